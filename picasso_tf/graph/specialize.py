"""Static shapes for the loops of an imported graph.

A graph captured on the model's input signature has an unknown batch size, and so have
its While loops' variables (a GRU's state). When TensorFlow differentiates an imported
loop it rebuilds the body from its FunctionDef, where moreover a variable read inside
the loop has no shape at all (a FunctionDef keeps no handle data for its arguments).
Keras traces its own step on the batch it is fed, so the original model's loops and
their gradient loops have static shapes, and Grappler fuses and folds what they allow
(MatMul + bias, the shape arithmetic of every iteration). `specialize_loops` gives each
imported loop the body TensorFlow would have traced on the tensors fed in.
"""
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.framework import function_def_to_graph, importer, ops
from tensorflow.python.framework.func_graph import FuncGraph
from tensorflow.python.ops import control_flow_ops, handle_data_util
from tensorflow.python.ops import control_flow_util_v2 as util

LOOPS = ("While", "StatelessWhile")


def specialize_loops(operations):
    """Re-traces the body and condition of each While op among `operations` (just
    imported into the graph being traced) on the shapes and handle data of the tensors
    fed to it, as while_v2 does when it traces a loop. A loop variable whose body output
    is not at least as specific keeps the captured shape (TensorFlow's shape-invariant
    rule), so a variable that changes shape from one iteration to the next stays open."""
    for op in operations:
        if op.type in LOOPS:
            _specialize(op)


def _specialize(op):
    captured = [tf.TensorShape(s) for s in op.get_attr("output_shapes")]
    shapes = [c.merge_with(t.shape) if c.is_compatible_with(t.shape) else c for c, t in zip(captured, op.inputs)]
    handles = [_handle_shapes(t) is not None for t in op.inputs]    # whose handle data the body receives
    if shapes == captured and not any(handles):
        return
    body_def = _definition(op, "body")
    while True:     # each round only reopens shapes, so it ends
        body = _function_graph(op, body_def, shapes, handles)
        kept = [s if control_flow_ops._ShapeLessThanOrEqual(o.shape, s) else c
                for s, o, c in zip(shapes, body.outputs, captured)]
        held = [h and _handles_within(o, t) for h, o, t in zip(handles, body.outputs, op.inputs)]
        if kept == shapes and held == handles:
            break
        shapes, handles = kept, held
    cond = _function_graph(op, _definition(op, "cond"), shapes, handles)
    with op.graph.as_default():
        op._set_func_attr("cond", util.create_new_tf_function(cond))
        op._set_func_attr("body", util.create_new_tf_function(body))
    op._set_shape_list_attr("output_shapes", shapes)
    # tf.gradients builds the gradient loop from these graphs rather than from the FunctionDefs.
    op._cond_graph, op._body_graph = cond, body
    for output, shape, result in zip(op.outputs, shapes, body.outputs):
        output.set_shape(shape)
        handle_data_util.copy_handle_data(result, output)


def _definition(op, attr):
    """The FunctionDef of the op's function attribute, from its graph or an enclosing one."""
    name, graph = op.get_attr(attr).name, op.graph
    while graph._get_function(name) is None:
        graph = graph.outer_graph
    return graph._get_function(name).cached_definition


def _function_graph(op, fdef, shapes, handles):
    """fdef imported into a new FuncGraph whose arguments have `shapes` and, where
    `handles` says so, the handle data of the op's inputs, before any node reads them
    (function_def_to_graph sets handle data only after the body's shapes are inferred)."""
    graph_def, flat = function_def_to_graph.function_def_to_graph_def(fdef)
    args = [arg.name for arg in fdef.signature.input_arg]
    body = graph_pb2.GraphDef()
    body.versions.CopyFrom(graph_def.versions)
    body.library.CopyFrom(graph_def.library)
    body.node.extend(n for n in graph_def.node if n.name not in args)
    with op.graph.as_default():
        graph = FuncGraph(f"{fdef.signature.name}_static_{ops.uid()}")
    with graph.as_default():
        inputs = []
        for arg, shape, handle, source in zip(fdef.signature.input_arg, shapes, handles, op.inputs):
            placeholder = tf.compat.v1.placeholder(arg.type, shape, name=arg.name)
            if handle:
                handle_data_util.copy_handle_data(source, placeholder)
            inputs.append(placeholder)
        read = {i for n in body.node for i in n.input}       # an argument no node reads maps nowhere
        feeds = {name: t for arg, t in zip(args, inputs) for name in (f"{arg}:0", f"^{arg}") if name in read}
        importer._import_graph_def_internal(
            body, input_map=feeds,
            validate_colocation_constraints=False, name="")
        graph.inputs = inputs
        graph.outputs = [graph.get_tensor_by_name(flat[fdef.ret[arg.name]]) for arg in fdef.signature.output_arg]
        graph.control_outputs = [graph.get_operation_by_name(fdef.control_ret[name])
                                 for name in fdef.signature.control_output]
    return graph


def _handle_shapes(tensor):
    """The element shapes a resource or variant tensor's handle data records, or None."""
    if tensor.dtype not in (tf.resource, tf.variant):
        return None
    data = handle_data_util.get_resource_handle_data(tensor)
    if not data.is_set or not data.shape_and_type:
        return None
    return [tf.TensorShape(s.shape) for s in data.shape_and_type]


def _handles_within(output, source):
    """Whether the body's output keeps (at least) the element shapes of its input."""
    out, given = _handle_shapes(output), _handle_shapes(source)
    return out is not None and len(out) == len(given) and all(
        control_flow_ops._ShapeLessThanOrEqual(o, g) for o, g in zip(out, given))
