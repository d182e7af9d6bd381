"""Interactions pass: a DLRM-style dot interaction becomes one fused kernel.

Models (DLRM, and Keras ports of it) write the pairwise dot products of F feature
vectors x [B, F, d] as `tf.matmul(x, x, transpose_b=True)` ([B, F, F]), reshaped to
[B, F*F] and gathered at constant positions (the strictly lower triangle, say). On a
CPU most of that layer's time then goes to moving single floats: the gather, and in
the gradient its scatter back to [B, F, F], two batched products and transposes. The
pass replaces the gather's output by PicassoPairwiseDots (ops/pairwise_dots.py), which
computes only the gathered products and whose gradient reads them directly. The
MatMul and the reshape go too, unless something else reads them. When the products'
one reader is a concatenation (DLRM's top-MLP input: [bottom MLP output, products]),
the kernel writes the concatenation itself, the other inputs copied to their columns,
and the gradient reads the products' columns in place: neither the concatenation nor
the slice of its gradient is left.

Matched: a BatchMatMul of x with itself, transposed on the right (adj_y, or a
Transpose of x by [0, 2, 1]), with F static, whose [B, F*F] reshape is read by a
GatherV2 along axis 1 with constant indices. Any other product of x with itself is
left alone, and the report says why.
"""
import dataclasses

import numpy as np
import tensorflow as tf

from picasso_tf.graph.graph_def_util import GraphIndex, canonical
from picasso_tf.ops.pairwise_dots import pairwise_dots

_MATMULS = ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")


def interactions(program, graph, config):
    captured = program.graphs[graph]
    index = GraphIndex(captured.graph_def)
    candidates = [n for n in captured.graph_def.node if n.op in _MATMULS]
    if not candidates:
        return program, {"fused": [], "left_alone": []}
    scratch = tf.Graph()
    with scratch.as_default():
        # A concatenation is matched by the static widths of its inputs: the variables'
        # shapes give them.
        replacements, removed = captured.import_typed()
    fused, left_alone = [], []
    for matmul in candidates:
        x = _self_product_operand(index, matmul)
        if x is None:
            continue   # not x times x^T: some other product
        match = _gathered_pairs(index, scratch, matmul, x)
        if isinstance(match, str):
            left_alone.append({"node": matmul.name, "why": match})
            continue
        gather, left, right = match
        operand = scratch.get_tensor_by_name(x)
        concat = _concatenation(index, scratch, gather, operand.dtype, claimed={f["concat"] for f in fused})
        with scratch.as_default(), tf.name_scope("picasso/interaction/"):
            if concat is None:
                replaced = gather
                dots = pairwise_dots(operand, left, right)
            else:   # the products land in the concatenation's columns, beside its other inputs
                replaced, parts = concat
                columns = np.cumsum([0] + [t.shape[1] for t in parts]).tolist()
                at = next(k for k, t in enumerate(parts) if t.op.name == gather.name)
                dense = [(t, c) for k, (t, c) in enumerate(zip(parts, columns)) if k != at]
                dots = pairwise_dots(operand, left, right, dense=[t for t, _ in dense],
                                     dense_columns=[c for _, c in dense], pairs_column=columns[at],
                                     width=columns[-1])
        replacements[canonical(replaced.name)] = canonical(dots.name)
        removed |= {gather.name, replaced.name}
        fused.append({"gather": gather.name, "concat": None if concat is None else replaced.name,
                      "features": operand.shape[1], "pairs": len(left)})
    if fused:
        program = dataclasses.replace(program, graphs={
            **program.graphs, graph: captured.rewritten(scratch.as_graph_def(), replacements, removed)})
    return program, {"fused": fused, "left_alone": left_alone}


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


def _concatenation(index, graph, gather, dtype, claimed):
    """(the ConcatV2 node, its inputs) when the gather's one reader is a concatenation
    along axis 1 of [batch, width] tensors of the operand's dtype with static widths,
    which no other interaction has claimed; else None."""
    uses = index.uses(gather.name)
    if len(uses) != 1 or uses[0][0].op != "ConcatV2" or uses[0][0].name in claimed:
        return None
    concat = uses[0][0]
    count = concat.attr["N"].i
    axis = _constant(index, concat.input[count])
    parts = [graph.get_tensor_by_name(canonical(t)) for t in concat.input[:count]]
    if axis is None or int(axis) not in (1, -1) or \
            [t.op.name for t in parts].count(gather.name) != 1 or \
            any(t.dtype != dtype or t.shape.rank != 2 or t.shape[1] is None for t in parts):
        return None
    return concat, parts


def _constant(index, tensor):
    """The value of a Const node's tensor, else None."""
    node = index.node(tensor)
    if node.op != "Const":
        return None
    return tf.make_ndarray(node.attr["value"].tensor)
