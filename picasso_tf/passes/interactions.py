"""Interactions pass: a DLRM-style dot interaction becomes one fused kernel.

Models (DLRM, and Keras ports of it) write the pairwise dot products of F feature
vectors x [B, F, d] as `tf.matmul(x, x, transpose_b=True)` ([B, F, F]), reshaped to
[B, F*F] and gathered at constant positions (the strictly lower triangle, say). On a
CPU most of that layer's time then goes to moving single floats: the gather, and in
the gradient its scatter back to [B, F, F], two batched products and transposes. The
pass replaces the gather's output by PicassoPairwiseDots (ops/pairwise_dots.py), which
computes only the gathered products and whose gradient reads them directly. The
MatMul and the reshape go too, unless something else reads them.

Matched: a BatchMatMul of x with itself, transposed on the right (adj_y, or a
Transpose of x by [0, 2, 1]), with F static, whose [B, F*F] reshape is read by a
GatherV2 along axis 1 with constant indices. Any other product of x with itself is
left alone, and the report says why.
"""
import numpy as np
import tensorflow as tf

from picasso_tf.graph.graph_def_util import GraphIndex, canonical
from picasso_tf.ops.pairwise_dots import pairwise_dots

_MATMULS = ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")


def interactions(state, config):
    captured = state.graph
    index = GraphIndex(captured.graph_def)
    candidates = [n for n in captured.graph_def.node if n.op in _MATMULS]
    if not candidates:
        return state, {"fused": [], "left_alone": []}
    scratch = tf.Graph()
    with scratch.as_default():
        tf.graph_util.import_graph_def(captured.graph_def, name="")
    fused, left_alone, replacements = [], [], {}
    for matmul in candidates:
        x = _self_product_operand(index, matmul)
        if x is None:
            continue   # not x times x^T: some other product
        match = _gathered_pairs(index, scratch, matmul, x)
        if isinstance(match, str):
            left_alone.append({"node": matmul.name, "why": match})
            continue
        gather, left, right = match
        with scratch.as_default(), tf.name_scope("picasso/interaction/"):
            dots = pairwise_dots(scratch.get_tensor_by_name(x), left, right)
        replacements[canonical(gather.name)] = canonical(dots.name)
        fused.append({"gather": gather.name, "features": scratch.get_tensor_by_name(x).shape[1],
                      "pairs": len(left)})
    if fused:
        state.graph = captured.rewritten(scratch.as_graph_def(), replacements, {g["gather"] for g in fused})
    return state, {"fused": fused, "left_alone": left_alone}


def _self_product_operand(index, matmul):
    """x where matmul computes x times x transposed (on its last two axes), else None."""
    a, b = canonical(matmul.input[0]), canonical(matmul.input[1])
    adj_x = matmul.attr["adj_x"].b
    adj_y = matmul.attr["adj_y"].b
    if adj_x:
        return None
    if adj_y:
        return a if a == b else None
    transpose = index.node(b)
    if transpose.op == "Transpose" and canonical(transpose.input[0]) == a:
        perm = _constant(index, transpose.input[1])
        if perm is not None and perm.tolist() == [0, 2, 1]:
            return a
    return None


def _gathered_pairs(index, graph, matmul, x):
    """(the GatherV2 node, left, right) of a matched interaction, else why not."""
    operand = graph.get_tensor_by_name(x)
    if operand.dtype not in (tf.float32, tf.float64):
        return f"its operand {x} is {operand.dtype.name}; the fused kernel takes float32 and float64"
    shape = operand.shape
    if shape.rank != 3 or shape[1] is None:
        return f"its operand {x} is not [batch, features, dim] with a static number of features"
    f = shape[1]
    uses = index.uses(matmul.name)
    reshapes = [n for n, pos in uses if n.op == "Reshape" and pos == 0]
    if len(reshapes) != 1:
        return "its product is not reshaped to [batch, features * features]"
    reshape = reshapes[0]
    flat = graph.get_tensor_by_name(canonical(reshape.name)).shape
    if flat.rank != 2 or flat[1] != f * f:
        return f"its product is reshaped to {flat}, not [batch, {f * f}]"
    gathers = [n for n, pos in index.uses(reshape.name) if n.op == "GatherV2" and pos == 0]
    if len(gathers) != 1:
        return "the reshaped product is not read by one gather"
    gather = gathers[0]
    indices = _constant(index, gather.input[1])
    axis = _constant(index, gather.input[2])
    if indices is None or indices.ndim != 1 or axis is None or int(axis) not in (1, -1) or \
            gather.attr["batch_dims"].i != 0:
        return "the gather does not take constant positions along axis 1"
    if indices.size and (indices.min() < 0 or indices.max() >= f * f):
        return f"the gather reads positions outside [0, {f * f})"
    left, right = np.divmod(indices.astype(np.int64), f)
    return gather, left.tolist(), right.tolist()


def _constant(index, tensor):
    """The value of a Const node's tensor, else None."""
    node = index.node(tensor)
    if node.op != "Const":
        return None
    return tf.make_ndarray(node.attr["value"].tensor)
