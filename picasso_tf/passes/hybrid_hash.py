"""HybridHash (paper §III-D): with hybrid_hash=True, the packed groups that only fused
lookups read are kept in hash-backed storage (picasso_tf.embedding.hybrid_hash), keyed
by row id and initialised from the original tables, so training is the same as with the
tables read in place. Each step fetches the rows its batch looks up from the storage
(picasso_tf.passes.fetched_rows) and the fused updates write their gradients back. Each
group's hot tier gets its share of config.hot_storage_bytes (``hot_rows``). Under
Horovod the distribute pass then shards these groups over the ranks.

Every other group stays read in place; the report names it and why.
"""
import dataclasses

from picasso_tf.embedding.hot_tier import hot_rows_of
from picasso_tf.graph.graph_def_util import GraphIndex
from picasso_tf.passes.fetched_rows import (check_hash_storage_options, fetch_rows_per_step, table_reads,
                                           why_read_in_place)

KIND = "hybrid_hash"


def hybrid_hash(program, graph, config):
    check_hash_storage_options(config, "hybrid_hash=True")
    captured = program.graphs[graph]
    index = GraphIndex(captured.graph_def)
    reads = table_reads(captured, index)
    hashed, in_place = {}, {}
    for layout in program.tables or ():
        if layout.kind not in ("tables", KIND):
            continue        # another pass chose its storage (dynamic_vocabulary)
        why = why_read_in_place(layout, reads.get(layout.name), index)
        if why:
            in_place[layout.name] = why
        else:
            hashed[layout.name] = layout
    if not hashed:
        return program, {"changed": False, "read_in_place": in_place}
    program, fetching_ops = fetch_rows_per_step(program, graph, hashed, reads, KIND)
    shares = hot_bytes(list(hashed.values()), config.hot_storage_bytes)
    hot = {name: hot_rows_of(hashed[name], share, 1) for name, share in shares.items()}
    tables = [dataclasses.replace(t, hot_rows=hot[t.name], hot_bytes=shares[t.name]) if t.name in hot else t
              for t in program.tables]
    return dataclasses.replace(program, tables=tables), {
        "changed": True, "hashed": sorted(hashed), "hot_rows": hot, "fetching_ops": fetching_ops,
        "read_in_place": in_place}


def hot_bytes(layouts, budget):
    """Each group's share of the hot tiers' `budget` bytes, in proportion to the groups'
    parameter volume (Eq. 1: the rows looked up most weigh most)."""
    volume = sum(t.param_volume for t in layouts) or 1.0
    return {t.name: int(budget * t.param_volume / volume) for t in layouts}

