"""Capture: trace a Keras model's forward pass into a GraphDef plus what it captured.

The trace runs `model(inputs, training=...)` inside a tf.function on the model's input
signature. Variables and other outside tensors the trace reads become placeholders in
the GraphDef; `captures` maps those placeholder tensors back to the Python objects, so
that `import_forward` can feed them again (or feed replacements, such as packed tables).
"""
import dataclasses
from typing import Any, Dict, List, Optional

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.ops import handle_data_util

from picasso_tf.graph.graph_def_util import canonical, prune, rewire, split_tensor_name
from picasso_tf.graph.inline import LibraryHold, inline_function_calls


@dataclasses.dataclass
class CapturedGraph:
    graph_def: graph_pb2.GraphDef
    input_specs: Any                 # nest structure of tf.TensorSpec, as the model takes it
    input_tensors: List[str]         # placeholder tensor per flattened input spec
    output_structure: Any            # nest structure of the model's outputs (tensor names)
    regularization_loss: Optional[str]  # tensor summing model.losses, None when there are none
    output_masks: List[Optional[str]]  # per flattened output its Keras mask (Keras weights losses by it)
    captures: Dict[str, Any]         # placeholder tensor -> tf.Variable or outside tensor
    training: bool
    library: Optional[LibraryHold] = None  # keeps the trace's loop/branch functions registered

    @property
    def output_tensors(self):
        return tf.nest.flatten(self.output_structure)

    @property
    def mask_tensors(self):
        return [m for m in self.output_masks if m]

    def with_graph(self, graph_def, replacements, captures):
        """A copy over a rewritten GraphDef whose tensors in `replacements` were replaced."""
        rename = lambda t: replacements.get(t, t)
        return dataclasses.replace(
            self, graph_def=graph_def, captures=captures,
            output_structure=tf.nest.map_structure(rename, self.output_structure),
            output_masks=[rename(m) if m else None for m in self.output_masks],
            regularization_loss=rename(self.regularization_loss) if self.regularization_loss else None)

    def rewritten(self, graph_def, replacements, removed, new_captures=None):
        """A copy over graph_def (this graph plus new nodes) with the tensors in
        `replacements` redirected, the `removed` nodes dropped and the nodes that no
        output needs any more pruned."""
        graph_def = rewire(graph_def, replacements, removed)
        renamed = self.with_graph(graph_def, replacements, {})
        keep_outputs = renamed.output_tensors + renamed.mask_tensors + (
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
    """TensorSpecs of the model's inputs: from model.inputs when the model knows them
    (functional, Sequential with an input shape), else from an example batch."""
    known = getattr(model, "_is_graph_network", False) and model.inputs
    if known:
        structure = model._nested_inputs if hasattr(model, "_nested_inputs") else model.input
        return tf.nest.map_structure(
            lambda t: tf.TensorSpec(t.shape, t.dtype, name=_spec_name(t.name)), structure)
    if example_inputs is None:
        raise ValueError(
            f"picasso_tf cannot tell the input signature of {type(model).__name__}: it is a subclassed "
            "model (or Sequential without an input shape). Pass an example batch: "
            "picasso_tf.optimize(model, example_inputs=features) or call the model once on data first.")
    flat = tf.nest.flatten(example_inputs)
    paths = _flat_paths(example_inputs)
    specs = [tf.TensorSpec([None] + list(tf.convert_to_tensor(t).shape[1:]), tf.convert_to_tensor(t).dtype,
                           name=_spec_name(p)) for t, p in zip(flat, paths)]
    return tf.nest.pack_sequence_as(example_inputs, specs)


def _flat_paths(structure):
    if isinstance(structure, dict):
        return [str(k) for k in sorted(structure)] if all(not isinstance(v, (dict, list, tuple))
                                                          for v in structure.values()) else \
            [f"input_{i}" for i in range(len(tf.nest.flatten(structure)))]
    return [f"input_{i}" for i in range(len(tf.nest.flatten(structure)))]


def _spec_name(name):
    name = name.split(":")[0]
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in name) or "input"


def capture(model, specs, training):
    """Traces model(inputs, training) on `specs` and returns a CapturedGraph."""

    def forward(inputs):
        outputs = model(inputs, training=training)
        losses = model.losses
        masks = [getattr(t, "_keras_mask", None) for t in tf.nest.flatten(outputs)]
        return outputs, (tf.add_n([tf.cast(l, tf.float32) for l in losses]) if losses else None), masks

    concrete = tf.function(forward).get_concrete_function(specs)
    graph = concrete.graph
    num_inputs = len(tf.nest.flatten(specs))
    input_tensors = [canonical(t.name) for t in graph.inputs[:num_inputs]]
    variables_by_handle = {id(v.handle): v for v in graph.variables}
    captures = {}
    for external, internal in graph.captures:
        captures[canonical(internal.name)] = variables_by_handle.get(id(external), external)
    outputs, reg, masks = concrete.structured_outputs
    output_structure = tf.nest.map_structure(lambda t: canonical(t.name), outputs)
    output_masks = [canonical(m.name) if m is not None else None for m in masks]
    graph_def = graph.as_graph_def()
    library = LibraryHold(graph_def)
    return CapturedGraph(
        graph_def=inline_function_calls(graph_def), library=library, input_specs=specs, input_tensors=input_tensors,
        output_structure=output_structure,
        regularization_loss=canonical(reg.name) if reg is not None else None,
        output_masks=output_masks,
        captures=captures, training=training)
