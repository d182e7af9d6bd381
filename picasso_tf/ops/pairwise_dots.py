"""Pairwise dot products of a feature interaction (DLRM's "dot" interaction) in one
kernel: ``output[b, p] = <x[b, left[p]], x[b, right[p]]>`` for ``x`` [B, F, d].

Models write it as ``tf.matmul(x, x, transpose_b=True)`` followed by a gather of some
of the [F, F] entries (the strictly lower triangle, usually); the interactions pass
replaces that pair of ops by this one. Equal to the MatMul up to rounding (each dot
product sums in its own order).
"""
import tensorflow as tf

from picasso_tf.ops.packed_lookup import _ops


def pairwise_dots(x, left, right, name=None):
    """[B, F, d] -> [B, len(left)]: the dot products of features left[p] and right[p]."""
    left, right = [int(i) for i in left], [int(j) for j in right]
    if len(left) != len(right):
        raise ValueError(f"pairwise_dots: left and right need one entry per pair; got "
                         f"{len(left)} and {len(right)}")
    return _ops().picasso_pairwise_dots(x, left=left, right=right, name=name)


@tf.RegisterGradient("PicassoPairwiseDots")
def _pairwise_dots_gradient(op, grad):
    return _ops().picasso_pairwise_dots_grad(op.inputs[0], grad, left=op.get_attr("left"),
                                             right=op.get_attr("right"))
