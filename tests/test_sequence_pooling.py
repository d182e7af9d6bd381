"""Sequence pooling folded into the fused lookup (picasso_tf/passes/sequence_pooling.py):
a [B, L] lookup that the model only sums or averages over L trains as in Keras, and
the report names each sequence it pooled."""
import numpy as np
import pytest
import tensorflow as tf

import picasso_tf
from models.blocks import MaskedPooling

LENGTH, VOCAB, DIM = 6, 50, 4


class PositionWeights(tf.keras.layers.Layer):
    """A trained weight per position, [1, L, 1]: broadcast over the batch."""

    def build(self, input_shape):
        self.w = self.add_weight("w", (1, LENGTH, 1), initializer="ones")

    def call(self, seq):
        return tf.reduce_sum(seq * self.w, 1)


def _pool(kind, seq, ids, item_emb):
    """The sequence's pooled [B, DIM] (or what the model makes of it), as models write it."""
    if kind == "zoo_masked_mean":           # the zoo's MaskedPooling: divide_no_nan by the mask's sum
        return MaskedPooling("mean")([seq, ids])
    if kind == "keras_global_average":      # Keras' own layer on Embedding(mask_zero=True)'s mask
        return tf.keras.layers.GlobalAveragePooling1D()(seq)
    if kind in ("sum", "sum_of_unknown_length"):
        return tf.reduce_sum(seq, 1)
    if kind in ("mean", "mean_of_unknown_length"):   # unknown length: TF's mean of nothing is NaN, left alone
        return tf.reduce_mean(seq, axis=-2)
    if kind == "positional_weights":
        return PositionWeights()(seq)
    if kind == "weight_per_example_mean":   # one weight per example: its sum over L is not L weights'
        weight = tf.expand_dims(tf.keras.layers.Dense(1, activation="sigmoid")(
            tf.cast(ids[:, :1], tf.float32) / VOCAB), 1)
        return tf.math.divide_no_nan(tf.reduce_sum(seq * weight, 1), tf.reduce_sum(weight, 1))
    if kind == "weights_from_a_lookup":     # attention-like scores from the item's embedding: left alone
        weight = tf.expand_dims(tf.keras.layers.Dense(LENGTH, activation="sigmoid")(item_emb), -1)
        return tf.reduce_sum(seq * weight, 1)
    mask = tf.expand_dims(tf.cast(tf.not_equal(ids, 0), tf.float32), -1)
    if kind == "mean_of_at_least_one":      # the zoo's MMoE: the division stays
        return tf.reduce_sum(seq * mask, 1) / tf.maximum(tf.reduce_sum(mask, 1), 1.0)
    if kind == "trained_weights":           # weights from a Dense: they get their gradient
        weights = tf.keras.layers.Dense(1, activation="sigmoid", name="position_weight")(
            tf.cast(tf.expand_dims(ids, -1), tf.float32) / VOCAB)
        return tf.reduce_sum(weights * seq, 1)
    if kind == "over_the_dimension":        # not a sequence pooling: left as it is
        return tf.reduce_sum(seq, 2)
    if kind == "keep_dims":
        return tf.keras.layers.Flatten()(tf.reduce_sum(seq, 1, keepdims=True))
    if kind == "rows_read_twice":           # the rows also go elsewhere: left as they are
        return tf.concat([tf.reduce_sum(seq, 1), tf.keras.layers.Flatten()(seq)], 1)
    raise ValueError(kind)


def _model(kind):
    ids = tf.keras.Input((None if kind.endswith("unknown_length") else LENGTH,), dtype=tf.int64, name="history")
    item = tf.keras.Input((1,), dtype=tf.int64, name="item")
    seq = tf.keras.layers.Embedding(VOCAB, DIM, mask_zero=kind == "keras_global_average", name="history_emb")(ids)
    item_emb = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(VOCAB, DIM, name="item_emb")(item))
    x = tf.keras.layers.Concatenate()([_pool(kind, seq, ids, item_emb), item_emb])
    hidden = tf.keras.layers.Dense(8, activation="relu")(x)
    return tf.keras.Model([ids, item], tf.keras.layers.Dense(1, activation="sigmoid")(hidden))


def _data(seed=0):
    rng = np.random.default_rng(seed)
    history = rng.integers(1, VOCAB, (64, LENGTH)) * (rng.random((64, LENGTH)) < 0.6)
    history[:, 0] = rng.integers(1, VOCAB, 64)   # Keras' average divides by the mask's sum as it is
    history[-4:, 1:] = 0
    return [history, rng.integers(0, VOCAB, (64, 1))], (rng.random((64, 1)) < 0.5).astype(np.float32)


def _train(model, optimizer, steps=6):
    model.compile(optimizer, "binary_crossentropy")
    x, y = _data()
    losses = [float(np.asarray(model.train_on_batch(x, y)).reshape(-1)[0]) for _ in range(steps)]
    return losses, [v.numpy() for v in model.weights]


def _pooled(model):
    [k_packing] = [p for p in model.picasso.reports["training"]["passes"] if p["pass"] == "k_packing"]
    return k_packing["sequences_pooled"]


POOLED = ["zoo_masked_mean", "keras_global_average", "sum", "mean", "mean_of_at_least_one", "trained_weights",
          "positional_weights", "weight_per_example_mean", "sum_of_unknown_length"]
NOT_POOLED = ["over_the_dimension", "keep_dims", "rows_read_twice", "mean_of_unknown_length",
              "weights_from_a_lookup"]
# Pooled with weights that train (or come from variables): their gradient reads the
# table, so its gradient kernel cannot update it in place.
WEIGHTS_TRAIN = ["trained_weights", "positional_weights", "weight_per_example_mean"]


@pytest.mark.parametrize("kind,optimizer", [(k, "adagrad") for k in POOLED + NOT_POOLED] + [
    ("zoo_masked_mean", "sgd"), ("zoo_masked_mean", "adam"), ("trained_weights", "adam")])
def test_trains_as_keras_and_pools_only_sequence_reductions(kind, optimizer):
    tf.keras.utils.set_random_seed(3)
    expected_losses, expected_weights = _train(_model(kind), optimizer)
    tf.keras.utils.set_random_seed(3)
    optimized = picasso_tf.optimize(_model(kind))
    initial = [v.numpy() for v in optimized.weights]
    losses, weights = _train(optimized, optimizer)
    assert _pooled(optimized) == (["history"] if kind in POOLED else [])
    # A mask made from the ids needs no gradient: the table is updated in its gradient kernel.
    if optimizer != "adam":
        in_kernel = "history_emb/embeddings:0" in optimized.picasso.updated_in_gradient
        assert in_kernel == (kind not in WEIGHTS_TRAIN), optimized.picasso.updated_in_gradient
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5, atol=1e-6)
    for got, want, start in zip(weights, expected_weights, initial):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        # The same variables train (a Dense giving weights too), and the others stay.
        assert np.array_equal(got, start) == np.array_equal(want, start)


def test_switched_off_and_masked_sequence_keeps_its_projection():
    off = picasso_tf.optimize(_model("zoo_masked_mean"), sequence_pooling=False)
    assert _pooled(off) == []
    on = picasso_tf.optimize(_model("zoo_masked_mean"))
    [k_packing] = [p for p in on.picasso.reports["training"]["passes"] if p["pass"] == "k_packing"]
    # The projection kernels take no weights: the masked sequence is copied into the
    # concatenation, whose product with the Dense is still computed from the rows.
    [stitch] = k_packing["stitched"]
    assert stitch["projection"] and stitch["copied_inputs"] == 1


def test_rows_the_model_also_returns_are_left_alone():
    ids = tf.keras.Input((LENGTH,), dtype=tf.int64, name="history")
    seq = tf.keras.layers.Embedding(VOCAB, DIM, name="history_emb")(ids)
    model = tf.keras.Model(ids, [tf.keras.layers.Dense(1)(tf.reduce_sum(seq, 1)), tf.keras.layers.Activation(None)(seq)])
    optimized = picasso_tf.optimize(model)
    assert _pooled(optimized) == []
    history = _data()[0][0]
    for got, want in zip(optimized.predict(history, verbose=0), model.predict(history, verbose=0)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_weights_of_another_shape_at_run_time_are_an_error_naming_the_feature():
    """Weights whose shape is not static: broadcast as the Mul would where it can be,
    and an error naming the feature where the Mul would broadcast the rows instead."""
    ids = tf.keras.Input((None,), dtype=tf.int64, name="history")
    weights = tf.keras.Input((None, 1), name="weights")
    seq = tf.keras.layers.Embedding(VOCAB, DIM, name="history_emb")(ids)
    model = tf.keras.Model([ids, weights], tf.reduce_sum(seq * weights, 1))
    optimized = picasso_tf.optimize(model)
    assert _pooled(optimized) == ["history"]
    history = np.arange(1, 25).reshape(4, 6)
    per_example = np.linspace(0.5, 2, 4, dtype=np.float32).reshape(4, 1, 1)
    np.testing.assert_allclose(optimized([history, per_example]), model([history, per_example]), rtol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError):
        # [3, 1] ids times [1, 3, 1] weights: Keras' product broadcasts the rows to [3, 3, D].
        optimized([history[:3, :1], np.ones((1, 3, 1), np.float32)])


def test_rows_of_width_one_stay_unpooled_and_say_why():
    """A logistic regression's sequence (rows of width 1): TensorFlow's own product and
    sum beat the kernel's loop there, so the pass stands down and the report says why."""
    ids = tf.keras.Input((LENGTH,), dtype=tf.int64, name="history")
    weights = tf.keras.layers.Embedding(VOCAB, 1, name="history_weight")(ids)
    mask = tf.expand_dims(tf.cast(tf.not_equal(ids, 0), tf.float32), -1)
    optimized = picasso_tf.optimize(tf.keras.Model(ids, tf.sigmoid(tf.reduce_sum(weights * mask, 1))))
    [k_packing] = [p for p in optimized.picasso.reports["training"]["passes"] if p["pass"] == "k_packing"]
    assert k_packing["sequences_pooled"] == []
    assert "width 1" in k_packing["sequences_not_pooled"]["history"]
