"""Fused row-sparse updates of the packed tables, driven by the user's Keras optimizer.

Made at the first training step (when the optimizer is known). When the optimizer or
one of its options has no exact fused form, packed tables are updated by the Keras
optimizer from their IndexedSlices gradients instead (still exact, still row-sparse
for SGD/Adagrad; Keras' own dense decays for Adam-like optimizers), and the reason is
recorded for the report.
"""
import tensorflow as tf

from picasso_tf.embedding.row_sparse_optimizers import RowSparseOptimizer, UnsupportedOptimizerError


class FusedTableUpdate:
    def __init__(self, optimizer, packed_tables, lazy):
        self.optimizer = RowSparseOptimizer.from_keras(optimizer, lazy=lazy)
        self.tables = {t.variable.ref(): t for t in packed_tables}
        self.decay = {}
        for table in packed_tables:
            members = [self.optimizer.applies_weight_decay_to(s.variable) for s in table.group.slots]
            if len(set(members)) > 1:
                raise UnsupportedOptimizerError(
                    f"weight decay excludes some but not all tables of packed group {table.name}")
            self.decay[table.variable.ref()] = members[0]
        self.slots = {t.name: self.optimizer.create_slots(t.variable, f"picasso/{t.name}")
                      for t in packed_tables}

    def handles(self, variable):
        return variable.ref() in self.tables

    def apply(self, grads_and_vars, iteration):
        updates = []
        for grad, var in grads_and_vars:
            table = self.tables[var.ref()]
            if not isinstance(grad, tf.IndexedSlices):   # a densely read table: every row
                grad = tf.IndexedSlices(grad, tf.range(tf.shape(grad, out_type=tf.int64)[0]))
            updates.append(self.optimizer.apply(var, self.slots[table.name], grad.indices, grad.values,
                                                iteration, apply_weight_decay=self.decay[var.ref()]))
        return tf.group(updates)


def make_fused_update(optimizer, packed_tables, config):
    """(FusedTableUpdate or None, reason or None)."""
    if not packed_tables:
        return None, None
    if not config.fused_optimizer:
        return None, "fused_optimizer=False: packed tables are updated by the Keras optimizer"
    if getattr(optimizer, "clipnorm", None):
        raise ValueError(
            f"picasso_tf: the optimizer's clipnorm={optimizer.clipnorm} clips each variable's gradient on "
            "its own, and packing merges embedding tables into one variable, which would change the "
            "result. Use global_clipnorm (same result packed or not), or optimize(..., packing=False).")
    try:
        with tf.init_scope():
            return FusedTableUpdate(optimizer, packed_tables, config.lazy_optimizer), None
    except UnsupportedOptimizerError as e:
        if config.lazy_optimizer:
            raise ValueError(f"picasso_tf: lazy_optimizer=True needs a fused row-sparse optimizer: {e}") from e
        return None, f"packed tables are updated by the Keras optimizer: {e}"
