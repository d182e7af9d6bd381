"""The row-sharded storage kind (hybrid parallelism): each rank holds one contiguous
block of rows of every member table, rows [rank * block, (rank + 1) * block) with
block = ceil(rows / size), as a shard variable, with shards of the optimizer's slots
alike. Hot ids spread over the blocks as long as ids are hashed or permuted, as CTR
ids are; ids ordered by popularity would load the first rank most.

Each table's rows are held once over the ranks: once a shard is cut, the original
variable (and each Keras slot of it) is released on every rank, holding [0, ...] until
``write_back`` gathers it whole again (export, get_weights, the one-file formats), and
``release`` frees it. A released variable checkpoints as its rank's block, a slice of
the logical table under the original variable's own key: the ranks' parts merged make
the plain model's checkpoint (picasso_tf.distributed.checkpoint), and restoring reads
each rank's block of whatever was saved (whole tables by one process, or slices by any
number of ranks) straight into its shard. ``read_back`` cuts the shards again from
originals that were assigned whole (set_weights, .h5 files).

The kernels do not read the shards in place: each step's exchange
(picasso_tf.distributed.exchange) looks up the rows other ranks ask for and the
fused updates apply the row gradients that come back.
"""
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import gen_resource_variable_ops
from tensorflow.python.trackable import base as trackable

from picasso_tf.distributed.world import hvd
from picasso_tf.embedding.storage import EmbeddingStorage
from picasso_tf.ops import sparse_apply


class RowShardedTables(EmbeddingStorage):

    kind = "sharded"
    collective = True

    def __init__(self, layout, world):
        super().__init__(layout)
        self.world = world
        self.blocks = [-(-m.rows // world.size) for m in layout.members]      # rows per rank
        self._pairs = []        # every Shard: the tables', then the slots' as they are made
        with tf.init_scope():
            self.shards = [self._shard_of(m.variable, f"picasso_shard/{m.name}", i).variable
                           for i, m in enumerate(layout.members)]
        self._slots = {}        # original slot variable's ref -> its Shard

    def first_row(self, member):
        """The first row of member table `member` (an index) this rank holds."""
        return min(self.world.rank * self.blocks[member], self.layout.members[member].rows)

    def rows_held(self, member):
        """How many rows of member table `member` (an index) this rank holds."""
        rows = self.layout.members[member].rows
        return min(rows, (self.world.rank + 1) * self.blocks[member]) - self.first_row(member)

    def _shard_of(self, full, name, member):
        shard = Shard(full, self.first_row(member), self.rows_held(member), name, self.layout.trainable)
        self._pairs.append(shard)
        return shard

    def kernel_inputs(self):
        return self.shards

    def variables(self):
        return self.shards

    def slots(self, optimizer, member):
        index = self._index(member)
        out = {}
        for slot, full in optimizer.keras_slots(member.variable).items():
            if full.ref() not in self._slots:
                with tf.init_scope():
                    self._slots[full.ref()] = self._shard_of(full, f"picasso_shard/{member.name}/{slot}", index)
            out[slot] = self._slots[full.ref()].variable
        return out

    def apply(self, optimizer, member, rows, row_grads, update):
        shard = self.shards[self._index(member)]
        return sparse_apply.apply(shard, rows, row_grads, update, lazy=optimizer.lazy)

    def _index(self, member):
        return next(i for i, m in enumerate(self.layout.members) if m is member)

    def write_back(self):
        """Gathers every original whole on every rank (a collective): it holds the rows
        until ``release`` (or ``read_back``)."""
        for shard in self._pairs:
            shard.gather_into_original()

    def release(self):
        for shard in self._pairs:
            shard.release_original()

    def held_blocks(self):
        """Every Shard: the tables', then the slots' made so far."""
        return list(self._pairs)

    def read_back(self):
        for shard in self._pairs:
            if shard.original_is_whole():
                shard.cut_from_original()


class Shard:
    """One rank's block of an original variable (a table or a Keras slot of one): rows
    [start, start + held) in `variable` (one zero row when it holds none: a table with
    fewer rows than ranks, never read)."""

    def __init__(self, original, start, held, name, trainable):
        self.original, self.start, self.held = original, start, held
        shape = original.shape.as_list()
        self.variable = tf.Variable(tf.zeros([max(held, 1)] + shape[1:], original.dtype), trainable=trainable,
                                    name=name)
        offset = [start] + [0] * (len(shape) - 1)
        self.slice_spec = tf.Variable.SaveSliceInfo(original.name, shape, offset, [held] + shape[1:]).spec
        self.cut_from_original()

    def rows(self):
        return self.variable[:self.held]

    def original_is_whole(self):
        return int(gen_resource_variable_ops.variable_shape(self.original.handle)[0]) == self.original.shape[0]

    def cut_from_original(self):
        if self.held:
            self.variable[:self.held].assign(self.original[self.start:self.start + self.held])
        self.release_original()

    def release_original(self):
        """Frees the original's rows; a checkpoint then saves and restores this block of it."""
        shape = self.original.shape.as_list()
        _assign_any_shape(self.original, tf.zeros([0] + shape[1:], self.original.dtype))
        # Instance attributes take precedence for TensorFlow's checkpoints (saveable_object_util).
        self.original._serialize_to_tensors = self._serialize
        self.original._restore_from_tensors = self._restore

    def gather_into_original(self):
        gathered = hvd().allgather(self.rows(), name=f"picasso_write_back_{_op_name(self.original)}")
        _assign_any_shape(self.original, gathered)
        # Whole again: it checkpoints as itself.
        self.original.__dict__.pop("_serialize_to_tensors", None)
        self.original.__dict__.pop("_restore_from_tensors", None)

    def _serialize(self):
        if not self.held:
            return {}
        return {trackable.VARIABLE_VALUE_KEY: {self.slice_spec: self.rows()}}

    def _restore(self, restored):
        value = restored[trackable.VARIABLE_VALUE_KEY]
        if isinstance(value, dict):
            value = value[self.slice_spec]
        return self.variable[:self.held].assign(value)


def _assign_any_shape(variable, value):
    # The original keeps its declared shape; its buffer changes size.
    gen_resource_variable_ops.assign_variable_op(variable.handle, value, validate_shape=False)


def rank_major_order(rows, size):
    """Where row i of a table sits in its shards concatenated rank by rank, when rank r
    holds the rows id % size == r (the hash-backed kind's sharding)."""
    held = [len(range(r, rows, size)) for r in range(size)]
    start = np.concatenate([[0], np.cumsum(held)[:-1]])
    i = np.arange(rows)
    return start[i % size] + i // size


def _op_name(variable):
    return variable.name.split(":")[0].replace("/", "_")
