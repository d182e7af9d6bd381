"""picasso_tf.optimize: the rewritten model trains exactly like the original.

Models here are written the many ways users write them (Keras Embedding, raw
tf.nn lookups on add_weight variables, sparse and ragged multi-hot, masks and pooling,
shared tables, nested Sequential blocks), since the analysis must work from graph
structure alone.
"""
import gc

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

import picasso_tf as picasso

BATCH, STEPS = 32, 20
VOCAB = {"user": 50, "item": 80, "cat": 12}
SEQ_LEN, TAGS = 6, 4


def make_data(seed=0, n=BATCH * STEPS):
    rng = np.random.default_rng(seed)
    hist = rng.integers(1, VOCAB["item"], (n, SEQ_LEN))
    hist[:, 1:][rng.random((n, SEQ_LEN - 1)) < 0.4] = 0   # padding holes; every row keeps one id
    tags = rng.integers(1, VOCAB["item"], (n, TAGS))
    tags[rng.random((n, TAGS)) < 0.5] = 0
    tags[: n // 10] = 0                                   # empty rows: safe_embedding_lookup_sparse
    features = {
        "user": rng.integers(0, VOCAB["user"], n),
        "item": rng.integers(0, VOCAB["item"], n),
        "cat": rng.integers(0, VOCAB["cat"], n),
        "hist": hist,
        "tags": tags,
        "price": rng.random(n).astype("float32"),
    }
    labels = (rng.random(n) < 0.4).astype("float32")
    return features, labels


def inputs():
    return {"user": tf.keras.Input((), dtype="int64", name="user"),
            "item": tf.keras.Input((), dtype="int64", name="item"),
            "cat": tf.keras.Input((), dtype="int64", name="cat"),
            "hist": tf.keras.Input((SEQ_LEN,), dtype="int64", name="hist"),
            "tags": tf.keras.Input((TAGS,), dtype="int64", name="tags"),
            "price": tf.keras.Input((), dtype="float32", name="price")}


def head(parts, price):
    x = tf.keras.layers.Concatenate()(parts + [tf.keras.layers.Reshape((1,))(price)])
    x = tf.keras.layers.Dense(8, activation="relu")(x)
    return tf.keras.layers.Dense(1, activation="sigmoid")(x)


def functional_keras_embeddings():
    """Keras Embeddings, a table shared by the item and its history (masked mean
    pooling), and an Embedding inside a nested Sequential block."""
    x = inputs()
    item_table = tf.keras.layers.Embedding(VOCAB["item"], 8, mask_zero=True, name="item_table")
    user = tf.keras.layers.Embedding(VOCAB["user"], 8, name="user_emb")(x["user"])
    item = item_table(x["item"])
    hist = tf.keras.layers.GlobalAveragePooling1D()(item_table(x["hist"]))
    cat_block = tf.keras.Sequential([tf.keras.layers.Embedding(VOCAB["cat"], 4), tf.keras.layers.Flatten()],
                                    name="cat_block")
    cat = cat_block(tf.keras.layers.Reshape((1,))(x["cat"]))
    return tf.keras.Model(x, head([user, item, hist, cat], x["price"]))


class LookupLayer(tf.keras.layers.Layer):
    """A custom layer holding its own table and calling tf.nn.embedding_lookup."""

    def __init__(self, vocab, dim, **kwargs):
        super().__init__(**kwargs)
        self.vocab, self.dim = vocab, dim

    def build(self, shape):
        self.weights_table = self.add_weight("w", (self.vocab, self.dim), initializer="glorot_uniform")

    def call(self, ids):
        return tf.nn.embedding_lookup(self.weights_table, ids)

    def get_config(self):
        return {**super().get_config(), "vocab": self.vocab, "dim": self.dim}


class SubclassedModel(tf.keras.Model):
    def __init__(self):
        super().__init__()
        self.user = LookupLayer(VOCAB["user"], 8)
        self.item = LookupLayer(VOCAB["item"], 16)
        self.cat = LookupLayer(VOCAB["cat"], 8)
        self.hidden = tf.keras.layers.Dense(8, activation="relu")
        self.out = tf.keras.layers.Dense(1, activation="sigmoid")

    def call(self, x):
        hist = self.item(x["hist"])                               # [B, L, 16]
        mask = tf.cast(tf.not_equal(x["hist"], 0), tf.float32)[..., None]
        pooled = tf.reduce_sum(hist * mask, axis=1)               # masked sum pooling
        parts = [self.user(x["user"]), self.item(x["item"]), self.cat(x["cat"]), pooled, x["price"][:, None]]
        return self.out(self.hidden(tf.concat(parts, axis=1)))


class SparseMultiHot(tf.keras.layers.Layer):
    """safe_embedding_lookup_sparse with and without weights, on padded ids."""

    def build(self, shape):
        self.table = self.add_weight("table", (VOCAB["item"], 8), initializer="glorot_uniform")
        self.cat_table = self.add_weight("cat_table", (VOCAB["cat"] + 1, 8), initializer="glorot_uniform")

    def call(self, x):
        ids = tf.sparse.from_dense(x["tags"])
        weights = tf.SparseTensor(ids.indices, tf.cast(ids.values % 3 + 1, tf.float32) / 2.0, ids.dense_shape)
        weighted = tf.nn.safe_embedding_lookup_sparse(self.table, ids, weights, combiner="mean")
        plain = tf.nn.safe_embedding_lookup_sparse(self.table, ids, None, combiner="sqrtn")
        cat = tf.nn.embedding_lookup_sparse(self.cat_table, tf.sparse.from_dense(x["cat"][:, None] + 1), None,
                                            combiner="sum")
        return tf.concat([weighted, plain, cat], axis=1)


def sparse_multi_hot():
    x = inputs()
    user = tf.keras.layers.Embedding(VOCAB["user"], 8)(x["user"])
    return tf.keras.Model(x, head([user, SparseMultiHot()(x)], x["price"]))


class RaggedPooling(tf.keras.layers.Layer):
    def build(self, shape):
        self.table = self.add_weight("table", (VOCAB["item"], 8), initializer="glorot_uniform")

    def call(self, hist):
        ragged = tf.RaggedTensor.from_tensor(hist, padding=0)
        rows = tf.nn.embedding_lookup(self.table, ragged)
        return tf.concat([tf.reduce_sum(rows, axis=1), tf.reduce_mean(rows, axis=1)], axis=1)


def ragged_pooled():
    x = inputs()
    user = tf.keras.layers.Embedding(VOCAB["user"], 8)(x["user"])
    return tf.keras.Model(x, head([user, RaggedPooling()(x["hist"])], x["price"]))


class PartitionedLookup(tf.keras.layers.Layer):
    """tf.nn.embedding_lookup over a list of variables (a partitioned table)."""

    def build(self, shape):
        self.parts = [self.add_weight(f"part{i}", (VOCAB["item"] // 4, 8)) for i in range(4)]

    def call(self, ids):
        return tf.nn.embedding_lookup(self.parts, ids)


def partitioned_and_sequential():
    x = inputs()
    item = PartitionedLookup()(x["item"])
    user = tf.keras.Sequential([tf.keras.layers.Embedding(VOCAB["user"], 8), tf.keras.layers.Flatten()],
                               name="user_block")(x["user"][:, None])
    return tf.keras.Model(x, head([item, user], x["price"]))


class DenseUseOfTable(tf.keras.layers.Layer):
    """A table looked up and also used whole (one_hot @ table): packed, and the whole-
    table use reads its rows of the packed table."""

    def build(self, shape):
        self.table = self.add_weight("dense_table", (VOCAB["cat"], 4), initializer="glorot_uniform")

    def call(self, cat):
        dense = tf.matmul(tf.one_hot(cat, VOCAB["cat"]), self.table)
        return dense + tf.gather(self.table, cat)


class MaxNormLookup(tf.keras.layers.Layer):
    """Renormalises its table in the forward pass (a stateful use of the table that
    picasso_tf does not rewrite), then looks it up."""

    def build(self, shape):
        self.table = self.add_weight("maxnorm_table", (VOCAB["cat"], 4), initializer="glorot_uniform")

    def call(self, cat):
        self.table.assign(tf.clip_by_norm(self.table, 0.5, axes=[1]))
        return tf.gather(self.table, cat)


def regularized_and_dense_use():
    x = inputs()
    user = tf.keras.layers.Embedding(VOCAB["user"], 8, embeddings_regularizer=tf.keras.regularizers.l2(0.01))
    item = tf.keras.layers.Embedding(VOCAB["item"], 8)
    return tf.keras.Model(x, head([user(x["user"]), item(x["item"]), DenseUseOfTable()(x["cat"])], x["price"]))


def unrecognised_pattern():
    x = inputs()
    user = tf.keras.layers.Embedding(VOCAB["user"], 8)(x["user"])
    return tf.keras.Model(x, head([user, MaxNormLookup()(x["cat"])], x["price"]))


MODELS = {"functional": functional_keras_embeddings, "subclassed": SubclassedModel,
          "sparse_multi_hot": sparse_multi_hot, "ragged": ragged_pooled,
          "regularized_and_dense_use": regularized_and_dense_use, "partitioned": partitioned_and_sequential}
OPTIMIZERS = {"sgd": lambda: tf.keras.optimizers.SGD(0.5), "adagrad": lambda: tf.keras.optimizers.Adagrad(0.3)}


def build_pair(builder, **options):
    """The same model twice with the same initial weights: baseline and optimized."""
    features, _ = make_data()
    tf.keras.utils.set_random_seed(7)
    baseline = builder()
    tf.keras.utils.set_random_seed(7)
    original = builder()
    example = {k: v[:2] for k, v in features.items()}
    baseline(example)
    original(example)
    original.set_weights(baseline.get_weights())
    return baseline, picasso.optimize(original, example_inputs=example, **options)


def train(model, optimizer, steps=STEPS):
    features, labels = make_data()
    model.compile(optimizer=optimizer, loss="binary_crossentropy")
    losses = []
    for i in range(steps):
        sl = slice(i * BATCH, (i + 1) * BATCH)
        losses.append(model.train_on_batch({k: v[sl] for k, v in features.items()}, labels[sl]))
    return np.array(losses)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_rewritten_model_trains_exactly_like_the_original(name, optimizer):
    baseline, optimized = build_pair(MODELS[name])
    report = optimized.picasso.reports["training"]
    assert report["analysis"]["sites"], "no embedding site recognised"
    assert not report["analysis"]["left_alone"], report["analysis"]["left_alone"]
    assert optimized.picasso.storages, "nothing was packed"
    base_losses = train(baseline, OPTIMIZERS[optimizer]())
    opt_losses = train(optimized, OPTIMIZERS[optimizer]())
    np.testing.assert_allclose(opt_losses, base_losses, rtol=1e-5, atol=1e-5)
    optimized.picasso.write_back()
    for b, o in zip(baseline.weights, optimized.original.weights):
        np.testing.assert_allclose(o.numpy(), b.numpy(), rtol=1e-5, atol=1e-5, err_msg=b.name)


def table_shaped_tensors(model, optimizer):
    """Ops in the compiled training step that produce a tensor as large as a table
    (other than reading the table itself): a densified embedding gradient."""
    features, labels = make_data(n=BATCH)
    model.compile(optimizer=optimizer, loss="binary_crossentropy")
    step = tf.function(model.train_step).get_concrete_function(
        ({k: tf.TensorSpec([None] + list(v.shape[1:]), tf.as_dtype(v.dtype)) for k, v in features.items()},
         tf.TensorSpec([None], tf.float32)))
    shapes = {tuple(v.shape) for v in model.picasso.table_variables}
    assert shapes
    return [(op.type, op.name) for op in step.graph.get_operations() for out in op.outputs
            if tuple(out.shape) in shapes and op.type not in ("ReadVariableOp", "PicassoReadTables", "Placeholder",
                                                               "VarHandleOp")]


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("name", ["functional", "sparse_multi_hot"])
def test_no_embedding_gradient_is_dense(name, packing):
    """Tables that the model itself never reads whole never get a table-sized tensor."""
    _, optimized = build_pair(MODELS[name], packing=packing)
    assert table_shaped_tensors(optimized, tf.keras.optimizers.Adagrad(0.1)) == []


def test_unrecognised_table_is_left_alone_reported_and_trains():
    baseline, optimized = build_pair(unrecognised_pattern)
    left = optimized.picasso.reports["training"]["analysis"]["left_alone"]
    assert len(left) == 1 and left[0]["table"].endswith("/maxnorm_table")
    assert "AssignVariableOp" in left[0]["reason"]
    assert "maxnorm_table" in optimized.picasso.report()
    np.testing.assert_allclose(train(optimized, tf.keras.optimizers.Adagrad(0.3)),
                               train(baseline, tf.keras.optimizers.Adagrad(0.3)), rtol=1e-5, atol=1e-5)


def recurrent_history():
    """A GRU over the embedded history: its loop's condition and body are library
    functions of the traced graph."""
    x = inputs()
    hist = tf.keras.layers.GRU(4)(tf.keras.layers.Embedding(VOCAB["item"], 8)(x["hist"]))
    return tf.keras.Model(x, head([tf.keras.layers.Embedding(VOCAB["user"], 8)(x["user"]), hist], x["price"]))


def test_loop_functions_outlive_the_collected_trace():
    """optimize() traces the model in a tf.function that is then garbage collected, and
    TensorFlow unregisters that function's loop bodies with it; the rewritten model
    (retraced here by a second compile) must still find them."""
    baseline, optimized = build_pair(recurrent_history)
    gc.collect()
    graph_def = optimized.rewritten_forward(training=True).captured.graph_def
    loops = [n.attr[a].func.name for n in graph_def.node if n.op in ("While", "StatelessWhile")
             for a in ("cond", "body")]
    assert loops, "the GRU should leave a While loop in the graph"
    assert all(context.context().has_function(f) for f in loops), loops
    expected = train(baseline, tf.keras.optimizers.Adagrad(0.3), steps=3)
    np.testing.assert_allclose(train(optimized, tf.keras.optimizers.Adagrad(0.3), steps=3), expected,
                               rtol=1e-5, atol=1e-5)


def test_decorator_forms():
    @picasso.optimize()
    def build():
        return functional_keras_embeddings()

    assert isinstance(build(), picasso.PicassoModel)
    assert isinstance(picasso.optimize(functional_keras_embeddings(), packing=False), picasso.PicassoModel)
    sequential = tf.keras.Sequential([tf.keras.Input((3,), dtype="int64"), tf.keras.layers.Embedding(20, 4),
                                      tf.keras.layers.Flatten(), tf.keras.layers.Dense(1)])
    wrapped = picasso.optimize(sequential)
    assert len(wrapped.picasso.storages) == 1
    ids = np.arange(12).reshape(4, 3)
    np.testing.assert_allclose(wrapped.predict(ids, verbose=0), sequential.predict(ids, verbose=0), rtol=1e-6)
    features, _ = make_data(n=4)
    subclass = picasso.optimize(SubclassedModel)()
    assert subclass(features).shape == (4, 1)       # signature taken from the first batch
    with pytest.raises(TypeError, match="unknown picasso_tf option"):
        picasso.optimize(functional_keras_embeddings(), packin=False)


def test_fit_evaluate_predict_callbacks_and_checkpoints(tmp_path):
    features, labels = make_data()
    model = picasso.optimize(functional_keras_embeddings())
    model.compile(optimizer="adagrad", loss="binary_crossentropy", metrics=[tf.keras.metrics.AUC(name="auc")])
    data = tf.data.Dataset.from_tensor_slices((features, labels)).batch(BATCH)
    callbacks = [tf.keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt"), save_weights_only=True),
                 tf.keras.callbacks.EarlyStopping(monitor="loss", patience=5),
                 tf.keras.callbacks.TensorBoard(str(tmp_path / "tb"))]
    history = model.fit(data, epochs=2, verbose=0, callbacks=callbacks)
    assert set(history.history) == {"loss", "auc"} and len(history.history["loss"]) == 2
    evaluated = model.evaluate(data, verbose=0, return_dict=True)
    predictions = model.predict(data, verbose=0)
    assert predictions.shape == (len(labels), 1) and 0.0 < evaluated["auc"] <= 1.0
    assert any((tmp_path / "tb" / "train").iterdir())

    model.save_weights(str(tmp_path / "weights"))
    restored = picasso.optimize(functional_keras_embeddings())
    restored.compile(optimizer="adagrad", loss="binary_crossentropy")
    restored.load_weights(str(tmp_path / "weights"))
    np.testing.assert_allclose(restored.predict(data, verbose=0), predictions, rtol=1e-6)
    for a, b in zip(model.original.weights, restored.original.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("packing", [True, False])
def test_a_mixed_precision_model_trains_exactly_like_keras(packing):
    """Under Keras' mixed_float16 policy the float16 layers read their float32 variables
    through AutoCastVariables, and Keras scales the loss for its LossScaleOptimizer: every
    variable trains, as in Keras. A float input reaches the graph as it is, not cast to
    float16 first (a functional model's layers cast their own inputs): a price beyond
    float16's range, taken to its logarithm in float32, stays finite."""
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        def build():
            tf.keras.utils.set_random_seed(0)
            ids = tf.keras.Input(shape=(3,), dtype=tf.int64, name="ids")
            price = tf.keras.Input(shape=(1,), name="price")
            scaled = tf.keras.layers.Lambda(lambda p: tf.math.log1p(p) - 11.0, dtype="float32")(price)
            hidden = tf.keras.layers.Dense(16, activation="relu")(tf.keras.layers.Concatenate()(
                [tf.keras.layers.Flatten()(tf.keras.layers.Embedding(50, 8)(ids)), scaled]))
            return tf.keras.Model([ids, price], tf.keras.layers.Dense(1, activation="sigmoid", dtype="float32")(hidden))
        rng = np.random.default_rng(0)
        x = {"ids": rng.integers(0, 50, (80, 3)), "price": rng.uniform(3e4, 1.3e5, (80, 1)).astype("float32")}
        y = rng.integers(0, 2, (80, 1)).astype("float32")
        keras_model, original = build(), build()
        initial = [w.numpy() for w in original.weights]
        model = picasso.optimize(original, packing=packing)
        losses = {}
        for name, m in (("keras", keras_model), ("picasso", model)):
            m.compile(tf.keras.optimizers.Adagrad(0.5), "binary_crossentropy")
            losses[name] = [m.train_on_batch({k: v[i:i + 16] for k, v in x.items()}, y[i:i + 16])
                            for i in range(0, 80, 16)]
        assert np.isfinite(losses["keras"]).all()
        np.testing.assert_allclose(losses["picasso"], losses["keras"], rtol=1e-5)
        for a, b, start in zip(keras_model.weights, original.weights, initial):
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6, err_msg=a.name)
            assert not np.array_equal(b.numpy(), start), f"{a.name} did not train"
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
