"""Interleaving (paper §III-C): D-interleaving's check and K-interleaving's groups.

D-interleaving (``micro_batches=K``) runs in the training step
(picasso_tf.runtime.micro_batches); the graph is unchanged, and this pass refuses a
model whose forward pass couples a batch's samples (graph/batch_coupling.py), or under
``micro_batches="auto"`` records them, so that the step keeps such a batch whole.

K-interleaving (``interleave_groups=N``) puts the graph's fused lookups, in graph
order, into N interleaving groups of about Eq. 3's capacity, the total parameter
volume (Eq. 1, the paper's cost of a lookup) over N (its "proportionally modifying
Capacity_g"), and chains the groups with control dependencies: every lookup of group
j+1 waits for every lookup of group j, so that groups do not contend for the same
memory bandwidth (or, across ranks, network) at once. With N=1 (the default) nothing
is chained: on this 2-core CPU the groups do not pay (benchmarks/interleaving_sweep.py),
so the pass stands down unless asked. Excluded embeddings (``interleave_excluded``, the
paper's "preset excluded embedding") stay out of the chains, neither waiting nor waited
for: by default the lookups whose outputs are not concatenated with other feature
embeddings, so that their downstream ops may start as soon as they are done.
"""
import dataclasses

from picasso_tf.errors import UnsupportedModelError
from picasso_tf.graph.batch_coupling import batch_coupling_ops
from picasso_tf.graph.graph_def_util import GraphIndex

CONCATENATIONS = {"ConcatV2", "Pack"}
RESHAPES = {"Identity", "Reshape", "ExpandDims", "Squeeze"}   # the same values, another shape


def k_interleave(program, graph, config):
    report = {"micro_batches": config.micro_batches}
    if config.micro_batches != 1:
        report["interleave_from"] = config.interleave_from
        coupled = batch_coupling_ops(program.graphs[graph])
        if coupled and config.micro_batches == "auto":
            report["batch_coupling"] = coupled      # "auto" keeps such a batch whole (runtime.micro_batch_planner)
        elif coupled:
            raise UnsupportedModelError(
                f"picasso_tf: micro_batches={config.micro_batches} runs the model on micro-batches, and "
                f"{coupled[0]} ({len(coupled)} such op(s)) normalises or reduces over the batch: each micro-batch "
                "would be computed on its own, a different result from the whole batch's. Use micro_batches=1 "
                "for this model.")
    records = program.lookups.get(graph, [])
    if config.interleave_groups == 1 or len(records) < 2:
        report["why"] = (f"interleave_groups={config.interleave_groups}: no kernel interleaving groups"
                         if len(records) >= 2 else "fewer than two fused lookups: nothing to interleave")
        return program, {"changed": False, **report}
    captured = program.graphs[graph]
    excluded = excluded_lookups(captured.graph_def, records, config.interleave_excluded)
    report["excluded"] = [{"node": records[i].node, "features": records[i].features, "why": why}
                          for i, why in excluded.items()]
    chained = [r for i, r in enumerate(records) if i not in excluded]
    if len(chained) < 2:
        report["why"] = "fewer than two fused lookups left to chain once the excluded ones are out"
        return program, {"changed": False, **report}
    volumes = [sum(program.layout(g).param_volume for g in record.groups) for record in chained]
    groups = interleaving_groups(volumes, config.interleave_groups)
    graph_def = chain_groups(captured.graph_def, [[chained[i].node for i in group] for group in groups])
    program = dataclasses.replace(program, graphs={**program.graphs,
                                                   graph: dataclasses.replace(captured, graph_def=graph_def)})
    return program, {"changed": True, **report, "groups": [[chained[i].node for i in g] for g in groups],
                     "volumes": [round(sum(volumes[i] for i in g), 3) for g in groups]}


def excluded_lookups(graph_def, records, preset):
    """{index into records: why} of the fused lookups left out of the chains (the paper's
    "excluded embeddings"): with a preset, those reading a feature it names; with
    "auto", packed lookups none of whose outputs a concatenation joins with other
    feature embeddings (a wide part's sum, a co-action's weights), whose downstream
    ops would only be held back by waiting for another group. Stitched lookups and
    projections are such concatenations themselves."""
    if preset != "auto":
        named, known = set(preset), {f for r in records for f in r.features}
        if named - known:
            raise ValueError(f"picasso_tf: interleave_excluded names feature(s) {sorted(named - known)} that no "
                             f"fused lookup reads; the fused lookups read {sorted(known)}")
        return {i: f"interleave_excluded names {sorted(named & set(r.features))}"
                for i, r in enumerate(records) if named & set(r.features)}
    index = GraphIndex(graph_def)
    lookups = {r.node for r in records}

    def from_lookup(tensor):
        node = index.node(tensor)
        while node.op in RESHAPES:
            node = index.input_node(node, 0)
        return node.name in lookups

    def concatenations(node_name):
        todo, found = [use for use, _ in index.node_uses(node_name)], []
        while todo:
            node = todo.pop()
            if node.op in RESHAPES:
                todo.extend(use for use, _ in index.node_uses(node.name))
            elif node.op in CONCATENATIONS:
                found.append(node)
        return found

    return {i: "its outputs are not concatenated with other feature embeddings"
            for i, r in enumerate(records)
            if r.kind == "packed" and not any(sum(from_lookup(t) for t in c.input if not t.startswith("^")) > 1
                                              for c in concatenations(r.node))}


def interleaving_groups(volumes, n):
    """Consecutive lookups (indices into `volumes`) in at most n groups of about equal
    volume: Eq. 3 with Capacity_g = total / n. A lookup joins the group its volume's
    midpoint falls in, so a lookup larger than the capacity is a group of its own."""
    capacity = sum(volumes) / n
    groups, done = [[] for _ in range(n)], 0.0
    for i, volume in enumerate(volumes):
        groups[min(n - 1, int((done + volume / 2) / capacity))].append(i)
        done += volume
    return [g for g in groups if g]


def chain_groups(graph_def, groups):
    """A copy of graph_def where every node of groups[j + 1] has a control input on
    every node of groups[j]."""
    out = type(graph_def)()
    out.CopyFrom(graph_def)
    nodes = {n.name: n for n in out.node}
    for before, after in zip(groups, groups[1:]):
        for name in after:
            nodes[name].input.extend(f"^{b}" for b in before if f"^{b}" not in nodes[name].input)
    return out
