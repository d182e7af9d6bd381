"""Common subexpressions merged in the captured forward pass, before it is differentiated.

Grappler merges identical ops too, but only after Keras' tape has built the gradient,
so every copy keeps its own gradient op. A model that slices each field out of one
stacked tensor once per pair of fields (DeepCTR's FwFM, DeepFEFM) has hundreds of
identical slices; each one's gradient is a stack-sized tensor of zeros with one field
filled in, and the step sums them all. Merged before differentiation, the copies' upstream
gradients are summed first (field-sized) and the stack-sized gradient is built once per
distinct slice. The values are the same: identical pure ops on identical inputs.

Only stateless, registered ops in the same name scope with the same inputs, control
inputs, device and attributes merge; sources (placeholders, constants), v1 control flow
and ops that call functions never do. A constant input counts by its value, so two
slices with equal bounds merge. An op never moves to another scope: the passes that
match repeated layer calls by their name scopes (dense packing) would find the copy
that kept it different from the copies that read it.
"""
from tensorflow.python.framework import op_def_registry

from picasso_tf.graph.graph_def_util import canonical, rewire, split_tensor_name, tensor_name

_NEVER_MERGED = frozenset({"Placeholder", "PlaceholderWithDefault", "Enter", "Exit", "NextIteration", "Merge",
                           "Switch", "LoopCond", "ControlTrigger", "NoOp"})


def merge_common_subexpressions(graph_def, read_tensors=()):
    """(graph_def with every mergeable node identical to an earlier one removed and its
    consumers reading that one, {removed tensor: kept tensor} for every output of a
    removed node that graph_def's nodes or `read_tensors` (the graph's outputs) read,
    number of nodes removed). A graph with a cycle is returned as it is."""
    order = _topological(graph_def)
    if order is None:
        return graph_def, {}, 0
    constants = {n.name: _constant_value(n) for n in order if n.op == "Const"}
    survivors, replacements, removed = {}, {}, {}
    for node in order:
        if not _mergeable(node):
            continue
        key = _key(node, removed, constants)
        kept = survivors.setdefault(key, node.name)
        if kept != node.name:
            removed[node.name] = kept
    if not removed:
        return graph_def, {}, 0
    read = [i for n in graph_def.node for i in n.input] + list(read_tensors)
    for src, index in map(split_tensor_name, read):
        if src in removed and index >= 0:
            replacements[tensor_name(src, index)] = tensor_name(removed[src], index)
    return rewire(graph_def, replacements, removed, control_replacement=removed), replacements, len(removed)


def _mergeable(node):
    if node.op in _NEVER_MERGED or not any(not i.startswith("^") for i in node.input):
        return False
    op = op_def_registry.get(node.op)
    if op is None or op.is_stateful:
        return False
    return not any(value.HasField("func") or len(value.list.func) for value in node.attr.values())


def _constant_value(node):
    """What a Const node computes: its dtype and value, with its device."""
    return ("Const", node.device, node.attr["dtype"].SerializeToString(deterministic=True),
            node.attr["value"].SerializeToString(deterministic=True))


def _key(node, removed, constants):
    attrs = tuple(sorted((k, v.SerializeToString(deterministic=True)) for k, v in node.attr.items()))
    inputs = _renamed_inputs(node, removed)
    data = tuple(constants.get(split_tensor_name(i)[0], i) for i in inputs if not i.startswith("^"))
    controls = tuple(sorted(i for i in inputs if i.startswith("^")))
    return node.name.rpartition("/")[0], node.op, node.device, data, controls, attrs


def _renamed_inputs(node, removed):
    """node's inputs with every removed node's tensors read from the node kept instead;
    control inputs deduplicated."""
    inputs, controls = [], set()
    for inp in node.input:
        src, index = split_tensor_name(inp)
        src = removed.get(src, src)
        if index < 0:
            if src not in controls:
                controls.add(src)
                inputs.append("^" + src)
        else:
            inputs.append(canonical(tensor_name(src, index)))
    return inputs


def _topological(graph_def):
    """graph_def's nodes, each after the nodes it reads (data and control); None if
    they form a cycle (v1 while loops)."""
    nodes = {n.name: n for n in graph_def.node}
    done, order = set(), []
    for root in nodes:
        stack, open_ = [root], set()
        while stack:
            name = stack[-1]
            if name in done:
                stack.pop()
                continue
            open_.add(name)
            pending = [s for s in (split_tensor_name(i)[0] for i in nodes[name].input) if s not in done]
            if any(s in open_ for s in pending):
                return None
            if pending:
                stack.extend(pending)
                continue
            done.add(name)
            open_.discard(name)
            order.append(nodes[name])
            stack.pop()
    return order
