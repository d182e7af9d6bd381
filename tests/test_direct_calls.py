"""Keras' step functions called without their per-call dispatch
(picasso_tf.runtime.direct_calls): the same training, evaluation and prediction as
Keras' own calls, on the same traced functions, and the iterator let go after fit."""
import gc

import numpy as np
import tensorflow as tf

import picasso_tf as picasso
from test_lifecycle import BATCH, features, wide_deep

STEPS = 4


def data(seed=0):
    return tf.data.Dataset.from_tensor_slices(features(BATCH * STEPS, seed)).batch(BATCH)


def model():
    optimized = picasso.optimize(wide_deep())
    optimized.compile(optimizer="adagrad", loss="binary_crossentropy", metrics=["AUC"])
    return optimized


class BoundAtBatchEnd(tf.keras.callbacks.Callback):
    """Whether the train (test) function called its concrete function directly, per batch."""

    def __init__(self):
        super().__init__()
        self.train, self.test = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.train.append(getattr(self.model.train_function, "_bound", None) is not None)

    def on_test_batch_end(self, batch, logs=None):
        self.test.append(getattr(self.model.test_function, "_bound", None) is not None)


def test_direct_calls_train_evaluate_and_predict_as_keras_own_calls():
    results = {}
    for name in ("direct", "dispatched"):
        m = model()
        if name == "dispatched":          # Keras' own call of the same tf.functions, every step
            for kind in ("train", "test", "predict"):
                setattr(m, f"{kind}_function", getattr(m, f"make_{kind}_function")().function)
        seen = BoundAtBatchEnd()
        history = m.fit(data(), epochs=2, verbose=0, callbacks=[seen], validation_data=data(1))
        results[name] = dict(history=history.history, evaluated=m.evaluate(data(2), verbose=0, callbacks=[seen]),
                             predicted=m.predict(data(3), verbose=0), weights=m.get_weights(), seen=seen,
                             tracings=m.train_function.experimental_get_tracing_count())
    direct, dispatched = results["direct"], results["dispatched"]
    # From each iterator's second call on (an iterator per epoch, evaluation's too).
    assert direct["seen"].train == [False] + [True] * (STEPS - 1) + [False] + [True] * (STEPS - 1)
    assert direct["seen"].test[-STEPS:] == [False] + [True] * (STEPS - 1)
    assert not any(dispatched["seen"].train)
    assert direct["tracings"] == dispatched["tracings"] == 1
    assert direct["history"] == dispatched["history"]
    assert direct["evaluated"] == dispatched["evaluated"]
    np.testing.assert_array_equal(direct["predicted"], dispatched["predicted"])
    for a, b in zip(direct["weights"], dispatched["weights"]):
        np.testing.assert_array_equal(a, b)


def test_the_iterator_is_let_go_after_fit_and_train_on_batch_keeps_keras_call():
    m = model()
    m.fit(data(), epochs=1, verbose=0)
    gc.collect()
    assert m.train_function._bound is None        # its flat arguments hold the iterator's resource
    x, y = next(iter(data()))
    before = m.get_weights()
    for _ in range(3):
        m.train_on_batch(x, y)                    # a new iterator per call: never bound
        assert m.train_function._bound is None
    assert any(not np.array_equal(a, b) for a, b in zip(before, m.get_weights()))
