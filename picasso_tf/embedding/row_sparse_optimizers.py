"""The user's Keras optimizer, applied to (packed) embedding tables by fused row-sparse kernels.

``RowSparseOptimizer.from_keras(optimizer, lazy=False)`` reads the hyper-parameters
of a Keras 2.15 ``SGD``, ``Adagrad``, ``Ftrl``, ``Adam``, ``AdamW`` or ``RMSprop``
and issues the kernels of ``picasso_tf.ops.sparse_apply``: every step, per table,
``apply(table, keras_slots(table), unique_rows, row_grads, iteration)`` with the step's
deduplicated gradient rows (each row once, repeated rows' gradients summed, as
Keras' ``_deduplicate_sparse_grad`` does before its own update). The slots are the
Keras optimizer's own (it must be built with the table among its variables), so a
checkpoint holds them where the plain model's would.

Exact (default) or lazy. The default reproduces what the Keras optimizer does to a
variable given a ``tf.IndexedSlices`` gradient, and costs work on every row of the
table where Keras changes rows that have no gradient:

============  ==================================  ===================================
optimizer     exact (Keras), rows without grad     ``lazy=True``
============  ==================================  ===================================
SGD           unchanged (momentum=0); with         unchanged; momentum not decayed
              momentum: ``m`` decays, ``var``
              moves by ``m``
Adagrad       unchanged                            same as exact
Ftrl          recomputed with g = 0 (Keras         unchanged (the classic sparse
              densifies the gradient): a row       FTRL of TF1 and recommender
              whose ``linear`` is 0 becomes 0      systems)
Adam/AdamW    ``m``, ``v`` decay, ``var`` steps    unchanged ("LazyAdam"; bias
              by ``m * alpha / (sqrt(v) + eps)``   correction still uses the global
                                                   step)
RMSprop       ``velocity`` (and average,           unchanged
              momentum) decay; with momentum
              ``var`` moves by it
============  ==================================  ===================================

Keras' decoupled weight decay (the ``weight_decay`` option, AdamW's default
0.004), ``var -= var * weight_decay * lr`` before the step, reaches every row in
the exact form and only the rows with a gradient in the lazy form. Recommender
systems usually train with the lazy form; it is opt-in because it is not what the
user's Keras optimizer computes (ARCHITECTURE.md §3: never change it silently).

Step count. ``apply`` takes ``iteration``: the value of ``optimizer.iterations``
that Keras' own ``update_step`` sees in this training step, i.e. read BEFORE Keras'
``apply_gradients`` increments it (``_internal_apply_gradients`` runs every
``update_step`` and then ``iterations.assign_add(1)``). Adam's bias correction uses
``t = iteration + 1`` and a ``LearningRateSchedule`` is evaluated at ``iteration``,
exactly as Keras (``_compute_current_learning_rate`` then ``update_step``). A
caller that applies the Keras optimizer to the dense variables first must pass the
value it read before that call (or ``optimizer.iterations - 1`` after it).

Refused, with an error naming the option: ``clipnorm``, ``clipvalue``,
``global_clipnorm`` (Keras clips an embedding's gradient as one row per lookup, the
fused gradients have one summed row per id),
``use_ema``, legacy optimizers (``tf.keras.optimizers.legacy.*``), other optimizer
classes, and subclasses that override ``update_step``. The fallback for all of
these is to leave the embedding tables unpacked, updated by the Keras optimizer
from their ``tf.IndexedSlices`` gradients. Variable constraints are not applied
here (Keras applies ``variable.constraint`` after its update).

Numerics: the kernels follow Keras' float operations in order (see
custom_ops/sparse_updates.h), and the scalars are computed here with the same
TF ops and Python-float roundings as Keras, so tables match a Keras-updated
variable to the last bit except RMSprop's rsqrt and FTRL's pow (about 1 ulp).
"""
import dataclasses

import tensorflow as tf

from picasso_tf.ops import sparse_apply

SUPPORTED = ("SGD", "Adagrad", "Ftrl", "Adam", "AdamW", "RMSprop")
_FALLBACK = ("leave the embedding tables unpacked so that the Keras optimizer updates "
             "them from their tf.IndexedSlices gradients")


class UnsupportedOptimizerError(ValueError):
    """The Keras optimizer, or one of its options, has no exact fused row-sparse update."""


def _is_number(x):
    return isinstance(x, (int, float))


def _cast(x, dtype):
    """Keras' ``tf.cast(self.x, variable.dtype)`` (a Python float is rounded to float32 first)."""
    return tf.cast(x, dtype)


def _operand(x, dtype):
    """A hyper-parameter as Keras uses it in ``tensor * x``: a Python number is
    converted straight to the tensor's dtype (``1 - beta_1`` is computed in float64)."""
    return tf.constant(x, dtype) if _is_number(x) else tf.cast(x, dtype)


class RowSparseOptimizer:
    """Fused row-sparse updates for one Keras optimizer; see the module docstring.

    Attributes:
      optimizer: the Keras optimizer whose hyper-parameters are read at each ``apply``.
      lazy: update only the rows with a gradient (see the module docstring).
      dense_gradients: the updates serve dense gradients (picasso_tf.ops.dense_apply),
        for which Keras writes every slot it keeps (SGD's "m" even with momentum 0).
      slot_names: the Keras slot variables an update uses (Keras' names).
    """

    def __init__(self, optimizer, lazy=False, dense_gradients=False):
        self.optimizer = optimizer
        self.lazy = bool(lazy)
        self.dense_gradients = bool(dense_gradients)
        self.slot_names = self._slot_names()

    @staticmethod
    def from_keras(optimizer, lazy=False, dense_gradients=False, fallback=_FALLBACK) -> "RowSparseOptimizer":
        """The RowSparseOptimizer for a Keras optimizer; raises UnsupportedOptimizerError,
        whose message ends with `fallback` (what the user can do instead)."""
        family, name = _family_of(optimizer, fallback), type(optimizer).__name__
        for option in ("clipnorm", "clipvalue", "global_clipnorm"):
            value = getattr(optimizer, option, None)
            if value is not None and value > 0:
                raise UnsupportedOptimizerError(
                    f"The Keras {name} optimizer has `{option}={value}`, which the "
                    "fused row-sparse updates cannot honour exactly (Keras clips an "
                    "embedding's gradient as one row per lookup; the fused gradients have "
                    f"one summed row per id). Remove the option, or {fallback}.")
        if getattr(optimizer, "use_ema", False):
            raise UnsupportedOptimizerError(
                f"The Keras {name} optimizer has `use_ema=True`; the fused "
                f"row-sparse updates keep no moving average of the tables. Remove the "
                f"option, or {fallback}.")
        return family(optimizer, lazy=lazy, dense_gradients=dense_gradients)

    def keras_slots(self, table: tf.Variable) -> dict:
        """{slot: the Keras optimizer's slot variable of `table`}, for ``apply``."""
        index = getattr(self.optimizer, "_index_dict", {}).get(self.optimizer._var_key(table))
        if index is None:
            raise ValueError(f"The {type(self.optimizer).__name__} optimizer was not built with table "
                             f"{table.name} among its variables; build it with the model's trainable "
                             "variables first.")
        return {slot: getattr(self.optimizer, self._KERAS_SLOT_LISTS[slot])[index] for slot in self.slot_names}

    def apply(self, table, slots, unique_rows, row_grads, iteration, *,
              apply_weight_decay=True, name=None):
        """Updates `table` and `slots` from one step's deduplicated gradient rows.

        Args:
          table: the table's ``tf.Variable`` ``[N, D]`` (float32 or float64).
          slots: its slot variables, ``keras_slots(table)``.
          unique_rows: int32/int64 ``[U]``, rows of the table, each at most once.
          row_grads: ``[U, D]``, the summed gradient of each of those rows.
          iteration: int64 scalar, ``optimizer.iterations`` as Keras' ``update_step``
            sees it this step (before Keras increments it; module docstring).
          apply_weight_decay: False for tables whose variables Keras would exclude
            from weight decay (see ``applies_weight_decay_to``).

        Returns:
          The update op (``None`` when executing eagerly).
        """
        return sparse_apply.apply(table, unique_rows, row_grads,
                                  self.update(table, slots, iteration,
                                              apply_weight_decay=apply_weight_decay),
                                  lazy=self.lazy, name=name)

    def update(self, table, slots, iteration, *, apply_weight_decay=True) -> sparse_apply.Update:
        """This step's update of `table` (arguments as ``apply``), not yet applied to a
        gradient: a fused gradient kernel can apply it in place."""
        if set(slots) != set(self.slot_names):
            raise ValueError(f"{type(self.optimizer).__name__} expects slots "
                             f"{sorted(self.slot_names)}, got {sorted(slots)}.")
        dtype = table.dtype
        iteration = tf.convert_to_tensor(iteration, dtype=tf.int64)
        lr = self._learning_rate(iteration, dtype)
        weight_decay = self.optimizer.weight_decay
        weight_decay = (_cast(weight_decay, dtype)
                        if apply_weight_decay and weight_decay is not None else 0.0)
        return self._update(slots, dtype, iteration, lr, weight_decay)

    def updates(self, tables, slots, iteration, apply_weight_decay) -> list:
        """``update`` of each of `tables` (with its slots and whether Keras decays it),
        the scalars computed once for all the tables that share a dtype and decay."""
        shared, out = {}, []
        for table, table_slots, decay in zip(tables, slots, apply_weight_decay):
            key = (table.dtype, bool(decay))
            if key not in shared:
                first = self.update(table, table_slots, iteration, apply_weight_decay=decay)
                # The kernel's slot order, by slot name.
                order = [next(n for n, v in table_slots.items() if v is s) for s in first.slots]
                shared[key] = (first, order)
                out.append(first)
                continue
            first, order = shared[key]
            out.append(dataclasses.replace(first, slots=[table_slots[n] for n in order]))
        return out

    def changes_only_gradient_rows(self, apply_weight_decay=True) -> bool:
        """Whether an update leaves every row without a gradient as it is: always in the
        lazy form; in the exact form when Keras' update does (Adagrad, SGD without
        momentum) and no weight decay reaches every row."""
        if self.lazy:
            return True
        decay = self.optimizer.weight_decay
        decays_all = apply_weight_decay and decay is not None and not (_is_number(decay) and decay == 0)
        return not decays_all and self._changes_only_gradient_rows()

    def applies_weight_decay_to(self, variable) -> bool:
        """Whether Keras would decay `variable` (the user's, e.g. an embedding matrix a
        packed table holds): weight decay is set and it is not excluded by
        ``exclude_from_weight_decay``."""
        return (self.optimizer.weight_decay is not None
                and self.optimizer._use_weight_decay(variable))

    # -- for subclasses

    def _slot_names(self):
        raise NotImplementedError

    def _update(self, slots, dtype, iteration, lr, weight_decay):
        raise NotImplementedError

    def _changes_only_gradient_rows(self):
        return False

    def _learning_rate(self, iteration, dtype):
        # Keras keeps a schedule in `_learning_rate` and evaluates it at `iterations`
        # at the start of apply_gradients; otherwise `learning_rate` is a variable.
        schedule = self.optimizer._learning_rate
        if isinstance(schedule, tf.keras.optimizers.schedules.LearningRateSchedule):
            return _cast(schedule(iteration), dtype)
        return _cast(self.optimizer.learning_rate, dtype)


class _Sgd(RowSparseOptimizer):
    _KERAS_SLOT_LISTS = {"m": "momentums"}

    def _slot_names(self):
        momentum = self.optimizer.momentum
        # Keras always keeps "m", but with momentum 0 it changes no row without a gradient.
        return () if _is_number(momentum) and momentum == 0 and not self.dense_gradients else ("m",)

    def _update(self, slots, dtype, iteration, lr, weight_decay):
        return sparse_apply.sgd_update(
            lr=lr, momentum_slot=slots.get("m"),
            momentum=_cast(self.optimizer.momentum, dtype) if slots else 0.0,
            nesterov=bool(self.optimizer.nesterov), weight_decay=weight_decay)

    def _changes_only_gradient_rows(self):
        return not self.slot_names


class _Adagrad(RowSparseOptimizer):
    _KERAS_SLOT_LISTS = {"accumulator": "_accumulators"}

    def _slot_names(self):
        return ("accumulator",)

    def _update(self, slots, dtype, iteration, lr, weight_decay):
        return sparse_apply.adagrad_update(
            slots["accumulator"], lr=lr, epsilon=_operand(self.optimizer.epsilon, dtype),
            weight_decay=weight_decay)

    def _changes_only_gradient_rows(self):
        return True


class _Ftrl(RowSparseOptimizer):
    _KERAS_SLOT_LISTS = {"accumulator": "_accumulators", "linear": "_linears"}

    def _slot_names(self):
        return ("accumulator", "linear")

    def _update(self, slots, dtype, iteration, lr, weight_decay):
        opt = self.optimizer
        return sparse_apply.ftrl_update(
            slots["accumulator"], slots["linear"], lr=lr,
            lr_power=_operand(opt.learning_rate_power, dtype),
            l1=_operand(opt.l1_regularization_strength, dtype),
            l2=_operand(opt.l2_regularization_strength, dtype),
            l2_shrinkage=_operand(opt.l2_shrinkage_regularization_strength, dtype),
            beta=_operand(opt.beta, dtype), weight_decay=weight_decay)


class _Adam(RowSparseOptimizer):
    """Adam and AdamW: Keras' update_step is the same; AdamW sets weight_decay."""

    _KERAS_SLOT_LISTS = {"m": "_momentums", "v": "_velocities", "vhat": "_velocity_hats"}

    def _slot_names(self):
        return ("m", "v", "vhat") if self.optimizer.amsgrad else ("m", "v")

    def _update(self, slots, dtype, iteration, lr, weight_decay):
        opt = self.optimizer
        local_step = tf.cast(iteration + 1, dtype)
        return sparse_apply.adam_update(
            slots["m"], slots["v"], lr=lr,
            beta1_power=tf.pow(_cast(opt.beta_1, dtype), local_step),
            beta2_power=tf.pow(_cast(opt.beta_2, dtype), local_step),
            one_minus_beta1=_operand(1 - opt.beta_1, dtype),
            one_minus_beta2=_operand(1 - opt.beta_2, dtype),
            epsilon=_operand(opt.epsilon, dtype), vhat=slots.get("vhat"),
            weight_decay=weight_decay)


class _Rmsprop(RowSparseOptimizer):
    _KERAS_SLOT_LISTS = {"velocity": "_velocities", "average_gradient": "_average_gradients",
                         "momentum": "_momentums"}

    def _slot_names(self):
        names = ("velocity",)
        if self.optimizer.centered:
            names += ("average_gradient",)
        if self.optimizer.momentum > 0:
            names += ("momentum",)
        return names

    def _update(self, slots, dtype, iteration, lr, weight_decay):
        opt = self.optimizer
        return sparse_apply.rmsprop_update(
            slots["velocity"], lr=lr, rho=_operand(opt.rho, dtype),
            one_minus_rho=_operand(1 - opt.rho, dtype), epsilon=_operand(opt.epsilon, dtype),
            average_gradient=slots.get("average_gradient"),
            momentum_slot=slots.get("momentum"),
            momentum=_operand(opt.momentum, dtype) if "momentum" in slots else 0.0,
            weight_decay=weight_decay)


def _keras_families():
    k = tf.keras.optimizers
    return ((k.SGD, _Sgd), (k.Adagrad, _Adagrad), (k.Ftrl, _Ftrl), (k.AdamW, _Adam),
            (k.Adam, _Adam), (k.RMSprop, _Rmsprop))


def _family_of(optimizer, fallback):
    name = type(optimizer).__name__
    supported = ", ".join(f"tf.keras.optimizers.{n}" for n in SUPPORTED)
    if isinstance(optimizer, tf.keras.optimizers.legacy.Optimizer):
        raise UnsupportedOptimizerError(
            f"{name} is a legacy Keras optimizer (tf.keras.optimizers.legacy), whose sparse "
            f"updates differ from the current ones; use {supported}, or {fallback}.")
    for keras_class, family in _keras_families():
        if isinstance(optimizer, keras_class):
            if type(optimizer).update_step is not keras_class.update_step:
                raise UnsupportedOptimizerError(
                    f"{name} overrides {keras_class.__name__}.update_step, so its update is "
                    f"unknown to the fused row-sparse kernels; {fallback}.")
            return family
    raise UnsupportedOptimizerError(
        f"The Keras optimizer {name} has no fused row-sparse update. Supported: {supported}. "
        f"Otherwise {fallback}.")
