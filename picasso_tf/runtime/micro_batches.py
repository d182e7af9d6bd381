"""D-interleaving (paper §III-C, Fig. 8): one training step over K micro-batches.

The batch is split along its first axis into K micro-batches whose sizes differ by at
most one (a batch smaller than K leaves some empty). Each runs the rewritten forward
pass and its own backward; TrainingStep.accumulate sums the K gradients (row-sparse
ones per id) and they are applied once. Each micro-batch's mean loss is weighted by its
share of the batch, so the step equals the whole batch's up to summation order.

Micro-batch i+1's inputs wait for micro-batch i's loss and micro-batch i-1's
gradients: the micro-batches run one after another, each one's lookups and forward
free to overlap the previous one's backward (TensorFlow's inter-op threads schedule
them), and at most two micro-batches' activations are alive at once instead of the
whole batch's (benchmarks/micro_batch_memory.py measures the peak).

From the embedding layer (Fig. 8b, the default) each micro-batch runs the whole
model, its lookups included. From the MLP (Fig. 8a, EmbeddingCut) the fused lookups
and the pooling of their outputs run once on the whole batch and the micro-batches
share the pooled embeddings: the lookups' backward runs once and the tables' row
gradients need no summing across micro-batches.
"""
import copy

import tensorflow as tf

from picasso_tf.errors import UnsupportedModelError
from picasso_tf.graph.cut import cut_tensors, dense_part, embedding_part
from picasso_tf.graph.graph_def_util import split_tensor_name
from picasso_tf.graph.rebuild import conform_inputs, import_forward

# Keras losses whose value is a mean over the batch's elements: a micro-batch's mean,
# weighted by its share of the batch, sums to the batch's.
MEAN_REDUCTIONS = ("auto", "sum_over_batch_size")


def run_micro_batches(step, optimizer, forward_and_loss, data, k, cut=None):
    """Trains one step of `step` (a TrainingStep) over k micro-batches of `data`
    ((x, y, sample_weight)); forward_and_loss(x, y, sample_weight, forward=None) gives a
    micro-batch's (predictions, mean loss), from the model's forward pass or, given a
    `forward`, from that one. With an EmbeddingCut (interleave_from="mlp") the fused
    lookups run once on the whole batch and only the rest per micro-batch. Returns the
    whole batch's predictions."""
    parts, shares, bounds = split_batch(data, k)
    embeddings = cut.embed(data[0]) if cut is not None else []
    sizes = tf.stack([e - b for b, e in bounds])
    cut_parts = [_parts(e, bounds, sizes) for e in embeddings]
    gradients, predictions, losses, embedding_grads = [], [], [], []
    for i, ((x, y, sample_weight), share) in enumerate(zip(parts, shares)):
        ready = losses[-1:] + (_computed(gradients[-2]) if i >= 2 else [])
        rows = [parts[i] for parts in cut_parts]
        with tf.control_dependencies(ready), tf.name_scope(f"picasso_micro_batch_{i}"):
            x = tf.nest.map_structure(_identity, x)
            # Stopped past the split: the split's gradient (a whole batch of zeros but
            # the micro-batch's rows) is not built only to be dropped.
            rows = [tf.stop_gradient(r) for r in rows]
        y_pred, loss = forward_and_loss(x, y, sample_weight, forward=cut.dense(rows) if cut is not None else None)
        _refuse_masked(y_pred, k)
        grads, rows_grads = _backward(step, loss * tf.cast(share, loss.dtype), optimizer.iterations, rows)
        gradients.append(grads)
        embedding_grads.append(rows_grads)
        predictions.append(y_pred)
        losses.append(loss)
    if cut is not None:
        gradients.append(_embedding_backward(step, optimizer, embeddings, embedding_grads))
    step.apply(optimizer, step.exchange(step.accumulate(gradients)))
    return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *predictions)


def _backward(step, loss, iteration, tensors):
    """(step.backward(loss), the gradients of loss with respect to `tensors`, zeros
    where it has none), from one tf.gradients call."""
    if not tensors:
        return step.backward(loss, iteration), []
    extended = copy.copy(step)
    extended.trainable = step.trainable + list(tensors)
    grads = extended.backward(loss, iteration)
    of = {id(t): g for g, t in grads.dense if any(t is x for x in tensors)}
    grads.dense = [(g, t) for g, t in grads.dense if id(t) not in of]
    return grads, [tf.convert_to_tensor(of[id(t)]) if id(t) in of else tf.zeros_like(t) for t in tensors]


def _embedding_backward(step, optimizer, embeddings, micro_batch_grads):
    """The embedding part's backward, once over the whole batch, from the cut tensors'
    gradients gathered from the micro-batches: each cut tensor enters the loss through
    a term whose gradient is the gathered one, so the lookups' backward takes it as
    their outputs' gradient. With the lookups read once in the step, their gradient
    kernels may update the tables (config.apply_in_gradient), as in a step without
    micro-batches."""
    terms = [_with_gradient(e, tf.concat(list(grads), 0))
             for e, *grads in zip(embeddings, *micro_batch_grads) if e.dtype.is_floating]
    one_stage = step.fused is not None and step.fused.in_gradient
    return step.backward(tf.add_n(terms), optimizer.iterations, fuse_apply=one_stage)


def _with_gradient(tensor, gradient):
    """A scalar zero whose gradient with respect to `tensor` is `gradient`, added
    unscaled into the loss tf.gradients starts from (its upstream gradient is one).
    Not sum(tensor * gradient): that product, the sum's broadcast gradient and their
    product each hold another whole batch of the cut tensor."""
    @tf.custom_gradient
    def term(t):
        return tf.zeros([], t.dtype), lambda upstream: gradient
    return term(tensor)


class EmbeddingCut:
    """interleave_from="mlp" (paper Fig. 8a): the rewritten forward pass (a
    RewrittenForward) cut where the embedding layer of the fused lookups named in
    `lookup_nodes` ends, their pooling included (graph/cut.py): the embedding part runs
    on the whole batch, the dense part on each micro-batch with its rows of the cut
    tensors."""

    def __init__(self, forward, lookup_nodes):
        self.forward = forward
        captured = forward.captured
        needed = captured.output_tensors + captured.mask_tensors + captured.logit_tensors + (
            [captured.regularization_loss] if captured.regularization_loss else [])
        self.tensors = cut_tensors(captured.graph_def, lookup_nodes, captured.input_tensors, needed)
        self.embedding_graph = embedding_part(captured.graph_def, self.tensors, keep=captured.input_tensors)
        self.dense_graph = None

    def embed(self, features):
        """The cut tensors' values on the whole batch."""
        c = self.forward.captured
        return import_forward(self.embedding_graph, c.input_tensors, conform_inputs(c.input_specs, features),
                              _present(self.embedding_graph, self.forward.captures), self.tensors,
                              name="picasso_embedding")

    def dense(self, rows):
        """A RewrittenForward of the dense part, with `rows` (a micro-batch's rows of the
        cut tensors) fed in."""
        if self.dense_graph is None:
            self.dense_graph, self.placeholders = dense_part(self.forward.captured, self.tensors, rows)
        forward = copy.copy(self.forward)
        forward.captured = self.dense_graph
        forward.captures = _present(self.dense_graph.graph_def, {**self.forward.captures,
                                                                 **dict(zip(self.placeholders, rows))})
        return forward


def embedding_cut(forward, program, config):
    """The EmbeddingCut of interleave_from="mlp", else None (also with no fused lookups:
    then every lookup is part of the micro-batches, as interleave_from="embedding")."""
    nodes = [r.node for r in program.lookups.get("training", [])]
    return EmbeddingCut(forward, nodes) if config.interleave_from == "mlp" and nodes else None


def _present(graph_def, captures):
    """The entries of captures whose placeholder graph_def still has."""
    names = {n.name for n in graph_def.node}
    return {t: v for t, v in captures.items() if split_tensor_name(t)[0] in names}


def split_batch(structure, k):
    """([structure's rows of micro-batch i], [its share of the batch], [its (begin, end)
    rows]) for i < k."""
    rows = _batch_size(next(t for t in tf.nest.flatten(structure) if t is not None))
    bounds = [(rows * i) // k for i in range(k + 1)]
    bounds = list(zip(bounds[:-1], bounds[1:]))
    sizes = tf.stack([e - b for b, e in bounds])
    flat = [_parts(t, bounds, sizes) for t in tf.nest.flatten(structure)]
    parts = [tf.nest.pack_sequence_as(structure, [p[i] for p in flat]) for i in range(k)]
    total = tf.cast(tf.maximum(rows, 1), tf.float64)
    shares = [tf.cast(e - b, tf.float64) / total for b, e in bounds]
    return parts, shares, bounds


def check_losses(compiled_loss, k):
    """Refuses losses that are not means over the batch (their micro-batch parts would
    not sum to the batch's)."""
    refusal = loss_refusal(compiled_loss)
    if refusal:
        raise ValueError(
            f"picasso_tf: micro_batches={k} splits the batch, and {refusal}, so its micro-batch parts would not "
            "add up to the batch's loss. Use a mean reduction (Keras' default), or micro_batches=1.")


def loss_refusal(compiled_loss):
    """Why the compiled loss cannot be split into micro-batches, or None."""
    for loss in tf.nest.flatten(getattr(compiled_loss, "_losses", None) or []):
        reduction = getattr(loss, "reduction", "auto")
        if reduction not in MEAN_REDUCTIONS:
            return (f"the loss {getattr(loss, 'name', loss)!r} has reduction={reduction!r}, not a mean over "
                    "the batch")
    return None


def _batch_size(tensor):
    if isinstance(tensor, tf.RaggedTensor):
        return tensor.nrows(out_type=tf.int32)
    if isinstance(tensor, tf.SparseTensor):
        return tf.cast(tensor.dense_shape[0], tf.int32)
    return tf.shape(tensor, out_type=tf.int32)[0]


def _parts(tensor, bounds, sizes):
    """tensor's rows [begin, end) for each (begin, end) of `bounds` (`sizes`: their end - begin)."""
    if tensor is None:
        return [None] * len(bounds)
    if isinstance(tensor, tf.SparseTensor):
        rank = tf.size(tensor.dense_shape)
        return [tf.sparse.slice(tensor, tf.concat([[tf.cast(b, tf.int64)], tf.zeros([rank - 1], tf.int64)], 0),
                                tf.concat([[tf.cast(e - b, tf.int64)], tensor.dense_shape[1:]], 0))
                for b, e in bounds]
    if isinstance(tensor, tf.RaggedTensor):
        return [tensor[b:e] for b, e in bounds]
    # One split for all micro-batches: a slice per micro-batch and feature is an op each,
    # with three more packing its bounds, over hundreds of features.
    return tf.split(tensor, sizes, axis=0, num=len(bounds))


def _refuse_masked(y_pred, k):
    # Keras weights metrics by an output's mask, which the whole batch's predictions,
    # concatenated from the micro-batches', would not carry.
    if any(getattr(t, "_keras_mask", None) is not None for t in tf.nest.flatten(y_pred)):
        raise UnsupportedModelError(
            f"picasso_tf: micro_batches={k}: the model's output carries a Keras mask, which its metrics are "
            "weighted by and the micro-batches' concatenated predictions would not carry. Use micro_batches=1 "
            "for this model.")


def _computed(gradients):
    """The tensors of a micro-batch's Gradients: once they exist, its backward is done."""
    return [t for grad, _ in gradients.tables + gradients.dense
            for t in ((grad.values, grad.indices) if isinstance(grad, tf.IndexedSlices) else (grad,))]


def _identity(tensor):
    if isinstance(tensor, (tf.RaggedTensor, tf.SparseTensor)):
        return tf.nest.map_structure(tf.identity, tensor, expand_composites=True)
    return tf.identity(tensor)
