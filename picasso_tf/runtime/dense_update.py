"""The Keras optimizer's update of the dense variables (every trained variable but the
fused tables), as one fused op per dtype instead of Keras' few ops per variable.

Keras' ``apply_gradients`` issues, per variable, the reads, element-wise ops and
assignments of its ``update_step`` (about five to ten ops each); a model with many
small Dense layers (MMoE's experts and towers) spends hundreds of ops of its step
there. ``FusedDenseUpdate`` runs the same update for all of them in one
``picasso_tf.ops.dense_apply`` op per dtype, on the Keras optimizer's own slot
variables, with the hyper-parameters of the fused row-sparse updates
(picasso_tf.embedding.row_sparse_optimizers); every element follows Keras' dense
branch in its float operation order. It does what Keras' ``apply_gradients`` does
around the update: evaluates a LearningRateSchedule at ``optimizer.iterations`` (and
keeps Keras' current learning rate), applies the decoupled weight decay (not to the
variables ``exclude_from_weight_decay`` names), then each variable's constraint, and
advances ``optimizer.iterations`` once.

A table read whole by its embedding regulariser (DeepCTR's default) has a dense
gradient that TensorFlow builds as AddN(UnsortedSegmentSum(rows of its lookup),
Mul(table, scale)) (Keras' L2 regulariser's): three passes over the table besides
the update's. Where the fused update finds it so (``_gradient_parts``), it hands the
op those parts, which it sums itself to the bit, and those ops do not run. A gradient
summed otherwise reaches the op as it is: over micro-batches (each adds its own
regulariser's term) or averaged over Horovod ranks (their Allreduce takes it dense).

What it does not fuse goes to Keras' ``apply_gradients`` in the same step: variables
of other dtypes than float32 and float64, and gradients that are ``tf.IndexedSlices``
(tables left unpacked). It stands down for the whole step, with the reason in the
report (``model.picasso.report()``'s optimizer line), where Keras does something it
does not: gradient clipping, ``use_ema``, an update compiled with XLA
(``jit_compile``, on GPUs), several replicas of a tf.distribute strategy,
LossScaleOptimizer (mixed precision), legacy optimizers, other optimizer classes, and
subclasses that override ``update_step`` or a step of ``apply_gradients``.
"""
import collections

import tensorflow as tf

from picasso_tf.embedding.row_sparse_optimizers import RowSparseOptimizer, UnsupportedOptimizerError
from picasso_tf.ops import dense_apply
from picasso_tf.runtime.fused_update import READS, _captured_from

FUSED_DTYPES = (tf.float32, tf.float64)
# The steps of Keras' apply_gradients that the fused update replaces (update_step is
# checked with the optimizer's family): a subclass overriding one of them changes it.
REPLACED_KERAS_STEPS = ("apply_gradients", "_internal_apply_gradients", "_distributed_apply_gradients_fn",
                        "_apply_weight_decay", "_update_step", "_compute_current_learning_rate")
_FALLBACK = "the dense variables are updated by the Keras optimizer's apply_gradients"


class KerasDenseUpdate:
    """The Keras optimizer's own apply_gradients, which also advances
    optimizer.iterations (alone when no variable has a gradient)."""

    def apply(self, optimizer, grads_and_vars):
        if not grads_and_vars:
            return optimizer.iterations.assign_add(1)
        # With only dense gradients, Keras' aggregation goes through an all_reduce
        # under @tf.custom_gradient, which registers a gradient function holding
        # the whole step graph in TF's global registry at every trace (a leak of
        # each optimize + fit). Across one replica that sum is the identity.
        one_replica = tf.distribute.get_replica_context().num_replicas_in_sync == 1
        return optimizer.apply_gradients(grads_and_vars, experimental_aggregate_gradients=not one_replica)


class FusedDenseUpdate(KerasDenseUpdate):
    """Keras' update of the dense variables in one op per dtype (module docstring);
    what it does not fuse goes to the Keras optimizer, which advances its iterations."""

    def __init__(self, optimizer):
        self.rows = RowSparseOptimizer.from_keras(optimizer, dense_gradients=True, fallback=_FALLBACK)

    def apply(self, optimizer, grads_and_vars):
        fused = [(g, v) for g, v in grads_and_vars if _fusable(g, v)]
        if not fused:
            return super().apply(optimizer, grads_and_vars)
        keras = [(g, v) for g, v in grads_and_vars if not _fusable(g, v)]
        if not keras:
            # Keras' apply_gradients keeps the schedule's current value in a variable.
            optimizer._compute_current_learning_rate()
        by_dtype = collections.defaultdict(list)
        for grad, var in fused:
            by_dtype[var.dtype].append((grad, var))
        # The update reads optimizer.iterations before Keras (or the step) advances it.
        updates = [self._apply_one_dtype(pairs, optimizer.iterations) for pairs in by_dtype.values()]
        with tf.control_dependencies(updates):
            # As Keras does after its update: a variable's constraint.
            updates += [v.assign(v.constraint(v)) for _, v in fused if v.constraint is not None]
        with tf.control_dependencies(updates):
            return super().apply(optimizer, keras)

    def _apply_one_dtype(self, grads_and_vars, iteration):
        variables = [v for _, v in grads_and_vars]
        updates = self.rows.updates(variables, [self.rows.keras_slots(v) for v in variables], iteration,
                                    [True] * len(variables))
        decayed = [self.rows.applies_weight_decay_to(v) for v in variables]
        grads, rows, scaled = zip(*(_gradient_parts(g, v) for g, v in grads_and_vars))
        return dense_apply.apply(variables, grads, updates, decayed, rows=rows, scaled=scaled,
                                 name="picasso_dense_apply")


def _fusable(grad, var):
    return not isinstance(grad, tf.IndexedSlices) and var.dtype in FUSED_DTYPES and "GPU" not in var.device


def _gradient_parts(grad, var):
    """(dense, rows, scaled): var's gradient in the parts dense_apply.apply takes, where
    TensorFlow built it from them and nothing else reads them (their ops then do not
    run): AddN(UnsortedSegmentSum(rows.values, rows.indices, num_rows), dense) (how
    tf.gradients and tf.add_n add a tf.IndexedSlices to a tensor), and a dense part that
    is Mul(var's value, scale) becomes the scale, with scaled=True. Else (grad, None,
    False)."""
    if tf.executing_eagerly() or not isinstance(grad, tf.Tensor) or grad.consumers():
        return grad, None, False
    dense, rows = grad, None
    inputs = list(grad.op.inputs)
    if grad.op.type == "AddN" and len(inputs) == 2:
        for part, other in (inputs, inputs[::-1]):
            if part.op.type == "UnsortedSegmentSum" and part.op.inputs[1].shape.rank == 1 and \
                    part.consumers() == [grad.op]:
                dense, rows = other, tf.IndexedSlices(part.op.inputs[0], part.op.inputs[1])
                break
    scale = _scale(dense, var) if all(op is grad.op for op in dense.consumers()) else None
    return (dense, rows, False) if scale is None else (scale, rows, True)


def _scale(dense, var):
    """s where `dense` is Mul(var's value, scalar s), the value read in a graph that does
    not write var (its handle has only readers): the value var has when the update
    runs. Else None."""
    if dense.op.type != "Mul":
        return None
    inputs = list(dense.op.inputs)
    for value, scale in (inputs, inputs[::-1]):
        if scale.shape.rank == 0 and value.op.type in READS:
            handle = value.op.inputs[value.value_index]
            if _captured_from(handle) is var.handle and all(op.type in READS for op in handle.consumers()):
                return scale
    return None


def make_dense_update(optimizer, config):
    """(the update of the dense variables, a note for the report)."""
    if not (config.packing and config.fused_dense_optimizer):
        option = "packing=False" if not config.packing else "fused_dense_optimizer=False"
        return KerasDenseUpdate(), f"dense variables: Keras' apply_gradients ({option})"
    reason = _stand_down_reason(optimizer)
    if reason is None:
        try:
            with tf.init_scope():
                update = FusedDenseUpdate(optimizer)
            return update, (f"dense variables: fused {type(optimizer).__name__}, one op per dtype "
                            "(other dtypes and sparse gradients: Keras' apply_gradients)")
        except UnsupportedOptimizerError as e:
            reason = str(e)
    return KerasDenseUpdate(), f"dense variables: Keras' apply_gradients, the fused update stands down: {reason}"


def horovod_wrapped(optimizer):
    """The Keras optimizer class under Horovod's hvd.DistributedOptimizer, else None.
    picasso_tf's step averages the gradients over the ranks itself (step.py's exchange),
    so the wrapper's own Allreduce has nothing left to do; not with its local gradient
    accumulation (backward_passes_per_step > 1), which changes the update."""
    if hasattr(optimizer, "_allreduce_grads") and getattr(optimizer, "_agg_helper", None) is None:
        return type(optimizer).__mro__[1]
    return None


def _stand_down_reason(optimizer):
    """Why Keras' apply_gradients would do something the fused update does not, else None."""
    name = type(optimizer).__name__
    if isinstance(optimizer, tf.keras.mixed_precision.LossScaleOptimizer):
        return (f"{name} (mixed precision) scales the loss and unscales the gradients around its inner "
                "optimizer's update")
    clipping = [f"{o}={getattr(optimizer, o)}" for o in ("clipnorm", "clipvalue", "global_clipnorm")
                if getattr(optimizer, o, None)]
    if clipping:
        return f"the {name} optimizer clips gradients ({', '.join(clipping)})"
    if getattr(optimizer, "use_ema", False):
        return f"the {name} optimizer keeps a moving average of the variables (use_ema=True)"
    if getattr(optimizer, "jit_compile", False):
        return f"the {name} optimizer compiles its update with XLA (jit_compile=True, on a GPU)"
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if replicas != 1:
        return f"{replicas} replicas of a tf.distribute strategy aggregate the gradients in apply_gradients"
    if isinstance(optimizer, tf.keras.optimizers.Optimizer) and not isinstance(
            optimizer, tf.keras.optimizers.legacy.Optimizer):
        base = tf.keras.optimizers.Optimizer
        keras_class = horovod_wrapped(optimizer) or type(optimizer)
        overridden = [m for m in REPLACED_KERAS_STEPS
                      if getattr(keras_class, m, None) is not getattr(base, m, None)]
        if overridden:
            return f"{name} overrides {', '.join(overridden)} of the Keras optimizer"
    return None
