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
class Stitch:
    node: str                   # the ConcatV2 / Pack node
    output: str                 # its output tensor
    output_shape: List[int]     # static, -1 for the one unknown dimension
    parts: List[StitchPart]

    @property
    def width(self):
        return sum(p.inner for p in self.parts)

    @property
    def sites(self):
        return [p.site for p in self.parts if p.site is not None]


def find_stitches(graph, sites):
    """The stitchable concatenations of a tf.Graph holding the captured graph."""
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
    stitches = [_stitch_of(node, reaches) for node in graph.get_operations()
                if node.type in ("ConcatV2", "Pack") and not node._control_outputs]
    stitches = [s for s in stitches if s is not None]
    # A table's sites must all go to one lookup op (one stitch, or the group's own
    # lookup): then its gradient comes from one op, each row once, summed in the order
    # of the model's own gradient. Sites of tables split otherwise are copied in.
    destination = {id(site): None for site in sites}
    for stitch in stitches:
        for site in stitch.sites:
            destination[id(site)] = stitch.node
    per_table = {}
    for site in sites:
        per_table.setdefault(site.table, set()).add(destination[id(site)])
    for stitch in stitches:
        for part in stitch.parts:
            if part.site is not None and len(per_table[part.site.table]) > 1:
                part.site, part.chain = None, []
    return [s for s in stitches if s.sites]


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
        exclusive = (site is not None and len(x.consumers()) == 1 and names.count(x.name) == 1
                     and inner % site.dim == 0 and site.dtype == out.dtype)
        parts.append(StitchPart(x.name, inner, site if exclusive else None, chain if exclusive else []))
    if not any(p.site for p in parts) or any(p.inner == 0 for p in parts):
        return None
    return Stitch(node.name, out.name, [-1 if d is None else d for d in output_shape], parts)
