"""RowSparseOptimizer against the Keras 2.15 optimizer applying the same tf.IndexedSlices.

Keras gets the raw gradient (repeated indices; it sums them itself); ours gets the
deduplicated sum. Both start from identical variables; after each of several steps
the table and every slot must agree.
"""
import numpy as np
import pytest
import tensorflow as tf

from picasso_tf.embedding.row_sparse_optimizers import (RowSparseOptimizer,
                                                        UnsupportedOptimizerError)

K = tf.keras.optimizers
N, D, STEPS = 30, 20, 5  # D = 20: vectorised row loops and their scalar tails

OPTIMIZERS = {
    "sgd": lambda: K.SGD(0.1),
    "sgd_momentum": lambda: K.SGD(0.1, momentum=0.9),
    "sgd_nesterov": lambda: K.SGD(0.1, momentum=0.9, nesterov=True),
    "sgd_weight_decay": lambda: K.SGD(0.1, weight_decay=0.05),
    "adagrad": lambda: K.Adagrad(0.1),
    "adagrad_options": lambda: K.Adagrad(0.05, initial_accumulator_value=0.5, epsilon=1e-5),
    "ftrl": lambda: K.Ftrl(0.1),
    "ftrl_options": lambda: K.Ftrl(
        0.1, learning_rate_power=-0.3, initial_accumulator_value=0.2,
        l1_regularization_strength=0.01, l2_regularization_strength=0.02,
        l2_shrinkage_regularization_strength=0.03, beta=0.5),
    "adam": lambda: K.Adam(0.01),
    "adam_amsgrad": lambda: K.Adam(0.01, beta_1=0.8, beta_2=0.99, epsilon=1e-4, amsgrad=True),
    "adam_schedule": lambda: K.Adam(K.schedules.ExponentialDecay(0.01, 2, 0.5)),
    "adamw": lambda: K.AdamW(0.01, weight_decay=0.05),
    "adamw_amsgrad": lambda: K.AdamW(0.01, amsgrad=True),
    "rmsprop": lambda: K.RMSprop(0.01),
    "rmsprop_centered": lambda: K.RMSprop(0.01, centered=True),
    "rmsprop_momentum": lambda: K.RMSprop(0.01, rho=0.8, momentum=0.5),
    "rmsprop_centered_momentum": lambda: K.RMSprop(0.01, momentum=0.5, centered=True),
}

# Our slot name -> the Keras optimizer's list of that slot.
KERAS_SLOTS = {
    "SGD": {"m": "momentums"},
    "Adagrad": {"accumulator": "_accumulators"},
    "Ftrl": {"accumulator": "_accumulators", "linear": "_linears"},
    "Adam": {"m": "_momentums", "v": "_velocities", "vhat": "_velocity_hats"},
    "AdamW": {"m": "_momentums", "v": "_velocities", "vhat": "_velocity_hats"},
    "RMSprop": {"velocity": "_velocities", "momentum": "_momentums",
                "average_gradient": "_average_gradients"},
}


def _steps(seed, n=N, d=D, steps=STEPS):
    """Per step: indices with repeats (some rows untouched) and their gradient rows."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        k = rng.integers(1, n)
        yield rng.integers(0, n, size=k), rng.normal(size=(k, d)).astype(np.float32)


def _deduplicate(indices, values):
    """What Keras' _deduplicate_sparse_grad computes (the caller's job for ours)."""
    unique, position = tf.unique(tf.constant(indices, tf.int64))
    return unique, tf.math.unsorted_segment_sum(values, position, tf.shape(unique)[0])


def _assert_close(got, want, what, bit_exact=False):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5, err_msg=what)
    if bit_exact:
        np.testing.assert_array_equal(got, want, err_msg=what)


def slots_for(ours, table):
    """The slots ours updates `table` with: its Keras optimizer's, built on the table."""
    ours.optimizer.build([table])
    return ours.keras_slots(table)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_exact_matches_keras(name):
    keras_opt = OPTIMIZERS[name]()
    ours = RowSparseOptimizer.from_keras(OPTIMIZERS[name]())
    init = np.random.default_rng(1).normal(size=(N, D)).astype(np.float32)
    keras_var, table = tf.Variable(init), tf.Variable(init)
    slots = slots_for(ours, table)
    keras_opt.build([keras_var])
    keras_slots = KERAS_SLOTS[type(keras_opt).__name__]
    for slot, var in slots.items():  # initial values as Keras'
        np.testing.assert_array_equal(var.numpy(), getattr(keras_opt, keras_slots[slot])[0].numpy())

    # Bit for bit as Keras' eager CPU update, except where the module docstring says
    # (RMSprop's rsqrt, FTRL's pow); on a GPU Keras compiles its update with XLA.
    bit_exact = (type(keras_opt).__name__ not in ("Ftrl", "RMSprop")
                 and not tf.config.list_physical_devices("GPU"))
    for step, (indices, values) in enumerate(_steps(seed=2)):
        iteration = keras_opt.iterations.numpy()  # as Keras' update_step will see it
        keras_opt.apply_gradients([(tf.IndexedSlices(
            tf.constant(values), tf.constant(indices), tf.constant([N, D])), keras_var)])
        ours.apply(table, slots, *_deduplicate(indices, values), iteration)
        _assert_close(table.numpy(), keras_var.numpy(), f"{name} table, step {step}",
                      bit_exact)
        for slot, var in slots.items():
            _assert_close(var.numpy(), getattr(keras_opt, keras_slots[slot])[0].numpy(),
                          f"{name} slot {slot}, step {step}", bit_exact)


def test_exact_ftrl_resets_rows_without_gradient_like_keras():
    """Keras' Ftrl densifies an IndexedSlices gradient: untouched rows whose `linear`
    slot is 0 become 0. The exact form reproduces it; the lazy form keeps them."""
    init = np.ones((4, 2), np.float32)
    exact, lazy = (RowSparseOptimizer.from_keras(K.Ftrl(0.1), lazy=z) for z in (False, True))
    for opt in (exact, lazy):
        table = tf.Variable(init)
        opt.apply(table, slots_for(opt, table), [1], tf.ones([1, 2]), 0)
        untouched = table.numpy()[[0, 2, 3]]
        np.testing.assert_array_equal(untouched, 0 * init[:3] if opt is exact else init[:3])


def _numpy_lazy_adam(w, m, v, steps, lr=0.01, b1=0.9, b2=0.999, eps=1e-7):
    f = np.float32
    for t, (rows, grads) in enumerate(steps, start=1):
        alpha = f(lr) * np.sqrt(f(1) - f(b2) ** f(t)) / (f(1) - f(b1) ** f(t))
        m[rows] = (m[rows] - m[rows] * f(1 - b1)) + grads * f(1 - b1)
        v[rows] = (v[rows] - v[rows] * f(1 - b2)) + grads * grads * f(1 - b2)
        w[rows] -= m[rows] * alpha / (np.sqrt(v[rows]) + f(eps))
    return w, m, v


def test_lazy_adam_matches_numpy():
    ours = RowSparseOptimizer.from_keras(K.Adam(0.01), lazy=True)
    init = np.random.default_rng(4).normal(size=(N, D)).astype(np.float32)
    table = tf.Variable(init)
    slots = slots_for(ours, table)
    steps = []
    for iteration, (indices, values) in enumerate(_steps(seed=5)):
        rows, grads = _deduplicate(indices, values)
        ours.apply(table, slots, rows, grads, iteration)
        steps.append((rows.numpy(), grads.numpy()))
    w, m, v = _numpy_lazy_adam(init.copy(), np.zeros_like(init), np.zeros_like(init), steps)
    _assert_close(table.numpy(), w, "table")
    _assert_close(slots["m"].numpy(), m, "m")
    _assert_close(slots["v"].numpy(), v, "v")
    never = np.setdiff1d(np.arange(N), np.concatenate([r for r, _ in steps]))
    np.testing.assert_array_equal(table.numpy()[never], init[never])


@pytest.mark.parametrize("lazy", [False, True], ids=["exact", "lazy"])
def test_bit_identical_between_runs(lazy):
    def run():
        opt = RowSparseOptimizer.from_keras(K.AdamW(0.01, amsgrad=True), lazy=lazy)
        table = tf.Variable(np.random.default_rng(6).normal(size=(500, 16)).astype(np.float32))
        slots = slots_for(opt, table)
        for iteration, (indices, values) in enumerate(_steps(seed=7, n=500, d=16)):
            opt.apply(table, slots, *_deduplicate(indices, values), iteration)
        return [table.numpy()] + [s.numpy() for s in slots.values()]

    for a, b in zip(run(), run()):
        np.testing.assert_array_equal(a, b)


def test_in_tf_function_with_schedule():
    keras_opt = K.SGD(K.schedules.PiecewiseConstantDecay([0], [0.5, 0.1]), momentum=0.5)
    ours = RowSparseOptimizer.from_keras(keras_opt)
    table = tf.Variable(tf.zeros([3, 1]))
    slots = slots_for(ours, table)

    @tf.function
    def step(iteration):
        op = ours.apply(table, slots, tf.constant([0]), tf.ones([1, 1]), iteration)
        assert isinstance(op, tf.Operation)

    step(tf.constant(0, tf.int64))  # lr 0.5: m = -0.5, var = -0.5
    step(tf.constant(1, tf.int64))  # lr 0.1: m = -0.25 - 0.1, var = -0.85
    np.testing.assert_allclose(table.numpy()[:, 0], [-0.85, 0, 0], rtol=1e-6)


def test_weight_decay_can_be_skipped_per_table():
    opt = RowSparseOptimizer.from_keras(K.AdamW(0.1, weight_decay=0.5))
    excluded = tf.Variable(tf.ones([2, 1]), name="bias")
    opt.optimizer.exclude_from_weight_decay(var_names=["bias"])
    assert not opt.applies_weight_decay_to(excluded)
    assert opt.applies_weight_decay_to(tf.Variable(tf.ones([2, 1]), name="embeddings"))
    table = tf.Variable(tf.ones([2, 1]))
    opt.apply(table, slots_for(opt, table), [0], tf.zeros([1, 1]), 0,
              apply_weight_decay=False)
    np.testing.assert_array_equal(table.numpy(), np.ones([2, 1]))  # zero grad, no decay


@pytest.mark.parametrize("make, message", [
    (lambda: K.Adam(clipnorm=1.0), "`clipnorm=1.0`"),
    (lambda: K.SGD(clipvalue=0.5), "`clipvalue=0.5`"),
    (lambda: K.Adagrad(global_clipnorm=2.0), "`global_clipnorm=2.0`"),
    (lambda: K.RMSprop(use_ema=True), "`use_ema=True`"),
    (lambda: K.Nadam(), r"Nadam has no fused row-sparse update\. Supported: .*AdamW"),
    (lambda: K.legacy.Adam(), "legacy Keras optimizer"),
    (lambda: type("MyAdam", (K.Adam,), {"update_step": lambda self, g, v: None})(),
     r"MyAdam overrides Adam.update_step"),
])
def test_refused(make, message):
    with pytest.raises(UnsupportedOptimizerError, match=message):
        RowSparseOptimizer.from_keras(make())


ONLY_GRADIENT_ROWS = {"sgd", "adagrad", "adagrad_options"}   # in Keras' own (exact) form


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_which_updates_leave_rows_without_a_gradient_alone(name):
    """What decides whether a gradient kernel may update a table itself: exact forms
    that decay or move every row (momentum, moments, FTRL's densified update, weight
    decay) may not, unless the table is excluded from weight decay; lazy forms may."""
    exact = RowSparseOptimizer.from_keras(OPTIMIZERS[name]())
    assert exact.changes_only_gradient_rows() == (name in ONLY_GRADIENT_ROWS)
    if name == "sgd_weight_decay":
        assert exact.changes_only_gradient_rows(apply_weight_decay=False)
    assert RowSparseOptimizer.from_keras(OPTIMIZERS[name](), lazy=True).changes_only_gradient_rows()
