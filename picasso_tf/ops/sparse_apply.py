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

``*_update`` describe an update (``Update``), ``apply`` runs one; ``sgd``, ``adagrad``,
... do both and return the op (``None`` when executing eagerly).
"""
import dataclasses

import tensorflow as tf

from picasso_tf.ops.library import load


@dataclasses.dataclass
class Update:
    """One optimizer's update of a table, before it is applied: the kernel
    (``optimizer``: sgd, adagrad, ftrl, adam or rmsprop), the table's slot variables in
    the kernel's order, its scalar hyper-parameters by input name, and its attributes.
    ``apply`` runs it on a gradient; a fused gradient kernel can run it in place."""
    optimizer: str
    slots: list
    hyper: dict
    attrs: dict = dataclasses.field(default_factory=dict)

    def hyper_tensors(self, dtype):
        return {k: tf.convert_to_tensor(v, dtype=dtype) for k, v in self.hyper.items()}


def in_place_inputs(planned, dtype):
    """The inputs and attributes of an op that runs one Update on several variables
    (custom_ops/sparse_updates.h, PICASSO_IN_PLACE_UPDATE_ATTRS), from ``planned``,
    a list of (variable, Update): the Updates may differ only in their slot variables
    (the first's hyper-parameters serve all)."""
    first = planned[0][1]
    hyper = first.hyper_tensors(dtype)
    return dict(vars=[v.handle for v, _ in planned], slots=[s.handle for _, u in planned for s in u.slots],
                hyper=list(hyper.values()), hyper_names=list(hyper), optimizer=first.optimizer,
                num_slots=len(first.slots), **first.attrs)


def apply(var, indices, grad, update, *, lazy=False, name=None):
    """Runs ``update`` on the rows ``indices`` of ``var`` with gradient rows ``grad``."""
    kernel = getattr(load(), f"picasso_sparse_apply_{update.optimizer}")
    return kernel(var=var.handle, slots=[s.handle for s in update.slots],
                  indices=tf.cast(indices, tf.int64),
                  grad=tf.convert_to_tensor(grad, dtype=var.dtype),
                  **update.hyper_tensors(var.dtype), **update.attrs, lazy=lazy, name=name)


def sgd_update(*, lr, momentum_slot=None, momentum=0.0, nesterov=False, weight_decay=0.0):
    """SGD; with ``momentum_slot`` (Keras' "m"), momentum and optionally Nesterov.

    Plain SGD changes only the rows in ``indices`` (lazy and exact agree). With
    momentum, the exact form decays ``m`` and moves ``var`` on every row, as Keras.
    """
    return Update("sgd", [] if momentum_slot is None else [momentum_slot],
                  dict(lr=lr, momentum=momentum, weight_decay=weight_decay),
                  dict(nesterov=nesterov))


def adagrad_update(accumulator, *, lr, epsilon, weight_decay=0.0):
    """Adagrad: ``acc += g*g; var += -lr * g / sqrt(acc + epsilon)`` on the given rows."""
    return Update("adagrad", [accumulator], dict(lr=lr, epsilon=epsilon, weight_decay=weight_decay))


def ftrl_update(accumulator, linear, *, lr, lr_power, l1, l2, l2_shrinkage, beta, weight_decay=0.0):
    """FTRL-proximal as Keras' Ftrl; the exact form recomputes every row with g = 0
    where it has no gradient (Keras densifies the gradient)."""
    return Update("ftrl", [accumulator, linear],
                  dict(lr=lr, lr_power=lr_power, l1=l1, l2=l2, l2_shrinkage=l2_shrinkage, beta=beta,
                       weight_decay=weight_decay))


def adam_update(m, v, *, lr, beta1_power, beta2_power, one_minus_beta1, one_minus_beta2, epsilon,
                vhat=None, weight_decay=0.0):
    """Adam (AdamW with ``weight_decay``); AMSGrad when ``vhat`` is given.

    ``beta1_power = beta_1 ** t`` with ``t`` the 1-based step. The exact form decays
    ``m``, ``v`` and steps ``var`` on every row, as Keras.
    """
    return Update("adam", [m, v] + ([] if vhat is None else [vhat]),
                  dict(lr=lr, beta1_power=beta1_power, beta2_power=beta2_power,
                       one_minus_beta1=one_minus_beta1, one_minus_beta2=one_minus_beta2,
                       epsilon=epsilon, weight_decay=weight_decay),
                  dict(amsgrad=vhat is not None))


def rmsprop_update(velocity, *, lr, rho, one_minus_rho, epsilon, average_gradient=None,
                   momentum_slot=None, momentum=0.0, weight_decay=0.0):
    """RMSprop; centered when ``average_gradient`` is given, with momentum when
    ``momentum_slot`` is. The exact form decays the slots of every row, as Keras."""
    slots = ([velocity] + ([] if average_gradient is None else [average_gradient])
             + ([] if momentum_slot is None else [momentum_slot]))
    return Update("rmsprop", slots,
                  dict(lr=lr, rho=rho, one_minus_rho=one_minus_rho, momentum=momentum,
                       epsilon=epsilon, weight_decay=weight_decay),
                  dict(centered=average_gradient is not None))


def sgd(var, indices, grad, *, lazy=False, name=None, **options):
    """``apply`` of ``sgd_update(**options)``."""
    return apply(var, indices, grad, sgd_update(**options), lazy=lazy, name=name)


def adagrad(var, accumulator, indices, grad, *, lazy=False, name=None, **options):
    """``apply`` of ``adagrad_update(accumulator, **options)``."""
    return apply(var, indices, grad, adagrad_update(accumulator, **options), lazy=lazy, name=name)


def ftrl(var, accumulator, linear, indices, grad, *, lazy=False, name=None, **options):
    """``apply`` of ``ftrl_update(accumulator, linear, **options)``."""
    return apply(var, indices, grad, ftrl_update(accumulator, linear, **options), lazy=lazy,
                 name=name)


def adam(var, m, v, indices, grad, *, lazy=False, name=None, **options):
    """``apply`` of ``adam_update(m, v, **options)``."""
    return apply(var, indices, grad, adam_update(m, v, **options), lazy=lazy, name=name)


def rmsprop(var, velocity, indices, grad, *, lazy=False, name=None, **options):
    """``apply`` of ``rmsprop_update(velocity, **options)``."""
    return apply(var, indices, grad, rmsprop_update(velocity, **options), lazy=lazy, name=name)
