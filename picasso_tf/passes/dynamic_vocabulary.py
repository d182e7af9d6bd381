"""Dynamic vocabularies (config.dynamic_vocabulary): where the model hashes raw ids into
a fixed number of bins right before an embedding lookup, the table is keyed by the raw
id instead (picasso_tf.embedding.dynamic_vocabulary): no two ids share a row, and rows
exist only for the ids seen.

This trains a different model from the user's: the report says so, and names every
feature it keys by raw id. A group of tables goes over only when every site reading
every one of its tables hashes right before the lookup, through one of
  - Keras' Hashing layer or tf.strings.to_hash_bucket* on strings: keyed by the
    string's 63-bit fingerprint (the same hash, over 2**63 - 1 bins);
  - the same on integers (Hashing turns them into strings first): keyed by the integer;
  - a modulo (tf.math.floormod, `%`) of integer ids by a constant: keyed by the integer.
Between the hash and the lookup only casts, identities and reshapes may stand. The
group's fused lookups then read the rows each step fetches (picasso_tf.passes.
fetched_rows), and each site's fetch is keyed by a copy of that chain applied to the
raw key.

Under Horovod (picasso_tf.distributed) each rank holds the keys it owns, chosen by a
fingerprint of the key mod the number of ranks, and the row exchange brings every
batch's rows from their owners in the same AllToAllv as the other groups' (the ids
travel as [table | lookups, key] pairs then, twice the bytes of the ids alone). The
owner admits, evicts and applies the updates (SGD, Adagrad) as one process would for
its keys: N ranks with 1/N of a batch each train like one process with the whole
batch. vocabulary_capacity is per rank; with it set, each training step adds one
small Allreduce in which the ranks agree whether any owner would exceed it, so that
all of them refuse the step together, before any table changes. Checkpoints carry
every rank's keys under the tables' names, gathered by save_weights (with
tf.train.Checkpoint, call model.picasso.write_back() on every rank first), and restore
into any number of ranks; model.picasso.vocabulary() gathers the whole vocabulary on
every rank (a collective). With admission_filter="bloom" each owner counts its keys in
a counting Bloom filter of its own; a checkpoint holds their sum (one process's filter)
and each rank's, so it restores on one process or on as many ranks (another number of
ranks is refused by name).
"""
import dataclasses

import tensorflow as tf

from picasso_tf.errors import UnsupportedModelError
from picasso_tf.graph.graph_def_util import GraphIndex, canonical, split_tensor_name, unique_name
from picasso_tf.passes.fetched_rows import (FUSED_LOOKUPS, check_hash_storage_options, fetch_rows_per_step,
                                           table_reads, why_read_in_place)
from picasso_tf.ops.hybrid_hash import initializer_spec
from picasso_tf.program import ExchangedIds

KIND = "dynamic_vocabulary"
STRING_HASHES = ("StringToHashBucketFast", "StringToHashBucketStrong", "StringToHashBucket")
PASS_THROUGH = ("Identity", "Cast", "Reshape", "ExpandDims", "Squeeze")
INTEGERS = (tf.int8, tf.int16, tf.int32, tf.int64, tf.uint8, tf.uint16, tf.uint32)
# A fetch's positions index at most its batch's distinct keys, whatever the table held.
POSITIONS_BOUND = 1 << 62


def dynamic_vocabulary(program, graph, config):
    check_hash_storage_options(config, "dynamic_vocabulary")
    if not config.pass_enabled("k_packing"):
        raise UnsupportedModelError(
            f"picasso_tf: dynamic_vocabulary keys the fused lookups' tables by raw id, and with "
            f"packing={config.packing}, d_packing={config.d_packing}, k_packing={config.k_packing} no lookup is "
            "fused; turn packing on")
    chosen = None if config.dynamic_vocabulary is True else set(config.dynamic_vocabulary)
    views = {name: _GraphView(program, name) for name in program.graphs}
    if chosen is not None:
        known = {f for view in views.values() for s in view.sites.values() for f, _ in s}
        if chosen - known:
            raise ValueError(f"picasso_tf: dynamic_vocabulary names {sorted(chosen - known)}, which no fused "
                             f"embedding lookup reads; the features are {sorted(known)}")
    # A group goes over in every graph or in none: decided while no graph has been rewritten
    # for it (kind "tables"), against every graph that reads it.
    groups, left = {}, {}
    for layout in program.tables or ():
        if layout.kind == KIND and layout.name in views[graph].sites:
            groups[layout.name] = layout        # decided on an earlier graph
        if layout.kind != "tables" or layout.name not in views[graph].sites:
            continue
        features = {f for view in views.values() for f, _ in view.sites.get(layout.name, ())}
        if chosen is not None and not chosen & features:
            continue
        why = next(filter(None, (view.why_not(layout, chosen) for view in views.values()
                                 if layout.name in view.sites)), None) or _why_no_initializer(program, layout)
        if why:
            left[layout.name] = why
        else:
            groups[layout.name] = layout
    if not groups:
        return program, {"changed": False, "left_alone": left}
    program, fetching_ops = fetch_rows_per_step(program, graph, groups, views[graph].reads, KIND,
                                                positions_bound=POSITIONS_BOUND)
    program, keyed = _key_by_raw_ids(program, graph, set(groups))
    return program, {
        "changed": True, "groups": sorted(groups), "raw_keys": keyed, "fetching_ops": fetching_ops,
        "left_alone": left,
        "note": "these features are keyed by their raw ids, not by the model's hash bins: a different "
                "(collision-free) model from the one written; its tables are the hash tables, not the model's "
                "variables (model.picasso.vocabulary() exports them)"}


def raw_keyed_tables(captured, analysis, features, chosen):
    """Names of the tables whose every site (analysis.sites; `features`: site output ->
    feature name) hashes its ids right before the lookup, for a feature `chosen` names
    (None: any): D-packing keeps them apart, so that a table whose ids are not hashed
    does not hold a hashed one back."""
    index = GraphIndex(captured.graph_def)
    hashed, other = set(), set()
    for site in analysis.sites:
        name = analysis.tables[site.table].name.split(":")[0]
        named = chosen is None or features[site.output] in chosen
        (hashed if named and _hashing(index, canonical(site.ids)) is not None else other).add(name)
    return hashed - other


class _GraphView:
    """One graph's fused lookup sites per group, and what reads the groups' tables."""

    def __init__(self, program, graph):
        captured = program.graphs[graph]
        self.index = GraphIndex(captured.graph_def)
        self.reads = table_reads(captured, self.index)
        self.sites = _sites_by_group(captured.graph_def, self.reads, program.tables or ())

    def why_not(self, layout, chosen):
        """Why this graph cannot key the group by raw id, or None."""
        return why_read_in_place(layout, self.reads.get(layout.name), self.index) or _why_not_hashed(
            self.index, self.sites[layout.name], chosen)


def _why_no_initializer(program, layout):
    """Why new keys of a member table could not be given rows, or None."""
    for member in layout.members:
        spec = program.initializers.get(member.name)
        if spec is None:
            return (f"table {member.name} is not a Keras Embedding layer's: the distribution of its new keys' "
                    "rows is unknown")
        initializer = tf.keras.initializers.deserialize(spec)
        try:
            initializer_spec(initializer)
        except ValueError:
            return (f"table {member.name}'s initializer {type(initializer).__name__} draws from a distribution "
                    "that depends on the table's shape, which a hash table has not")
    return None


def _sites_by_group(graph_def, reads, layouts):
    """group name -> [(feature, ids tensor)] of every fused lookup site reading it."""
    member_of = {f"{reads[t.name]}:{m}": t.name for t in layouts if t.name in reads for m in range(len(t.members))}
    sites = {}
    for node in graph_def.node:
        if node.op not in FUSED_LOOKUPS:
            continue
        num_tables = node.attr["G"].i
        names = [f.decode() for f in node.attr["feature_names"].list.s]
        for i, t in enumerate(node.attr["table_index"].list.i):
            group = member_of.get(canonical(node.input[t]))
            if group is not None:
                sites.setdefault(group, []).append((names[i], canonical(node.input[num_tables + i])))
    return sites


def _why_not_hashed(index, sites, chosen):
    """Why a group's sites cannot be keyed by raw id, or None."""
    for feature, ids in sites:
        if chosen is not None and feature not in chosen:
            return f"its tables are read by {feature} too, which dynamic_vocabulary does not name"
        if _hashing(index, ids) is None:
            return (f"the ids of {feature} are not hashed into bins right before the lookup (Keras Hashing, "
                    "tf.strings.to_hash_bucket*, or a modulo by a constant): there is no raw id to key by")
    return None


def _hashing(index, ids):
    """(the hashing node, [pass-through nodes from it to `ids`]), or None."""
    chain = []
    node = index.node(ids)
    while node.op in PASS_THROUGH:
        chain.append(node)
        node = index.input_node(node, 0)
        if node is None:
            return None
    if node.op in STRING_HASHES:
        return node, chain[::-1]
    if node.op == "FloorMod" and tf.as_dtype(node.attr["T"].type) in INTEGERS:
        divisor = index.input_node(node, 1)
        if divisor is not None and divisor.op == "Const":
            return node, chain[::-1]
    return None


def _key_by_raw_ids(program, graph, groups):
    """The program with each ExchangedIds of `groups` keyed by raw id: its `ids` a new
    int64 tensor of the same shape computed from the hash's input, and its placeholder
    int64 (cast back to the lookup's id type where that differs). Returns it and
    {feature: how its raw ids are keyed}."""
    captured = program.graphs[graph]
    graph_def = type(captured.graph_def)()
    graph_def.CopyFrom(captured.graph_def)
    index = GraphIndex(graph_def)
    captures, keyed, made = dict(captured.captures), {}, {}
    for placeholder, request in captured.captures.items():
        if not (isinstance(request, ExchangedIds) and request.group in groups):
            continue
        if request.ids not in made:
            hashing, chain = _hashing(index, request.ids)
            made[request.ids], keyed[request.feature] = _raw_key(graph_def, index, hashing, chain)
        captures[placeholder] = dataclasses.replace(request, ids=made[request.ids])
        _take_int64(graph_def, split_tensor_name(placeholder)[0])
    return dataclasses.replace(program, graphs={**program.graphs, graph: dataclasses.replace(
        captured, graph_def=graph_def, captures=captures)}), keyed


def _raw_key(graph_def, index, hashing, chain):
    """(name of a new int64 tensor: the raw key of each id, shaped like them; how it is keyed)."""
    source = index.input_node(hashing, 0)
    base = f"picasso/dynamic_vocabulary/{hashing.name}"
    if hashing.op in STRING_HASHES and source.op == "AsString" and tf.as_dtype(source.attr["T"].type) in INTEGERS:
        key, how = _cast(graph_def, f"{base}/key", source.input[0], source.attr["T"].type), "the integer id"
    elif hashing.op in STRING_HASHES:
        node = _add(graph_def, f"{base}/key", hashing.op, [hashing.input[0]])
        for name, value in hashing.attr.items():
            node.attr[name].CopyFrom(value)
        node.attr["num_buckets"].i = (1 << 63) - 1
        key, how = f"{node.name}:0", "the string's fingerprint"
    else:
        key, how = _cast(graph_def, f"{base}/key", hashing.input[0], hashing.attr["T"].type), "the integer id"
    for step in chain:
        if step.op in ("Identity", "Cast"):
            continue
        node = _add(graph_def, f"{base}/{step.op}", step.op, [key] + list(step.input[1:]))
        for name, value in step.attr.items():
            node.attr[name].CopyFrom(value)
        node.attr["T"].type = tf.int64.as_datatype_enum
        key = f"{node.name}:0"
    return key, how


def _cast(graph_def, base, tensor, dtype_enum):
    if dtype_enum == tf.int64.as_datatype_enum:
        return canonical(tensor)
    node = _add(graph_def, base, "Cast", [tensor])
    node.attr["SrcT"].type = dtype_enum
    node.attr["DstT"].type = tf.int64.as_datatype_enum
    return f"{node.name}:0"


def _take_int64(graph_def, placeholder):
    """Makes the placeholder int64; where its consumers read another id type, they read a cast of it."""
    node = next(n for n in graph_def.node if n.name == placeholder)
    dtype = node.attr["dtype"].type
    if dtype == tf.int64.as_datatype_enum:
        return
    node.attr["dtype"].type = tf.int64.as_datatype_enum
    cast = _add(graph_def, f"{placeholder}/as_ids", "Cast", [placeholder])
    cast.attr["SrcT"].type = tf.int64.as_datatype_enum
    cast.attr["DstT"].type = dtype
    for consumer in graph_def.node:
        if consumer is cast:
            continue
        for i, name in enumerate(consumer.input):
            if name in (placeholder, f"{placeholder}:0"):
                consumer.input[i] = cast.name


def _add(graph_def, base, op, inputs):
    name = unique_name(graph_def, base)
    node = graph_def.node.add()
    node.name, node.op = name, op
    node.input.extend(inputs)
    return node
