"""Pairwise dot products of a feature interaction (DLRM's "dot" interaction) in one
kernel: ``output[b, p] = <x[b, left[p]], x[b, right[p]]>`` for ``x`` [B, F, d].

Models write it as ``tf.matmul(x, x, transpose_b=True)`` followed by a gather of some
of the [F, F] entries (the strictly lower triangle, usually); the interactions pass
replaces that pair of ops by this one. Equal to the MatMul up to rounding (each dot
product sums in its own order).

The products can also land in columns of a wider output, beside dense inputs copied
to theirs: the concatenation a model makes of them (DLRM's ``[bottom MLP output,
interactions]``), built without the copy; the gradient then reads the products'
columns of the output gradient in place.
"""
import tensorflow as tf

from picasso_tf.ops.packed_lookup import _ops


def pairwise_dots(x, left, right, dense=(), dense_columns=(), pairs_column=0, width=None,
                  name=None):
    """[B, F, d] -> [B, width]: the dot products of features left[p] and right[p] in
    columns [pairs_column, pairs_column + P), dense input m ([B, w_m]) in columns
    [dense_columns[m], dense_columns[m] + w_m). Without dense inputs the output is
    [B, P]; with them, every column must be filled once and ``width`` given."""
    left, right = [int(i) for i in left], [int(j) for j in right]
    if len(left) != len(right):
        raise ValueError(f"pairwise_dots: left and right need one entry per pair; got "
                         f"{len(left)} and {len(right)}")
    if len(dense) != len(dense_columns):
        raise ValueError(f"pairwise_dots: dense_columns needs one entry per dense input "
                         f"({len(dense)}); got {len(dense_columns)}")
    if width is None:
        if dense:
            raise ValueError("pairwise_dots: with dense inputs, give the output's width")
        width = pairs_column + len(left)
    return _ops().picasso_pairwise_dots(x, dense=list(dense), left=left, right=right,
                                        pairs_column=int(pairs_column),
                                        dense_columns=[int(c) for c in dense_columns],
                                        width=int(width), name=name)


@tf.RegisterGradient("PicassoPairwiseDots")
def _pairwise_dots_gradient(op, grad):
    x_grad = _ops().picasso_pairwise_dots_grad(op.inputs[0], grad, left=op.get_attr("left"),
                                               right=op.get_attr("right"),
                                               pairs_column=op.get_attr("pairs_column"))
    dense_grads = [tf.slice(grad, [0, column], [-1, tf.shape(dense)[1]])
                   for dense, column in zip(op.inputs[1:], op.get_attr("dense_columns"))]
    return [x_grad] + dense_grads
