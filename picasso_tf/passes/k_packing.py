"""K-packing (paper §III-B): replace each packed group's per-feature op chains by one
fused lookup kernel reading the group's storage. Sites whose outputs the model
only concatenates are looked up straight into the concatenation instead, by one
stitched kernel per concatenation reading every packed table involved (stitching.py);
where the concatenation only feeds a MatMul, a kernel computes the product from the
tables' rows without building the concatenation (a stitched projection). Tables read
with the same ids and concatenated one per part are looked up once, side by side
(same_ids_stacking.py), by one stitched kernel whose columns are regrouped into the
parts' concatenations.

The new ops are built with TensorFlow's Python API in a scratch graph holding the
original GraphDef, so that attributes and shapes come from the op definitions; the
result is exported, rewired (consumers of every site's output now read the fused
output) and pruned of the replaced chains. Each table of a group is read through a
placeholder captured as a StorageRef(group, member): the pass creates no variable, the
runtime binds the group's storage.
"""
import collections
import dataclasses

import numpy as np
import tensorflow as tf

from picasso_tf.distributed.world import current_world
from picasso_tf.graph.graph_def_util import GraphIndex, canonical, split_tensor_name
from picasso_tf.ops.stitched_projection import MAX_UNITS
from picasso_tf.passes.same_ids_stacking import find_stacked_stitches, same_ids_sets, why_not_stack
from picasso_tf.passes.sequence_pooling import pool_sequences
from picasso_tf.passes.sparse_one_hot import read_one_hot_ids
from picasso_tf.passes.stitching import find_stitches
from picasso_tf.program import LookupRecord, StorageRef, TableLayout, TableMember

# Ops between a model input and the ids a site looks up that keep them that input's ids
# (hashed, gathered, made sparse, looked up in a vocabulary), each with the input that
# carries them; followed back to name a site's feature.
_ID_PASSTHROUGH = {**dict.fromkeys(("Identity", "Cast", "Reshape", "ExpandDims", "Squeeze", "StridedSlice", "Unique",
                                    "AsString", "StringToHashBucketFast", "StringToHashBucketStrong",
                                    "StringToHashBucket", "FloorMod", "GatherV2", "GatherNd"), 0),
                   "SparseFillEmptyRows": 1, "LookupTableFindV2": 1}


def _why_sparse_ids_stay_sparse(config):
    """Why no padded ids made sparse may be read as they are under `config`, or None.
    Read so, they look up other rows than the sparse form: read weighted, the positions
    it drops (weighted 0); read as the kept ids, not the id 0 it gives a row of no ids."""
    if config.lazy_optimizer:
        return ("lazy_optimizer: read as they are, the ids would touch other rows than the sparse form's "
                "(the positions it drops, weighted 0; not the id 0 it gives a row of no ids), and a lazy "
                "update moves exactly the touched rows")
    if config.dynamic_vocabulary or config.hybrid_hash:
        return ("a vocabulary or hash table would count other ids as looked up than the sparse form's (the "
                "positions it drops; not the id 0 it gives a row of no ids)")
    if current_world().distributed:
        return "on several ranks the exchange would carry other ids than the sparse form's (not done there)"
    return None


def k_packing(program, graph, config):
    captured, analysis = program.graphs[graph], program.analyses[graph]
    if not analysis.sites:
        return program, {"fused_lookups": 0, "sites": 0}
    feature_names = site_feature_names(captured, analysis)
    scratch = tf.Graph()
    edits = _Edits()
    with scratch.as_default():
        # Stitching and sequence pooling need the static shapes of the lookups and of what reads them.
        stand_ins, stand_in_nodes = captured.import_typed()
    edits.replacements.update(stand_ins)
    edits.removed |= stand_in_nodes
    sites, unpaid, one_hot_read, kept_sparse = analysis.sites, [], [], {}
    if config.sequence_pooling:
        sites, one_hot_read, kept_sparse = read_one_hot_ids(scratch, sites, program.statistics,
                                                            _why_sparse_ids_stay_sparse(config))
        kept = captured.output_tensors + captured.mask_tensors + captured.logit_tensors + (
            [captured.regularization_loss] if captured.regularization_loss else [])
        sites, shape_stand_ins, unpaid = pool_sequences(scratch, sites, [canonical(t) for t in kept])
        edits.replacements.update(shape_stand_ins)
        feature_names.update({new.output: feature_names[old.output] for old, new in zip(analysis.sites, sites)})
    if program.tables is None:          # D-packing off: fuse each table's lookups on its own
        program = dataclasses.replace(program, tables=[
            TableLayout(f"table_{i}", s.dim, s.dtype, [TableMember(analysis.tables[s.table], s.vocab_size, 1.0)],
                        densely_read=analysis.densely_read(analysis.tables[s.table]))
            for i, s in enumerate(_one_site_per_table(analysis))])
    sites_by_table = collections.defaultdict(list)
    for site in sites:
        sites_by_table[analysis.tables[site.table].ref()].append(site)

    members_of = {}
    for group in program.tables:
        members = [(member, site) for member in group.members for site in sites_by_table[member.variable.ref()]]
        if members:
            members_of[group.name] = members

    why_not = why_not_stack(config, current_world().distributed, training=graph == "training")
    with scratch.as_default():
        stitches = find_stitches(scratch, sites, lambda stitch: _projection_choice(
            stitch, program.statistics, config)[0]) if config.stitching else []
        sets = same_ids_sets(sites, analysis.tables) if config.same_ids_stacking else []
        stacked, stacks_apart = [], [{"tables": [program.table_of(v)[1].name for v, _ in pairs], "reason": why_not}
                                     for pairs in sets]
        if not why_not:
            stacked, stacks_apart = find_stacked_stitches(stitches, sets, program.table_of,
                                                          program.statistics.accesses, program.statistics.batch_size)
        regrouped = {id(stitch) for family in stacked for stitch in family.stitches}
        in_stitch = {id(site) for stitch in stitches for site in stitch.sites}
        values, member_of, fused = {}, {}, []
        for group in program.tables:
            if group.name in members_of:
                members = members_of[group.name]
                values[group.name] = _rewrite_group(scratch, group, analysis,
                                                    [(m, si) for m, si in members if id(si) not in in_stitch],
                                                    feature_names, edits)
                member_of.update({id(site): (group, member) for member, site in members})
                fused.append({"group": group.name, "sites": len(members), "tables": len(group.members)})
        for family in stacked:
            _rewrite_stacked_stitches(scratch, family, values, feature_names, edits)
        stitched = [_rewrite_stitch(scratch, stitch, values, member_of, feature_names, edits,
                                    *_projection_choice(stitch, program.statistics, config))
                    for stitch in stitches if id(stitch) not in regrouped]
        graph_def = scratch.as_graph_def()

    rewritten = captured.rewritten(graph_def, edits.replacements, edits.removed, edits.captures)
    program = dataclasses.replace(program, graphs={**program.graphs, graph: rewritten},
                                  lookups={**program.lookups, graph: edits.records})
    return program, {"fused_lookups": len(fused), "sites": sum(f["sites"] for f in fused), "groups": fused,
                     "stitched": stitched,
                     "sequences_pooled": [feature_names[s.output] for s in sites
                                          if s.pattern == "sequence" and s.output not in one_hot_read],
                     "sparse_one_hot_read_as_ids": [feature_names[s.output] for s in sites if s.output in one_hot_read],
                     "sparse_ids_kept_sparse": {feature_names[output]: why for output, why in kept_sparse.items()},
                     "sequences_not_pooled": {feature_names[s.output]: (
                         f"rows of width {s.dim}: the model's own product and sum are faster there")
                         for s in unpaid},
                     "stacked": [{"feature": feature_names[s.sites[0].output], "tables": [m.name for m in s.members],
                                  "width": s.width, "tables_copied": not family.in_place}
                                 for family in stacked for s in family.stacks],
                     "stacks_apart": stacks_apart}


@dataclasses.dataclass
class _Edits:
    """What the rewrite does to the imported graph: tensors replaced (old -> new name),
    nodes removed, new placeholders with the storage they stand for, and a record of
    each fused lookup."""
    replacements: dict = dataclasses.field(default_factory=dict)
    removed: set = dataclasses.field(default_factory=set)
    captures: dict = dataclasses.field(default_factory=dict)
    records: list = dataclasses.field(default_factory=list)


def _rewrite_group(graph, group, analysis, own, feature_names, edits):
    """Reads a group's tables from its storage; its own sites (not stitched) get one
    fused lookup, its whole-table readers the table's value. Returns {variable ref:
    the table's value}."""
    from picasso_tf.ops.read_tables import read_tables   # loads the op library on first use
    with tf.name_scope(f"picasso/{group.name}/"):
        handles = [tf.compat.v1.placeholder(tf.resource, [], name="table") for _ in group.members]
        values = dict(zip((m.variable.ref() for m in group.members), read_tables(handles, group.dtype)))
    for i, handle in enumerate(handles):
        edits.captures[canonical(handle.name)] = StorageRef(group.name, i)
    if own:
        outputs = _fused_lookup(graph, group, values, own, feature_names)
        for (_, site), out in zip(own, outputs):
            edits.replacements[site.output] = canonical(out.name)
            edits.removed.update(site.chain)
        edits.records.append(LookupRecord(outputs[0].op.name, "packed", [group.name],
                                          [feature_names[site.output] for _, site in own]))
    for member in group.members:
        for read in _dense_reads_of(analysis, member.variable):
            # Whole-table readers (a regularizer, say) read the same value as the lookups.
            edits.replacements[read] = canonical(values[member.variable.ref()].name)
            edits.removed.add(split_tensor_name(read)[0])
    return values


def _rewrite_stacked_stitches(graph, family, values, feature_names, edits):
    """Replaces the concatenations of a StackedStitches by one stitched lookup of its
    stacks (each its tables side by side), whose [rows, stack, row block, table, dim]
    layout is regrouped into [rows, table, stack, row block, dim] and split into the
    concatenations (same_ids_stacking.py)."""
    from picasso_tf.ops import stitched_lookup as stitch_ops   # loads the op library on first use
    from picasso_tf.ops.stacked_tables import stack_columns, stacked_lookup
    stacks, first = family.stacks, family.stitches[0].parts[0]
    tables, dim = len(family.stitches), first.site.dim
    blocks = first.inner // dim
    width = tables * dim
    heads = [(stack.members[0], stack.sites[0]) for stack in stacks]
    with tf.name_scope("picasso/stacked/"):
        tables_of = [[values[stack.group][m.variable.ref()] for m in stack.members] for stack in stacks]
        if family.in_place:
            out = stacked_lookup(tables_of, [graph.get_tensor_by_name(site.ids) for _, site in heads],
                                 row_blocks=blocks, vocab_sizes=[member.rows for member, _ in heads],
                                 feature_names=[feature_names[site.output] for _, site in heads])
        else:
            out = stitch_ops.stitched_lookup(
                [stack_columns(stack) for stack in tables_of], table_index=list(range(len(stacks))),
                columns=[n * blocks * width for n in range(len(stacks))], row_blocks=[blocks] * len(stacks),
                width=len(stacks) * blocks * width, **_site_args(graph, heads, first.site.dtype, feature_names))
        regrouped = tf.reshape(tf.transpose(tf.reshape(out, [-1, len(stacks), blocks, tables, dim]), [0, 3, 1, 2, 4]),
                               [-1, tables * len(stacks) * blocks * dim])
        for stitch, part in zip(family.stitches, tf.split(regrouped, tables, axis=1)):
            for concat in stitch.outputs:
                shaped = part if concat.shape == [-1, stitch.width] else tf.reshape(part, concat.shape)
                edits.replacements[concat.tensor] = canonical(shaped.name)
            edits.removed.update(concat.node for concat in stitch.outputs)
            for p in stitch.parts:
                edits.removed.update(p.chain + p.site.chain)
    edits.records.append(LookupRecord(out.op.name, "stitched", sorted({stack.group for stack in stacks}),
                                      [feature_names[stack.sites[0].output] for stack in stacks],
                                      [concat.node for stitch in family.stitches for concat in stitch.outputs]))


def _projection_choice(stitch, statistics, config):
    """(whether to replace the stitch's MatMul by a stitched projection, why not).

    A wide projection (more than MAX_UNITS units) works per distinct id of each site,
    which pays off where ids repeat within a batch; where the warm-up batches show more
    than config.projection_max_distinct of them distinct, the MatMul on the stitched
    lookup is the faster choice."""
    projected = stitch.projection
    if projected is None:
        return False, None
    if not config.projection:
        return False, "projection=False"
    if projected.units <= MAX_UNITS or not statistics.distinct_ids:
        return True, None
    # Each site weighs by the MatMul's work on it: the columns it fills.
    parts = [p for p in stitch.parts if p.site is not None]
    share = sum(p.inner * statistics.distinct_ids.get(p.site.variable_name, 1.0) for p in parts) / sum(
        p.inner for p in parts)
    if share > config.projection_max_distinct:
        return False, (f"{share:.0%} of the warm-up batches' ids are distinct (above "
                       f"projection_max_distinct={config.projection_max_distinct:.0%}): the MatMul is faster")
    return True, None


def _rewrite_stitch(graph, stitch, values, member_of, feature_names, edits, projection, why_not):
    """Replaces the concatenations of a stitch by (reshapes of) one stitched lookup, or
    the stitch's MatMul by a stitched projection; returns the report entry."""
    layout = _StitchLayout(graph, stitch, values, member_of, feature_names)
    projected = stitch.projection if projection else None
    features = [feature_names[site.output] for site in stitch.sites]
    if projected:
        out = layout.projection(projected.kernel)
        edits.replacements[projected.tensor] = canonical(out.name)
        edits.removed.add(projected.node)
        edits.records.append(LookupRecord(layout.op_name, "projection", layout.group_names, features,
                                          [projected.node]))
    else:
        out = layout.lookup()
        edits.records.append(LookupRecord(out.op.name, "stitched", layout.group_names, features,
                                          [concat.node for concat in stitch.outputs]))
        for concat in stitch.outputs:
            shaped = out
            if concat.shape != [-1, stitch.width]:
                with tf.name_scope("picasso/stitched/"):
                    shaped = tf.reshape(out, concat.shape)
            edits.replacements[concat.tensor] = canonical(shaped.name)
    edits.removed.update(concat.node for concat in stitch.outputs)
    for part in stitch.parts:
        edits.removed.update(part.chain + (part.site.chain if part.site else []))
    return {"concat": [c.node for c in stitch.outputs], "sites": len(stitch.sites), "width": stitch.width,
            "copied_inputs": len(stitch.parts) - len(stitch.sites),
            "projection": projected.node if projected else None,
            "projection_skipped": why_not}


def _one_site_per_table(analysis):
    seen, firsts = set(), []
    for site in analysis.sites:
        if site.table not in seen:
            seen.add(site.table)
            firsts.append(site)
    return firsts


def _site_args(graph, members, dtype, feature_names):
    """The per-site inputs and attributes of a lookup op over (member, site) pairs (each
    site reads its member table from row 0)."""
    t = graph.get_tensor_by_name
    # One shared empty tensor stands for "no segments" / "no weights" of every site.
    no_segments, no_weights = tf.zeros([0], tf.int64), tf.zeros([0], dtype)
    no_count = tf.constant(0, tf.int64)
    args = collections.defaultdict(list)
    for member, site in members:
        args["ids_list"].append(t(site.ids))   # the wrappers cast mixed int32/int64 ids to int64
        args["segment_ids_list"].append(
            tf.cast(t(site.segment_ids), tf.int64) if site.segment_ids else no_segments)
        args["weights_list"].append(tf.cast(t(site.weights), dtype) if site.weights else no_weights)
        # Sites pooled by row (sequence pooling) have no segment ids and count their rows.
        args["num_segments_list"].append(_num_segments(t, site) if site.segment_ids else no_count)
        args["offsets"].append(0)
        args["vocab_sizes"].append(member.rows)
        args["combiners"].append(site.combiner)
        args["feature_names"].append(feature_names[site.output])
    return args


def _fused_lookup(graph, group, values, members, feature_names):
    """PicassoPackedLookup of a group's sites on the values of the tables they read."""
    from picasso_tf.ops import packed_lookup as lookup_ops   # loads the op library on first use
    tables = _tables_read(members)
    with tf.name_scope(f"picasso/{group.name}/"):
        return lookup_ops.packed_lookup([values[ref] for ref in tables],
                                        table_index=[tables.index(m.variable.ref()) for m, _ in members],
                                        **_site_args(graph, members, group.dtype, feature_names))


def _tables_read(members):
    """The distinct member tables (variable refs) of (member, site) pairs, in order of first use."""
    return list(dict.fromkeys(m.variable.ref() for m, _ in members))


class _StitchLayout:
    """Where a stitch's parts go: its packed tables, its sites' columns and row blocks,
    and its other inputs (dense, copied in) with their columns."""

    def __init__(self, graph, stitch, values, member_of, feature_names):
        self.width = stitch.width
        groups, members, self.columns, self.row_blocks = [], [], [], []
        self.dense = []   # (tensor, first column, columns)
        column = 0
        for part in stitch.parts:
            if part.site is None:
                self.dense.append((graph.get_tensor_by_name(part.tensor), column, part.inner))
            else:
                group, member = member_of[id(part.site)]
                if group.name not in [g.name for g in groups]:
                    groups.append(group)
                members.append((member, part.site))
                self.columns.append(column)
                self.row_blocks.append(part.inner // part.site.dim)
            column += part.inner
        self.graph = graph
        self.group_names = [g.name for g in groups]
        self.op_name = None   # the projection op's, once built
        tables = _tables_read(members)
        self.table_index = [tables.index(m.variable.ref()) for m, _ in members]
        table_values = {ref: value for g in groups for ref, value in values[g.name].items()}
        self.tables = [table_values[ref] for ref in tables]
        self.site_args = _site_args(graph, members, groups[0].dtype, feature_names)

    def lookup(self):
        """PicassoStitchedLookup: the [rows, width] concatenation."""
        from picasso_tf.ops import stitched_lookup as stitch_ops
        with tf.name_scope("picasso/stitched/"):
            return stitch_ops.stitched_lookup(
                self.tables, dense_list=[d for d, _, _ in self.dense], table_index=self.table_index,
                columns=self.columns, row_blocks=self.row_blocks,
                dense_columns=[c for _, c, _ in self.dense], width=self.width, **self.site_args)

    def projection(self, kernel_name):
        """The concatenation times the kernel: PicassoStitchedProjection of the sites,
        plus the product of the other inputs with their rows of the kernel."""
        from picasso_tf.ops import stitched_projection as projection_ops
        kernel = self.graph.get_tensor_by_name(kernel_name)
        args = {k: v for k, v in self.site_args.items() if k != "weights_list"}
        with tf.name_scope("picasso/projected/"):
            out = projection_ops.stitched_projection(
                self.tables, kernel=kernel, table_index=self.table_index, columns=self.columns,
                row_blocks=self.row_blocks, width=self.width, **args)
            self.op_name = out.op.name
            if len(self.dense) == 1:
                [(tensor, column, inner)] = self.dense
                return out + tf.matmul(tf.reshape(tensor, [-1, inner]), kernel[column:column + inner])
            if self.dense:
                # One product for all the other inputs (a model may concatenate hundreds of
                # them: CAN's co-action outputs), with their rows of the kernel gathered,
                # rather than a product per input and a kernel-sized gradient for each.
                inputs = tf.concat([tf.reshape(t, [-1, inner]) for t, _, inner in self.dense], axis=1)
                rows = np.concatenate([np.arange(column, column + inner) for _, column, inner in self.dense])
                out += tf.matmul(inputs, tf.gather(kernel, rows))
            return out


def _dense_reads_of(analysis, variable):
    return [read for placeholder, reads in analysis.dense_reads.items()
            if analysis.tables[placeholder] is variable for read in reads]


def _num_segments(t, site):
    if site.num_segments:
        return tf.cast(t(site.num_segments), tf.int64)
    # SegmentSum / SparseSegmentSum without a count: rows = last (largest) segment id + 1.
    segs = tf.cast(t(site.segment_ids), tf.int64)
    return tf.reduce_max(tf.concat([segs, [-1]], 0)) + 1


def site_feature_names(captured, analysis):
    """Names each site after the model input its ids come from, else after its table."""
    index = GraphIndex(captured.graph_def)
    inputs = {split_tensor_name(t)[0]: name for t, name in zip(captured.input_tensors, captured.input_names)}
    names = {}
    for site in analysis.sites:
        node = index.node(site.ids)
        while node.op in _ID_PASSTHROUGH and len(node.input) > _ID_PASSTHROUGH[node.op]:
            node = index.node(node.input[_ID_PASSTHROUGH[node.op]])
        names[site.output] = inputs.get(node.name, site.variable_name)
    return names

