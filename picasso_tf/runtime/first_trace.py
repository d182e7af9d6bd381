"""A step that creates picasso_tf's variables is traced once, not twice.

The first call of a training step rewrites the model, builds its storage and the
optimizer's slots: variables, created eagerly (under tf.init_scope) while Keras'
tf.function traces the step. A tf.function that saw variables created during its first
trace traces the step a second time, so that later traces cannot create more, which
doubles the cost of the first step. Variables created eagerly need none of that (they
are initialised already and the trace only captures them), and tf.Variable's
experimental_enable_variable_lifting=False tells tf.function not to count them. So
picasso_tf's entry points into a step create their eager variables that way; a
variable created in the trace's graph (a Keras metric's, say) is counted as before."""
import contextlib
import functools

import tensorflow as tf


def _eager_variables_not_lifted(next_creator, **kwargs):
    if tf.executing_eagerly():     # under tf.init_scope inside a trace, or no trace at all
        kwargs["experimental_enable_variable_lifting"] = False
    return next_creator(**kwargs)


@contextlib.contextmanager
def eager_variables_not_counted():
    """Variables created eagerly in this block do not make the tf.function being traced
    trace again (see the module doc)."""
    with tf.variable_creator_scope(_eager_variables_not_lifted):
        yield


def traced_once(method):
    """`method` run under eager_variables_not_counted."""
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with eager_variables_not_counted():
            return method(*args, **kwargs)
    return wrapped
