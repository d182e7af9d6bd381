"""Stitched lookups: several packed tables looked up straight into one [rows, width]
tensor, the concatenation the model makes of their outputs (the paper's "shuffle &
stitch" of packed outputs back into the model's layout), built without the copy.

Site i reads ``tables[table_index[i]]`` exactly as in ``packed_lookup`` and fills the
columns ``[columns[i], columns[i] + row_blocks[i] * D_i)``: each output row holds
``row_blocks[i]`` consecutive rows of the site's own output (1 for a one-hot feature,
L for a sequence of L ids concatenated flat). Dense inputs (tensors that are not
lookups, e.g. dense features in the same concatenation) are copied to their columns.

The gradient reads each table's sites' columns of the output gradient in place (no
split), giving every table a row-sparse ``tf.IndexedSlices``; dense inputs get their
columns back. Inside ``in_gradient.update_tables_in_gradient`` it may instead apply an
optimizer's update to the tables' rows in the same kernel.
"""
import tensorflow as tf

from picasso_tf.ops.in_gradient import apply_in_gradient, gradient_wanted, planned_updates
from picasso_tf.ops.packed_lookup import (_ops, lookup_attrs, row_sparse_gradient, site_inputs,
                                          tables_rows, weight_gradient)


def stitched_lookup(tables, ids_list, segment_ids_list=None, weights_list=None,
                    num_segments_list=None, dense_list=(), *, table_index, columns, row_blocks,
                    dense_columns=(), width, offsets, vocab_sizes, combiners, feature_names,
                    name=None):
    """The [rows, width] stitched output (see the module doc); per-site arguments as
    for ``packed_lookup``, all tables and dense inputs of one float dtype."""
    tables = [tf.convert_to_tensor(t) for t in tables]
    n = len(ids_list)
    for arg, values in (("table_index", table_index), ("columns", columns),
                        ("row_blocks", row_blocks)):
        if len(values) != n:
            raise ValueError(f"stitched_lookup: {arg} needs one entry per site ({n}); "
                             f"got {len(values)}")
    ids, segment_ids, weights, num_segments = site_inputs(
        tables[0].dtype, ids_list, segment_ids_list, weights_list, num_segments_list,
        offsets=offsets, vocab_sizes=vocab_sizes, combiners=combiners,
        feature_names=feature_names, op_name="stitched_lookup")
    return _ops().picasso_stitched_lookup(
        tables=tables, ids=ids, segment_ids=segment_ids, weights=weights,
        num_segments=num_segments, dense=list(dense_list), width=width,
        table_index=list(table_index), columns=list(columns), row_blocks=list(row_blocks),
        dense_columns=list(dense_columns), offsets=list(offsets),
        vocab_sizes=list(vocab_sizes), combiners=list(combiners),
        feature_names=list(feature_names), name=name)


@tf.RegisterGradient("PicassoStitchedLookup")
def _stitched_lookup_gradient(op, grad):
    g, n = op.get_attr("G"), op.get_attr("N")
    tables = op.inputs[:g]
    ids = op.inputs[g:g + n]
    segment_ids = op.inputs[g + n:g + 2 * n]
    weights = op.inputs[g + 2 * n:g + 3 * n]
    num_segments = op.inputs[g + 3 * n:g + 4 * n]
    attrs = lookup_attrs(op)
    table_index, columns = op.get_attr("table_index"), op.get_attr("columns")
    row_blocks = op.get_attr("row_blocks")
    grad = tf.convert_to_tensor(grad)
    skip = set(getattr(op, "skip_input_indices", None) or ())

    def site_columns(tensor, i):
        d = tables[table_index[i]].shape[1]
        return tf.reshape(tensor[:, columns[i]:columns[i] + row_blocks[i] * d], [-1, d])

    weight_grads = []
    for i in range(n):
        empty = weights[i].shape.rank == 1 and weights[i].shape[0] == 0  # "all ones"
        weight_grads.append(None if empty or not gradient_wanted(op, g + 2 * n + i) else weight_gradient(
            tables[table_index[i]], site_columns(grad, i), site_columns(op.outputs[0], i),
            ids[i] if attrs["combiners"][i] != "none" else tf.reshape(ids[i], [-1]), segment_ids[i],
            weights[i], num_segments[i],
            attrs["offsets"][i], attrs["combiners"][i]))

    wanted = [t for t in range(g) if t not in skip and t in table_index]
    table_grads = [None] * g
    if wanted:
        sites = [i for i in range(n) if table_index[i] in wanted]
        pick = lambda values: [values[i] for i in sites]  # noqa: E731
        inputs = dict(
            grad=grad, ids=pick(ids), segment_ids=pick(segment_ids), weights=pick(weights),
            num_segments=pick(num_segments), table_index=[wanted.index(table_index[i]) for i in sites],
            num_rows=[tables_rows(tables, table_index, attrs)[t] for t in wanted],
            dims=[tables[t].shape[1] for t in wanted], columns=pick(columns),
            row_blocks=pick(row_blocks), **{k: pick(v) for k, v in attrs.items()})
        # The kernel may update the tables itself when it computes all their gradients
        # and no weight's gradient reads their values after it.
        in_kernel = (len(wanted) == g and all(w is None for w in weight_grads)
                     and all(t.shape.is_fully_defined() for t in tables))
        planned = planned_updates(tables) if in_kernel else None
        if planned:
            apply_in_gradient(_ops().picasso_stitched_lookup_grad_apply, planned, tables[0].dtype, **inputs)
        else:
            unique_rows, row_grads = _ops().picasso_stitched_lookup_grad(G=len(wanted), **inputs)
            for t, rows, values in zip(wanted, unique_rows, row_grads):
                table_grads[t] = row_sparse_gradient(tables[t], rows, values)

    return table_grads + [None] * (2 * n) + weight_grads + [None] * n + dense_gradients(op, grad)


def dense_gradients(op, grad):
    """The gradients of the stitched lookup `op`'s dense inputs, from `grad`, its
    output's: their columns of it, in their shapes."""
    g, n = op.get_attr("G"), op.get_attr("N")
    rows = tf.shape(grad)[0]
    return [tf.reshape(tf.slice(grad, [0, col], [-1, tf.size(x) // tf.maximum(rows, 1)]), tf.shape(x))
            for x, col in zip(op.inputs[g + 4 * n:], op.get_attr("dense_columns"))]

