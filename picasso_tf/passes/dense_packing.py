"""Dense packing pass: K-packing of the dense ops that a model repeats per field.

Models apply the same small computation once per feature field or per expert: CAN's
co-action unit per (target, feeder) pair, MMoE's experts and gates, a tower per task,
an attention unit per behaviour sequence. Each copy is a handful of small ops, and on
a CPU a step's time then goes to launching them rather than to arithmetic. Keras
names each layer call's ops under its own name scope, so the copies show up as
scopes whose ops are the same, with the same shapes and attributes, wired the same
way: a *unit*. The pass finds groups of such units that do not depend on each other
and replaces each group by one vectorised computation (TensorFlow's pfor, the
machinery of tf.vectorized_map): the inputs that differ between units are stacked
on a new leading axis, an input every unit shares is used as it is, and the copies'
MatMuls become one batched product, their elementwise ops one op each. The units'
outputs are slices of the stacked results. Gradients follow by autodiff, so the
user's variables stay the weights (their values are stacked each step, which is a
copy of the weights, not of the activations). Results equal the original up to
summation order.

Matched: name scopes with at least one matrix product whose ops (other than the
variables' reads and placeholders, which stay outside and are stacked) have identical
types, attributes, static shapes and wiring, with no control dependencies across
their border and no path from one unit to another. A group stands down where a unit
multiplies its own input by its own weights (towers over different inputs, an
expert's second layer): batched over stacked copies of both, such products ran
slower on a CPU than apart, so only products with an operand every unit shares (one
wide product) or per-sample products (already batched) are packed; a stood-down
group's inner scopes are tried next (an expert's first layer reads the shared
input). A group also stands down where its units are large: packing saves launches,
which matter for small units, and one wide product for large ones, while a
mid-sized unit (_STAND_DOWN_MACS multiply-adds per example) runs as fast apart, and
the stacked inputs and outputs only add copies. The report lists every group it packed and every
group it left alone, with the reason.
"""
import collections
import dataclasses
import hashlib

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.python.ops.parallel_for.control_flow_ops import pfor

from picasso_tf.graph.graph_def_util import canonical

_PRODUCTS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
# Per example, units whose products take more than the first and at most the second
# many multiply-adds stand down: measured, packing them added copies worth more than
# the launches it saved. Smaller units (CAN's co-action units, a few thousand) pack for
# the launches; larger ones (MMoE's experts over a couple of thousand inputs) pack
# into one wide product that runs faster than the experts' narrow ones apart
# (docs/benchmarks.md, "Dense packing's stand-down").
_STAND_DOWN_MACS = (64 * 128, 256 * 256)
# Ops that stay outside a unit: their outputs are the unit's inputs.
_OUTSIDE = ("Placeholder", "ReadVariableOp", "VarHandleOp", "PlaceholderWithDefault")
_CONTROL_FLOW = ("While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase", "PartitionedCall",
                 "StatefulPartitionedCall")
# Node attributes that do not change what an op computes.
_IGNORED_ATTRS = ("_class", "_output_shapes", "_has_manual_control_dependencies")


@dataclasses.dataclass
class _Unit:
    scope: str
    ops: list                   # the unit's body, in the graph's order
    inputs: list                # external input tensors, in signature order
    signature: str


def dense_packing(program, graph, config):
    captured = program.graphs[graph]
    scratch = tf.Graph()
    with scratch.as_default():
        replacements, removed = captured.import_typed()
    kept = set(captured.output_tensors + captured.mask_tensors + captured.logit_tensors +
               ([captured.regularization_loss] if captured.regularization_loss else []))
    groups = _candidate_groups(scratch)
    # The units are ops of the captured graph, which the groups packed before them only
    # read: one order serves every group's independence check.
    order = _topological(scratch)
    packed, left_alone = [], []
    claimed = set()
    for units in groups:
        if any(op.name in claimed for u in units for op in u.ops):
            continue
        why = _why_not_packable(order, units)
        if why is None:
            try:
                with scratch.as_default(), tf.name_scope(f"picasso/dense_pack/{_short(units[0].scope)}/"):
                    outputs = _vectorize(scratch, units, kept)
            except (ValueError, NotImplementedError, TypeError) as e:   # pfor has no converter for an op
                why = f"TensorFlow cannot vectorise it: {str(e).splitlines()[0][:200]}"
        if why is not None:
            left_alone.append({"scopes": [u.scope for u in units][:4], "units": len(units), "why": why})
            continue
        for original, new in outputs.items():
            replacements[original] = new
        for u in units:
            claimed.update(op.name for op in u.ops)
            removed.update(op.name for op in u.ops)
        packed.append({"scopes": [u.scope for u in units][:4], "units": len(units), "ops_per_unit": len(units[0].ops),
                       "macs_per_example": _macs_per_example(units[0]),
                       "stacked_inputs": sum(len({u.inputs[p].name for u in units}) > 1
                                             for p in range(len(units[0].inputs)))})
    if packed:
        program = dataclasses.replace(program, graphs={
            **program.graphs, graph: captured.rewritten(scratch.as_graph_def(), replacements, removed)})
    return program, {"packed": packed, "left_alone": left_alone}


def _short(scope):
    return scope.replace("/", "_")


def _candidate_groups(graph):
    """Groups (lists of _Units, two or more) of name scopes with the same signature,
    shallow scopes first (a group of larger units packs more)."""
    by_scope = collections.defaultdict(list)
    for op in graph.get_operations():
        parts = op.name.split("/")
        for depth in range(1, len(parts)):
            by_scope["/".join(parts[:depth])].append(op)
    by_signature = collections.defaultdict(list)
    for scope, ops in by_scope.items():
        body = [op for op in ops if op.type not in _OUTSIDE]
        if not any(op.type in _PRODUCTS for op in body):
            continue
        unit = _unit(scope, body)
        if unit is not None:
            by_signature[unit.signature].append(unit)
    # A scope holding nothing but one inner scope has that scope's signature: not a group.
    groups = [units for units in by_signature.values()
              if len(units) > 1 and len({op.name for u in units for op in u.ops}) == sum(len(u.ops) for u in units)]
    return sorted(groups, key=lambda units: (units[0].scope.count("/"), -len(units)))


def _unit(scope, body):
    """The _Unit of `scope`'s ops, or None where they cannot form one (an op whose
    output has no static rank). The signature names ops by their position in the
    graph's order, not by name: Keras numbers the layers a Sequential makes globally, so
    the same code gives the copies different inner names."""
    members = {op.name: k for k, op in enumerate(body)}
    inputs, position, lines = [], {}, []
    for op in body:
        wiring = []
        for t in op.inputs:
            if t.op.name in members:
                wiring.append(f"{members[t.op.name]}:{t.value_index}")
            else:
                if t.name not in position:
                    position[t.name] = len(inputs)
                    inputs.append(t)
                wiring.append(f"in{position[t.name]}")
        if any(t.shape.rank is None for t in op.outputs):
            return None
        attrs = sorted((k, _attr_text(v)) for k, v in op.node_def.attr.items() if k not in _IGNORED_ATTRS)
        control = sorted(members.get(c.name, -1) for c in op.control_inputs)
        lines.append(repr((op.type, wiring, attrs, control, [(t.dtype.name, t.shape.as_list()) for t in op.outputs])))
    lines += [repr((t.dtype.name, t.shape.as_list() if t.shape.rank is not None else None)) for t in inputs]
    signature = hashlib.sha1("\n".join(lines).encode()).hexdigest()
    return _Unit(scope, body, inputs, signature)


def _attr_text(value):
    text = value.SerializeToString(deterministic=True)
    return hashlib.sha1(text).hexdigest() if len(text) > 64 else text


def _why_not_packable(order, units):
    """None where the units can run as one vectorised computation (`order`: the graph's
    ops in topological order), else why not."""
    template = units[0]
    for op in template.ops:
        if op._is_stateful or op.type in _CONTROL_FLOW:      # noqa: SLF001
            # A random op (dropout) would draw one batched sample instead of the units'
            # own; a variable read, an assertion or a loop has no batched form that keeps
            # its effects in order.
            return (f"{op.name[len(template.scope) + 1:]} ({op.type}) has effects or draws random numbers, "
                    "which a batched computation would not reproduce unit by unit")
    shared = {t.name for p, t in enumerate(template.inputs) if all(u.inputs[p] is t for u in units)}
    for op in template.ops:
        if op.type == "MatMul" and not any(t.name in shared for t in op.inputs):
            # Stacked, such products become one BatchMatMul over stacked activations and
            # weights, which ran slower on a CPU than the products apart (both its copies
            # and its gradient): batching pays where one operand is shared (one wide
            # product) or the products are per-sample already (BatchMatMul).
            return (f"{op.name[len(template.scope) + 1:]} multiplies each unit's own input by its own weights: "
                    "batched over stacked copies of both it runs slower than the units apart")
    macs = _macs_per_example(template)
    low, high = _STAND_DOWN_MACS
    if macs is not None and low < macs <= high:
        return (f"each unit's products take {macs:,} multiply-adds per example (between {low:,} and {high:,}): "
                "units of that size run as fast apart, and packing them would only add the copies of its "
                "stacked inputs and outputs")
    members = {op.name: k for k, u in enumerate(units) for op in u.ops}
    for u in units:
        for op in u.ops:
            if any(c.name not in members for c in op.control_inputs):
                return f"{op.name} waits on an op outside its unit (a control dependency)"
            if any(members.get(c.name) != members[op.name] for c in op._control_outputs):   # noqa: SLF001
                return f"an op outside its unit waits on {op.name} (a control dependency)"
    # depends[op]: bit k set where op is computed from unit k's ops.
    depends = {}
    for op in order:
        bits = 0
        for t in op.inputs:
            bits |= depends.get(t.op.name, 0)
        for c in op.control_inputs:
            bits |= depends.get(c.name, 0)
        if op.name in members:
            bits |= 1 << members[op.name]
        depends[op.name] = bits
    for u in units:
        for t in u.inputs:
            if depends.get(t.op.name, 0):
                return (f"unit {u.scope} takes {t.name}, which is computed from a unit of the group "
                        f"(the units are not independent)")
    return None


def _topological(graph):
    """The graph's ops, each after the ops it reads."""
    order, state = [], {}
    for root in graph.get_operations():
        stack = [(root, False)]
        while stack:
            op, done = stack.pop()
            if done:
                order.append(op)
                state[op.name] = 2
                continue
            if state.get(op.name):
                continue
            state[op.name] = 1
            stack.append((op, True))
            stack.extend((t.op, False) for t in op.inputs if not state.get(t.op.name))
            stack.extend((c, False) for c in op.control_inputs if not state.get(c.name))
    return order


def _macs_per_example(unit):
    """Multiply-adds per example of the unit's products (their outputs' elements past the
    leading, batch, dimension times the contracted dimension), or None where a shape is
    not static."""
    total = 0
    for op in unit.ops:
        if op.type not in _PRODUCTS:
            continue
        a, b, out = op.inputs[0].shape, op.inputs[1].shape, op.outputs[0].shape
        if op.type == "MatMul":     # either operand may know it (x [B, ?] @ W [n, m])
            contracted = (a[0] if op.get_attr("transpose_a") else a[1]) or (
                b[1] if op.get_attr("transpose_b") else b[0])
        else:
            contracted = (a[-2] if op.get_attr("adj_x") else a[-1]) or (b[-1] if op.get_attr("adj_y") else b[-2])
        per_example = out[1:].num_elements()
        if contracted is None or per_example is None:
            return None
        total += per_example * contracted
    return total


def _vectorize(graph, units, kept):
    """Builds one vectorised computation of the units in `graph`; returns
    {unit output tensor: the tensor replacing it}."""
    template = units[0]
    prefix = template.scope + "/"
    shared, stacked = {}, {}
    for p, t in enumerate(template.inputs):
        column = [u.inputs[p] for u in units]
        if all(c is t for c in column):
            shared[p] = t
        else:
            stacked[p] = tf.stack(column, name=f"stack_{p}")
    outputs = _unit_outputs(units, kept)          # (relative op name, index) read outside
    body = graph_pb2.GraphDef()
    for p, t in enumerate(template.inputs):
        body.node.add().CopyFrom(_placeholder_def(f"picasso_in_{p}", t))
    for op in template.ops:
        node = body.node.add()
        node.CopyFrom(op.node_def)
        node.name = op.name[len(prefix):]
        for attr in _IGNORED_ATTRS:
            node.attr.pop(attr, None)
        del node.input[:]
        node.input.extend(_inside_name(t, prefix, template) for t in op.inputs)
        node.input.extend("^" + c.name[len(prefix):] for c in op.control_inputs)

    @tf.autograph.experimental.do_not_convert   # pfor would convert it; it has no Python control flow
    def one_unit(k):
        input_map = {f"picasso_in_{p}": shared[p] if p in shared else tf.gather(stacked[p], k)
                     for p in range(len(template.inputs))}
        return tf.graph_util.import_graph_def(
            body, input_map=input_map, name="unit",
            return_elements=[f"{template.ops[at].name[len(prefix):]}:{index}" for at, index in outputs])

    before = set(graph.get_operations())
    results = pfor(one_unit, len(units), fallback_to_while_loop=False)
    replacements = _fold_static(graph, [op for op in graph.get_operations() if op not in before])
    for (at, index), result in zip(outputs, results):
        for u, value in zip(units, tf.unstack(result, num=len(units))):
            replacements[canonical(u.ops[at].outputs[index].name)] = canonical(value.name)
    return replacements


def _placeholder_def(name, tensor):
    node = tf.compat.v1.NodeDef(name=name, op="Placeholder")
    node.attr["dtype"].type = tensor.dtype.as_datatype_enum
    node.attr["shape"].shape.CopyFrom(tensor.shape.as_proto())
    return node


def _fold_static(graph, ops):
    """{tensor: constant} for the tensors of `ops` (in creation order) that depend only
    on constants and on static shapes: pfor writes its shape arithmetic for unknown
    shapes, and most of it is known here. Returns the replacements."""
    shapes = {"Shape": lambda s: s.as_list(), "Size": lambda s: s.num_elements(), "Rank": lambda s: s.rank}
    static, feeds = set(), {}
    for op in ops:
        if op.type in shapes and op.inputs[0].shape.is_fully_defined():
            feeds[op.outputs[0]] = shapes[op.type](op.inputs[0].shape)
        elif op.type == "Const" or (op.inputs and not op.control_inputs and op.type not in _OUTSIDE
                                    and not op._is_stateful and all(t.op in static for t in op.inputs)):   # noqa: SLF001
            pass
        else:
            continue
        static.add(op)
    # In creation order: the constants' names must not depend on set order (every rank
    # builds the same graph).
    boundary = [t for op in ops if op in static and op.type != "Const" for t in op.outputs
                if any(c not in static for c in t.consumers())]
    if not boundary:
        return {}
    with tf.compat.v1.Session(graph=graph) as session:
        values = session.run(boundary, feed_dict=feeds)
    replacements = {}
    for t, value in zip(boundary, values):
        constant = tf.constant(value, dtype=t.dtype, name="folded")
        replacements[canonical(t.name)] = canonical(constant.name)
    return replacements


def _inside_name(tensor, prefix, unit):
    """How the template body names `tensor`: by its name relative to the unit's scope,
    or as the external input placeholder it is mapped from."""
    if tensor.op.name.startswith(prefix) and tensor.op in unit.ops:
        return f"{tensor.op.name[len(prefix):]}:{tensor.value_index}"
    return f"picasso_in_{next(p for p, t in enumerate(unit.inputs) if t is tensor)}:0"


def _unit_outputs(units, kept):
    """(position in the unit, output index) of every tensor of any unit that something
    outside its unit reads, or that the graph outputs."""
    outputs = set()
    for u in units:
        members = set(u.ops)
        for at, op in enumerate(u.ops):
            for t in op.outputs:
                if any(c not in members for c in t.consumers()) or canonical(t.name) in kept:
                    outputs.add((at, t.value_index))
    return sorted(outputs)
