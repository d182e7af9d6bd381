"""hybrid_hash=True: the packed groups live in a hash table keyed by row id (the
HybridHash storage kind), fetched per step and updated by the hash table's own ops.
It trains as the tables read in place do, its checkpoints are the plain model's with
the counts and hot set beside, and what it cannot honour is refused by name."""
import functools

import numpy as np
import pytest
import tensorflow as tf

import picasso_tf as picasso
from picasso_tf.embedding.hot_tier import HotTier
from picasso_tf.embedding.hybrid_hash import HybridHashTables
from picasso_tf.errors import HotTierTooLargeError, UnsupportedModelError
from test_program_and_storage import FIELDS, batches, build, plain_weights

# Its tests run on one pytest-xdist worker: they share read_in_place's trainings, cached for the module.
pytestmark = pytest.mark.xdist_group("test_hybrid_hash_storage")


def train(model, data, optimizer=None):
    """The losses of training on `data` (a hash-backed model also logs its hot tier's hit ratio)."""
    if not model.optimizer:
        model.compile(optimizer=optimizer or tf.keras.optimizers.Adagrad(0.2), loss="binary_crossentropy")
    return [float(model.train_on_batch(x, y, return_dict=True)["loss"]) for x, y in data]

OPTIMIZERS = {"sgd": lambda: tf.keras.optimizers.SGD(0.5),
              "adagrad": lambda: tf.keras.optimizers.Adagrad(0.2, initial_accumulator_value=0.05),
              "adagrad with a schedule": lambda: tf.keras.optimizers.Adagrad(
                  tf.keras.optimizers.schedules.ExponentialDecay(0.3, 20, 0.5))}


def hashed(seed=5, **options):
    return picasso.optimize(build(seed=seed), hybrid_hash=True, **options)


def test_every_packed_group_is_hash_backed():
    model = hashed()
    kinds = {s.kind for s in model.picasso.storages.values()}
    assert kinds == {HybridHashTables.kind}
    assert "hybrid_hash   on  {" in model.picasso.report() and "'hashed': [" in model.picasso.report()
    # The model reads no table in place: every lookup of a group reads the rows fetched for the step.
    for graph in model.picasso.program.graphs.values():
        assert not any(n.op == "PicassoReadTables" for n in graph.graph_def.node)


# Hot tiers: none (every row in the hash table), a small one refreshed every few steps
# (rows move between the tiers), and the default, which holds these small tables whole.
SMALL_HOT = dict(hot_storage_bytes=12000, hot_warmup_steps=5, hot_refresh_every=7)
HOT_TIERS = {"no hot tier": dict(hot_storage_bytes=0), "small hot tier": SMALL_HOT, "all hot": {}}


# Keras' Adam decays every row's moments each step (exact), or with lazy_optimizer=True
# only the rows with a gradient.
ADAM = {"adam (exact)": {}, "adam (lazy)": dict(lazy_optimizer=True)}


def make_optimizer(name):
    """A new optimizer named by a key of OPTIMIZERS or ADAM."""
    return OPTIMIZERS[name]() if name in OPTIMIZERS else tf.keras.optimizers.Adam(0.01)


@functools.lru_cache(maxsize=None)
def read_in_place(optimizer, steps):
    """Losses, weights and optimizer variables of the tables read in place, trained
    `steps` steps under `optimizer` without the projection: trained once for the hot
    tiers compared with them."""
    options = dict(projection=False, **ADAM.get(optimizer, {}))
    dense = picasso.optimize(build(), **options)
    losses = train(dense, batches(steps, seed=3), make_optimizer(optimizer))
    return losses, plain_weights(dense), [v.numpy() for v in dense.optimizer.variables]


@pytest.mark.parametrize("optimizer, hot", [(o, "small hot tier") for o in sorted(OPTIMIZERS) + sorted(ADAM)] +
                         [("adagrad", "no hot tier"), ("adagrad", "all hot"), ("adam (exact)", "no hot tier"),
                          ("adam (exact)", "all hot")])
def test_trains_bit_for_bit_as_the_tables_read_in_place(optimizer, hot):
    """100 steps (14 refreshes of the small tier); without the stitched projection
    (which projects the fetched rows in another order) losses, every weight and the
    optimizer's slots are identical."""
    steps = 100
    model = hashed(projection=False, **ADAM.get(optimizer, {}), **HOT_TIERS[hot])
    losses = train(model, batches(steps, seed=3), make_optimizer(optimizer))
    dense_losses, dense_weights, dense_slots = read_in_place(optimizer, steps)
    assert losses == dense_losses
    model.picasso.write_back()
    for a, b in zip(dense_weights, plain_weights(model)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(dense_slots, model.optimizer.variables):   # Adagrad's accumulators too
        np.testing.assert_array_equal(a, b.numpy())


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS) + sorted(ADAM))
def test_a_hot_tier_trained_by_tensorflow_ops_trains_as_the_fused_one(optimizer):
    """A hot tier on a GPU is trained by TensorFlow's own ops (apply_with_tf_ops), with
    the fused kernels' arithmetic in their order: made to on the host, it trains bit for
    bit as the fused tier, through refreshes."""
    data = batches(40, seed=3)
    options = dict(projection=False, **SMALL_HOT, **ADAM.get(optimizer, {}))
    fused, by_tf_ops = hashed(**options), hashed(**options)
    fused.compile(optimizer=make_optimizer(optimizer), loss="binary_crossentropy")
    by_tf_ops.compile(optimizer=make_optimizer(optimizer), loss="binary_crossentropy")
    train(by_tf_ops, data[:1])      # binds the optimizer: Adam's tier is made again for its slots
    for storage in by_tf_ops.picasso.storages.values():
        assert storage.hot.fused
        storage.hot.fused = False
    by_tf_ops.train_function = None     # traced again with the tier's TensorFlow-ops update
    assert train(by_tf_ops, data[1:]) == train(fused, data)[1:]
    for model in (fused, by_tf_ops):
        model.picasso.write_back()
    for a, b in zip(plain_weights(fused) + fused.optimizer.variables,
                    plain_weights(by_tf_ops) + by_tf_ops.optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_with_adam_the_hot_tier_holds_fewer_rows_in_the_same_bytes():
    """hot_storage_bytes counts a row's optimizer slots: Adam's two make a tier of fewer
    rows than Adagrad's one, which keeps its hottest rows through the change."""
    data = batches(12, seed=3)
    model = hashed(projection=False, **SMALL_HOT)
    train(model, data[:8])      # Adagrad: the hot set is chosen after 5 steps
    # A hot key's lookups are counted by the table until it became hot, then by the tier.
    before = {name: (s.hot.capacity, s.hot.held_keys(), s.table.counts(s.hot.held_keys()).numpy()
                     + s.hot.counts.numpy()[:len(s.hot.held_keys())])
              for name, s in model.picasso.storages.items()}
    model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="binary_crossentropy")
    train(model, data[8:10])    # no refresh yet: the hot sets are those bind kept
    for name, storage in model.picasso.storages.items():
        capacity, keys, counts = before[name]
        dim, share = storage.layout.dim, storage.layout.hot_bytes
        assert capacity == share // (2 * dim * 4 + 16) and storage.hot.capacity == share // (3 * dim * 4 + 16)
        assert len(storage.hot.slots) == 2 and storage.table.num_slots == 2
        kept = keys[np.lexsort((keys, -counts))[:storage.hot.capacity]]
        np.testing.assert_array_equal(storage.hot.held_keys(), np.sort(kept))


def test_what_was_traced_before_adam_reads_the_hot_tier_made_for_it():
    """Binding Adam makes the hot tier again (two slots): a prediction or a call traced
    before it reads the new tier after training, as the tables read in place do."""
    data = batches(20, seed=3)
    x = data[0][0]
    dense, model = picasso.optimize(build(), projection=False), hashed(projection=False, **SMALL_HOT)
    for m in (dense, model):
        m.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="binary_crossentropy")
        m.predict(x, verbose=0), m(x)
        train(m, data)
    np.testing.assert_array_equal(model.predict(x, verbose=0), dense.predict(x, verbose=0))
    np.testing.assert_array_equal(model(x), dense(x))


def test_the_hot_rows_live_on_a_gpu_when_there_is_one_and_their_keys_on_the_host():
    device = "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
    for storage in hashed(**SMALL_HOT).picasso.storages.values():
        assert storage.hot.rows.device.endswith(f"{device}:0") and storage.hot.slots[0].device.endswith(f"{device}:0")
        assert storage.hot.keys.device.endswith("CPU:0") and storage.hot.counts.device.endswith("CPU:0")
        assert storage.hot.fused == (device == "CPU")
    for storage in hashed(hot_tier_device="/CPU:0", **SMALL_HOT).picasso.storages.values():
        assert storage.hot.rows.device.endswith("CPU:0") and storage.hot.fused


def test_a_hot_tier_device_or_size_that_cannot_be_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("PICASSO_HOT_TIER_DEVICE", "/CPU:0")
    assert picasso.Config.from_options().hot_tier_device == "/CPU:0"
    monkeypatch.delenv("PICASSO_HOT_TIER_DEVICE")
    with pytest.raises(ValueError, match=r"hot_tier_device is a device TensorFlow sees.*got '/TPU:3'"):
        hashed(hot_tier_device="/TPU:3")
    with pytest.raises(HotTierTooLargeError, match=r"hot tier of group huge \(1099511627776 rows of dim 64: "
                                                   r".* does not fit on /CPU:0 .* lower hot_storage_bytes"):
        HotTier(1 << 40, 64, warmup=0, refresh_every=1, name="huge", device="/CPU:0")


def one_table_model(fold=False):
    """60 rows of dim 4 looked up by 3 ids per example (fold: any ids, folded into the
    table by the model, ids % 60)."""
    tf.keras.utils.set_random_seed(1)
    x = tf.keras.Input((3,), dtype="int64", name="u")
    pooled = tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(60, 4)(x % 60 if fold else x))
    return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(pooled))


def test_the_hot_set_follows_algorithm_1():
    """Lookups counted once per step per distinct id; after the warm-up steps and every
    refresh_every steps after, the hot tier holds the ids with the highest counts (ties:
    the smaller id); the logged hit ratio is the step's share of distinct ids held, and
    the logged tier size the rows it holds."""
    warmup, every, capacity, steps = 4, 3, 7, 14
    rng = np.random.default_rng(0)
    data = [({"u": rng.zipf(1.3, (16, 3)) % 60}, (rng.random(16) < 0.5).astype("float32")) for _ in range(steps)]
    row_bytes = 2 * 4 * 4 + 16
    model = picasso.optimize(one_table_model(), hybrid_hash=True, hot_storage_bytes=capacity * row_bytes,
                             hot_warmup_steps=warmup, hot_refresh_every=every)
    model.compile(optimizer=OPTIMIZERS["adagrad"](), loss="binary_crossentropy")
    (storage,) = model.picasso.storages.values()
    assert storage.hot.capacity == capacity
    counts, hot, ratios = np.zeros(60, np.int64), set(), []
    for step, (x, y) in enumerate(data):
        logs = model.train_on_batch(x, y, return_dict=True)
        distinct = np.unique(x["u"])
        ratios.append(len(hot & set(distinct.tolist())) / len(distinct))
        np.testing.assert_allclose(logs["hot_hit_ratio"], ratios[-1], rtol=1e-6)
        counts[distinct] += 1
        if step + 1 >= warmup and (step + 1 - warmup) % every == 0:
            hot = set(sorted(range(60), key=lambda i: (-counts[i], i))[:capacity])
        assert set(storage.hot.keys.numpy()[storage.hot.keys.numpy() < 60].tolist()) == hot, step
        assert logs["hot_tier_rows"] == len(hot), step       # the tier's size, after the step's refresh
    assert any(r > 0 for r in ratios) and any(r < 1 for r in ratios[warmup:])


def test_a_lookahead_refresh_holds_the_ids_of_the_next_batches():
    """refresh_ahead every 3 steps from the next 4 batches (the scheduled refresh kept
    off): the hot set holds the ids looked up in most of them, then the most counted
    before, then the smaller id; hit ratios follow, and training is the same as without
    a hot tier (rows move between the tiers, never change)."""
    every, ahead, capacity, steps = 3, 4, 7, 14
    rng = np.random.default_rng(1)
    data = [({"u": rng.zipf(1.3, (16, 3)) % 60}, (rng.random(16) < 0.5).astype("float32")) for _ in range(steps)]
    models = {}
    for hot in (capacity, 0):
        models[hot] = picasso.optimize(one_table_model(), hybrid_hash=True, projection=False,
                                       hot_storage_bytes=hot * (2 * 4 * 4 + 16), hot_warmup_steps=10 ** 9)
        models[hot].compile(optimizer=OPTIMIZERS["adagrad"](), loss="binary_crossentropy")
    (storage,) = models[capacity].picasso.storages.values()
    (table,) = [m.name for m in storage.layout.members]
    counts, hot, losses = np.zeros(60, np.int64), set(), {capacity: [], 0: []}
    for step, (x, y) in enumerate(data):
        if step % every == 0:
            storage.refresh_ahead([{table: later["u"]} for later, _ in data[step:step + ahead]])
            future = np.zeros(60, np.int64)
            for later, _ in data[step:step + ahead]:
                future[np.unique(later["u"])] += 1
            hot = set(np.lexsort((np.arange(60), -counts, -future))[:capacity].tolist())
        assert set(storage.hot.keys.numpy()[storage.hot.keys.numpy() < 60].tolist()) == hot, step
        logs = {h: m.train_on_batch(x, y, return_dict=True) for h, m in models.items()}
        distinct = np.unique(x["u"])
        np.testing.assert_allclose(logs[capacity]["hot_hit_ratio"], len(hot & set(distinct.tolist())) / len(distinct),
                                   rtol=1e-6)
        counts[distinct] += 1
        for h in models:
            losses[h].append(float(logs[h]["loss"]))
    assert losses[capacity] == losses[0]


def test_a_lookahead_refresh_refuses_ids_outside_the_table_and_changes_nothing():
    model = picasso.optimize(one_table_model(), hybrid_hash=True, hot_storage_bytes=7 * (2 * 4 * 4 + 16))
    model.compile(optimizer=OPTIMIZERS["adagrad"](), loss="binary_crossentropy")
    (storage,) = model.picasso.storages.values()
    (table,) = [m.name for m in storage.layout.members]
    storage.refresh_ahead([{table: np.arange(5, 12)}])
    before = storage.hot.keys.numpy().copy()
    for bad in (np.array([3, 60]), np.array([-1]), np.array([0.5])):
        with pytest.raises(ValueError, match=f"refresh_ahead.*table {table}.*0, 60"):
            storage.refresh_ahead([{table: np.arange(3)}, {table: bad}])
        np.testing.assert_array_equal(storage.hot.keys.numpy(), before)
    assert sorted(before[before < 60].tolist()) == list(range(5, 12))


# fit(hot_refresh="lookahead") on a dataset of 6 batches (the last one partial), in
# the ways Keras reads a dataset: a new iterator each epoch (its cardinality known or
# not, or steps_per_epoch equal to it), or one iterator across epochs (steps_per_epoch
# of a repeated dataset).
LOOKAHEAD_FITS = {"epochs": (lambda d: d, dict(epochs=3)),
                  "unknown cardinality": (lambda d: d.filter(lambda x, y: True), dict(epochs=2)),
                  "steps_per_epoch of the dataset": (lambda d: d, dict(epochs=2, steps_per_epoch=6)),
                  "steps_per_epoch across epochs": (lambda d: d.repeat(), dict(epochs=3, steps_per_epoch=4))}
LOOKAHEAD = dict(hot_refresh="lookahead", hot_refresh_every=2, hot_lookahead_batches=3)


def fold_data(seed=2, samples=23):
    rng = np.random.default_rng(seed)
    return {"u": (rng.zipf(1.3, (samples, 3)) % 60) + 60 * rng.integers(0, 9, (samples, 3))}, \
        (rng.random(samples) < 0.5).astype("float32")


class StepRecorder(tf.keras.callbacks.Callback):
    """Each step's loss, and the hot set of a one-table model's hot tier (if it has one)
    as the step began (a step begun on a dataset with no batch left ends with no record)."""

    def __init__(self, model):
        super().__init__()
        self.picasso, self.losses, self.hot, self._hot = model.picasso, [], [], None

    def on_train_batch_begin(self, batch, logs=None):
        storages = list(self.picasso.storages.values())
        if getattr(storages[0], "hot", None) is not None:
            keys = storages[0].hot.keys.numpy()
            self._hot = sorted(keys[keys < 60].tolist())

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))
        if self._hot is not None:
            self.hot.append(self._hot)


def lookahead_hot_sets(passes, capacity, steps_per_execution=1):
    """A NumPy model of the hot set as each execution of steps begins under LOOKAHEAD,
    from the ids (in the table) of the batches of each pass Keras reads: refreshed at
    the first execution of a pass and at the first one hot_refresh_every steps or more
    after the last refresh."""
    every, ahead = LOOKAHEAD["hot_refresh_every"], LOOKAHEAD["hot_lookahead_batches"]
    counts, hot_sets = np.zeros(60, np.int64), []
    for read in passes:
        last = None
        for position, ids in enumerate(read):
            if position % steps_per_execution == 0:
                if last is None or position - last >= every:
                    future = np.zeros(60, np.int64)
                    for later in read[position:position + ahead]:
                        future[np.unique(later)] += 1
                    hot, last = sorted(np.lexsort((np.arange(60), -counts, -future))[:capacity].tolist()), position
                hot_sets.append(hot)
            counts[np.unique(ids)] += 1
    return hot_sets


def fit_steps(options, dataset, fit):
    """(model, StepRecorder) of fitting a one-table model (ids folded in the model) with `options`."""
    model = picasso.optimize(one_table_model(fold=True), projection=False, **options)
    model.compile(optimizer=OPTIMIZERS["adagrad"](), loss="binary_crossentropy")
    recorder = StepRecorder(model)
    model.fit(dataset, verbose=0, callbacks=[recorder], **fit)
    return model, recorder


@pytest.mark.parametrize("read", sorted(LOOKAHEAD_FITS))
def test_fit_with_lookahead_trains_as_counts_and_as_tables_read_in_place(read):
    """On a dataset reshuffled each epoch, losses at every step and the trained weights
    are the same as with the hot set chosen from counts and with no hash tables: Keras
    sees the same batches, in the same order, the last partial one included."""
    shape, fit = LOOKAHEAD_FITS[read]
    x, y = fold_data()
    runs = {}
    for name, options in [("lookahead", dict(hybrid_hash=True, hot_storage_bytes=7 * 48, **LOOKAHEAD)),
                          ("counts", dict(hybrid_hash=True, hot_storage_bytes=7 * 48, hot_warmup_steps=2,
                                          hot_refresh_every=2)),
                          ("hybrid_hash=False", dict(hybrid_hash=False))]:
        dataset = shape(tf.data.Dataset.from_tensor_slices((x, y)).shuffle(23, seed=4).batch(4))
        runs[name] = fit_steps(options, dataset, fit)
    steps = fit["epochs"] * fit.get("steps_per_epoch", 6)
    losses = {name: recorder.losses for name, (_, recorder) in runs.items()}
    assert len(losses["lookahead"]) == steps and losses["lookahead"] == losses["counts"] == losses["hybrid_hash=False"]
    assert len({tuple(h) for h in runs["lookahead"][1].hot}) > 1        # the hot set did change
    weights = {name: model.get_weights() for name, (model, _) in runs.items()}
    for a, b, c in zip(*weights.values()):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("read", sorted(LOOKAHEAD_FITS))
def test_fit_with_lookahead_holds_the_ids_of_the_next_batches(read):
    """At the first step of each pass over the dataset and every hot_refresh_every steps
    of it, the hot set becomes the ids (as the model folds them) looked up in most of the
    next hot_lookahead_batches batches of the pass, then the most counted before, then
    the smaller id: a NumPy model of it on the batches Keras reads."""
    shape, fit = LOOKAHEAD_FITS[read]
    x, y = fold_data(seed=3)
    _, recorder = fit_steps(dict(hybrid_hash=True, hot_storage_bytes=7 * 48, **LOOKAHEAD),
                            shape(tf.data.Dataset.from_tensor_slices((x, y)).batch(4)), fit)
    folded = [x["u"][i:i + 4] % 60 for i in range(0, 23, 4)]
    if "steps_per_epoch" in fit and fit["steps_per_epoch"] != len(folded):
        passes = [folded * 3]                       # one iterator of the repeated dataset
    else:
        passes = [folded] * fit["epochs"]
    assert recorder.hot == lookahead_hot_sets(passes, 7)[:fit["epochs"] * fit.get("steps_per_epoch", len(folded))]


def test_with_several_steps_per_execution_a_refresh_waits_for_the_next_execution():
    """steps_per_execution=3, hot_refresh_every=2: Keras runs steps 0-2 and 3-5 of each
    epoch in one call each, so the refreshes come before steps 0 and 3; training is as
    without hash tables."""
    x, y = fold_data(seed=3)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    runs = {}
    for name, options in [("lookahead", dict(hybrid_hash=True, hot_storage_bytes=7 * 48, **LOOKAHEAD)),
                          ("hybrid_hash=False", dict(hybrid_hash=False))]:
        model = picasso.optimize(one_table_model(fold=True), projection=False, **options)
        model.compile(optimizer=OPTIMIZERS["adagrad"](), loss="binary_crossentropy", steps_per_execution=3)
        runs[name] = (model, StepRecorder(model))
        model.fit(dataset, epochs=2, verbose=0, callbacks=[runs[name][1]])
    folded = [x["u"][i:i + 4] % 60 for i in range(0, 23, 4)]
    assert runs["lookahead"][1].hot == lookahead_hot_sets([folded] * 2, 7, steps_per_execution=3)
    assert runs["lookahead"][1].losses == runs["hybrid_hash=False"][1].losses
    for a, b in zip(*(model.get_weights() for model, _ in runs.values())):
        np.testing.assert_array_equal(a, b)


class OneTableSubclass(tf.keras.Model):
    """one_table_model(fold=True) as a subclass, whose inputs picasso_tf learns from the first batch."""

    def __init__(self):
        super().__init__()
        tf.keras.utils.set_random_seed(1)
        self.embedding, self.out = tf.keras.layers.Embedding(60, 4), tf.keras.layers.Dense(1, activation="sigmoid")

    def call(self, features):
        return self.out(tf.reduce_mean(self.embedding(features["u"] % 60), 1))


def test_a_subclassed_model_is_refreshed_from_its_first_step():
    """The model is rewritten on the first batch peeked, before its first step."""
    x, y = fold_data(seed=3)
    model = picasso.optimize(OneTableSubclass(), hybrid_hash=True, hot_storage_bytes=7 * 48, **LOOKAHEAD)
    model.compile(optimizer=OPTIMIZERS["adagrad"](), loss="binary_crossentropy")
    recorder = StepRecorder(model)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), verbose=0, callbacks=[recorder])
    assert recorder.hot == lookahead_hot_sets([[x["u"][i:i + 4] % 60 for i in range(0, 23, 4)]], 7)


def test_the_batches_keras_reads_through_a_peeked_dataset_are_the_datasets():
    """Every iterator of PeekedDataset.dataset reads a new pass of the dataset (a
    shuffle's next order), whatever was peeked, ragged features and a last partial batch
    included; peeks stop at the end of the pass."""
    from picasso_tf.embedding.lookahead import PeekedDataset

    def dataset():
        ragged = tf.ragged.constant([[i] * (i % 3) for i in range(11)], dtype=tf.int64)
        return tf.data.Dataset.from_tensor_slices(({"r": ragged, "d": tf.range(11.0)}, tf.range(11))).shuffle(
            11, seed=5).batch(3)

    def as_lists(batch):
        return tf.nest.map_structure(lambda t: t.to_list() if isinstance(t, tf.RaggedTensor) else t.numpy().tolist(),
                                     batch)

    plain, peeked = dataset(), PeekedDataset(dataset())
    assert int(peeked.dataset.cardinality()) == 4
    for _ in range(3):
        expected, read = [as_lists(b) for b in iter(plain)], []
        iterator = iter(peeked.dataset)
        for step in range(4):
            assert peeked.position()[1] == step
            assert [as_lists(b) for b in peeked.peek(3)] == expected[step:step + 3]
            read.append(as_lists(next(iterator)))
        assert read == expected
        with pytest.raises(StopIteration):
            next(iterator)


def test_an_id_out_of_range_ahead_stops_fit_before_the_refresh_reading_it():
    """Batch 3 holds an id outside the table: the refresh before step 2, which reads
    batches 2-4, stops fit with the error naming the feature, as training on batch 3
    would; the hot set and the weights are those after steps 0-1."""
    x, y = fold_data()
    x = {"u": x["u"] % 60}
    x["u"][13, 1] = 70
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    model = picasso.optimize(one_table_model(), hybrid_hash=True, projection=False, hot_storage_bytes=7 * 48,
                             **LOOKAHEAD)
    model.compile(optimizer=OPTIMIZERS["adagrad"](), loss="binary_crossentropy")
    (storage,) = model.picasso.storages.values()
    recorder = StepRecorder(model)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"ids of feature.*u.*got.*70"):
        model.fit(dataset, verbose=0, callbacks=[recorder])
    keys = storage.hot.keys.numpy()
    assert len(recorder.hot) == 2 and sorted(keys[keys < 60].tolist()) == recorder.hot[0]
    plain = picasso.optimize(one_table_model(), projection=False)
    plain.compile(optimizer=OPTIMIZERS["adagrad"](), loss="binary_crossentropy")
    plain.fit(dataset.take(2), verbose=0)
    for a, b in zip(plain.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_lookahead_options_and_input_it_cannot_read_ahead_are_refused_by_name():
    for bad, named in [(dict(hot_refresh="future"), "hot_refresh must be 'counts'.*'future'"),
                       (dict(hot_lookahead_batches=0), "hot_lookahead_batches must be.*0")]:
        with pytest.raises(ValueError, match=named):
            picasso.Config(**bad)
    assert picasso.Config(hot_refresh_every=5).lookahead_batches == 5
    model = picasso.optimize(one_table_model(), hybrid_hash=True, hot_storage_bytes=7 * 48, **LOOKAHEAD)
    model.compile(optimizer=OPTIMIZERS["adagrad"](), loss="binary_crossentropy")
    x, y = fold_data()
    x = {"u": x["u"] % 60}
    with pytest.raises(TypeError, match="hot_refresh='lookahead'.*tf.data.Dataset; got dict"):
        model.fit(x, y, batch_size=4, verbose=0)
    with pytest.raises(ValueError, match="hot_refresh='lookahead'.*class_weight"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(4), class_weight={0: 1.0, 1: 2.0}, verbose=0)
    assert int(model.optimizer.iterations) == 0


def test_a_hot_tier_that_holds_every_row_holds_them_from_the_start():
    model = hashed()
    model.compile(optimizer=OPTIMIZERS["sgd"](), loss="binary_crossentropy")
    history = model.fit(tf.data.Dataset.from_tensor_slices(batches(1)[0]).batch(8), epochs=1, verbose=0)
    assert history.history["hot_hit_ratio"] == [1.0]
    for storage in model.picasso.storages.values():
        assert storage.hot.capacity == storage.layout.num_rows


def test_with_every_pass_on_it_trains_as_keras():
    data = batches(30, seed=4)
    plain, model = build(), hashed()
    np.testing.assert_allclose(train(model, data), train(plain, data), rtol=1e-5)
    np.testing.assert_allclose(model.predict(data[0][0], verbose=0), plain.predict(data[0][0], verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_checkpoints_are_the_plain_models_and_training_continues_exactly(tmp_path):
    """Weights and Adagrad's accumulators go to the plain model's checkpoint keys: a
    hash-backed model restores into the plain model and into another hash-backed model,
    which trains on exactly as the one that never stopped."""
    first = hashed(projection=False, **SMALL_HOT)
    train(first, batches(9), OPTIMIZERS["adagrad"]())
    first.save_weights(str(tmp_path / "ckpt"))
    tf.train.Checkpoint(model=first, optimizer=first.optimizer).write(str(tmp_path / "object_ckpt"))

    plain = build(seed=6)
    plain.compile(optimizer=OPTIMIZERS["adagrad"](), loss="binary_crossentropy")
    plain.optimizer.build(plain.trainable_variables)
    tf.train.Checkpoint(model=plain, optimizer=plain.optimizer).read(str(tmp_path / "object_ckpt")).expect_partial()
    for a, b in zip(plain_weights(first), plain_weights(plain)):
        np.testing.assert_array_equal(a, b)

    second = hashed(seed=7, projection=False, **SMALL_HOT)
    second.compile(optimizer=OPTIMIZERS["adagrad"](), loss="binary_crossentropy")
    train(second, batches(1, seed=8))          # its own rows and accumulators, which the restore replaces
    second.load_weights(str(tmp_path / "ckpt"))
    after = batches(6, seed=1)
    assert train(second, after) == train(first, after)
    first.picasso.write_back()
    second.picasso.write_back()
    for a, b in zip(plain_weights(first), plain_weights(second)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(first.optimizer.variables, second.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def hash_state(model):
    """Per logical table, every row's count and the hot row ids, as a checkpoint saves them."""
    return {m.name: storage.saved_state(i) for storage in model.picasso.storages.values()
            for i, m in enumerate(storage.layout.members)}


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for name in a:
        for x, y in zip(a[name], b[name]):
            np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.mark.parametrize("how", ["save_weights", "tf.train.Checkpoint"])
def test_checkpoints_carry_the_counts_and_the_hot_set(tmp_path, how):
    """Saved between refreshes (after steps 5 and 12), a hash-backed model restores into
    another one with the same counts and hot set, whose hit ratios, losses and state
    then follow the uninterrupted run's."""
    data = batches(16, seed=2)
    first = hashed(projection=False, **SMALL_HOT)
    train(first, data[:9], OPTIMIZERS["adagrad"]())
    second = hashed(seed=7, projection=False, **SMALL_HOT)
    second.compile(optimizer=OPTIMIZERS["adagrad"](), loss="binary_crossentropy")
    train(second, batches(1, seed=8))           # its own counts, which the restore replaces
    path = str(tmp_path / "ckpt")
    if how == "save_weights":
        first.save_weights(path)
        second.load_weights(path)
    else:
        tf.train.Checkpoint(model=first, optimizer=first.optimizer).write(path)
        tf.train.Checkpoint(model=second, optimizer=second.optimizer).read(path).assert_consumed()
        second.picasso.read_back()
    saved = hash_state(first)
    assert all(len(hot) for _, hot in saved.values()) and sum(c.sum() for c, _ in saved.values()) > 0
    assert_same_state(hash_state(second), saved)

    def go_on(model):
        logs = [model.train_on_batch(x, y, return_dict=True) for x, y in data[9:]]
        return [(float(g["loss"]), float(g["hot_hit_ratio"])) for g in logs]

    assert go_on(second) == go_on(first)
    assert_same_state(hash_state(second), hash_state(first))


def test_plain_checkpoints_restore_both_ways(tmp_path):
    """A hash-backed model's checkpoint restores into the plain Keras model, and the
    plain model's into a new hash-backed one, which starts with no counts and an empty
    hot set (a hot tier that holds every row: all of them)."""
    hashed_model = hashed(projection=False, **SMALL_HOT)
    train(hashed_model, batches(9), OPTIMIZERS["adagrad"]())
    hashed_model.save_weights(str(tmp_path / "hashed"))
    plain = build(seed=6)
    plain.compile(optimizer=OPTIMIZERS["adagrad"](), loss="binary_crossentropy")
    plain.load_weights(str(tmp_path / "hashed"))
    for a, b in zip(plain_weights(hashed_model), plain_weights(plain)):
        np.testing.assert_array_equal(a, b)

    data = batches(4, seed=3)
    train(plain, data)
    plain.save_weights(str(tmp_path / "plain"))
    for hot in ("small hot tier", "all hot"):
        model = hashed(seed=7, projection=False, **HOT_TIERS[hot])
        model.compile(optimizer=OPTIMIZERS["adagrad"](), loss="binary_crossentropy")
        model.load_weights(str(tmp_path / "plain"))
        for a, b in zip(plain_weights(plain), plain_weights(model)):
            np.testing.assert_array_equal(a, b)
        for table, (counts, hot_ids) in hash_state(model).items():
            assert not counts.any(), table
            rows = dict((f"emb_{n}/embeddings", v) for n, v, _ in FIELDS)[table]
            assert hot_ids.tolist() == (list(range(rows)) if hot == "all hot" else []), table


def test_a_hash_state_that_does_not_fit_the_table_is_refused_and_changes_nothing():
    model = hashed(projection=False, **SMALL_HOT)
    train(model, batches(7), OPTIMIZERS["adagrad"]())
    before = hash_state(model)
    (storage, member), = [(s, i) for s in model.picasso.storages.values()
                          for i, m in enumerate(s.layout.members) if m.name == "emb_u/embeddings"]
    counts, hot = before["emb_u/embeddings"]
    assert hot.size
    for bad in [(counts[:-1], hot), (counts.astype(np.int32), hot), (counts, np.append(hot, 50)),
                (counts, np.append(hot, hot[:1]))]:
        with pytest.raises(ValueError, match="hash state of table emb_u/embeddings.*another vocabulary"):
            storage.restore_state(member, *bad)
    model.picasso.read_back()
    assert_same_state(hash_state(model), before)


def test_recompiling_continues_from_the_trained_rows():
    data = batches(8, seed=2)
    dense, model = picasso.optimize(build(), projection=False), hashed(projection=False)
    for m in (dense, model):
        train(m, data[:4], OPTIMIZERS["sgd"]())
        m.compile(optimizer=OPTIMIZERS["adagrad"](), loss="binary_crossentropy")
    assert train(model, data[4:]) == train(dense, data[4:])


@pytest.mark.parametrize("make, named", [
    (lambda: tf.keras.optimizers.Adam(0.01, amsgrad=True), r"Adam \(amsgrad=True\)"),
    (lambda: tf.keras.optimizers.RMSprop(0.01), "RMSprop"),
    (lambda: tf.keras.optimizers.SGD(0.1, momentum=0.9), "SGD"),
    (lambda: tf.keras.optimizers.Adagrad(0.1, weight_decay=0.01), "weight_decay=0.01")])
def test_optimizers_the_hash_table_cannot_apply_are_refused_by_name(make, named):
    model = hashed()
    model.compile(optimizer=make(), loss="binary_crossentropy")
    with pytest.raises(UnsupportedModelError, match=f"hybrid_hash=True.*{named}"):
        model.picasso.check_optimizer(model.optimizer)      # before training
    x, y = batches(1)[0]
    with pytest.raises(UnsupportedModelError, match=f"hybrid_hash=True.*{named}"):
        model.train_on_batch(x, y)


def test_an_id_out_of_range_names_the_feature_and_changes_nothing():
    model = hashed()
    train(model, batches(2))
    model.picasso.write_back()
    before = plain_weights(model)
    x, y = batches(1, seed=5)[0]
    x = dict(x, i=np.where(np.arange(len(x["i"])) == 3, 70, x["i"]))   # the vocabulary of "i" is 70
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"ids of feature.*i.*got.*70"):
        model.train_on_batch(x, y)
    model.picasso.write_back()
    for a, b in zip(before, plain_weights(model)):
        np.testing.assert_array_equal(a, b)


def test_groups_the_hash_cannot_hold_stay_read_in_place_with_a_reason():
    model = picasso.optimize(build(frozen=("g",), constraint_of_u=tf.keras.constraints.MaxNorm(0.5)),
                             hybrid_hash=True)
    passes = {p["pass"]: p for p in model.picasso.reports["training"]["passes"]}
    reasons = " ".join(passes["hybrid_hash"]["read_in_place"].values())
    assert "frozen" in reasons and "emb_u/embeddings has a constraint" in reasons
    data = batches(5)
    plain = build(frozen=("g",), constraint_of_u=tf.keras.constraints.MaxNorm(0.5))
    np.testing.assert_allclose(train(model, data), train(plain, data), rtol=1e-5)


def test_micro_batches_are_refused_with_hybrid_hash():
    with pytest.raises(UnsupportedModelError, match="micro_batches=2"):
        hashed(micro_batches=2)


def test_every_row_is_in_the_table_and_exported_to_the_original_model(tmp_path):
    model = hashed()
    train(model, batches(3))
    storage = next(iter(model.picasso.storages.values()))
    assert int(storage.table.size()) == storage.layout.num_rows
    model.picasso.export(str(tmp_path / "saved"))
    served = tf.saved_model.load(str(tmp_path / "saved"))
    x, _ = batches(1, seed=2)[0]
    out = served.signatures["serving_default"](**{n: tf.constant(x[n]) for n, _, _ in FIELDS})
    np.testing.assert_allclose(next(iter(out.values())).numpy(), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)
