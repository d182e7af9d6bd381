"""dynamic_vocabulary: features hashed into bins right before their embedding are keyed
by their raw ids in hash tables instead. Trains like a Keras model with one row per
raw id (no collisions), admits and evicts keys as documented, refuses a batch beyond
the capacity without changing anything, and checkpoints and exports what it trained."""
import numpy as np
import pytest
import tensorflow as tf

import picasso_tf as picasso
from picasso_tf.embedding.dynamic_vocabulary import DynamicVocabularyTables
from picasso_tf.embedding.hot_tier import EMPTY
from picasso_tf.errors import UnsupportedModelError
from picasso_tf.ops.hybrid_hash import HashTable

DIM = 4


def hashed_model(seed=0, bins=(7, 5, 6), user_dim=DIM):
    """Three features hashed into a few bins (so raw ids collide in the written model):
    an integer user id (Keras Hashing), string tags (Keras Hashing) and an item id (a
    modulo); each an Embedding, pooled, concatenated, one Dense."""
    tf.keras.utils.set_random_seed(seed)
    user = tf.keras.Input(shape=(1,), dtype=tf.int64, name="user")
    tags = tf.keras.Input(shape=(2,), dtype=tf.string, name="tags")
    item = tf.keras.Input(shape=(1,), dtype=tf.int64, name="item")
    parts = [
        tf.keras.layers.Flatten()(tf.keras.layers.Embedding(bins[0], user_dim, name="emb_user")(
            tf.keras.layers.Hashing(bins[0])(user))),
        tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(bins[1], DIM, name="emb_tags")(
            tf.keras.layers.Hashing(bins[1])(tags))),
        tf.keras.layers.Flatten()(tf.keras.layers.Embedding(bins[2], DIM, name="emb_item")(
            tf.keras.layers.Lambda(lambda x: x % bins[2])(item))),
    ]
    out = tf.keras.layers.Dense(1, activation="sigmoid", name="head")(
        tf.keras.layers.Concatenate()(parts))
    return tf.keras.Model([user, tags, item], out)


def batches(steps, batch=16, users=40, items=30, seed=1):
    rng = np.random.default_rng(seed)
    words = np.array([f"w{i}" for i in range(12)])
    return [({"user": rng.integers(0, users, (batch, 1)) * 1000 + 7,
              "tags": words[rng.integers(0, len(words), (batch, 2))],
              "item": rng.integers(0, items, (batch, 1)) * 13},
             rng.integers(0, 2, (batch, 1)).astype(np.float32)) for _ in range(steps)]


def keys_of(feature, values):
    """The raw keys a feature's values are looked up by."""
    if feature == "tags":
        return tf.strings.to_hash_bucket_fast(values.reshape(-1), (1 << 63) - 1).numpy()
    return values.reshape(-1).astype(np.int64)


def storage_of(model):
    [storage] = [s for s in model.picasso.storages.values() if s.kind == DynamicVocabularyTables.kind]
    return storage


def table_of(model, layer):
    storage = storage_of(model)
    member = next(i for i, m in enumerate(storage.layout.members) if m.name.startswith(layer + "/"))
    return storage.tables[member]


def train(model, data):
    return [float(model.train_on_batch(x, y, return_dict=True)["loss"]) for x, y in data]


TABLES = {"user": "emb_user", "tags": "emb_tags", "item": "emb_item"}


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_trains_like_keras_with_one_row_per_raw_id(optimizer):
    """The reference: the same model in plain Keras with an exact vocabulary (one row per
    raw id, the ids mapped to rows before the model), its rows starting as the hash
    tables' initial rows. 20 steps: the same losses, rows and head."""
    make = {"sgd": lambda: tf.keras.optimizers.SGD(0.5),
            "adagrad": lambda: tf.keras.optimizers.Adagrad(0.3, initial_accumulator_value=0.05)}[optimizer]
    data = batches(20)
    model = picasso.optimize(hashed_model(), dynamic_vocabulary=True)
    model.compile(make(), "binary_crossentropy")
    vocabulary, initial = {}, {}
    for feature, layer in TABLES.items():
        vocabulary[feature] = np.unique(np.concatenate([keys_of(feature, x[feature]) for x, _ in data]))
        # A table drawing new rows as the model's does (the model's own would count these lookups).
        twin = HashTable(DIM, initializer=model.original.get_layer(layer).embeddings_initializer,
                         seed=table_of(model, layer).seed)
        initial[feature] = twin.find_or_insert(vocabulary[feature]).numpy()

    user = tf.keras.Input(shape=(1,), dtype=tf.int64, name="user")
    tags = tf.keras.Input(shape=(2,), dtype=tf.int64, name="tags")
    item = tf.keras.Input(shape=(1,), dtype=tf.int64, name="item")
    embed = {f: tf.keras.layers.Embedding(len(vocabulary[f]), DIM, name=TABLES[f]) for f in TABLES}
    parts = [tf.keras.layers.Flatten()(embed["user"](user)),
             tf.keras.layers.GlobalAveragePooling1D()(embed["tags"](tags)),
             tf.keras.layers.Flatten()(embed["item"](item))]
    reference = tf.keras.Model([user, tags, item], tf.keras.layers.Dense(1, activation="sigmoid", name="head")(
        tf.keras.layers.Concatenate()(parts)))
    for feature in TABLES:
        embed[feature].set_weights([initial[feature]])
    reference.get_layer("head").set_weights(model.original.get_layer("head").get_weights())
    reference.compile(make(), "binary_crossentropy")

    def rows(x):
        return {f: np.searchsorted(vocabulary[f], keys_of(f, x[f])).reshape(x[f].shape) for f in TABLES}

    expected = [float(reference.train_on_batch(rows(x), y)) for x, y in data]
    np.testing.assert_allclose(train(model, data), expected, rtol=1e-5)
    trained = model.picasso.vocabulary()
    for feature, layer in TABLES.items():
        keys, values = trained[f"{layer}/embeddings"]
        np.testing.assert_array_equal(keys, vocabulary[feature])
        np.testing.assert_allclose(values, embed[feature].get_weights()[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(model.original.get_layer("head").get_weights(), reference.get_layer("head").get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_report_says_it_is_a_different_model_and_names_the_features():
    model = picasso.optimize(hashed_model(), dynamic_vocabulary=True)
    report = model.picasso.report()
    assert "different (collision-free) model" in report
    assert "'user': 'the integer id'" in report and "'tags': \"the string's fingerprint\"" in report
    assert "'item': 'the integer id'" in report


def test_unknown_ids_read_zeros_when_serving_and_nothing_is_inserted():
    model = picasso.optimize(hashed_model(), dynamic_vocabulary=True)
    model.compile("adagrad", "binary_crossentropy")
    x, y = batches(1)[0]
    train(model, [(x, y)])
    before = {k: v[0].copy() for k, v in model.picasso.vocabulary().items()}
    unseen = {"user": x["user"] + 1, "tags": np.full_like(x["tags"], "never"), "item": x["item"] + 1}
    head = model.original.get_layer("head")
    expected = np.full((len(x["item"]), 1), tf.sigmoid(head.bias).numpy()[0])     # every row zeros
    np.testing.assert_allclose(model.predict(unseen, verbose=0), expected, rtol=1e-6)
    for k, v in model.picasso.vocabulary().items():
        np.testing.assert_array_equal(v[0], before[k])


def only_user_model(admit_after=1, **options):
    """One feature: user ids hashed into 3 bins; its embedding summed by a frozen Dense of
    ones, so that a prediction is the sum of the user's row."""
    tf.keras.utils.set_random_seed(0)
    user = tf.keras.Input(shape=(1,), dtype=tf.int64, name="user")
    embedded = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(3, DIM, name="emb_user")(
        tf.keras.layers.Hashing(3)(user)))
    out = tf.keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", trainable=False)(embedded)
    model = picasso.optimize(tf.keras.Model(user, out), dynamic_vocabulary=True, admit_after=admit_after, **options)
    model.compile(tf.keras.optimizers.SGD(0.1), "mse")
    return model


def keys_held(model):
    return model.picasso.vocabulary()["emb_user/embeddings"][0].tolist()


@pytest.mark.parametrize("admission_filter", ["exact", "bloom"])
def test_a_key_gets_a_row_on_its_admit_after_th_lookup(admission_filter):
    model = only_user_model(admit_after=3, admission_filter=admission_filter)
    ones = np.ones((2, 1), np.float32)
    # Key 5 twice in the first batch (two lookups), key 9 once: neither has a row yet.
    logs = model.train_on_batch(np.array([[5], [5]]), ones, return_dict=True)
    assert keys_held(model) == [] and logs["loss"] == pytest.approx(1.0)     # their rows read zeros: (1 - 0)^2
    assert logs["vocabulary_keys"] == 0
    model.train_on_batch(np.array([[9], [7]]), ones)
    assert keys_held(model) == []
    model.train_on_batch(np.array([[5], [9]]), ones)                # key 5's third lookup
    assert keys_held(model) == [5]
    table = table_of(model, "emb_user")
    assert table.counts([5]).numpy().tolist() == [1]                # counted from its admission on


def test_a_bloom_filter_admits_early_never_late():
    # One counter for every key: the third lookup of any keys admits them all.
    model = only_user_model(admit_after=3, admission_filter="bloom", bloom_filter_counters=1)
    ones = np.ones((2, 1), np.float32)
    model.train_on_batch(np.array([[1], [2]]), ones)
    assert keys_held(model) == []
    model.train_on_batch(np.array([[3], [4]]), ones)
    assert keys_held(model) == [3, 4]


def lfu_reference(data, capacity):
    """What LFU eviction leaves: per step, each distinct key of the batch counts one
    lookup at that step; a table over the capacity keeps its 9/10 looked up in the most
    steps, then most recently, then smallest."""
    counts, last = {}, {}
    for step, x in enumerate(data):
        for key in np.unique(x):
            counts[key] = counts.get(key, 0) + 1
            last[key] = step
        if len(counts) > capacity:
            kept = sorted(counts, key=lambda k: (-counts[k], -last[k], k))[:int(capacity * 0.9)]
            counts, last = {k: counts[k] for k in kept}, {k: last[k] for k in kept}
    return sorted(counts), counts


def test_lfu_eviction_keeps_the_keys_looked_up_in_most_steps():
    rng = np.random.default_rng(4)
    data = [rng.zipf(1.5, (8, 1)) % 60 for _ in range(30)]
    model = only_user_model(vocabulary_capacity=20)
    for x in data:
        logs = model.train_on_batch(x, np.ones((8, 1), np.float32), return_dict=True)
    expected, counts = lfu_reference(data, 20)
    assert logs["vocabulary_keys"] == len(expected)          # the training logs' count, after the eviction
    assert keys_held(model) == expected
    assert table_of(model, "emb_user").counts(expected).numpy().tolist() == [counts[k] for k in expected]


def test_steps_to_live_evict_the_keys_not_looked_up_since():
    model = only_user_model(eviction="ttl", steps_to_live=2)
    ones = np.ones((1, 1), np.float32)
    model.train_on_batch(np.array([[10]]), ones)        # step 0
    model.train_on_batch(np.array([[11]]), ones)        # step 1
    assert keys_held(model) == [10, 11]
    model.train_on_batch(np.array([[12]]), ones)        # step 2: due; key 10 was last looked up 2 steps ago
    assert keys_held(model) == [11, 12]
    model.train_on_batch(np.array([[13]]), ones)        # step 3: not due
    assert keys_held(model) == [11, 12, 13]


def test_a_batch_beyond_the_capacity_is_refused_and_changes_nothing():
    model = only_user_model(vocabulary_capacity=4)
    model.train_on_batch(np.array([[1], [2]]), np.ones((2, 1), np.float32))
    before = model.picasso.vocabulary()["emb_user/embeddings"]
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"distinct ids of user.*vocabulary_capacity=4"):
        model.train_on_batch(np.arange(6)[:, None] + 10, np.ones((6, 1), np.float32))
    after = model.picasso.vocabulary()["emb_user/embeddings"]
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])


def test_a_batch_beyond_the_capacity_changes_no_table_of_any_group():
    """Two tables in one group (user, tags: same dim) and one in another (item): a batch
    whose user ids exceed the capacity inserts and counts nothing anywhere."""
    model = picasso.optimize(hashed_model(), dynamic_vocabulary=True, vocabulary_capacity=20, admit_after=2,
                             max_shards=1)
    model.compile(tf.keras.optimizers.Adagrad(0.1), "binary_crossentropy")
    x, y = batches(1, batch=8)[0]
    train(model, [(x, y), (x, y)])
    before = {name: [t.numpy() for t in table_of(model, layer).export()] for name, layer in TABLES.items()}
    crowded = dict(batches(1, batch=24, seed=5)[0][0], user=np.arange(24)[:, None] + 10**6)
    with pytest.raises(tf.errors.InvalidArgumentError, match="distinct ids of user.*vocabulary_capacity=20"):
        model.train_on_batch(crowded, np.ones((24, 1), np.float32))
    for name, layer in TABLES.items():
        for a, b in zip(before[name], table_of(model, layer).export()):
            np.testing.assert_array_equal(a, b.numpy())
    counter = storage_of(model).filters
    assert all(int(f.table.size()) == 0 for f in counter)      # every key seen twice: admitted, counts gone


def test_checkpoint_round_trip_then_training_goes_on_identically(tmp_path):
    data = batches(6)
    options = dict(dynamic_vocabulary=True, admit_after=2)
    first = picasso.optimize(hashed_model(), **options)
    first.compile(tf.keras.optimizers.Adagrad(0.2), "binary_crossentropy")
    train(first, data[:3])
    path = str(tmp_path / "ckpt")
    tf.train.Checkpoint(model=first, optimizer=first.optimizer).write(path)
    second = picasso.optimize(hashed_model(seed=9), **options)
    second.compile(tf.keras.optimizers.Adagrad(0.2), "binary_crossentropy")
    second.train_on_batch(*batches(1, seed=7)[0])           # state to be replaced
    tf.train.Checkpoint(model=second, optimizer=second.optimizer).read(path).assert_consumed()
    for table in TABLES.values():
        a, b = table_of(first, table).export(), table_of(second, table).export()
        for x, y in zip(a, b):      # keys, values, slots, counts and last steps
            np.testing.assert_array_equal(x.numpy(), y.numpy())
    assert train(second, data[3:]) == train(first, data[3:])


def test_save_weights_in_tensorflow_format_carries_the_vocabularies(tmp_path):
    first = only_user_model(admit_after=2)
    for x in [[[1], [2], [2]], [[1], [3], [4]]]:
        first.train_on_batch(np.array(x), np.ones((3, 1), np.float32))
    first.save_weights(str(tmp_path / "weights"))
    second = only_user_model(admit_after=2)
    second.load_weights(str(tmp_path / "weights"))
    for a, b in zip(table_of(first, "emb_user").export(), table_of(second, "emb_user").export()):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert keys_held(second) == [1, 2]
    second.train_on_batch(np.array([[3]]), np.ones((1, 1), np.float32))      # its second lookup: admitted
    assert keys_held(second) == [1, 2, 3]


def test_restoring_into_a_smaller_capacity_keeps_the_keys_ranked_first(tmp_path):
    first = only_user_model()
    for x in [[[1], [2], [3]], [[1], [2], [4]], [[1], [5], [6]]]:
        first.train_on_batch(np.array(x), np.ones((3, 1), np.float32))
    path = str(tmp_path / "ckpt")
    tf.train.Checkpoint(model=first).write(path)
    second = only_user_model(vocabulary_capacity=3)
    tf.train.Checkpoint(model=second).read(path).expect_partial()
    # counts 1:3, 2:2, then one step each: 5 and 6 looked up last (step 2), 5 the smaller.
    assert keys_held(second) == [1, 2, 5]


def test_only_the_named_features_and_the_reasons_for_the_others():
    model = picasso.optimize(hashed_model(user_dim=8), dynamic_vocabulary=["user"])    # a group of its own
    report = model.picasso.reports["training"]
    dynamic = next(p for p in report["passes"] if p["pass"] == "dynamic_vocabulary")
    assert list(dynamic["raw_keys"]) == ["user"]
    # Of the same dim as the others, it is packed apart from them (D-packing keeps the tables to key by raw id apart).
    packed = picasso.optimize(hashed_model(), dynamic_vocabulary=["user"])
    dynamic = next(p for p in packed.picasso.reports["training"]["passes"] if p["pass"] == "dynamic_vocabulary")
    assert list(dynamic["raw_keys"]) == ["user"]
    with pytest.raises(ValueError, match=r"dynamic_vocabulary names \['nope'\]"):
        picasso.optimize(hashed_model(), dynamic_vocabulary=["nope"])


def test_a_hashed_table_is_not_held_back_by_an_unhashed_one_of_the_same_dim():
    tf.keras.utils.set_random_seed(0)
    user = tf.keras.Input(shape=(1,), dtype=tf.int64, name="user")
    item = tf.keras.Input(shape=(1,), dtype=tf.int64, name="item")
    parts = [tf.keras.layers.Flatten()(tf.keras.layers.Embedding(7, DIM, name="emb_user")(
        tf.keras.layers.Hashing(7)(user))),
        tf.keras.layers.Flatten()(tf.keras.layers.Embedding(30, DIM, name="emb_item")(item))]
    model = picasso.optimize(tf.keras.Model([user, item], tf.keras.layers.Dense(1)(
        tf.keras.layers.Concatenate()(parts))), dynamic_vocabulary=True)
    kinds = {s.kind: [m.name for m in s.layout.members] for s in model.picasso.storages.values()}
    assert kinds == {"dynamic_vocabulary": ["emb_user/embeddings"], "tables": ["emb_item/embeddings"]}


def test_what_cannot_make_new_rows_or_differs_between_graphs_stays_and_says_why():
    tf.keras.utils.set_random_seed(0)

    class DropSomeIds(tf.keras.layers.Layer):
        """Id dropout: in training only, between the hash and the lookup."""
        def call(self, ids, training=None):
            return ids * tf.cast(ids % 2 == 0, ids.dtype) if training else ids

    user = tf.keras.Input(shape=(1,), dtype=tf.int64, name="user")
    item = tf.keras.Input(shape=(1,), dtype=tf.int64, name="item")
    tags = tf.keras.Input(shape=(1,), dtype=tf.int64, name="tags")
    parts = [tf.keras.layers.Flatten()(tf.keras.layers.Embedding(7, 8, name="emb_user")(
                 DropSomeIds()(tf.keras.layers.Hashing(7)(user)))),
             tf.keras.layers.Flatten()(tf.keras.layers.Embedding(9, 4, embeddings_initializer="glorot_uniform",
                                                                 name="emb_item")(tf.keras.layers.Hashing(9)(item))),
             tf.keras.layers.Flatten()(tf.keras.layers.Embedding(5, 2, name="emb_tags")(tags % 5))]
    model = picasso.optimize(tf.keras.Model([user, item, tags], tf.keras.layers.Dense(1)(
        tf.keras.layers.Concatenate()(parts))), dynamic_vocabulary=True)
    dynamic = next(p for p in model.picasso.reports["training"]["passes"] if p["pass"] == "dynamic_vocabulary")
    assert list(dynamic["raw_keys"]) == ["tags"]
    left = " ".join(dynamic["left_alone"].values())
    # The ids are multiplied between the hash and the lookup in the training graph only.
    assert "the ids of emb_user/embeddings are not hashed into bins right before the lookup" in left
    assert "table emb_item/embeddings's initializer GlorotUniform draws from a distribution that depends" in left
    model.compile(tf.keras.optimizers.Adagrad(0.1), "mse")
    model.train_on_batch({"user": np.arange(4)[:, None], "item": np.arange(4)[:, None],
                          "tags": np.arange(4)[:, None] * 100}, np.ones((4, 1), np.float32))
    assert model.picasso.vocabulary()["emb_tags/embeddings"][0].tolist() == [0, 100, 200, 300]


def test_a_capacity_of_one_keeps_one_key():
    model = only_user_model(vocabulary_capacity=1)
    for key in [5, 5, 6]:
        model.train_on_batch(np.array([[key]]), np.ones((1, 1), np.float32))
    assert keys_held(model) == [5]       # looked up in more steps than 6


def test_ids_not_hashed_right_before_the_lookup_stay_and_say_why():
    tf.keras.utils.set_random_seed(0)
    ids = tf.keras.Input(shape=(1,), dtype=tf.int64, name="ids")
    out = tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(tf.keras.layers.Embedding(10, DIM)(ids)))
    model = picasso.optimize(tf.keras.Model(ids, out), dynamic_vocabulary=True)
    dynamic = next(p for p in model.picasso.reports["training"]["passes"] if p["pass"] == "dynamic_vocabulary")
    assert not dynamic["changed"]
    assert "not hashed into bins right before the lookup" in str(dynamic["left_alone"])


def test_refusals_name_the_option():
    model = picasso.optimize(hashed_model(), dynamic_vocabulary=True)
    model.compile(tf.keras.optimizers.Adam(), "binary_crossentropy")
    with pytest.raises(UnsupportedModelError, match="dynamic_vocabulary.*SGD without momentum or Adagrad.*Adam"):
        model.train_on_batch(*batches(1)[0])
    for what, call in [("model.picasso.export", lambda: model.picasso.export("/tmp/never")),
                       ("model.save", lambda: model.save("/tmp/never.keras")),
                       ("save_weights", lambda: model.save_weights("/tmp/never.h5")),
                       ("load_weights", lambda: model.load_weights("/tmp/never.h5")),
                       ("get_weights", model.get_weights)]:
        with pytest.raises(UnsupportedModelError, match=f"{what}.*untrained hash bins.*model.picasso.vocabulary"):
            call()
    x, y = batches(1)[0]
    for callback in [tf.keras.callbacks.EarlyStopping(restore_best_weights=True),
                     tf.keras.callbacks.ModelCheckpoint("/tmp/never.keras")]:
        with pytest.raises(UnsupportedModelError, match="untrained hash bins"):
            model.fit(x, y, epochs=2, callbacks=[callback], verbose=0)
    with pytest.raises(UnsupportedModelError, match="micro_batches=2"):
        picasso.optimize(hashed_model(), dynamic_vocabulary=True, micro_batches=2)
    with pytest.raises(UnsupportedModelError, match="dynamic_vocabulary.*packing=False"):
        picasso.optimize(hashed_model(), dynamic_vocabulary=True, packing=False)
    with pytest.raises(ValueError, match="eviction='ttl' takes steps_to_live"):
        picasso.optimize(hashed_model(), dynamic_vocabulary=True, eviction="ttl")


def test_beside_hybrid_hash_with_a_lookahead_refresh():
    """A dynamic vocabulary and a hash-backed group keyed by row id in one model: fit with
    hot_refresh="lookahead" reads the batches ahead for the hash-backed group's hot tier
    and leaves the dynamic vocabulary to its own steps."""
    tf.keras.utils.set_random_seed(0)
    user = tf.keras.Input(shape=(1,), dtype=tf.int64, name="user")
    item = tf.keras.Input(shape=(1,), dtype=tf.int64, name="item")
    parts = [tf.keras.layers.Flatten()(tf.keras.layers.Embedding(7, 8, name="emb_user")(
        tf.keras.layers.Hashing(7)(user))),
             tf.keras.layers.Flatten()(tf.keras.layers.Embedding(30, DIM, name="emb_item")(item))]
    out = tf.keras.layers.Dense(1, activation="sigmoid")(tf.keras.layers.Concatenate()(parts))
    model = picasso.optimize(tf.keras.Model([user, item], out), dynamic_vocabulary=True, hybrid_hash=True,
                             hot_refresh="lookahead", hot_storage_bytes=400, hot_refresh_every=2)
    model.compile(tf.keras.optimizers.Adagrad(0.1), "binary_crossentropy")
    kinds = sorted(s.kind for s in model.picasso.storages.values())
    assert kinds == ["dynamic_vocabulary", "hybrid_hash"]
    rng = np.random.default_rng(0)
    x = {"user": rng.integers(0, 10**6, (64, 1)), "item": rng.integers(0, 30, (64, 1))}
    dataset = tf.data.Dataset.from_tensor_slices((x, rng.integers(0, 2, (64, 1)).astype(np.float32))).batch(8)
    history = model.fit(dataset, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert keys_held(model) == sorted(set(x["user"][:, 0].tolist()))
    [hashed] = [s for s in model.picasso.storages.values() if s.kind == "hybrid_hash"]
    assert 0 < hashed.hot.capacity < 30 and (hashed.hot.keys.numpy() != EMPTY).all()     # chosen ahead
