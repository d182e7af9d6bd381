"""Stitched projections: a stitched lookup multiplied by a narrow kernel, fused.

When a model's concatenation of embeddings feeds only a MatMul with a few output
units (a logistic regression over hundreds of fields, the wide part of a model),
building the [rows, width] concatenation costs more than the product itself: it is
written once, read by the MatMul, and its gradient (as wide) is written and read
back. ``stitched_projection`` computes ``stitched_lookup(...) @ kernel`` from the
tables' rows directly, and its gradient gives every table its row-sparse gradient
and the kernel its gradient without either wide tensor.

Sites are laid out as in ``stitched_lookup`` (``columns``, ``row_blocks``); columns
that no site covers (dense inputs of the concatenation) contribute nothing here:
the caller adds their products. Sites take no per-id weights.

A wider kernel (an MLP's first layer) is better multiplied by BLAS, so there the
stitched lookup is built and a MatMul takes the product; ``stitched_product`` builds
that MatMul and gives its product the projection's gradient: per unique row rather
than per entry, as two small matrix products per site, instead of the MatMul's two
[rows, width] products and the lookup's gradient over its [rows, width] input.

Inside ``update_tables_in_gradient`` the gradient can instead hand each table's rows
to an optimizer's update in the same kernel (custom_ops/stitched_projection_ops.cc),
while they are in cache: the training step uses it where that is the same update.
"""
import contextlib
import threading

import tensorflow as tf

from picasso_tf.ops.packed_lookup import _ops, lookup_attrs, row_sparse_gradient, site_inputs

MAX_UNITS = 8   # kMaxProjectionUnits in the kernel: wider MatMuls are left to BLAS


def stitched_projection(tables, ids_list, segment_ids_list=None, num_segments_list=None, *,
                        kernel, table_index, columns, row_blocks, width, offsets, vocab_sizes,
                        combiners, feature_names, name=None):
    """[rows, units]: the stitched lookup of the sites times ``kernel`` [width, units]."""
    tables = [tf.convert_to_tensor(t) for t in tables]
    ids, segment_ids, weights, num_segments = site_inputs(
        tables[0].dtype, ids_list, segment_ids_list, None, num_segments_list,
        offsets=offsets, vocab_sizes=vocab_sizes, combiners=combiners,
        feature_names=feature_names, op_name="stitched_projection")
    return _ops().picasso_stitched_projection(
        tables=tables, ids=ids, segment_ids=segment_ids, weights=weights,
        num_segments=num_segments, kernel=tf.convert_to_tensor(kernel, tables[0].dtype),
        width=width, table_index=list(table_index), columns=list(columns),
        row_blocks=list(row_blocks), offsets=list(offsets), vocab_sizes=list(vocab_sizes),
        combiners=list(combiners), feature_names=list(feature_names), name=name)


_in_gradient = threading.local()


@contextlib.contextmanager
def update_tables_in_gradient(updates):
    """While active, differentiating a stitched projection (or product) asks
    ``updates.for_tables(tables, also_read_by)`` (the op's table inputs, the values it
    read; the other ops that read them, before the gradient) for a list of (variable,
    ``sparse_apply.Update``), one per table, or None. Given one, the
    gradient is PicassoStitchedProjectionGradApply: the tables' gradients are applied
    to the variables inside the kernel that computes them (never returned: the tables
    get no gradient), and ``updates.record(op, variables)`` receives the op. One kernel
    runs one update: the Updates may differ only in their slot variables (the first's
    hyper-parameters serve all). ``updates=None`` changes nothing."""
    previous = getattr(_in_gradient, "updates", None)
    _in_gradient.updates = updates
    try:
        yield
    finally:
        _in_gradient.updates = previous


class FixedTableUpdates:
    """An ``update_tables_in_gradient`` hook for a projection whose tables are known:
    plans the given (variable, Update) pairs (one per table, in the op's order) and
    keeps the ops in ``ops``."""

    def __init__(self, planned):
        self.planned, self.ops = list(planned), []

    def for_tables(self, tables, also_read_by=()):
        return self.planned

    def record(self, op, variables):
        self.ops.append(op)


def stitched_product(lookup, kernel, name=None):
    """``lookup @ kernel`` by a MatMul, for ``lookup`` a stitched lookup (the output of
    ``stitched_lookup`` in a graph, its sites without per-id weights), with the
    projection's gradient: the tables get row-sparse gradients and the kernel and the
    lookup's dense inputs theirs, without the lookup's gradient."""
    op = lookup.op
    if op.type != "PicassoStitchedLookup":
        raise ValueError(f"stitched_product: {lookup.name} is not a stitched lookup's output")
    g, n = op.get_attr("G"), op.get_attr("N")
    tables, per_site, dense = op.inputs[:g], op.inputs[g:g + 4 * n], op.inputs[g + 4 * n:]
    kernel = tf.convert_to_tensor(kernel, lookup.dtype)
    return _ops().picasso_stitched_product(
        product=tf.matmul(lookup, kernel), kernel=kernel, tables=tables, ids=per_site[:n],
        segment_ids=per_site[n:2 * n], weights=per_site[2 * n:3 * n], num_segments=per_site[3 * n:],
        dense=dense, **{a: op.get_attr(a) for a in ("width", "table_index", "columns", "row_blocks",
                                                     "dense_columns", "offsets", "vocab_sizes",
                                                     "combiners", "feature_names")},
        name=name)


@tf.RegisterGradient("PicassoStitchedProjection")
def _stitched_projection_gradient(op, grad):
    g, n = op.get_attr("G"), op.get_attr("N")
    table_grads, kernel_grad = _projection_gradient(op, grad, op.inputs[:g], op.inputs[g:g + 4 * n],
                                                    op.inputs[-1])
    return table_grads + [None] * (4 * n) + [kernel_grad]


@tf.RegisterGradient("PicassoStitchedProduct")
def _stitched_product_gradient(op, grad):
    g, n = op.get_attr("G"), op.get_attr("N")
    kernel = op.inputs[1]
    dense = op.inputs[2 + g + 4 * n:]
    # The lookup that the product was computed from reads the tables too, before this.
    lookup = op.inputs[0].op.inputs[0].op
    table_grads, kernel_grad = _projection_gradient(op, grad, op.inputs[2:2 + g],
                                                    op.inputs[2 + g:2 + g + 4 * n], kernel,
                                                    also_read_by=[lookup])
    dense_grads = []
    width = op.get_attr("width")
    for tensor, column in zip(dense, op.get_attr("dense_columns")):
        inner = tensor.shape[1:].num_elements()
        rows, weights = tf.reshape(tensor, [-1, inner]), kernel[column:column + inner]
        dense_grads.append(tf.reshape(tf.matmul(grad, weights, transpose_b=True), tf.shape(tensor)))
        kernel_grad += tf.pad(tf.matmul(rows, grad, transpose_a=True),
                              [[column, width - column - inner], [0, 0]])
    return [None, kernel_grad] + table_grads + [None] * (4 * n) + dense_grads


def _projection_gradient(op, grad, tables, per_site, kernel, also_read_by=()):
    """(table gradients, kernel gradient) of a projection of the tables' values, whose
    sites' inputs are per_site (ids, segment_ids, weights, num_segments; N each) and
    whose attributes are op's; inside update_tables_in_gradient, maybe the tables'
    updates instead (their gradients then None). also_read_by: the other ops reading
    the tables' values, all before this gradient runs."""
    n = op.get_attr("N")
    inputs = dict(grad=grad, kernel=kernel, ids=per_site[:n], segment_ids=per_site[n:2 * n],
                  weights=per_site[2 * n:3 * n], num_segments=per_site[3 * n:],
                  width=op.get_attr("width"), table_index=op.get_attr("table_index"),
                  columns=op.get_attr("columns"), row_blocks=op.get_attr("row_blocks"),
                  **lookup_attrs(op))
    in_gradient = getattr(_in_gradient, "updates", None)
    planned = in_gradient.for_tables(tables, also_read_by) if in_gradient is not None else None
    if planned:
        first = planned[0][1]
        for variable, update in planned:
            if (update.optimizer, update.attrs, len(update.slots)) != (first.optimizer, first.attrs, len(first.slots)):
                raise ValueError(f"picasso_tf: one projection's tables need one update; {variable.name} has "
                                 f"{update.optimizer} {update.attrs} with {len(update.slots)} slots, the first "
                                 f"table {first.optimizer} {first.attrs} with {len(first.slots)}")
        hyper = first.hyper_tensors(tables[0].dtype)
        apply_op = _ops().picasso_stitched_projection_grad_apply(
            vars=[v.handle for v, _ in planned], slots=[s.handle for _, u in planned for s in u.slots],
            hyper=list(hyper.values()), hyper_names=list(hyper), optimizer=first.optimizer,
            num_slots=len(first.slots), **first.attrs, **inputs)
        in_gradient.record(apply_op.op, [v for v, _ in planned])
        return [None] * len(tables), apply_op
    unique_rows, row_grads, kernel_grad = _ops().picasso_stitched_projection_grad(tables=tables, **inputs)
    return ([row_sparse_gradient(t, rows, values) for t, rows, values in zip(tables, unique_rows, row_grads)],
            kernel_grad)
