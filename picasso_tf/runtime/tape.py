"""The rewritten forward pass on tf.GradientTape.

The rewritten graph is imported into the function being traced (graph/rebuild.py), and
a tape records only ops made through TensorFlow's Python API: the imported ops are
invisible to it. So the forward pass tells the tapes what a plain model's forward
pass would: the variables it reads were accessed (a tape watching accessed variables
watches them, as it does a read of a variable), and the whole imported forward is one
recorded operation from the features and those variables' handles (as a variable read
records its handle) to the outputs and the regularisation loss. Its backward is
tf.gradients over the imported ops, which carry their registered gradients: row-sparse
tf.IndexedSlices for the tables, as the plain model's lookups give; inside
`updating_in_gradient` (model.picasso.fused_gradients) the kernels update their tables
instead, as fit's step does.

Called eagerly, the forward runs as a tf.function: its call is differentiated by
TensorFlow through the function's graph, imported ops included, and the tapes learn
the variables read from the function's watched variables (recorded while tracing).
"""
import contextlib
import threading

import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.ops import resource_variable_ops

from picasso_tf.errors import UnsupportedModelError
from picasso_tf.ops.in_gradient import update_tables_in_gradient

_in_gradient = threading.local()


@contextlib.contextmanager
def updating_in_gradient(updates):
    """While active, a tape's gradient of the rewritten forward lets the fused gradient
    kernels update their tables (`updates`: a runtime.fused_update.InGradientUpdates,
    which collects the ops and the tables they updated; those get no gradient)."""
    previous = getattr(_in_gradient, "updates", None)
    _in_gradient.updates = updates
    try:
        yield updates
    finally:
        _in_gradient.updates = previous


def tape_is_recording():
    """Whether a tf.GradientTape (or any tape) is active in this thread."""
    return record.could_possibly_record()


def forward_for_tapes(forward, inputs, world, record_on_tapes=True):
    """(outputs, regularisation loss or None) of `forward` (a RewrittenForward) on
    `inputs`, seen by the active tapes as the plain model's forward pass would be.
    world: the ranks the model runs on. record_on_tapes=False while tracing the
    function an eager call runs (TensorFlow then differentiates the call itself)."""
    variables = forward.variables
    if tape_is_recording():
        refuse_ranks(world)
        refuse_storage_a_tape_cannot_see(forward)
    for variable in variables:
        resource_variable_ops.variable_accessed(variable)
    outputs, regularization = forward(inputs)
    if record_on_tapes and tape_is_recording():
        flat = tf.nest.flatten(outputs)
        # Keras' losses read an output's logits and mask, which the graph computes apart.
        attached = [t for o in flat for t in (getattr(o, "_keras_logits", None), getattr(o, "_keras_mask", None))
                    if t is not None and t.dtype.is_floating]
        _record(inputs, variables, flat + attached + ([regularization] if regularization is not None else []))
    return outputs, regularization


def refuse_ranks(world):
    """Under Horovod the hybrid plan's exchange runs in picasso_tf's own step: a tape
    (hvd.DistributedGradientTape) would have Horovod reduce every table's gradient, or
    each rank train on its own."""
    if world.distributed:
        raise UnsupportedModelError(
            f"picasso_tf: a tf.GradientTape (hvd.DistributedGradientTape included) over a picasso_tf model under "
            f"Horovod ({world.size} ranks): the tables' gradients must be exchanged by picasso_tf's hybrid plan "
            "(sharded tables' rows to their owners), which only its own training step does. Train with "
            "model.fit() or model.train_on_batch() through Keras' standard train_step (not a custom loop, nor a "
            "train_step of the model's own) and a plain Keras optimizer or hvd.DistributedOptimizer (picasso_tf "
            "averages the dense gradients over the ranks itself), or run the custom loop on one process")


def refuse_storage_a_tape_cannot_see(forward):
    """A tape differentiates the variables the forward pass reads; storage whose rows
    are fetched per step (hash tables, another rank's shards) has none to give."""
    if forward.fetch is None:
        return
    kinds = sorted({s.kind for s in forward.fetch.storages})
    raise UnsupportedModelError(
        f"picasso_tf: a tf.GradientTape cannot differentiate tables held in {', '.join(kinds)} storage (their rows "
        "are fetched from hash tables or other ranks each step, and no Keras variable holds them). Train this "
        "model with fit()/train_on_batch() (its own train_step included), or wrap it without hybrid_hash, "
        "dynamic_vocabulary and (under Horovod) with replicate_tables_below large enough to keep every table whole")


def _record(inputs, variables, outputs):
    graph = tf.compat.v1.get_default_graph()
    # A variable is differentiated through the handle the imported graph reads it by.
    handles = [graph.capture(v.handle) for v in variables]
    features = [t for t in tf.nest.flatten(inputs, expand_composites=True)
                if isinstance(t, tf.Tensor) and t.dtype.is_floating]
    sources = features + handles

    def backward(*upstream):
        pairs = [(y, g) for y, g in zip(outputs, upstream) if g is not None]
        if not pairs:
            return [None] * len(sources)
        ys, grad_ys = zip(*pairs)
        with update_tables_in_gradient(getattr(_in_gradient, "updates", None), sources):
            return tf.gradients(list(ys), sources, grad_ys=list(grad_ys))

    record.record_operation("PicassoRewrittenForward", outputs, features + [v.handle for v in variables], backward)
