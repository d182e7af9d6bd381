"""Rebuild: import a (rewritten) forward GraphDef into the graph being traced.

Imported ops are invisible to tf.GradientTape, so callers differentiate with
tf.gradients; custom ops carry their own registered gradients.
"""
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from picasso_tf.graph.inline import register_library
from picasso_tf.graph.specialize import specialize_loops


def feature_names(specs):
    """Per flattened spec, its feature's name: the TensorSpec's, else its key in a dict
    of features (ragged and sparse specs have no name), else its position."""
    flat = tf.nest.flatten(specs)
    keys = sorted(specs) if isinstance(specs, dict) and len(specs) == len(flat) else [None] * len(flat)
    return [getattr(s, "name", None) or (str(k) if k is not None else f"input_{i}")
            for i, (s, k) in enumerate(zip(flat, keys))]


def input_names(specs):
    """Per input tensor of the captured graph (one per dense feature; values and row
    splits, or indices, values and dense shape, per ragged or sparse one), its feature's name."""
    return [name for spec, name in zip(tf.nest.flatten(specs), feature_names(specs))
            for _ in tf.nest.flatten(spec, expand_composites=True)]


def conform_inputs(specs, inputs):
    """Flattens `inputs` in the order of `specs` into the tensors the captured graph's
    placeholders take (ragged and sparse features as their components), selecting dict
    entries by name and casting/expanding like Keras' functional models do. Missing
    features are an error that names them."""
    if isinstance(specs, dict):
        if not isinstance(inputs, dict):
            raise TypeError(f"the model takes a dict of features {sorted(specs)}; got {type(inputs).__name__}")
        missing = [k for k in specs if k not in inputs]
        if missing:
            raise KeyError(f"feature(s) {missing} missing from the batch; the model needs {sorted(specs)} "
                           f"and the batch has {sorted(inputs)}")
        inputs = {k: inputs[k] for k in specs}
    flat_specs, names = tf.nest.flatten(specs), feature_names(specs)
    if isinstance(inputs, dict) and not isinstance(specs, dict):
        # A model built on a list of Inputs takes a dict keyed by the Inputs' names, as Keras does.
        missing = [n for n in names if n not in inputs]
        if missing:
            raise KeyError(f"feature(s) {missing} missing from the batch; the model needs "
                           f"{names} and the batch has {sorted(inputs)}")
        inputs = [inputs[n] for n in names]
    flat_inputs = tf.nest.flatten(inputs)
    if len(flat_specs) != len(flat_inputs):
        raise ValueError(f"the model takes {len(flat_specs)} input tensor(s); got {len(flat_inputs)}")
    return [component for spec, tensor, name in zip(flat_specs, flat_inputs, names)
            for component in tf.nest.flatten(_conform(spec, tensor, name), expand_composites=True)]


def _conform(spec, tensor, name):
    if isinstance(spec, tf.RaggedTensorSpec):
        if not isinstance(tensor, tf.RaggedTensor) or tensor.ragged_rank != spec.ragged_rank:
            raise TypeError(f"input {name!r} is ragged (ragged_rank {spec.ragged_rank}) in the model; got "
                            f"{_describe(tensor)}: feed a tf.RaggedTensor of that ragged_rank")
        return tf.cast(tensor, spec.dtype).with_row_splits_dtype(spec.row_splits_dtype)
    if isinstance(spec, tf.SparseTensorSpec):
        if not isinstance(tensor, tf.SparseTensor):
            raise TypeError(f"input {name!r} is sparse in the model; got {_describe(tensor)}: feed a tf.SparseTensor")
        return tf.SparseTensor(tensor.indices, tf.cast(tensor.values, spec.dtype), tensor.dense_shape)
    if isinstance(tensor, (tf.RaggedTensor, tf.SparseTensor)):
        raise TypeError(f"input {name!r} is a dense tensor in the model; got {_describe(tensor)}")
    tensor = tf.convert_to_tensor(tensor)
    if tensor.dtype != spec.dtype:
        if spec.dtype.is_integer and not (tensor.dtype.is_integer or tensor.dtype.is_floating):
            raise TypeError(f"input {name!r} must be {spec.dtype.name}; got {tensor.dtype.name}")
        tensor = tf.cast(tensor, spec.dtype)
    if spec.shape.rank is not None and tensor.shape.rank == spec.shape.rank - 1 and spec.shape[-1] == 1:
        tensor = tf.expand_dims(tensor, -1)
    return tensor


def _describe(tensor):
    if isinstance(tensor, tf.RaggedTensor):
        return f"a tf.RaggedTensor of ragged_rank {tensor.ragged_rank}"
    return f"a {type(tensor).__name__}"


def import_forward(graph_def, input_tensors, inputs, captures, output_tensors, name="picasso"):
    """Imports graph_def into the current graph with `inputs` (flat, aligned with
    input_tensors) and `captures` (placeholder tensor -> variable or tensor) fed in, and
    returns the tensors named in output_tensors. Its loops get the static shapes of what
    is fed in (graph/specialize.py)."""
    graph = tf.compat.v1.get_default_graph()
    if not hasattr(graph, "capture"):
        raise RuntimeError("import_forward must run while tracing a tf.function")
    graph_def = _functions_new_to(graph, graph_def)
    register_library(graph_def)
    input_map = dict(zip(input_tensors, inputs))
    for placeholder, value in captures.items():
        # Outside (eager) tensors must become captures of the function being traced.
        input_map[placeholder] = graph.capture(value.handle if isinstance(value, tf.Variable) else value)
    first = len(graph.get_operations())
    returned = tf.graph_util.import_graph_def(
        graph_def, input_map=input_map, return_elements=list(output_tensors), name=name)
    specialize_loops(graph.get_operations()[first:])
    return returned



def _functions_new_to(graph, graph_def):
    """graph_def, its library functions renamed if `graph` already has them: a graph
    imported twice into one function (micro-batches) must not share control-flow
    functions, whose gradients TensorFlow builds per function name."""
    names = [f.signature.name for f in graph_def.library.function]
    if not any(graph._is_function(name) for name in names):
        return graph_def
    suffix = graph.unique_name("picasso_copy", mark_as_used=True).rsplit("/", 1)[-1]
    renamed = {name: f"{name}_{suffix}" for name in names}
    copy = graph_pb2.GraphDef()
    copy.CopyFrom(graph_def)
    for function in copy.library.function:
        function.signature.name = renamed[function.signature.name]
        for node in function.node_def:
            _rename_calls(node, renamed)
    for node in copy.node:
        _rename_calls(node, renamed)
    return copy


def _rename_calls(node, renamed):
    """Points a node's function-valued attributes (While/If branches, calls) at the renamed functions."""
    if node.op in renamed:                      # a function called as an op
        node.op = renamed[node.op]
    for value in node.attr.values():
        if value.HasField("func") and value.func.name in renamed:
            value.func.name = renamed[value.func.name]
        for func in value.list.func:
            if func.name in renamed:
                func.name = renamed[func.name]
