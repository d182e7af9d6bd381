"""The rewritten model at run time: forward pass and the gradient/apply half of a step.

Forward imports the rewritten GraphDef into the function being traced. Gradients come
from tf.gradients (the tape does not see imported ops). Embedding tables (packed or
not) always receive row-sparse gradients (tf.IndexedSlices); a dense gradient for a
table is a bug and stops the trace instead of silently densifying the table.
"""
import tensorflow as tf

from picasso_tf.graph.rebuild import conform_inputs, import_forward
from picasso_tf.ops.in_gradient import update_tables_in_gradient
from picasso_tf.runtime.fused_update import InGradientUpdates


class RewrittenForward:
    """Calls a rewritten CapturedGraph on a batch of features."""

    def __init__(self, captured):
        self.captured = captured

    def __call__(self, inputs):
        c = self.captured
        outs, masks = c.output_tensors, c.mask_tensors
        names = outs + masks + ([c.regularization_loss] if c.regularization_loss else [])
        tensors = import_forward(c.graph_def, c.input_tensors, conform_inputs(c.input_specs, inputs),
                                 c.captures, names)
        flat_outputs = tensors[:len(outs)]
        mask_values = iter(tensors[len(outs):len(outs) + len(masks)])
        for tensor, mask in zip(flat_outputs, c.output_masks):
            if mask:
                tensor._keras_mask = next(mask_values)  # Keras weights the loss by an output's mask
        outputs = tf.nest.pack_sequence_as(c.output_structure, flat_outputs)
        reg = tensors[-1] if c.regularization_loss else None
        return outputs, reg

    @property
    def variables(self):
        return list(self.captured.variables.values())


class GradientApplier:
    """Differentiates a loss with tf.gradients and applies the updates: packed tables
    through the fused row-sparse optimizer when one serves, everything else through
    the user's Keras optimizer."""

    def __init__(self, trainable, table_variables, fused=None, densely_read=()):
        self.trainable = list(trainable)
        # Tables whose whole value the model itself reads (e.g. a regularizer) get dense
        # gradients in the original model too; any other table's must stay row-sparse.
        self.tables = {v.ref() for v in table_variables} - {v.ref() for v in densely_read}
        self.fused = fused          # picasso_tf.runtime.fused_update.FusedTableUpdate or None

    def gradients(self, loss):
        grads = tf.gradients(loss, self.trainable)
        for var, grad in zip(self.trainable, grads):
            if var.ref() in self.tables and grad is not None and not isinstance(grad, tf.IndexedSlices):
                raise AssertionError(f"picasso_tf: the gradient of embedding table {var.name} became dense "
                                     f"({grad.op.type}); please report this model")
        return grads

    def apply(self, optimizer, loss):
        """Adds the step's updates; returns the tables updated inside their gradient kernels."""
        if self.fused is None:
            optimizer.apply_gradients([(g, v) for g, v in zip(self.gradients(loss), self.trainable)
                                       if g is not None])
            return []
        # Tables that a fused gradient kernel updates itself get no gradient here.
        in_gradient = InGradientUpdates(self.fused, optimizer.iterations) if self.fused.in_gradient else None
        with update_tables_in_gradient(in_gradient):
            grads = self.gradients(loss)
        pairs = [(g, v) for g, v in zip(grads, self.trainable) if g is not None]
        fused = [(g, v) for g, v in pairs if self.fused.handles(v)]
        rest = [(g, v) for g, v in pairs if not self.fused.handles(v)]
        # The fused updates read optimizer.iterations before Keras increments it, so both
        # halves of the step use the same step count.
        update = tf.group([self.fused.apply(fused, optimizer.iterations)] + (in_gradient.ops if in_gradient else []))
        with tf.control_dependencies([update]):
            if rest:
                optimizer.apply_gradients(rest)
            else:
                optimizer.iterations.assign_add(1)
        return in_gradient.variables if in_gradient else []

