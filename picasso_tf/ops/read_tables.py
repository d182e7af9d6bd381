"""One op reading a group's table variables (custom_ops/read_tables_op.cc).

Its gradient passes each value's gradient to its variable, as ReadVariableOp's does:
``tf.gradients(loss, table_variable)`` through it is the lookups' row-sparse gradient.
A value without a gradient (a table its gradient kernel updated in place) reaches
this gradient function as zeros TensorFlow made for the missing output; its variable
gets no gradient, as through its own ReadVariableOp.
"""
import tensorflow as tf

from picasso_tf.ops.library import load


def read_tables(handles, dtype, name=None):
    """The values of the variables behind resource `handles`, all of `dtype`."""
    return list(load().picasso_read_tables(tables=list(handles), dtype=dtype, name=name))


@tf.RegisterGradient("PicassoReadTables")
def _read_tables_gradient(op, *grads):
    return [None if _zeros_for_missing(grad, value) else grad for grad, value in zip(grads, op.outputs)]


def _zeros_for_missing(grad, value):
    return isinstance(grad, tf.Tensor) and grad.op.type == "ZerosLike" and grad.op.inputs[0] is value
