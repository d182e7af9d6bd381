"""The row exchange of hybrid parallelism: each step (each micro-batch, under
micro_batches=K from the embedding), every rank fetches the rows its batch looks up
from the ranks that hold them, in two AllToAllv for all groups together. A
row-sharded table's row id lives on rank id // block (picasso_tf.embedding.sharded:
contiguous blocks), a hash-backed table's on rank id % size.

Requester (every rank, for its batch): per group, the ids of its sites become keys
(table number << 40 | id), deduplicated, and are partitioned by owner. One buffer
holds every group's keys, owner-major (each owner's part: group by group), and one
AllToAllv sends it.

Owner: the keys it received are looked up in its shards with the fused lookup kernel,
one op per group, and sent back in one AllToAllv laid out like the keys (flattened
rows, group by group). Two ranks may ask for the same row: the lookup's gradient sums
its rows' gradients per row, so the keys are looked up as received (hash-backed groups,
whose rows are served and updated by key, deduplicate them first). With
config.wire_dtype="float16" the rows and, on the way back, their gradients travel as
float16 (wire.py).

Requester again: each group's rows land in one [fetched, dim] tensor; a site's ids
become positions in it (ExchangedIds), which the rewritten graph's fused lookups read.

Backward needs nothing of its own: the gradient of the rows' AllToAllv is the reverse
AllToAllv, which returns every row gradient to its owner, summed there per row by the
gradient of the owner's lookup, and becomes the shard variables' row-sparse gradient.
A hash-backed group (picasso_tf.embedding.hybrid_hash) serves its rows from this rank's
hash storage instead, and the step takes the gradient of the rows it served (``log``).

A dynamic vocabulary (picasso_tf.embedding.dynamic_vocabulary) is keyed by raw ids, any
int64, owned by rank raw_key_owner(key): no bits are left for a table number. With one
in the exchange every key travels as a pair (row_keys.pairs: table number << ID_BITS |
lookups, key; a row id's pair has no lookups) in the same one AllToAllv, [n, 2] instead
of [n]: the requester sends each distinct raw key once with how often its batch looked
it up, and the owner sums those over the ranks (admission counts every lookup). Its
owner's lookup inserts and counts, so with vocabulary_capacity set every owner first
checks its distinct keys per table against it, and the ranks agree on the largest
count in one small Allreduce (Max): a step beyond the capacity fails on every rank,
before any table of any rank changes, instead of leaving the others waiting.

An id outside its table is found by the requester, but refusing the step there alone
would leave the other ranks waiting in the AllToAllv (or, if the script goes on,
matching the next step's). So the ids' AllToAllv itself carries it, at no cost to a
good step: a rank with an invalid id sends every rank, in place of its keys, one record
naming the request and the id (_reported), and every rank finds it among what it
received and raises the same error, before serving anything (_refuse_reported).

A table read in place (replicated: too small to shard, or frozen) has its ids checked
by the fused kernels, which would fail on their rank alone. So its sites' ids are
checked here too (``in_place``), reported like the exchanged ones, and reach the
kernels only once no rank reported one. A training step with no exchanged group has no
ids' AllToAllv: its in-place ids are reported in its gradients' Allreduce instead
(reported_ids.py).
"""
import numpy as np
import tensorflow as tf

from picasso_tf.distributed.wire import alltoall_rows
from picasso_tf.distributed.world import hvd
from picasso_tf.embedding.dynamic_vocabulary import DynamicVocabularyTables
from picasso_tf.embedding.hybrid_hash import FetchedRowsLog, HybridHashTables
from picasso_tf.embedding.row_keys import (ID_BITS, check_table_count, first_invalid, flat_ids, invalid_id_message,
                                           keys_of_ids, pairs, positions_of, raw_key_owner, row_id, table_number,
                                           widened)
from picasso_tf.embedding.sharded import RowShardedTables
from picasso_tf.ops.packed_lookup import packed_lookup, packed_unique
from picasso_tf.ops.read_tables import read_tables


# The owner looks a group's keys up as one site per (sender, member) run up to this many
# sites (measured on 2 ranks); beyond, one op with that many inputs, and the split and
# concatenation of as many pieces, are untried, and it partitions by member instead.
MAX_RUNS = 256


class RowExchange:
    """The exchange of the sharded storages `storages` (picasso_tf.embedding.sharded),
    in the order every rank lays them out."""

    def __init__(self, storages, world, check_ids=True, training=True, wire_dtype="float32"):
        self.storages, self.world, self.check_ids, self.training = list(storages), world, check_ids, training
        self.wire_dtype = wire_dtype
        self.log = FetchedRowsLog()     # rows served from hash storage, for the training step
        # Raw keys take all 64 bits: with a dynamic vocabulary, every key travels as a pair.
        self.wide = any(s.kind == DynamicVocabularyTables.kind for s in self.storages)
        self.features = {}              # (group, member) -> the features reading it, for errors
        self.first_table, tables = {}, []
        for g, storage in enumerate(self.storages):
            self.first_table[storage.name] = len(tables)
            tables += [(g, m) for m in range(len(storage.layout.members))]
        check_table_count(len(tables))
        self.group_of_table = tf.constant([g for g, _ in tables], tf.int32)
        self.member_of_table = tf.constant([m for _, m in tables], tf.int32)
        sharded = [self.storages[g] if self.storages[g].kind == RowShardedTables.kind else None for g, _ in tables]
        # Per table: rows per rank, and this rank's first row (row-sharded tables only).
        self.block_of_table = tf.constant([s.blocks[m] if s else 1 for s, (_, m) in zip(sharded, tables)], tf.int64)
        self.first_row_of_table = tf.constant([s.first_row(m) if s else 0 for s, (_, m) in zip(sharded, tables)],
                                              tf.int64)

    def fetch(self, requests, in_place=()):
        """requests: [(ExchangedIds, ids tensor)]; in_place: [(feature, rows, ids tensor)]
        of the sites whose tables the kernels read in place. Returns ({group name:
        fetched rows}, [positions tensor per request, shaped and typed as its ids] + [the
        ids of each in-place site, once every rank found its own in their tables])."""
        size, groups = self.world.size, len(self.storages)
        keys, remap, counts, segments, invalid = [], [], [], [], []
        for x, _ in requests:
            self.features.setdefault((x.group, x.member), set()).add(x.feature)
        for storage in self.storages:
            own = [i for i, (x, _) in enumerate(requests) if x.group == storage.name]
            k, positions, c, segmented, bad = self._request(storage, [requests[i] for i in own])
            keys.append(k)
            remap.append((own, positions))
            counts.append(c)
            segments.append(segmented)
            if bad is not None:
                flag, request, value = bad
                invalid.append((flag, tf.gather(tf.constant(own, tf.int32), request), value))
        if in_place:
            flag, site, value = first_invalid([rows for _, rows, _ in in_place],
                                              flat_ids([ids for _, _, ids in in_place]))
            invalid.append((flag, site + len(requests), value))     # numbered after the requests
        # One buffer, owner-major: for each owner, group by group.
        send = tf.concat([keys[g][d] for d in range(size) for g in range(groups)], 0)
        send_splits = tf.add_n(counts)
        if invalid:
            send, send_splits = self._reported(invalid, send, send_splits)
        received, received_splits = hvd().alltoall(send, splits=send_splits, name="picasso_exchange_ids")
        if invalid:
            features = [x.feature for x, _ in requests] + [feature for feature, _, _ in in_place]
            received = self._refuse_reported(features, self._limits(requests, in_place), received, received_splits)
        with tf.control_dependencies([received]):
            checked = [tf.identity(ids) for _, _, ids in in_place]
        rows_back, back_splits = self._serve(received, received_splits)
        fetched = alltoall_rows(rows_back, back_splits, "picasso_exchange_rows", self.wire_dtype)

        rows = self._rows_of_groups(fetched, counts, segments)
        positions = [None] * len(requests)
        for own, site_positions in remap:
            for i, p in zip(own, site_positions):
                positions[i] = p
        return rows, positions + checked

    def _rows_of_groups(self, fetched, counts, segments):
        """{group name: its fetched rows}, from the flat buffer the owners sent back (owner
        by owner, group by group): in the order of the group's keys, that is owner by owner,
        or, for a group whose keys were cut in segments (_request), in ascending keys."""
        size, groups = self.world.size, len(self.storages)
        dims = [s.layout.dim for s in self.storages]
        sizes, at = [], {}      # each piece's floats; (owner, group) -> its pieces' numbers
        for d in range(size):
            for g in range(groups):
                part = counts[g][d:d + 1] if segments[g] is None else segments[g][:, d]
                first = sum(int(p.shape[0]) for p in sizes)
                at[d, g] = range(first, first + int(part.shape[0]))
                sizes.append(part * dims[g])
        pieces = tf.split(fetched, tf.concat(sizes, 0), num=at[size - 1, groups - 1].stop)
        rows = {}
        for g, storage in enumerate(self.storages):
            # Segment t of every owner, then segment t + 1 (one segment: owner by owner).
            order = [at[d, g][t] for t in range(len(at[0, g])) for d in range(size)]
            rows[storage.name] = tf.reshape(tf.concat([pieces[i] for i in order], 0), [-1, dims[g]])
        return rows

    def _limits(self, requests, in_place):
        """The rows of each request's table, then of each in-place site's."""
        storages = {s.name: s for s in self.storages}
        return [storages[x.group].layout.members[x.member].rows for x, _ in requests] + [r for _, r, _ in in_place]

    def _request(self, storage, requests):
        """One group's deduplicated keys per owner, each request's positions in the
        group's fetched rows, the number of keys per owner, the keys' segments or None
        (below), and (checking ids) whether an id lies outside its table, the request
        holding the first one and that id (first_invalid), else None.

        A row-sharded group's keys (with checked ids) are distinct and ascending: table by
        table, each table's rows owner by owner. So they are cut in segments, [members,
        size] keys of each table for each owner, and each owner is sent its segments table
        by table. The fetched rows are put back in the keys' order by the same cuts (a
        split and a concatenation of rows, _rows_of_groups), and each id's position is its
        key's index as found: no per-id gather maps it to its place owner by owner."""
        size = self.world.size
        bad = None
        if not requests:
            empty = tf.zeros([0, 2] if self.wide else [0], tf.int64)
            return [empty] * size, [], tf.zeros([size], tf.int32), None, bad
        if storage.kind == DynamicVocabularyTables.kind:
            unique, index, sizes, owner = self._raw_keys(storage, requests)
        else:
            flat = flat_ids([ids for _, ids in requests])
            if self.check_ids:
                bad = first_invalid([storage.layout.members[x.member].rows for x, _ in requests], flat)
                # Such a batch is reported instead of sent (fetch): its ids need only find an owner.
                flat = tf.cond(bad[0], lambda: [tf.zeros_like(f) for f in flat], lambda: flat)
            sizes = [tf.size(f) for f in flat]
            if storage.kind == RowShardedTables.kind and self.check_ids:
                unique, index = self._distinct_rows(storage, requests, flat)
                segments = self._owner_segments(storage, unique)
                members = len(storage.layout.members)
                sent = widened(unique) if self.wide else unique
                cut = tf.split(sent, tf.reshape(segments, [-1]), num=members * size)    # table-major
                by_owner = [tf.concat(cut[d::size], 0) for d in range(size)]
                return by_owner, positions_of(requests, index, sizes), tf.reduce_sum(segments, 0), segments, bad
            unique, index = tf.unique(keys_of_ids(requests, flat, self.first_table[storage.name]))
            if storage.kind == RowShardedTables.kind:
                owner = tf.cast(row_id(unique) // tf.gather(self.block_of_table, table_number(unique)), tf.int32)
            else:
                owner = tf.cast(row_id(unique) % size, tf.int32)
            if self.wide:
                unique = widened(unique)
        by_owner = tf.dynamic_partition(unique, owner, size)
        order = tf.dynamic_partition(tf.range(tf.shape(unique)[0]), owner, size)
        # Fetched rows come back owner by owner: a key's row lands at its place in that order.
        place = tf.gather(tf.math.invert_permutation(tf.concat(order, 0)), index)
        counts = tf.stack([tf.shape(part)[0] for part in by_owner])
        return by_owner, positions_of(requests, place, sizes), counts, None, bad

    def _owner_segments(self, storage, keys):
        """[members, size] int32: how many of a row-sharded group's ascending keys fall in
        each member table's block of rows of each owner."""
        first = self.first_table[storage.name]
        edges = [(first + m) << ID_BITS | min(d * storage.blocks[m], member.rows)
                 for m, member in enumerate(storage.layout.members) for d in range(self.world.size)]
        starts = tf.searchsorted(keys, tf.constant(edges, tf.int64), out_type=tf.int32)
        ends = tf.concat([starts[1:], tf.shape(keys, out_type=tf.int32)], 0)
        return tf.reshape(ends - starts, [len(storage.layout.members), self.world.size])

    def _distinct_rows(self, storage, requests, flat):
        """A row-sharded group's distinct keys (ascending) and each id's index among them,
        requests after one another, from the fused kernels' grouping of rows (a byte map
        over the group's rows where they are few per id, else a radix sort), which costs
        less than tf.unique's hash map (a third of it on small tables). The order of the
        keys changes no value: every sum over an id's contributions keeps the ids' order.
        The ids must be checked first: here an id beyond its table would read the next
        one's rows. (The owner keeps tf.unique: grouping there by shard row needs a
        lookup per member and a concatenation whose gradient costs more than it saves.)"""
        rows = [m.rows for m in storage.layout.members]
        starts = np.cumsum([0] + rows[:-1])         # each member's first row among the group's
        packed = tf.concat([ids + int(starts[x.member]) for (x, _), ids in zip(requests, flat)], 0)
        distinct, (index,), _ = packed_unique([packed], offsets=[0], vocab_sizes=[sum(rows)],
                                              feature_names=[storage.name])
        starts = tf.constant(starts, tf.int64)
        member = tf.searchsorted(starts, distinct, side="right") - 1
        table = tf.cast(member, tf.int64) + self.first_table[storage.name]
        key = tf.bitwise.bitwise_or(tf.bitwise.left_shift(table, tf.constant(ID_BITS, tf.int64)),
                                    distinct - tf.gather(starts, member))
        return key, index

    def _reported(self, invalid, send, send_splits):
        """The ids' buffer and splits as they are, or, where an id of this rank's batch
        lies outside its table (`invalid`: per group, first_invalid's report, the request
        numbered among all), a record to every rank in their place: (-1 - the request's
        number, the id), which no key can be (keys are >= 0)."""
        flags = tf.stack([flag for flag, _, _ in invalid])
        first = tf.argmax(tf.cast(flags, tf.int32), output_type=tf.int32)
        request = tf.gather(tf.stack([r for _, r, _ in invalid]), first)
        record = tf.stack([-1 - tf.cast(request, tf.int64), tf.gather(tf.stack([v for _, _, v in invalid]), first)])
        record = record[None] if self.wide else record      # one pair, or two ids
        size = self.world.size

        def report():
            return tf.tile(record, [size, 1] if self.wide else [size]), tf.fill([size], tf.shape(record)[0])
        return tf.cond(tf.reduce_any(flags), report, lambda: (send, send_splits))

    def _refuse_reported(self, features, limits, received, received_splits):
        """`received`, once no rank reported an invalid id (_reported's record heads the
        part it sent); else the error every rank raises alike, naming the first reporting
        rank, the feature and the id (features, limits: per request numbered as
        reported), before any table of any rank changes and before any other
        collective of the step (but the earlier micro-batches' finished ones), so that
        every rank can go on to the next step."""
        tag = received[:, 0] if self.wide else received
        starts = tf.cumsum(received_splits, exclusive=True)
        head = tf.gather(tf.concat([tag, tf.zeros([1], tf.int64)], 0), starts)     # a sender's first key
        reported = tf.logical_and(received_splits > 0, head < 0)

        def fail():
            sender = tf.argmax(tf.cast(reported, tf.int32), output_type=tf.int32)
            request = tf.cast(-1 - tf.gather(head, sender), tf.int32)
            at = tf.gather(starts, sender)
            value = received[at, 1] if self.wide else received[at + 1]
            message = invalid_id_message(features, limits, request, value, rank=sender)
            with tf.control_dependencies([tf.debugging.Assert(False, message, summarize=1)]):
                return tf.constant(False)

        checked = tf.cond(tf.reduce_any(reported), fail, lambda: tf.constant(True))
        with tf.control_dependencies([checked]):
            return tf.identity(received)

    def _raw_keys(self, storage, requests):
        """A dynamic vocabulary's requests as (their distinct keys as pairs, each id's
        place among them, requests after one another, the ids per request, each pair's
        owner)."""
        first = self.first_table[storage.name]
        members = storage.distinct_keys(requests)
        places, start = [None] * len(requests), 0
        for x in members:
            for i, place in zip(x.own, tf.split(x.index + start, x.sizes, num=len(x.sizes))):
                places[i] = place
            start += tf.size(x.unique)
        keys = tf.concat([x.unique for x in members], 0)
        sent = tf.concat([pairs(tf.fill(tf.shape(x.unique), first + x.member), x.counts, x.unique)
                          for x in members], 0)
        return sent, tf.concat(places, 0), [tf.size(p) for p in places], raw_key_owner(keys, self.world.size)

    def _serve(self, received, received_splits):
        """The rows of the keys other ranks asked this one for, laid out as they sent
        them, and the number of floats per rank."""
        size, groups = self.world.size, len(self.storages)
        tag = received[:, 0] if self.wide else received
        table = table_number(tag)
        if self.wide:       # as it is whenever a dynamic vocabulary is served
            key, lookups = received[:, 1], row_id(tag)
            # A row id's pair has no lookups: its tag | id is the key it would travel as alone.
            received = tf.bitwise.bitwise_or(tag, key)
        received_group = tf.gather(self.group_of_table, table)
        # Each group's keys in the order received (sender by sender).
        entries = tf.dynamic_partition(tf.range(tf.size(table)), received_group, groups)
        sender = tf.repeat(tf.range(size), received_splits)
        per_sender = tf.reshape(tf.math.bincount(sender * groups + received_group, minlength=size * groups,
                                                 maxlength=size * groups), [size, groups])
        vocabularies = {g: storage.plan_received(tf.gather(self.member_of_table, tf.gather(table, entries[g])),
                                                 tf.gather(key, entries[g]), tf.gather(lookups, entries[g]))
                        for g, storage in enumerate(self.storages) if storage.kind == DynamicVocabularyTables.kind}
        # No group's table changes before every rank's vocabularies are within their capacity.
        with tf.control_dependencies(self._capacity_checks(vocabularies)):
            served = [self._served(storage, entries[g], received, vocabularies.get(g), sender)
                      for g, storage in enumerate(self.storages)]
        pieces, floats = [], []
        for g, (storage, rows) in enumerate(zip(self.storages, served)):
            dim = storage.layout.dim
            pieces.append(tf.split(tf.reshape(rows, [-1]), per_sender[:, g] * dim, num=size))
            floats.append(per_sender[:, g] * dim)
        buffer = tf.concat([pieces[g][s] for s in range(size) for g in range(groups)], 0)
        return buffer, tf.add_n(floats)

    def _served(self, storage, entries, received, vocabulary, sender):
        """The rows of one group's received keys (at `entries` of `received`, whose keys
        came from ranks `sender`), in the order received; `vocabulary`: plan_received's
        members, for a dynamic vocabulary."""
        if vocabulary is not None:
            rows, distinct_rows, keys = storage.serve(vocabulary, self.training)
            if self.training:
                self.log.record(storage, keys, distinct_rows, None)
            return rows
        keys = tf.gather(received, entries)
        if storage.kind == RowShardedTables.kind:
            # Two ranks may ask for the same row: the lookup's gradient kernel sums each row's
            # gradients before the update applies them, so each key is looked up as received.
            if self.check_ids and self.world.size * len(storage.layout.members) <= MAX_RUNS:
                return self._lookup_ascending(storage, keys, tf.gather(sender, entries))
            return self._lookup(storage, keys)
        # A hash-backed group's rows are served and updated by key, once each.
        unique, index = tf.unique(keys)
        return tf.gather(self._lookup(storage, unique), index)

    def _capacity_checks(self, vocabularies):
        """The ops refusing a training step in which any rank owns more distinct keys of a
        dynamic-vocabulary table than its capacity: the same on every rank (one Allreduce
        of the counts), so that they all fail together; none without a capacity."""
        checked = [(self.storages[g], x) for g, members in vocabularies.items()
                   if self.storages[g].options.capacity is not None for x in members]
        if not checked or not self.training:
            return []
        distinct = tf.stack([tf.size(x.unique, out_type=tf.int64) for _, x in checked])
        most = hvd().allreduce(distinct, op=hvd().Max, name="picasso_vocabulary_capacity")
        return [storage.capacity_check(x.member, most[i], sorted(self.features.get((storage.name, x.member), ())))
                for i, (storage, x) in enumerate(checked)]

    def _lookup_ascending(self, storage, keys, sender):
        """The rows of a row-sharded group's keys from this rank's shards, in their order,
        where each sender's keys are ascending (_request, with checked ids), so member by
        member: each (sender, member) run is a site of one fused lookup, whose outputs
        follow one another in the keys' order (no partition by member, no stitch back)."""
        members, size = len(storage.layout.members), self.world.size
        table = table_number(keys)
        member = tf.gather(self.member_of_table, table)
        local = row_id(keys) - tf.gather(self.first_row_of_table, table)
        sites = size * members
        runs = tf.math.bincount(sender * members + member, minlength=sites, maxlength=sites)
        shards = storage.variables()
        rows = packed_lookup(read_tables([v.handle for v in shards], storage.layout.dtype),
                             tf.split(local, runs, num=sites), offsets=[0] * sites,
                             vocab_sizes=[int(v.shape[0]) for v in shards] * size, combiners=["none"] * sites,
                             feature_names=[m.name for m in storage.layout.members] * size,
                             table_index=list(range(members)) * size)
        return tf.concat(rows, 0)

    def _lookup(self, storage, keys):
        """The rows of one group's keys from this rank's shards, in their order (a hash-backed group's: distinct)."""
        members = len(storage.layout.members)
        member = tf.gather(self.member_of_table, table_number(keys))
        if storage.kind == HybridHashTables.kind:
            # Its keys: the member table's number in the group and the row id.
            own = tf.bitwise.bitwise_or(row_id(keys), tf.bitwise.left_shift(tf.cast(member, tf.int64), ID_BITS))
            rows, hits = storage.rows(own, self.training)
            if self.training:
                self.log.record(storage, own, rows, hits)
            return rows
        local = row_id(keys) - tf.gather(self.first_row_of_table, table_number(keys))
        ids = tf.dynamic_partition(local, member, members)
        order = tf.dynamic_partition(tf.range(tf.size(keys)), member, members)
        shards = storage.variables()
        rows = packed_lookup(read_tables([v.handle for v in shards], storage.layout.dtype), ids,
                             offsets=[0] * members, vocab_sizes=[int(v.shape[0]) for v in shards],
                             combiners=["none"] * members, feature_names=[m.name for m in storage.layout.members],
                             table_index=list(range(members)))
        return tf.dynamic_stitch(order, rows)

