"""HybridHash's cold tier: a hash table from int64 key to an embedding row and its
optimizer slots (custom_ops/hybrid_hash_ops.cc, custom_ops/hash_table.h).

Industrial ids are raw values from a space far larger than the rows that are ever
used; a hash table keyed by the raw id holds a row only for the ids seen, with no
collisions. A new key's row is drawn from the layer's initializer seeded by
(seed, key), so a training run does not depend on the order in which keys arrive;
its slots start at ``slot_init`` (Keras Adagrad's ``initial_accumulator_value``, 0
for Adam's moments). Each key also keeps an access count and the step of its last
access, for the hot tier and for eviction.

The table is created eagerly (TF2) and its ops may run eagerly or inside
``tf.function``s; ops on one table at the same time are race-free, and each op's
result does not depend on the number of threads. Updates (``apply_*``) take unique
keys that are already in the table: sum the gradients of repeated keys first
(``tf.unique`` and ``tf.math.unsorted_segment_sum``).
"""
import collections
import itertools
import threading

import tensorflow as tf
from tensorflow.python.eager import context

from picasso_tf.ops.library import load

for _op in ("PicassoHashTableCreate", "PicassoHashTableFindOrInsert", "PicassoHashTableLookup",
            "PicassoHashTableApplySgd", "PicassoHashTableApplyAdagrad", "PicassoHashTableExport",
            "PicassoHashTableImport", "PicassoHashTableSize", "PicassoHashTableCounts", "PicassoHashTableErase",
            "PicassoHashTableEvict"):
    tf.no_gradient(_op)  # the table is updated by apply_*, not through the tape

Exported = collections.namedtuple("Exported", ["keys", "values", "slots", "counts", "last_steps"])
Exported.__doc__ = """A table's contents, keys in increasing order: values [n, dim], slots
[num_slots, n, dim], counts and last_steps [n]."""

_names = itertools.count()
_names_lock = threading.Lock()

# Keras initializer class name -> (the op's initializer, its two parameters).
_INITIALIZERS = {
    "Zeros": lambda c: ("zeros", 0.0, 0.0),
    "Constant": lambda c: ("constant", float(c.get("value", 0.0)), 0.0),
    "Ones": lambda c: ("constant", 1.0, 0.0),
    "RandomUniform": lambda c: ("uniform", float(c["minval"]), float(c["maxval"])),
    "RandomNormal": lambda c: ("normal", float(c["mean"]), float(c["stddev"])),
    "TruncatedNormal": lambda c: ("truncated_normal", float(c["mean"]), float(c["stddev"])),
}


def initializer_spec(initializer):
    """(kind, a, b, seed or None) of a Keras initializer or its name: only the
    distributions that do not depend on a table's shape, which a hash table has not."""
    init = tf.keras.initializers.get(initializer)
    name = type(init).__name__
    if name not in _INITIALIZERS:
        raise ValueError(
            f"HashTable: initializer {initializer!r} ({name}) is not supported: a hash table has "
            f"no fixed shape, so its rows can only follow a distribution that does not depend "
            f"on one; use one of {sorted(_INITIALIZERS)}")
    config = init.get_config()
    kind, a, b = _INITIALIZERS[name](config)
    return kind, a, b, config.get("seed")


class HashTable:
    """A resource handle to one table and the methods that use it.

    dim: floats per row; num_slots: optimizer slot rows per key (1 for Adagrad);
    initializer: a Keras initializer (or its name) for new rows, drawn per key;
    seed: overrides the initializer's seed (0 when neither gives one);
    slot_init: the value of every slot element of a new key;
    num_partitions: a power of two, the most threads an op can use;
    initial_capacity: keys held before the first growth (growth loses nothing).
    """

    def __init__(self, dim, num_slots=0, initializer="uniform", seed=None, slot_init=0.0,
                 num_partitions=16, initial_capacity=1024, name=None):
        kind, a, b, init_seed = initializer_spec(initializer)
        self.dim = int(dim)
        self.num_slots = int(num_slots)
        self.seed = int(seed if seed is not None else (init_seed if init_seed is not None else 0))
        if name is None:
            with _names_lock:
                name = f"picasso_hash_table_{next(_names)}"
        self.name = name
        self._attrs = dict(dim=self.dim, num_slots=self.num_slots, initializer=kind, init_a=a, init_b=b,
                           seed=self.seed, slot_init=float(slot_init), num_partitions=int(num_partitions),
                           initial_capacity=int(initial_capacity))
        with tf.init_scope():  # a handle that outlives any tf.function being traced
            self.handle = load().picasso_hash_table_create(**self._attrs, shared_name=name)
            self._eager = tf.executing_eagerly()

    @property
    def slot_init(self):
        return self._attrs["slot_init"]

    def set_slot_init(self, slot_init):
        """New keys' slots start at `slot_init` from now on (an optimizer known only after
        the table was made); the keys held keep theirs."""
        self._remake(slot_init=float(slot_init))

    def set_num_slots(self, num_slots):
        """Makes every row hold `num_slots` optimizer slots (an optimizer known only after
        the table was made): the first ones kept, new ones zeros."""
        self._remake(num_slots=int(num_slots))

    def _remake(self, **attrs):
        """Makes the table again with `attrs` changed, holding what it holds, under its
        name, so that the handles functions already captured reach the new one."""
        with tf.init_scope():
            held = self.export()
            tf.raw_ops.DestroyResourceOp(resource=self.handle, ignore_lookup_error=False)
            self._attrs.update(attrs)
            self.num_slots = self._attrs["num_slots"]
            self.handle = load().picasso_hash_table_create(**self._attrs, shared_name=self.name)
            n, kept = tf.size(held.keys), held.slots[:self.num_slots]
            slots = tf.concat([kept, tf.zeros([self.num_slots - tf.shape(kept)[0], n, self.dim])], 0)
            self.import_(held.keys, held.values, slots, held.counts, held.last_steps)

    def __del__(self):
        # Frees the rows when the last Python reference goes (tables are large).
        # The collector may run this while a tf.function is traced: the op must run
        # eagerly, not be added to that graph (whose lock the tracing thread holds).
        try:
            if self._eager:
                with context.eager_mode():
                    tf.raw_ops.DestroyResourceOp(resource=self.handle, ignore_lookup_error=True)
        except Exception:  # interpreter shutdown: nothing left to free
            pass

    def find_or_insert(self, keys, step=0):
        """The rows of ``keys`` (any shape; rows: keys.shape + [dim]) for training:
        missing keys are inserted, each occurrence counts an access at ``step``."""
        return load().picasso_hash_table_find_or_insert(
            self.handle, tf.cast(keys, tf.int64), tf.cast(step, tf.int64), dim=self.dim)

    def lookup(self, keys):
        """(rows, found) for serving and evaluation: nothing is inserted or counted;
        a missing key's row is zeros and found False."""
        return load().picasso_hash_table_lookup(self.handle, tf.cast(keys, tf.int64), dim=self.dim)

    def counts(self, keys):
        """Each key's access count (0 when missing); nothing is inserted or counted."""
        return load().picasso_hash_table_counts(self.handle, tf.cast(keys, tf.int64))

    def erase(self, keys):
        """Removes the ``keys`` (missing ones are skipped); returns the op."""
        return load().picasso_hash_table_erase(self.handle, tf.cast(keys, tf.int64))

    def evict(self, keep, stale_before=-(1 << 63)):
        """Removes every key last looked up before step ``stale_before``, then all but the
        ``keep`` keys looked up most (ties: most recently, then the smaller key); returns
        how many went."""
        return load().picasso_hash_table_evict(self.handle, tf.cast(keep, tf.int64), tf.cast(stale_before, tf.int64))

    def apply_sgd(self, keys, grads, lr):
        """``value -= lr * grad`` for unique ``keys`` [U] in the table, ``grads`` [U, dim]."""
        return load().picasso_hash_table_apply_sgd(
            self.handle, tf.cast(keys, tf.int64), tf.convert_to_tensor(grads, tf.float32),
            tf.cast(lr, tf.float32))

    def apply_adagrad(self, keys, grads, lr, epsilon=1e-7):
        """Keras' Adagrad on unique ``keys``: ``acc += g*g; value -= lr*g/sqrt(acc + epsilon)``,
        the accumulator being slot 0 (create the table with ``num_slots>=1`` and
        ``slot_init`` = Keras' ``initial_accumulator_value``, 0.1)."""
        return load().picasso_hash_table_apply_adagrad(
            self.handle, tf.cast(keys, tf.int64), tf.convert_to_tensor(grads, tf.float32),
            tf.cast(lr, tf.float32), tf.cast(epsilon, tf.float32))

    def apply_adam(self, keys, grads, lr, beta1_power, beta2_power, one_minus_beta1, one_minus_beta2, epsilon,
                   lazy=False):
        """Keras' Adam on unique ``keys`` (slots 0, 1 = m, v: create the table with
        ``num_slots>=2``), as sparse_apply.adam_update: with ``lazy=False`` every other
        row of the table decays too, as Keras' update of a row-sparse gradient does."""
        scalars = [tf.cast(x, tf.float32) for x in (lr, beta1_power, beta2_power, one_minus_beta1,
                                                    one_minus_beta2, epsilon)]
        return load().picasso_hash_table_apply_adam(
            self.handle, tf.cast(keys, tf.int64), tf.convert_to_tensor(grads, tf.float32), *scalars, lazy=lazy)

    def export(self):
        """Everything in the table (``Exported``), keys sorted: what a checkpoint saves."""
        return Exported(*load().picasso_hash_table_export(self.handle))

    def import_(self, keys, values, slots, counts=None, last_steps=None):
        """Replaces the contents (the inverse of ``export``); on an error (a repeated key,
        shapes that do not fit this table) the table is left as it was."""
        keys = tf.cast(keys, tf.int64)
        n = tf.size(keys, out_type=tf.int64)
        if counts is None:
            counts = tf.zeros([n], tf.int64)
        if last_steps is None:
            last_steps = tf.zeros([n], tf.int64)
        return load().picasso_hash_table_import(
            self.handle, keys, tf.convert_to_tensor(values, tf.float32),
            tf.convert_to_tensor(slots, tf.float32), tf.cast(counts, tf.int64),
            tf.cast(last_steps, tf.int64))

    def hottest(self, k):
        """(keys, counts) of the min(k, size) keys looked up most, in that order (ties: the
        smaller key); no row is copied."""
        return load().picasso_hash_table_hottest(self.handle, tf.cast(k, tf.int64))

    def read(self, keys):
        """(values [n, dim], slots [num_slots, n, dim]) of unique ``keys`` in the table."""
        return load().picasso_hash_table_read(self.handle, tf.cast(keys, tf.int64))

    def write(self, keys, values, slots, add_counts):
        """Sets the values and slots of unique ``keys`` in the table (the inverse of
        ``read``) and adds ``add_counts`` to their access counts; on an error (a key
        missing or repeated, a shape) nothing is written. Returns the op."""
        return load().picasso_hash_table_write(
            self.handle, tf.cast(keys, tf.int64), tf.convert_to_tensor(values, tf.float32),
            tf.convert_to_tensor(slots, tf.float32), tf.cast(add_counts, tf.int64))

    def size(self):
        """The number of keys."""
        return load().picasso_hash_table_size(self.handle)
