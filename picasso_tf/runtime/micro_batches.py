"""D-interleaving (paper §III-C, Fig. 8b): one training step over K micro-batches.

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
"""
import tensorflow as tf

from picasso_tf.errors import UnsupportedModelError

# Keras losses whose value is a mean over the batch's elements: a micro-batch's mean,
# weighted by its share of the batch, sums to the batch's.
MEAN_REDUCTIONS = ("auto", "sum_over_batch_size")


def run_micro_batches(step, optimizer, forward_and_loss, data, k):
    """Trains one step of `step` (a TrainingStep) over k micro-batches of `data`
    ((x, y, sample_weight)); forward_and_loss(x, y, sample_weight) gives a micro-batch's
    (predictions, mean loss). Returns the whole batch's predictions."""
    parts, shares = split_batch(data, k)
    gradients, predictions, losses = [], [], []
    for i, ((x, y, sample_weight), share) in enumerate(zip(parts, shares)):
        ready = losses[-1:] + (_computed(gradients[-2]) if i >= 2 else [])
        with tf.control_dependencies(ready), tf.name_scope(f"picasso_micro_batch_{i}"):
            x = tf.nest.map_structure(_identity, x)
        y_pred, loss = forward_and_loss(x, y, sample_weight)
        _refuse_masked(y_pred, k)
        gradients.append(step.backward(loss * tf.cast(share, loss.dtype), optimizer.iterations))
        predictions.append(y_pred)
        losses.append(loss)
    step.apply(optimizer, step.exchange(step.accumulate(gradients)))
    return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *predictions)


def split_batch(structure, k):
    """([structure's rows of micro-batch i] for i < k, [its share of the batch])."""
    rows = _batch_size(next(t for t in tf.nest.flatten(structure) if t is not None))
    bounds = [(rows * i) // k for i in range(k + 1)]
    parts = [tf.nest.map_structure(lambda t, b=b, e=e: _rows(t, b, e), structure)
             for b, e in zip(bounds[:-1], bounds[1:])]
    total = tf.cast(tf.maximum(rows, 1), tf.float64)
    shares = [tf.cast(e - b, tf.float64) / total for b, e in zip(bounds[:-1], bounds[1:])]
    return parts, shares


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


def _rows(tensor, begin, end):
    if tensor is None:
        return None
    if isinstance(tensor, tf.SparseTensor):
        rank = tf.size(tensor.dense_shape)
        start = tf.concat([[tf.cast(begin, tf.int64)], tf.zeros([rank - 1], tf.int64)], 0)
        size = tf.concat([[tf.cast(end - begin, tf.int64)], tensor.dense_shape[1:]], 0)
        return tf.sparse.slice(tensor, start, size)
    return tensor[begin:end]


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
