"""The row exchange of hybrid parallelism: each step, every rank fetches the rows its
batch looks up from the ranks that hold them, in two AllToAllv for all groups
together. A row-sharded table's row id lives on rank id // block (picasso_tf.embedding.
sharded: contiguous blocks), a hash-backed table's on rank id % size.

Requester (every rank, for its batch): per group, the ids of its sites become keys
(table number << 40 | id), deduplicated, and are partitioned by owner. One buffer
holds every group's keys, owner-major (each owner's part: group by group), and one
AllToAllv sends it.

Owner: the keys it received, deduplicated again (two ranks asking for the same row
must be served one row, or their gradients would overwrite each other), are looked up
in its shards with the fused lookup kernel, one op per group, and sent back in one
AllToAllv laid out like the keys (flattened rows, group by group). With
config.wire_dtype="float16" the rows and, on the way back, their gradients travel as
float16 (wire.py).

Requester again: each group's rows land in one [fetched, dim] tensor; a site's ids
become positions in it (ExchangedIds), which the rewritten graph's fused lookups read.

Backward needs nothing of its own: the gradient of the rows' AllToAllv is the reverse
AllToAllv, which returns every row gradient to its owner, summed there per row by the
gradient of the owner's gather, and becomes the shard variables' row-sparse gradient.
A hash-backed group (picasso_tf.embedding.hybrid_hash) serves its rows from this rank's
hash storage instead, and the step takes the gradient of the rows it served (``log``).
"""
import tensorflow as tf

from picasso_tf.distributed.wire import alltoall_rows
from picasso_tf.distributed.world import hvd
from picasso_tf.embedding.hybrid_hash import FetchedRowsLog, HybridHashTables
from picasso_tf.embedding.row_keys import ID_BITS, check_table_count, keys_of, positions_of, row_id, table_number
from picasso_tf.embedding.sharded import RowShardedTables
from picasso_tf.ops.packed_lookup import packed_lookup
from picasso_tf.ops.read_tables import read_tables


class RowExchange:
    """The exchange of the sharded storages `storages` (picasso_tf.embedding.sharded),
    in the order every rank lays them out."""

    def __init__(self, storages, world, check_ids=True, training=True, wire_dtype="float32"):
        self.storages, self.world, self.check_ids, self.training = list(storages), world, check_ids, training
        self.wire_dtype = wire_dtype
        self.log = FetchedRowsLog()     # rows served from hash storage, for the training step
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

    def fetch(self, requests):
        """requests: [(ExchangedIds, ids tensor)]. Returns ({group name: fetched rows},
        [positions tensor per request, shaped and typed as its ids])."""
        size, groups = self.world.size, len(self.storages)
        keys, remap, counts = [], [], []
        for storage in self.storages:
            own = [i for i, (x, _) in enumerate(requests) if x.group == storage.name]
            k, positions, c = self._request(storage, [requests[i] for i in own])
            keys.append(k)
            remap.append((own, positions))
            counts.append(c)
        # One buffer, owner-major: for each owner, group by group.
        send = tf.concat([keys[g][d] for d in range(size) for g in range(groups)], 0)
        send_splits = tf.add_n(counts)
        received, received_splits = hvd().alltoall(send, splits=send_splits, name="picasso_exchange_ids")
        rows_back, back_splits = self._serve(received, received_splits)
        fetched = alltoall_rows(rows_back, back_splits, "picasso_exchange_rows", self.wire_dtype)

        dims = [s.layout.dim for s in self.storages]
        sizes = tf.stack([counts[g][d] * dims[g] for d in range(size) for g in range(groups)])
        pieces = tf.split(fetched, sizes, num=size * groups)
        rows = {storage.name: tf.reshape(tf.concat([pieces[d * groups + g] for d in range(size)], 0), [-1, dims[g]])
                for g, storage in enumerate(self.storages)}
        positions = [None] * len(requests)
        for own, site_positions in remap:
            for i, p in zip(own, site_positions):
                positions[i] = p
        return rows, positions

    def _request(self, storage, requests):
        """One group's deduplicated keys per owner, each request's positions in the
        group's fetched rows, and the number of keys per owner."""
        size = self.world.size
        if not requests:
            empty = tf.zeros([0], tf.int64)
            return [empty] * size, [], tf.zeros([size], tf.int32)
        keys, sizes = keys_of(storage.layout, requests, self.first_table[storage.name], self.check_ids)
        unique, index = tf.unique(keys)
        if storage.kind == RowShardedTables.kind:
            owner = tf.cast(row_id(unique) // tf.gather(self.block_of_table, table_number(unique)), tf.int32)
        else:
            owner = tf.cast(row_id(unique) % size, tf.int32)
        by_owner = tf.dynamic_partition(unique, owner, size)
        order = tf.dynamic_partition(tf.range(tf.size(unique)), owner, size)
        # Fetched rows come back owner by owner: a key's row lands at its place in that order.
        place = tf.gather(tf.math.invert_permutation(tf.concat(order, 0)), index)
        counts = tf.stack([tf.size(part) for part in by_owner])
        return by_owner, positions_of(requests, place, sizes), counts

    def _serve(self, received, received_splits):
        """The rows of the keys other ranks asked this one for, laid out as they sent
        them, and the number of floats per rank."""
        size, groups = self.world.size, len(self.storages)
        unique, index = tf.unique(received)
        table = table_number(unique)
        group = tf.gather(self.group_of_table, table)
        by_group = tf.dynamic_partition(unique, group, groups)
        order = tf.dynamic_partition(tf.range(tf.size(unique)), group, groups)
        starts = tf.cumsum(tf.stack([tf.size(part) for part in by_group]), exclusive=True)
        place = tf.gather(tf.math.invert_permutation(tf.concat(order, 0)), index)   # group-major
        received_group = tf.gather(group, index)
        place_in_group = place - tf.gather(starts, received_group)
        wanted = tf.dynamic_partition(place_in_group, received_group, groups)
        sender = tf.repeat(tf.range(size), received_splits)
        per_sender = tf.reshape(tf.math.bincount(sender * groups + received_group, minlength=size * groups,
                                                 maxlength=size * groups), [size, groups])
        pieces, floats = [], []
        for g, storage in enumerate(self.storages):
            rows = tf.gather(self._lookup(storage, by_group[g]), wanted[g])
            dim = storage.layout.dim
            pieces.append(tf.split(tf.reshape(rows, [-1]), per_sender[:, g] * dim, num=size))
            floats.append(per_sender[:, g] * dim)
        buffer = tf.concat([pieces[g][s] for s in range(size) for g in range(groups)], 0)
        return buffer, tf.add_n(floats)

    def _lookup(self, storage, keys):
        """The rows of one group's (unique) keys from this rank's shards, in their order."""
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

