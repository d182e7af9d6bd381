"""Padded ids read as they are, or as the SparseTensor a model makes of them?

A model that pools padded ids [B, L] (0 = no id) can write the pooling two ways, and
picasso_tf fuses both: `tf.sparse.from_dense` + `tf.nn.safe_embedding_lookup_sparse`
(the zoo's DLRM), or a lookup of every position summed with a weight `id != 0`
(sequence pooling: no conversion, but the fused kernels pass over every position,
checking padding but not reading its rows). The first's ids are read as they are
(picasso_tf/passes/sparse_one_hot.py: the kept ids alone, with their rows, in one op)
at every fill; with sequence_pooling=False its conversion's ops stay and the fused
lookup reads only the kept ids they give.

  python benchmarks/padded_ids.py [--fills 0.05,0.2,0.5,0.9] [--batch 1024]

Six such features (L = 50, 10,000 ids, width 16) feeding a small MLP, Adagrad, a cached
`tf.data` pipeline; per fill (the mean share of non-padding positions: lengths uniform
in [0, 2 * fill * L]) three models under picasso_tf: the from_dense one with
sequence_pooling=False (its sparse form kept), the same at the defaults (the output says
how many features were read as ids), and the masked one; timed interleaved by the
suite's `measure` (5 rounds of at least 1 s each); prints their samples/s and per-round
ratios to the first (above 1: faster).
"""
import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np            # noqa: E402
import tensorflow as tf       # noqa: E402

from tools.benchmarking.timing import Variant, measure, summary_lines   # noqa: E402

LENGTH, VOCAB, DIM, FEATURES = 50, 10_000, 16, 6


class SparseBag(tf.keras.layers.Layer):
    """The padded ids as a SparseTensor, pooled by safe_embedding_lookup_sparse."""

    def build(self, shape):
        self.table = self.add_weight("table", (VOCAB, DIM), initializer="uniform")

    def call(self, ids):
        return tf.nn.safe_embedding_lookup_sparse(self.table, tf.sparse.from_dense(ids), combiner="sum")


class MaskedBag(SparseBag):
    """Every position looked up, weighted by whether it holds an id, and summed."""

    def call(self, ids):
        weights = tf.cast(ids != 0, tf.float32)[..., None]
        return tf.reduce_sum(tf.nn.embedding_lookup(self.table, ids) * weights, axis=1)


def build(bag):
    inputs = [tf.keras.Input((LENGTH,), dtype="int64", name=f"seq{i}") for i in range(FEATURES)]
    x = tf.keras.layers.Concatenate()([bag()(ids) for ids in inputs])
    x = tf.keras.layers.Dense(64, activation="relu")(x)
    return tf.keras.Model(inputs, tf.keras.layers.Dense(1, activation="sigmoid")(x))


def dataset(fill, batch):
    rng = np.random.default_rng(0)
    n = batch * 16
    features = {}
    for i in range(FEATURES):
        ids = rng.integers(1, VOCAB, (n, LENGTH))
        lengths = rng.integers(0, int(2 * fill * LENGTH) + 1, n).clip(0, LENGTH)
        ids[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
        features[f"seq{i}"] = ids
    labels = (rng.random(n) < 0.3).astype("float32")
    return tf.data.Dataset.from_tensor_slices((features, labels)).batch(batch).cache().repeat()


def main(argv=None):
    import picasso_tf
    parser = argparse.ArgumentParser()
    parser.add_argument("--fills", default="0.05,0.2,0.5,0.9")
    parser.add_argument("--batch", type=int, default=1024)
    args = parser.parse_args(argv)
    print(f"batch {args.batch}, {FEATURES} features of {LENGTH} padded ids, width {DIM}, Adagrad", flush=True)
    for fill in (float(f) for f in args.fills.split(",")):
        data = dataset(fill, args.batch)
        variants, read = [], None
        for name, bag, pooling in (("sparse", SparseBag, False), ("read", SparseBag, True),
                                   ("masked", MaskedBag, True)):
            tf.keras.utils.set_random_seed(0)
            model = picasso_tf.optimize(build(bag), sequence_pooling=pooling)
            if name == "read":
                k_packing = next(p for p in model.picasso.reports["training"]["passes"] if p["pass"] == "k_packing")
                read = len(k_packing["sparse_one_hot_read_as_ids"])
            model.compile(tf.keras.optimizers.Adagrad(0.05), "binary_crossentropy")
            variants.append(Variant(name, model, data, args.batch))
        result = measure(variants, rounds=5, steps=100, warmup_steps=10, min_window_s=1.0,
                         pairs=[("read", "sparse"), ("masked", "sparse")])
        print(f"fill {fill:.2f} ({fill * LENGTH:.0f} of {LENGTH} ids; {read} of {FEATURES} "
              f"features read as ids), load {result['load_average'][0][0]:.1f}->{result['load_average'][1][0]:.1f}:",
              flush=True)
        print("\n".join("  " + line for line in summary_lines(result)), flush=True)
        tf.keras.backend.clear_session()


if __name__ == "__main__":
    main()
