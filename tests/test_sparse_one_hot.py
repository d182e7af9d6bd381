"""Padded ids made sparse, read as they are (picasso_tf/passes/sparse_one_hot.py): a
tf.nn.safe_embedding_lookup_sparse of [B, 1] ids turned into a SparseTensor (by
tf.sparse.from_dense, or by a feature column dropping its ignored value) trains as in
Keras when the fused lookup reads the ids themselves: ignored ids, negative ids and rows
with no id left alike, for every combiner. Longer ids are read so too, as the ids the
conversion keeps and the row of each, however few of their positions are filled; those
only readable weighted (a dropped value above 0, per-id ops) where warm-up data shows
enough of their positions filled. Where an option needs the sparse form's rows, every
one keeps it, saying why."""
import numpy as np
import pytest
import tensorflow as tf

import picasso_tf
from exactness import assert_train_alike
from picasso_tf.ops.kept_ids import kept_ids, kept_segments

BATCH, VOCAB, DIM = 16, 30, 4


class SparseLookups(tf.keras.layers.Layer):
    """The same [B, 1] ids made sparse three ways, pooled by each combiner; and [B, 3] ids."""

    def build(self, shape):
        self.tables = [self.add_weight(f"t{i}", (VOCAB, DIM), initializer="glorot_uniform") for i in range(5)]

    def call(self, x):
        one = x["one"]
        from_dense = tf.sparse.from_dense(one)                          # drops 0
        kept = tf.where(tf.not_equal(one, 7))                           # drops 7, as a feature column its ignored value
        ignoring = tf.SparseTensor(kept, tf.gather_nd(one, kept), tf.shape(one, out_type=tf.int64))
        kept = tf.where(tf.not_equal(one, -1))                          # drops -1, an int feature column's default
        ignoring_negative = tf.SparseTensor(kept, tf.gather_nd(one, kept), tf.shape(one, out_type=tf.int64))
        return tf.concat([tf.nn.safe_embedding_lookup_sparse(self.tables[0], from_dense, combiner="sum"),
                          tf.nn.safe_embedding_lookup_sparse(self.tables[1], from_dense, combiner="mean"),
                          tf.nn.safe_embedding_lookup_sparse(self.tables[2], ignoring, combiner="sqrtn"),
                          tf.nn.safe_embedding_lookup_sparse(self.tables[3], tf.sparse.from_dense(x["three"]),
                                                             combiner="mean"),
                          tf.nn.safe_embedding_lookup_sparse(self.tables[4], ignoring_negative, combiner="sum")],
                         axis=1)


def build():
    x = {"one": tf.keras.Input((1,), dtype=tf.int64, name="one"),
         "three": tf.keras.Input((3,), dtype=tf.int64, name="three")}
    hidden = tf.keras.layers.Dense(8, activation="relu")(SparseLookups()(x))
    return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(hidden))


def data(steps, three_filled=0.8):
    rng = np.random.default_rng(0)
    n = BATCH * steps
    one = rng.integers(-2, VOCAB, (n, 1))          # 0 and 7 dropped by one conversion each, negative ids pruned
    one[::6] = 0
    one[1::6] = 7
    three = rng.integers(-1, VOCAB, (n, 3))
    three[rng.random((n, 3)) >= three_filled] = 0
    three[::5] = 0                                  # rows with no id left
    return {"one": one, "three": three}, (rng.random(n) < 0.4).astype("float32")


def warmup(features, labels):
    return tf.data.Dataset.from_tensor_slices((features, labels)).batch(BATCH)


class Ignoring(tf.keras.layers.Layer):
    """[B, 3] ids made sparse as a feature column does, dropping its ignored value (-1: id
    0 is a real id; 7: only readable weighted)."""

    def __init__(self, ignored, combiner="mean", **kwargs):
        super().__init__(**kwargs)
        self.ignored, self.combiner = ignored, combiner

    def build(self, shape):
        self.table = self.add_weight("t", (VOCAB, DIM), initializer="glorot_uniform")

    def call(self, ids):
        kept = tf.where(tf.not_equal(ids, self.ignored))
        sparse = tf.SparseTensor(kept, tf.gather_nd(ids, kept), tf.shape(ids, out_type=tf.int64))
        return tf.nn.safe_embedding_lookup_sparse(self.table, sparse, combiner=self.combiner)


def build_ignoring(ignored, combiner="mean", id_dtype="int64"):
    ids = tf.keras.Input((3,), dtype=id_dtype, name="three")
    hidden = tf.keras.layers.Dense(8, activation="relu")(Ignoring(ignored, combiner)(ids))
    return tf.keras.Model(ids, tf.keras.layers.Dense(1, activation="sigmoid")(hidden))


def ignoring_data(steps, ignored, filled, id_dtype="int64"):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (BATCH * steps, 3))
    ids[ids == ignored] = 0
    ids[rng.random(ids.shape) >= filled] = ignored
    ids[::5] = ignored                                  # rows with no id left
    return {"three": ids.astype(id_dtype)}, (rng.random(len(ids)) < 0.4).astype("float32")


def _k_packing(model):
    return next(p for p in model.picasso.reports["training"]["passes"] if p["pass"] == "k_packing")


def _op_count(model, op_type):
    return sum(node.op == op_type for node in model.picasso.program.graphs["training"].graph_def.node)


@pytest.mark.parametrize("optimizer", ["adagrad", "adam", "ftrl"])
def test_trains_as_keras_reading_the_one_hot_ids_as_they_are(optimizer):
    tf.keras.utils.set_random_seed(0)
    baseline, original = build(), build()
    original.set_weights(baseline.get_weights())
    features, labels = data(8)
    optimized = picasso_tf.optimize(original, warmup_data=warmup(features, labels))
    # The [B, 1] ids are read as they are, four times, and the [B, 3] ones too.
    assert _k_packing(optimized)["sparse_one_hot_read_as_ids"] == ["one"] * 3 + ["three", "one"], \
        optimized.picasso.report()
    assert not _k_packing(optimized)["sequences_pooled"] and not _k_packing(optimized)["sparse_ids_kept_sparse"]
    assert_train_alike(baseline, optimized, features, labels, optimizer, BATCH, 8, atol=1e-6, weights_rtol=1e-5)
    np.testing.assert_allclose(optimized.predict(features, verbose=0), baseline.predict(features, verbose=0),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options", [dict(sequence_pooling=False), dict(hybrid_hash=True)])
def test_stays_sparse_where_switched_off_or_ids_are_counted(options):
    """sequence_pooling=False keeps every lookup's form; hash tables and vocabularies would
    count the ids read with weight 0, so under them the sparse form stays too."""
    report = _k_packing(picasso_tf.optimize(build(), **options))
    assert not report["sparse_one_hot_read_as_ids"]
    if options.get("hybrid_hash"):
        assert "hash table would count other ids as looked up" in report["sparse_ids_kept_sparse"]["one"]


def test_longer_ids_are_read_as_they_are_without_warm_up_data_however_few_are_filled():
    """Reading the kept ids costs one pass over the positions, the conversion several, so
    the [B, 3] ids are read so whatever their fill, and with no warm-up data to measure it."""
    tf.keras.utils.set_random_seed(0)
    baseline, original = build(), build()
    original.set_weights(baseline.get_weights())
    optimized = picasso_tf.optimize(original)
    report = _k_packing(optimized)
    assert report["sparse_one_hot_read_as_ids"] == ["one"] * 3 + ["three", "one"], optimized.picasso.report()
    assert not report["sparse_ids_kept_sparse"] and _op_count(optimized, "PicassoKeptSegments") == 1
    features, labels = data(8, three_filled=0.1)
    assert_train_alike(baseline, optimized, features, labels, "adagrad", BATCH, 8, atol=1e-6, weights_rtol=1e-5)


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("id_dtype", ["int32", "int64"])
def test_ids_dropping_minus_one_are_read_as_the_kept_ids_and_train_as_keras(combiner, id_dtype):
    """-1 dropped, as an int feature column does: id 0 is kept, rows of only -1 get zeros."""
    tf.keras.utils.set_random_seed(0)
    baseline, original = build_ignoring(-1, combiner, id_dtype), build_ignoring(-1, combiner, id_dtype)
    original.set_weights(baseline.get_weights())
    optimized = picasso_tf.optimize(original)
    assert _k_packing(optimized)["sparse_one_hot_read_as_ids"] == ["three"], optimized.picasso.report()
    assert _op_count(optimized, "PicassoKeptSegments") == 1
    features, labels = ignoring_data(8, -1, 0.6, id_dtype)
    assert_train_alike(baseline, optimized, features, labels, "adagrad", BATCH, 8, atol=1e-6, weights_rtol=1e-5)


def test_ids_only_readable_weighted_stay_sparse_without_warm_up_data_or_where_few_are_filled():
    """Dropping 7, the ids can only be read weighted, every position passed over: that
    costs more than the conversion over a few ids, and how full the sequences are is
    the data's, so measured on the warm-up batches, or they keep their form, saying why."""
    report = _k_packing(picasso_tf.optimize(build_ignoring(7)))
    assert not report["sparse_one_hot_read_as_ids"]
    assert "pass warmup_data" in report["sparse_ids_kept_sparse"]["three"]
    few = _k_packing(picasso_tf.optimize(build_ignoring(7), warmup_data=warmup(*ignoring_data(4, 7, 0.3))))
    assert not few["sparse_one_hot_read_as_ids"]
    assert "positions hold an id in the warm-up batches, under the 40%" in few["sparse_ids_kept_sparse"]["three"]
    tf.keras.utils.set_random_seed(0)
    baseline, original = build_ignoring(7), build_ignoring(7)
    original.set_weights(baseline.get_weights())
    features, labels = ignoring_data(8, 7, 0.9)
    optimized = picasso_tf.optimize(original, warmup_data=warmup(features, labels))
    assert _k_packing(optimized)["sparse_one_hot_read_as_ids"] == ["three"], optimized.picasso.report()
    assert _op_count(optimized, "PicassoKeptSegments") == 0
    assert_train_alike(baseline, optimized, features, labels, "adagrad", BATCH, 8, atol=1e-6, weights_rtol=1e-5)


class SharedTable(tf.keras.layers.Layer):
    """The [B, 3] ids made sparse and the [B, 1] ones looked up plainly, in one table."""

    def build(self, shape):
        self.table = self.add_weight("t", (VOCAB, DIM), initializer="glorot_uniform")

    def call(self, x):
        return tf.concat([tf.nn.safe_embedding_lookup_sparse(self.table, tf.sparse.from_dense(x["three"]),
                                                             combiner="mean"),
                          tf.nn.embedding_lookup(self.table, tf.maximum(x["one"][:, 0], 0))], axis=1)


def test_longer_ids_are_read_as_they_are_where_their_table_is_also_read_otherwise():
    """The [B, 3] ids' table is also looked up plainly: both lookups are fused, one reading
    the kept ids, and the table trains as in Keras."""
    def build_shared():
        x = {"one": tf.keras.Input((1,), dtype=tf.int64, name="one"),
             "three": tf.keras.Input((3,), dtype=tf.int64, name="three")}
        return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(SharedTable()(x)))

    tf.keras.utils.set_random_seed(0)
    baseline, original = build_shared(), build_shared()
    original.set_weights(baseline.get_weights())
    features, labels = data(6)
    optimized = picasso_tf.optimize(original, warmup_data=warmup(features, labels))
    assert _k_packing(optimized)["sparse_one_hot_read_as_ids"] == ["three"], optimized.picasso.report()
    assert_train_alike(baseline, optimized, features, labels, "adam", BATCH, 6, atol=1e-6, weights_rtol=1e-5)


def test_warm_up_counts_the_ids_a_safe_lookup_keeps_not_its_empty_rows_fill():
    """The fill is measured as the ids the conversion keeps per example: the warm-up
    statistics count them before SparseFillEmptyRows gives each empty row an id."""
    features, labels = data(4, three_filled=0.3)
    optimized = picasso_tf.optimize(build(), warmup_data=warmup(features, labels))
    table = next(name for name in optimized.picasso.program.statistics.accesses if name.endswith("/t3"))
    kept = np.sum(features["three"] > 0) / len(labels)        # from_dense drops 0, the lookup prunes -1
    assert optimized.picasso.program.statistics.accesses[table] == pytest.approx(kept)


def test_a_gradient_tape_loop_trains_as_keras_with_the_ids_read_as_they_are():
    tf.keras.utils.set_random_seed(0)
    baseline, original = build(), build()
    original.set_weights(baseline.get_weights())
    optimized = picasso_tf.optimize(original)
    assert _k_packing(optimized)["sparse_one_hot_read_as_ids"] == ["one"] * 3 + ["three", "one"]
    features, labels = data(6)
    loss_fn = tf.keras.losses.BinaryCrossentropy()
    losses = {}
    for name, model in (("baseline", baseline), ("picasso", optimized)):
        optimizer = tf.keras.optimizers.Adagrad(0.1)

        @tf.function
        def step(x, y, model=model, optimizer=optimizer):
            with tf.GradientTape() as tape:
                loss = loss_fn(y[:, None], model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        losses[name] = [float(step({k: v[i * BATCH:(i + 1) * BATCH] for k, v in features.items()},
                                   labels[i * BATCH:(i + 1) * BATCH])) for i in range(6)]
    np.testing.assert_allclose(losses["picasso"], losses["baseline"], rtol=1e-5, atol=1e-6)
    for b, o in zip(baseline.trainable_weights, optimized.trainable_weights):
        np.testing.assert_allclose(o.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=b.name)


def test_under_a_lazy_optimizer_the_ids_stay_sparse_and_rows_they_drop_are_not_moved():
    """Read as they are, the ids would touch other rows than the sparse form, which gives
    each row of no ids (all -1) the id 0: a touched row, which lazy Adam moves by its
    moments though its gradient is 0. Row 0 is looked up by an id in the first batch only."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, (BATCH * 8, 3))
    ids[rng.random(ids.shape) < 0.3] = -1
    ids[0, 0] = 0
    labels = (rng.random(len(ids)) < 0.4).astype("float32")
    trained = {}
    for pooling in (True, False):           # sequence_pooling=False: every lookup keeps its form
        tf.keras.utils.set_random_seed(0)
        model = picasso_tf.optimize(build_ignoring(-1), lazy_optimizer=True, sequence_pooling=pooling,
                                    warmup_data=warmup({"three": ids}, labels))
        if pooling:
            report = _k_packing(model)
            assert not report["sparse_one_hot_read_as_ids"]
            assert report["sparse_ids_kept_sparse"]["three"].startswith("lazy_optimizer: "), report
        model.compile(tf.keras.optimizers.Adam(0.05), "binary_crossentropy")
        model.fit({"three": ids}, labels, batch_size=BATCH, verbose=0, shuffle=False)
        trained[pooling] = [w.numpy() for w in model.weights]
    for a, b in zip(*trained.values()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("keep_zero", [False, True])
@pytest.mark.parametrize("id_dtype", [tf.int32, tf.int64])
@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32, tf.float64])
def test_the_kept_ids_op_reads_padded_ids_as_the_conversion_keeps_them(keep_zero, id_dtype, dtype):
    """PicassoKeptIds, the rewrite's one pass over the ids: max(ids, 0), and weights of 1
    where the conversion keeps an id (> 0; >= 0 where it drops a negative value) and 0
    elsewhere; more ids than one of its work items, so the pool shares them."""
    ids = np.random.default_rng(1).integers(-3, 9, (40_000, 2))
    got_ids, weights = kept_ids(tf.constant(ids, id_dtype), dtype, keep_zero)
    assert got_ids.dtype == id_dtype and weights.dtype == dtype and weights.shape == (40_000, 2, 1)
    np.testing.assert_array_equal(got_ids.numpy(), np.maximum(ids, 0))
    np.testing.assert_array_equal(weights.numpy()[..., 0].astype(np.float64), (ids >= (0 if keep_zero else 1)))
    static = tf.function(lambda x: kept_ids(x, dtype, keep_zero)).get_concrete_function(
        tf.TensorSpec([None, 5], id_dtype)).structured_outputs
    assert static[0].shape.as_list() == [None, 5] and static[1].shape.as_list() == [None, 5, 1]


@pytest.mark.parametrize("keep_zero", [False, True])
@pytest.mark.parametrize("id_dtype", [tf.int32, tf.int64])
def test_the_kept_segments_op_keeps_the_ids_the_conversion_keeps_in_order(keep_zero, id_dtype):
    """PicassoKeptSegments, what the rewrite reads of longer ids: the ids the conversion
    keeps (> 0; >= 0 where it drops a negative value) in row-major order, the row of each
    and the number of rows; over more ids than one of its work items, so the pool shares
    them and each item writes after the ones before; no ids or no rows give empty ids."""
    ids = np.random.default_rng(2).integers(-3, 9, (3_000, 50))
    ids[::7] = 0                                    # rows with no id left
    for shape in [ids.shape, (4, 0), (0, 5)]:
        given = ids[:shape[0], :shape[1]]
        got, rows, count = kept_segments(tf.constant(given, id_dtype), keep_zero)
        want_rows, columns = np.nonzero(given >= (0 if keep_zero else 1))
        assert got.dtype == id_dtype and rows.dtype == tf.int64 and int(count) == shape[0]
        np.testing.assert_array_equal(got.numpy(), given[want_rows, columns])
        np.testing.assert_array_equal(rows.numpy(), want_rows)
    static = tf.function(lambda x: kept_segments(x, keep_zero)).get_concrete_function(
        tf.TensorSpec([None, 5], id_dtype)).structured_outputs
    assert [t.shape.as_list() for t in static] == [[None], [None], []]
