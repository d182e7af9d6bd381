"""How long capture + rewrite + rebuild take as the number of fields grows.

    python benchmarks/rewrite_time.py 200 1000

For each field count: a model of N one-hot fields (dims 8/16/32 in turn, vocabulary
1,000, concatenated into a sigmoid unit); optimize() time (two captures, the passes) and
the first training step (its trace imports the rewritten graph), beside stock Keras'
own first training step on the same model (its trace) for scale.
"""
import os
import platform
import sys
import time

import numpy as np
import tensorflow as tf

import picasso_tf


def build(fields):
    x = {f"f{i}": tf.keras.Input((), dtype="int64", name=f"f{i}") for i in range(fields)}
    embs = [tf.keras.layers.Embedding(1000, (8, 16, 32)[i % 3])(x[f"f{i}"]) for i in range(fields)]
    return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(tf.keras.layers.Concatenate()(embs)))


def first_step_seconds(model, batch):
    model.compile(optimizer="adagrad", loss="binary_crossentropy")
    start = time.perf_counter()
    model.train_on_batch(*batch)
    return time.perf_counter() - start


def main(field_counts):
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}; command: python {' '.join(sys.argv)}")
    print(f"{'fields':>7} {'optimize s':>11} {'first step s':>13} {'keras first step s':>19}")
    for fields in field_counts:
        rng = np.random.default_rng(0)
        batch = ({f"f{i}": rng.integers(0, 1000, 64) for i in range(fields)}, np.zeros(64, np.float32))
        start = time.perf_counter()
        model = picasso_tf.optimize(build(fields))
        optimize_s = time.perf_counter() - start
        step_s = first_step_seconds(model, batch)
        keras_s = first_step_seconds(build(fields), batch)
        print(f"{fields:>7} {optimize_s:>11.1f} {step_s:>13.1f} {keras_s:>19.1f}")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [200, 1000])
