"""Fused row-sparse optimizer updates of a table and its slots (custom_ops/sparse_apply_ops.cc).

Every function updates ``var`` (a resource ``tf.Variable`` ``[N, ...]``, float32 or
float64) and its slot variables (same shape and dtype) in place from ``indices``
(``[U]``, int64 or int32: rows of ``var``, each at most once; the caller sums the gradients
of repeated rows first) and ``grad`` (``[U, ...]``, one row per index). Indices out
of range or repeated give ``InvalidArgumentError`` before anything is written.

``lazy=False`` (default) is Keras 2.15's own update for a ``tf.IndexedSlices``
gradient, including what Keras does to rows without a gradient; ``lazy=True``
updates only the rows in ``indices``. The math of each op is in the C++ file.

Hyper-parameters are scalars: Python numbers (rounded to the table's dtype) or
tensors of the table's dtype (e.g. a schedule's value this step). Where Keras
multiplies by a constant it rounds from a Python float (``1 - beta_1``), the op
takes that constant, so that callers can round it the same way.
``weight_decay`` is Keras' decoupled decay ``var -= var * weight_decay * lr``
applied before the step (to every row in the exact form); 0 disables it.

Each function returns the op (``None`` when executing eagerly).
"""
import tensorflow as tf

from picasso_tf.ops.library import load


def _scalars(var, **values):
    return {k: tf.convert_to_tensor(v, dtype=var.dtype) for k, v in values.items()}


def _common(var, slots, indices, grad):
    return dict(var=var.handle, slots=[s.handle for s in slots],
                indices=tf.cast(indices, tf.int64),
                grad=tf.convert_to_tensor(grad, dtype=var.dtype))


def sgd(var, indices, grad, *, lr, momentum_slot=None, momentum=0.0, nesterov=False,
        weight_decay=0.0, lazy=False, name=None):
    """SGD; with ``momentum_slot`` (Keras' "m"), momentum and optionally Nesterov.

    Plain SGD changes only the rows in ``indices`` (lazy and exact agree). With
    momentum, the exact form decays ``m`` and moves ``var`` on every row, as Keras.
    """
    slots = [] if momentum_slot is None else [momentum_slot]
    return load().picasso_sparse_apply_sgd(
        **_common(var, slots, indices, grad),
        **_scalars(var, lr=lr, momentum=momentum, weight_decay=weight_decay),
        nesterov=nesterov, lazy=lazy, name=name)


def adagrad(var, accumulator, indices, grad, *, lr, epsilon, weight_decay=0.0, lazy=False,
            name=None):
    """Adagrad: ``acc += g*g; var += -lr * g / sqrt(acc + epsilon)`` on the given rows."""
    return load().picasso_sparse_apply_adagrad(
        **_common(var, [accumulator], indices, grad),
        **_scalars(var, lr=lr, epsilon=epsilon, weight_decay=weight_decay),
        lazy=lazy, name=name)


def ftrl(var, accumulator, linear, indices, grad, *, lr, lr_power, l1, l2, l2_shrinkage,
         beta, weight_decay=0.0, lazy=False, name=None):
    """FTRL-proximal as Keras' Ftrl; the exact form recomputes every row with g = 0
    where it has no gradient (Keras densifies the gradient)."""
    return load().picasso_sparse_apply_ftrl(
        **_common(var, [accumulator, linear], indices, grad),
        **_scalars(var, lr=lr, lr_power=lr_power, l1=l1, l2=l2, l2_shrinkage=l2_shrinkage,
                   beta=beta, weight_decay=weight_decay),
        lazy=lazy, name=name)


def adam(var, m, v, indices, grad, *, lr, beta1_power, beta2_power, one_minus_beta1,
         one_minus_beta2, epsilon, vhat=None, weight_decay=0.0, lazy=False, name=None):
    """Adam (AdamW with ``weight_decay``); AMSGrad when ``vhat`` is given.

    ``beta1_power = beta_1 ** t`` with ``t`` the 1-based step. The exact form decays
    ``m``, ``v`` and steps ``var`` on every row, as Keras.
    """
    slots = [m, v] + ([] if vhat is None else [vhat])
    return load().picasso_sparse_apply_adam(
        **_common(var, slots, indices, grad),
        **_scalars(var, lr=lr, beta1_power=beta1_power, beta2_power=beta2_power,
                   one_minus_beta1=one_minus_beta1, one_minus_beta2=one_minus_beta2,
                   epsilon=epsilon, weight_decay=weight_decay),
        amsgrad=vhat is not None, lazy=lazy, name=name)


def rmsprop(var, velocity, indices, grad, *, lr, rho, one_minus_rho, epsilon,
            average_gradient=None, momentum_slot=None, momentum=0.0, weight_decay=0.0,
            lazy=False, name=None):
    """RMSprop; centered when ``average_gradient`` is given, with momentum when
    ``momentum_slot`` is. The exact form decays the slots of every row, as Keras."""
    slots = ([velocity] + ([] if average_gradient is None else [average_gradient])
             + ([] if momentum_slot is None else [momentum_slot]))
    return load().picasso_sparse_apply_rmsprop(
        **_common(var, slots, indices, grad),
        **_scalars(var, lr=lr, rho=rho, one_minus_rho=one_minus_rho, momentum=momentum,
                   epsilon=epsilon, weight_decay=weight_decay),
        centered=average_gradient is not None, lazy=lazy, name=name)
