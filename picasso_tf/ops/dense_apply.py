"""One op that applies a Keras optimizer's update to many variables with dense gradients
(custom_ops/dense_apply_ops.cc): a multi-tensor ("foreach") update.

Each variable is updated with its own slot variables as Keras 2.15's dense-gradient
branch of ``update_step`` would, element by element in Keras' float operation order,
after Keras' decoupled weight decay where ``decayed``. The hyper-parameters are those
of a row-sparse ``sparse_apply.Update`` (the same kernels' scalars), shared by all
variables of the call, which must have one dtype (float32 or float64).
"""
import tensorflow as tf

from picasso_tf.ops.library import load
from picasso_tf.ops.sparse_apply import in_place_inputs


def apply(variables, grads, updates, decayed, rows=None, scaled=None, name=None):
    """Updates ``variables`` (resource tf.Variables of one dtype) from their dense
    ``grads`` (one per variable, same shape), each with its ``sparse_apply.Update``
    (they may differ only in their slots); ``decayed``: per variable, whether Keras'
    weight decay reaches it. Where ``scaled`` (per variable) is true, the gradient is
    the variable's value times the scalar in ``grads``, ``var * grad``. ``rows``: per
    variable, None or a tf.IndexedSlices added to its gradient as
    ``tf.add_n([tf.convert_to_tensor(rows), grad])`` would. Both to the bit, without
    building a tensor of the variable's size. Returns the op (None when executing
    eagerly)."""
    variables = list(variables)
    dtype = variables[0].dtype
    mixed = [v.name for v in variables if v.dtype != dtype]
    if mixed:
        raise ValueError(f"picasso_tf dense_apply: one call takes variables of one dtype; {variables[0].name} is "
                         f"{dtype.name}, {mixed} are not. Call it once per dtype.")
    added = [(i, r) for i, r in enumerate(rows or ()) if r is not None]
    return load().picasso_dense_apply(**in_place_inputs(list(zip(variables, updates)), dtype),
                                      grads=[tf.convert_to_tensor(g, dtype=dtype) for g in grads],
                                      row_indices=[r.indices for _, r in added],
                                      row_values=[tf.convert_to_tensor(r.values, dtype=dtype) for _, r in added],
                                      row_vars=[i for i, _ in added],
                                      scaled_vars=[i for i, s in enumerate(scaled or ()) if s],
                                      decayed=[bool(d) for d in decayed], name=name)
