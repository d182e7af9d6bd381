"""Fused row-sparse optimizer kernels (picasso_tf.ops.sparse_apply) against NumPy.

The references update rows densely in the table's dtype, term by term as Keras
does. The exact form is the dense update of all rows with a zero gradient where a
row has none (for every supported optimizer that is what Keras computes for a
tf.IndexedSlices gradient); the lazy form is the same update on the given rows only.
"""
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
import tensorflow as tf

from picasso_tf.ops import sparse_apply

HP = dict(lr=0.05, momentum=0.9, epsilon=1e-3, lr_power=-0.5, l1=0.01, l2=0.02,
          l2_shrinkage=0.03, beta=0.5, beta_1=0.9, beta_2=0.999, t=3, rho=0.9)


def _c(dtype, x):
    return dtype.type(x)


# ---------------------------------------------------------------------------
# NumPy references: (w, slots, g, dt) -> new (w, slots); arrays hold the rows updated.

def ref_sgd(w, s, g, dt, nesterov=False):
    lr, mom = _c(dt, HP["lr"]), _c(dt, HP["momentum"])
    if not s:
        return w + -g * lr, []
    m = s[0] * mom + -g * lr
    w = (w + -g * lr) + m * mom if nesterov else w + m
    return w, [m]


def ref_adagrad(w, s, g, dt):
    acc = s[0] + g * g
    return w + -_c(dt, HP["lr"]) * g / np.sqrt(acc + _c(dt, HP["epsilon"])), [acc]


def ref_ftrl(w, s, g, dt, lr_power=HP["lr_power"]):
    acc, lin = s
    lr = _c(dt, HP["lr"])
    two_l2_reg = _c(dt, 2) * (_c(dt, HP["l2"]) + _c(dt, HP["beta"]) / (_c(dt, 2) * lr))
    # Correctly rounded, as the kernel's sqrt / std::pow: the cancellation in
    # power(new_acc) - power(acc) would turn a 1-ulp difference (NumPy's vectorised
    # float32 pow) into ~1e-5 here.
    exponent = np.float64(_c(dt, -lr_power))  # rounded to the dtype, as Keras
    power = lambda x: np.power(x.astype(np.float64), exponent).astype(dt)  # noqa: E731
    new_acc = acc + g * g
    lin = lin + ((g + _c(dt, 2 * HP["l2_shrinkage"]) * w)
                 - (power(new_acc) - power(acc)) / lr * w)
    quadratic = power(new_acc) / lr + two_l2_reg
    l1 = _c(dt, HP["l1"])
    return (np.clip(lin, -l1, l1) - lin) / quadratic, [new_acc, lin]


def ref_adam(w, s, g, dt):
    lr, t = _c(dt, HP["lr"]), _c(dt, HP["t"])
    b1p, b2p = _c(dt, HP["beta_1"]) ** t, _c(dt, HP["beta_2"]) ** t
    alpha = lr * np.sqrt(_c(dt, 1) - b2p) / (_c(dt, 1) - b1p)
    c1, c2 = _c(dt, 1 - HP["beta_1"]), _c(dt, 1 - HP["beta_2"])
    m = (s[0] - s[0] * c1) + g * c1
    v = (s[1] - s[1] * c2) + g * g * c2
    out = [m, v]
    if len(s) == 3:
        v = np.maximum(s[2], v)
        out.append(v)
    return w - m * alpha / (np.sqrt(v) + _c(dt, HP["epsilon"])), out


def ref_rmsprop(w, s, g, dt, centered=False, momentum=False):
    lr, rho, eps = _c(dt, HP["lr"]), _c(dt, HP["rho"]), _c(dt, HP["epsilon"])
    c = _c(dt, 1 - HP["rho"])
    vel = rho * s[0] + g * g * c
    out = [vel]
    if centered:
        avg = rho * s[1] + g * c
        out.append(avg)
        denominator = vel - avg * avg + eps
    else:
        denominator = vel + eps
    increment = lr * g * (_c(dt, 1) / np.sqrt(denominator))
    if momentum:
        mom = _c(dt, HP["momentum"]) * s[-1] + increment
        out.append(mom)
        return w + -mom, out
    return w + -increment, out


# ---------------------------------------------------------------------------
# Cases: name -> (number of slots, op call, reference)

def _adam_hp(dt):
    t = tf.constant(HP["t"], dt)
    return dict(lr=HP["lr"], beta1_power=tf.pow(tf.constant(HP["beta_1"], dt), t),
                beta2_power=tf.pow(tf.constant(HP["beta_2"], dt), t),
                one_minus_beta1=1 - HP["beta_1"], one_minus_beta2=1 - HP["beta_2"],
                epsilon=HP["epsilon"])


def _rms_hp():
    return dict(lr=HP["lr"], rho=HP["rho"], one_minus_rho=1 - HP["rho"],
                epsilon=HP["epsilon"])


FTRL_HP = {k: HP[k] for k in ("lr", "lr_power", "l1", "l2", "l2_shrinkage", "beta")}

CASES = {
    "sgd": (0, lambda w, s, i, g, **kw: sparse_apply.sgd(w, i, g, lr=HP["lr"], **kw),
            ref_sgd),
    "sgd_momentum": (1, lambda w, s, i, g, **kw: sparse_apply.sgd(
        w, i, g, lr=HP["lr"], momentum_slot=s[0], momentum=HP["momentum"], **kw), ref_sgd),
    "sgd_nesterov": (1, lambda w, s, i, g, **kw: sparse_apply.sgd(
        w, i, g, lr=HP["lr"], momentum_slot=s[0], momentum=HP["momentum"], nesterov=True,
        **kw), lambda *a: ref_sgd(*a, nesterov=True)),
    "adagrad": (1, lambda w, s, i, g, **kw: sparse_apply.adagrad(
        w, s[0], i, g, lr=HP["lr"], epsilon=HP["epsilon"], **kw), ref_adagrad),
    "ftrl": (2, lambda w, s, i, g, **kw: sparse_apply.ftrl(w, *s, i, g, **FTRL_HP, **kw),
             ref_ftrl),
    "ftrl_lr_power": (2, lambda w, s, i, g, **kw: sparse_apply.ftrl(
        w, *s, i, g, **{**FTRL_HP, "lr_power": -0.3}, **kw),
        lambda *a: ref_ftrl(*a, lr_power=-0.3)),
    "adam": (2, lambda w, s, i, g, **kw: sparse_apply.adam(
        w, *s, i, g, **_adam_hp(w.dtype), **kw), ref_adam),
    "amsgrad": (3, lambda w, s, i, g, **kw: sparse_apply.adam(
        w, s[0], s[1], i, g, vhat=s[2], **_adam_hp(w.dtype), **kw), ref_adam),
    "rmsprop": (1, lambda w, s, i, g, **kw: sparse_apply.rmsprop(
        w, s[0], i, g, **_rms_hp(), **kw), ref_rmsprop),
    "rmsprop_centered_momentum": (3, lambda w, s, i, g, **kw: sparse_apply.rmsprop(
        w, s[0], i, g, average_gradient=s[1], momentum_slot=s[2], momentum=HP["momentum"],
        **_rms_hp(), **kw), lambda *a: ref_rmsprop(*a, centered=True, momentum=True)),
    "rmsprop_momentum": (2, lambda w, s, i, g, **kw: sparse_apply.rmsprop(
        w, s[0], i, g, momentum_slot=s[1], momentum=HP["momentum"], **_rms_hp(), **kw),
        lambda *a: ref_rmsprop(*a, momentum=True)),
}

# (rows N, row width D, number of indices U, weight decay). The last two give the
# exact form long runs of rows without a gradient (one vectorised loop each), split
# between threads.
SHAPES = [(7, 1, 0, 0.0), (9, 64, 9, 0.0), (40, 3, 17, 0.1), (25, 64, 6, 0.0),
          (3000, 16, 40, 0.0), (1001, 5, 13, 0.1)]


def _state(rng, n, d, num_slots, dt, case=""):
    w = rng.normal(size=(n, d)).astype(dt)
    # Positive slots keep sqrt/pow arguments valid (accumulators, second moments) ...
    slots = [rng.uniform(0.1, 1.0, size=(n, d)).astype(dt) for _ in range(num_slots)]
    if "centered" in case:  # ... and RMSprop's average_gradient^2 < velocity.
        slots[1] = rng.uniform(-0.3, 0.3, size=(n, d)).astype(dt)
    return w, slots


def _reference(ref, w, slots, idx, g, dt, lazy, weight_decay):
    w, slots = w.copy(), [s.copy() for s in slots]
    rows = idx if lazy else np.arange(w.shape[0])
    dense_g = np.zeros_like(w)
    dense_g[idx] = g
    ww = w[rows]
    if weight_decay:
        ww = ww - ww * _c(dt, weight_decay) * _c(dt, HP["lr"])
    new_w, new_slots = ref(ww, [s[rows] for s in slots], dense_g[rows], dt)
    w[rows] = new_w
    for s, ns in zip(slots, new_slots):
        s[rows] = ns
    return w, slots


def _run(case, w0, slots0, idx, g, lazy, weight_decay, dtype):
    _, call, _ = CASES[case]
    w = tf.Variable(w0)
    slots = [tf.Variable(s) for s in slots0]
    kw = dict(lazy=lazy)
    if weight_decay:
        kw["weight_decay"] = weight_decay
    call(w, slots, tf.constant(idx, tf.int64), tf.constant(g, dtype), **kw)
    return w.numpy(), [s.numpy() for s in slots]


@pytest.mark.parametrize("lazy", [False, True], ids=["exact", "lazy"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N%d_D%d_U%d_wd%g" % s)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_numpy(case, shape, lazy):
    n, d, u, weight_decay = shape
    dt = np.dtype(np.float32)
    rng = np.random.default_rng(zlib.crc32(repr((case, shape, lazy)).encode()))
    num_slots, _, ref = CASES[case]
    w0, slots0 = _state(rng, n, d, num_slots, dt, case)
    idx = rng.permutation(n)[:u].astype(np.int64)
    g = rng.normal(size=(u, d)).astype(dt)
    w, slots = _run(case, w0, slots0, idx, g, lazy, weight_decay, tf.float32)
    want_w, want_slots = _reference(ref, w0, slots0, idx, g, dt, lazy, weight_decay)
    np.testing.assert_allclose(w, want_w, rtol=1e-6, atol=1e-6)
    for got, want in zip(slots, want_slots):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    if lazy:
        untouched = np.setdiff1d(np.arange(n), idx)
        np.testing.assert_array_equal(w[untouched], w0[untouched])
        for got, before in zip(slots, slots0):
            np.testing.assert_array_equal(got[untouched], before[untouched])


@pytest.mark.parametrize("case", ["adam", "ftrl", "rmsprop_centered_momentum"])
def test_float64(case):
    dt = np.dtype(np.float64)
    rng = np.random.default_rng(7)
    num_slots, _, ref = CASES[case]
    w0, slots0 = _state(rng, 12, 5, num_slots, dt, case)
    idx = np.array([3, 0, 11, 7], np.int64)
    g = rng.normal(size=(4, 5))
    w, slots = _run(case, w0, slots0, idx, g, False, 0.0, tf.float64)
    want_w, want_slots = _reference(ref, w0, slots0, idx, g, dt, False, 0.0)
    np.testing.assert_allclose(w, want_w, rtol=1e-13)
    for got, want in zip(slots, want_slots):
        np.testing.assert_allclose(got, want, rtol=1e-13)


@pytest.mark.parametrize("lazy", [False, True], ids=["exact", "lazy"])
@pytest.mark.parametrize("indices, message", [
    ([1, 10, 2], r"indices\[1\] = 10 is not a row of the table \(0 <= index < 10\)"),
    ([1, -1], r"indices\[1\] = -1 is not a row"),
    ([4, 2, 4], r"indices\[2\] = 4 repeats indices\[0\]"),
])
def test_bad_indices_fail_before_writing(indices, message, lazy):
    rng = np.random.default_rng(3)
    w0, (m0, v0) = _state(rng, 10, 4, 2, np.float32)
    w, m, v = tf.Variable(w0), tf.Variable(m0), tf.Variable(v0)
    g = np.ones((len(indices), 4), np.float32)
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        sparse_apply.adam(w, m, v, tf.constant(indices, tf.int64), g, lazy=lazy,
                          **_adam_hp(tf.float32))
    np.testing.assert_array_equal(w.numpy(), w0)
    np.testing.assert_array_equal(m.numpy(), m0)
    np.testing.assert_array_equal(v.numpy(), v0)


def test_shape_and_slot_errors():
    w = tf.Variable(tf.zeros([5, 3]))
    acc = tf.Variable(tf.ones([5, 3]))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"grad has shape \[2,4\], expected \[2,3\]"):
        sparse_apply.adagrad(w, acc, [0, 1], tf.ones([2, 4]), lr=0.1, epsilon=1e-7)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"slot 0 has shape \[5,2\]"):
        sparse_apply.adagrad(w, tf.Variable(tf.ones([5, 2])), [0], tf.ones([1, 3]), lr=0.1,
                             epsilon=1e-7)
    with pytest.raises(tf.errors.InvalidArgumentError, match="distinct variables"):
        sparse_apply.adagrad(w, w, [0], tf.ones([1, 3]), lr=0.1, epsilon=1e-7)
    with pytest.raises(tf.errors.InvalidArgumentError, match="needs a momentum slot"):
        sparse_apply.sgd(w, [0], tf.ones([1, 3]), lr=0.1, momentum=0.9)


def test_pending_read_keeps_its_value():
    """Copy-on-write: a tensor read before the update still holds the old values."""
    w0 = np.arange(12, dtype=np.float32).reshape(4, 3)
    w = tf.Variable(w0)
    before = w.read_value()
    sparse_apply.sgd(w, [2], tf.ones([1, 3]), lr=1.0)
    np.testing.assert_array_equal(before.numpy(), w0)
    np.testing.assert_array_equal(w.numpy()[2], w0[2] - 1)


def test_in_graph():
    w = tf.Variable(tf.ones([6, 2]))
    m, v = tf.Variable(tf.zeros([6, 2])), tf.Variable(tf.zeros([6, 2]))

    @tf.function
    def step(rows, grads):
        op = sparse_apply.adam(w, m, v, rows, grads, lazy=True, **_adam_hp(tf.float32))
        assert isinstance(op, tf.Operation)
        with tf.control_dependencies([op]):
            return w.read_value()

    out = step(tf.constant([1, 4], tf.int64), tf.ones([2, 2])).numpy()
    assert np.all(out[[1, 4]] < 1) and np.all(out[[0, 2, 3, 5]] == 1)


# ---------------------------------------------------------------------------
# Determinism: bit-identical between runs and for any number of intra-op threads.

def _determinism_run():
    rng = np.random.default_rng(11)
    n, d = 5000, 32
    out = []
    for lazy in (False, True):
        w = tf.Variable(rng.normal(size=(n, d)).astype(np.float32))
        m, v = tf.Variable(tf.zeros([n, d])), tf.Variable(tf.zeros([n, d]))
        for step in range(2):
            idx = rng.choice(n, 1500, replace=False)
            g = rng.normal(size=(1500, d)).astype(np.float32)
            sparse_apply.adam(w, m, v, idx, g, lr=0.01, beta1_power=0.9 ** (step + 1),
                              beta2_power=0.999 ** (step + 1), one_minus_beta1=0.1,
                              one_minus_beta2=0.001, epsilon=1e-7, weight_decay=0.01,
                              lazy=lazy)
        out += [w.numpy(), m.numpy(), v.numpy()]
    return np.stack(out)


_SINGLE_THREAD = """
import sys
import numpy as np
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
sys.path.insert(0, sys.argv[1])
from test_ops_sparse_apply import _determinism_run
np.save(sys.argv[2], _determinism_run())
"""


def test_bit_identical_across_runs_and_thread_counts(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    first, second = _determinism_run(), _determinism_run()  # the default (multi-thread) pool
    assert np.array_equal(first, second)
    path = tmp_path / "single_thread.npy"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
        [os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", _SINGLE_THREAD, here, str(path)], env=env,
                   check=True)
    assert np.array_equal(first, np.load(path))
