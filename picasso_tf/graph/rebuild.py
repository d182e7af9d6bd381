"""Rebuild: import a (rewritten) forward GraphDef into the graph being traced.

Imported ops are invisible to tf.GradientTape, so callers differentiate with
tf.gradients; custom ops carry their own registered gradients.
"""
import tensorflow as tf

from picasso_tf.graph.inline import register_library


def conform_inputs(specs, inputs):
    """Flattens `inputs` in the order of `specs`, selecting dict entries by name and
    casting/expanding like Keras' functional models do. Missing features are an error
    that names them."""
    if isinstance(specs, dict):
        if not isinstance(inputs, dict):
            raise TypeError(f"the model takes a dict of features {sorted(specs)}; got {type(inputs).__name__}")
        missing = [k for k in specs if k not in inputs]
        if missing:
            raise KeyError(f"feature(s) {missing} missing from the batch; the model needs {sorted(specs)} "
                           f"and the batch has {sorted(inputs)}")
        inputs = {k: inputs[k] for k in specs}
    flat_specs = tf.nest.flatten(specs)
    if isinstance(inputs, dict) and not isinstance(specs, dict):
        # A model built on a list of Inputs takes a dict keyed by the Inputs' names, as Keras does.
        missing = [s.name for s in flat_specs if s.name not in inputs]
        if missing:
            raise KeyError(f"feature(s) {missing} missing from the batch; the model needs "
                           f"{[s.name for s in flat_specs]} and the batch has {sorted(inputs)}")
        inputs = [inputs[s.name] for s in flat_specs]
    flat_inputs = tf.nest.flatten(inputs)
    if len(flat_specs) != len(flat_inputs):
        raise ValueError(f"the model takes {len(flat_specs)} input tensor(s); got {len(flat_inputs)}")
    return [_conform(spec, tensor) for spec, tensor in zip(flat_specs, flat_inputs)]


def _conform(spec, tensor):
    tensor = tf.convert_to_tensor(tensor)
    if tensor.dtype != spec.dtype:
        if spec.dtype.is_integer and not (tensor.dtype.is_integer or tensor.dtype.is_floating):
            raise TypeError(f"input {spec.name!r} must be {spec.dtype.name}; got {tensor.dtype.name}")
        tensor = tf.cast(tensor, spec.dtype)
    if spec.shape.rank is not None and tensor.shape.rank == spec.shape.rank - 1 and spec.shape[-1] == 1:
        tensor = tf.expand_dims(tensor, -1)
    return tensor


def import_forward(graph_def, input_tensors, inputs, captures, output_tensors, name="picasso"):
    """Imports graph_def into the current graph with `inputs` (flat, aligned with
    input_tensors) and `captures` (placeholder tensor -> variable or tensor) fed in, and
    returns the tensors named in output_tensors."""
    graph = tf.compat.v1.get_default_graph()
    if not hasattr(graph, "capture"):
        raise RuntimeError("import_forward must run while tracing a tf.function")
    register_library(graph_def)
    input_map = dict(zip(input_tensors, inputs))
    for placeholder, value in captures.items():
        # Outside (eager) tensors must become captures of the function being traced.
        input_map[placeholder] = graph.capture(value.handle if isinstance(value, tf.Variable) else value)
    return tf.graph_util.import_graph_def(
        graph_def, input_map=input_map, return_elements=list(output_tensors), name=name)

