"""Small GraphDef helpers: tensor names, use-def index, rewiring and pruning.

A tensor is named "node:index" (":0" may be omitted); a control input is "^node".
"""
import collections

from tensorflow.core.framework import graph_pb2
from tensorflow.python.framework import op_def_registry


def split_tensor_name(name):
    """'node:1' -> ('node', 1); 'node' -> ('node', 0); '^node' -> ('node', -1)."""
    if name.startswith("^"):
        return name[1:], -1
    node, _, index = name.partition(":")
    return node, int(index) if index else 0


def tensor_name(node, index=0):
    return f"{node}:{index}"


def canonical(name):
    """'node' and 'node:0' are the same tensor; control inputs stay as they are."""
    node, index = split_tensor_name(name)
    return name if index < 0 else tensor_name(node, index)


class GraphIndex:
    """Nodes by name and the consumers of every tensor, for pattern matching."""

    def __init__(self, graph_def):
        self.graph_def = graph_def
        self.nodes = {n.name: n for n in graph_def.node}
        self.consumers = collections.defaultdict(list)   # tensor name -> [(node, input position)]
        self.control_consumers = collections.defaultdict(list)  # node name -> [node]
        for n in graph_def.node:
            for pos, inp in enumerate(n.input):
                src, index = split_tensor_name(inp)
                if index < 0:
                    self.control_consumers[src].append(n)
                else:
                    self.consumers[tensor_name(src, index)].append((n, pos))

    def node(self, tensor):
        return self.nodes[split_tensor_name(tensor)[0]]

    def input_node(self, node, position):
        return self.node(node.input[position])

    def uses(self, tensor):
        return self.consumers.get(canonical(tensor), [])

    def node_uses(self, node_name):
        """Every (consumer, position) of any output of node_name (data edges only)."""
        return [use for t, uses in self.consumers.items() if split_tensor_name(t)[0] == node_name for use in uses]


def rewire(graph_def, replacements, removed_nodes, control_replacement=None):
    """Returns a copy of graph_def where every data input named in `replacements`
    (tensor -> tensor) is redirected, nodes in `removed_nodes` are dropped, and control
    inputs on removed nodes point at `control_replacement` (a node name, or a dict
    {removed node: node}; None drops them)."""
    replacements = {canonical(k): v for k, v in replacements.items()}
    out = graph_pb2.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    for node in graph_def.node:
        if node.name in removed_nodes:
            continue
        new = out.node.add()
        new.CopyFrom(node)
        del new.input[:]
        seen_control = set()
        for inp in node.input:
            src, index = split_tensor_name(inp)
            if index < 0:
                if src in removed_nodes:
                    if control_replacement is None:
                        continue
                    src = (control_replacement[src] if isinstance(control_replacement, dict)
                           else control_replacement)
                if src not in seen_control:
                    seen_control.add(src)
                    new.input.append("^" + src)
            else:
                new.input.append(replacements.get(canonical(inp), inp))
    return drop_stale_colocations(out)


def reachable_nodes(graph_def, output_tensors):
    """Names of the nodes needed (data and control) to compute output_tensors."""
    nodes = {n.name: n for n in graph_def.node}
    stack = [split_tensor_name(t)[0] for t in output_tensors]
    seen = set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        stack.extend(split_tensor_name(i)[0] for i in nodes[name].input)
    return seen


def computed_from(graph_def, roots):
    """Names of the `roots` nodes and of the stateless nodes computed from them and
    constants alone (from a batch's inputs, a feature's mask or weights; from dense
    variables' reads, what reads no batch)."""
    nodes = {n.name: n for n in graph_def.node}
    free, seen = set(), set()
    for root in nodes:                           # depth first, without recursion
        stack = [root]
        while stack:
            name = stack[-1]
            if name in seen:
                stack.pop()
                continue
            sources = [split_tensor_name(i)[0] for i in nodes[name].input]
            pending = [s for s in sources if s not in seen]
            if pending:
                stack.extend(pending)
                continue
            seen.add(name)
            stack.pop()
            op = op_def_registry.get(nodes[name].op)
            if name in roots or nodes[name].op == "Const" or (
                    sources and nodes[name].op != "Placeholder" and op is not None and not op.is_stateful
                    and all(s in free for s in sources)):
                free.add(name)
    return free


def prune(graph_def, output_tensors, keep=()):
    """Drops nodes that neither the outputs nor the `keep` nodes depend on."""
    needed = reachable_nodes(graph_def, list(output_tensors) + list(keep))
    out = graph_pb2.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    out.node.extend(n for n in graph_def.node if n.name in needed)
    return drop_stale_colocations(out)


def drop_stale_colocations(graph_def):
    """Drops colocation constraints (`_class: loc:@node`) on nodes the graph no longer
    has (a table placeholder a pass replaced, which tf.nn.embedding_lookup(max_norm=...)
    colocates its clipping with): importing would fail on them. In place; returns graph_def."""
    names = {n.name for n in graph_def.node}
    for node in graph_def.node:
        if "_class" not in node.attr:
            continue
        groups = node.attr["_class"].list.s
        kept = [g for g in groups if not g.startswith(b"loc:@") or g[len(b"loc:@"):].decode() in names]
        if len(kept) == len(groups):
            continue
        if kept:
            del groups[:]
            groups.extend(kept)
        else:
            del node.attr["_class"]
    return graph_def


def unique_name(graph_def_or_names, base):
    names = graph_def_or_names if isinstance(graph_def_or_names, set) else {n.name for n in graph_def_or_names.node}
    if base not in names:
        return base
    i = 1
    while f"{base}_{i}" in names:
        i += 1
    return f"{base}_{i}"


def split_off(graph_def, tensors):
    """(the part of graph_def computing `tensors`, the outputs of its nodes other than
    placeholders that the rest of graph_def consumes): running that part first and
    feeding these outputs to the whole graph computes it only once."""
    needed = reachable_nodes(graph_def, tensors)
    part = graph_pb2.GraphDef()
    part.versions.CopyFrom(graph_def.versions)
    part.library.CopyFrom(graph_def.library)
    part.node.extend(n for n in graph_def.node if n.name in needed)
    computed = {n.name for n in part.node if n.op != "Placeholder"}
    consumed = sorted({canonical(i) for n in graph_def.node for i in n.input
                       if split_tensor_name(i)[1] >= 0 and split_tensor_name(i)[0] in computed} - set(tensors))
    return drop_stale_colocations(part), consumed
