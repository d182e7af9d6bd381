"""Analysis: find the embedding sites of a captured forward graph.

A site is one lookup of a 2-D table variable: the ids it reads, how their rows are
combined, and the tensor the rest of the model consumes. Matching works on use-def
structure from the table's resource placeholder, never on layer classes or names, so
models written by anyone are recognised the same way. Patterns (TF 2.15 graphs):

  gather       ResourceGather(table, ids)              keras Embedding, tf.nn.embedding_lookup
               GatherV2(ReadVariableOp(table), ids, 0) tf.gather on the table's value
  sparse       SparseSegment{Sum,Mean,SqrtN}[WithNumSegments](ReadVariableOp(table), ids, segs)
               ResourceGather(table, Unique(ids).y) -> SparseSegment*(., Unique.idx, segs)
                                                       (safe_)embedding_lookup_sparse
  weighted     ResourceGather(table, Unique(ids).y) -> GatherV2(., Unique.idx) ->
               Mul(., Reshape(weights)) -> SegmentSum(., segs)    ... with sp_weights
  ragged       ResourceGather(table, flat_ids) -> UnsortedSegmentSum(., segs, n)
                                                       reduce_sum over a ragged lookup

Dense reads of a table's value by anything else (an embedding regularizer, a matmul
with the table) are recorded: the table is still packed, and those readers get its
rows of the packed table; their gradient is dense, exactly as in the original model.
A table read only whole, as one_hot(ids) @ table, has no lookup to pack: it is
reported as left alone.
Any other use of the table's resource (an unknown lookup op, a stateful update) makes
every lookup of that table stay as it is; the analysis says so and why.
"""
import dataclasses
from typing import Dict, List, Optional

import tensorflow as tf

from picasso_tf.graph.graph_def_util import GraphIndex, canonical, split_tensor_name, tensor_name

SEGMENT_COMBINERS = {"SparseSegmentSum": "sum", "SparseSegmentMean": "mean", "SparseSegmentSqrtN": "sqrtn",
                     "SparseSegmentSumWithNumSegments": "sum", "SparseSegmentMeanWithNumSegments": "mean",
                     "SparseSegmentSqrtNWithNumSegments": "sqrtn"}


@dataclasses.dataclass
class EmbeddingSite:
    """One lookup. Tensor fields are GraphDef tensor names ("node:index")."""
    table: str                      # the table's resource placeholder tensor
    variable_name: str              # the table variable's name, for reports
    vocab_size: int
    dim: int
    dtype: tf.DType
    pattern: str                    # gather | sparse | weighted | ragged
    ids: str                        # ids as the site reads them (any shape for "none")
    combiner: str = "none"          # none | sum | mean | sqrtn
    segment_ids: Optional[str] = None
    num_segments: Optional[str] = None   # None: last segment id + 1 (sorted segments)
    weights: Optional[str] = None
    output: str = ""                # what the rest of the model consumes
    chain: List[str] = dataclasses.field(default_factory=list)  # nodes the site replaces

    def __post_init__(self):
        for name in ("ids", "segment_ids", "num_segments", "weights", "output"):
            if getattr(self, name):
                setattr(self, name, canonical(getattr(self, name)))

    def describe(self):
        extra = ", weighted" if self.weights else ""
        return f"{self.variable_name}[{self.vocab_size}x{self.dim}] {self.pattern}/{self.combiner}{extra} -> {self.output}"


@dataclasses.dataclass
class Analysis:
    sites: List[EmbeddingSite]
    left_alone: List[Dict[str, str]]    # {"table": ..., "reason": ...}
    tables: Dict[str, tf.Variable]      # placeholder tensor -> variable, for packable tables
    dense_reads: Dict[str, List[str]] = dataclasses.field(default_factory=dict)  # placeholder -> read tensors

    def densely_read(self, variable):
        return any(self.tables[p] is variable for p in self.dense_reads)

    def report(self):
        return {"sites": [s.describe() for s in self.sites], "left_alone": list(self.left_alone)}


def find_embedding_sites(captured):
    """Returns the Analysis of a CapturedGraph."""
    index = GraphIndex(captured.graph_def)
    sites, left_alone, tables, dense_reads = [], [], {}, {}
    for placeholder, variable in sorted(captured.variables.items()):
        if variable.shape.rank != 2 or not variable.dtype.is_floating:
            continue
        found, reads, reason = _sites_of_table(index, placeholder, variable)
        if reason is None and found:
            sites.extend(found)
            tables[placeholder] = variable
            if reads:
                dense_reads[placeholder] = reads
        elif reason is not None and (found or _looks_like_table(index, placeholder)):
            left_alone.append({"table": variable.name.split(":")[0], "reason": reason})
        elif reason is None and (product := _one_hot_product(index, reads)) is not None:
            left_alone.append({"table": variable.name.split(":")[0], "reason": (
                f"read only whole, as a product of one-hot ids with the table ({product.op} {product.name}): "
                "there is no lookup to pack, so it trains as in the model (a dense gradient there too); look "
                "its rows up with tf.gather(table, ids) or an Embedding layer to have it packed")})
    return Analysis(sites=sites, left_alone=left_alone, tables=tables, dense_reads=dense_reads)


def _looks_like_table(index, placeholder):
    """A 2-D variable read by any gather-like op is a table worth reporting on."""
    lookups = {"ResourceGather", "GatherV2", "ResourceGatherNd"} | set(SEGMENT_COMBINERS)
    frontier = [placeholder]
    for tensor in frontier:
        for node, _ in index.uses(tensor):
            if node.op in lookups:
                return True
            if node.op in ("ReadVariableOp", "Identity"):
                frontier.append(tensor_name(node.name))
    return False


# Ops that carry one-hot ids to a MatMul unchanged in meaning.
_ONE_HOT_PASSTHROUGH = ("Identity", "Cast", "Reshape", "ExpandDims", "Squeeze")


def _one_hot_product(index, reads):
    """The MatMul multiplying one of the table's dense reads by one-hot ids, or None."""
    for read in reads:
        for node, pos in index.uses(read):
            if node.op not in ("MatMul", "BatchMatMulV2"):
                continue
            other = index.input_node(node, 1 - pos)
            while other.op in _ONE_HOT_PASSTHROUGH:
                other = index.input_node(other, 0)
            if other.op == "OneHot":
                return node
    return None


def _sites_of_table(index, placeholder, variable):
    """(sites, dense reads, None), or (sites, reads, reason) when the table must stay."""
    vocab, dim = (int(d) for d in variable.shape)
    base = dict(table=placeholder, variable_name=variable.name.split(":")[0], vocab_size=vocab, dim=dim,
                dtype=variable.dtype)
    sites, dense_reads = [], []
    for node, pos in index.uses(placeholder):
        if node.op == "ResourceGather" and pos == 0:
            if node.attr["batch_dims"].i != 0:
                return sites, dense_reads, f"{node.name}: ResourceGather with batch_dims={node.attr['batch_dims'].i}"
            sites.append(_match_after_gather(index, node, base))
        elif node.op == "ReadVariableOp":
            read = tensor_name(node.name)
            for reader, rpos in index.uses(read):
                site = _match_on_value(index, reader, rpos, base, node)
                if site is not None:
                    sites.append(site)
                elif read not in dense_reads:
                    dense_reads.append(read)
        elif node.op == "ResourceGatherNd":
            return sites, dense_reads, (
                f"tf.gather_nd on the table ({node.name}): picasso_tf packs lookups of whole rows by id "
                "(tf.gather, tf.nn.embedding_lookup, Embedding), not gathers by index tuples, so every lookup of "
                "this table stays as it is and trains as in the model; write tf.gather(table, ids) to have it packed")
        else:
            return sites, dense_reads, (f"the table is used by {node.op} ({node.name}), which picasso_tf does "
                                        f"not recognise; its lookups stay as they are")
    return sites, dense_reads, None


def _single_use(index, tensor):
    uses = index.uses(tensor)
    return uses[0] if len(uses) == 1 else (None, None)


def _skip_identities(index, tensor, chain):
    """Follows Identity ops that are the only consumer, recording them in chain."""
    while True:
        node, _ = _single_use(index, tensor)
        if node is None or node.op != "Identity" or index.control_consumers.get(node.name):
            return tensor
        chain.append(node.name)
        tensor = tensor_name(node.name)


def _match_on_value(index, reader, pos, base, read_node):
    """Lookups that take the table's value: GatherV2 and the fast sparse-segment path."""
    chain = [read_node.name, reader.name]
    if reader.op == "GatherV2" and pos == 0:
        if not _is_const(index, reader.input[2], 0) or reader.attr["batch_dims"].i:
            return None
        output = _skip_identities(index, tensor_name(reader.name), chain)
        return EmbeddingSite(**base, pattern="gather", ids=reader.input[1], output=output, chain=chain)
    if reader.op in SEGMENT_COMBINERS and pos == 0:
        return _segment_site(index, reader, base, ids=reader.input[1], chain=chain)
    return None


def _segment_site(index, node, base, ids, chain):
    with_num = node.op.endswith("WithNumSegments")
    output = _skip_identities(index, tensor_name(node.name), chain)
    return EmbeddingSite(**base, pattern="sparse", ids=ids, combiner=SEGMENT_COMBINERS[node.op],
                         segment_ids=node.input[2], num_segments=node.input[3] if with_num else None,
                         output=output, chain=chain)


def _match_after_gather(index, gather, base):
    """A ResourceGather, possibly followed by the reduction of a pooled lookup."""
    chain = [gather.name]
    out = _skip_identities(index, tensor_name(gather.name), chain)
    ids = gather.input[1]
    plain = EmbeddingSite(**base, pattern="gather", ids=ids, output=out, chain=list(chain))
    unique = index.node(ids)
    consumer, pos = _single_use(index, out)
    if consumer is None or pos != 0:
        return plain
    if unique.op == "Unique" and split_tensor_name(ids)[1] == 0:
        idx = tensor_name(unique.name, 1)
        if consumer.op in SEGMENT_COMBINERS and _same(consumer.input[1], idx):
            return _segment_site(index, consumer, base, ids=unique.input[0], chain=chain + [consumer.name])
        if consumer.op == "GatherV2" and _same(consumer.input[1], idx) and _is_const(index, consumer.input[2], 0):
            weighted = _match_weighted(index, consumer, base, unique, chain + [consumer.name])
            if weighted is not None:
                return weighted
    if consumer.op == "UnsortedSegmentSum":
        sum_chain = chain + [consumer.name]
        output = _skip_identities(index, tensor_name(consumer.name), sum_chain)
        return EmbeddingSite(**base, pattern="ragged", ids=ids, combiner="sum", segment_ids=consumer.input[1],
                             num_segments=consumer.input[2], output=output, chain=sum_chain)
    return plain


def _match_weighted(index, regather, base, unique, chain):
    """GatherV2(rows, idx) -> Mul(., Reshape(weights, shape)) -> SegmentSum(., segs)."""
    mul, _ = _single_use(index, tensor_name(regather.name))
    if mul is None or mul.op != "Mul":
        return None
    other = [i for i in mul.input if not _same(i, tensor_name(regather.name))]
    if len(other) != 1:
        return None
    reshape = index.node(other[0])
    if reshape.op != "Reshape":
        return None
    segsum, pos = _single_use(index, tensor_name(mul.name))
    if segsum is None or segsum.op != "SegmentSum" or pos != 0:
        return None
    seg_chain = chain + [mul.name, segsum.name]
    output = _skip_identities(index, tensor_name(segsum.name), seg_chain)
    return EmbeddingSite(**base, pattern="weighted", ids=unique.input[0], combiner="sum",
                         segment_ids=segsum.input[1], weights=reshape.input[0], output=output, chain=seg_chain)


def _is_const(index, tensor, value):
    node = index.node(tensor)
    return node.op == "Const" and tf.make_ndarray(node.attr["value"].tensor).size == 1 and \
        tf.make_ndarray(node.attr["value"].tensor).item() == value


def _same(a, b):
    return split_tensor_name(a) == split_tensor_name(b)
