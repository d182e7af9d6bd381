"""HybridHash's cold tier (picasso_tf.ops.hybrid_hash) against a dict/NumPy reference.

The reference holds a dict from key to value row, slot rows, count and last step, and
draws a new key's uniform initial row with the same counter-based hash as the C++
(SplitMix64 of seed and key), so rows, slots and counts are compared exactly.
"""
import threading

import numpy as np
import pytest
import tensorflow as tf

from picasso_tf.ops.hybrid_hash import HashTable
from picasso_tf.ops.library import load

GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(z):
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def uniform_rows(keys, dim, minval, maxval, seed):
    """The C++ initializer's uniform rows, recomputed."""
    keys = np.asarray(keys, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        base = mix64(keys ^ mix64(np.array([seed], np.uint64) ^ np.uint64(0x6A09E667F3BCC909)))
        j = np.arange(1, dim + 1, dtype=np.uint64)
        bits = mix64(base[:, None] + j[None, :] * GOLDEN)
    unit = (bits >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)
    lo, hi = np.float32(minval), np.float32(maxval)
    return lo + np.float32(hi - lo) * unit


class Reference:
    """A dict-of-rows model of the table."""

    def __init__(self, dim, num_slots, minval, maxval, seed, slot_init):
        self.dim, self.num_slots = dim, num_slots
        self.init = (minval, maxval, seed)
        self.slot_init = np.float32(slot_init)
        self.rows = {}  # key -> [value, slots (num_slots, dim), count, last_step]

    def find_or_insert(self, keys, step):
        out = np.empty((len(keys), self.dim), np.float32)
        for i, k in enumerate(keys):
            k = int(k)
            if k not in self.rows:
                value = uniform_rows([k], self.dim, *self.init)[0]
                self.rows[k] = [value, np.full((self.num_slots, self.dim), self.slot_init), 0, 0]
            r = self.rows[k]
            r[2] += 1
            r[3] = step
            out[i] = r[0]
        return out

    def lookup(self, keys):
        rows = np.array([self.rows[int(k)][0] if int(k) in self.rows else np.zeros(self.dim, np.float32)
                         for k in keys], np.float32).reshape(len(keys), self.dim)
        return rows, np.array([int(k) in self.rows for k in keys], bool)

    def apply_sgd(self, keys, grads, lr):
        for k, g in zip(keys, grads):
            r = self.rows[int(k)]
            r[0] = r[0] + np.float32(-lr) * g

    def apply_adagrad(self, keys, grads, lr, eps):
        for k, g in zip(keys, grads):
            r = self.rows[int(k)]
            r[1][0] = r[1][0] + g * g
            r[0] = r[0] + np.float32(-lr) * g / np.sqrt(r[1][0] + np.float32(eps))

    def export(self):
        keys = np.array(sorted(self.rows), np.int64)
        rows = [self.rows[int(k)] for k in keys]
        values = np.array([r[0] for r in rows], np.float32).reshape(len(keys), self.dim)
        slots = np.array([r[1] for r in rows], np.float32).reshape(len(keys), self.num_slots, self.dim)
        return (keys, values, slots.transpose(1, 0, 2), np.array([r[2] for r in rows], np.int64),
                np.array([r[3] for r in rows], np.int64))


def assert_exports_equal(a, b):
    for name, x, y in zip(("keys", "values", "slots", "counts", "last_steps"), a, b):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)


def unique_sum(keys, grads):
    uniq, idx = np.unique(keys, return_inverse=True)
    summed = np.zeros((len(uniq), grads.shape[1]), np.float32)
    np.add.at(summed, idx, grads)
    return uniq, summed


def _grads(rng, n, dim):
    return rng.normal(size=(n, dim)).astype(np.float32)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_matches_reference_over_steps(optimizer):
    dim, num_slots = 8, 1 if optimizer == "adagrad" else 0
    table = HashTable(dim, num_slots=num_slots,
                      initializer=tf.keras.initializers.RandomUniform(-0.3, 0.2), seed=11,
                      slot_init=0.1, num_partitions=4, initial_capacity=4)
    ref = Reference(dim, num_slots, -0.3, 0.2, 11, 0.1)
    rng = np.random.default_rng(0)
    space = np.array([0, 1, -1, 2 ** 62, -(2 ** 63), 2 ** 63 - 1] + list(range(10, 200, 3)), np.int64)
    for step in range(1, 7):
        keys = rng.choice(space, size=int(rng.integers(1, 120)))  # repeats
        rows = table.find_or_insert(keys, step=step)
        np.testing.assert_array_equal(rows.numpy(), ref.find_or_insert(keys, step))
        uniq, g = unique_sum(keys, _grads(rng, len(keys), dim))
        if optimizer == "sgd":
            table.apply_sgd(uniq, g, lr=0.05)
            ref.apply_sgd(uniq, g, 0.05)
        else:
            table.apply_adagrad(uniq, g, lr=0.05, epsilon=1e-7)
            ref.apply_adagrad(uniq, g, 0.05, 1e-7)
        probe = np.concatenate([keys[:5], [7, 8, 9]])  # 7, 8, 9 never inserted
        rows, found = table.lookup(probe)
        want_rows, want_found = ref.lookup(probe)
        np.testing.assert_array_equal(rows.numpy(), want_rows)
        np.testing.assert_array_equal(found.numpy(), want_found)
    assert int(table.size()) == len(ref.rows)
    assert_exports_equal(table.export(), ref.export())


def test_rows_keep_the_shape_of_keys_and_work_in_tf_function():
    table = HashTable(4, num_slots=1, seed=2, slot_init=0.1)
    twin = HashTable(4, num_slots=1, seed=2, slot_init=0.1)
    keys = tf.constant([[3, 4, 3], [9, 3, 4]], tf.int64)

    @tf.function
    def step(keys, step):
        rows = table.find_or_insert(keys, step)
        uniq, idx = tf.unique(tf.reshape(keys, [-1]))
        g = tf.math.unsorted_segment_sum(tf.reshape(rows, [-1, 4]), idx, tf.size(uniq))
        with tf.control_dependencies([rows]):
            table.apply_adagrad(uniq, g, 0.1)
        return rows

    rows = step(keys, tf.constant(5, tf.int64))
    assert rows.shape == (2, 3, 4)
    eager = twin.find_or_insert(keys, 5)
    np.testing.assert_array_equal(rows.numpy(), eager.numpy())
    uniq, idx = tf.unique(tf.reshape(keys, [-1]))
    twin.apply_adagrad(uniq, tf.math.unsorted_segment_sum(tf.reshape(eager, [-1, 4]), idx, 3), 0.1)
    assert_exports_equal(table.export(), twin.export())


def test_initial_rows_do_not_depend_on_arrival_order_or_threads():
    rng = np.random.default_rng(1)
    keys = rng.integers(-(2 ** 40), 2 ** 40, size=20000)
    a = HashTable(16, num_slots=2, initializer="truncated_normal", seed=7, num_partitions=1)
    b = HashTable(16, num_slots=2, initializer="truncated_normal", seed=7, num_partitions=16,
                  initial_capacity=1)
    a.find_or_insert(keys)  # one batch, one partition, one thread
    for chunk in np.array_split(keys[::-1], 7):  # reversed, batches in parallel
        b.find_or_insert(chunk)
    assert_exports_equal(a.export(), b.export())
    other_seed = HashTable(16, initializer="truncated_normal", seed=8)
    assert not np.array_equal(other_seed.find_or_insert(keys[:10]).numpy(),
                              a.lookup(keys[:10])[0].numpy())


@pytest.mark.parametrize("initializer, check", [
    (tf.keras.initializers.RandomUniform(-0.5, 1.5),
     lambda v: (v.min() >= -0.5 and v.max() < 1.5 and abs(v.mean() - 0.5) < 0.01
                and abs(v.std() - 2 / np.sqrt(12)) < 0.01)),
    (tf.keras.initializers.RandomNormal(1.0, 2.0),
     lambda v: abs(v.mean() - 1.0) < 0.03 and abs(v.std() - 2.0) < 0.03
     and abs(((v - 1) / 2) ** 3).mean() < 1.7),
    (tf.keras.initializers.TruncatedNormal(0.0, 0.1),
     lambda v: np.abs(v).max() <= 0.2 + 1e-7 and abs(v.mean()) < 0.002
     and abs(v.std() - 0.088) < 0.002),
    ("zeros", lambda v: not v.any()),
    (tf.keras.initializers.Constant(0.25), lambda v: (v == np.float32(0.25)).all()),
])
def test_initial_rows_follow_the_distribution(initializer, check):
    table = HashTable(15, initializer=initializer, seed=3)  # odd dim: Box-Muller's last pair
    values = table.find_or_insert(np.arange(20000) * 7919).numpy()
    assert check(values.ravel()), (values.mean(), values.std(), values.min(), values.max())
    # columns are not copies of each other, nor rows
    if values.std():
        assert abs(np.corrcoef(values[:, 0], values[:, 14])[0, 1]) < 0.05
        assert abs(np.corrcoef(values[:-1, 3], values[1:, 3])[0, 1]) < 0.05


def test_growth_from_tiny_capacity_loses_nothing():
    dim = 4
    grown = HashTable(dim, num_slots=1, slot_init=0.5, seed=5, num_partitions=4, initial_capacity=1)
    rng = np.random.default_rng(2)
    keys = rng.permutation(rng.choice(2 ** 50, size=100_000, replace=False).astype(np.int64))
    start = 0
    for size in [1, 2, 5, 100, 3000] + [20000] * 10:
        batch = keys[start:start + size]
        if not len(batch):
            break
        grown.find_or_insert(batch, step=start)
        start += size
    assert int(grown.size()) == len(keys)
    exported = grown.export()
    np.testing.assert_array_equal(exported.keys.numpy(), np.sort(keys))
    np.testing.assert_array_equal(exported.values.numpy(),
                                  uniform_rows(np.sort(keys), dim, -0.05, 0.05, 5))
    assert (exported.slots.numpy() == np.float32(0.5)).all()
    assert (exported.counts.numpy() == 1).all()
    rows, found = grown.lookup(keys[::97])
    assert found.numpy().all()


def test_erase_and_reinsert_against_a_dict():
    """Keys erased from crowded probe runs (one partition, a table kept small) leave every
    other key findable with its row; erased keys' rows are reused; a key inserted again
    gets its initial row and counts from zero."""
    dim = 2
    table = HashTable(dim, initializer="uniform", seed=3, num_partitions=1, initial_capacity=8)
    fresh = HashTable(dim, initializer="uniform", seed=3)
    rng = np.random.default_rng(7)
    held = {}
    for step in range(60):
        inserted = rng.integers(0, 400, 20)
        rows = table.find_or_insert(inserted, step=step).numpy()
        for key, row in zip(inserted, rows):
            held[int(key)] = row
        erased = rng.choice(sorted(held), size=min(len(held), 15), replace=False)
        table.erase(np.concatenate([erased, [10_000]]))         # a missing key is skipped
        for key in erased:
            del held[int(key)]
        assert int(table.size()) == len(held)
    keys = np.array(sorted(held))
    np.testing.assert_array_equal(table.export().keys.numpy(), keys)
    rows, found = table.lookup(keys)
    assert found.numpy().all()
    np.testing.assert_array_equal(rows.numpy(), np.stack([held[k] for k in keys]))
    gone = np.setdiff1d(np.arange(400), keys)[:5]
    assert not table.lookup(gone)[1].numpy().any()
    np.testing.assert_array_equal(table.find_or_insert(gone).numpy(), fresh.find_or_insert(gone).numpy())
    assert table.counts(gone).numpy().tolist() == [1] * 5


def test_evict_keeps_the_keys_ranked_first_and_drops_the_stale():
    table = HashTable(1, num_partitions=4)
    looked_up = {1: [0, 1, 2], 2: [0, 1], 3: [2], 4: [1], 5: [2], 6: [0]}     # key -> steps
    for step in range(3):
        table.find_or_insert([k for k, steps in looked_up.items() if step in steps], step=step)
    # counts 1:3, 2:2, then one lookup each, last at step 2 (3, 5), 1 (4), 0 (6).
    assert int(table.evict(keep=4)) == 2
    assert table.export().keys.numpy().tolist() == [1, 2, 3, 5]
    assert int(table.evict(keep=10, stale_before=2)) == 1          # key 2 was last looked up at step 1
    assert table.export().keys.numpy().tolist() == [1, 3, 5]


def _train(table, keys, steps, seed):
    """find_or_insert, then Adagrad on the unique keys, with deterministic grads."""
    rng = np.random.default_rng(seed)
    for step in range(steps):
        batch = rng.choice(keys, size=3000)
        rows = table.find_or_insert(batch, step=step)
        uniq, idx = np.unique(batch, return_inverse=True)
        g = np.zeros((len(uniq), table.dim), np.float32)
        np.add.at(g, idx, rows.numpy() * np.float32(0.5) + np.float32(0.01))
        table.apply_adagrad(uniq, g, lr=0.1)
        table.lookup(batch[:500])


def test_concurrent_threads_equal_a_serial_run():
    """Threads inserting, looking up and updating disjoint key sets while the table
    grows from a tiny capacity end where one thread doing the same work would."""
    num_threads, steps = 4, 12
    key_sets = [np.arange(t, 40000 * num_threads, num_threads, dtype=np.int64) * 1_000_003
                for t in range(num_threads)]
    make = lambda: HashTable(8, num_slots=1, slot_init=0.1, seed=9, initial_capacity=1)
    serial = make()
    for t in range(num_threads):
        _train(serial, key_sets[t], steps, seed=t)
    shared = make()
    errors = []

    def work(t):
        try:
            _train(shared, key_sets[t], steps, seed=t)
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(num_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert_exports_equal(shared.export(), serial.export())


def test_export_import_round_trip_is_exact_and_replaces_contents():
    src = HashTable(6, num_slots=2, seed=4, slot_init=0.1)
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 10 ** 9, size=5000)
    src.find_or_insert(keys, step=3)
    src.find_or_insert(keys[:100], step=4)
    uniq = np.unique(keys)
    g = _grads(rng, len(uniq), 6)
    src.apply_adagrad(uniq, g, 0.1)
    saved = src.export()

    dst = HashTable(6, num_slots=2, seed=99, slot_init=0.3)  # other seed: import decides
    dst.find_or_insert([-5, -6])  # replaced, not merged
    dst.import_(*saved)
    again = dst.export()
    assert_exports_equal(again, saved)
    assert not dst.lookup([-5])[1].numpy()[0]
    # training continues identically
    for t in (src, dst):
        t.find_or_insert(keys[:50], step=5)
        t.apply_adagrad(uniq[:10], g[:10], 0.1)
    assert_exports_equal(dst.export(), src.export())
    # an empty table round-trips too
    empty = HashTable(6, num_slots=2)
    dst.import_(*empty.export())
    assert int(dst.size()) == 0


def test_a_hot_tier_moves_only_its_rows_through_hottest_read_and_write():
    """hottest: the keys looked up most (ties: the smaller key), in that order; read:
    their values and slots as export has them; write: sets them and adds counts,
    touching no other key; a missing or repeated key or a bad shape changes nothing."""
    table = HashTable(4, num_slots=1, seed=2, slot_init=0.1)
    table.find_or_insert([5, 5, 5, 9, 9, 3, 3, 7, 1])          # counts 5:3, 9:2, 3:2, 7:1, 1:1
    keys, counts = table.hottest(4)
    assert keys.numpy().tolist() == [5, 3, 9, 1] and counts.numpy().tolist() == [3, 2, 2, 1]
    assert table.hottest(100)[0].numpy().tolist() == [5, 3, 9, 1, 7]
    assert table.hottest(0)[0].numpy().tolist() == []
    before = table.export()
    values, slots = table.read([3, 9])
    at = np.searchsorted(before.keys.numpy(), [3, 9])
    np.testing.assert_array_equal(values.numpy(), before.values.numpy()[at])
    np.testing.assert_array_equal(slots.numpy(), before.slots.numpy()[:, at])
    new_values = np.arange(8, dtype=np.float32).reshape(2, 4)
    new_slots = np.full((1, 2, 4), 0.5, np.float32)
    table.write([3, 9], new_values, new_slots, [10, 0])
    after = table.export()
    np.testing.assert_array_equal(after.values.numpy()[at], new_values)
    np.testing.assert_array_equal(after.slots.numpy()[:, at], new_slots)
    assert after.counts.numpy()[at].tolist() == [12, 2]
    others = np.isin(before.keys.numpy(), [3, 9], invert=True)
    np.testing.assert_array_equal(after.values.numpy()[others], before.values.numpy()[others])
    np.testing.assert_array_equal(after.last_steps.numpy(), before.last_steps.numpy())
    with pytest.raises(tf.errors.NotFoundError, match=r"key 4 .*not in the hash table; read or write only keys"):
        table.write([1, 4], new_values, new_slots, [1, 1])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"key 1 appears more than once.*give each key once"):
        table.write([1, 1], new_values, new_slots, [1, 1])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"slots must be \[1,2,4\] for 2 keys"):
        table.write([1, 7], new_values, new_slots[:, :1], [1, 1])
    with pytest.raises(tf.errors.NotFoundError, match=r"key 4 .*not in the hash table"):
        table.read([4])
    _assert_unchanged(table, after)


def _assert_unchanged(table, before):
    assert_exports_equal(table.export(), before)


def test_errors_are_named_and_change_nothing():
    table = HashTable(4, num_slots=1, seed=1)
    table.find_or_insert([1, 2, 3])
    before = table.export()
    g = np.ones((2, 4), np.float32)
    with pytest.raises(tf.errors.NotFoundError, match=r"key 77 .*not in the hash table.*find_or_insert"):
        table.apply_adagrad([1, 77], g, 0.1)
    _assert_unchanged(table, before)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"key 2 appears more than once.*unique"):
        table.apply_sgd([2, 2], g, 0.1)
    _assert_unchanged(table, before)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"grads must be \[2, 4\]"):
        table.apply_sgd([1, 2], np.ones((2, 5), np.float32), 0.1)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"needs 1 slot.*accumulator.*num_slots=1"):
        HashTable(4).apply_adagrad([], np.zeros((0, 4), np.float32), 0.1)
    # import: another table's dim, slot count, a repeated key
    wide = HashTable(8, num_slots=1)
    wide.find_or_insert([5])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"values must be \[1,4\].*dim=8"):
        table.import_(*wide.export())
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"slots must be \[1,2,4\].*num_slots=1"):
        table.import_([1, 2], np.zeros((2, 4)), np.zeros((0, 2, 4)))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"key 9 appears more than once.*export never repeats"):
        table.import_([9, 8, 9], np.zeros((3, 4)), np.zeros((1, 3, 4)))
    _assert_unchanged(table, before)
    # the op's dim against the table's, for both ops that return rows
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"rows of 3 floats but the hash table's dim is 4"):
        load().picasso_hash_table_find_or_insert(table.handle, tf.constant([7], tf.int64),
                                                 tf.constant(0, tf.int64), dim=3)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"rows of 8 floats but the hash table's dim is 4"):
        load().picasso_hash_table_lookup(table.handle, tf.constant([1], tf.int64), dim=8)
    _assert_unchanged(table, before)
    # one name, two configurations
    first = HashTable(4, name="hybrid_hash_test_clash")  # noqa: F841 (alive: the name is taken)
    with pytest.raises(tf.errors.AlreadyExistsError, match=r"hybrid_hash_test_clash.*another shared_name"):
        HashTable(5, name="hybrid_hash_test_clash")
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"num_partitions must be a power of two"):
        HashTable(4, num_partitions=6)
    with pytest.raises(ValueError, match=r"GlorotUniform.*not supported"):
        HashTable(4, initializer="glorot_uniform")

