"""Updating tables inside their gradient kernels.

A fused gradient kernel (a stitched lookup's or projection's) can hand each table's
summed gradient rows straight to an optimizer's update of those rows, while they are
in cache, instead of returning them as IndexedSlices for a separate update op
(custom_ops/sparse_updates.h, InPlaceUpdates). The training step asks for it while
differentiating, through ``update_tables_in_gradient``; a gradient function that
takes it returns no gradient for those tables.

A kernel can do that only if nothing else reads the tables' values after it: a
site's per-id weights have a gradient that does. Most weights need none (a
sequence's mask, made from its ids), but tf.gradients, unlike a tape, does not tell
a gradient function which of its op's inputs it differentiates for. So the step
names the sources of its tf.gradients, and ``gradient_wanted`` finds whether any
differentiable path joins an input to them.
"""
import contextlib
import threading

import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops

from picasso_tf.ops.sparse_apply import in_place_inputs

_in_gradient = threading.local()


@contextlib.contextmanager
def update_tables_in_gradient(updates, sources=None):
    """While active, a fused gradient asks ``updates.for_tables(tables)`` (the op's
    table inputs, the values it read) for a list of (variable, ``sparse_apply.Update``),
    one per table, or None. Given one, its kernel applies the tables' gradients to the
    variables (the tables then get no gradient), and ``updates.record(op, variables)``
    receives the op, which the caller must run. One kernel runs one update: the
    Updates may differ only in their slot variables (the first's hyper-parameters serve
    all). ``updates=None`` changes nothing. `sources`: the `xs` of the tf.gradients
    call it surrounds (variables or tensors of the current graph), for
    ``gradient_wanted``; None: unknown, every input's gradient is wanted."""
    previous = getattr(_in_gradient, "updates", None), getattr(_in_gradient, "sources", None)
    _in_gradient.updates = updates
    _in_gradient.sources = None if updates is None or sources is None else _Sources(sources)
    try:
        yield
    finally:
        _in_gradient.updates, _in_gradient.sources = previous


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


class _Sources:
    """The tensors a tf.gradients call differentiates for, in the graph it runs in."""

    def __init__(self, sources):
        self.graph = tf.compat.v1.get_default_graph()
        self.refs = {t.ref() for t in sources if isinstance(t, tf.Tensor)}


# Longer walks count as joined to a source rather than take time in every trace.
_MAX_WALK = 10_000


def gradient_wanted(op, index):
    """Whether the gradient of `op`'s input `index` may be wanted by the differentiation
    that called `op`'s gradient function. A tape says which inputs it skips; inside
    update_tables_in_gradient(..., sources) an input is wanted if a differentiable path
    joins it to a source or to any resource (a variable's handle); otherwise, always."""
    if hasattr(op, "skip_input_indices"):        # a tape's stand-in for the op
        return index not in (op.skip_input_indices or ())
    sources = getattr(_in_gradient, "sources", None)
    if sources is None or op.graph is not sources.graph:
        return True
    pending, seen = [op.inputs[index]], set()
    while pending:
        tensor = pending.pop()
        if tensor.ref() in sources.refs or tensor.dtype in (tf.resource, tf.variant):
            return True
        if not (tensor.dtype.is_floating or tensor.dtype.is_complex) or tensor.op.name in seen:
            continue
        seen.add(tensor.op.name)
        if len(seen) > _MAX_WALK:
            return True
        try:
            differentiable = tf_ops.get_gradient_function(tensor.op) is not None
        except LookupError:                     # no gradient: tf.gradients could not pass it either
            differentiable = False
        if differentiable:
            pending.extend(tensor.op.inputs)
    return False


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
