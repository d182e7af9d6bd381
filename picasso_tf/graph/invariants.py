"""The part of a forward graph that does not depend on the batch: ops computed from
dense variables' values and constants alone, such as the stacked and transposed
kernels of MMoE's experts that dense packing makes each step. D-interleaving
(runtime/micro_batches.py) computes it once per step instead of once per
micro-batch."""
from picasso_tf.graph.graph_def_util import GraphIndex, canonical, computed_from, prune, split_tensor_name

# A read of a variable (or a constant) passed on as it is, or cast (mixed precision):
# nothing to compute once.
_PASSED_ON = ("ReadVariableOp", "Identity", "Const", "Cast")


def batch_invariant(graph_def, variables, needed):
    """(tensors, graph_def pruned to what computes them): the invariant tensors that
    the rest of graph_def, or `needed`, reads, sorted, leaving out a read passed on as
    it is. Invariant: computed by stateless ops from constants and the reads of
    `variables` (placeholders of dense variables) that the graph only reads."""
    index = GraphIndex(graph_def)
    uses = [[use for use, _ in index.node_uses(split_tensor_name(v)[0])] for v in variables]
    # A read with a control input waits for something; a variable written too is read in order.
    reads = {use.name for used in uses if all(u.op == "ReadVariableOp" for u in used)
             for use in used if not any(i.startswith("^") for i in use.input)}
    invariant = computed_from(graph_def, reads)
    read = {t for t, uses in index.consumers.items() if any(n.name not in invariant for n, _ in uses)}
    frontier = sorted(t for t in read | {canonical(t) for t in needed}
                      if split_tensor_name(t)[0] in invariant and _computes(index, t))
    return frontier, prune(graph_def, frontier)


def _computes(index, tensor):
    """Whether an op other than a read passed on computes `tensor` (invariant: every
    node above it is)."""
    todo, seen = [split_tensor_name(tensor)[0]], set()
    while todo:
        node = index.nodes[todo.pop()]
        if node.op not in _PASSED_ON:
            return True
        if node.name not in seen:
            seen.add(node.name)
            todo.extend(split_tensor_name(i)[0] for i in node.input if node.op != "ReadVariableOp")
    return False
