"""Same-ids stacking (picasso_tf/passes/same_ids_stacking.py): tables always read with
the same ids and concatenated one per part, the way MLR's parts read theirs, are looked
up once as one wider table per feature; training, tapes and the report stay as without
it. (DeepCTR's own MLR and ONN: tests/test_public_models.py.)"""
import numpy as np
import pytest
import tensorflow as tf

import picasso_tf as picasso
from exactness import assert_train_alike
from picasso_tf.ops.stacked_tables import _stack_columns_gradient, stack_columns, stacked_lookup
from picasso_tf.ops.stitched_lookup import stitched_lookup

FEATURES, PARTS, VOCAB, BATCH, STEPS = 3, 4, 50, 32, 6


def mixture(dim=2, shared=False, ids=1, axis=-1, part0_axis=None):
    """PARTS linear parts (MLR's regions and learners), each with a table per feature of
    FEATURES, read with that feature's `ids` ids per example and concatenated along `axis`
    (part 0 along `part0_axis` if given), each part's columns weighed apart so that a
    column out of place changes the loss; a dim-8 table of feature g besides, so that
    D-packing shards the parts' group. shared: part 0's table of f0 is also read with g's
    ids."""
    tf.keras.utils.set_random_seed(3)
    x = {name: tf.keras.Input((ids,), dtype="int64", name=name) for name in [f"f{i}" for i in range(FEATURES)]}
    x["g"] = tf.keras.Input((1,), dtype="int64", name="g")
    sums = []
    for p in range(PARTS):
        tables = [tf.keras.layers.Embedding(VOCAB, dim, name=f"part{p}_f{i}") for i in range(FEATURES)]
        rows = [t(x[f"f{i}"]) for i, t in enumerate(tables)]
        if shared and p == 0:
            rows.append(tables[0](tf.keras.layers.Lambda(lambda g: tf.tile(g, [1, ids]))(x["g"])))
        joined = tf.keras.layers.Concatenate(axis=part0_axis if p == 0 and part0_axis is not None else axis)(rows)
        weights = np.linspace(0.5, 1.5 + p, int(np.prod(joined.shape[1:]))).reshape(joined.shape[1:]).astype("float32")
        sums.append(tf.keras.layers.Lambda(lambda t, w=weights: tf.reduce_sum(t * w, axis=[1, 2]))(joined))
    parts = tf.keras.layers.Lambda(lambda ts: tf.stack(ts, axis=1))(sums)
    other = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(VOCAB, 8, name="g_table")(x["g"]))
    joined = tf.keras.layers.Concatenate()([parts, other])
    return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(joined))


def pooled_mixture(dim=2, ids=3, one_hot=()):
    """PARTS parts, each summing its table per feature over the feature's `ids` ids (a
    multi-hot feature; one id of the features in `one_hot`) and weighing the sums'
    columns apart."""
    tf.keras.utils.set_random_seed(3)
    x = {f"f{i}": tf.keras.Input((1 if i in one_hot else ids,), dtype="int64", name=f"f{i}") for i in range(FEATURES)}
    read = {i: tf.keras.layers.Flatten() if i in one_hot else tf.keras.layers.Lambda(lambda e: tf.reduce_sum(e, axis=1))
            for i in range(FEATURES)}
    sums = []
    for p in range(PARTS):
        rows = [read[i](tf.keras.layers.Embedding(VOCAB, dim, name=f"part{p}_f{i}")(x[f"f{i}"])) for i in range(FEATURES)]
        joined = tf.keras.layers.Concatenate()(rows)
        weights = np.linspace(0.5, 1.5 + p, joined.shape[-1]).astype("float32")
        sums.append(tf.keras.layers.Lambda(lambda t, w=weights: tf.reduce_sum(t * w, axis=1, keepdims=True))(joined))
    return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(tf.keras.layers.Concatenate()(sums)))


def data(steps=STEPS, seed=0, ids=1):
    rng = np.random.default_rng(seed)
    n = BATCH * steps
    features = {f"f{i}": rng.integers(0, VOCAB, (n, ids)) for i in range(FEATURES)}
    features["g"] = rng.integers(0, VOCAB, (n, 1))
    return features, (rng.random((n, 1)) < 0.4).astype("float32")


def k_packing(model, graph="training"):
    return next(p for p in model.picasso.reports[graph]["passes"] if p["pass"] == "k_packing")


def plan(model):
    return next(p for p in model.picasso.reports["training"]["passes"] if p["pass"] == "d_packing")["plan"]


@pytest.mark.parametrize("optimizer, ids, axis", [
    ("sgd", 1, -1), ("adagrad", 1, -1), ("adam", 1, -1),
    ("adagrad", 2, 1),      # two rows of each table per example, side by side
    ("adagrad", 2, -1),     # two rows per example, each row of the concatenation one id's
], ids=["sgd", "adagrad", "adam", "rows side by side", "a row per id"])
def test_tables_read_with_the_same_ids_are_looked_up_as_one_and_train_exactly(optimizer, ids, axis):
    baseline, optimized = mixture(ids=ids, axis=axis), picasso.optimize(mixture(ids=ids, axis=axis))
    optimized.set_weights(baseline.get_weights())
    features, labels = data(ids=ids)
    optimized(features)
    stacked = k_packing(optimized)["stacked"]
    # Ids read one by one: each table's rows read in place, no copy of the tables.
    assert [(s["feature"], len(s["tables"]), s["width"], s["tables_copied"]) for s in stacked] == [
        (f"f{i}", PARTS, 2 * PARTS, False) for i in range(FEATURES)]
    # D-packing cut the parts' group into shards, each feature's tables in one of them.
    for s in stacked:
        assert sum(set(s["tables"]) <= set(g["tables"]) for g in plan(optimized)) == 1, plan(optimized)
    assert len([g for g in plan(optimized) if g["dim"] == 2]) > 1, plan(optimized)
    # Predictions, of any batch size, look the tables up one by one.
    inference = k_packing(optimized, "inference")
    assert not inference["stacked"] and all("inference" in s["reason"] for s in inference["stacks_apart"])
    assert_train_alike(baseline, optimized, features, labels, optimizer, BATCH, STEPS, weights_rtol=1e-5)


@pytest.mark.parametrize("one_hot", [(), (0,)], ids=["all pooled", "one-hot beside pooled"])
def test_pooled_ids_are_looked_up_in_a_copy_of_the_tables_and_train_exactly(one_hot):
    baseline, optimized = pooled_mixture(one_hot=one_hot), picasso.optimize(pooled_mixture(one_hot=one_hot))
    optimized.set_weights(baseline.get_weights())
    features, labels = data(ids=3)
    for i in one_hot:
        features[f"f{i}"] = features[f"f{i}"][:, :1]
    optimized(features)
    stacked = k_packing(optimized)["stacked"]
    assert [(s["feature"], len(s["tables"]), s["tables_copied"]) for s in stacked] == [
        (f"f{i}", PARTS, True) for i in range(FEATURES)]
    assert_train_alike(baseline, optimized, features, labels, "adagrad", BATCH, STEPS, weights_rtol=1e-5)


def test_a_gradient_tape_gets_each_table_s_row_sparse_gradient():
    baseline, optimized = mixture(), picasso.optimize(mixture())
    optimized.set_weights(baseline.get_weights())
    features, labels = data(steps=1)
    grads = {}
    for name, model in (("baseline", baseline), ("picasso", optimized)):
        with tf.GradientTape() as tape:
            loss = tf.keras.losses.binary_crossentropy(labels, model(features, training=True))
        grads[name] = list(zip((v.name for v in model.trainable_variables),
                               tape.gradient(loss, model.trainable_variables)))
    assert k_packing(optimized)["stacked"]
    assert len(grads["picasso"]) == len(grads["baseline"])
    for (name, expected), (_, got) in zip(grads["baseline"], grads["picasso"]):
        assert type(got) is type(expected), name
        # (The plain model's IndexedSlices hold a row per id; summed here in another order.)
        np.testing.assert_allclose(tf.convert_to_tensor(got).numpy(), tf.convert_to_tensor(expected).numpy(),
                                   rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("layout, options, reason", [
    ({"shared": True}, {}, "not concatenated one table per concatenation"),
    ({"ids": 2, "axis": -1, "part0_axis": 1}, {}, "not concatenated one table per concatenation"),
    ({}, {"micro_batches": 2}, "micro_batches"),
], ids=["a table read twice", "parts laid out differently", "micro-batches"])
def test_stacking_stands_down_and_says_why(layout, options, reason):
    baseline, optimized = mixture(**layout), picasso.optimize(mixture(**layout), **options)
    optimized.set_weights(baseline.get_weights())
    features, labels = data(ids=layout.get("ids", 1))
    optimized(features)
    report = k_packing(optimized)
    apart = [s for s in report["stacks_apart"] if reason in s["reason"]]
    assert apart and not [s for s in report["stacked"] if s["feature"] == "f0"], report
    assert_train_alike(baseline, optimized, features, labels, "adagrad", BATCH, STEPS, weights_rtol=1e-5)


def test_an_id_outside_a_stacked_table_names_its_feature():
    optimized = picasso.optimize(mixture())
    features, _ = data(steps=1)
    optimized(features)
    assert k_packing(optimized)["stacked"]
    features["f1"][3, 0] = VOCAB + 7
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"f1.*{VOCAB + 7}"):
        optimized(features)


def test_stack_columns_puts_rows_side_by_side_and_gives_each_table_its_columns_of_the_gradient():
    tables = [np.arange(rows * width, dtype="float32").reshape(rows, width) + 100 * i
              for i, (rows, width) in enumerate([(5, 1), (5, 1), (5, 3)])]
    np.testing.assert_array_equal(stack_columns(tables).numpy(), np.concatenate(tables, axis=1))
    upstream = np.arange(25, dtype="float32").reshape(5, 5)
    with tf.GradientTape() as tape:
        inputs = [tf.constant(t) for t in tables]
        tape.watch(inputs)
        stacked = stack_columns(inputs)
    dense = tape.gradient(stacked, inputs, output_gradients=tf.constant(upstream))
    np.testing.assert_array_equal(np.concatenate([g.numpy() for g in dense], axis=1), upstream)
    # A lookup's row-sparse gradient stays row-sparse: each table gets the same rows.
    graph = tf.Graph()
    with graph.as_default():
        out = stack_columns([tf.constant(t) for t in tables])
        sparse = tf.IndexedSlices(tf.constant(upstream[:2]), tf.constant([4, 1], tf.int64))
        split = _stack_columns_gradient(out.op, sparse)
        assert all(isinstance(g, tf.IndexedSlices) for g in split)
        with tf.compat.v1.Session() as session:
            values, indices = session.run(([g.values for g in split], [g.indices for g in split]))
    np.testing.assert_array_equal(np.concatenate(values, axis=1), upstream[:2])
    assert all(list(i) == [4, 1] for i in indices)


@pytest.mark.parametrize("dtype, id_dtype, row_blocks, width", [
    ("float32", "int64", 1, 1), ("float32", "int32", 2, 3), ("float64", "int64", 1, 2)])
def test_a_stacked_lookup_reads_the_tables_as_a_lookup_of_their_copy_does(dtype, id_dtype, row_blocks, width):
    rng = np.random.default_rng(4)
    k, rows, vocabs = 3, 7, [11, 5]
    stacks = [[tf.constant(rng.normal(size=(v, width)).astype(dtype)) for _ in range(k)] for v in vocabs]
    ids = [tf.constant(rng.integers(0, v, (rows, row_blocks)).astype(id_dtype)) for v in vocabs]
    upstream = tf.constant(rng.normal(size=(rows, len(vocabs) * row_blocks * k * width)).astype(dtype))
    names = ["a", "b"]

    def copied(tables):
        return stitched_lookup([stack_columns(t) for t in tables], ids, table_index=[0, 1],
                               columns=[0, row_blocks * k * width], row_blocks=[row_blocks] * 2,
                               width=2 * row_blocks * k * width, offsets=[0, 0], vocab_sizes=vocabs,
                               combiners=["none"] * 2, feature_names=names)

    def in_place(tables):
        return stacked_lookup(tables, ids, row_blocks=row_blocks, vocab_sizes=vocabs, feature_names=names)

    results = []
    for lookup in (copied, in_place):
        with tf.GradientTape() as tape:
            tape.watch([t for stack in stacks for t in stack])
            out = lookup(stacks)
        grads = tape.gradient(out, [t for stack in stacks for t in stack], output_gradients=upstream)
        assert all(isinstance(g, tf.IndexedSlices) for g in grads)
        results.append((out.numpy(), [tf.convert_to_tensor(g).numpy() for g in grads]))
    np.testing.assert_array_equal(results[1][0], results[0][0])
    for got, expected in zip(results[1][1], results[0][1]):
        np.testing.assert_array_equal(got, expected)
    bad = [ids[0], tf.tensor_scatter_nd_update(ids[1], [[3, 0]], tf.constant([9], ids[1].dtype))]
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"feature 'b' must lie in \[0, 5\): got 9 at position "
                                                             f"{3 * row_blocks}"):
        stacked_lookup(stacks, bad, row_blocks=row_blocks, vocab_sizes=vocabs, feature_names=names)
