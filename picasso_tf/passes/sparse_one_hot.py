"""One-hot ids made sparse, read as they are. TensorFlow's feature columns (and models
calling tf.sparse.from_dense themselves) turn each id input [B, 1] into a SparseTensor,
dropping an ignored value, for tf.nn.safe_embedding_lookup_sparse, which drops
negative ids, gives rows with no id zeros, and pools the rest by segment. Per feature
and step that is a dozen small ops around the lookup (Where, GatherNd, SparseReshape,
the pruning gathers, SparseFillEmptyRows, the empty rows' Select), kept by the fused
lookup of the "sparse" pattern. Here such a lookup reads the ids as they are: [B, L]
ids, where one op can tell which the conversion keeps, as those ids and the row of each
(PicassoKeptSegments), so that the kernels never pass over the padding; [B, 1] ids and
the others pooled by row, each weighted 1 where the conversion keeps it and 0 where it
does not (read as id 0), in one op where it can tell them (PicassoKeptIds). The same sums,
means and square-root means, and zeros where no id is left, as the kernels divide like
div_no_nan.

Matched on a tf.Graph with static shapes, from the site back (whatever is computed from
the site's pooled rows must end in the Select; the conversion's ops may serve other
lookups too, and then stay for them):

  Select(Tile(Reshape(F:2)), ZerosLike(out), out)      the empty rows' zeros; out the site's
  F = SparseFillEmptyRows(GatherV2(I, k), GatherV2(V, k), Identity(R:1), default)
      k = Reshape(Where(GreaterEqual(V, 0)))          the pruning of negative ids
  R = SparseReshape(W, S, Pack(Prod(Slice(S)), GatherV2(S)))   2-D to 2-D: the same
  I = R:0, V = Identity(f(GatherNd(D, W))), W = Where(NotEqual(D, p)), S = Shape(D)

where f is none, one or several ops applied to each kept id (a cast, a hash, a
vocabulary's lookup: _PER_ID), which the rewrite applies to every id of D instead.

D of shape [B, 1] or [B, L]. [B, L] ids PicassoKeptSegments can read (no per-id ops, a
dropped value <= 0) are read at any fill: one pass over the positions where the
conversion makes several (benchmarks/padded_ids.py). The others can only be read
weighted, every position passed over, so only where warm-up data measured their table's
positions at least MIN_FILL filled; how full a sequence is belongs to the data, so
without warm-up data they keep their form.
"""
import collections
import dataclasses

import tensorflow as tf

from picasso_tf.graph.graph_def_util import canonical
from picasso_tf.ops.kept_ids import kept_ids, kept_segments


# The share of a table's padded positions holding an id from which reading them weighted,
# every position, pays (the twelfth session's padded_ids.py, docs/benchmarks.md).
MIN_FILL = 0.4


def read_one_hot_ids(graph, sites, statistics, refused=None):
    """(sites, outputs, kept): the sites of a tf.Graph holding the captured graph, each
    safe_embedding_lookup_sparse of padded ids made sparse replaced by a lookup of the
    ids themselves where that pays; the outputs of the sites so replaced; and {output:
    why} of those left sparse (every [B, L] one read weighted that does not pay; every
    one when `refused`, a reason, says none may be read so). statistics: the Program's."""
    matches = {id(site): _match(graph, site) for site in sites}
    fill = _fill_by_table(sites, matches, statistics)
    read, changed, kept = [], [], {}
    for site in sites:
        match = matches[id(site)]
        if match is not None and refused:
            kept[site.output], match = refused, None
        if match is not None and match[0].shape[1] > 1 and not _kept_segments_read(*match[:3]):
            why = _why_weighted_stays_sparse(match[0].shape[1], fill.get(site.variable_name), statistics)
            if why:
                kept[site.output], match = why, None
        if match is None:
            read.append(site)
            continue
        read.append(_rewrite(graph, site, *match))
        changed.append(read[-1].output)
    return read, changed, kept


def _why_weighted_stays_sparse(length, fill, statistics):
    """Why [B, L] ids read weighted keep their sparse form, given their table's measured
    fill (None where the warm-up cannot tell it), or None where reading them pays."""
    if fill is not None:
        return None if fill >= MIN_FILL else (
            f"{fill:.0%} of its table's {length} positions hold an id in the warm-up batches, under the "
            f"{MIN_FILL:.0%} from which reading them weighted (per-id ops or a dropped value above 0) pays")
    if statistics.batch_size is not None:
        return (f"{length} padded positions whose fill the warm-up cannot tell: their table is also read by "
                "other lookups, whose ids it counts with theirs")
    return (f"{length} padded positions read weighted (per-id ops or a dropped value above 0): pass warmup_data "
            f"to picasso_tf.optimize to measure how full they are (read so from {MIN_FILL:.0%} filled)")


def _fill_by_table(sites, matches, statistics):
    """{table: the share of its sites' padded positions holding an id the conversion
    keeps, in the warm-up batches}, for tables read only by matched sites; empty without
    warm-up batches."""
    if statistics.batch_size is None:
        return {}
    positions, unmatched = collections.defaultdict(int), set()
    for site in sites:
        match = matches[id(site)]
        if match is None:
            unmatched.add(site.variable_name)
        else:
            positions[site.variable_name] += match[0].shape[1]
    return {table: statistics.accesses.get(table, 0.0) / count for table, count in positions.items()
            if table not in unmatched}


def _match(graph, site):
    """(dense ids D, the ops applied to each kept id in order, D's NotEqual mask, the
    Select standing for the site's output) or None."""
    if site.pattern != "sparse" or site.weights or site.combiner == "none":
        return None
    fill = graph.get_tensor_by_name(site.ids)
    if fill.op.type != "SparseFillEmptyRows" or fill.value_index != 1:
        return None
    fill = fill.op
    select = _empty_rows_select(graph.get_tensor_by_name(site.output), fill)
    if select is None or not _first_column(graph.get_tensor_by_name(site.segment_ids), fill):
        return None
    indices, values = _unpruned(fill.inputs[0], fill.inputs[1])
    if indices is None or indices.op.type != "SparseReshape" or indices.value_index != 0:
        return None
    reshape = indices.op
    if not (_is_identity_of(fill.inputs[2], reshape.outputs[1]) and values.op.type == "Identity"):
        return None
    transforms, gathered = [], values.op.inputs[0]
    while gathered.op.type in _PER_ID:
        transforms.append(gathered.op)
        gathered = gathered.op.inputs[_PER_ID[gathered.op.type]]
    gather_nd, where, shape = gathered.op, reshape.inputs[0], reshape.inputs[1]
    if gather_nd.type != "GatherNd" or gather_nd.inputs[1] is not where or where.op.type != "Where":
        return None
    dense, mask = gather_nd.inputs[0], where.op.inputs[0]
    if (mask.op.type != "NotEqual" or mask.op.inputs[0] is not dense or shape.op.type != "Shape" or
            shape.op.inputs[0] is not dense or not _same_2d_shape(reshape.inputs[2], shape)):
        return None
    if dense.shape.rank != 2 or dense.shape[1] is None or not values.dtype.is_integer:
        return None
    return dense, transforms[::-1], mask, select


# Ops a feature column applies to each id it keeps (casting, hashing, a vocabulary's
# lookup), with the input carrying the ids: applied to every id of the input instead.
_PER_ID = {"Identity": 0, "Cast": 0, "AsString": 0, "StringToHashBucketFast": 0, "StringToHashBucketStrong": 0,
           "StringToHashBucket": 0, "LookupTableFindV2": 1}

# What PicassoKeptIds and PicassoKeptSegments take (custom_ops/kept_ids_op.cc); other
# types go through TF's ops.
_KEPT_IDS_TYPES = (tf.int32, tf.int64)
_KEPT_WEIGHT_TYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def _kept_segments_read(dense, transforms, mask):
    """Whether PicassoKeptSegments can read the ids as the conversion keeps them: ids of
    its types, taken as they are, with a constant dropped value <= 0 (so that the kept ids
    are those > 0, or >= 0)."""
    ignored = _ignored_value(mask.op.inputs[1])
    return not transforms and ignored is not None and ignored <= 0 and dense.dtype in _KEPT_IDS_TYPES


def _rewrite(graph, site, dense, transforms, mask, select):
    """The site reading `dense`: [B, L] ids as the kept ids alone with their rows, so that
    the kernels never pass over the padding, where one op can tell them; else pooled by
    row, each id weighted by whether the conversion keeps it."""
    with graph.as_default(), tf.name_scope("picasso/sparse_one_hot/"):
        ids = dense
        for op in transforms:
            inputs = list(op.inputs)
            inputs[_PER_ID[op.type]] = ids
            with graph.control_dependencies(op.control_inputs):
                ids = graph.create_op(op.type, inputs, [out.dtype for out in op.outputs],
                                      attrs=dict(op.node_def.attr), name=op.type).outputs[0]
        if transforms:
            # One id per id; said in the graph, as a vocabulary's shape function cannot tell
            # and the fused lookup's shape follows its ids'.
            ids = tf.ensure_shape(ids, dense.shape)
        one_pass = _kept_segments_read(dense, transforms, mask)
        keep_zero = one_pass and _ignored_value(mask.op.inputs[1]) < 0
        replaced = dict(output=canonical(select.outputs[0].name), chain=site.chain + [select.name])
        if one_pass and dense.shape[1] > 1:
            ids, segment_ids, num_segments = kept_segments(ids, keep_zero)
            return dataclasses.replace(site, pattern="sparse", ids=canonical(ids.name),
                                       segment_ids=canonical(segment_ids.name),
                                       num_segments=canonical(num_segments.name), **replaced)
        if one_pass and tf.as_dtype(site.dtype) in _KEPT_WEIGHT_TYPES:
            # The kept ids are the positive ones (0 ignored) or those >= 0: one pass over
            # the ids, not three.
            ids, weights = kept_ids(ids, site.dtype, keep_zero)
        else:
            kept = tf.logical_and(mask, ids >= 0)
            ids = tf.where(kept, ids, tf.zeros_like(ids))
            weights = tf.cast(kept, site.dtype)[..., None]
    return dataclasses.replace(site, pattern="sequence", ids=canonical(ids.name), weights=canonical(weights.name),
                               segment_ids=None, num_segments=None, **replaced)


def _empty_rows_select(out, fill):
    """The Select giving the rows SparseFillEmptyRows filled zeros, if it is what reads `out`."""
    readers = {op.type: op for op in out.consumers()}
    select, zeros = readers.get("Select"), readers.get("ZerosLike")
    if select is None or zeros is None or len(out.consumers()) != 3 or "Shape" not in readers:
        return None
    condition, then, otherwise = select.inputs
    if otherwise is not out or then.op is not zeros or condition.op.type != "Tile":
        return None
    flags = condition.op.inputs[0].op
    if flags.type != "Reshape" or flags.inputs[0] is not fill.outputs[2] or not _read_only_by(out, select):
        return None
    return select


# What safe_embedding_lookup_sparse computes from its pooled rows to zero the empty ones.
_EMPTY_ROWS_OPS = {"Shape", "StridedSlice", "Pack", "Tile", "ZerosLike"}


def _read_only_by(out, select):
    """Whether everything computed from `out` ends in `select` (the site's pooled rows
    then go with it)."""
    frontier, seen = [out.op], set()
    while frontier:
        op = frontier.pop()
        if op._control_outputs:
            return False
        for reader in {c for t in op.outputs for c in t.consumers()}:
            if reader is select:
                continue
            if reader.type not in _EMPTY_ROWS_OPS or len(seen) > len(_EMPTY_ROWS_OPS):
                return False
            if reader.name not in seen:
                seen.add(reader.name)
                frontier.append(reader)
    return True


def _first_column(segment_ids, fill):
    """Whether segment_ids is indices[:, 0] of SparseFillEmptyRows' indices."""
    op = segment_ids.op
    if (op.type != "StridedSlice" or op.inputs[0] is not fill.outputs[0] or op.get_attr("shrink_axis_mask") != 2
            or not op.get_attr("begin_mask") & op.get_attr("end_mask") & 1
            or op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask")):
        return False
    begin, end, strides = (_const(t) for t in op.inputs[1:])
    return begin == [0, 0] and end == [0, 1] and strides == [1, 1]


def _unpruned(indices, values):
    """(indices, values) before safe_embedding_lookup_sparse's pruning of negative ids."""
    if indices.op.type != "GatherV2" or values.op.type != "GatherV2":
        return None, None
    keep = indices.op.inputs[1]
    if values.op.inputs[1] is not keep or keep.op.type != "Reshape" or keep.op.inputs[0].op.type != "Where":
        return None, None
    test = keep.op.inputs[0].op.inputs[0].op
    if test.type != "GreaterEqual" or test.inputs[0] is not values.op.inputs[0] or _const(test.inputs[1]) != 0:
        return None, None
    return indices.op.inputs[0], values.op.inputs[0]


def _is_identity_of(tensor, source):
    return tensor is source or (tensor.op.type == "Identity" and tensor.op.inputs[0] is source)


def _same_2d_shape(new_shape, shape):
    """Whether SparseReshape's new shape is [prod(shape[:1]), shape[1]]: the same 2-D shape."""
    pack = new_shape.op
    if pack.type != "Pack" or len(pack.inputs) != 2:
        return False
    prod, last = pack.inputs[0].op, pack.inputs[1].op
    if prod.type != "Prod" or prod.inputs[0].op.type != "Slice" or last.type != "GatherV2":
        return False
    leading = prod.inputs[0].op
    return (leading.inputs[0] is shape and _const(leading.inputs[1]) == [0] and _const(leading.inputs[2]) == [1]
            and last.inputs[0] is shape and _const(last.inputs[1]) == 1 and _const(last.inputs[2]) == 0)


def _ignored_value(tensor):
    """The value the conversion drops (NotEqual's other operand), if a constant scalar."""
    if tensor.op.type == "ZerosLike":           # tf.sparse.from_dense's
        return 0
    value = _const(tensor)
    return value if isinstance(value, int) else None


def _const(tensor):
    if tensor.op.type != "Const":
        return None
    return tf.make_ndarray(tensor.op.get_attr("value")).tolist()
