"""D-packing (paper §III-B): group embedding tables of the same dimension and dtype.

Each group becomes one packed table, its member tables stacked at row offsets. Groups
whose parameter volume (Eq. 1, CalcVParam) is above the average are split evenly into
shards, as many as their volume is multiple of the lightest group's (at most
max_shards): with uniform ids, dim-8 tables stay one group while dim-32 tables become
four shards.
"""
import collections

from picasso_tf.passes.plan import PackedGroup, TableSlot


def d_packing(state, config):
    if state.plan.groups is None:      # planned once, on the first (training) graph
        state.plan.groups = plan_groups(state.analysis, state.plan.accesses,
                                        config.max_shards if config.shard_heavy_groups else 1)
    groups = state.plan.groups
    return state, {"groups": len(groups), "tables": sum(len(g.slots) for g in groups),
                   "statistics": state.plan.statistics_source, "plan": state.plan.describe()}


def plan_groups(analysis, accesses, max_shards=4):
    # Tables read densely too (e.g. by a regularizer) get dense gradients: they pack
    # only with each other, so the other tables keep row-sparse updates.
    by_key = collections.OrderedDict()
    for site in analysis.sites:
        variable = analysis.tables[site.table]
        key = (site.dim, site.dtype, analysis.densely_read(variable))
        by_key.setdefault(key, collections.OrderedDict()).setdefault(variable.ref(), variable)
    groups = []
    for (dim, dtype, dense), members in by_key.items():
        tables = list(members.values())
        slots = [TableSlot(v, 0, int(v.shape[0]), accesses.get(_name(v), 1.0)) for v in tables]
        groups.append((dim, dtype, dense, slots))
    volumes = [dim * sum(s.accesses for s in slots) for dim, _, _, slots in groups]
    mean = sum(volumes) / len(volumes) if volumes else 0.0
    lightest = min(volumes) if volumes else 0.0
    packed = []
    for (dim, dtype, dense, slots), volume in zip(groups, volumes):
        shards = 1
        if volume > mean and lightest > 0:
            shards = max(1, min(len(slots), max_shards, round(volume / lightest)))
        for i, shard in enumerate(_balanced_split(slots, dim, shards)):
            name = f"packed_{dtype.name}_d{dim}" + ("_dense" if dense else "") + (f"_s{i}" if shards > 1 else "")
            packed.append(PackedGroup(name=name, dim=dim, dtype=dtype, slots=_with_offsets(shard),
                                      densely_read=dense))
    return packed


def _balanced_split(slots, dim, shards):
    """Greedy: heaviest table first into the lightest shard; shard order follows the
    first table's original position so the plan is deterministic and readable."""
    bins = [[] for _ in range(shards)]
    loads = [0.0] * shards
    for slot in sorted(slots, key=lambda s: -s.accesses * dim):
        i = loads.index(min(loads))
        bins[i].append(slot)
        loads[i] += slot.accesses * dim
    order = {id(s): n for n, s in enumerate(slots)}
    return [sorted(b, key=lambda s: order[id(s)]) for b in bins if b]


def _with_offsets(slots):
    offset, placed = 0, []
    for s in slots:
        placed.append(TableSlot(s.variable, offset, s.rows, s.accesses))
        offset += s.rows
    return placed


def _name(variable):
    return variable.name.split(":")[0]
