"""Same-ids stacking: tables that a model always looks up with the same ids are looked
up once, as the columns of one wider table, instead of once each.

MLR keeps a width-1 table per feature for each of its four region and four learner
parts, each part concatenating its features' rows; all eight tables of a feature are
read with that feature's ids. A fused lookup's cost is per id far more than per byte of
row, so k such tables cost about k lookups, and their rows side by side about one.

The tables are stacked where each of k concatenations (stitches) holds one table of
every stack, the stacks in the same order (StackedStitches): K-packing looks every stack
up in one lookup and regroups its columns into the k concatenations with one transpose.
Where every stack's ids are read one by one (one-hot features), that lookup reads each
id's row of each of a stack's tables (PicassoStackedLookup); where some are pooled, the
stacks are looked up in a copy of each stack's tables side by side (PicassoStackColumns,
in every forward pass) by a stitched lookup. The values are the original tables', so nothing else
changes: checkpoints, optimizer slots, regularisers and tapes see the original
variables, and each table's gradient is its columns of the stack's row-sparse gradient
(the same rows, each summed in the same order as its own lookup's).

Sites of stacked tables whose outputs are used one by one (ONN's field-aware products)
are left apart: splitting a stack's rows back into its tables' outputs, and joining
their gradients, costs more than the lookups saved (measured: benchmarks.md,
"Same-ids stacking").

A same-ids set is at least MIN_TABLES tables with the same rows, each read by exactly
one site, whose sites read the same ids the same way. Ids read one by one are always
stacked; stacks with pooled ids only where the copy of the tables, once per forward pass, costs less
than the lookups of the ids it saves (COPY_BYTES_PER_SAVED_ID, measured), and only in the
training graph: a prediction's batch may be far smaller than the training batch the
rule weighs.
"""
import collections
import dataclasses
from typing import List

MIN_TABLES = 3          # a pair per id did not pay (benchmarks.md, "MLR: eight lookups of the same ids, sized")
# Stacked only below this many bytes of tables copied per id lookup saved: DeepCTR's MLR
# broke even near 22 (benchmarks.md, "Same-ids stacking").
COPY_BYTES_PER_SAVED_ID = 16.0
ASSUMED_BATCH = 256     # examples per batch when no warm-up data gave the batch size


@dataclasses.dataclass
class Stack:
    """Tables of one group looked up at the same ids: member i is read by sites[i]."""
    group: str
    members: list
    sites: list

    @property
    def width(self):
        return sum(site.dim for site in self.sites)


def why_not_stack(config, distributed, training=True):
    """Why tables read with the same ids are not stacked under `config` (same_ids_stacking
    on) in the training graph (`training`) or the inference graph, or None."""
    if not training:
        # The cost rule weighs the copy against a training batch's lookups and their gradients;
        # a prediction's batch may be far smaller, and has no gradient to save.
        return "inference: the copy is weighed against a training step's lookups and gradients only"
    if config.hybrid_hash or config.dynamic_vocabulary:
        return "hybrid_hash and dynamic_vocabulary fetch a group's rows from their own storage"
    if not config.stitching:
        return "stitching=False: a stack is looked up into the concatenations that stitching writes"
    if config.micro_batches != 1:
        return "micro_batches: each micro-batch's forward pass would copy the tables again"
    if distributed:
        return "on several ranks a group's rows may be exchanged, which reads them table by table"
    return None


def reads_one_by_one(site):
    """Whether a site's ids are each read as a row of its output (no pooling, no weights):
    stacks of only such sites are looked up without copying their tables."""
    return site.combiner == "none" and not site.segment_ids and not site.weights


def same_ids_sets(sites, tables):
    """[(variable, site)] lists of at least MIN_TABLES tables of the same rows, each read
    by exactly one of `sites`, whose sites read the same ids the same way. tables: a
    site's table placeholder -> its variable."""
    sites_of = collections.defaultdict(list)
    for site in sites:
        sites_of[tables[site.table].ref()].append(site)
    by_reading = collections.defaultdict(list)
    for ref, read in sites_of.items():
        if len(read) == 1:
            variable = ref.deref()
            by_reading[(int(variable.shape[0]), _reading(read[0]))].append((variable, read[0]))
    return [pairs for pairs in by_reading.values() if len(pairs) >= MIN_TABLES]


@dataclasses.dataclass
class StackedStitches:
    """Concatenations (stitches) each of one table of every stack, the stacks in the same
    order in each: one stitched lookup of the stacks gives them all, its columns regrouped.
    Member i of every stack is read by a site of stitches[i]. in_place: every site reads
    its ids one by one, so the lookup reads the tables themselves, else a copy of each
    stack's tables side by side."""
    stitches: list
    stacks: List[Stack]
    in_place: bool


def find_stacked_stitches(stitches, sets, table_of, accesses, batch_size):
    """(the StackedStitches that pay, a report entry per same-ids set left apart).

    stitches: find_stitches' (those with a projection stay as they are); sets:
    same_ids_sets(...); table_of(variable): its (TableLayout, TableMember); accesses: ids
    per example per table name; batch_size: examples per batch, or None."""
    set_of = {id(site): n for n, pairs in enumerate(sets) for _, site in pairs}
    families = collections.defaultdict(list)
    for stitch in stitches:
        order = tuple(set_of.get(id(part.site)) for part in stitch.parts)
        # One layout for the whole family: every part the same columns (its rows of one dim).
        inner = {part.inner for part in stitch.parts}
        if stitch.projection is None and None not in order and len(set(order)) == len(order) and len(inner) == 1:
            families[order, inner.pop()].append(stitch)
    found, stacked, apart = [], set(), []
    batch = batch_size or ASSUMED_BATCH
    for (order, _), family in families.items():
        if any(len(sets[n]) != len(family) for n in order):
            continue    # a table of a set is read elsewhere than these concatenations
        stacks = []
        site_at = {id(part.site): i for i, stitch in enumerate(family) for part in stitch.parts}
        for n in order:
            pairs = sorted(sets[n], key=lambda pair: site_at[id(pair[1])])
            placed = [table_of(variable) for variable, _ in pairs]
            stacks.append((placed, [site for _, site in pairs]))
        in_place = all(reads_one_by_one(site) for _, sites in stacks for site in sites)
        copied = 0 if in_place else sum(member.rows * site.dim * site.dtype.size
                                        for placed, sites in stacks for (_, member), site in zip(placed, sites))
        saved_ids = sum((len(sites) - 1) * accesses.get(placed[0][1].name, 1.0) * batch for placed, sites in stacks)
        if copied > COPY_BYTES_PER_SAVED_ID * saved_ids:
            apart.append({"tables": [m.name for placed, _ in stacks for _, m in placed], "reason": (
                f"copying their {copied:,} bytes each forward pass costs more than the lookups of the "
                f"{saved_ids:,.0f} ids a step it would save")})
        elif any(len({layout.name for layout, _ in placed}) > 1 for placed, _ in stacks):
            apart.append({"tables": [m.name for placed, _ in stacks for _, m in placed],
                          "reason": "packed into different groups"})
        else:
            found.append(StackedStitches(family, [Stack(placed[0][0].name, [m for _, m in placed], sites)
                                                  for placed, sites in stacks], in_place))
        stacked.update(order)
    for n, pairs in enumerate(sets):
        if n not in stacked:
            apart.append({"tables": [table_of(v)[1].name for v, _ in pairs], "reason": (
                "not concatenated one table per concatenation, the same way in each: only tables read so are "
                "stacked (their rows split apart again would cost more than the lookups saved)")})
    return found, apart


def _reading(site):
    """What makes two sites read the same rows the same way, whatever their table."""
    return (site.pattern, site.ids, site.combiner, site.segment_ids, site.num_segments, site.weights,
            site.dim, site.dtype)


