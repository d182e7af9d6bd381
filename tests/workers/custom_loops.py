"""Horovod's own idioms around a picasso_tf model, for tests/test_custom_loops.py:
hvd.DistributedGradientTape (refused by name) and fit with hvd.DistributedOptimizer
(trains with the hybrid plan: picasso_tf averages the gradients, the wrapper adds no
Allreduce). Under `horovodrun -np N` or as one process (then a plain Keras optimizer).

    custom_loops.py OUT_DIR

Every rank reads the same global batches of 64 samples and keeps its contiguous share.
Rank 0 writes OUT_DIR/result.json (the tape's refusal, the optimizer note, the losses)
and OUT_DIR/weights.npz (get_weights after 10 steps).
"""
import json
import os
import sys

import numpy as np
import tensorflow as tf

import picasso_tf
from picasso_tf.distributed.world import launched_world
from picasso_tf.errors import UnsupportedModelError

SIZE = launched_world()[0]
if SIZE > 1:
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    hvd.init()
RANK = hvd.rank() if SIZE > 1 else 0
FIELDS, VOCAB, GLOBAL_BATCH, STEPS = 4, 50, 64, 10


def model():
    tf.keras.utils.set_random_seed(5)
    x = {f"c{i}": tf.keras.Input((), dtype="int64", name=f"c{i}") for i in range(FIELDS)}
    deep = tf.keras.layers.Concatenate()([tf.keras.layers.Embedding(VOCAB, 4)(x[f"c{i}"]) for i in range(FIELDS)])
    return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(
        tf.keras.layers.Dense(8, activation="relu")(deep)))


def batch(step):
    rng = np.random.default_rng(step)
    x = {f"c{i}": rng.integers(0, VOCAB, GLOBAL_BATCH) for i in range(FIELDS)}
    y = (rng.random((GLOBAL_BATCH, 1)) < 0.5).astype("float32")
    share = slice(RANK * GLOBAL_BATCH // SIZE, (RANK + 1) * GLOBAL_BATCH // SIZE)
    return {k: v[share] for k, v in x.items()}, y[share]


def main(argv):
    (out_dir,) = argv
    result = {}
    # Every table sharded: the plan a tape cannot serve.
    wrapped = picasso_tf.optimize(model(), replicate_tables_below=0)
    if SIZE > 1:
        try:
            with hvd.DistributedGradientTape(tf.GradientTape()):
                wrapped(batch(0)[0], training=True)
            result["tape"] = None
        except UnsupportedModelError as e:
            result["tape"] = str(e)
    optimizer = tf.keras.optimizers.Adagrad(0.1)
    wrapped.compile(optimizer=hvd_keras.DistributedOptimizer(optimizer) if SIZE > 1 else optimizer,
                    loss="binary_crossentropy")
    result["losses"] = [float(wrapped.train_on_batch(*batch(step))) for step in range(STEPS)]
    result["optimizer_note"] = wrapped.picasso.optimizer_note
    weights = wrapped.get_weights()
    if RANK == 0:
        os.makedirs(out_dir, exist_ok=True)
        json.dump(result, open(os.path.join(out_dir, "result.json"), "w"))
        np.savez(os.path.join(out_dir, "weights.npz"), *weights)


if __name__ == "__main__":
    main(sys.argv[1:])
