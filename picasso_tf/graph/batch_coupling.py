"""Ops that couple the samples of a batch: where a batch cannot be split into
micro-batches without changing the result.

An op couples samples when it lies on a path from the model's inputs to its outputs
and normalises over the batch (FusedBatchNorm in training) or reduces over the batch
axis (Keras' BatchNormalization on 2-D inputs computes tf.nn.moments over axis 0; an
in-batch softmax or a batch mean feeding the outputs does the same). Reductions that
read no input (a regularizer of a table), feed only the regularization loss, or reduce
integers (shape arithmetic) are not couplings.
"""
import collections

import tensorflow as tf

from picasso_tf.graph.graph_def_util import reachable_nodes, split_tensor_name

NORMALISATIONS = {"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"}
REDUCTIONS = {"Mean", "Sum", "Max", "Min", "Prod"}


def batch_coupling_ops(captured):
    """Names of the ops of a CapturedGraph's forward pass that couple a batch's samples."""
    nodes = {n.name: n for n in captured.graph_def.node}
    from_inputs = batch_dependent_nodes(captured)
    to_outputs = reachable_nodes(captured.graph_def, captured.output_tensors)
    return sorted(name for name in from_inputs & to_outputs
                  if nodes[name].op in NORMALISATIONS
                  or (nodes[name].op in REDUCTIONS and _reduces_values(nodes[name])
                      and 0 in _constant_axes(nodes, nodes[name])))


def batch_dependent_nodes(captured):
    """Names of the nodes a CapturedGraph's inputs reach by data edges: those whose
    values are computed from the batch (its activations), the inputs included."""
    consumers = collections.defaultdict(list)
    for node in captured.graph_def.node:
        for inp in node.input:
            source, index = split_tensor_name(inp)
            if index >= 0:                          # data edges only
                consumers[source].append(node.name)
    return _downstream([split_tensor_name(t)[0] for t in captured.input_tensors], consumers)


def _reduces_values(reduction):
    # A float reduction reduces values; an integer one over axis 0 is shape arithmetic
    # (the Prod of a Shape in a Tensordot), which couples nothing.
    return tf.as_dtype(reduction.attr["T"].type).is_floating


def _downstream(starts, consumers):
    seen, todo = set(starts), list(starts)
    while todo:
        for name in consumers[todo.pop()]:
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def _constant_axes(nodes, reduction):
    axes = nodes.get(split_tensor_name(reduction.input[1])[0])
    if axes is None or axes.op != "Const":
        return ()
    return tf.make_ndarray(axes.attr["value"].tensor).ravel().tolist()
