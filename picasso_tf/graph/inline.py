"""Inline function calls of a captured GraphDef into its top level.

Layers that run inside nested tf.functions (Keras' GRU/LSTM backend selection, or a
user's @tf.function helper) appear as (Stateful)PartitionedCall ops. Inlining them
makes lookups inside visible to the analysis, and lets tf.gradients differentiate the
imported graph with TensorFlow's Python gradients (a call op imported from a GraphDef
would fall back to the runtime's SymbolicGradient, which lacks gradients for ops such
as TensorListStack). Control flow (While/If) stays as functional ops.
"""
from tensorflow.core.framework import graph_pb2
from tensorflow.python.eager import context
from tensorflow.python.framework import function_def_to_graph

from picasso_tf.graph.graph_def_util import split_tensor_name, tensor_name

CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")


def inline_function_calls(graph_def, max_rounds=16):
    """Returns graph_def with every call of a library function replaced by its body
    (repeatedly, for calls inside inlined bodies)."""
    register_library(graph_def)
    library = {f.signature.name: f for f in graph_def.library.function}
    for _ in range(max_rounds):
        calls = [n for n in graph_def.node if n.op in CALL_OPS and n.attr["f"].func.name in library]
        if not calls:
            return graph_def
        graph_def = _inline_once(graph_def, {n.name for n in calls}, library)
    raise ValueError(f"function calls nested deeper than {max_rounds} levels")


def _inline_once(graph_def, call_names, library):
    out = graph_pb2.GraphDef()
    out.versions.CopyFrom(graph_def.versions)
    out.library.CopyFrom(graph_def.library)
    outputs = {}    # "call:i" -> body tensor
    for node in graph_def.node:
        if node.name in call_names:
            outputs.update(_splice(out, node, library[node.attr["f"].func.name]))
        else:
            out.node.add().CopyFrom(node)
    for node in out.node:
        for i, name in enumerate(node.input):
            if not name.startswith("^"):
                node.input[i] = outputs.get(tensor_name(*split_tensor_name(name)), name)
    return out


def _splice(out, call, fdef):
    """Adds the body of `call` to `out` under the call's name; returns the mapping of
    the call's outputs to body tensors. A NoOp keeps the call's name for control edges."""
    body, flat = function_def_to_graph.function_def_to_graph_def(fdef)
    prefix = call.name + "/"
    data_inputs = [i for i in call.input if not i.startswith("^")]
    controls = [i for i in call.input if i.startswith("^")]
    args = {arg.name: data_inputs[k] for k, arg in enumerate(fdef.signature.input_arg)}

    def rename(name):
        node, index = split_tensor_name(name)
        if node in args:
            return "^" + split_tensor_name(args[node])[0] if index < 0 else args[node]
        return ("^" + prefix + node) if index < 0 else tensor_name(prefix + node, index)

    for node in body.node:
        if node.name in args:
            continue
        new = out.node.add()
        new.CopyFrom(node)
        new.name = prefix + node.name
        del new.input[:]
        new.input.extend(rename(i) for i in node.input)
        new.input.extend(controls)            # the call waited for these; so does its body
    returns = [rename(flat[fdef.ret[arg.name]]) for arg in fdef.signature.output_arg]
    done = out.node.add()
    done.name, done.op = call.name, "NoOp"
    done.input.extend("^" + split_tensor_name(r)[0] for r in returns)
    done.input.extend("^" + prefix + fdef.control_ret[k] for k in fdef.control_ret)
    return {tensor_name(call.name, i): r for i, r in enumerate(returns)}


def register_library(graph_def):
    """Makes the GraphDef's library functions (control-flow branches and bodies) known
    to the runtime: import_graph_def only records them in the Python graph."""
    ctx = context.context()
    for fdef in graph_def.library.function:
        if not ctx.has_function(fdef.signature.name):
            ctx.add_function_def(fdef)


class LibraryHold:
    """Keeps a GraphDef's library functions registered with the runtime while it lives.

    The runtime counts registrations and drops a function when the tf.function that
    traced it is garbage collected, which for a captured model happens at a moment
    the garbage collector picks, possibly while a rewritten graph that calls the
    function is being imported or run. Holding a registration of our own (released
    when the hold is collected) rules that out."""

    def __init__(self, graph_def):
        self._context = context.context()
        self._names = []
        for fdef in graph_def.library.function:
            self._context.add_function_def(fdef)
            self._names.append(fdef.signature.name)

    def __del__(self):
        for name in self._names:
            try:
                self._context.remove_function(name)
            except Exception:  # noqa: BLE001 - the runtime may already be shut down
                return
