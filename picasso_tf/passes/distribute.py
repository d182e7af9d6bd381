"""Distribute (paper §III-A, Fig. 6): under Horovod with more than one rank, row-shard
the packed groups across the ranks and have the fused lookups read the rows that each
step fetches from their owners.

A group is sharded when only fused lookups read its tables (nothing reads a table
whole), it trains, and it is not small (config.replicate_tables_below). For such a
group the pass
  - sets its storage kind to "sharded" (picasso_tf.embedding.sharded: rank r holds the
    rows id % size == r of every member table);
  - replaces, in every fused lookup reading it, its table inputs by one FetchedRows
    placeholder (the rows this step's batch needs, fetched from their owners) and
    each site's ids by an ExchangedIds placeholder (their positions in those rows),
    and marks the op `exchanged`: its ids then index the fetched rows. A site's
    vocabulary becomes the group's row count, a bound on the rows fetched;
  - keeps the original ids in the graph: the runtime computes them first, runs the
    exchange (picasso_tf.distributed.exchange) and then the rest of the graph.
Every other table stays whole on every rank (replicated): its gradient joins the dense
Allreduce. The report names those tables and why.
"""
import dataclasses

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from picasso_tf.distributed.world import current_world
from picasso_tf.errors import UnsupportedModelError
from picasso_tf.graph.graph_def_util import (GraphIndex, canonical, drop_stale_colocations, split_tensor_name,
                                             unique_name)
from picasso_tf.program import ExchangedIds, FetchedRows, StorageRef

FUSED_LOOKUPS = ("PicassoPackedLookup", "PicassoStitchedLookup", "PicassoStitchedProjection")


def distribute(program, graph, config):
    world = current_world()
    if not world.distributed:
        return program, {"changed": False, "why": "single process: nothing to distribute"}
    if config.micro_batches != 1:
        raise UnsupportedModelError(
            f"picasso_tf: micro_batches={config.micro_batches!r} with hybrid parallelism over {world.size} ranks is "
            "not built yet (each micro-batch would need its own exchange); use micro_batches=1 under Horovod")
    captured = program.graphs[graph]
    index = GraphIndex(captured.graph_def)
    reads = _table_reads(captured, index)            # group -> ReadTables node
    sharded, replicated = {}, {}
    for layout in program.tables or ():
        why = _why_replicated(layout, reads.get(layout.name), index, config.replicate_tables_below)
        if why:
            replicated[layout.name] = why
        else:
            sharded[layout.name] = layout
    if not sharded:
        return program, {"changed": False, "ranks": world.size, "replicated": replicated}

    graph_def = graph_pb2.GraphDef()
    graph_def.CopyFrom(captured.graph_def)
    nodes = {n.name: n for n in graph_def.node}
    captures = {k: v for k, v in captured.captures.items()
                if not (isinstance(v, StorageRef) and v.group in sharded)}
    rows = {}
    for name, layout in sharded.items():
        rows[name] = _placeholder(graph_def, f"picasso/exchange/{name}/rows", layout.dtype, [None, layout.dim])
        captures[rows[name]] = FetchedRows(name)
    member_of = {f"{reads[g]}:{m}": (g, m) for g in sharded for m in range(len(sharded[g].members))}
    exchanged_ops = 0
    for node in [n for n in graph_def.node if n.op in FUSED_LOOKUPS]:
        num_tables, table_index = node.attr["G"].i, list(node.attr["table_index"].list.i)
        tables = [canonical(node.input[t]) for t in range(num_tables)]
        if not any(t in member_of for t in tables):
            continue
        vocab = node.attr["vocab_sizes"].list.i
        names = [f.decode() for f in node.attr["feature_names"].list.s]
        for i, t in enumerate(table_index):
            if tables[t] not in member_of:
                continue            # a replicated table: its ids and rows stay as they are
            group, member = member_of[tables[t]]
            ids = canonical(node.input[num_tables + i])
            placeholder = _placeholder(graph_def, f"picasso/exchange/{group}/ids", node.attr["Tid"].type, None)
            captures[placeholder] = ExchangedIds(group, member, ids, names[i])
            node.input[num_tables + i] = placeholder
            vocab[i] = sharded[group].num_rows
        for t in range(num_tables):
            if tables[t] in member_of:
                node.input[t] = rows[member_of[tables[t]][0]]
        node.attr["exchanged"].b = True
        exchanged_ops += 1
    unused = {reads[g] for g in sharded} | {split_tensor_name(k)[0] for k, v in captured.captures.items()
                                            if isinstance(v, StorageRef) and v.group in sharded}
    kept = graph_pb2.GraphDef()
    kept.versions.CopyFrom(graph_def.versions)
    kept.library.CopyFrom(graph_def.library)
    kept.node.extend(n for n in graph_def.node if n.name not in unused)
    tables = [dataclasses.replace(t, kind="sharded") if t.name in sharded else t for t in program.tables]
    rewritten = dataclasses.replace(captured, graph_def=drop_stale_colocations(kept), captures=captures)
    program = dataclasses.replace(program, graphs={**program.graphs, graph: rewritten}, tables=tables)
    return program, {"changed": True, "ranks": world.size, "sharded": sorted(sharded),
                     "exchanged_ops": exchanged_ops, "replicated": replicated}


def _table_reads(captured, index):
    """group name -> the PicassoReadTables node reading its storage."""
    reads = {}
    for placeholder, value in captured.captures.items():
        if isinstance(value, StorageRef):
            for consumer, _ in index.uses(placeholder):
                if consumer.op == "PicassoReadTables":
                    reads[value.group] = consumer.name
    return reads


def _why_replicated(layout, read, index, replicate_below):
    """Why a group stays whole on every rank; None when it can be sharded."""
    size = layout.num_rows * layout.dim * layout.dtype.size
    if size < replicate_below:
        return f"{size} bytes, below replicate_tables_below={replicate_below}: cheaper summed whole than exchanged"
    if not layout.trainable:
        return "frozen (trainable=False): never updated, read locally"
    if layout.densely_read:
        return "read whole by the model (its gradient is dense)"
    if layout.dtype != tf.float32:
        return f"{layout.dtype.name} tables are exchanged only as float32"
    if read is None:
        return "not read by a fused lookup"
    for consumer, position in index.node_uses(read):
        if consumer.op not in FUSED_LOOKUPS or position >= consumer.attr["G"].i:
            return f"read by {consumer.op} {consumer.name}, which only a whole table serves"
    return None


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
