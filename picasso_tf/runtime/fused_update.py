"""Fused row-sparse updates of the table groups' storage, driven by the user's Keras optimizer.

Made at the first training step (when the optimizer is known). When the optimizer or
one of its options has no exact fused form, the groups' storage is updated by the
Keras optimizer from their IndexedSlices gradients instead (still exact, still
row-sparse for SGD/Adagrad; Keras' own dense decays for Adam-like optimizers), and the
reason is recorded for the report.
"""
import tensorflow as tf

from picasso_tf.embedding.row_sparse_optimizers import RowSparseOptimizer, UnsupportedOptimizerError


class FusedTableUpdate:
    def __init__(self, optimizer, storages, lazy, in_gradient=True):
        self.optimizer = RowSparseOptimizer.from_keras(optimizer, lazy=lazy)
        # A frozen group (trainable=False tables) is neither updated nor given slots.
        storages = [s for s in storages if s.layout.trainable]
        self.in_gradient = in_gradient   # config.apply_in_gradient
        self.storages = {s.kernel_input().ref(): s for s in storages}
        self.decay = {}
        for storage in storages:
            members = [self.optimizer.applies_weight_decay_to(m.variable) for m in storage.layout.members]
            if len(set(members)) > 1:
                raise UnsupportedOptimizerError(
                    f"weight decay excludes some but not all tables of packed group {storage.name}")
            self.decay[storage.name] = members[0]
        for storage in storages:
            storage.create_slots(self.optimizer)

    def handles(self, variable):
        return variable.ref() in self.storages

    def apply(self, grads_and_vars, iteration):
        updates = []
        for grad, var in grads_and_vars:
            storage = self.storages[var.ref()]
            if not isinstance(grad, tf.IndexedSlices):   # a densely read table: every row
                grad = tf.IndexedSlices(grad, tf.range(tf.shape(grad, out_type=tf.int64)[0]))
            updates.append(storage.apply(self.optimizer, grad.indices, grad.values, iteration,
                                         self.decay[storage.name]))
        return tf.group(updates)


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
        storages = [_storage_read_only_as(t, self.fused.storages) for t in tables]
        if any(s is None for s in storages):
            return None
        decays = {self.fused.decay[s.name] for s in storages}
        if len(decays) > 1 or not self.fused.optimizer.changes_only_gradient_rows(decays.pop()):
            return None
        return [(s.kernel_input(), s.in_place_update(self.fused.optimizer, self.iteration, self.fused.decay[s.name]))
                for s in storages]

    def record(self, op, variables):
        self.ops.append(op)
        self.variables.extend(variables)


def _storage_read_only_as(value, storages):
    """The storage (among `storages`) whose one read in the graph gives `value`,
    itself used by one op; else None."""
    read = value.op
    if read.type != "ReadVariableOp" or len(value.consumers()) != 1:
        return None
    handle = read.inputs[0]
    if handle.consumers() != [read]:
        return None
    outside = _captured_from(handle)
    return next((s for s in storages.values() if s.kernel_input().handle is outside), None)


def _captured_from(tensor):
    """What a tensor of a (nested) function graph captures from outside, else itself."""
    while True:
        captures = getattr(getattr(tensor, "graph", None), "captures", ())
        outside = next((external for external, internal in captures if internal is tensor), None)
        if outside is None:
            return tensor
        tensor = outside


def make_fused_update(optimizer, storages, config):
    """(FusedTableUpdate or None, reason or None)."""
    if not storages:
        return None, None
    if getattr(optimizer, "clipnorm", None):
        # Checked on every path: the Keras optimizer would clip a packed group as one variable too.
        raise ValueError(
            f"picasso_tf: the optimizer's clipnorm={optimizer.clipnorm} clips each variable's gradient on "
            "its own, and packing merges embedding tables into one variable, which would change the "
            "result. Use global_clipnorm (same result packed or not), or optimize(..., packing=False).")
    if not config.fused_optimizer:
        return None, "fused_optimizer=False: packed tables are updated by the Keras optimizer"
    try:
        with tf.init_scope():
            return FusedTableUpdate(optimizer, storages, config.lazy_optimizer, config.apply_in_gradient), None
    except UnsupportedOptimizerError as e:
        if config.lazy_optimizer:
            raise ValueError(f"picasso_tf: lazy_optimizer=True needs a fused row-sparse optimizer: {e}") from e
        return None, f"packed tables are updated by the Keras optimizer: {e}"
