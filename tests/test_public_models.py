"""Models written by others: DeepCTR (a public Keras CTR library) is recognised from
graph structure alone and trains exactly like the original under the decorator.

DeepCTR names, nests and regularizes its embeddings its own way (an l2 regularizer on
every table, so each table is also read whole), and pools behaviour sequences with
its own masked layers.
"""
import numpy as np
import pytest
import tensorflow as tf

import picasso_tf as picasso

deepctr_models = pytest.importorskip("deepctr.models")
from deepctr.feature_column import DenseFeat, SparseFeat, VarLenSparseFeat  # noqa: E402

BATCH, STEPS = 32, 20


def deepfm():
    features = [SparseFeat(f"c{i}", 40 + i, embedding_dim=8) for i in range(5)] + [DenseFeat("d0", 1)]
    return deepctr_models.DeepFM(features, features, dnn_hidden_units=(16, 8), seed=1)


def din():
    features = [SparseFeat("user", 30, embedding_dim=8), SparseFeat("item", 50, embedding_dim=8),
                VarLenSparseFeat(SparseFeat("hist_item", 50, embedding_dim=8, embedding_name="item"),
                                 maxlen=4)]
    return deepctr_models.DIN(features, ["item"], dnn_hidden_units=(16, 8), att_hidden_size=(8, 4), seed=1)


def deepfm_with_sequence():
    """DeepFM with a multi-valued feature, which DeepCTR pools with its SequencePoolingLayer
    (a mask tiled to the embedding's width): its deep lookup pools the sequence."""
    features = [SparseFeat(f"c{i}", 40 + i, embedding_dim=8) for i in range(3)] + [
        VarLenSparseFeat(SparseFeat("genres", 40, embedding_dim=8), maxlen=5, combiner="mean")]
    return deepctr_models.DeepFM(features, features, dnn_hidden_units=(16, 8), seed=1)


def data(model, steps=STEPS):
    rng = np.random.default_rng(0)
    n = BATCH * steps
    features = {}
    for tensor in model.inputs:
        name = tensor.name.split(":")[0]
        if tensor.dtype.is_floating:
            features[name] = rng.random((n,) + tuple(tensor.shape[1:])).astype("float32")
        else:
            ids = rng.integers(1, 30, (n,) + tuple(tensor.shape[1:]))
            if len(tensor.shape) > 1 and tensor.shape[1] > 1:
                ids[:, 2:] *= rng.random((n, tensor.shape[1] - 2)) < 0.5   # padding in sequences
            features[name] = ids
    return features, (rng.random(n) < 0.3).astype("float32")


@pytest.mark.parametrize("builder", [deepfm, din, deepfm_with_sequence], ids=["deepfm", "din", "deepfm_sequence"])
def test_deepctr_model_is_recognised_and_trains_exactly(builder):
    baseline = builder()
    original = builder()
    original.set_weights(baseline.get_weights())
    optimized = picasso.optimize(original)
    analysis = optimized.picasso.reports["training"]["analysis"]
    assert analysis["sites"] and not analysis["left_alone"], optimized.picasso.report()
    [k_packing] = [p for p in optimized.picasso.reports["training"]["passes"] if p["pass"] == "k_packing"]
    # The sequence's deep lookup (dim 8) pools; its linear one (dim 1) does not pay.
    assert k_packing["sequences_pooled"] == (["genres"] if builder is deepfm_with_sequence else [])
    features, labels = data(baseline)
    losses = {}
    for name, model in (("baseline", baseline), ("picasso", optimized)):
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.1), loss="binary_crossentropy")
        losses[name] = [model.train_on_batch({k: v[i * BATCH:(i + 1) * BATCH] for k, v in features.items()},
                                             labels[i * BATCH:(i + 1) * BATCH]) for i in range(STEPS)]
    np.testing.assert_allclose(losses["picasso"], losses["baseline"], rtol=1e-5, atol=1e-5)
    optimized.picasso.write_back()
    for b, o in zip(baseline.weights, optimized.original.weights):
        np.testing.assert_allclose(o.numpy(), b.numpy(), rtol=1e-4, atol=1e-5, err_msg=b.name)


def test_deepctr_hashed_features_stay_bins_under_dynamic_vocabulary_and_say_why():
    """DeepCTR's use_hash=True hashes ids right before its embeddings, but regularises
    every table (read whole): dynamic_vocabulary leaves them, with the reason, and the
    model trains exactly as without it."""
    def hashed_deepfm():
        features = [SparseFeat(f"c{i}", 20, embedding_dim=8, use_hash=True, dtype="int64") for i in range(3)]
        return deepctr_models.DeepFM(features, features, dnn_hidden_units=(8,), seed=1)
    baseline, original = hashed_deepfm(), hashed_deepfm()
    original.set_weights(baseline.get_weights())
    optimized = picasso.optimize(original, dynamic_vocabulary=True)
    dynamic = next(p for p in optimized.picasso.reports["training"]["passes"] if p["pass"] == "dynamic_vocabulary")
    assert not dynamic["changed"] and dynamic["left_alone"]
    assert all("read whole by the model" in why for why in dynamic["left_alone"].values())
    rng = np.random.default_rng(0)
    features = {f"c{i}": rng.integers(0, 10**9, (BATCH * 5, 1)) for i in range(3)}
    labels = (rng.random(BATCH * 5) < 0.3).astype("float32")
    losses = {}
    for name, model in (("baseline", baseline), ("picasso", optimized)):
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.1), loss="binary_crossentropy")
        losses[name] = [model.train_on_batch({k: v[i * BATCH:(i + 1) * BATCH] for k, v in features.items()},
                                             labels[i * BATCH:(i + 1) * BATCH]) for i in range(5)]
    np.testing.assert_allclose(losses["picasso"], losses["baseline"], rtol=1e-5, atol=1e-5)
