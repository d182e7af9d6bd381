"""How long capture + rewrite + rebuild take as the number of fields grows.

    python benchmarks/rewrite_time.py 200 1000
    python benchmarks/rewrite_time.py --zoo deepfm,dsin

For each field count: a model of N one-hot fields (dims 8/16/32 in turn, vocabulary
1,000, concatenated into a sigmoid unit); optimize() time (two captures, the passes) and
the first training step (its trace imports the rewritten graph), beside stock Keras'
own first training step on the same model (its trace) for scale. With --zoo, the zoo's
models on the synthetic task's schema instead. `traces`: how many times each
first step traced Keras' train function.
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


def first_step(model, batch):
    """(seconds, traces) of the model's first training step."""
    model.compile(optimizer="adagrad", loss="binary_crossentropy")
    start = time.perf_counter()
    model.train_on_batch(*batch)
    return time.perf_counter() - start, model.train_function.experimental_get_tracing_count()


def zoo_builder(name):
    """A builder of zoo model `name` on the synthetic task's schema, and a batch of 64."""
    import picasso_tf.models as zoo
    from picasso_tf.models import quality
    train, _, _ = quality.synthetic(rows=1000)
    meta = zoo.info(name)
    params = dict(meta.prepare(train.schema, train.features)) if meta.prepare else {}
    label = next(iter(train.labels.values())) if isinstance(train.labels, dict) else train.labels
    return (lambda: meta.builder(train.schema, **params)), ({k: v[:64] for k, v in train.features.items()}, label[:64])


def main(args):
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}; command: python {' '.join(sys.argv)}")
    print(f"{'model':>9} {'optimize s':>11} {'first step s':>13} {'traces':>7} {'keras first step s':>19} "
          f"{'traces':>7}")
    if args[:1] == ["--zoo"]:
        cases = [(name, *zoo_builder(name)) for name in args[1].split(",")]
    else:
        cases = []
        for fields in [int(a) for a in args] or [200, 1000]:
            rng = np.random.default_rng(0)
            batch = ({f"f{i}": rng.integers(0, 1000, 64) for i in range(fields)}, np.zeros(64, np.float32))
            cases.append((f"{fields} fields", lambda fields=fields: build(fields), batch))
    for name, make, batch in cases:
        start = time.perf_counter()
        model = picasso_tf.optimize(make())
        optimize_s = time.perf_counter() - start
        step_s, traces = first_step(model, batch)
        keras_s, keras_traces = first_step(make(), batch)
        print(f"{name:>9} {optimize_s:>11.1f} {step_s:>13.2f} {traces:>7} {keras_s:>19.2f} {keras_traces:>7}")
        tf.keras.backend.clear_session()


if __name__ == "__main__":
    main(sys.argv[1:])
