"""Models written by others: DeepCTR (a public Keras CTR library) and tf.feature_column
models are recognised from graph structure alone and trains exactly like the original under the decorator.

DeepCTR names, nests and regularizes its embeddings its own way (an l2 regularizer on
every table, so each table is also read whole), and pools behaviour sequences with
its own masked layers. TensorFlow's feature columns (read by Keras' DenseFeatures) turn
dense inputs into SparseTensors and look them up with safe_embedding_lookup_sparse.
"""
import numpy as np
import pytest
import tensorflow as tf

import picasso_tf as picasso
from exactness import assert_train_alike

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


def mlr():
    """MLR: four region and four learner linear parts, each with a width-1 table per feature,
    all read with that feature's ids, and each concatenating its features' rows."""
    features = [SparseFeat(f"c{i}", 40 + i, embedding_dim=4) for i in range(4)] + [DenseFeat("d0", 1)]
    return deepctr_models.MLR(features, seed=1)


def onn():
    """ONN: every feature has a copy of its table per other field, read with its ids and
    multiplied with the other field's copy of that feature."""
    features = [SparseFeat(f"c{i}", 40 + i, embedding_dim=4) for i in range(4)] + [DenseFeat("d0", 1)]
    return deepctr_models.ONN(features, features, dnn_hidden_units=(16, 8), seed=1)


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


@pytest.mark.parametrize("builder", [deepfm, din, deepfm_with_sequence, mlr, onn],
                         ids=["deepfm", "din", "deepfm_sequence", "mlr", "onn"])
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
    # Per feature, MLR's eight tables are looked up as one; ONN's three (one per other field)
    # stay apart, their rows used one by one, and the report says why.
    assert [len(s["tables"]) for s in k_packing["stacked"]] == ([8] * 4 if builder is mlr else []), k_packing
    apart = [len(s["tables"]) for s in k_packing["stacks_apart"] if "not concatenated" in s["reason"]]
    assert apart == ([3] * 4 if builder is onn else []), k_packing
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


def feature_column_wide_and_deep():
    """The classic TensorFlow wide-and-deep: tf.feature_column columns read by Keras'
    DenseFeatures (identity, string vocabulary list with out-of-vocabulary values,
    hash buckets on a one-hot feature with missing values (-1) and on a padded multi-hot
    one, a crossed column, an indicator and a width-1 linear part), as tf.estimator
    users brought them to Keras."""
    fc = tf.feature_column
    user, item = fc.categorical_column_with_identity("user", 50), fc.categorical_column_with_identity("item", 50)
    genre = fc.categorical_column_with_vocabulary_list("genre", ["a", "b", "c", "d"])
    tags = fc.categorical_column_with_hash_bucket("tags", 40, dtype=tf.int64)
    zip_code = fc.categorical_column_with_hash_bucket("zip", 30, dtype=tf.int64)
    deep = [fc.embedding_column(user, 8), fc.embedding_column(item, 8), fc.embedding_column(genre, 4),
            fc.embedding_column(zip_code, 4),
            fc.embedding_column(tags, 4, combiner="mean"), fc.embedding_column(fc.crossed_column([user, "genre"], 100), 4),
            fc.numeric_column("price")]
    wide = [fc.indicator_column(genre), fc.embedding_column(tags, 1, combiner="sum")]
    x = {"user": tf.keras.Input((1,), dtype="int64", name="user"),
         "item": tf.keras.Input((1,), dtype="int64", name="item"),
         "genre": tf.keras.Input((1,), dtype="string", name="genre"),
         "tags": tf.keras.Input((5,), dtype="int64", name="tags"),
         "zip": tf.keras.Input((1,), dtype="int64", name="zip"), "price": tf.keras.Input((1,), name="price")}
    hidden = tf.keras.layers.Dense(8, activation="relu")(tf.keras.layers.DenseFeatures(deep)(x))
    both = tf.keras.layers.Concatenate()([hidden, tf.keras.layers.DenseFeatures(wide)(x)])
    return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(both))


def feature_column_data(n):
    rng = np.random.default_rng(0)
    tags = rng.integers(0, 1000, (n, 5))
    tags[rng.random((n, 5)) < 0.3] = -1          # the columns' padding: dropped
    tags[:BATCH // 2] = -1                       # rows with no tag at all
    features = {"user": rng.integers(0, 50, (n, 1)), "item": rng.integers(0, 50, (n, 1)),
                "genre": rng.choice(np.array(["a", "b", "c", "d", "unknown"]), (n, 1)), "tags": tags,
                "zip": np.where(rng.random((n, 1)) < 0.2, -1, rng.integers(10_000, 99_999, (n, 1))),
                "price": rng.random((n, 1)).astype("float32")}
    return features, (rng.random(n) < 0.4).astype("float32")


def keras_preprocessing_model():
    """Keras' preprocessing layers in the model, feeding Keras Embeddings: a string and an
    integer vocabulary lookup (out-of-vocabulary ids), a masked multi-valued string
    feature (averaged, and multi-hot encoded), a discretised float and a hashed cross."""
    layers = tf.keras.layers
    x = {"city": tf.keras.Input((1,), dtype="string", name="city"),
         "user": tf.keras.Input((1,), dtype="int64", name="user"),
         "genres": tf.keras.Input((4,), dtype="string", name="genres"), "age": tf.keras.Input((1,), name="age")}
    city = layers.StringLookup(vocabulary=["paris", "rome", "oslo"], num_oov_indices=2)(x["city"])
    user = layers.IntegerLookup(vocabulary=list(range(100, 140)), mask_token=None)(x["user"])
    genres = layers.StringLookup(vocabulary=["a", "b", "c", "d", "e"], mask_token="")(x["genres"])
    age = layers.Discretization(bin_boundaries=[0.2, 0.4, 0.6, 0.8])(x["age"])
    cross = layers.HashedCrossing(num_bins=64)((x["city"], x["user"]))
    parts = [layers.Flatten()(layers.Embedding(6, 8)(city)), layers.Flatten()(layers.Embedding(42, 8)(user)),
             layers.GlobalAveragePooling1D()(layers.Embedding(7, 8, mask_zero=True)(genres)),
             layers.Flatten()(layers.Embedding(5, 8)(age)), layers.Flatten()(layers.Embedding(64, 8)(cross)),
             layers.CategoryEncoding(num_tokens=7, output_mode="multi_hot")(genres)]
    hidden = layers.Dense(8, activation="relu")(layers.Concatenate()(parts))
    return tf.keras.Model(x, layers.Dense(1, activation="sigmoid")(hidden))


def keras_preprocessing_data(n):
    rng = np.random.default_rng(0)
    features = {"city": rng.choice(np.array(["paris", "rome", "oslo", "nyc"]), (n, 1)),
                "user": rng.integers(95, 145, (n, 1)),
                "genres": rng.choice(np.array(["a", "b", "c", "d", "e", "", "unknown"]), (n, 4)),
                "age": rng.random((n, 1)).astype("float32")}
    return features, (rng.random(n) < 0.4).astype("float32")


@pytest.mark.parametrize("model_and_data", [(feature_column_wide_and_deep, feature_column_data, 7),
                                            (keras_preprocessing_model, keras_preprocessing_data, 5)],
                         ids=["feature_columns", "keras_preprocessing"])
@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_tensorflow_s_own_feature_preprocessing_is_recognised_and_trains_exactly(model_and_data, optimizer):
    builder, make_data, tables = model_and_data
    tf.keras.utils.set_random_seed(1)
    baseline, original = builder(), builder()
    original.set_weights(baseline.get_weights())
    optimized = picasso.optimize(original)
    analysis = optimized.picasso.reports["training"]["analysis"]
    # Every table is looked up by a fused kernel (an indicator column and a multi-hot encoding have none).
    assert len(analysis["sites"]) == tables and not analysis["left_alone"], optimized.picasso.report()
    if builder is feature_column_wide_and_deep:
        # The one-hot columns' ids are read as they are (hashed or looked up in the vocabulary first).
        [k_packing] = [p for p in optimized.picasso.reports["training"]["passes"] if p["pass"] == "k_packing"]
        assert sorted(k_packing["sparse_one_hot_read_as_ids"]) == ["genre", "item", "user", "zip"]
    assert_train_alike(baseline, optimized, *make_data(BATCH * 10), optimizer, BATCH, 10)


def test_feature_columns_padded_multi_hot_ids_are_read_as_ids_given_warm_up_data_and_train_exactly():
    """The hashed multi-hot column (5 padded ids, about 60% of them kept: the columns drop
    -1) is read as ids too once the warm-up data shows it filled: hashed at every
    position, the dropped ones weighted 0."""
    tf.keras.utils.set_random_seed(1)
    baseline, original = feature_column_wide_and_deep(), feature_column_wide_and_deep()
    original.set_weights(baseline.get_weights())
    features, labels = feature_column_data(BATCH * 10)
    warmup = tf.data.Dataset.from_tensor_slices((features, labels)).batch(BATCH)
    optimized = picasso.optimize(original, warmup_data=warmup)
    [k_packing] = [p for p in optimized.picasso.reports["training"]["passes"] if p["pass"] == "k_packing"]
    assert sorted(k_packing["sparse_one_hot_read_as_ids"]) == ["genre", "item", "tags", "tags", "user", "zip"]
    assert_train_alike(baseline, optimized, features, labels, "adagrad", BATCH, 10)


def test_an_id_outside_a_feature_column_s_buckets_fails_the_step_naming_the_feature():
    """The plain model fails the step in its gather; the fused lookup names the feature
    the ids came from, through the columns' conversion of the input to a SparseTensor."""
    features, labels = feature_column_data(BATCH)
    features["user"][3] = 50
    for model in (feature_column_wide_and_deep(), picasso.optimize(feature_column_wide_and_deep())):
        model.compile(optimizer="adagrad", loss="binary_crossentropy")
        with pytest.raises(tf.errors.InvalidArgumentError) as refused:
            model.train_on_batch(features, labels)
    assert "ids of feature 'user' must lie in [0, 50): got 50" in refused.value.message
