"""Sequence pooling folded into the lookup. A sequence feature's lookup (ids [B, L],
rows [B, L, D]) that the model only reduces over the sequence becomes a lookup pooled
by row (picasso_tf.ops.packed_lookup), which writes [B, D] straight away: the
[B, L, D] rows, their product with a mask, the reduction and all their gradients are
never built.

Patterns, on a tf.Graph with static shapes (e: the site's output, ids of rank r >= 2,
every reduction over axis r - 1 without keep_dims, each tensor used only by the next):

  Sum(e)                              combiner sum
  Mean(e)                             combiner mean
  Sum(Mul(e, w))                      combiner sum, weights w (shaped ids.shape + [1], or
                                      tiled from it along the rows' dimension)
  DivNoNan(Sum(Mul(e, w)), Sum(w))    combiner mean, weights w

The last is a masked average written with divide_no_nan (an all-padding row gives
zeros, as the kernel's mean does). An average divided otherwise (Keras'
GlobalAveragePooling1D divides by the mask's sum as it is) keeps its division and
folds only the weighted sum. Weights may depend on trainable variables (the lookup's
gradient gives theirs), but not on embedding lookups.
"""
import dataclasses

import tensorflow as tf

from picasso_tf.graph.graph_def_util import canonical

REDUCTIONS = {"Sum": "sum", "Mean": "mean"}


# Rows narrower than this are summed faster by TensorFlow's vectorised product and
# reduction than by the kernel's loop over ids (benchmarks/sequence_pooling.txt).
MIN_POOLED_DIM = 2


def pool_sequences(graph, sites, kept):
    """(sites, replacements, unpaid): the sites of a tf.Graph holding the captured graph,
    each unpooled lookup whose output the graph only reduces over its sequence replaced
    by the pooled site; {tensor: tensor standing for it} for what read only the shape of
    a pooled lookup's rows (Keras' masked pooling layers do); and the sites that could
    pool but whose rows are too narrow to pay. kept: names of the tensors the graph
    returns (a reader of them is never unused)."""
    pooled, replacements, unpaid = [], {}, []
    lookups = {node for site in sites for node in site.chain}
    for site in sites:
        match = _match(graph, site, set(kept), lookups)
        if match and site.dim < MIN_POOLED_DIM:
            unpaid.append(site)
            match = None
        pooled.append(_pool(graph, site, match, replacements) if match else site)
    return pooled, replacements, unpaid


@dataclasses.dataclass
class _Match:
    combiner: str
    output: object                  # the tensor the pooled lookup stands for
    chain: list                     # nodes it replaces, beyond the lookup's own
    weights: object = None          # the Mul's weights, [B, L, 1] (or broadcast to it)
    shape_readers: list = dataclasses.field(default_factory=list)  # Shape ops of the rows


def _match(graph, site, kept, lookups):
    if site.combiner != "none":
        return None
    ids = graph.get_tensor_by_name(site.ids)
    rows = graph.get_tensor_by_name(site.output)
    rank = ids.shape.rank
    if rank is None or rank < 2 or rows.shape.rank != rank + 1:
        return None
    chain, shape_readers = [], []
    node = _value_reader(rows, chain, shape_readers, kept)
    weights = None
    if node is not None and node.type == "Mul":
        weights = _weights_of(node, rows, ids)
        # Weights computed from lookups (attention scores) would make the fused lookup
        # an input of itself.
        if weights is None or _reads_any(weights, lookups):
            return None
        chain.append(node.name)
        node = _only_consumer(node.outputs[0], chain)
    if node is None or node.type not in (("Sum",) if weights is not None else REDUCTIONS) or \
            not _reduces_axis(node, rank - 1):
        return None
    length = ids.shape[-1]
    if node.type == "Mean" and not length:
        return None     # TF's mean of no rows is NaN, the kernel's zeros: fold only a known L > 0
    chain.append(node.name)
    match = _Match(REDUCTIONS[node.type], node.outputs[0], chain, weights, shape_readers)
    between = []
    division = _only_consumer(match.output, between)
    # The weights' sum over the sequence is the mean's only where there is one weight per
    # position: a weight broadcast along the sequence counts once, not L times.
    per_position = weights is not None and ids.shape[1:].is_fully_defined() and \
        weights.shape[1:-1] == ids.shape[1:]
    if (per_position and division is not None and _is_mean_division(division, weights, rank) and
            division.inputs[0].op.name in [match.output.op.name] + between):
        match.chain += between + [division.name]
        match.combiner, match.output = "mean", division.outputs[0]
    return match


def _pool(graph, site, match, replacements):
    """The pooled site of a match; adds the graph's stand-ins for what it replaces."""
    ids = graph.get_tensor_by_name(site.ids)
    weights = match.weights
    with graph.as_default(), tf.name_scope("picasso/sequence_pooling/"):
        if weights is not None and not _one_per_id(weights.shape[:-1], ids.shape):
            # Not provably one weight per id: broadcast as the Mul would (the kernel checks
            # the weights' shape against the ids' where the batch's is not static).
            weights = tf.broadcast_to(weights, tf.concat([tf.shape(ids), [1]], 0))
        for shape in match.shape_readers:
            out_type = shape.get_attr("out_type")
            rows_shape = tf.concat([tf.shape(ids, out_type=out_type), tf.constant([site.dim], out_type)], 0)
            replacements[canonical(shape.outputs[0].name)] = canonical(rows_shape.name)
    return dataclasses.replace(
        site, pattern="sequence", combiner=match.combiner, output=canonical(match.output.name),
        weights=canonical(weights.name) if weights is not None else None,
        chain=site.chain + [s.name for s in match.shape_readers] + match.chain)


def _reads_any(tensor, nodes):
    """Whether any of the named nodes is among the ops `tensor` depends on."""
    seen, frontier = set(), [tensor.op]
    while frontier:
        op = frontier.pop()
        if op.name in nodes:
            return True
        if op.name not in seen:
            seen.add(op.name)
            frontier += [x.op for x in op.inputs] + list(op.control_inputs)
    return False


def _one_per_id(shape, ids_shape):
    """Whether weights of `shape` ([B, L] of [B, L, 1]) have one entry per id: every
    dimension equal to the ids', the batch's unknown in both allowed."""
    dims, ids_dims = shape.as_list(), ids_shape.as_list()
    return (dims[0] == ids_dims[0]) and all(a is not None and a == b for a, b in zip(dims[1:], ids_dims[1:]))


def _value_reader(rows, chain, shape_readers, kept):
    """The one op reading the values of a lookup's rows, or None. Shape ops (which the
    pooled lookup's ids stand in for) go to shape_readers, ops whose outputs nothing
    reads (Keras reads a tensor's dtype from a slice of it) to chain."""
    readers = []
    for node in rows.consumers():
        if node._control_outputs:
            return None
        if node.type == "Shape":
            shape_readers.append(node)
        elif not any(out.consumers() or canonical(out.name) in kept for out in node.outputs):
            chain.append(node.name)
        else:
            readers.append(node)
    if len(readers) != 1:
        return None
    if readers[0].type == "Identity":
        chain.append(readers[0].name)
        return _only_consumer(readers[0].outputs[0], chain)
    return readers[0]


def _only_consumer(tensor, chain):
    """The one op reading `tensor`, past Identity ops (appended to chain), or None."""
    while True:
        consumers = tensor.consumers()
        if len(consumers) != 1 or consumers[0]._control_outputs:
            return None
        node = consumers[0]
        if node.type != "Identity":
            return node
        chain.append(node.name)
        tensor = node.outputs[0]


def _weights_of(mul, rows, ids):
    """The Mul's other input if it can be a weight per id: shaped [B, L, 1] (or a shape
    that broadcasts to it, a length-1 axis or one not static), or such weights tiled
    along the rows' dimension (DeepCTR's SequencePoolingLayer tiles its mask)."""
    names = [x.name for x in mul.inputs]
    if names.count(rows.name) != 1:
        return None
    weights = mul.inputs[1 - names.index(rows.name)]
    if weights.op.type == "Tile" and _tiles_last_axis(weights.op):
        weights = weights.op.inputs[0]
    shape, ids_shape = weights.shape, ids.shape.as_list()
    if weights.dtype != rows.dtype or shape.rank != len(ids_shape) + 1 or shape[-1] != 1:
        return None
    if any(a not in (None, 1, b) for a, b in zip(shape.as_list()[:-1], ids_shape) if b is not None):
        return None
    return weights


def _tiles_last_axis(tile):
    """Whether a Tile repeats only its input's last axis (of length 1)."""
    multiples = tile.inputs[1]
    if multiples.op.type != "Const" or tile.inputs[0].shape.rank is None or tile.inputs[0].shape[-1] != 1:
        return False
    return all(m == 1 for m in tf.make_ndarray(multiples.op.get_attr("value")).tolist()[:-1])


def _reduces_axis(node, axis):
    """Whether a Sum/Mean reduces exactly `axis` of its input, without keep_dims."""
    if node.get_attr("keep_dims"):
        return False
    indices = node.inputs[1]
    if indices.op.type != "Const":
        return False
    axes = tf.make_ndarray(indices.op.get_attr("value")).reshape(-1).tolist()
    rank = node.inputs[0].shape.rank
    return len(axes) == 1 and axes[0] % rank == axis


def _is_mean_division(node, weights, rank):
    """DivNoNan(., Sum(weights over the sequence)): a masked average."""
    if node.type != "DivNoNan":
        return False
    denominator = node.inputs[1].op
    while denominator.type == "Identity":
        denominator = denominator.inputs[0].op
    return (denominator.type == "Sum" and denominator.inputs[0].name == weights.name and
            _reduces_axis(denominator, rank - 1))
