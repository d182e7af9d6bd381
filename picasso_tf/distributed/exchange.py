"""The row exchange of hybrid parallelism: each step, every rank fetches the rows its
batch looks up from the ranks that hold them (rank id % size holds row id of every
sharded table), in two AllToAllv for all groups together.

Requester (every rank, for its batch): per group, the ids of its sites become keys
(table number << 40 | id), deduplicated, and are partitioned by owner. One buffer
holds every group's keys, owner-major (each owner's part: group by group), and one
AllToAllv sends it.

Owner: the keys it received, deduplicated again (two ranks asking for the same row
must be served one row, or their gradients would overwrite each other), are looked up
in its shards with the fused lookup kernel, one op per group, and sent back in one
AllToAllv laid out like the keys (flattened rows, group by group).

Requester again: each group's rows land in one [fetched, dim] tensor; a site's ids
become positions in it (ExchangedIds), which the rewritten graph's fused lookups read.

Backward needs nothing of its own: the gradient of the rows' AllToAllv is the reverse
AllToAllv, which returns every row gradient to its owner, summed there per row by the
gradient of the owner's gather, and becomes the shard variables' row-sparse gradient.
"""
import tensorflow as tf

from picasso_tf.distributed.world import hvd
from picasso_tf.ops.packed_lookup import packed_lookup
from picasso_tf.ops.read_tables import read_tables

ID_BITS = 40            # ids below 2**40; the table number takes the bits above
ID_MASK = (1 << ID_BITS) - 1


class RowExchange:
    """The exchange of the sharded storages `storages` (picasso_tf.embedding.sharded),
    in the order every rank lays them out."""

    def __init__(self, storages, world, check_ids=True):
        self.storages, self.world, self.check_ids = list(storages), world, check_ids
        self.first_table, tables = {}, []
        for g, storage in enumerate(self.storages):
            self.first_table[storage.name] = len(tables)
            tables += [(g, m) for m in range(len(storage.layout.members))]
        if len(tables) >= 1 << (63 - ID_BITS):
            raise ValueError(f"picasso_tf: {len(tables)} sharded tables; at most {1 << (63 - ID_BITS)} can be exchanged")
        self.group_of_table = tf.constant([g for g, _ in tables], tf.int32)
        self.member_of_table = tf.constant([m for _, m in tables], tf.int32)

    def fetch(self, requests):
        """requests: [(ExchangedIds, ids tensor)]. Returns ({group name: fetched rows},
        [positions tensor per request, shaped and typed as its ids])."""
        size, groups = self.world.size, len(self.storages)
        keys, remap, counts = [], [], []
        for storage in self.storages:
            own = [(i, x, ids) for i, (x, ids) in enumerate(requests) if x.group == storage.name]
            k, positions, c = self._request(storage, own)
            keys.append(k)
            remap.append((own, positions))
            counts.append(c)
        # One buffer, owner-major: for each owner, group by group.
        send = tf.concat([keys[g][d] for d in range(size) for g in range(groups)], 0)
        send_splits = tf.add_n(counts)
        received, received_splits = hvd().alltoall(send, splits=send_splits, name="picasso_exchange_ids")
        rows_back, back_splits = self._serve(received, received_splits)
        fetched, _ = hvd().alltoall(rows_back, splits=back_splits, name="picasso_exchange_rows")

        dims = [s.layout.dim for s in self.storages]
        sizes = tf.stack([counts[g][d] * dims[g] for d in range(size) for g in range(groups)])
        pieces = tf.split(fetched, sizes, num=size * groups)
        rows = {storage.name: tf.reshape(tf.concat([pieces[d * groups + g] for d in range(size)], 0), [-1, dims[g]])
                for g, storage in enumerate(self.storages)}
        positions = [None] * len(requests)
        for own, site_positions in remap:
            for (i, _, ids), p in zip(own, site_positions):
                positions[i] = tf.reshape(tf.cast(p, ids.dtype), tf.shape(ids))
        return rows, positions

    def _request(self, storage, own):
        """One group's deduplicated keys per owner, each request's positions in the
        group's fetched rows, and the number of keys per owner."""
        size = self.world.size
        first = self.first_table[storage.name]
        flat = [tf.reshape(tf.cast(ids, tf.int64), [-1]) for _, _, ids in own]
        if not flat:
            empty = tf.zeros([0], tf.int64)
            return [empty] * size, [], tf.zeros([size], tf.int32)
        if self.check_ids:
            flat = self._checked(storage, own, flat)
        keys = tf.concat([tf.bitwise.bitwise_or(ids, tf.constant((first + x.member) << ID_BITS, tf.int64))
                          for (_, x, _), ids in zip(own, flat)], 0)
        unique, index = tf.unique(keys)
        owner = tf.cast(_row_id(unique) % size, tf.int32)
        by_owner = tf.dynamic_partition(unique, owner, size)
        order = tf.dynamic_partition(tf.range(tf.size(unique)), owner, size)
        # Fetched rows come back owner by owner: a key's row lands at its place in that order.
        place = tf.gather(tf.math.invert_permutation(tf.concat(order, 0)), index)
        positions = tf.split(place, [tf.size(ids) for ids in flat], num=len(flat))
        counts = tf.stack([tf.size(part) for part in by_owner])
        return by_owner, positions, counts

    def _checked(self, storage, own, flat):
        """The ids, with an error naming the feature and the id unless every id lies in
        its table (an id outside would be fetched from a wrong row or rank)."""
        ids = tf.concat(flat, 0)
        rows = tf.concat([tf.fill([tf.size(f)], tf.constant(storage.layout.members[x.member].rows, tf.int64))
                          for (_, x, _), f in zip(own, flat)], 0)
        site = tf.concat([tf.fill([tf.size(f)], i) for i, f in enumerate(flat)], 0)
        bad = tf.logical_or(ids < 0, ids >= rows)
        first = tf.argmax(tf.cast(bad, tf.int32), output_type=tf.int32)
        features = tf.constant([x.feature for _, x, _ in own])
        check = tf.debugging.Assert(
            tf.logical_not(tf.reduce_any(bad)),
            ["picasso_tf: ids of feature", tf.gather(features, tf.gather(site, first)), "must lie in [0,",
             tf.gather(rows, first), "): got", tf.gather(ids, first),
             "; raise the feature's vocabulary size or hash its ids into that range"], summarize=1)
        with tf.control_dependencies([check]):
            return [tf.identity(f) for f in flat]

    def _serve(self, received, received_splits):
        """The rows of the keys other ranks asked this one for, laid out as they sent
        them, and the number of floats per rank."""
        size, groups = self.world.size, len(self.storages)
        unique, index = tf.unique(received)
        table = _table_number(unique)
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
        member = tf.gather(self.member_of_table, _table_number(keys))
        local = _row_id(keys) // self.world.size
        ids = tf.dynamic_partition(local, member, members)
        order = tf.dynamic_partition(tf.range(tf.size(keys)), member, members)
        shards = storage.variables()
        rows = packed_lookup(read_tables([v.handle for v in shards], storage.layout.dtype), ids,
                             offsets=[0] * members, vocab_sizes=[int(v.shape[0]) for v in shards],
                             combiners=["none"] * members, feature_names=[m.name for m in storage.layout.members],
                             table_index=list(range(members)))
        return tf.dynamic_stitch(order, rows)


def _row_id(keys):
    return tf.bitwise.bitwise_and(keys, tf.constant(ID_MASK, tf.int64))


def _table_number(keys):
    return tf.cast(tf.bitwise.right_shift(keys, tf.constant(ID_BITS, tf.int64)), tf.int32)
