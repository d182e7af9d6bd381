"""D-packing and K-packing: exact training under every fused optimizer, determinism,
the paper's sharding example, op-count reduction and clear errors for bad ids."""
import numpy as np
import pytest
import tensorflow as tf

import picasso_tf as picasso
from picasso_tf.profiling.profile import profile

BATCH = 64
FIELDS = [("u", 40, 8), ("i", 60, 16), ("c", 10, 8), ("g", 30, 32)]   # name, vocab, dim
SEQ = ("hist", 60, 5)      # shares the "i" table, masked sum pooling


def model_builder(seed=3, regularizer=None):
    def build():
        tf.keras.utils.set_random_seed(seed)
        x = {n: tf.keras.Input((), dtype="int64", name=n) for n, _, _ in FIELDS}
        x[SEQ[0]] = tf.keras.Input((SEQ[2],), dtype="int64", name=SEQ[0])
        tables = {n: tf.keras.layers.Embedding(v, d, name=f"emb_{n}", embeddings_regularizer=regularizer)
                  for n, v, d in FIELDS}
        parts = [tables[n](x[n]) for n, _, _ in FIELDS]
        hist = tables["i"](x[SEQ[0]])
        mask = tf.cast(tf.not_equal(x[SEQ[0]], 0), tf.float32)[..., None]
        parts.append(tf.reduce_sum(hist * mask, axis=1))
        h = tf.keras.layers.Dense(8, activation="relu")(tf.keras.layers.Concatenate()(parts))
        return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(h))
    return build


def batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = {n: rng.zipf(1.3, BATCH) % v for n, v, _ in FIELDS}
        x[SEQ[0]] = rng.zipf(1.3, (BATCH, SEQ[2])) % SEQ[1]
        out.append((x, (rng.random(BATCH) < 0.3).astype("float32")))
    return out


def run(model, optimizer, steps, seed=0):
    return run_on(model, batches(steps, seed), optimizer)


def run_on(model, data, optimizer=None):
    model.compile(optimizer=optimizer or tf.keras.optimizers.Adagrad(0.2), loss="binary_crossentropy")
    return np.array([model.train_on_batch(x, y) for x, y in data])


OPTIMIZERS = {
    "sgd": lambda: tf.keras.optimizers.SGD(0.3),
    "adagrad": lambda: tf.keras.optimizers.Adagrad(0.2),
    "ftrl": lambda: tf.keras.optimizers.Ftrl(0.2, l1_regularization_strength=0.001,
                                             l2_regularization_strength=0.001),
    "adam": lambda: tf.keras.optimizers.Adam(0.01),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_packed_model_matches_baseline_for_50_steps(optimizer):
    build = model_builder()
    baseline, optimized = build(), picasso.optimize(build())
    assert len(optimized.picasso.storages) >= 2
    base_losses = run(baseline, OPTIMIZERS[optimizer](), 50)
    opt_losses = run(optimized, OPTIMIZERS[optimizer](), 50)
    assert optimized.picasso.optimizer_note.startswith("packed tables: fused")
    np.testing.assert_allclose(opt_losses, base_losses, rtol=1e-5, atol=1e-5)
    optimized.picasso.write_back()
    for b, o in zip(baseline.weights, optimized.original.weights):
        np.testing.assert_allclose(o.numpy(), b.numpy(), rtol=1e-4, atol=1e-5, err_msg=b.name)


def step_op_types(model):
    """The op types of the model's compiled training step, with their counts."""
    x = {n: v for n, v in batches(1)[0][0].items() if n in model.original.input_names}
    step = tf.function(model.train_step).get_concrete_function(
        ({k: tf.TensorSpec([None] + list(v.shape[1:]), tf.int64) for k, v in x.items()},
         tf.TensorSpec([None], tf.float32)))
    types = [op.type for op in step.graph.get_operations()]
    return {t: types.count(t) for t in set(types)}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_regularized_tables_train_exactly_in_one_dense_pass(optimizer):
    """Tables under an L2 regularizer (DeepCTR's default) have a dense gradient in the
    original model: picasso_tf applies it with the dense variables, in one fused op,
    rather than row by row through the row-sparse kernels."""
    build = model_builder(regularizer=tf.keras.regularizers.l2(1e-3))
    baseline, optimized = build(), picasso.optimize(build())
    base_losses = run(baseline, OPTIMIZERS[optimizer](), 20)
    opt_losses = run(optimized, OPTIMIZERS[optimizer](), 20)
    np.testing.assert_allclose(opt_losses, base_losses, rtol=1e-5, atol=1e-5)
    optimized.picasso.write_back()
    for b, o in zip(baseline.weights, optimized.original.weights):
        np.testing.assert_allclose(o.numpy(), b.numpy(), rtol=1e-4, atol=1e-5, err_msg=b.name)
    types = step_op_types(optimized)
    assert not [t for t in types if t.startswith("PicassoSparseApply")], types
    assert types.get("PicassoDenseApply") == 1, types


def summed_logits_builder():
    """A logistic regression: one width-1 table per field, the lookups summed (not
    concatenated, so they are packed lookups, not a stitched one)."""
    def build():
        tf.keras.utils.set_random_seed(5)
        x = {n: tf.keras.Input((), dtype="int64", name=n) for n, _, _ in FIELDS}
        terms = [tf.keras.layers.Embedding(v, 1, name=f"w_{n}")(x[n]) for n, v, _ in FIELDS]
        return tf.keras.Model(x, tf.keras.layers.Activation("sigmoid")(tf.keras.layers.Add()(terms)))
    return build


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_packed_lookup_gradient_updates_its_tables_in_the_kernel(optimizer):
    """Where the optimizer leaves rows without a gradient alone (SGD, Adagrad), the packed
    lookup's gradient kernel applies the rows itself; Adam decays every row, so its
    tables keep their own update."""
    build = summed_logits_builder()
    data = [({n: x[n] for n, _, _ in FIELDS}, y) for x, y in batches(20)]
    baseline, optimized = build(), picasso.optimize(build())
    np.testing.assert_allclose(run_on(optimized, data, OPTIMIZERS[optimizer]()),
                               run_on(baseline, data, OPTIMIZERS[optimizer]()), rtol=1e-5, atol=1e-5)
    optimized.picasso.write_back()
    for b, o in zip(baseline.weights, optimized.original.weights):
        np.testing.assert_allclose(o.numpy(), b.numpy(), rtol=1e-4, atol=1e-6, err_msg=b.name)
    types = step_op_types(optimized)
    in_kernel = optimizer != "adam"
    assert ("PicassoPackedLookupGradApply" in types) == in_kernel, types
    assert bool([t for t in types if t.startswith("PicassoSparseApply")]) != in_kernel, types


def test_two_runs_are_bit_identical():
    build = model_builder()
    first, second = picasso.optimize(build()), picasso.optimize(build())
    np.testing.assert_array_equal(run(first, tf.keras.optimizers.Adam(0.01), 10),
                                  run(second, tf.keras.optimizers.Adam(0.01), 10))
    for a, b in zip(first.original.weights, second.original.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_lazy_adam_matches_numpy_lazy_adam():
    """Each step: the table gradient comes from the baseline model at the same weights;
    NumPy's lazy Adam updates only the rows that have one."""
    build = model_builder()
    # Without the projection the table gradients are summed in the baseline's order:
    # Adam divides by sqrt(v), so a near-zero gradient's rounding would move its step.
    baseline, optimized = build(), picasso.optimize(build(), lazy_optimizer=True, projection=False)
    optimized.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss="binary_crossentropy")
    table_names = [v.name for v in baseline.weights if v.name.startswith("emb_")]
    state = {n: (np.zeros(v.shape), np.zeros(v.shape)) for n, v in
             ((v.name, v) for v in baseline.weights) if n in table_names}
    lr, b1, b2, eps = 0.05, 0.9, 0.999, 1e-7
    for t, (x, y) in enumerate(batches(4), start=1):
        optimized.picasso.write_back()
        baseline.set_weights(optimized.original.get_weights())
        with tf.GradientTape() as tape:
            loss = tf.keras.losses.binary_crossentropy(y[:, None], baseline(x, training=True))
            loss = tf.reduce_mean(loss)
        grads = dict(zip([v.name for v in baseline.trainable_weights],
                         tape.gradient(loss, baseline.trainable_weights)))
        expected = {}
        for name in table_names:
            g = tf.convert_to_tensor(grads[name]).numpy()          # dense only in the test
            rows = np.unique(grads[name].indices.numpy())
            m, v = state[name]
            m[rows] = b1 * m[rows] + (1 - b1) * g[rows]
            v[rows] = b2 * v[rows] + (1 - b2) * g[rows] ** 2
            alpha = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
            table = baseline.get_layer(name.split("/")[0]).embeddings.numpy().astype(np.float64)
            table[rows] -= m[rows] * alpha / (np.sqrt(v[rows]) + eps)
            expected[name] = table
        optimized.train_on_batch(x, y)
        optimized.picasso.write_back()
        for name, table in expected.items():
            got = optimized.original.get_layer(name.split("/")[0]).embeddings.numpy()
            np.testing.assert_allclose(got, table, rtol=1e-4, atol=1e-6, err_msg=f"step {t} {name}")


def test_calc_vparam_shards_heavy_groups_like_the_paper():
    """Uniform data, same number of tables per dim: dim-8 stays one packed group while
    dim-32 becomes four shards (paper §III-B, Eq. 1)."""
    x = {f"f{i}": tf.keras.Input((), dtype="int64", name=f"f{i}") for i in range(12)}
    embs = [tf.keras.layers.Embedding(100, [8, 16, 32][i % 3])(x[f"f{i}"]) for i in range(12)]
    model = tf.keras.Model(x, tf.keras.layers.Dense(1)(tf.keras.layers.Concatenate()(embs)))
    tables = picasso.optimize(model).picasso.program.tables
    shards = {}
    for group in tables:
        shards[group.dim] = shards.get(group.dim, 0) + 1
    assert shards == {8: 1, 16: 1, 32: 4}
    unsharded = picasso.optimize(model, shard_heavy_groups=False).picasso.program.tables
    assert sorted(g.dim for g in unsharded) == [8, 16, 32]


def test_warmup_statistics_count_ids_per_example():
    build = model_builder()
    data = tf.data.Dataset.from_tensor_slices(batches(1)[0]).batch(16)
    statistics = picasso.optimize(build(), warmup_data=data, warmup_batches=2).picasso.program.statistics
    assert statistics.source == "2 warm-up batches"
    assert statistics.accesses["emb_u/embeddings"] == pytest.approx(1.0)
    assert statistics.accesses["emb_i/embeddings"] == pytest.approx(1.0 + SEQ[2])   # item + its history
    first, second = [{n: np.asarray(v) for n, v in b[0].items()} for b in data.take(2)]
    distinct_u = len(np.unique(first["u"])) + len(np.unique(second["u"]))
    assert statistics.distinct_ids["emb_u/embeddings"] == pytest.approx(distinct_u / 32)


@pytest.mark.parametrize("units", [1, 16])
def test_a_wide_projection_is_left_to_the_matmul_where_warmup_ids_are_mostly_distinct(units):
    """Per unique row, a wide projection only pays where ids repeat within a batch; a
    narrow one works per entry and is always used."""
    x = {f"f{i}": tf.keras.Input((), dtype="int64", name=f"f{i}") for i in range(3)}
    embs = [tf.keras.layers.Embedding(1000, 8)(x[f"f{i}"]) for i in range(3)]
    model = tf.keras.Model(x, tf.keras.layers.Dense(units)(tf.keras.layers.Concatenate()(embs)))

    def stitch_with(ids, **options):
        data = tf.data.Dataset.from_tensor_slices(({f"f{i}": ids for i in range(3)}, np.zeros(256))).batch(128)
        optimized = picasso.optimize(model, warmup_data=data, warmup_batches=2, **options)
        [k_packing] = [p for p in optimized.picasso.reports["training"]["passes"] if p["pass"] == "k_packing"]
        [stitch] = k_packing["stitched"]
        return stitch

    repeating, distinct = stitch_with(np.arange(256) % 7), stitch_with(np.arange(256))
    assert repeating["projection"] and repeating["projection_skipped"] is None
    if units == 1:
        assert distinct["projection"] and distinct["projection_skipped"] is None
    else:
        assert distinct["projection"] is None
        assert "100% of the warm-up batches' ids are distinct" in distinct["projection_skipped"]
        assert stitch_with(np.arange(256), projection_max_distinct=1.0)["projection"]
    with pytest.raises(ValueError, match="projection_max_distinct is a share of ids, in \\[0, 1\\]; got 1.5"):
        picasso.optimize(model, projection_max_distinct=1.5)


def test_training_step_ops_drop_to_a_tenth_for_200_fields():
    x = {f"f{i}": tf.keras.Input((), dtype="int64", name=f"f{i}") for i in range(200)}
    embs = [tf.keras.layers.Embedding(1000, [8, 16, 32][i % 3])(x[f"f{i}"]) for i in range(200)]
    model = picasso.optimize(tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(
        tf.keras.layers.Concatenate()(embs))))
    model.compile(optimizer="adagrad", loss="binary_crossentropy")
    rng = np.random.default_rng(0)
    batch = ({f"f{i}": rng.integers(0, 1000, 8) for i in range(200)}, np.ones(8, np.float32))
    report = profile(model, batch, out_dir=None)
    assert report["embedding_sites"] == 200
    assert report["step_op_ratio"] <= 0.10, report["step_op_ratio"]


def test_out_of_range_id_names_the_feature_and_value():
    model = picasso.optimize(model_builder()())
    model.compile(optimizer="adagrad", loss="binary_crossentropy")
    x, y = batches(1)[0]
    x = dict(x, c=np.full(BATCH, 10))             # vocabulary of "c" is 10
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"'c'.*10"):
        model.train_on_batch(x, y)
    x = dict(x, c=np.full(BATCH, -1))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"'c'.*-1"):
        model.predict_on_batch(x)


def stitch_model_builder():
    """Lookups concatenated with a dense feature, a flattened 3-id sequence and a
    stack of same-dim lookups (DLRM's interaction input): all stitched."""
    def build():
        tf.keras.utils.set_random_seed(7)
        x = {n: tf.keras.Input((), dtype="int64", name=n) for n, _, _ in FIELDS}
        x["seq"] = tf.keras.Input((3,), dtype="int64", name="seq")
        x["num"] = tf.keras.Input((2,), name="num")
        tables = {n: tf.keras.layers.Embedding(v, d, name=f"emb_{n}") for n, v, d in FIELDS}
        seq = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(30, 4, name="emb_seq")(x["seq"]))
        wide = tf.keras.layers.Concatenate()([x["num"], tables["u"](x["u"]), seq, tables["i"](x["i"]),
                                              tables["g"](x["g"])])
        stacked = tf.keras.layers.Flatten()(tf.stack([tables["c"](x["c"]),
                                                      tf.keras.layers.Embedding(20, 8, name="emb_c2")(x["c"])], axis=1))
        h = tf.keras.layers.Dense(8, activation="relu")(tf.keras.layers.Concatenate()([wide, stacked]))
        return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(h))
    return build


def stitch_batches(steps):
    rng = np.random.default_rng(4)
    out = []
    for x, y in batches(steps):
        out.append((dict(x, seq=rng.integers(0, 30, (BATCH, 3)), num=rng.normal(size=(BATCH, 2))), y))
    return out


def test_concatenated_lookups_are_stitched_and_train_exactly():
    build = stitch_model_builder()
    baseline, stitched = build(), picasso.optimize(build())
    unstitched = picasso.optimize(build(), stitching=False)
    k_packing = [p for p in stitched.picasso.reports["training"]["passes"] if p["pass"] == "k_packing"][0]
    by_width = {s["width"]: s for s in k_packing["stitched"]}
    wide = by_width[2 + 8 + 3 * 4 + 16 + 32]
    assert (wide["sites"], wide["copied_inputs"]) == (4, 1)   # the dense feature is copied in
    assert by_width[16]["sites"] == 2                  # the tf.stack
    losses = {}
    for name, model in (("baseline", baseline), ("stitched", stitched), ("unstitched", unstitched)):
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.2), loss="binary_crossentropy")
        losses[name] = [model.train_on_batch(x, y) for x, y in stitch_batches(20)]
    np.testing.assert_allclose(losses["stitched"], losses["baseline"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(losses["stitched"], losses["unstitched"])
    stitched.picasso.write_back()
    for b, o in zip(baseline.weights, stitched.original.weights):
        np.testing.assert_allclose(o.numpy(), b.numpy(), rtol=1e-4, atol=1e-5, err_msg=b.name)
    x, _ = stitch_batches(1)[0]
    np.testing.assert_allclose(stitched.predict_on_batch(x), baseline.predict_on_batch(x), rtol=1e-5, atol=1e-6)


def test_a_lookup_also_used_elsewhere_is_copied_into_the_stitch():
    x = {n: tf.keras.Input((), dtype="int64", name=n) for n in "ab"}
    table_a, table_b = tf.keras.layers.Embedding(10, 4), tf.keras.layers.Embedding(10, 4)
    ea, eb = table_a(x["a"]), table_b(x["b"])
    out = tf.keras.layers.Dense(1)(tf.keras.layers.Concatenate()([ea, eb])) + tf.reduce_sum(ea, 1, keepdims=True)
    model = picasso.optimize(tf.keras.Model(x, out))
    k_packing = [p for p in model.picasso.reports["training"]["passes"] if p["pass"] == "k_packing"][0]
    assert [(s["sites"], s["copied_inputs"]) for s in k_packing["stitched"]] == [(1, 1)]
    assert k_packing["stitched"][0]["projection"], "the Dense(1) takes the product from the kernel"
    batch = {"a": np.arange(6) % 10, "b": np.arange(6) * 3 % 10}
    np.testing.assert_allclose(model.predict_on_batch(batch), model.original.predict_on_batch(batch),
                               rtol=1e-6, atol=1e-7)
    # b's table is read by the projection alone, and updated inside its gradient kernel;
    # a's by its own lookup, whose output the stitch copies: the lookup's gradient (the
    # projection's share and the sum's, added before it) updates it in its kernel.
    baseline = tf.keras.models.clone_model(model.original)
    baseline.set_weights(model.original.get_weights())
    losses = [run_on(m, [(batch, np.arange(6) % 2)] * 5) for m in (model, baseline)]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    assert sorted(model.picasso.updated_in_gradient) == sorted([table_a.embeddings.name, table_b.embeddings.name])


def test_twin_concatenations_share_one_stitched_lookup():
    """DeepFM's pattern: the FM part stacks the embeddings that the deep part
    concatenates flat; both are the same [B, sum(dims)] layout, so one stitched
    lookup serves both and the model still trains exactly."""
    def build():
        tf.keras.utils.set_random_seed(11)
        x = {n: tf.keras.Input((), dtype="int64", name=n) for n, _, _ in FIELDS}
        embs = [tf.keras.layers.Embedding(v, 8, name=f"emb_{n}")(x[n]) for n, v, _ in FIELDS]
        stacked = tf.stack(embs, axis=1)                                   # [B, 4, 8]
        fm = 0.5 * tf.reduce_sum(tf.square(tf.reduce_sum(stacked, 1)) - tf.reduce_sum(tf.square(stacked), 1),
                                 axis=1, keepdims=True)
        deep = tf.keras.layers.Dense(1)(tf.keras.layers.Concatenate()(embs))  # [B, 32]
        return tf.keras.Model(x, tf.keras.layers.Activation("sigmoid")(fm + deep))

    baseline, optimized = build(), picasso.optimize(build())
    k_packing = [p for p in optimized.picasso.reports["training"]["passes"] if p["pass"] == "k_packing"][0]
    assert [(len(s["concat"]), s["sites"], s["width"]) for s in k_packing["stitched"]] == [(2, 4, 32)]
    np.testing.assert_allclose(run(optimized, tf.keras.optimizers.Adagrad(0.2), 20),
                               run(baseline, tf.keras.optimizers.Adagrad(0.2), 20), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("units", [1, 16])
def test_a_concatenation_feeding_a_dense_gets_the_projection_and_trains_like_the_baseline(units):
    """Lookups, a flattened sequence and a trained dense input, concatenated into a
    Dense: a logistic regression's Dense(1) (per entry) or an MLP's first layer
    Dense(16) (per unique row) is folded into the lookups: neither the concatenation
    nor its gradient is built."""
    def build():
        tf.keras.utils.set_random_seed(5)
        x = {n: tf.keras.Input((), dtype="int64", name=n) for n, _, _ in FIELDS}
        x["seq"] = tf.keras.Input((3,), dtype="int64", name="seq")
        x["num"] = tf.keras.Input((2,), name="num")
        seq = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(30, 4, name="emb_seq")(x["seq"]))
        num = tf.keras.layers.Dense(2, name="num_proj")(x["num"])
        parts = [num, seq] + [tf.keras.layers.Embedding(v, d, name=f"emb_{n}")(x[n]) for n, v, d in FIELDS]
        h = tf.keras.layers.Dense(units, activation="sigmoid" if units == 1 else "relu")(
            tf.keras.layers.Concatenate()(parts))
        return tf.keras.Model(x, h if units == 1 else tf.keras.layers.Dense(1, activation="sigmoid")(h))

    def stitches(model):
        return [p for p in model.picasso.reports["training"]["passes"] if p["pass"] == "k_packing"][0]["stitched"]

    baseline, projected, again = build(), picasso.optimize(build()), picasso.optimize(build())
    plain = picasso.optimize(build(), projection=False)
    separate = picasso.optimize(build(), apply_in_gradient=False)
    plain_separate = picasso.optimize(build(), projection=False, apply_in_gradient=False)
    assert [(s["sites"], s["copied_inputs"], bool(s["projection"])) for s in stitches(projected)] == [(5, 1, True)]
    assert [bool(s["projection"]) for s in stitches(plain)] == [False]
    losses = {}
    models = (("baseline", baseline), ("projected", projected), ("again", again), ("plain", plain),
              ("separate", separate), ("plain_separate", plain_separate))
    for name, model in models:
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.2), loss="binary_crossentropy")
        losses[name] = [model.train_on_batch(x, y) for x, y in stitch_batches(20)]
    # Adagrad changes only the rows with a gradient: the projection's (or without it,
    # the stitched lookup's) gradient kernel updates every table itself, with
    # the same result as a separate update.
    for model in (projected, plain):
        assert sorted(model.picasso.updated_in_gradient) == sorted(v.name for s in model.picasso.storages.values() for v in s.variables())
    assert separate.picasso.updated_in_gradient == plain_separate.picasso.updated_in_gradient == []
    np.testing.assert_allclose(losses["projected"], losses["baseline"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(losses["plain"], losses["baseline"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(losses["projected"], losses["again"])
    np.testing.assert_array_equal(losses["projected"], losses["separate"])
    np.testing.assert_array_equal(losses["plain"], losses["plain_separate"])
    for in_kernel, apart in ((projected, separate), (plain, plain_separate)):
        for a, b in zip(in_kernel.weights, apart.weights):
            np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.name)
    projected.picasso.write_back()
    for b, o in zip(baseline.weights, projected.original.weights):
        np.testing.assert_allclose(o.numpy(), b.numpy(), rtol=1e-4, atol=1e-5, err_msg=b.name)


def test_tables_are_updated_in_the_gradient_kernel_inside_keras_step_loops_too():
    """steps_per_execution > 1 traces the step in a loop body, whose tables are captures
    of captures: still recognised, and training equals one step per call."""
    def build():
        tf.keras.utils.set_random_seed(5)
        x = {n: tf.keras.Input((), dtype="int64", name=n) for n, _, _ in FIELDS}
        parts = [tf.keras.layers.Embedding(v, d, name=f"emb_{n}")(x[n]) for n, v, d in FIELDS]
        return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(tf.keras.layers.Concatenate()(parts)))

    data = batches(6)
    x = {n: np.concatenate([b[0][n] for b in data]) for n, _, _ in FIELDS}
    y = np.concatenate([b[1] for b in data])
    weights = {}
    for steps in (1, 3):
        model = picasso.optimize(build())
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.2), loss="binary_crossentropy",
                      steps_per_execution=steps)
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        assert sorted(model.picasso.updated_in_gradient) == sorted(v.name for s in model.picasso.storages.values() for v in s.variables())
        weights[steps] = [w.numpy() for w in model.weights]
    for a, b in zip(weights[1], weights[3]):
        np.testing.assert_array_equal(a, b)
