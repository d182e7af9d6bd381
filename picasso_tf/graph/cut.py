"""The cut of D-interleaving from the MLP (paper Fig. 8a): a forward GraphDef split at
the end of its embedding layer into the embedding part, which runs on the whole batch,
and the dense part, which runs per micro-batch with the cut tensors fed in.

The embedding layer is the fused lookups and the ops that pool or mask their outputs
row by row (cut_tensors): a sequence feature's unpooled rows are 50 times its pooled
embedding, and the whole batch of them, with their gradients, would otherwise be held
through every micro-batch."""
import tensorflow as tf

from picasso_tf.graph.graph_def_util import (GraphIndex, canonical, computed_from, prune, reachable_nodes, rewire,
                                             split_tensor_name, unique_name)

# Ops whose output row i reads row i of their inputs only (inputs broadcast to the
# output's rank): with axis 0 the batch in and out, the cut can move past them.
ELEMENTWISE = {"AddN", "Mul", "RealDiv", "Div", "DivNoNan", "MulNoNan", "Add", "AddV2", "Sub", "Maximum", "Minimum", "Neg",
               "Cast", "Identity", "Square", "Sqrt", "Rsqrt", "Exp", "Log", "Abs"}
# Ops over constant axes that keep axis 0 where it is unless they name it: pooling
# reductions, concatenation, inserting or squeezing an axis.
REDUCTIONS = {"Sum", "Mean", "Max", "Min", "Prod"}


def cut_tensors(graph_def, lookup_nodes, input_tensors, needed):
    """The tensors at which the embedding layer of `lookup_nodes` (fused lookups) ends,
    sorted: outputs of the lookups, or of row-wise ops computed from them and from the
    batch's inputs (masks and weights, pooling over a non-batch axis, concatenations),
    that the rest of the graph reads or that are `needed` (the graph's outputs). Axis 0
    of each is the batch."""
    index = GraphIndex(graph_def)
    free = computed_from(graph_def, {split_tensor_name(t)[0] for t in input_tensors})
    ranks = _ranks(graph_def)
    layer, todo = set(lookup_nodes), list(lookup_nodes)
    while todo:
        for use, _ in index.node_uses(todo.pop()):
            if use.name not in layer and _row_wise(use, layer, free, ranks, index):
                layer.add(use.name)
                todo.append(use.name)
    # Only what the outputs need: the dense part is pruned to them.
    live = reachable_nodes(graph_def, needed)
    read = {t for t, uses in index.consumers.items() if any(n.name not in layer and n.name in live for n, _ in uses)}
    return sorted(t for t in read | {canonical(t) for t in needed} if split_tensor_name(t)[0] in layer)


def embedding_part(graph_def, cut, keep):
    """graph_def pruned to what computes the `cut` tensors, the `keep` nodes kept."""
    return prune(graph_def, cut, keep=keep)


def dense_part(captured, cut, embeddings):
    """(the CapturedGraph whose every consumer of a cut tensor reads a new placeholder
    instead, pruned to the outputs; those placeholders, aligned with cut). The
    placeholders take the dtype and the non-batch shape of `embeddings`, the cut
    tensors' values on a batch."""
    graph_def = type(captured.graph_def)()
    graph_def.CopyFrom(captured.graph_def)
    placeholders = []
    for tensor, value in zip(cut, embeddings):
        node = graph_def.node.add()
        node.name = unique_name(graph_def, "picasso_cut/" + split_tensor_name(tensor)[0].replace("/", "_"))
        node.op = "Placeholder"
        node.attr["dtype"].type = value.dtype.as_datatype_enum
        node.attr["shape"].shape.CopyFrom(tf.TensorShape([None]).concatenate(value.shape[1:]).as_proto())
        placeholders.append(f"{node.name}:0")
    replacements = {canonical(t): p for t, p in zip(cut, placeholders)}
    dense = captured.with_graph(rewire(graph_def, replacements, set()), replacements, captured.captures)
    needed = dense.output_tensors + dense.mask_tensors + dense.logit_tensors + (
        [dense.regularization_loss] if dense.regularization_loss else [])
    return dense.with_graph(prune(dense.graph_def, needed, keep=captured.input_tensors), {}, dense.captures), placeholders


def _row_wise(node, layer, free, ranks, index):
    """Whether `node` joins the embedding layer: a row-wise op, every input of which
    the layer or the batch's inputs compute, that keeps axis 0 the batch."""
    sources = [split_tensor_name(i) for i in node.input]
    rank = ranks.get(f"{node.name}:0")
    if rank is None or any(s not in layer and s not in free for s, _ in sources):
        return False
    if node.op in ELEMENTWISE:
        return all(ranks.get(f"{s}:{i}") == rank for s, i in sources if s in layer and i >= 0)
    if node.op == "Squeeze":
        axes, rank = list(node.attr["squeeze_dims"].list.i), ranks.get(canonical(node.input[0]))
    elif node.op in REDUCTIONS or node.op == "ExpandDims":
        if sources[1][0] in layer or index.node(node.input[1]).op != "Const":
            return False
        axes = tf.make_ndarray(index.node(node.input[1]).attr["value"].tensor).ravel().tolist()
        rank = ranks.get(canonical(node.input[0])) if node.op in REDUCTIONS else rank
    elif node.op == "ConcatV2":
        if sources[-1][0] in layer or index.node(node.input[-1]).op != "Const":
            return False
        axes = tf.make_ndarray(index.node(node.input[-1]).attr["value"].tensor).ravel().tolist()
    else:
        return False
    return bool(rank) and bool(axes) and all(a % rank != 0 for a in axes)


def _ranks(graph_def):
    """Static rank of every tensor of graph_def (None where unknown), from an import
    into a scratch graph: its placeholders carry the input specs' shapes, and shape
    inference the rest."""
    with tf.Graph().as_default() as graph:
        tf.graph_util.import_graph_def(graph_def, name="")
    return {t.name: t.shape.rank for op in graph.get_operations() for t in op.outputs}
