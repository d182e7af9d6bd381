"""D-packing (paper §III-B): group embedding tables of the same dimension and dtype.

Each group's tables are read by one fused kernel (K-packing) as a list, in place. Groups
whose parameter volume (Eq. 1, CalcVParam) is above the average are split evenly into
shards, as many as their volume is multiple of the lightest group's (at most
max_shards): with uniform ids, dim-8 tables stay one group while dim-32 tables become
four shards. Tables read with the same ids, which K-packing may look up as one
(same_ids_stacking.py), stay in one shard.
"""
import collections

import dataclasses

from picasso_tf.distributed.world import current_world
from picasso_tf.passes.dynamic_vocabulary import raw_keyed_tables
from picasso_tf.passes.k_packing import site_feature_names
from picasso_tf.passes.same_ids_stacking import same_ids_sets, why_not_stack
from picasso_tf.program import TableLayout, TableMember


def d_packing(program, graph, config):
    if program.tables is None:      # planned once, on the first (training) graph
        raw_keyed = frozenset()
        if config.dynamic_vocabulary:
            captured, analysis = program.graphs[graph], program.analyses[graph]
            chosen = None if config.dynamic_vocabulary is True else set(config.dynamic_vocabulary)
            raw_keyed = raw_keyed_tables(captured, analysis, site_feature_names(captured, analysis), chosen)
        analysis = program.analyses[graph]
        stacking = config.same_ids_stacking and not why_not_stack(config, current_world().distributed)
        together = [] if not stacking else [
            [variable for variable, _ in pairs] for pairs in same_ids_sets(analysis.sites, analysis.tables)]
        program = dataclasses.replace(program, tables=plan_groups(
            analysis, program.statistics.accesses,
            config.max_shards if config.shard_heavy_groups else 1, program.frozen, raw_keyed, together))
    return program, {"groups": len(program.tables), "tables": sum(len(t.members) for t in program.tables),
                     "statistics": program.statistics.source, "plan": program.describe_tables()}


def plan_groups(analysis, accesses, max_shards=4, frozen=frozenset(), raw_keyed=frozenset(), together=()):
    # Tables read densely too (e.g. by a regularizer) get dense gradients: they pack
    # only with each other, so the other tables keep row-sparse updates. Frozen tables
    # (not among the model's trainable variables) pack only with each other too, and
    # their group never trains. Tables a dynamic vocabulary may key by raw id
    # (`raw_keyed`) pack only with each other, so that the others do not hold them back.
    # Each list of tables in `together` stays in one shard.
    by_key = collections.OrderedDict()
    for site in analysis.sites:
        variable = analysis.tables[site.table]
        key = (site.dim, site.dtype, analysis.densely_read(variable), _name(variable) not in frozen,
               _name(variable) in raw_keyed)
        by_key.setdefault(key, collections.OrderedDict()).setdefault(variable.ref(), variable)
    groups = []
    for (dim, dtype, dense, trainable, raw), tables in by_key.items():
        members = [TableMember(v, int(v.shape[0]), accesses.get(_name(v), 1.0)) for v in tables.values()]
        suffix = ("_dense" if dense else "") + ("" if trainable else "_frozen") + ("_raw" if raw else "")
        groups.append((dim, dtype, dense, trainable, suffix, members))
    volumes = [dim * sum(s.accesses for s in members) for dim, _, _, _, _, members in groups]
    mean = sum(volumes) / len(volumes) if volumes else 0.0
    lightest = min(volumes) if volumes else 0.0
    packed = []
    for (dim, dtype, dense, trainable, suffix, members), volume in zip(groups, volumes):
        shards = 1
        if volume > mean and lightest > 0:
            shards = max(1, min(len(members), max_shards, round(volume / lightest)))
        for i, shard in enumerate(_balanced_split(members, dim, shards, together)):
            name = f"packed_{dtype.name}_d{dim}{suffix}" + (f"_s{i}" if shards > 1 else "")
            packed.append(TableLayout(name=name, dim=dim, dtype=dtype, members=shard,
                                      densely_read=dense, trainable=trainable))
    return packed


def _balanced_split(members, dim, shards, together=()):
    """Greedy: heaviest unit (a table, or a list of `together`) first into the lightest
    shard; shard order follows the first table's original position so the plan is
    deterministic and readable."""
    unit_of = {v.ref(): n for n, variables in enumerate(together) for v in variables}
    units = collections.OrderedDict()
    for member in members:
        units.setdefault(unit_of.get(member.variable.ref(), ("table", id(member))), []).append(member)
    bins = [[] for _ in range(shards)]
    loads = [0.0] * shards
    for unit in sorted(units.values(), key=lambda u: -sum(s.accesses for s in u) * dim):
        i = loads.index(min(loads))
        bins[i].extend(unit)
        loads[i] += sum(s.accesses for s in unit) * dim
    order = {id(s): n for n, s in enumerate(members)}
    return [sorted(b, key=lambda s: order[id(s)]) for b in bins if b]


def _name(variable):
    return variable.name.split(":")[0]
