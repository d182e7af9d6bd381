"""Distribute (paper §III-A, Fig. 6): under Horovod with more than one rank, row-shard
the packed groups across the ranks and have the fused lookups read the rows that each
step fetches from their owners.

A group is sharded when only fused lookups read its tables (nothing reads a table
whole), it trains, and it is not small (config.replicate_tables_below). For such a
group the pass
  - sets its storage kind to "sharded" (picasso_tf.embedding.sharded: rank r holds a
    contiguous block of ceil(rows / size) rows of every member table);
  - has the fused lookups read the rows each step fetches (picasso_tf.passes.fetched_rows),
    which the exchange (picasso_tf.distributed.exchange) brings from their owners.
Every other table stays whole on every rank (replicated): its gradient joins the dense
Allreduce. The report names those tables and why. Hash-backed groups (hybrid_hash=True)
are always sharded: kind "sharded_hybrid_hash"; so are dynamic vocabularies, whose
storage spreads their keys over the ranks itself (picasso_tf.embedding.dynamic_vocabulary).
"""
import dataclasses

from picasso_tf.distributed.world import current_world
from picasso_tf.graph.graph_def_util import GraphIndex
from picasso_tf.passes.fetched_rows import fetch_rows_per_step, table_reads, why_read_in_place


def distribute(program, graph, config):
    world = current_world()
    if not world.distributed:
        return program, {"changed": False, "why": "single process: nothing to distribute"}
    captured = program.graphs[graph]
    index = GraphIndex(captured.graph_def)
    reads = table_reads(captured, index)            # group -> ReadTables node
    sharded, replicated = {}, {}
    # A hash-backed group's rows are fetched already (the hybrid_hash pass): each rank
    # holds a share of them, so that every row is updated once.
    hashed = [t.name for t in program.tables or () if t.kind in ("hybrid_hash", "sharded_hybrid_hash")]
    program = dataclasses.replace(program, tables=[
        dataclasses.replace(t, kind="sharded_hybrid_hash") if t.name in hashed else t for t in program.tables or ()])
    hashed += [t.name for t in program.tables or () if t.kind == "dynamic_vocabulary"]
    for layout in program.tables or ():
        if layout.name in hashed:
            continue
        why = _why_replicated(layout, reads.get(layout.name), index, config.replicate_tables_below)
        if why:
            replicated[layout.name] = why
        else:
            sharded[layout.name] = layout
    if not sharded and not hashed:
        return program, {"changed": False, "ranks": world.size, "replicated": replicated}
    exchanged_ops = 0
    if sharded:
        program, exchanged_ops = fetch_rows_per_step(program, graph, sharded, reads, "sharded")
    return program, {"changed": True, "ranks": world.size, "sharded": sorted(list(sharded) + hashed),
                     "exchanged_ops": exchanged_ops, "replicated": replicated}


def _why_replicated(layout, read, index, replicate_below):
    """Why a group stays whole on every rank; None when it can be sharded."""
    size = layout.num_rows * layout.dim * layout.dtype.size
    if size < replicate_below:
        return f"{size} bytes, below replicate_tables_below={replicate_below}: cheaper summed whole than exchanged"
    return why_read_in_place(layout, read, index)
