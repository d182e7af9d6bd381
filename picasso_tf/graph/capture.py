"""Capture: trace a Keras model's forward pass into a GraphDef plus what it captured.

The trace runs `model(inputs, training=...)` inside a tf.function on the model's input
signature. Variables and other outside tensors the trace reads become placeholders in
the GraphDef; `captures` maps those placeholder tensors back to the Python objects, so
that `import_forward` can feed them again (or feed replacements, such as packed tables).
Ragged and sparse inputs are fed as their component tensors (values, row splits /
indices, values, dense shape), one placeholder each.
"""
import collections
import dataclasses
from typing import Any, Dict, List, Optional

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.ops import handle_data_util

from picasso_tf.errors import UnsupportedModelError
from picasso_tf.graph.graph_def_util import canonical, prune, rewire, split_tensor_name
from picasso_tf.graph.inline import LibraryHold, inline_function_calls
from picasso_tf.graph.rebuild import feature_names, input_names

# Keras' crossentropies take the logits of an output made by these ops (keras.backend._get_logits).
LOGIT_ACTIVATIONS = ("Sigmoid", "Softmax")


@dataclasses.dataclass
class CapturedGraph:
    graph_def: graph_pb2.GraphDef
    input_specs: Any                 # nest structure of TensorSpec/RaggedTensorSpec/SparseTensorSpec, as the model takes it
    input_tensors: List[str]         # placeholder tensor per component of the flattened input specs
    output_structure: Any            # nest structure of the model's outputs (tensor names)
    regularization_loss: Optional[str]  # tensor summing model.losses, None when there are none
    output_masks: List[Optional[str]]  # per flattened output its Keras mask (Keras weights losses by it)
    captures: Dict[str, Any]         # placeholder tensor -> tf.Variable or outside tensor
    training: bool
    library: Optional[LibraryHold] = None  # keeps the trace's loop/branch functions registered
    # per flattened output the logits Keras' activation attached to it (_keras_logits), which
    # Keras' crossentropy uses instead of the output
    output_logits: List[Optional[str]] = dataclasses.field(default_factory=list)

    @property
    def output_tensors(self):
        return tf.nest.flatten(self.output_structure)

    @property
    def mask_tensors(self):
        return [m for m in self.output_masks if m]

    @property
    def logit_tensors(self):
        return [t for t in self.output_logits if t]

    @property
    def input_names(self):
        """The feature each input tensor belongs to (every component of a ragged or
        sparse feature is named after it)."""
        return input_names(self.input_specs)

    def with_graph(self, graph_def, replacements, captures):
        """A copy over a rewritten GraphDef whose tensors in `replacements` were replaced."""
        rename = lambda t: replacements.get(t, t)
        return dataclasses.replace(
            self, graph_def=graph_def, captures=captures,
            output_structure=tf.nest.map_structure(rename, self.output_structure),
            output_masks=[rename(m) if m else None for m in self.output_masks],
            output_logits=[rename(t) if t else None for t in self.output_logits],
            regularization_loss=rename(self.regularization_loss) if self.regularization_loss else None)

    def rewritten(self, graph_def, replacements, removed, new_captures=None):
        """A copy over graph_def (this graph plus new nodes) with the tensors in
        `replacements` redirected, the `removed` nodes dropped and the nodes that no
        output needs any more pruned."""
        graph_def = rewire(graph_def, replacements, removed)
        renamed = self.with_graph(graph_def, replacements, {})
        keep_outputs = renamed.output_tensors + renamed.mask_tensors + renamed.logit_tensors + (
            [renamed.regularization_loss] if renamed.regularization_loss else [])
        # Inputs stay, used or not, so that feeding every feature keeps working.
        graph_def = prune(graph_def, keep_outputs, keep=self.input_tensors)
        present = {n.name for n in graph_def.node}
        captures = {k: v for k, v in {**self.captures, **(new_captures or {})}.items()
                    if split_tensor_name(k)[0] in present}
        return self.with_graph(graph_def, replacements, captures)

    def import_typed(self):
        """Imports this graph into the default graph with each variable's placeholder fed
        by one that carries the variable's shape and dtype, so that what reads a variable
        (and what follows) has static shapes: passes that match shapes need them.
        Returns (replacements, removed) that map the stand-ins back in `rewritten`."""
        input_map, replacements, removed = {}, {}, set()
        for placeholder, variable in self.variables.items():
            typed = tf.compat.v1.placeholder(tf.resource, [], name="picasso/typed_variable")
            handle_data_util.copy_handle_data(variable.handle, typed)
            input_map[placeholder] = typed
            replacements[canonical(typed.name)] = placeholder
            removed.add(typed.op.name)
        tf.graph_util.import_graph_def(self.graph_def, input_map=input_map, name="")
        return replacements, removed

    @property
    def variables(self):
        return {name: v for name, v in self.captures.items() if isinstance(v, tf.Variable)}


def input_signature(model, example_inputs=None):
    """TypeSpecs of the model's inputs (TensorSpec, or RaggedTensorSpec/SparseTensorSpec
    for ragged and sparse inputs): from model.inputs when the model knows them
    (functional, Sequential with an input shape), else from an example batch."""
    known = getattr(model, "_is_graph_network", False) and model.inputs
    if known:
        structure = model._nested_inputs if hasattr(model, "_nested_inputs") else model.input
        return tf.nest.map_structure(
            lambda t: t.type_spec if isinstance(t.type_spec, (tf.RaggedTensorSpec, tf.SparseTensorSpec))
            else tf.TensorSpec(t.shape, t.dtype, name=_spec_name(t.name)), structure)
    if example_inputs is None:
        raise ValueError(
            f"picasso_tf cannot tell the input signature of {type(model).__name__}: it is a subclassed "
            "model (or Sequential without an input shape). Pass an example batch: "
            "picasso_tf.optimize(model, example_inputs=features) or call the model once on data first.")
    flat = tf.nest.flatten(example_inputs)
    paths = _flat_paths(example_inputs)
    return tf.nest.pack_sequence_as(example_inputs, [_example_spec(t, p) for t, p in zip(flat, paths)])


def _example_spec(value, path):
    """The spec of one example feature with the batch dimension left open."""
    if isinstance(value, tf.RaggedTensor):
        return tf.RaggedTensorSpec([None] + value.shape[1:], value.dtype, value.ragged_rank, value.row_splits.dtype)
    if isinstance(value, tf.SparseTensor):
        return tf.SparseTensorSpec([None] + value.shape[1:], value.dtype)
    value = tf.convert_to_tensor(value)
    return tf.TensorSpec([None] + list(value.shape[1:]), value.dtype, name=_spec_name(path))


def _flat_paths(structure):
    if isinstance(structure, dict):
        return [str(k) for k in sorted(structure)] if all(not isinstance(v, (dict, list, tuple))
                                                          for v in structure.values()) else \
            [f"input_{i}" for i in range(len(tf.nest.flatten(structure)))]
    return [f"input_{i}" for i in range(len(tf.nest.flatten(structure)))]


def _spec_name(name):
    name = name.split(":")[0]
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in name) or "input"


def check_has_call(model):
    """Refuses a Keras model without call(): there is no forward pass to rewrite."""
    if isinstance(model, tf.keras.Model) and type(model).call is tf.keras.Model.call:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no call(): picasso_tf rewrites the forward pass a model's call() "
            "defines, and this model computes its outputs elsewhere (in its own train_step, as the TensorFlow "
            "Recommenders retrieval tutorials do). Wrap the sub-models it calls (its query and candidate "
            "towers) with picasso_tf.optimize instead, or move the forward pass into call(inputs, training=None).")


def capture(model, specs, training, check_numerics=False):
    """Traces model(inputs, training) on `specs` and returns a CapturedGraph.
    check_numerics: every float feature first passes a CheckNumerics op whose error
    names the feature."""
    check_has_call(model)

    def forward(inputs):
        if check_numerics:
            inputs = _checked_numerics(specs, inputs)
        outputs = model(inputs, training=training)
        losses = model.losses
        flat = tf.nest.flatten(outputs)
        masks = [getattr(t, "_keras_mask", None) for t in flat]
        logits = [getattr(t, "_keras_logits", None) for t in flat]
        return outputs, (tf.add_n([tf.cast(l, tf.float32) for l in losses]) if losses else None), masks, logits

    concrete = tf.function(forward).get_concrete_function(specs)
    graph = concrete.graph
    num_inputs = len(tf.nest.flatten(specs, expand_composites=True))
    input_tensors = [canonical(t.name) for t in graph.inputs[:num_inputs]]
    variables_by_handle = {id(v.handle): v for v in graph.variables}
    captures = {}
    for external, internal in graph.captures:
        captures[canonical(internal.name)] = variables_by_handle.get(id(external), external)
    outputs, reg, masks, logits = concrete.structured_outputs
    output_structure = tf.nest.map_structure(lambda t: canonical(t.name), outputs)
    name_or_none = lambda t: canonical(t.name) if t is not None else None
    graph_def = graph.as_graph_def()
    library = LibraryHold(graph_def)
    return CapturedGraph(
        graph_def=_outputs_as_activations(inline_function_calls(graph_def), tf.nest.flatten(output_structure)),
        library=library, input_specs=specs, input_tensors=input_tensors,
        output_structure=output_structure,
        regularization_loss=name_or_none(reg),
        output_masks=[name_or_none(m) for m in masks], output_logits=[name_or_none(t) for t in logits],
        captures=captures, training=training)


def _checked_numerics(specs, inputs):
    """`inputs` (structured like specs) with every float feature's values passed
    through a CheckNumerics op whose error names the feature."""

    def check(tensor, name):
        message = (f"float feature {name!r} holds NaN or Inf values (picasso_tf option check_numerics=True): "
                   "clean the data, or set check_numerics=False to train on them as Keras does")
        return tf.nest.map_structure(
            lambda t: tf.debugging.check_numerics(t, message) if t.dtype.is_floating else t, tensor,
            expand_composites=True)

    flat = [check(t, name) for t, name in zip(tf.nest.flatten(inputs), feature_names(specs))]
    return tf.nest.pack_sequence_as(inputs, flat)


def _outputs_as_activations(graph_def, output_tensors):
    """Where an output is a Sigmoid or Softmax, the function's returned Identity of it
    becomes that op, on the same logits: Keras' crossentropy recognises the op type and
    takes the logits (keras.backend._get_logits), as it does on the original model's
    output. The Identity's control inputs (the step's stateful ops) stay."""
    nodes = {n.name: n for n in graph_def.node}
    consumers = collections.Counter(split_tensor_name(i)[0] for n in graph_def.node for i in n.input)
    removed = set()
    for tensor in output_tensors:
        node = nodes[split_tensor_name(tensor)[0]]
        if node.op != "Identity":
            continue
        source_name, index = split_tensor_name(node.input[0])
        source = nodes[source_name]
        if source.op not in LOGIT_ACTIVATIONS or index != 0:
            continue
        controls = [i for i in node.input if i.startswith("^")]
        node.op = source.op
        node.attr.clear()
        for key, value in source.attr.items():
            node.attr[key].CopyFrom(value)
        del node.input[:]
        node.input.extend(list(source.input) + controls)
        if consumers[source_name] == 1:
            removed.add(source_name)
    return rewire(graph_def, {}, removed) if removed else graph_def
