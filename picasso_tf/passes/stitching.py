"""Finds the concatenations that K-packing can stitch: a ConcatV2 (or Pack) some of
whose inputs are embedding sites' outputs, used nowhere else. A stitched lookup then
writes those sites' rows straight into the concatenation's layout (the paper's
shuffle & stitch), so neither the concatenation nor its gradient's split copies them.

Any tensor concatenated along axis a is, in memory, a [outer, inner] matrix with
outer = prod(shape[:a]) and inner = prod(shape[a:]) (Pack: the same with the new axis
at a), and the result is these matrices side by side. A site's output, reshaped any
way on its way to the concatenation (Reshape, ExpandDims, Squeeze, Identity), keeps
its row order, so each outer row holds inner / D of its consecutive D-wide rows.
Other inputs (dense features, sites used elsewhere too) are copied in by the kernel.

Twin concatenations, with the same inputs giving the same columns (DeepFM's FM part
stacks the embeddings that its deep part concatenates flat: the same memory layout),
share one stitched lookup: each takes its own reshape of it.

A concatenation whose only use is a MatMul (a logistic regression, a wide part, an
MLP's first layer) is noted as the stitch's projection: K-packing can compute the
product from the tables' rows (picasso_tf.ops.stitched_projection).
"""
import dataclasses
import math
from typing import List, Optional

import tensorflow as tf

# Ops that only reshape their first input.
_RESHAPES = {"Reshape", "ExpandDims", "Squeeze", "Identity"}


@dataclasses.dataclass
class StitchPart:
    tensor: str                 # the concatenation's input
    inner: int                  # its columns in the stitched [outer, width] matrix
    site: Optional[object] = None   # the EmbeddingSite it is, or None (copied in)
    chain: List[str] = dataclasses.field(default_factory=list)  # reshape nodes replaced


@dataclasses.dataclass
class StitchOutput:
    node: str                   # a ConcatV2 / Pack node
    tensor: str                 # its output
    shape: List[int]            # static, -1 for the one unknown dimension


@dataclasses.dataclass
class StitchProjection:
    node: str                   # the MatMul that is the concatenation's only use
    tensor: str                 # its output
    kernel: str                 # its [width, units] second input
    units: int


@dataclasses.dataclass
class Stitch:
    outputs: List[StitchOutput]   # the concatenations (twins) it replaces
    parts: List[StitchPart]
    projection: Optional[StitchProjection] = None

    @property
    def width(self):
        return sum(p.inner for p in self.parts)

    @property
    def sites(self):
        return [p.site for p in self.parts if p.site is not None]


def find_stitches(graph, sites, projection_pays):
    """The stitchable concatenations of a tf.Graph holding the captured graph.
    projection_pays(stitch): whether K-packing would make the stitch's projection."""
    reaches = {}   # tensor name -> (site, reshape chain) for exclusively used site outputs
    for site in sites:
        tensor, chain = graph.get_tensor_by_name(site.output), []
        while True:
            consumers = tensor.consumers()
            if len(consumers) != 1 or len(consumers[0].inputs) == 0:
                break
            node = consumers[0]
            if (node.type not in _RESHAPES or node._control_outputs or
                    [x.name for x in node.inputs].count(tensor.name) != 1 or
                    node.inputs[0].name != tensor.name):
                break
            chain.append(node.name)
            tensor = node.outputs[0]
        reaches[tensor.name] = (site, chain)
    twins = {}   # (input, columns) pairs -> the Stitch of every concatenation made of them
    for node in graph.get_operations():
        if node.type in ("ConcatV2", "Pack") and not node._control_outputs:
            stitch = _stitch_of(node, reaches)
            if stitch is not None:
                key = tuple((p.tensor, p.inner) for p in stitch.parts)
                if key in twins:
                    twins[key].outputs += stitch.outputs
                else:
                    twins[key] = stitch
    stitches = list(twins.values())
    # A site is stitched only where every use of it is in this stitch's concatenations.
    for stitch in stitches:
        nodes = sorted(o.node for o in stitch.outputs)
        for part in stitch.parts:
            if part.site and sorted(c.name for c in graph.get_tensor_by_name(part.tensor).consumers()) != nodes:
                part.site, part.chain = None, []
    # The projection kernels take no per-id weights: where a concatenation would be a
    # projection but for weighted sites (weighted or masked poolings), those are copied in.
    for stitch in stitches:
        weighted = [p for p in stitch.parts if p.site is not None and p.site.weights]
        if weighted and len(weighted) < len(stitch.sites):
            projection = _projection_of(graph, stitch, weights=True)
            if projection and projection_pays(dataclasses.replace(stitch, projection=projection)):
                for part in weighted:
                    part.site, part.chain = None, []
    # A table's sites must all go to one lookup op (one stitch, or the group's own
    # lookup): then its gradient comes from one op, each row once, summed in the order
    # of the model's own gradient. Sites of tables split otherwise are copied in.
    destination = {id(site): None for site in sites}
    for k, stitch in enumerate(stitches):
        for site in stitch.sites:
            destination[id(site)] = k
    per_table = {}
    for site in sites:
        per_table.setdefault(site.table, set()).add(destination[id(site)])
    for stitch in stitches:
        for part in stitch.parts:
            if part.site is not None and len(per_table[part.site.table]) > 1:
                part.site, part.chain = None, []
    stitches = [s for s in stitches if s.sites]
    for stitch in stitches:
        stitch.projection = _projection_of(graph, stitch)
    return stitches


def _projection_of(graph, stitch, weights=False):
    """The stitch's MatMul, if its one concatenation feeds nothing else and no site has
    per-id weights (the projection kernels take none; `weights`: whatever the sites')."""
    if len(stitch.outputs) != 1 or stitch.outputs[0].shape[1:] != [stitch.width] or (
            not weights and any(site.weights for site in stitch.sites)):
        return None
    tensor = graph.get_tensor_by_name(stitch.outputs[0].tensor)
    consumers = tensor.consumers()
    if len(consumers) != 1 or consumers[0].type != "MatMul" or consumers[0]._control_outputs:
        return None
    matmul = consumers[0]
    kernel = matmul.inputs[1]
    units = kernel.shape[1] if kernel.shape.rank == 2 and kernel.shape[0] == stitch.width else None
    if (matmul.get_attr("transpose_a") or matmul.get_attr("transpose_b") or
            matmul.inputs[0].name != tensor.name or kernel.name == tensor.name or
            units is None or units < 1):
        return None
    return StitchProjection(matmul.name, matmul.outputs[0].name, kernel.name, units)


def _stitch_of(node, reaches):
    out = node.outputs[0]
    if not out.dtype.is_floating or out.shape.rank is None:
        return None
    if node.type == "ConcatV2":
        inputs, axis_op = list(node.inputs[:-1]), node.inputs[-1].op
        if axis_op.type != "Const":
            return None
        axis = int(tf.make_ndarray(axis_op.get_attr("value")))
        rank = out.shape.rank
    else:
        inputs, axis, rank = list(node.inputs), node.get_attr("axis"), out.shape.rank
    axis = axis + rank if axis < 0 else axis
    output_shape = out.shape.as_list()
    if output_shape.count(None) > 1:
        return None
    names = [x.name for x in inputs]
    parts = []
    for x in inputs:
        dims = x.shape.as_list()[axis:] if x.shape.rank is not None else [None]
        if None in dims:
            return None
        inner = math.prod(dims)
        site, chain = reaches.get(x.name, (None, []))
        fits = (site is not None and names.count(x.name) == 1 and inner % site.dim == 0
                and site.dtype == out.dtype)
        parts.append(StitchPart(x.name, inner, site if fits else None, chain if fits else []))
    if not any(p.site for p in parts) or any(p.inner == 0 for p in parts):
        return None
    return Stitch([StitchOutput(node.name, out.name, [-1 if d is None else d for d in output_shape])], parts)
