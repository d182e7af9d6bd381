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
    def __init__(self, optimizer, packed_tables, lazy, in_gradient=True):
        self.optimizer = RowSparseOptimizer.from_keras(optimizer, lazy=lazy)
        self.in_gradient = in_gradient   # config.apply_in_gradient
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


class InGradientUpdates:
    """The packed tables that one trace of a training step updates inside their fused
    gradient kernels (picasso_tf.ops.in_gradient.update_tables_in_gradient),
    and the ops that do it.

    A kernel may update its tables when each is a packed table whose only read in the
    step is the value the differentiated op took, used by no other op (so that
    kernel's gradient is the table's whole gradient, and nothing reads the table after
    it), and the optimizer leaves rows without a gradient alone (Adagrad, SGD without
    momentum, any lazy form): the update of a row then needs only that row's gradient.
    """

    def __init__(self, fused, iteration):
        self.fused, self.iteration, self.ops, self.variables = fused, iteration, [], []

    def for_tables(self, tables):
        """Per table value, (variable, this step's sparse_apply.Update); None unless all qualify."""
        variables = [_variable_read_only_as(t, self.fused.tables) for t in tables]
        if any(v is None for v in variables):
            return None
        decays = {self.fused.decay[v.ref()] for v in variables}
        if len(decays) > 1 or not self.fused.optimizer.changes_only_gradient_rows(decays.pop()):
            return None
        return [(v, self.fused.optimizer.update(v, self.fused.slots[self.fused.tables[v.ref()].name],
                                                 self.iteration, apply_weight_decay=self.fused.decay[v.ref()]))
                for v in variables]

    def record(self, op, variables):
        self.ops.append(op)
        self.variables.extend(variables)


def _variable_read_only_as(value, tables):
    """The variable of the packed table (among `tables`' values) whose one read in the
    graph gives `value`, itself used by one op; else None."""
    read = value.op
    if read.type != "ReadVariableOp" or len(value.consumers()) != 1:
        return None
    handle = read.inputs[0]
    if handle.consumers() != [read]:
        return None
    outside = _captured_from(handle)
    return next((t.variable for t in tables.values() if t.variable.handle is outside), None)


def _captured_from(tensor):
    """What a tensor of a (nested) function graph captures from outside, else itself."""
    while True:
        captures = getattr(getattr(tensor, "graph", None), "captures", ())
        outside = next((external for external, internal in captures if internal is tensor), None)
        if outside is None:
            return tensor
        tensor = outside


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
            return FusedTableUpdate(optimizer, packed_tables, config.lazy_optimizer,
                                    config.apply_in_gradient), None
    except UnsupportedOptimizerError as e:
        if config.lazy_optimizer:
            raise ValueError(f"picasso_tf: lazy_optimizer=True needs a fused row-sparse optimizer: {e}") from e
        return None, f"packed tables are updated by the Keras optimizer: {e}"
