"""Distribute (paper §III-A, Fig. 6): under Horovod with more than one rank, row-shard
the packed groups across the ranks and have the fused lookups read the rows that each
step fetches from their owners.

A group is sharded when only fused lookups read its tables (nothing reads a table
whole), it trains, and it is not small (config.replicate_tables_below): the exchange
costs each step a fixed amount of CPU. Once a step exchanges rows anyway, a small group
joins the exchange too where that moves fewer bytes than its gradient's share of the
Allreduce, estimated from the warm-up statistics (ids per example, the share of them
distinct, examples per batch): a wide part's width-1 tables of many rows, say, whose
dense gradient would otherwise cross the Allreduce whole every step. For such a
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
    sharded, replicated, small = {}, {}, {}
    # A hash-backed group's rows are fetched already (the hybrid_hash pass): each rank
    # holds a share of them, so that every row is updated once.
    hashed = [t.name for t in program.tables or () if t.kind in ("hybrid_hash", "sharded_hybrid_hash")]
    program = dataclasses.replace(program, tables=[
        dataclasses.replace(t, kind="sharded_hybrid_hash") if t.name in hashed else t for t in program.tables or ()])
    hashed += [t.name for t in program.tables or () if t.kind == "dynamic_vocabulary"]
    for layout in program.tables or ():
        if layout.name in hashed:
            continue
        why = why_read_in_place(layout, reads.get(layout.name), index)
        if why:
            replicated[layout.name] = why
        elif _bytes(layout) < config.replicate_tables_below:
            small[layout.name] = layout
        else:
            sharded[layout.name] = layout
    joined = {}
    for name, layout in small.items():
        exchanged = _exchanged_bytes(layout, program.statistics, world.size, config.wire_dtype)
        allreduced = 2 * (world.size - 1) / world.size * _bytes(layout)
        if (sharded or hashed) and exchanged is not None and exchanged < allreduced:
            sharded[name] = layout
            joined[name] = (f"{_bytes(layout)} bytes, below replicate_tables_below={config.replicate_tables_below}, "
                            f"but beside the exchange its rows move about {exchanged:,.0f} bytes a step against "
                            f"{allreduced:,.0f} for its gradient in the Allreduce")
        else:
            replicated[name] = (f"{_bytes(layout)} bytes, below replicate_tables_below={config.replicate_tables_below}: "
                                "cheaper summed whole than exchanged")
    if not sharded and not hashed:
        return program, {"changed": False, "ranks": world.size, "replicated": replicated}
    exchanged_ops = 0
    if sharded:
        program, exchanged_ops = fetch_rows_per_step(program, graph, sharded, reads, "sharded")
    return program, {"changed": True, "ranks": world.size, "sharded": sorted(list(sharded) + hashed),
                     "exchanged_ops": exchanged_ops, "replicated": replicated,
                     **({"joined_the_exchange": joined} if joined else {})}


def _bytes(layout):
    return layout.num_rows * layout.dim * layout.dtype.size


def _exchanged_bytes(layout, statistics, ranks, wire_dtype):
    """The bytes a rank would send for `layout` in a step's exchange (its distinct ids to
    their owners, the rows it serves, the row gradients it returns), from the warm-up
    statistics; None without them."""
    if statistics.batch_size is None:
        return None
    distinct = sum(min(m.rows, m.accesses * statistics.batch_size * statistics.distinct_ids.get(m.name, 1.0))
                   for m in layout.members)
    wire_bytes = 2 if wire_dtype == "float16" else layout.dtype.size
    return distinct * (ranks - 1) / ranks * (8 + 2 * layout.dim * wire_bytes)
