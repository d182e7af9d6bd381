"""The cut of D-interleaving from the MLP (paper Fig. 8a): a forward GraphDef split at
the outputs of its fused lookups into the embedding part, which runs on the whole
batch, and the dense part, which runs per micro-batch with those outputs fed in."""
import tensorflow as tf

from picasso_tf.graph.graph_def_util import GraphIndex, canonical, prune, rewire, split_tensor_name, unique_name


def lookup_outputs(graph_def, nodes):
    """The outputs of the nodes named in `nodes` that other nodes consume, sorted."""
    index, nodes = GraphIndex(graph_def), set(nodes)
    return sorted(t for t, uses in index.consumers.items() if split_tensor_name(t)[0] in nodes and uses)


def embedding_part(graph_def, cut, keep):
    """graph_def pruned to what computes the `cut` tensors, the `keep` nodes kept."""
    return prune(graph_def, cut, keep=keep)


def dense_part(captured, cut, embeddings):
    """(the CapturedGraph whose every consumer of a cut tensor reads a new placeholder
    instead, pruned to the outputs; those placeholders, aligned with cut). The
    placeholders take the dtype and the non-batch shape of `embeddings`, the cut
    tensors' values on a batch."""
    graph_def = type(captured.graph_def)()
    graph_def.CopyFrom(captured.graph_def)
    placeholders = []
    for tensor, value in zip(cut, embeddings):
        node = graph_def.node.add()
        node.name = unique_name(graph_def, "picasso_cut/" + split_tensor_name(tensor)[0].replace("/", "_"))
        node.op = "Placeholder"
        node.attr["dtype"].type = value.dtype.as_datatype_enum
        node.attr["shape"].shape.CopyFrom(tf.TensorShape([None]).concatenate(value.shape[1:]).as_proto())
        placeholders.append(f"{node.name}:0")
    replacements = {canonical(t): p for t, p in zip(cut, placeholders)}
    dense = captured.with_graph(rewire(graph_def, replacements, set()), replacements, captured.captures)
    needed = dense.output_tensors + dense.mask_tensors + dense.logit_tensors + (
        [dense.regularization_loss] if dense.regularization_loss else [])
    return dense.with_graph(prune(dense.graph_def, needed, keep=captured.input_tensors), {}, dense.captures), placeholders
