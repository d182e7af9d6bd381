"""The rewrite shared by the storage kinds whose tables the fused lookups do not read in
place (hybrid_hash, distribute): each step, the runtime fetches the rows the batch looks
up, and the lookups read those.

For each such group, in every fused lookup reading it, its table inputs become one
FetchedRows placeholder (the step's rows of the group) and each site's ids an
ExchangedIds placeholder (their positions in those rows); the op is marked `exchanged`:
its ids then index the fetched rows, and a site's vocabulary becomes the group's row
count, a bound on the rows fetched. The original ids stay in the graph: the runtime
computes them first, fetches the rows (picasso_tf.runtime.step.RewrittenForward), and
then runs the rest of the graph. The group's ReadTables node and StorageRef
placeholders go.
"""
import dataclasses

import tensorflow as tf

from picasso_tf.errors import UnsupportedModelError
from tensorflow.core.framework import graph_pb2

from picasso_tf.graph.graph_def_util import canonical, drop_stale_colocations, split_tensor_name, unique_name
from picasso_tf.program import ExchangedIds, FetchedRows, StorageRef

FUSED_LOOKUPS = ("PicassoPackedLookup", "PicassoStitchedLookup", "PicassoStitchedProjection")


def check_hash_storage_options(config, option):
    """Refuses by name the options a hash-backed storage (chosen by `option`) cannot serve."""
    if config.micro_batches != 1:
        raise UnsupportedModelError(
            f"picasso_tf: {option} with micro_batches={config.micro_batches!r} is not built yet (each "
            f"micro-batch would fetch and update its rows apart); use micro_batches=1 with {option}")
    if not config.fused_optimizer:
        raise UnsupportedModelError(
            f"picasso_tf: {option} needs fused_optimizer=True: its hash tables are updated by the fused "
            "row-sparse optimizers, not by the Keras optimizer")


def table_reads(captured, index):
    """group name -> the PicassoReadTables node reading its storage."""
    reads = {}
    for placeholder, value in captured.captures.items():
        if isinstance(value, StorageRef):
            for consumer, _ in index.uses(placeholder):
                if consumer.op == "PicassoReadTables":
                    reads[value.group] = consumer.name
    return reads


def why_read_in_place(layout, read, index):
    """Why a group's tables must stay whole for the kernels to read; None when its rows
    can be fetched per step instead."""
    if not layout.trainable:
        return "frozen (trainable=False): never updated, read in place"
    if layout.densely_read:
        return "read whole by the model (its gradient is dense)"
    if layout.dtype != tf.float32:
        return f"{layout.dtype.name} tables: fetched rows are float32 only"
    constrained = [m.name for m in layout.members if m.variable.constraint is not None]
    if constrained:
        return f"{', '.join(constrained)} has a constraint, which Keras applies to the whole table"
    if read is None:
        return "not read by a fused lookup"
    for consumer, position in index.node_uses(read):
        if consumer.op not in FUSED_LOOKUPS or position >= consumer.attr["G"].i:
            return f"read by {consumer.op} {consumer.name}, which only a whole table serves"
    return None


def in_place_sites(graph_def, exchanged):
    """[(ids tensor, feature, rows)] of the fused lookups' sites that read their table in
    place: those whose ids are not among `exchanged` (ExchangedIds placeholders), with
    the bound their kernel checks the ids against."""
    sites = []
    for node in graph_def.node:
        if node.op in FUSED_LOOKUPS:
            ids = [canonical(i) for i in node.input[node.attr["G"].i:][:len(node.attr["table_index"].list.i)]]
            names, vocab = node.attr["feature_names"].list.s, node.attr["vocab_sizes"].list.i
            sites += [(t, name.decode(), rows) for t, name, rows in zip(ids, names, vocab) if t not in exchanged]
    return sites


def fetch_rows_per_step(program, graph, groups, reads, kind, positions_bound=None):
    """`program` with graph `graph` rewritten so that the groups `groups` (name ->
    TableLayout, each read by the ReadTables node `reads[name]`) are fetched per step,
    and their layouts' storage kind `kind`; and the number of fused lookups rewritten.
    A site's positions are checked against `positions_bound` (None: its group's rows,
    which a fetch keyed by row id never exceeds) and the rows fetched."""
    captured = program.graphs[graph]
    graph_def = graph_pb2.GraphDef()
    graph_def.CopyFrom(captured.graph_def)
    captures = {k: v for k, v in captured.captures.items()
                if not (isinstance(v, StorageRef) and v.group in groups)}
    rows = {}
    for name, layout in groups.items():
        rows[name] = _placeholder(graph_def, f"picasso/fetched/{name}/rows", layout.dtype, [None, layout.dim])
        captures[rows[name]] = FetchedRows(name)
    member_of = {f"{reads[g]}:{m}": (g, m) for g in groups for m in range(len(groups[g].members))}
    rewritten = 0
    for node in [n for n in graph_def.node if n.op in FUSED_LOOKUPS]:
        num_tables, table_index = node.attr["G"].i, list(node.attr["table_index"].list.i)
        tables = [canonical(node.input[t]) for t in range(num_tables)]
        if not any(t in member_of for t in tables):
            continue
        vocab = node.attr["vocab_sizes"].list.i
        names = [f.decode() for f in node.attr["feature_names"].list.s]
        for i, t in enumerate(table_index):
            if tables[t] not in member_of:
                continue            # a table read in place: its ids and rows stay as they are
            group, member = member_of[tables[t]]
            ids = canonical(node.input[num_tables + i])
            placeholder = _placeholder(graph_def, f"picasso/fetched/{group}/ids", node.attr["Tid"].type, None)
            captures[placeholder] = ExchangedIds(group, member, ids, names[i])
            node.input[num_tables + i] = placeholder
            vocab[i] = positions_bound or groups[group].num_rows
        for t in range(num_tables):
            if tables[t] in member_of:
                node.input[t] = rows[member_of[tables[t]][0]]
        node.attr["exchanged"].b = True
        rewritten += 1
    unused = {reads[g] for g in groups} | {split_tensor_name(k)[0] for k, v in captured.captures.items()
                                           if isinstance(v, StorageRef) and v.group in groups}
    kept = graph_pb2.GraphDef()
    kept.versions.CopyFrom(graph_def.versions)
    kept.library.CopyFrom(graph_def.library)
    kept.node.extend(n for n in graph_def.node if n.name not in unused)
    tables = [dataclasses.replace(t, kind=kind) if t.name in groups else t for t in program.tables]
    graph_rewritten = dataclasses.replace(captured, graph_def=drop_stale_colocations(kept), captures=captures)
    return dataclasses.replace(program, graphs={**program.graphs, graph: graph_rewritten}, tables=tables), rewritten


def _placeholder(graph_def, base, dtype, shape):
    """Adds a Placeholder node named after `base` (made unique); returns its tensor name."""
    name = unique_name(graph_def, base)
    node = graph_def.node.add()
    node.name, node.op = name, "Placeholder"
    node.attr["dtype"].type = dtype.as_datatype_enum if isinstance(dtype, tf.DType) else dtype
    if shape is not None:
        node.attr["shape"].shape.CopyFrom(tf.TensorShape(shape).as_proto())
    else:
        node.attr["shape"].shape.unknown_rank = True
    return f"{name}:0"
