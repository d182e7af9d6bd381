"""Fused row-sparse updates of the table groups' storage, driven by the user's Keras optimizer.

Made at the first training step (when the optimizer is known and built: the fused
updates use its slot variables). When the optimizer or one of its options has no
exact fused form, the groups' tables are updated by the Keras optimizer from their
IndexedSlices gradients instead (still exact, still row-sparse for SGD/Adagrad; Keras'
own dense decays for Adam-like optimizers), and the reason is recorded for the report.
"""
import dataclasses

import tensorflow as tf

from picasso_tf.embedding.row_sparse_optimizers import RowSparseOptimizer, UnsupportedOptimizerError


class FusedTableUpdate:
    """The fused updates of the storages' tables; `tables` maps each table variable's
    ref to its (storage, member)."""

    def __init__(self, optimizer, storages, lazy, in_gradient=True, huge_pages=True):
        self.optimizer = RowSparseOptimizer.from_keras(optimizer, lazy=lazy)
        self.in_gradient = in_gradient   # config.apply_in_gradient
        self.huge_pages = huge_pages     # config.huge_pages: an attribute of every update kernel
        # A frozen group (trainable=False tables) is never updated.
        self.tables = {variable.ref(): (storage, member) for storage in storages if storage.layout.trainable
                       for variable, member in zip(storage.variables(), storage.layout.members)}
        self.decay = {ref: self.optimizer.applies_weight_decay_to(member.variable)
                      for ref, (_, member) in self.tables.items()}

    def handles(self, variable):
        return variable.ref() in self.tables

    def updates(self, variables, iteration):
        """This step's sparse_apply.Update of each table variable."""
        members = [self.tables[v.ref()] for v in variables]
        updates = self.optimizer.updates(variables, [s.slots(self.optimizer, m) for s, m in members], iteration,
                                         [self.decay[v.ref()] for v in variables])
        return [dataclasses.replace(u, attrs={**u.attrs, "huge_pages": self.huge_pages}) for u in updates]

    def apply(self, grads_and_vars, iteration):
        grads_and_vars = list(grads_and_vars)
        ops = []
        for (grad, var), update in zip(grads_and_vars, self.updates([v for _, v in grads_and_vars], iteration)):
            storage, member = self.tables[var.ref()]
            if not isinstance(grad, tf.IndexedSlices):   # a replicated table after the Allreduce: every row
                grad = tf.IndexedSlices(grad, tf.range(tf.shape(grad, out_type=tf.int64)[0]))
            ops.append(storage.apply(self.optimizer, member, grad.indices, grad.values, update))
        return tf.group(ops)


class InGradientUpdates:
    """The storages that one trace of a training step updates inside their fused
    gradient kernels (picasso_tf.ops.in_gradient.update_tables_in_gradient),
    and the ops that do it.

    A kernel may update its tables when each is a storage whose only read in the step
    is the value the differentiated op took, used by no other op (so that kernel's
    gradient is the table's whole gradient, and nothing reads the table after it), and
    the optimizer leaves rows without a gradient alone (Adagrad, SGD without momentum,
    any lazy form): the update of a row then needs only that row's gradient.
    """

    def __init__(self, fused, iteration):
        self.fused, self.iteration, self.ops, self.variables = fused, iteration, [], []

    def for_tables(self, tables):
        """Per table value, (variable, this step's sparse_apply.Update); None unless all qualify."""
        variables = [self._variable(t) for t in tables]
        if any(v is None for v in variables):
            return None
        decays = {self.fused.decay[v.ref()] for v in variables}
        if len(decays) > 1 or not self.fused.optimizer.changes_only_gradient_rows(decays.pop()):
            return None
        return list(zip(variables, self.fused.updates(variables, self.iteration)))

    def _variable(self, value):
        return _variable_read_only_as(value, self.fused)

    def record(self, op, variables):
        self.ops.append(op)
        self.variables.extend(variables)


def _variable_read_only_as(value, fused):
    """The table variable (among those `fused` updates) whose one read in the graph gives
    `value`, itself used by one op; else None."""
    read = value.op
    if read.type not in READS or len(value.consumers()) != 1:
        return None
    handle = read.inputs[value.value_index]
    if handle.consumers() != [read]:
        return None
    outside = _captured_from(handle)
    return next((ref.deref() for ref in fused.tables if ref.deref().handle is outside), None)


READS = ("ReadVariableOp", "PicassoReadTables")   # a variable's value: output i reads input i


def _captured_from(tensor):
    """What a tensor of a (nested) function graph captures from outside, else itself."""
    while True:
        captures = getattr(getattr(tensor, "graph", None), "captures", ())
        outside = next((external for external, internal in captures if internal is tensor), None)
        if outside is None:
            return tensor
        tensor = outside


def refuse_clipping(optimizer):
    """Refuses an optimizer that clips gradients, on every path that applies the fused
    lookups' gradients (fit's, or a model's own train_step): Keras clips an embedding's
    gradient as one row per lookup, the fused gradients sum the rows of an id, so a
    repeated id would clip differently."""
    clipping = [f"{o}={getattr(optimizer, o)}" for o in ("clipnorm", "clipvalue", "global_clipnorm")
                if getattr(optimizer, o, None)]
    if clipping:
        raise ValueError(
            f"picasso_tf: the optimizer clips gradients ({', '.join(clipping)}): Keras clips an embedding "
            "table's gradient as one row per lookup, while picasso's fused lookups give one summed row per "
            "id, so the result would differ whenever an id repeats in a batch. Train without gradient "
            "clipping, or optimize(..., packing=False) to keep Keras' lookups.")


def make_fused_update(optimizer, storages, config):
    """(FusedTableUpdate or None, reason or None)."""
    if not storages:
        return None, None
    refuse_clipping(optimizer)
    if not config.fused_optimizer:
        return None, "fused_optimizer=False: packed tables are updated by the Keras optimizer"
    try:
        with tf.init_scope():
            return FusedTableUpdate(optimizer, storages, config.lazy_optimizer, config.apply_in_gradient,
                                    config.huge_pages), None
    except UnsupportedOptimizerError as e:
        if config.lazy_optimizer:
            raise ValueError(f"picasso_tf: lazy_optimizer=True needs a fused row-sparse optimizer: {e}") from e
        return None, f"packed tables are updated by the Keras optimizer: {e}"
