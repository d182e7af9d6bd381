"""A model's own Keras steps (train_step, test_step, predict_step, compute_loss,
compute_metrics), run with the rewritten forward pass inside them.

A TensorFlow Recommenders model, or any model with its own step, keeps its step: the
PicassoModel runs the original model's method on the original model, bound for the
call to what the PicassoModel holds: its `call` is the rewritten forward pass (which a
tf.GradientTape differentiates, picasso_tf.runtime.tape), and its optimizer, compiled
loss and metrics are the ones the user compiled the PicassoModel with. The variables,
metrics and attributes the step reads (`self.trainable_variables`, `self.task`, ...)
are the original's own.
"""
import contextlib

import tensorflow as tf
from keras.src.saving.legacy.saved_model.utils import no_automatic_dependency_tracking_scope

from picasso_tf.errors import UnsupportedModelError

KERAS_STEPS = ("train_step", "test_step", "predict_step", "compute_loss", "compute_metrics")

# What the PicassoModel lends the original for the length of one of its steps.
_LENT = ("optimizer", "compiled_loss", "compiled_metrics", "loss", "_is_compiled", "_run_eagerly", "_jit_compile")


def own_keras_steps(original):
    """The Keras steps `original`'s class overrides."""
    return [name for name in KERAS_STEPS if getattr(type(original), name) is not getattr(tf.keras.Model, name)]


def check_own_steps(original, own, config):
    """Refuses what a model's own steps cannot be run with."""
    if not own:
        return
    trains = {"train_step", "compute_loss"} & set(own)
    if trains and config.micro_batches != 1:
        raise UnsupportedModelError(
            f"picasso_tf: {type(original).__name__} overrides keras.Model.{', '.join(sorted(trains))}, and "
            f"micro_batches={config.micro_batches!r} splits the batch inside picasso_tf's own training step, which "
            "a model's own step replaces (and its loss need not be a mean over the batch); use micro_batches=1")


def check_no_activity_losses(original, own):
    """A model's own step reads `self.losses` of the original model, which the rewritten
    forward pass (run in its stead) does not add to: refused where the forward pass adds
    losses of its own (activity regularisers, add_loss in call). Called right after the
    forward pass was traced, when the trace's losses are still the layers' last."""
    if not own:
        return
    added = [layer.name for layer in original._flatten_layers() if layer._eager_losses]
    if added:
        raise UnsupportedModelError(
            f"picasso_tf: {type(original).__name__} overrides keras.Model.{', '.join(own)}, and its forward pass adds "
            f"losses of its own (add_loss or an activity regulariser in {', '.join(added)}), which the model's own "
            "step would not see through the rewritten forward pass. Use Keras' standard steps with compile(loss=...), "
            "or move the penalty into the step's loss, or train without picasso_tf.optimize")


@contextlib.contextmanager
def bound(picasso_model, rewritten_call):
    """`picasso_model.original`, whose `call` is `rewritten_call` and whose optimizer,
    compiled loss and metrics are `picasso_model`'s, for the length of the block."""
    original = picasso_model.original
    lent = {name: getattr(picasso_model, name) for name in _LENT if hasattr(picasso_model, name)}
    # The rewritten graph casts the inputs where the original's own __call__ did.
    lent.update(call=rewritten_call, _autocast=False)
    own = _swap(original, lent)
    _swap(original, {_OWN: own})
    # The trace's losses would be read by a step that calls self.losses before self().
    original._clear_losses()
    try:
        yield original
    finally:
        _swap(original, {**own, _OWN: None})


@contextlib.contextmanager
def as_written(original):
    """`original` as its user wrote it for the length of the block, inside a bound step
    too: the rewrite traces its own call."""
    own = original.__dict__.get(_OWN)
    if own is None:
        yield original
        return
    lent = _swap(original, own)
    try:
        yield original
    finally:
        _swap(original, lent)


_OWN = "_picasso_own_attributes"     # on a bound original: what its binding replaced


def _swap(original, values):
    """Sets `values` (None: no instance attribute) on `original` without tracking them;
    returns what they replaced, to swap back."""
    replaced = {name: original.__dict__.get(name) for name in values}
    with no_automatic_dependency_tracking_scope(original):
        for name, value in values.items():
            if value is not None:
                setattr(original, name, value)
            elif name in original.__dict__:
                delattr(original, name)
    return replaced
