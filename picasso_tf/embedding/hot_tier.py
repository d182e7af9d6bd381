"""HybridHash's hot tier (paper §III-D, Algorithm 1's HStore): a dense array of the rows
of the keys looked up most often, in front of the hash table that holds every key (the
cold tier, picasso_tf.ops.hybrid_hash). The paper keeps it in GPU memory; here it stays
in host memory, beside the fused row-sparse updates that train it (CPU kernels only).

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

EMPTY = (1 << 63) - 1       # no key: every real key is smaller


class HotTier:

    def __init__(self, capacity, dim, warmup, refresh_every, name):
        self.capacity, self.dim = int(capacity), int(dim)
        self.warmup, self.refresh_every = int(warmup), int(refresh_every)
        with tf.init_scope(), tf.device("/CPU:0"):
            def variable(value, what):
                return tf.Variable(value, trainable=False, name=f"picasso_hot/{name}/{what}")
            self.keys = variable(tf.fill([self.capacity], tf.constant(EMPTY, tf.int64)), "keys")
            self.rows = variable(tf.zeros([self.capacity, self.dim]), "rows")
            self.slot = variable(tf.zeros([self.capacity, self.dim]), "slot")
            self.counts = variable(tf.zeros([self.capacity], tf.int64), "counts")
            self.hits = variable(tf.constant(0, tf.int64), "hits")
            self.lookups = variable(tf.constant(0, tf.int64), "lookups")

    def locate(self, keys):
        """(whether each of the distinct `keys` is hot, its position in the tier)."""
        position = tf.minimum(tf.searchsorted(self.keys, keys), self.capacity - 1)
        return tf.equal(tf.gather(self.keys, position), keys), position

    def count(self, keys, hit, position):
        """Counts one lookup of each hot key among the step's distinct `keys` (the cold
        tier counts the others; `hit` None: every key is hot) and the step's hits;
        returns the op."""
        hot = position if hit is None else tf.boolean_mask(position, hit)
        return tf.group(self.counts.scatter_add(tf.IndexedSlices(tf.ones_like(hot, tf.int64), hot)),
                        self.hits.assign_add(tf.size(hot, out_type=tf.int64)),
                        self.lookups.assign_add(tf.size(keys, out_type=tf.int64)))

    def due(self, step):
        """Whether the hot set is refreshed after `step` (0-based) of training."""
        done = step + 1 - self.warmup
        return tf.logical_and(done >= 0, tf.equal(done % self.refresh_every, 0))

    def current(self, keys, values, slot, counts):
        """The cold tier's export (sorted keys, values, slot, counts) with the hot keys'
        rows, slots and counts in place of their stale copies."""
        held = tf.not_equal(self.keys, EMPTY)
        at = tf.searchsorted(keys, tf.boolean_mask(self.keys, held))[:, None]
        return (tf.tensor_scatter_nd_update(values, at, tf.boolean_mask(self.rows, held)),
                tf.tensor_scatter_nd_update(slot, at, tf.boolean_mask(self.slot, held)),
                tf.tensor_scatter_nd_add(counts, at, tf.boolean_mask(self.counts, held)))

    def write_back(self, table):
        """Writes the held rows and slots into `table` (the cold tier, a HashTable that
        holds their keys), and moves the lookups counted here into its counts (so a
        second write_back adds none), so that the table is current; returns the op.
        Only the tier's rows move."""
        held = tf.not_equal(self.keys, EMPTY)
        written = table.write(tf.boolean_mask(self.keys, held), tf.boolean_mask(self.rows, held),
                              tf.boolean_mask(self.slot, held)[None], tf.boolean_mask(self.counts, held))
        with tf.control_dependencies([written]):
            return self.counts.assign(tf.zeros([self.capacity], tf.int64)).op

    def load(self, table, keys):
        """Makes the tier hold the rows and slots that `table` holds for `keys` (increasing,
        at most `capacity`), counts from zero; returns the op."""
        values, slots = table.read(keys)
        free = self.capacity - tf.size(keys)
        return tf.group(
            self.keys.assign(tf.concat([tf.cast(keys, tf.int64), tf.fill([free], tf.constant(EMPTY, tf.int64))], 0)),
            self.rows.assign(tf.concat([values, tf.zeros([free, self.dim])], 0)),
            self.slot.assign(tf.concat([slots[0], tf.zeros([free, self.dim])], 0)),
            self.counts.assign(tf.zeros([self.capacity], tf.int64)))

    def loaded(self, keys):
        """Positions in the sorted `keys` of the keys the tier holds."""
        held = tf.boolean_mask(self.keys, tf.not_equal(self.keys, EMPTY))
        return tf.searchsorted(keys, held)

    def hit_ratio(self):
        """Hot hits over lookups of distinct keys since training started (0 before)."""
        return tf.math.divide_no_nan(tf.cast(self.hits, tf.float64), tf.cast(self.lookups, tf.float64))
