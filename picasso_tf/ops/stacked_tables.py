"""Tables side by side (custom_ops/stacked_tables_ops.cc), as same-ids stacking looks
them up in place of several (picasso_tf/passes/same_ids_stacking.py).

``stack_columns`` copies tables into one wider table, for any stitched lookup of it;
``stacked_lookup`` reads the rows of ids read one by one from the tables themselves,
as that lookup of the copy would, without the copy.

Either way, each table's gradient is its columns of the stacked rows' gradient:
row-sparse ``tf.IndexedSlices`` (the same rows, each table's columns of their values)
where the lookup's gradient is, dense where it is dense.
"""
import tensorflow as tf

from picasso_tf.ops.library import load
from picasso_tf.ops.packed_lookup import _same_id_dtype, row_sparse_gradient


def stack_columns(tables, name=None):
    """The [rows, sum of widths] table whose row r holds row r of each of `tables` in turn."""
    return load().picasso_stack_columns(tables=list(tables), name=name)


@tf.RegisterGradient("PicassoStackColumns")
def _stack_columns_gradient(op, grad):
    widths = [int(t.shape[1]) for t in op.inputs]
    if isinstance(grad, tf.IndexedSlices):
        return [row_sparse_gradient(table, grad.indices, values)
                for values, table in zip(tf.split(grad.values, widths, axis=1), op.inputs)]
    return tf.split(grad, widths, axis=1)


def stacked_lookup(stacks, ids_list, *, row_blocks, vocab_sizes, feature_names, name=None):
    """What ``stitched_lookup`` gives on ``stack_columns(stack)`` of each of `stacks` (k
    tables of one width each, a stack's tables of the same rows), its ids read one by
    one (combiner "none"), row_blocks ids per output row, stacks side by side: the
    [rows, len(stacks) * row_blocks * k * width] output. vocab_sizes: a stack's tables'
    rows, which its ids must lie below; feature_names: its ids' feature, for errors."""
    sizes = {len(stack) for stack in stacks}
    if len(sizes) != 1:
        raise ValueError(f"stacked_lookup: every stack needs as many tables; got {sorted(sizes)}")
    return load().picasso_stacked_lookup(tables=[t for stack in stacks for t in stack], ids=_same_id_dtype(ids_list),
                                         row_blocks=row_blocks, vocab_sizes=list(vocab_sizes),
                                         feature_names=list(feature_names), name=name)


@tf.RegisterGradient("PicassoStackedLookup")
def _stacked_lookup_gradient(op, grad):
    num_stacks, row_blocks = op.get_attr("S"), op.get_attr("row_blocks")
    tables, ids = op.inputs[:-num_stacks], list(op.inputs[-num_stacks:])
    k, width = len(tables) // num_stacks, int(tables[0].shape[1])
    vocab_sizes, dtype = op.get_attr("vocab_sizes"), tables[0].dtype
    # The stitched lookup's gradient, as for the stacked copies: it reads no table.
    unique_rows, row_grads = load().picasso_stitched_lookup_grad(
        G=num_stacks, grad=tf.convert_to_tensor(grad), ids=ids,
        segment_ids=[tf.zeros([0], tf.int64)] * num_stacks, weights=[tf.zeros([0], dtype)] * num_stacks,
        num_segments=[tf.constant(0, tf.int64)] * num_stacks, table_index=list(range(num_stacks)),
        num_rows=list(vocab_sizes), dims=[k * width] * num_stacks,
        columns=[s * row_blocks * k * width for s in range(num_stacks)], row_blocks=[row_blocks] * num_stacks,
        offsets=[0] * num_stacks, vocab_sizes=list(vocab_sizes),
        combiners=["none"] * num_stacks, feature_names=[f.decode() for f in op.get_attr("feature_names")])
    gradients = []
    for s in range(num_stacks):
        columns = tf.split(row_grads[s], k, axis=1)
        gradients += [row_sparse_gradient(table, unique_rows[s], values)
                      for table, values in zip(tables[s * k:(s + 1) * k], columns)]
    return gradients + [None] * num_stacks
