"""Operation counts of a GraphDef, by op type and by dominant hardware resource.

The resource classes follow the paper §III-B: compute-bound ops (dense math),
memory-bound ops (gathers, scatters, reshapes, segment reductions: moving bytes) and
communication ops (collectives). Bookkeeping ops (constants, identities, no-ops) are
counted as "other". A function's arguments (its placeholders: the inputs and every
variable it reads) are not ops it runs: ``summarize`` counts them apart. Ops inside
functions the graph calls (control flow bodies, nested tf.functions) are counted too,
once per function.
"""
import collections

COMMUNICATION_MARKERS = ("Horovod", "AllReduce", "Allreduce", "Alltoall", "AllToAll", "Allgather",
                         "Nccl", "Collective", "_Send", "_Recv")
ARGUMENTS = {"Placeholder", "_Arg"}
OTHER = {"Const", "Identity", "IdentityN", "NoOp", "PlaceholderWithDefault", "StopGradient", "_Retval", "VarHandleOp", "Assert", "PartitionedCall",
         "StatefulPartitionedCall", "If", "StatelessIf", "While", "StatelessWhile"}
MEMORY = {
    "ResourceGather", "GatherV2", "GatherNd", "ResourceGatherNd", "Unique", "UniqueV2", "UniqueWithCounts",
    "ConcatV2", "Concat", "Split", "SplitV", "Reshape", "ExpandDims", "Squeeze", "StridedSlice", "Slice",
    "Pack", "Unpack", "Tile", "Transpose", "Fill", "ZerosLike", "OnesLike", "Shape", "ShapeN", "Size",
    "Rank", "Cast", "Pad", "PadV2", "BroadcastTo", "BroadcastArgs", "BroadcastGradientArgs",
    "DynamicPartition", "DynamicStitch", "ParallelDynamicStitch", "ReadVariableOp", "AssignVariableOp",
    "AssignAddVariableOp", "AssignSubVariableOp", "ResourceScatterAdd", "ResourceScatterUpdate",
    "ResourceScatterSub", "ResourceScatterMul", "ScatterNd", "TensorScatterUpdate", "TensorScatterAdd",
    "SegmentSum", "UnsortedSegmentSum", "SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN",
    "SparseSegmentSumWithNumSegments", "SparseSegmentMeanWithNumSegments", "SparseSegmentSqrtNWithNumSegments",
    "SparseSegmentSumGrad", "SparseSegmentMeanGrad", "SparseSegmentSqrtNGrad", "SparseSegmentSumGradV2",
    "SparseSegmentMeanGradV2", "SparseSegmentSqrtNGradV2", "SparseFillEmptyRows", "SparseReshape",
    "SparseToDense", "Where", "SelectV2", "Select", "Range", "InvertPermutation", "ConcatOffset",
    "TensorListFromTensor", "TensorListStack", "TensorListReserve", "TensorListGetItem", "TensorListSetItem",
}
RESOURCE_CLASSES = ("compute", "memory", "communication", "other")


def resource_class(op_type):
    if any(m in op_type for m in COMMUNICATION_MARKERS):
        return "communication"
    if op_type in OTHER:
        return "other"
    if op_type in MEMORY or op_type.startswith("Picasso") or "Scatter" in op_type or "Gather" in op_type:
        return "memory"
    return "compute"


def count_ops(graph_def):
    """Counter of op types over the graph and every function in its library."""
    counts = collections.Counter(n.op for n in graph_def.node)
    for function in graph_def.library.function:
        counts.update(n.op for n in function.node_def)
    return counts


def summarize(counts):
    """{"total": ops run (arguments apart), "arguments", "by_class", "by_op"}."""
    by_class = collections.Counter()
    for op, n in counts.items():
        if op not in ARGUMENTS:
            by_class[resource_class(op)] += n
    arguments = sum(n for op, n in counts.items() if op in ARGUMENTS)
    return {"total": sum(counts.values()) - arguments, "arguments": arguments,
            "by_class": {c: by_class.get(c, 0) for c in RESOURCE_CLASSES},
            "by_op": dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))}
