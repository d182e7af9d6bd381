"""Tables side by side (custom_ops/stack_columns_op.cc): the one table that same-ids
stacking looks up in place of several (picasso_tf/passes/same_ids_stacking.py).

The gradient gives each table its columns of the stacked table's gradient: row-sparse
``tf.IndexedSlices`` (the same rows, each table's columns of their values) where the
lookup's gradient is, dense where it is dense.
"""
import tensorflow as tf

from picasso_tf.ops.library import load
from picasso_tf.ops.packed_lookup import row_sparse_gradient


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
