"""HybridHash's hot tier (paper §III-D, Algorithm 1's HStore): a dense array of the rows
of the keys looked up most often, in front of the hash table that holds every key (the
cold tier, picasso_tf.ops.hybrid_hash). As in the paper, its rows and optimizer slots
live in GPU memory when TensorFlow sees a GPU (``tier_device``), and are trained there
by TensorFlow's own gather and scatter ops (``apply_with_tf_ops``); without one they are
a compact host array trained by the fused row-sparse updates (CPU kernels). Its keys and
counts stay in host memory beside the cold tier, which the batch's ids are looked up in.

While a key is in the hot tier, its row and optimizer slot there are the current ones
(the cold tier's copy is stale) and its lookups are counted there. During the first
`warmup` steps every lookup goes to the cold tier, which counts them; then every
`refresh_every` steps `refresh` writes the hot rows and counts back into the cold tier
and loads the `capacity` keys with the highest counts (ties: the smaller key), so the
rows move between the tiers but never change; only the tier's own rows move, whatever
the size of the table (with Config.hot_refresh="lookahead" the
storage instead refreshes it between steps from the batches ahead,
HybridHashTables.refresh_ahead). A tier that can hold every row holds all of them from
the start.

The keys are kept sorted (padded with EMPTY), so finding a batch's keys is a binary
search; the rows sit at the same positions.
"""
import tensorflow as tf

from picasso_tf.embedding.row_keys import select_rows
from picasso_tf.errors import HotTierTooLargeError
from picasso_tf.ops import sparse_apply

EMPTY = (1 << 63) - 1       # no key: every real key is smaller


def tier_device(requested=None):
    """Where hot rows live: `requested` (a device name) if given, else the first GPU
    TensorFlow sees, else the host."""
    if requested:
        return requested
    return "/GPU:0" if tf.config.list_logical_devices("GPU") else "/CPU:0"


def hot_row_bytes(dim, num_slots, value_bytes=4):
    """What a hot row costs: its values and optimizer slots, its key and its count."""
    return (1 + num_slots) * dim * value_bytes + 16


def hot_rows_of(layout, share, num_slots):
    """Rows of a group's hot tier in `share` bytes, each with `num_slots` optimizer slots
    (one until the optimizer is known, HybridHashTables.bind), never more than it has."""
    return min(layout.num_rows, share // hot_row_bytes(layout.dim, num_slots, layout.dtype.size))


def host_bytes_available():
    """The host memory new allocations can take without swapping (Linux: MemAvailable),
    or None where the system does not say."""
    try:
        with open("/proc/meminfo") as info:
            return next(int(line.split()[1]) * 1024 for line in info if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def runs_fused_updates(device):
    """Whether the fused row-sparse updates (CPU kernels only) can train rows on `device`."""
    return tf.DeviceSpec.from_string(device).device_type in (None, "CPU")


class HotTier:

    def __init__(self, capacity, dim, warmup, refresh_every, name, device="/CPU:0", num_slots=1):
        self.capacity, self.dim = int(capacity), int(dim)
        self.warmup, self.refresh_every = int(warmup), int(refresh_every)
        self.device, self.fused = device, runs_fused_updates(device)

        def variable(value, what):
            return tf.Variable(value, trainable=False, name=f"picasso_hot/{name}/{what}")
        with tf.init_scope():
            need = (1 + num_slots) * self.capacity * self.dim * tf.float32.size
            available = host_bytes_available() if self.fused else None
            if available is not None and need > available:
                raise _too_large(name, self.capacity, self.dim, device, need, f"{available} bytes of memory available")
            try:
                with tf.device(device):
                    self.rows = variable(tf.zeros([self.capacity, self.dim]), "rows")
                    self.slots = [variable(tf.zeros([self.capacity, self.dim]), f"slot{s}")
                                  for s in range(num_slots)]
            except tf.errors.ResourceExhaustedError as e:
                raise _too_large(name, self.capacity, self.dim, device, need, e.message) from None
            with tf.device("/CPU:0"):
                self.keys = variable(tf.fill([self.capacity], tf.constant(EMPTY, tf.int64)), "keys")
                self.counts = variable(tf.zeros([self.capacity], tf.int64), "counts")
                self.hits = variable(tf.constant(0, tf.int64), "hits")
                self.lookups = variable(tf.constant(0, tf.int64), "lookups")
                self.held = variable(tf.constant(0, tf.int64), "held")      # rows it holds

    def locate(self, keys):
        """(whether each of the distinct `keys` is hot, its position in the tier)."""
        position = tf.minimum(tf.searchsorted(self.keys, keys), self.capacity - 1)
        return tf.equal(tf.gather(self.keys, position), keys), position

    def count(self, keys, hit, position):
        """Counts one lookup of each hot key among the step's distinct `keys` (the cold
        tier counts the others; `hit` None: every key is hot) and the step's hits;
        returns the op."""
        hot = position if hit is None else select_rows(hit, position)
        return tf.group(self.counts.scatter_add(tf.IndexedSlices(tf.ones_like(hot, tf.int64), hot)),
                        self.hits.assign_add(tf.size(hot, out_type=tf.int64)),
                        self.lookups.assign_add(tf.size(keys, out_type=tf.int64)))

    def apply(self, positions, row_grads, update, lazy=True):
        """Runs `update` (a sparse_apply.Update, its slots this tier's) on the hot rows at
        `positions` (each once; not `lazy`: every row, as Keras' exact Adam); returns the op."""
        if self.fused:
            return sparse_apply.apply(self.rows, positions, row_grads, update, lazy=lazy)
        return apply_with_tf_ops(self.rows, self.slots, positions, row_grads, update, lazy)

    def due(self, step):
        """Whether the hot set is refreshed after `step` (0-based) of training."""
        done = step + 1 - self.warmup
        return tf.logical_and(done >= 0, tf.equal(done % self.refresh_every, 0))

    def current(self, keys, values, slots, counts):
        """The cold tier's export (sorted keys, values, slots [num_slots, n, dim], counts)
        with the hot keys' rows, slots and counts in place of their stale copies."""
        held_keys, rows, held_counts, *held_slots = select_rows(tf.not_equal(self.keys, EMPTY), self.keys, self.rows,
                                                                self.counts, *self.slots)
        at = tf.searchsorted(keys, held_keys)[:, None]
        return (tf.tensor_scatter_nd_update(values, at, rows),
                tf.stack([tf.tensor_scatter_nd_update(slots[s], at, mine) for s, mine in enumerate(held_slots)]),
                tf.tensor_scatter_nd_add(counts, at, held_counts))

    def write_back(self, table):
        """Writes the held rows and slots into `table` (the cold tier, a HashTable that
        holds their keys), and moves the lookups counted here into its counts (so a
        second write_back adds none), so that the table is current; returns the op.
        Only the tier's rows move."""
        held_keys, rows, held_counts, *held_slots = select_rows(tf.not_equal(self.keys, EMPTY), self.keys, self.rows,
                                                                self.counts, *self.slots)
        written = table.write(held_keys, rows, tf.stack(held_slots), held_counts)
        with tf.control_dependencies([written]):
            return self.counts.assign(tf.zeros([self.capacity], tf.int64)).op

    def load(self, table, keys):
        """Makes the tier hold the rows and slots that `table` holds for `keys` (increasing,
        at most `capacity`), counts from zero; returns the op."""
        values, slots = table.read(keys)
        free = self.capacity - tf.size(keys)
        # Every new tensor first, then the assignments: run eagerly, a tier that cannot
        # make them (out of device memory) is left as it was.
        with tf.device(self.device):
            rows = [tf.concat([part, tf.zeros([free, self.dim])], 0)
                    for part in [values] + [slots[s] for s in range(len(self.slots))]]
        held = tf.concat([tf.cast(keys, tf.int64), tf.fill([free], tf.constant(EMPTY, tf.int64))], 0)
        return tf.group(*[mine.assign(new) for mine, new in zip([self.rows] + self.slots, rows)],
                        self.keys.assign(held), self.counts.assign(tf.zeros([self.capacity], tf.int64)),
                        self.held.assign(tf.size(keys, out_type=tf.int64)))

    def held_keys(self):
        """The keys the tier holds, increasing (NumPy)."""
        keys = self.keys.numpy()
        return keys[keys != EMPTY]

    def hit_ratio(self):
        """Hot hits over lookups of distinct keys since training started (0 before)."""
        return tf.math.divide_no_nan(tf.cast(self.hits, tf.float64), tf.cast(self.lookups, tf.float64))


def _too_large(name, capacity, dim, device, need, why):
    return HotTierTooLargeError(
        f"picasso_tf: the hot tier of group {name} ({capacity} rows of dim {dim}: {need} bytes with their optimizer "
        f"slot) does not fit on {device} ({why}); lower hot_storage_bytes (shared by every hash-backed group), or "
        "set hot_tier_device to a device with more memory free")


def apply_with_tf_ops(rows, slots, positions, row_grads, update, lazy=True):
    """`update` (SGD without momentum, Adagrad or Adam, no weight decay: what hash
    storage trains) of `rows` and their `slots` at the distinct `positions` (not `lazy`:
    Adam decays every other row too), with TensorFlow's own ops, so that it runs where
    `rows` live (a GPU); the same arithmetic, in the same order, as the fused kernels
    (custom_ops/sparse_updates.h), so the same rounding. Returns the op."""
    h = update.hyper_tensors(rows.dtype)
    grads = tf.convert_to_tensor(row_grads, rows.dtype)
    if update.optimizer == "sgd":
        return rows.scatter_add(tf.IndexedSlices(-grads * h["lr"], positions)).op
    if update.optimizer == "adagrad":
        accumulated = tf.gather(slots[0], positions) + tf.square(grads)
        # DivNoNan divides as Div does (but for 0 / 0, which is NaN in Keras' step), and
        # Grappler does not turn it into a multiplication by Rsqrt, which rounds otherwise.
        step = tf.math.divide_no_nan(-h["lr"] * grads, tf.sqrt(accumulated + h["epsilon"]))
        return tf.group(slots[0].scatter_update(tf.IndexedSlices(accumulated, positions)),
                        rows.scatter_update(tf.IndexedSlices(tf.gather(rows, positions) + step, positions)))
    if update.optimizer != "adam":
        raise ValueError(f"picasso_tf: a hot tier is trained by SGD, Adagrad or Adam, not {update.optimizer}")
    alpha = h["lr"] * tf.sqrt(1 - h["beta2_power"]) / (1 - h["beta1_power"])
    c1, c2, at = h["one_minus_beta1"], h["one_minus_beta2"], positions[:, None]
    # Square, not g * g: Grappler turns (g * g) * c2 into g * (g * c2), which rounds otherwise.
    squared = tf.square(grads)
    if lazy:
        m, v, var = (tf.gather(x, positions) for x in (slots[0], slots[1], rows))
        m, v = m - m * c1 + grads * c1, v - v * c2 + squared * c2
        var = var - m * alpha / (tf.sqrt(v) + h["epsilon"])
        return tf.group(*[x.scatter_update(tf.IndexedSlices(y, positions))
                          for x, y in ((slots[0], m), (slots[1], v), (rows, var))])
    m = tf.tensor_scatter_nd_add(slots[0] - slots[0] * c1, at, grads * c1)
    v = tf.tensor_scatter_nd_add(slots[1] - slots[1] * c2, at, squared * c2)
    return tf.group(slots[0].assign(m), slots[1].assign(v),
                    rows.assign(rows - m * alpha / (tf.sqrt(v) + h["epsilon"])))
