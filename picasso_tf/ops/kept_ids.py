"""Padded ids as the fused lookups read them, in one op (custom_ops/kept_ids_op.cc)."""
import tensorflow as tf

from picasso_tf.ops.library import load

# Ids carry no gradient; neither do weights made from them.
tf.no_gradient("PicassoKeptIds")


def kept_ids(ids, dtype, keep_zero, name=None):
    """(max(ids, 0), weights ids.shape + [1] of `dtype`: 1 where an id is kept, else 0).
    Kept: ids > 0, or ids >= 0 with keep_zero."""
    return tuple(load().picasso_kept_ids(ids=ids, T=dtype, keep_zero=keep_zero, name=name))


tf.no_gradient("PicassoKeptSegments")


def kept_segments(ids, keep_zero, name=None):
    """(kept ids, the row of each, the number of rows) of padded ids [B, L]: the ids a
    conversion to a SparseTensor keeps (> 0, or >= 0 with keep_zero), in order."""
    return tuple(load().picasso_kept_segments(ids=ids, keep_zero=keep_zero, name=name))
