"""The storage of dynamic vocabularies (kind "dynamic_vocabulary", the pass
picasso_tf.passes.dynamic_vocabulary): one hash table (picasso_tf.ops.hybrid_hash) per
member table of a group, keyed by the raw id, holding a row only for the ids seen.

A new key's row is drawn from the original layer's initializer, seeded by the key and
the table's name (a run does not depend on the order keys arrive in, and two features
do not start with the same row for the same id); its Adagrad accumulator starts at the
optimizer's initial value. Each step fetches the rows of the batch's distinct keys per
table (inserting the new ones, counting every lookup and noting the step), the lookups
read those, and ``apply_fetched`` updates them with the hash table's own optimizer ops
(SGD without momentum, Adagrad). Serving and evaluation insert nothing: an unknown key's
row is zeros.

Options (VocabularyOptions, from picasso_tf.Config):
  capacity        keys a table may hold. A batch with more distinct ids of a table is an
                  error before anything changes. When a step leaves a table holding more,
                  it evicts down to 9/10 of the capacity (so that the pass over the keys an
                  eviction costs runs once per tenth of the capacity in new keys, not every
                  step): by eviction "lfu", the keys looked up in the fewest steps (ties:
                  the least recently, then the largest key); by "ttl", first the keys not
                  looked up in the last steps_to_live steps, which also go every
                  steps_to_live steps whatever the size. The rows of evicted keys are
                  reused by new keys in place (HashTable.evict).
  admit_after     a key gets a row once it has been looked up this many times (each
                  occurrence in a batch counts); until then its lookups read zeros and its
                  gradient is dropped. The counts of keys without a row are kept exactly (a
                  hash table of counts, which a key leaves when admitted, bounded and
                  evicted as the rows are) or by a counting Bloom filter of fixed size,
                  which never undercounts (a key may be admitted early, never late).

Checkpoints hold every table's keys, rows, slots, counts and last steps (and the
admission counts) under "picasso_vocabulary/<table>"; a restore into a smaller capacity
evicts as a step would, down to the capacity. The model's own variables keep the rows of
its hash bins, untrained: ``vocabulary()`` exports what was trained.

Under hybrid parallelism (Horovod, `world` of several ranks) each rank holds the keys
it owns (picasso_tf.embedding.row_keys.raw_key_owner) and serves the other ranks'
lookups of them through the row exchange (picasso_tf.distributed.exchange):
``distinct_keys`` on the requester, ``plan_received``/``serve`` on the owner, with the
lookups summed over the ranks, so that admission, eviction and the capacity (per rank)
work on the owner's keys as on one process's. ``write_back`` (every rank together)
gathers every rank's keys, which a checkpoint then holds under the same names as one
process's; a restore keeps the keys this rank owns, whatever the number of ranks that
wrote it. ``vocabulary()`` gathers them too. A Bloom admission filter counts, on each
owner, the lookups of the keys it owns (every rank's, summed by plan_received), so while
it does not saturate it admits what one process's would; a checkpoint holds the sum of
the ranks' counters, which is one process's filter, under its name, and each rank's
beside it (AdmissionState): it restores into one process or into as many ranks, and a
restore into another number of ranks is refused, one filter's counters not being
divisible by owner. Under several ranks a restore's tables wait for read_back with its
counters, which checks them all first: a refused restore changes no table and no filter.
"""
import dataclasses
import zlib
from typing import Optional

import numpy as np
import tensorflow as tf

from picasso_tf.distributed.checkpoint import refused_on_save, restore_with_numpy
from picasso_tf.distributed.world import World, hvd
from picasso_tf.embedding.hybrid_hash import FetchPlan, apply_to_table, check_hash_optimizer, table_update
from picasso_tf.embedding.row_keys import positions_of, raw_key_owner, select_rows
from picasso_tf.embedding.storage import EmbeddingStorage
from picasso_tf.ops.hybrid_hash import HashTable

KEEP_AFTER_EVICTION = 0.9       # of the capacity
BLOOM_HASHES = 3
KERAS_ADAGRAD_ACCUMULATOR = 0.1     # initial_accumulator_value's default


@dataclasses.dataclass(frozen=True)
class VocabularyOptions:
    capacity: Optional[int] = None
    admit_after: int = 1
    admission_filter: str = "exact"
    bloom_counters: int = 1 << 20
    eviction: str = "lfu"
    steps_to_live: Optional[int] = None

    @classmethod
    def from_config(cls, config):
        return cls(config.vocabulary_capacity, config.admit_after, config.admission_filter,
                   config.bloom_filter_counters, config.eviction, config.steps_to_live)


class DynamicVocabularyTables(EmbeddingStorage):

    kind = "dynamic_vocabulary"

    def __init__(self, layout, initializers, options=VocabularyOptions(), world=World()):
        """initializers: per member, the Keras initializer of its layer; world: the ranks
        whose keys it shares (this rank holds those it owns)."""
        super().__init__(layout)
        self.options = options
        self.world = world
        self.collective = world.distributed     # write_back and vocabulary() gather from every rank
        with tf.init_scope():
            # Counts the steps applied, so that a checkpoint knows whether write_back's keys are current.
            self.updates = tf.Variable(0, dtype=tf.int64, trainable=False,
                                       name=f"picasso_vocabulary_updates/{layout.name}")
        self._gathered, self._gathered_at = None, None   # write_back's per member state (several ranks)
        self._gathered_admission = None     # and per member its Bloom counters, {AdmissionState part: tensor}
        self._restored_admission = {}       # member -> {part: counters} a restore read, until read_back
        self._restored_tables = {}          # member -> the state a restore read (several ranks), until read_back
        self.optimizer = None       # the RowSparseOptimizer it was bound to
        capacity = min(options.capacity or 1024, 1 << 20)
        self.tables = [HashTable(layout.dim, num_slots=1, initializer=init, seed=_seed(init, m.name),
                                 slot_init=KERAS_ADAGRAD_ACCUMULATOR, initial_capacity=capacity)
                       for m, init in zip(layout.members, initializers)]
        self.filters = [_admission_filter(options, m.name) for m in layout.members]
        self._checkpointed = {}
        for i, m in enumerate(layout.members):
            self._checkpointed[f"picasso_vocabulary/{m.name}"] = VocabularyState(self, i)
            if not isinstance(self.filters[i], BloomCounts):
                continue
            if world.distributed:
                # Each rank counts the keys it owns: one process's filter is the sum of the
                # ranks' counters, and beside it each rank's own, for a restore on as many ranks.
                self._checkpointed[f"picasso_admission/{m.name}"] = AdmissionState(self, i, "total")
                self._checkpointed[f"picasso_admission_ranks/{m.name}"] = AdmissionState(self, i, "by_rank")
            else:
                self._checkpointed[f"picasso_admission/{m.name}"] = self.filters[i].counters

    def kernel_inputs(self):
        return []       # every lookup of the group reads the rows fetched per step

    def variables(self):
        return []

    def check(self, optimizer):
        check_hash_optimizer(optimizer, self.layout, "dynamic_vocabulary", ("sgd", "adagrad"))

    def bind(self, optimizer):
        """Ties the tables to `optimizer` (a RowSparseOptimizer) before a training step
        is traced: new keys' accumulators start at its initial value."""
        if optimizer is self.optimizer:
            return
        self.check(optimizer)
        self.optimizer = optimizer
        initial = float(getattr(optimizer.optimizer, "initial_accumulator_value", KERAS_ADAGRAD_ACCUMULATOR))
        for table in self.tables:
            if table.slot_init != initial:
                table.set_slot_init(initial)

    def distinct_keys(self, requests):
        """[_MemberKeys] of the requests ([(ExchangedIds, raw keys)] of this group): per
        member table they read, its distinct keys and how often each is looked up."""
        members = []
        for m in sorted({x.member for x, _ in requests}):
            own = [i for i, (x, _) in enumerate(requests) if x.member == m]
            flat = [tf.reshape(tf.cast(requests[i][1], tf.int64), [-1]) for i in own]
            unique, index, counts = tf.unique_with_counts(tf.concat(flat, 0))
            members.append(_MemberKeys(m, own, [tf.size(f) for f in flat], unique, index, counts))
        return members

    def plan(self, requests, check_ids):
        """The distinct raw keys per table of the requests, each table's checked against
        the capacity (``fetch`` takes it; its guards: what waits for the checks).
        `check_ids` does not apply: any int64 is a key."""
        members = self.distinct_keys(requests)
        checks = [self.capacity_check(x.member, tf.size(x.unique, out_type=tf.int64),
                                      sorted({requests[i][0].feature for i in x.own}))
                  for x in members if self.options.capacity is not None]
        return FetchPlan(requests, members, None, None, guards=[x.unique for x in members] + checks)

    def capacity_check(self, member, distinct, features):
        """The op refusing a step that looks up more than the capacity's `distinct` keys
        of member table `member` (several ranks: on the rank that owns them), which the
        `features` read."""
        where = "" if not self.world.distributed else (
            f" on the rank that owns them (under Horovod each of the {self.world.size} ranks holds up to "
            "vocabulary_capacity keys of its own)")
        return tf.debugging.assert_less_equal(
            distinct, tf.constant(self.options.capacity, tf.int64),
            message=f"picasso_tf: a batch looks up more distinct ids of {', '.join(features)} (table "
                    f"{self.layout.members[member].name}) than vocabulary_capacity={self.options.capacity} keys"
                    f"{where}; raise vocabulary_capacity or train on smaller batches. Nothing was changed")

    def fetch(self, plan, training):
        """What a plan's requests look up: (the rows of their distinct keys, table by
        table, each request's positions among them, those keys as [member, key, admitted]
        rows, None: no hot tier)."""
        rows, keys, firsts = self._rows(plan.keys, training)
        positions = [None] * len(plan.requests)
        for x, first in zip(plan.keys, firsts):
            for i, p in zip(x.own, positions_of([plan.requests[i] for i in x.own], x.index + first, x.sizes)):
                positions[i] = p
        return rows, positions, keys, None

    def plan_received(self, member, keys, lookups):
        """The owner's part of the exchange: [_MemberKeys] of every member table (in
        order, one each, however few keys it got), from the raw `keys` other ranks sent
        of member tables `member`, each looked up `lookups` times by its sender; a key
        sent by several ranks is one key, looked up as often as they all did."""
        members = []
        for m in range(len(self.layout.members)):
            own = tf.where(tf.equal(member, m))[:, 0]
            unique, index = tf.unique(tf.gather(keys, own))
            counts = tf.math.unsorted_segment_sum(tf.cast(tf.gather(lookups, own), tf.int32), index, tf.size(unique))
            members.append(_MemberKeys(m, own, None, unique, index, counts))
        return members

    def serve(self, members, training):
        """(The row of every key received, in the order received; the rows of the
        distinct keys, whose gradients update them; those keys as [member, key,
        admitted]) of plan_received's `members`."""
        rows, keys, firsts = self._rows(members, training)
        place = tf.dynamic_stitch([tf.cast(x.own, tf.int32) for x in members],
                                  [x.index + first for x, first in zip(members, firsts)])
        return tf.gather(rows, place), rows, keys

    def _rows(self, members, training):
        """(The rows of `members`' distinct keys, member after member; those keys as
        [member, key, admitted]; where each member's rows start)."""
        rows, keys, firsts, first = [], [], [], 0
        for x in members:
            if training:
                member_rows, admitted = self._find_or_admit(x.member, x.unique, x.counts)
            else:
                member_rows, admitted = self.tables[x.member].lookup(x.unique)[0], tf.ones_like(x.unique, tf.bool)
            firsts.append(first)
            first += tf.size(x.unique)
            rows.append(member_rows)
            keys.append(tf.stack([tf.fill(tf.shape(x.unique), tf.constant(x.member, tf.int64)), x.unique,
                                  tf.cast(admitted, tf.int64)], 1))
        return tf.concat(rows, 0), tf.concat(keys, 0), firsts

    def _find_or_admit(self, member, unique, counts):
        """(the rows of the distinct keys `unique` of member table `member`, looked up
        `counts` times each in this batch, which of them are admitted): the admitted ones
        found or inserted, counted at this step; zeros for the others."""
        table = self.tables[member]
        # The step a key was last looked up at (steps-to-live); 0 outside a training step.
        step = tf.identity(self.optimizer.optimizer.iterations) if self.optimizer else tf.constant(0, tf.int64)
        if self.filters[member] is None:
            return table.find_or_insert(unique, step), tf.ones_like(unique, tf.bool)
        found = table.lookup(unique)[1]
        seen = self.filters[member].count(unique, counts, tf.logical_not(found), step)
        admitted = tf.logical_or(found, seen >= self.options.admit_after)
        where = tf.where(admitted)
        rows = table.find_or_insert(tf.gather_nd(unique, where), step)
        with tf.control_dependencies([self.filters[member].forget(unique, tf.logical_and(admitted, ~found))]):
            rows = tf.scatter_nd(where, rows, [tf.size(unique, out_type=tf.int64), self.layout.dim])
        return rows, admitted

    def apply_fetched(self, keys, row_grads, iteration):
        """Updates the admitted rows of `keys` (fetch's) from their summed gradients, then
        evicts where a table is over its capacity (or its steps-to-live are due)."""
        update = table_update(self.optimizer, self.layout, iteration)
        member, admitted = keys[:, 0], keys[:, 2] > 0
        applied = []
        for m, table in enumerate(self.tables):
            mine = tf.where(tf.logical_and(tf.equal(member, m), admitted))[:, 0]
            applied.append(apply_to_table(table, update, tf.gather(keys[:, 1], mine), tf.gather(row_grads, mine)))
        with tf.control_dependencies(applied):
            step = tf.convert_to_tensor(iteration, tf.int64)
            evicted = tf.group([self._evictions(m, step) for m in range(len(self.tables))])
        with tf.control_dependencies([evicted]):
            return self.updates.assign_add(1)

    def _evictions(self, member, step):
        """The evictions due after a step from member table `member` and its admission counts."""
        tables = [self.tables[member]]
        if isinstance(self.filters[member], ExactCounts):
            tables.append(self.filters[member].table)
        return tf.group([_evict_when_due(table, self.options, step) for table in tables])

    def write_back(self):
        """The original variables hold hash bins' rows, not these (vocabulary() exports
        them). Several ranks: keeps every rank's keys, gathered, for the next checkpoint
        (a collective: every rank calls it, as save_weights does)."""
        if not self.world.distributed:
            return
        now = int(self.updates.numpy())
        if self._gathered_at != now:
            self._gathered = [self._gathered_state(m) for m in range(len(self.tables))]
            self._gathered_admission = [self._gathered_counters(m) if isinstance(f, BloomCounts) else None
                                        for m, f in enumerate(self.filters)]
            self._gathered_at = now

    def check_read_back(self):
        """Refuses the Bloom counters a restore read (AdmissionState) of a checkpoint
        written by one process or another number of ranks (one filter of every key cannot
        be split by owner), or with another bloom_filter_counters; they stay for the next
        read_back to refuse too."""
        for member, parts in sorted(self._restored_admission.items()):
            shape = parts["by_rank"].shape if "by_rank" in parts else (1,) + parts["total"].shape
            if shape != (self.world.size, self.filters[member].size):
                raise self._admission_refusal(member, shape)

    def read_back(self):
        """Several ranks: once check_read_back passes, imports the keys this rank owns of
        the tables a restore read and makes each Bloom filter whose counters it read hold
        this rank's own counters of the checkpoint; a refused restore changes nothing."""
        self.check_read_back()
        tables, self._restored_tables = self._restored_tables, {}
        admission, self._restored_admission = self._restored_admission, {}
        for member, state in tables.items():
            self._import(member, self._owned(state))
        for member, parts in admission.items():
            self.filters[member].counters.assign(parts["by_rank"][self.world.rank])

    def checkpoint_children(self):
        return dict(self._checkpointed)

    def keys_held(self):
        """The number of keys its tables hold (int64 tensor)."""
        return tf.add_n([table.size() for table in self.tables])

    def vocabulary(self):
        """{logical table name: (keys, rows)} of every member, keys increasing (NumPy);
        several ranks: every rank's keys (a collective: every rank calls it)."""
        out = {}
        for m, (member, table) in enumerate(zip(self.layout.members, self.tables)):
            exported = table.export()
            keys, [values] = self._from_every_rank(exported.keys, [exported.values], f"{m}_vocabulary")
            out[member.name] = (keys.numpy(), values.numpy())
        return out

    def checkpoint_state(self, member):
        """VocabularyState's tensors of member table number `member`: its hash table's
        export (and the exact admission counts); several ranks: write_back's, of every rank."""
        if not self.world.distributed:
            return self._local_state(member)
        if self._gathered_at == int(self.updates.numpy()):
            return self._gathered[member]
        return refused_on_save({name: tensor.dtype for name, tensor in self._local_state(member).items()},
                               lambda: self._refuse_stale(member))

    def admission_state(self, member, part):
        """AdmissionState's tensors of member table number `member` (several ranks): write_back's."""
        key = AdmissionState.KEYS[part]
        if self._gathered_at == int(self.updates.numpy()):
            return {key: self._gathered_admission[member][part]}
        return refused_on_save({key: tf.int32}, lambda: self._refuse_stale(member))

    def _refuse_stale(self, member):
        raise RuntimeError(
            f"picasso_tf: the dynamic vocabulary of {self.layout.members[member].name} is held by "
            f"{self.world.size} ranks and saved from write_back, which gathers it and which every rank calls "
            "together (save_weights does); call model.picasso.write_back() on every rank before writing a "
            "checkpoint with tf.train.Checkpoint")

    def restore_admission(self, member, part, counters):
        """Takes a checkpoint's Bloom counters (AdmissionState's `part`: NumPy) of member
        table number `member`, for the next read_back."""
        self._restored_admission.setdefault(member, {})[part] = counters

    def _admission_refusal(self, member, shape):
        """The error refusing a checkpoint's Bloom counters of member table `member`,
        `shape` [the ranks that saved them, counters]."""
        name = self.layout.members[member].name
        ranks, counters = shape
        if counters != self.filters[member].size:
            return ValueError(
                f"picasso_tf: the checkpoint's Bloom admission filter of table {name} has {counters} counters, not "
                f"bloom_filter_counters={self.filters[member].size}; restore it into a model with the "
                "bloom_filter_counters it was trained with")
        saver = "one process" if ranks == 1 else f"{ranks} ranks"
        return ValueError(
            f"picasso_tf: the checkpoint's Bloom admission counters of table {name} (admission_filter='bloom') "
            f"were saved by {saver}, and this model runs on {self.world.size} ranks, each counting only the keys "
            "it owns: a filter's counters cannot be split by owner. Restore it on one process or on as many ranks "
            "as saved it, or train with admission_filter='exact', whose counts restore into any number of ranks")

    def _local_state(self, member):
        state = self.tables[member].export()._asdict()
        counter = self.filters[member]
        if isinstance(counter, ExactCounts):
            candidates = counter.table.export()
            state.update(candidate_keys=candidates.keys, candidate_counts=candidates.counts,
                         candidate_last_steps=candidates.last_steps)
        return state

    def _gathered_state(self, member):
        """_local_state of member table `member` from every rank, keys increasing."""
        state = self._local_state(member)
        # Slots are [slot, key, dim]: gathered key by key.
        keys, (values, slots, counts, last_steps) = self._from_every_rank(
            state["keys"], [state["values"], tf.transpose(state["slots"], [1, 0, 2]), state["counts"],
                            state["last_steps"]], f"{member}_state")
        gathered = dict(keys=keys, values=values, slots=tf.transpose(slots, [1, 0, 2]), counts=counts,
                        last_steps=last_steps)
        if "candidate_keys" in state:
            keys, (counts, last_steps) = self._from_every_rank(
                state["candidate_keys"], [state["candidate_counts"], state["candidate_last_steps"]],
                f"{member}_candidates")
            gathered.update(candidate_keys=keys, candidate_counts=counts, candidate_last_steps=last_steps)
        return gathered

    def _gathered_counters(self, member):
        """Member table `member`'s Bloom counters from every rank: {"by_rank": [ranks, counters],
        "total": their sum, which one process's filter would hold}."""
        by_rank = hvd().allgather(self.filters[member].counters[None],
                                  name=f"picasso_vocabulary_{self.layout.name}_{member}_bloom")
        return {"by_rank": by_rank, "total": tf.reduce_sum(by_rank, 0)}

    def _from_every_rank(self, keys, fields, what):
        """(`keys`, `fields`: tensors of a row per key) of every rank, keys increasing
        (eagerly); one rank's as they are."""
        if not self.world.distributed:
            return keys, fields
        name = f"picasso_vocabulary_{self.layout.name}_{what}"
        keys = hvd().allgather(keys, name=f"{name}_keys")
        order = np.argsort(keys.numpy(), kind="stable")
        return tf.gather(keys, order), [tf.gather(hvd().allgather(f, name=f"{name}_{i}"), order)
                                        for i, f in enumerate(fields)]

    def restore(self, member, state):
        """Takes a checkpoint's `state` (VocabularyState's tensors) of member table
        number `member`: one process, now; several ranks, at read_back (the keys this
        rank owns, whatever the number of ranks that saved it), so that a refused restore
        changes no table. Returns the op."""
        if self.world.distributed:
            names = sorted(state)
            return restore_with_numpy(lambda *arrays: self._restored_tables.update({member: dict(zip(names, arrays))}),
                                      [state[n] for n in names])
        return self._import(member, state)

    def _import(self, member, state):
        """Makes member table `member` hold `state`, evicted down to the capacity if it
        holds more. Returns the op."""
        self._gathered_at = None
        table, counter = self.tables[member], self.filters[member]
        restored = [table.import_(state["keys"], state["values"], state["slots"], state["counts"],
                                  state["last_steps"])]
        if isinstance(counter, ExactCounts) and "candidate_keys" in state:
            n = tf.size(state["candidate_keys"])
            restored.append(counter.table.import_(state["candidate_keys"], tf.zeros([n, 1]), tf.zeros([0, n, 1]),
                                                  state["candidate_counts"], state["candidate_last_steps"]))
        if self.options.capacity is None:
            return tf.group(restored)
        with tf.control_dependencies(restored):
            held = [table] + ([counter.table] if isinstance(counter, ExactCounts) else [])
            return tf.group([t.evict(self.options.capacity) for t in held])


    def _owned(self, state):
        """A checkpoint's state reduced to the keys (and candidate keys) this rank owns."""
        out = dict(state)
        for keys, fields, slotted in (("keys", ("values", "counts", "last_steps"), "slots"),
                                      ("candidate_keys", ("candidate_counts", "candidate_last_steps"), None)):
            if keys not in state:
                continue
            mine = tf.where(tf.equal(raw_key_owner(state[keys], self.world.size), self.world.rank))[:, 0]
            for name in (keys,) + fields:
                out[name] = tf.gather(state[name], mine)
            if slotted:
                out[slotted] = tf.gather(state[slotted], mine, axis=1)
        return out


@dataclasses.dataclass
class _MemberKeys:
    """One member table's part of a step's fetch."""
    member: int
    own: list           # the requests (their indices) reading it; the owner's: the received keys' (tensor)
    sizes: list         # ids per request (None on the owner)
    unique: tf.Tensor   # the distinct keys
    index: tf.Tensor    # each id's place among them
    counts: tf.Tensor   # each distinct key's lookups in the batch


class VocabularyState(tf.__internal__.tracking.Trackable):
    """A checkpoint's dynamic vocabulary of one logical table: its hash table's keys,
    rows, slots, counts and last steps, and (exact admission) the counts of keys not yet
    admitted."""

    def __init__(self, storage, member):
        self._storage, self._member = storage, member

    def _serialize_to_tensors(self):
        return self._storage.checkpoint_state(self._member)

    def _restore_from_tensors(self, restored_tensors):
        return self._storage.restore(self._member, restored_tensors)


class AdmissionState(tf.__internal__.tracking.Trackable):
    """Under several ranks, a checkpoint's Bloom admission counters of one logical table:
    `part` "total", their sum over the ranks, under a variable's key (one process restores
    its filter, a variable, from it), or "by_rank", each rank's counters."""

    KEYS = {"total": "VARIABLE_VALUE", "by_rank": "counters"}

    def __init__(self, storage, member, part):
        self._storage, self._member, self._part = storage, member, part

    def _serialize_to_tensors(self):
        return self._storage.admission_state(self._member, self._part)

    def _restore_from_tensors(self, restored_tensors):
        return restore_with_numpy(lambda counters: self._storage.restore_admission(self._member, self._part, counters),
                                  [restored_tensors[self.KEYS[self._part]]])


class ExactCounts:
    """Admission by exact counts: a hash table of one float per key, whose access count
    is how often the key was looked up without a row."""

    def __init__(self):
        self.table = HashTable(1, initializer="zeros")

    def count(self, unique, counts, candidates, step):
        """Each of the distinct keys `unique`'s count, after adding `counts` (this batch's
        lookups) for those `candidates` (the keys without a row)."""
        keys = tf.repeat(*select_rows(candidates, unique, counts))
        with tf.control_dependencies([self.table.find_or_insert(keys, step)]):
            return self.table.counts(unique)

    def forget(self, unique, admitted):
        """Drops the counts of the keys just `admitted` (a mask of `unique`): they have rows now."""
        return self.table.erase(select_rows(admitted, unique))


class BloomCounts:
    """Admission by a counting Bloom filter: `size` int32 counters, a key's count being
    the least of its BLOOM_HASHES counters (never below the true count)."""

    def __init__(self, size, name):
        with tf.init_scope():
            self.counters = tf.Variable(tf.zeros([size], tf.int32), trainable=False,
                                        name=f"picasso_admission/{name}")
        self.size = size

    def count(self, unique, counts, candidates, step):
        slots = tf.stack([_fingerprint_slots(unique, salt, self.size) for salt in range(BLOOM_HASHES)], 1)
        added = tf.cast(tf.where(candidates, counts, tf.zeros_like(counts)), tf.int32)
        # Each of a key's counters once, where two of its hashes fall on the same counter.
        key = tf.repeat(tf.range(tf.size(unique, out_type=tf.int64)), BLOOM_HASHES)
        pairs = tf.unique(key * self.size + tf.reshape(slots, [-1]))[0]
        update = self.counters.scatter_add(tf.IndexedSlices(tf.gather(added, pairs // self.size), pairs % self.size))
        with tf.control_dependencies([update]):
            return tf.cast(tf.reduce_min(tf.gather(self.counters, slots), axis=1), counts.dtype)

    def forget(self, unique, admitted):
        return tf.no_op()       # a counter is shared by many keys: it cannot forget one


def _fingerprint_slots(keys, salt, size):
    salted = tf.stack([keys, tf.fill(tf.shape(keys), tf.constant(salt, tf.int64))], 1)
    bits = tf.bitcast(tf.fingerprint(salted), tf.int64)
    return tf.math.floormod(bits, tf.constant(size, tf.int64))


def _admission_filter(options, name):
    if options.admit_after <= 1:
        return None
    if options.admission_filter == "bloom":
        return BloomCounts(options.bloom_counters, name)
    return ExactCounts()


def _evict_when_due(table, options, step):
    """An op evicting from `table` (HashTable.evict) when it holds more than the capacity
    (down to KEEP_AFTER_EVICTION of it) or its steps-to-live are due."""
    over = tf.constant(False)
    keep = tf.constant(tf.int64.max)
    if options.capacity is not None:
        over = table.size() > options.capacity
        low = max(1, int(options.capacity * KEEP_AFTER_EVICTION))
        keep = tf.where(over, tf.constant(low, tf.int64), keep)
    stale_before, due = tf.int64.min, over
    if options.eviction == "ttl":
        stale_before = step - options.steps_to_live + 1
        due = tf.logical_or(due, tf.logical_and(step > 0, tf.equal(step % options.steps_to_live, 0)))
    return tf.cond(due, lambda: tf.group(table.evict(keep, stale_before)), tf.no_op)


def _seed(initializer, table_name):
    """The table's seed for new rows: the initializer's, told apart by the table's name."""
    config = tf.keras.initializers.get(initializer).get_config()
    return (int(config.get("seed") or 0) ^ zlib.crc32(table_name.encode())) & ((1 << 63) - 1)
