"""The row-sharded storage kind (hybrid parallelism): each rank holds the rows
id % size == rank of every member table, as a shard variable whose row j is the
table's row j * size + rank, with shards of the optimizer's slots alike.

The kernels do not read it in place: each step's exchange
(picasso_tf.distributed.exchange) looks up the rows other ranks ask for and the
fused updates apply the row gradients that come back. The original variables stay
the model's checkpoint: ``write_back`` gathers every rank's shards into them (and into
the Keras optimizer's slots), ``read_back`` cuts the shards from them again (after a
restore). Both are collectives: every rank calls them together. Since checkpoints
hold whole tables, a checkpoint written by any number of ranks restores on any other.
"""
import numpy as np
import tensorflow as tf

from picasso_tf.distributed.world import hvd
from picasso_tf.embedding.storage import EmbeddingStorage
from picasso_tf.ops import sparse_apply


class RowShardedTables(EmbeddingStorage):

    kind = "sharded"
    collective = True

    def __init__(self, layout, world):
        super().__init__(layout)
        self.world = world
        with tf.init_scope():
            self.shards = [self._shard_of(m.variable, f"picasso_shard/{m.name}") for m in layout.members]
        self._slots = {}        # (member index, slot name) -> shard of the Keras slot

    def rows_held(self, member):
        """How many rows of the member's table this rank holds."""
        return len(range(self.world.rank, self.layout.members[member].rows, self.world.size))

    def _shard_of(self, full, name):
        """A variable holding this rank's rows of `full` (at least one row: a table with
        fewer rows than ranks leaves some ranks none, and their padding row is never read)."""
        rows = full[self.world.rank::self.world.size]
        if rows.shape[0] == 0:
            rows = tf.zeros([1] + full.shape[1:].as_list(), full.dtype)
        return tf.Variable(rows, trainable=self.layout.trainable, name=name)

    def kernel_inputs(self):
        return self.shards

    def variables(self):
        return self.shards

    def slots(self, optimizer, member):
        index = self._index(member)
        out = {}
        for slot, full in optimizer.keras_slots(member.variable).items():
            if (index, slot) not in self._slots:
                with tf.init_scope():
                    self._slots[index, slot] = (full, self._shard_of(full, f"picasso_shard/{member.name}/{slot}"))
            out[slot] = self._slots[index, slot][1]
        return out

    def apply(self, optimizer, member, rows, row_grads, update):
        shard = self.shards[self._index(member)]
        return sparse_apply.apply(shard, rows, row_grads, update, lazy=optimizer.lazy)

    def _index(self, member):
        return next(i for i, m in enumerate(self.layout.members) if m is member)

    def pairs(self):
        """(original variable, its shard) for the tables and every slot made so far."""
        tables = [(m.variable, s) for m, s in zip(self.layout.members, self.shards)]
        return tables + list(self._slots.values())

    def write_back(self):
        for full, shard in self.pairs():
            held = len(range(self.world.rank, full.shape[0], self.world.size))
            gathered = hvd().allgather(shard[:held], name=f"picasso_write_back_{_op_name(full)}")
            full.assign(tf.gather(gathered, rank_major_order(full.shape[0], self.world.size)))

    def read_back(self):
        for full, shard in self.pairs():
            rows = full[self.world.rank::self.world.size]
            if rows.shape[0]:
                shard[:rows.shape[0]].assign(rows)


def rank_major_order(rows, size):
    """Where row i of a table sits in its shards concatenated rank by rank."""
    held = [len(range(r, rows, size)) for r in range(size)]
    start = np.concatenate([[0], np.cumsum(held)[:-1]])
    i = np.arange(rows)
    return start[i % size] + i // size


def _op_name(variable):
    return variable.name.split(":")[0].replace("/", "_")
