"""Inputs and models the rewrite must take as Keras does (issue 20, items 5-11): each
trains exactly like the plain model built with the same seed, or is refused with a
named error, or is left alone with the reason in the report."""
import numpy as np
import pytest
import tensorflow as tf

import picasso_tf as picasso
from picasso_tf.config import Config
from picasso_tf.errors import UnsupportedModelError

STEPS = 3


def train_both(build, batches, **options):
    """(baseline losses, picasso losses, baseline, wrapped) after training a model from
    build() and picasso.optimize(build()) on the same batches."""
    baseline, wrapped = build(), picasso.optimize(build(), **options)
    losses = []
    for model in (baseline, wrapped):
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.1), loss="binary_crossentropy")
        losses.append([float(model.train_on_batch(x, y)) for x, y in batches])
    return losses[0], losses[1], baseline, wrapped


def assert_trains_exactly(build, batches, **options):
    expected, got, baseline, wrapped = train_both(build, batches, **options)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    wrapped.picasso.write_back()
    for b, w in zip(baseline.weights, wrapped.original.weights):
        np.testing.assert_allclose(w.numpy(), b.numpy(), rtol=1e-5, atol=1e-7, err_msg=b.name)
    return wrapped


def left_alone(wrapped):
    return wrapped.picasso.reports["training"]["analysis"]["left_alone"]


def labels(n, seed=0):
    return (np.random.default_rng(seed).random(n) < 0.5).astype("float32")


# -- 5: NaN/inf in dense features -------------------------------------------------------
ACTIVATIONS = {"keras": lambda: tf.keras.layers.Activation("sigmoid"),
               "tf.nn": lambda: tf.keras.layers.Lambda(tf.nn.sigmoid),
               # Keras' binary crossentropy takes the logits Keras' softmax attached to its
               # output as sigmoid logits, whatever op made the output.
               "softmax": lambda: tf.keras.layers.Activation("softmax")}


def wide_deep(activation="keras"):
    """A small Wide & Deep whose output goes through ACTIVATIONS[activation]."""
    tf.keras.utils.set_random_seed(3)
    x = {"c": tf.keras.Input((), dtype="int64", name="c"), "d": tf.keras.Input((2,), name="d")}
    deep = tf.keras.layers.Concatenate()([tf.keras.layers.Embedding(20, 4)(x["c"]), x["d"]])
    deep = tf.keras.layers.Dense(1)(tf.keras.layers.Dense(4, activation="relu")(deep))
    wide = [tf.keras.layers.Embedding(20, 1)(x["c"]), tf.keras.layers.Dense(1, use_bias=False)(x["d"])]
    return tf.keras.Model(x, ACTIVATIONS[activation]()(tf.keras.layers.Add()([deep] + wide)))


def dense_batches(value, steps=STEPS):
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(steps):
        d = rng.random((16, 2)).astype("float32")
        d[3, 1] = value
        batches.append(({"c": rng.integers(0, 20, 16), "d": d}, labels(16)))
    return batches


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("value", [np.inf, 1e4], ids=["inf", "saturating"])
def test_extreme_dense_feature_trains_like_keras(value, activation):
    """Keras takes a sigmoid output's crossentropy from its logits (inf gives NaN, a
    saturated output a large finite loss), the ones Keras' activation attached to it or
    else the Sigmoid op's input; the rewritten model's output offers the same logits
    both ways, so its loss is never that of the clipped probability."""
    expected, got, _, _ = train_both(lambda: wide_deep(activation), dense_batches(value))
    assert np.isnan(expected[0]) == (value == np.inf)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_check_numerics_names_the_feature_and_leaves_state_untouched(monkeypatch):
    assert Config().check_numerics is False
    monkeypatch.setenv("PICASSO_CHECK_NUMERICS", "1")
    assert Config.from_options().check_numerics is True
    monkeypatch.delenv("PICASSO_CHECK_NUMERICS")
    model = picasso.optimize(wide_deep(), check_numerics=True)
    model.compile(optimizer=tf.keras.optimizers.Adagrad(0.1), loss="binary_crossentropy")
    (clean, y), = dense_batches(0.5, steps=1)
    model.train_on_batch(clean, y)
    before = [w.numpy() for w in model.original.weights]
    (bad, y), = dense_batches(np.nan, steps=1)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"float feature 'd' holds NaN or Inf.*NaN values"):
        model.train_on_batch(bad, y)
    for b, w in zip(before, model.original.weights):
        np.testing.assert_array_equal(w.numpy(), b, err_msg=w.name)


# -- 6, 7: ragged and sparse Keras inputs ------------------------------------------------
def ragged_model():
    tf.keras.utils.set_random_seed(3)
    x = tf.keras.Input((None,), ragged=True, dtype="int64", name="hist")
    pooled = tf.keras.layers.Lambda(lambda t: tf.reduce_mean(t, axis=1))(tf.keras.layers.Embedding(20, 4)(x))
    return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(pooled))


def test_ragged_input_trains_exactly():
    rng = np.random.default_rng(1)
    batches = [(tf.ragged.constant([rng.integers(0, 20, n).tolist() for n in rng.integers(1, 5, 8)], tf.int64),
                labels(8, i)) for i in range(STEPS)]
    wrapped = assert_trains_exactly(ragged_model, batches)
    assert len(wrapped.picasso.reports["training"]["analysis"]["sites"]) == 1


class SafeSparseLookup(tf.keras.layers.Layer):
    def build(self, shape):
        self.table = self.add_weight("table", (20, 4), initializer="uniform")

    def call(self, ids):
        return tf.nn.safe_embedding_lookup_sparse(self.table, ids, combiner="mean")


def sparse_model():
    tf.keras.utils.set_random_seed(3)
    x = tf.keras.Input((None,), sparse=True, dtype="int64", name="tags")
    return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(SafeSparseLookup()(x)))


def test_sparse_input_with_safe_embedding_lookup_sparse_trains_exactly():
    rng = np.random.default_rng(2)
    batches = []
    for i in range(STEPS):
        dense = rng.integers(0, 20, (8, 3)) * (rng.random((8, 3)) < 0.6)
        dense[0] = 0                       # an empty row: safe_embedding_lookup_sparse gives it zeros
        batches.append((tf.sparse.from_dense(tf.constant(dense, tf.int64)), labels(8, i)))
    wrapped = assert_trains_exactly(sparse_model, batches)
    assert len(wrapped.picasso.reports["training"]["analysis"]["sites"]) == 1


# -- 8, 9, 11: other ways to read a table ------------------------------------------------
class TableRead(tf.keras.layers.Layer):
    """Reads its table the way `kind` says: gather_nd, embedding_lookup with max_norm, or
    a one-hot product."""

    def __init__(self, kind, **kwargs):
        super().__init__(**kwargs)
        self.kind = kind

    def build(self, shape):
        # Rows of norm about 1, so that max_norm=0.3 clips them.
        self.table = self.add_weight("table", (20, 4), initializer=tf.keras.initializers.RandomUniform(-1, 1))

    def call(self, ids):
        if self.kind == "gather_nd":
            return tf.gather_nd(self.table, ids[:, :, None])[:, 0]
        if self.kind == "max_norm":
            return tf.nn.embedding_lookup(self.table, ids, max_norm=0.3)[:, 0]
        return tf.matmul(tf.one_hot(ids[:, 0], 20), self.table)


def table_read_model(kind):
    def build():
        tf.keras.utils.set_random_seed(3)
        x = tf.keras.Input((1,), dtype="int64", name="c")
        return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(TableRead(kind, name="read")(x)))
    return build


def id_batches():
    rng = np.random.default_rng(4)
    return [(rng.integers(0, 20, (8, 1)), labels(8, i)) for i in range(STEPS)]


def test_gather_nd_table_is_left_alone_with_the_reason_and_trains_exactly():
    wrapped = assert_trains_exactly(table_read_model("gather_nd"), id_batches())
    (entry,) = left_alone(wrapped)
    assert entry["table"] == "read/table" and "tf.gather_nd" in entry["reason"] and "tf.gather(" in entry["reason"]


def test_embedding_lookup_with_max_norm_trains_exactly():
    wrapped = assert_trains_exactly(table_read_model("max_norm"), id_batches())
    assert len(wrapped.picasso.reports["training"]["analysis"]["sites"]) == 1


def test_table_read_only_as_one_hot_product_is_reported_left_alone():
    wrapped = assert_trains_exactly(table_read_model("one_hot"), id_batches())
    (entry,) = left_alone(wrapped)
    assert entry["table"] == "read/table" and "one-hot" in entry["reason"], entry
    assert "left alone: read/table: read only whole" in wrapped.picasso.report()


# -- 10: a model without call ------------------------------------------------------------
class Retrieval(tf.keras.Model):
    """The TensorFlow Recommenders retrieval tutorial's shape: towers used only in train_step."""

    def __init__(self):
        super().__init__()
        self.user, self.item = tf.keras.layers.Embedding(20, 4), tf.keras.layers.Embedding(30, 4)

    def train_step(self, data):
        with tf.GradientTape() as tape:
            loss = -tf.reduce_mean(tf.reduce_sum(self.user(data["u"]) * self.item(data["i"]), -1))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
        return {"loss": loss}


def test_model_without_call_is_refused_with_a_named_error():
    features = {"u": np.array([1, 2, 3]), "i": np.array([4, 5, 6])}
    for example_inputs in (features, None):     # refused at optimize, signature or not
        with pytest.raises(UnsupportedModelError, match=r"Retrieval has no call\(\).*forward pass"):
            picasso.optimize(Retrieval(), example_inputs=example_inputs)


@pytest.mark.parametrize("name, text, value", [
    ("micro_batches", "auto", "auto"), ("micro_batches", "4", 4), ("dynamic_vocabulary", "city,user", ("city", "user")),
    ("dynamic_vocabulary", "true", True), ("interleave_excluded", "none", ()), ("interleave_excluded", "auto", "auto"),
    ("vocabulary_capacity", "none", None), ("vocabulary_capacity", "100", 100), ("hot_tier_device", "none", None),
    ("projection_max_distinct", "0.5", 0.5), ("packing", "off", False)])
def test_every_option_takes_its_environment_override(monkeypatch, name, text, value):
    monkeypatch.setenv(f"PICASSO_{name.upper()}", text)
    assert getattr(Config.from_options(), name) == value


def test_an_environment_override_of_the_wrong_kind_names_the_variable(monkeypatch):
    monkeypatch.setenv("PICASSO_MAX_SHARDS", "many")
    with pytest.raises(ValueError, match=r"PICASSO_MAX_SHARDS='many': expected int"):
        Config.from_options()
