"""The hash-backed storage kind (HybridHash, hybrid_hash=True): a group's rows and their
optimizer slots live in one hash table (picasso_tf.ops.hybrid_hash, the cold tier),
keyed by (member << ID_BITS) | row id (picasso_tf.embedding.row_keys).

The kernels do not read it in place: each step HashRowFetch finds the rows of the
batch's distinct keys (counting their accesses) and the rewritten lookups read those
(under hybrid parallelism, kind "sharded_hybrid_hash": each rank holds the rows
id % size == rank, and the row exchange, picasso_tf.distributed.exchange, serves them);
the step takes the loss's gradient with respect to the fetched rows (one summed row per
key) and ``apply_fetched`` updates the table with the hash table's own optimizer ops.
They implement SGD without momentum, Adagrad and Adam (exact: every row's moments decay
each step, as Keras' do; or lazy); `bind` refuses other optimizers by name.

The table starts as a copy of the original tables (every row, keyed by its id), so
training is the same as with the tables read in place. The original variables stay the
model's checkpoint: ``write_back`` copies the rows (and the Adagrad accumulators, into
the Keras optimizer's slots) into them (sharded: gathered from every rank, a
collective), ``read_back`` imports them again. Until the
original tables are released the group's rows are held twice.

The rest of the hash state goes into checkpoints beside them, per logical table under
"picasso_hash/<table>" (``checkpoint_children``, HashState): every row's lookup count
(Algorithm 1's FCounter) and the row ids in the hot tier, so that a restored model's hot
tier goes on as the saved one would have. A checkpoint without them (the plain model's)
leaves the counts and the hot set as they are: empty in a new model.
"""
import dataclasses

import numpy as np
import tensorflow as tf

from picasso_tf.distributed.checkpoint import refused_on_save, restore_with_numpy
from picasso_tf.distributed.world import World, hvd
from picasso_tf.embedding.hot_tier import HotTier, hot_rows_of
from picasso_tf.embedding.row_keys import (ID_BITS, ID_MASK, keys_of, positions_of, row_id, select_rows,
                                          table_number)
from picasso_tf.embedding.sharded import rank_major_order
from picasso_tf.embedding.storage import EmbeddingStorage
from picasso_tf.errors import UnsupportedModelError
from picasso_tf.ops.hybrid_hash import HashTable

# The optimizer kernels (sparse_apply.Update.optimizer) the hash table has ops for.
HASH_UPDATES = ("sgd", "adagrad", "adam")


class HybridHashTables(EmbeddingStorage):

    kind = "hybrid_hash"
    sharded_kind = "sharded_hybrid_hash"     # under hybrid parallelism: this rank's rows only

    def __init__(self, layout, warmup=0, refresh_every=1, world=World(), refresh="counts", hot_device="/CPU:0"):
        super().__init__(layout)
        # "lookahead": the hot set changes only by refresh_ahead, which fit calls between steps.
        self.scheduled_refresh = refresh == "counts"
        self.world = world if layout.kind == self.sharded_kind else World()
        self.collective = self.world.distributed
        with tf.init_scope():
            self.table = HashTable(layout.dim, num_slots=1, initializer="zeros", initial_capacity=layout.num_rows)
            # Counts the updates, so that write_back knows whether the originals are behind.
            self.updates = tf.Variable(0, dtype=tf.int64, trainable=False, name=f"picasso_hash_updates/{layout.name}")
        self.hot = (HotTier(layout.hot_rows, layout.dim, warmup, refresh_every, layout.name, hot_device)
                    if layout.hot_rows else None)
        held = [len(self._held(m)) for m in layout.members]
        # A hot tier that holds every row holds them in key order, for good: a key's
        # position follows from its member and id, with no search.
        self.all_hot = self.hot is not None and self.hot.capacity >= sum(held)
        self._first_position = np.cumsum([0] + held[:-1]).astype(np.int64)
        self.optimizer = None       # the RowSparseOptimizer it was bound to
        self._slots = []            # per member, the Keras optimizer's slot variables (the table's order)
        self._written_at = None     # self.updates when the originals last held the rows
        self._saved_state = None    # per member (counts, hot ids) as of self.updates == _state_at, for HashState
        self._state_at = None
        self._restored = {}         # member index -> (counts, hot ids) a restore read, until read_back
        self._carried_hot = None    # the keys a hot tier made again held, until read_back
        self._checkpointed = {f"picasso_hash/{m.name}": HashState(self, i) for i, m in enumerate(layout.members)}
        with tf.init_scope():       # the model may be rewritten while a step is traced
            self.read_back()

    def kernel_inputs(self):
        return []       # every lookup of the group reads the rows fetched per step

    def variables(self):
        return []

    def keys(self):
        """The key of every row it holds (sharded: the rows id % size == rank), increasing."""
        return np.concatenate([(m << ID_BITS) | self._held(member) for m, member in enumerate(self.layout.members)])

    def _held(self, member):
        return np.arange(self.world.rank, member.rows, self.world.size, dtype=np.int64)

    def plan(self, requests, check_ids):
        """The distinct keys the requests ([(ExchangedIds, ids)] of this group) look up,
        their ids checked (``fetch`` takes it; its guards: what waits for the checks)."""
        keys, sizes = keys_of(self.layout, requests, 0, check_ids)
        unique, index = tf.unique(keys)
        return FetchPlan(requests, unique, index, sizes, guards=[unique])

    def fetch(self, plan, training):
        """What a plan's requests look up: (the rows of their distinct keys, each
        request's positions among them, those keys, how many of them were hot or None)."""
        rows, hits = self.rows(plan.keys, training)
        return rows, positions_of(plan.requests, plan.index, plan.sizes), plan.keys, hits

    def rows(self, keys, training):
        """(The rows of the distinct `keys`, how many were hot): hot ones from the hot
        tier, the others from the table. In training every lookup is counted (Algorithm
        1's FCounter)."""
        if self.hot is None:
            return (self.table.find_or_insert(keys) if training else self.table.lookup(keys)[0]), None
        if self.all_hot:
            position = self._position(keys)
            counted = [self.hot.count(keys, None, position)] if training else []
            with tf.control_dependencies(counted):
                return tf.gather(self.hot.rows, position), tf.size(keys, out_type=tf.int64)
        hit, position = self.hot.locate(keys)
        hot, cold = tf.where(hit)[:, 0], tf.where(tf.logical_not(hit))[:, 0]
        cold_keys = tf.gather(keys, cold)
        counted = [self.hot.count(keys, hit, position)] if training else []
        with tf.control_dependencies(counted):
            cold_rows = self.table.find_or_insert(cold_keys) if training else self.table.lookup(cold_keys)[0]
            hot_rows = tf.gather(self.hot.rows, tf.gather(position, hot))
        rows = tf.dynamic_stitch([tf.cast(hot, tf.int32), tf.cast(cold, tf.int32)], [hot_rows, cold_rows])
        return rows, tf.size(hot, out_type=tf.int64)

    def _position(self, keys):
        """Where the keys' rows sit in a hot tier that holds every row."""
        member = tf.cast(tf.bitwise.right_shift(keys, tf.constant(ID_BITS, tf.int64)), tf.int32)
        return tf.gather(tf.constant(self._first_position), member) + row_id(keys) // self.world.size

    def check(self, optimizer):
        """Refuses by name an optimizer (a RowSparseOptimizer) the hash table cannot apply."""
        check_hash_optimizer(optimizer, self.layout, "hybrid_hash=True", HASH_UPDATES)

    def bind(self, optimizer):
        """Ties the table's slots to `optimizer` (a RowSparseOptimizer) before a
        training step is traced (``check`` first), and makes the table's slots hold the
        Keras optimizer's. Returns whether it made the hot tier again (for another number
        of slots): functions traced before read the old one."""
        if optimizer is self.optimizer:
            return False
        self.check(optimizer)
        with tf.init_scope():
            self.write_back()       # the rows trained so far, and the previous optimizer's slots
            self.optimizer = optimizer
            self._slots = [[optimizer.keras_slots(m.variable)[s] for s in optimizer.slot_names]
                           for m in self.layout.members]
            remade = self._hold_slots(max(1, len(optimizer.slot_names)))
            self.read_back()
        return remade

    def _hold_slots(self, num_slots):
        """Makes the table's rows and the hot tier hold `num_slots` slots each; returns
        whether the hot tier was made again."""
        if num_slots == self.table.num_slots:
            return False
        if self.hot is not None:
            self.hot.write_back(self.table)     # its rows and counts, before the table changes shape
        self.table.set_num_slots(num_slots)
        if self.hot is not None:
            # The tier keeps its bytes (hot_storage_bytes), and read_back loads its hot set again.
            old, dim = self.hot, self.layout.dim
            capacity = hot_rows_of(self.layout, self.layout.hot_bytes, num_slots)
            self.hot = (HotTier(capacity, dim, old.warmup, old.refresh_every, self.layout.name, old.device, num_slots)
                        if capacity else None)
            self.all_hot = self.hot is not None and capacity >= len(self.keys())
            self._carried_hot = old.held_keys()
            return True
        return False

    def apply_fetched(self, keys, row_grads, iteration):
        """Updates the rows of the distinct `keys` from their summed gradients (in the
        tier each is in), then refreshes the hot set when it is due."""
        if self.all_hot:
            with tf.control_dependencies([self._apply_hot(self._position(keys), row_grads, iteration)]):
                return self.updates.assign_add(1)
        cold_keys, cold_grads, applied = keys, row_grads, []
        if self.hot is not None:
            hit, position = self.hot.locate(keys)
            applied.append(self._apply_hot(*select_rows(hit, position, row_grads), iteration))
            cold_keys, cold_grads = select_rows(tf.logical_not(hit), keys, row_grads)
        applied.append(apply_to_table(self.table, table_update(self.optimizer, self.layout, iteration),
                                      cold_keys, cold_grads, self.optimizer.changes_only_gradient_rows(False)))
        with tf.control_dependencies(applied):
            counted = self.updates.assign_add(1)
        if self.hot is None or not self.scheduled_refresh:
            return counted
        with tf.control_dependencies([counted]):
            return tf.cond(self.hot.due(tf.convert_to_tensor(iteration, tf.int64)), self._refresh, tf.no_op)

    def _apply_hot(self, positions, row_grads, iteration):
        """The update of the hot rows at `positions` (each once; Keras' exact Adam decays
        the others too)."""
        slots = dict(zip(self.optimizer.slot_names, self.hot.slots))
        return self.hot.apply(positions, row_grads,
                              self.optimizer.update(self.hot.rows, slots, iteration, apply_weight_decay=False),
                              lazy=self.optimizer.changes_only_gradient_rows(apply_weight_decay=False))

    def _current(self):
        """Every key's (values, slots [num_slots, n, dim], counts, last steps), keys
        increasing: the table's, with the hot tier's rows where they are hot."""
        exported = self.table.export()
        values, slots, counts = exported.values, exported.slots, exported.counts
        if self.hot is not None:
            values, slots, counts = self.hot.current(exported.keys, values, slots, counts)
        return exported.keys, values, slots, counts, exported.last_steps

    def _refresh(self):
        """Algorithm 1, L23-26: the hot rows and counts go back to the table, and the
        keys with the highest counts become the hot set."""
        with tf.control_dependencies([self.hot.write_back(self.table)]):
            hottest, _ = self.table.hottest(self.hot.capacity)
            return self.hot.load(self.table, tf.sort(hottest))

    def refresh_ahead(self, upcoming):
        """Lookahead refresh (Bagpipe's idea), between steps: the hot set becomes the
        keys looked up in most of the `upcoming` batches, then those of highest count
        (Algorithm 1's choice), then the smaller key; the rows and counts of the keys
        that leave go back to the table, as at a scheduled refresh. `upcoming` is one
        {table name: the ids its lookups read, any shape} per batch, in training order,
        as a loop that peeks ahead of its input would give them (fit does with
        hot_refresh="lookahead": picasso_tf.embedding.lookahead); a table of another
        group is ignored. Refuses (changing nothing) a table name that no hash-backed
        group holds or an id outside its table."""
        position = {m.name: i for i, m in enumerate(self.layout.members)}
        batches = []
        for batch in upcoming:
            keys = []
            for name, ids in batch.items():
                if name not in position:
                    continue
                member = self.layout.members[position[name]]
                ids = np.asarray(ids).reshape(-1)
                if not np.issubdtype(ids.dtype, np.integer) or ((ids < 0) | (ids >= member.rows)).any():
                    raise ValueError(f"picasso_tf: refresh_ahead: the upcoming ids of table {name} are not all "
                                     f"integers in [0, {member.rows}): {ids[:8].tolist()}...; give the ids its "
                                     "lookups read")
                held = ids[ids % self.world.size == self.world.rank].astype(np.int64)
                keys.append((position[name] << ID_BITS) | held)
            batches.append(np.unique(np.concatenate(keys)) if keys else np.zeros(0, np.int64))
        if not self.chooses_hot_set:
            return
        self.hot.write_back(self.table)
        # Keys of the batches ahead first (in most batches, then highest count, then the
        # smaller key), then the table's hottest of the others: Algorithm 1's order.
        ahead, future = np.unique(np.concatenate(batches) if batches else np.zeros(0, np.int64),
                                  return_counts=True)
        past = self.table.counts(ahead).numpy()
        chosen = ahead[np.lexsort((ahead, -past, -future))[:self.hot.capacity]]
        if len(chosen) < self.hot.capacity:
            hottest = self.table.hottest(self.hot.capacity)[0].numpy()
            others = hottest[np.isin(hottest, chosen, invert=True)]
            chosen = np.concatenate([chosen, others[:self.hot.capacity - len(chosen)]])
        self.hot.load(self.table, np.sort(chosen))
        self._state_at = None       # the hot set a checkpoint saves has changed

    @property
    def chooses_hot_set(self):
        """Whether a refresh has a choice to make: a hot tier that cannot hold every row."""
        return self.hot is not None and not self.all_hot

    def write_back(self):
        """Copies the rows and slots into the originals, unless they hold them already
        (so that a write-back after a restore does not undo it), and keeps the hash
        state a checkpoint saves (a collective when sharded, as both are gathered)."""
        now = int(self.updates.numpy())
        if self._written_at == now and self._state_at == now:
            return
        keys, values, slots, counts, _ = self._current()
        sizes = [len(self._held(m)) for m in self.layout.members]
        if int(tf.size(keys)) != sum(sizes):
            raise AssertionError(f"picasso_tf: hash storage {self.name} holds {int(tf.size(keys))} rows, "
                                 f"not its tables' {sum(sizes)}; please report this model")
        if self._written_at != now:
            # Keys sort member by member, row by row: the rows are the (held rows of the) tables concatenated.
            for m, (member, rows) in enumerate(zip(self.layout.members, tf.split(values, sizes))):
                member.variable.assign(self._whole(rows, member, "rows"))
                for s, keras_slot in enumerate(self._slots[m] if self._slots else []):
                    slot_rows = tf.split(slots[s], sizes)[m]
                    keras_slot.assign(self._whole(slot_rows, member, f"slot_{self.optimizer.slot_names[s]}"))
            self._written_at = now
        self._keep_state(counts, sizes)

    def _keep_state(self, counts, sizes):
        """Keeps, per member table, every row's count and its hot row ids (whole: from
        every rank when sharded), for the next checkpoint written before a step."""
        hot_keys = self.hot.held_keys() if self.hot is not None else np.zeros(0, np.int64)
        state = []
        for m, (member, member_counts) in enumerate(zip(self.layout.members, tf.split(counts, sizes))):
            hot = hot_keys[hot_keys >> ID_BITS == m] & ID_MASK
            state.append((self._whole(member_counts, member, "counts").numpy(),
                          np.sort(self._whole(tf.constant(hot), member, "hot", in_order=False).numpy())))
        self._saved_state, self._state_at = state, int(self.updates.numpy())

    def _whole(self, rows, member, what, in_order=True):
        """A member table's `rows` from every rank's (a collective when sharded), in the
        table's row order unless not `in_order`."""
        if not self.world.distributed:
            return rows
        gathered = hvd().allgather(rows, name=f"picasso_hash_write_back_{what}_{member.name.replace('/', '_')}")
        return tf.gather(gathered, rank_major_order(member.rows, self.world.size)) if in_order else gathered

    def checkpoint_children(self):
        """Per member table, its HashState, named after the table."""
        return dict(self._checkpointed)

    def checkpoint_state(self, member):
        """HashState's tensors of member table number `member`; sharded, before write_back
        kept them, ones that refuse a save (a restore, which asks only for their names
        and dtypes, goes on)."""
        if self.collective and self._state_at != int(self.updates.numpy()):
            return refused_on_save({"counts": tf.int64, "hot": tf.int64}, lambda: self.saved_state(member))
        counts, hot = self.saved_state(member)
        return {"counts": tf.constant(counts), "hot": tf.constant(hot)}

    def saved_state(self, member):
        """(every row's count, the hot row ids) of member table number `member`, as a
        checkpoint saves them."""
        if self._state_at != int(self.updates.numpy()):
            if self.collective:
                raise RuntimeError(
                    f"picasso_tf: the hash state of {self.layout.members[member].name} is saved from write_back, which "
                    "every rank calls together under hybrid parallelism (save_weights does); call "
                    "model.picasso.write_back() on every rank before writing a checkpoint")
            with tf.init_scope():
                keys, _, _, counts, _ = self._current()
                self._keep_state(counts, [len(self._held(m)) for m in self.layout.members])
        return self._saved_state[member]

    def restore_state(self, member, counts, hot):
        """Takes a checkpoint's hash state of member table number `member` for the next
        ``read_back``; refuses (changing nothing) one that does not fit the table."""
        table = self.layout.members[member]
        counts, hot = np.asarray(counts), np.asarray(hot)
        problem = None
        if counts.dtype != np.int64 or counts.shape != (table.rows,) or (counts < 0).any():
            problem = f"counts of dtype {counts.dtype} and shape {counts.shape}, not {table.rows} int64 counts >= 0"
        elif hot.dtype != np.int64 or hot.ndim != 1 or ((hot < 0) | (hot >= table.rows)).any() or \
                np.unique(hot).size != hot.size:
            problem = f"hot row ids {hot.tolist()[:8]}..., not distinct int64 ids below {table.rows}"
        if problem:
            raise ValueError(f"picasso_tf: the checkpoint's hash state of table {table.name} (picasso_hash/"
                             f"{table.name}) holds {problem}; was it written by a model with another vocabulary "
                             "for this table? Restore a checkpoint of this model")
        self._restored[member] = (counts, hot)

    def read_back(self):
        """Imports the originals' rows and slots, with the counts and hot set that a
        restore read (HashState) for the tables it read them for; the others keep
        theirs (all rows hot when the hot tier can hold every row)."""
        members = self.layout.members
        keys = self.keys()
        held = [self._held(m) for m in members]
        values = tf.concat([tf.gather(m.variable, h) for m, h in zip(members, held)], 0)
        # Slots the optimizer does not use (SGD's one, before one is bound) hold zeros.
        slots = tf.stack([tf.concat([tf.gather(self._slots[m][s], h) if self._slots and s < len(self._slots[m])
                                     else tf.zeros([len(h), self.layout.dim]) for m, h in enumerate(held)], 0)
                          for s in range(self.table.num_slots)])
        counts = self._current()[3].numpy() if self._written_at is not None else np.zeros(len(keys), np.int64)
        first = np.cumsum([0] + [len(h) for h in held])
        for m, (restored_counts, _) in self._restored.items():
            counts[first[m]:first[m + 1]] = restored_counts[held[m]]
        hot = self._hot_after_read(keys, counts, held) if self.hot is not None else None
        self.table.import_(keys, values, slots, counts)
        if self.hot is not None:
            self.hot.load(self.table, keys[hot])
        self._restored, self._carried_hot = {}, None
        self._written_at, self._state_at = int(self.updates.numpy()), None

    def _hot_after_read(self, keys, counts, held):
        """Positions in `keys` of the hot set after read_back: the restored hot ids of
        the tables a restore read, the hot keys of the others; if they are more than the
        tier holds (a checkpoint of another plan), those of highest count (ties: the
        smaller key)."""
        if self.all_hot:
            return np.arange(len(keys))
        kept = np.searchsorted(keys, self.hot.held_keys() if self._carried_hot is None else self._carried_hot)
        chosen = [kept[np.isin(keys[kept] >> ID_BITS, list(self._restored), invert=True)]]
        for m, (_, hot) in self._restored.items():
            mine = hot[np.isin(hot, held[m], assume_unique=True)]
            chosen.append(np.searchsorted(keys, (m << ID_BITS) | mine))
        chosen = np.unique(np.concatenate(chosen))
        if chosen.size > self.hot.capacity:
            chosen = np.sort(chosen[np.lexsort((chosen, -counts[chosen]))[:self.hot.capacity]])
        return chosen


class HashState(tf.__internal__.tracking.Trackable):
    """A checkpoint's hash state of one logical table (a member of a hash-backed group):
    "counts", every row's lookup count, and "hot", the row ids in the hot tier."""

    def __init__(self, storage, member):
        self._storage, self._member = storage, member

    def _serialize_to_tensors(self):
        return self._storage.checkpoint_state(self._member)

    def _restore_from_tensors(self, restored_tensors):
        return restore_with_numpy(lambda counts, hot: self._storage.restore_state(self._member, counts, hot),
                                  [restored_tensors["counts"], restored_tensors["hot"]])


@dataclasses.dataclass
class FetchPlan:
    """A hash-backed group's part of a step's fetch, made before any row is fetched."""
    requests: list          # [(ExchangedIds, ids)]
    keys: object            # the distinct keys (tensor), or the storage's own record of them
    index: object           # each requested id's place among them
    sizes: list             # ids per request
    guards: list            # what the fetch of any group waits for: the checks of this one's ids


class FetchedRowsLog:
    """What the forward pass being traced fetched from hash storage, for its training
    step: the rows (whose gradients update the storage) and the hot tiers' hits."""

    def __init__(self):
        self._fetched, self._hits = [], []

    def record(self, storage, keys, rows, hits):
        """`rows` of the distinct `keys` of `storage`, `hits` of them hot (None: no hot tier)."""
        self._fetched.append((storage, keys, rows))
        if hits is not None:
            self._hits.append((hits, tf.size(keys, out_type=tf.int64)))   # keys: one per row

    def take(self):
        """[(storage, distinct keys, their rows)] fetched for the training step being traced."""
        taken, self._fetched = _of_this_graph(self._fetched), []
        return taken

    def hit_ratio(self):
        """The share of the distinct keys of the training step being traced that its hot
        tiers held; None without hot tiers."""
        hits, self._hits = _of_this_graph(self._hits), []
        if not hits:
            return None
        return tf.math.divide_no_nan(tf.cast(tf.add_n([h for h, _ in hits]), tf.float32),
                                     tf.cast(tf.add_n([n for _, n in hits]), tf.float32))


class HashRowFetch:
    """Feeds the FetchedRows and ExchangedIds placeholders of the hash-backed groups
    `storages` in one process: per group, the rows of the batch's distinct keys. In
    training they are found with their accesses counted, and logged (``log``) for the
    step's gradient."""

    def __init__(self, storages, training, check_ids=True):
        self.storages, self.training, self.check_ids = list(storages), training, check_ids
        self.log = FetchedRowsLog()

    def fetch(self, requests):
        """requests: [(ExchangedIds, ids tensor)]. Returns ({group name: fetched rows},
        [positions tensor per request, shaped and typed as its ids])."""
        rows, positions, plans = {}, [None] * len(requests), {}
        for storage in self.storages:
            own = [i for i, (x, _) in enumerate(requests) if x.group == storage.name]
            if not own:
                rows[storage.name] = tf.zeros([0, storage.layout.dim], storage.layout.dtype)
                continue
            plans[storage.name] = (own, storage.plan([requests[i] for i in own], self.check_ids))
        # Every group's ids are checked before any group's rows are fetched: a batch
        # refused for one group changes no table (no insert, no count).
        with tf.control_dependencies([g for _, plan in plans.values() for g in plan.guards]):
            for storage in self.storages:
                if storage.name not in plans:
                    continue
                own, plan = plans[storage.name]
                rows[storage.name], own_positions, keys, hits = storage.fetch(plan, self.training)
                if self.training:
                    self.log.record(storage, keys, rows[storage.name], hits)
                for i, p in zip(own, own_positions):
                    positions[i] = p
        return rows, positions


class LookedUpIds:
    """A fetch in HashRowFetch's place that fetches nothing, for a lookahead refresh: it
    keeps (``ids``), per member table of the hash-backed groups `storages`, the distinct
    ids the batch's lookups read (checked as a training step checks them), as
    refresh_ahead takes them. The rows it gives the graph are empty: only the ids are
    meant to be computed."""

    def __init__(self, storages, check_ids=True):
        self.storages, self.check_ids = list(storages), check_ids
        self.ids = {}

    def fetch(self, requests):
        """requests: [(ExchangedIds, ids tensor)]; returns what HashRowFetch.fetch does,
        with no rows (and the ids as positions)."""
        rows, self.ids = {}, {}
        for storage in self.storages:
            rows[storage.name] = tf.zeros([0, storage.layout.dim], storage.layout.dtype)
            own = [r for r in requests if r[0].group == storage.name]
            if not own or storage.kind != HybridHashTables.kind:
                continue        # a dynamic vocabulary has no hot tier to choose
            keys = tf.unique(keys_of(storage.layout, own, 0, self.check_ids)[0])[0]
            member, ids = table_number(keys), row_id(keys)
            for m in sorted({x.member for x, _ in own}):
                self.ids[storage.layout.members[m].name] = select_rows(tf.equal(member, m), ids)
        return rows, [ids for _, ids in requests]


def _of_this_graph(records):
    """The records (tuples whose last item is a tensor) made in the graph being built."""
    graph = tf.compat.v1.get_default_graph()
    return [r for r in records if r[-1].graph is graph]


def check_hash_optimizer(optimizer, layout, option, updates):
    """Refuses by name an optimizer (a RowSparseOptimizer) whose updates are not among
    `updates` (the hash table's kernels that `option`'s storage applies), for the group
    `layout` kept in hash tables by `option`."""
    with tf.init_scope():
        update = table_update(optimizer, layout, tf.constant(0, tf.int64))
    keras_name = type(optimizer.optimizer).__name__
    amsgrad = "vhat" in optimizer.slot_names
    if update.optimizer not in updates or (update.optimizer == "sgd" and optimizer.slot_names) or amsgrad:
        names = {"sgd": "SGD without momentum", "adagrad": "Adagrad", "adam": "Adam (no AMSGrad)"}
        raise UnsupportedModelError(
            f"picasso_tf: {option} stores group {layout.name} in hash tables, which are updated by "
            f"{' or '.join(names[u] for u in updates)} only; the model is compiled with {keras_name}"
            f"{' (amsgrad=True)' if amsgrad else ''}. Compile with one of those, or turn "
            f"{option.split('=')[0]} off")
    if not _is_zero(update.hyper.get("weight_decay", 0.0)):
        raise UnsupportedModelError(
            f"picasso_tf: {option}: the {keras_name} optimizer decays weights "
            f"(weight_decay={optimizer.optimizer.weight_decay}), which the hash table's updates do not; set "
            f"weight_decay=None, exclude the embeddings from it, or turn {option.split('=')[0]} off")


def table_update(optimizer, layout, iteration):
    """The sparse_apply.Update a group's hash tables apply at `iteration`: its
    hyper-parameters as the fused updates compute them (its slots: placeholders)."""
    variable = layout.members[0].variable
    return optimizer.update(variable, {s: None for s in optimizer.slot_names}, iteration,
                            apply_weight_decay=optimizer.applies_weight_decay_to(variable))


def apply_to_table(table, update, keys, grads, lazy=True):
    """Applies `update` (check_hash_optimizer's) to the rows of the unique `keys` of
    `table`; exact Adam (not `lazy`) decays every other row too."""
    h = update.hyper
    if update.optimizer == "sgd":
        return table.apply_sgd(keys, grads, h["lr"])
    if update.optimizer == "adam":
        return table.apply_adam(keys, grads, h["lr"], h["beta1_power"], h["beta2_power"], h["one_minus_beta1"],
                                h["one_minus_beta2"], h["epsilon"], lazy=lazy)
    return table.apply_adagrad(keys, grads, h["lr"], h["epsilon"])


def _is_zero(value):
    return isinstance(value, (int, float)) and value == 0
