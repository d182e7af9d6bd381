"""A wide-and-deep written with TensorFlow's feature columns, as tf.estimator users bring
it to Keras: stock Keras against picasso_tf, with and without reading the columns' one-hot
ids as they are (picasso_tf.passes.sparse_one_hot; sequence_pooling=False turns it off,
and nothing else of this model).

  python benchmarks/feature_columns.py [--batches 512,4096]

26 identity columns of 10,000 ids (Zipf 1.2) read by DenseFeatures twice: embedding
columns of width 8 into a 256-128 MLP with 13 numeric columns, and width-1 embedding
columns summed as the linear part. Adagrad, a cached tf.data pipeline; fit calls of at
least 60 steps alternated over 5 rounds; samples/s (median) and per-round median ratios.
"""
import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np            # noqa: E402
import tensorflow as tf       # noqa: E402

from dense_packing import alternating   # noqa: E402

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


def main(argv=None):
    import picasso_tf
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="512,4096")
    args = parser.parse_args(argv)
    variants = {"keras": lambda model: model,
                "picasso, sparse ids kept": lambda model: picasso_tf.optimize(model, sequence_pooling=False),
                "picasso": picasso_tf.optimize}
    for batch in (int(b) for b in args.batches.split(",")):
        data, steps = dataset(batch), max(60, 120_000 // batch)
        runs = {}
        for name, wrap in variants.items():
            tf.keras.utils.set_random_seed(0)
            model = wrap(build())
            model.compile(tf.keras.optimizers.Adagrad(0.01), "binary_crossentropy")
            model.fit(data, steps_per_epoch=5, verbose=0)
            runs[name] = lambda model=model: model.fit(data, steps_per_epoch=steps, verbose=0)
        seconds, ratios = alternating(runs, rounds=5, steps=1)
        rates = ", ".join(f"{name} {batch * steps / s:,.0f}/s" for name, s in seconds.items())
        print(f"batch {batch} ({steps} steps a round): {rates}; over keras: "
              + ", ".join(f"{name} {ratio:.2f}x" for name, ratio in ratios.items()), flush=True)
        tf.keras.backend.clear_session()


if __name__ == "__main__":
    main()
