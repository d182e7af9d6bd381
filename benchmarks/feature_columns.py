"""A wide-and-deep written with TensorFlow's feature columns, as tf.estimator users bring
it to Keras: stock Keras against picasso_tf, with and without reading the columns' one-hot
ids as they are (picasso_tf.passes.sparse_one_hot; sequence_pooling=False turns it off,
and nothing else of this model).

  python benchmarks/feature_columns.py [--batches 512,4096] [--rounds 9]
  python benchmarks/feature_columns.py --traced 5 [--batches 512,4096]

26 identity columns of 10,000 ids (Zipf 1.2) read by DenseFeatures twice: embedding
columns of width 8 into a 256-128 MLP with 13 numeric columns, and width-1 embedding
columns summed as the linear part. Adagrad, a cached tf.data pipeline; fit calls of at
least 60 steps alternated over 9 rounds; samples/s (median) and each round's ratio to
stock Keras (steps on this machine flip between a fast and a slow mode: the rounds show it).
--traced N: the two picasso_tf variants only, N alternations of 30 traced steps each
(tools/benchmarking/breakdown.py): wall and op time per step and ops run per step.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np            # noqa: E402
import tensorflow as tf       # noqa: E402

FIELDS, NUMERIC, VOCAB = 26, 13, 10_000


def build():
    fc = tf.feature_column
    ids = [fc.categorical_column_with_identity(f"c{i}", VOCAB) for i in range(FIELDS)]
    deep = [fc.embedding_column(c, 8) for c in ids] + [fc.numeric_column(f"d{i}") for i in range(NUMERIC)]
    wide = [fc.embedding_column(c, 1, combiner="sum") for c in ids]
    x = {f"c{i}": tf.keras.Input((1,), dtype="int64", name=f"c{i}") for i in range(FIELDS)}
    x.update({f"d{i}": tf.keras.Input((1,), name=f"d{i}") for i in range(NUMERIC)})
    hidden = tf.keras.layers.DenseFeatures(deep)(x)
    for units in (256, 128):
        hidden = tf.keras.layers.Dense(units, activation="relu")(hidden)
    linear = tf.reduce_sum(tf.keras.layers.DenseFeatures(wide)(x), axis=1, keepdims=True)
    return tf.keras.Model(x, tf.keras.layers.Activation("sigmoid")(tf.keras.layers.Dense(1)(hidden) + linear))


def dataset(batch):
    rng = np.random.default_rng(0)
    n = batch * 8
    features = {f"c{i}": np.minimum(rng.zipf(1.2, (n, 1)), VOCAB) - 1 for i in range(FIELDS)}
    features.update({f"d{i}": rng.random((n, 1)).astype("float32") for i in range(NUMERIC)})
    labels = (rng.random(n) < 0.3).astype("float32")
    return tf.data.Dataset.from_tensor_slices((features, labels)).batch(batch).cache().repeat()


def rounds_of(runs, rounds):
    """{name: seconds of each round's call}, the order of the calls reversed every other round."""
    times = {name: [] for name in runs}
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    return times


def main(argv=None):
    import picasso_tf
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="512,4096")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--traced", type=int, default=0)
    args = parser.parse_args(argv)
    variants = {"keras": lambda model: model,
                "picasso, sparse ids kept": lambda model: picasso_tf.optimize(model, sequence_pooling=False),
                "picasso": picasso_tf.optimize}
    if args.traced:
        variants.pop("keras")
    for batch in (int(b) for b in args.batches.split(",")):
        data, steps = dataset(batch), max(60, 120_000 // batch)
        models = {}
        for name, wrap in variants.items():
            tf.keras.utils.set_random_seed(0)
            models[name] = wrap(build())
            models[name].compile(tf.keras.optimizers.Adagrad(0.01), "binary_crossentropy")
            models[name].fit(data, steps_per_epoch=5, verbose=0)
        if args.traced:
            traced(models, data, batch, args.traced)
        else:
            timed(models, data, batch, steps, args.rounds)
        tf.keras.backend.clear_session()


def timed(models, data, batch, steps, rounds):
    times = rounds_of({name: lambda model=model: model.fit(data, steps_per_epoch=steps, verbose=0)
                       for name, model in models.items()}, rounds)
    rates = ", ".join(f"{name} {batch * steps / np.median(t):,.0f}/s" for name, t in times.items())
    print(f"batch {batch} ({steps} steps a round): {rates}", flush=True)
    for name in list(models)[1:]:
        ratios = np.array(times["keras"]) / np.array(times[name])
        print(f"  {name} / keras per round: median {np.median(ratios):.2f}x, "
              f"{' '.join(f'{r:.2f}' for r in ratios)}", flush=True)


def traced(models, data, batch, alternations):
    from tools.benchmarking.breakdown import op_breakdown
    walls = {name: [] for name in models}
    for _ in range(alternations):
        for name, model in models.items():
            trace = op_breakdown(model, data, steps=30, top=1000)
            walls[name].append(trace["wall_ms_per_step"])
            ops = sum(row["ops_per_step"] for row in trace["by_type"])
            print(f"batch {batch} {name}: wall {trace['wall_ms_per_step']:.2f} ms/step, op time "
                  f"{trace['op_ms_per_step']:.2f} ms/step, {ops:.0f} ops/step", flush=True)
    print(f"batch {batch} median wall ms/step: "
          + ", ".join(f"{name} {np.median(w):.2f}" for name, w in walls.items()), flush=True)


if __name__ == "__main__":
    main()
