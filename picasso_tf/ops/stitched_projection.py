"""Stitched projections: a stitched lookup multiplied by a kernel, fused.

When a model's concatenation of embeddings feeds only a MatMul (a logistic
regression over hundreds of fields, the wide part of a model, an MLP's first layer),
``stitched_projection`` computes ``stitched_lookup(...) @ kernel`` from the tables'
rows directly, and its gradient gives every table its row-sparse gradient and the
kernel its gradient: neither the [rows, width] concatenation nor its gradient is
ever written.

With a few output units (at most MAX_UNITS) each entry's row meets the kernel
directly. A wider kernel is multiplied per unique row of the batch instead: ids
repeat (a batch of 4096 draws about 1,000 distinct ids per field under Zipf 1.2),
so each distinct row's product with its kernel rows is computed once and added to
the output rows of its entries, a fraction of a MatMul's work on the concatenation.
The gradient works per unique row for any width: the upstream rows of a row's
entries summed once, then that sum meets the site's kernel rows (the row's
gradient) and the row's values (the kernel's gradient); with a wide kernel, a few
rows at a time in registers, so the sums are never written out.

Sites are laid out as in ``stitched_lookup`` (``columns``, ``row_blocks``); columns
that no site covers (dense inputs of the concatenation) contribute nothing here:
the caller adds their products. Sites take no per-id weights.

Inside ``in_gradient.update_tables_in_gradient`` the gradient can instead hand each
table's rows to an optimizer's update in the same kernel, while they are in cache
(their values too, read for the kernel's gradient): the training step uses it where
that is the same update.
"""
import tensorflow as tf

from picasso_tf.ops.in_gradient import apply_in_gradient, planned_updates
from picasso_tf.ops.packed_lookup import _ops, lookup_attrs, row_sparse_gradient, site_inputs

MAX_UNITS = 8   # kMaxProjectionUnits in the kernel: wider kernels go per unique row


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


@tf.RegisterGradient("PicassoStitchedProjection")
def _stitched_projection_gradient(op, grad):
    """The tables' row-sparse gradients and the kernel's; inside
    update_tables_in_gradient, maybe the tables' updates instead (their gradients then
    None)."""
    g, n = op.get_attr("G"), op.get_attr("N")
    tables, per_site = op.inputs[:g], op.inputs[g:g + 4 * n]
    inputs = dict(grad=grad, kernel=op.inputs[-1], ids=per_site[:n], segment_ids=per_site[n:2 * n],
                  weights=per_site[2 * n:3 * n], num_segments=per_site[3 * n:],
                  width=op.get_attr("width"), table_index=op.get_attr("table_index"),
                  columns=op.get_attr("columns"), row_blocks=op.get_attr("row_blocks"),
                  exchanged=op.get_attr("exchanged"), **lookup_attrs(op))
    no_site_grads = [None] * (4 * n)
    planned = planned_updates(tables)
    if planned:
        kernel_grad = apply_in_gradient(_ops().picasso_stitched_projection_grad_apply, planned,
                                        tables[0].dtype, **inputs)
        return [None] * g + no_site_grads + [kernel_grad]
    unique_rows, row_grads, kernel_grad = _ops().picasso_stitched_projection_grad(tables=tables, **inputs)
    return ([row_sparse_gradient(t, rows, values) for t, rows, values in zip(tables, unique_rows, row_grads)]
            + no_site_grads + [kernel_grad])
