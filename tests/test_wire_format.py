"""config.wire_dtype in one process: a named error for a type it does not know, and no
effect (there is no exchange). Its effect across ranks: tests/test_horovod.py."""
import numpy as np
import pytest
import tensorflow as tf

import picasso_tf


def test_an_unknown_wire_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match=r"wire_dtype .*'float32'.*'float16'.*got 'bfloat16'"):
        picasso_tf.Config(wire_dtype="bfloat16")


def _trained(wire_dtype):
    tf.keras.utils.set_random_seed(1)
    ids = tf.keras.Input((2,), dtype=tf.int64)
    x = tf.keras.layers.Flatten()(tf.keras.layers.Embedding(50, 4)(ids))
    model = picasso_tf.optimize(tf.keras.Model(ids, tf.keras.layers.Dense(1, activation="sigmoid")(x)),
                                wire_dtype=wire_dtype)
    model.compile(tf.keras.optimizers.Adam(0.01), "binary_crossentropy")
    rng = np.random.default_rng(0)
    model.fit(rng.integers(0, 50, (64, 2)), rng.integers(0, 2, (64, 1)).astype(np.float32), batch_size=16,
              epochs=1, verbose=0, shuffle=False)
    return model.get_weights()


def test_a_float16_wire_changes_nothing_in_one_process():
    for a, b in zip(_trained("float32"), _trained("float16")):
        np.testing.assert_array_equal(a, b)
