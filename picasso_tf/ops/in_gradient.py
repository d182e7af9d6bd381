"""Updating tables inside their gradient kernels.

A fused gradient kernel (a stitched lookup's or projection's) can hand each table's
summed gradient rows straight to an optimizer's update of those rows, while they are
in cache, instead of returning them as IndexedSlices for a separate update op
(custom_ops/sparse_updates.h, InPlaceUpdates). The training step asks for it while
differentiating, through ``update_tables_in_gradient``; a gradient function that
takes it returns no gradient for those tables.
"""
import contextlib
import threading

from picasso_tf.ops.sparse_apply import in_place_inputs

_in_gradient = threading.local()


@contextlib.contextmanager
def update_tables_in_gradient(updates):
    """While active, a fused gradient asks ``updates.for_tables(tables)`` (the op's
    table inputs, the values it read) for a list of (variable, ``sparse_apply.Update``),
    one per table, or None. Given one, its kernel applies the tables' gradients to the
    variables (the tables then get no gradient), and ``updates.record(op, variables)``
    receives the op, which the caller must run. One kernel runs one update: the
    Updates may differ only in their slot variables (the first's hyper-parameters serve
    all). ``updates=None`` changes nothing."""
    previous = getattr(_in_gradient, "updates", None)
    _in_gradient.updates = updates
    try:
        yield
    finally:
        _in_gradient.updates = previous


class FixedTableUpdates:
    """An ``update_tables_in_gradient`` hook for an op whose tables are known: plans
    the given (variable, Update) pairs (one per table, in the op's order) and keeps
    the ops in ``ops``."""

    def __init__(self, planned):
        self.planned, self.ops = list(planned), []

    def for_tables(self, tables):
        return self.planned

    def record(self, op, variables):
        self.ops.append(op)


def planned_updates(tables):
    """The active hook's (variable, Update) per table of these values, else None."""
    hook = getattr(_in_gradient, "updates", None)
    planned = hook.for_tables(tables) if hook is not None else None
    if not planned:
        return None
    first = planned[0][1]
    for variable, update in planned:
        if (update.optimizer, update.attrs, len(update.slots)) != (first.optimizer, first.attrs, len(first.slots)):
            raise ValueError(f"picasso_tf: one kernel's tables need one update; {variable.name} has "
                             f"{update.optimizer} {update.attrs} with {len(update.slots)} slots, the first "
                             f"table {first.optimizer} {first.attrs} with {len(first.slots)}")
    return planned


def apply_in_gradient(grad_apply_op, planned, dtype, /, **inputs):
    """Calls ``grad_apply_op`` (a gradient-and-apply op) on the planned tables and the
    gradient's own ``inputs``, records it with the hook and returns its result."""
    result = grad_apply_op(**in_place_inputs(planned, dtype), **inputs)
    _in_gradient.updates.record(getattr(result, "op", result), [v for v, _ in planned])
    return result
