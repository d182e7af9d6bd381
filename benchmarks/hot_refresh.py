"""What one refresh of HybridHash's hot tier costs, against the size of the table.

    .venv/bin/python benchmarks/hot_refresh.py [--rows 100000 1000000 4000000] [--hot-share 0.01]
        [--batch 256] [--ids-per-example 16] [--ahead 10] [--repeats 5]

One Keras model (an embedding table of each --rows rows, dim 16, looked up by
--ids-per-example Zipf ids per example, averaged, and a sigmoid unit; Adagrad) trains
through picasso_tf.optimize(hybrid_hash=True) with a hot tier of --hot-share of the rows,
for a few steps; then each refresh is timed alone, between steps, --repeats times (the
median is printed):

- scheduled: Algorithm 1's refresh from past counts, as the training step runs it when
  it is due (the hot rows and counts go back to the table, the hottest keys come in);
- lookahead: hot_refresh="lookahead"'s refresh from the ids of the next --ahead batches.

Run it at two commits to compare them (the script uses nothing newer than both).
"""
import argparse
import statistics
import time

import numpy as np
import tensorflow as tf

import picasso_tf


def model_of(rows, ids_per_example):
    ids = tf.keras.Input(shape=(ids_per_example,), dtype=tf.int64, name="u")
    rows_of = tf.keras.layers.Embedding(rows, 16, name="table")(ids)
    out = tf.keras.layers.Dense(1, activation="sigmoid")(tf.reduce_mean(rows_of, axis=1))
    return tf.keras.Model(ids, out)


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000, 4_000_000])
    parser.add_argument("--hot-share", type=float, default=0.01)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--ids-per-example", type=int, default=16)
    parser.add_argument("--ahead", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"batch {args.batch} x {args.ids_per_example} Zipf(1.05) ids; dim 16, Adagrad; hot tier "
          f"{args.hot_share:.0%} of the rows; median of {args.repeats} refreshes, each alone between steps")
    print(f"{'rows':>10} {'hot rows':>9} {'scheduled ms':>13} {'lookahead ms':>13}")
    for rows in args.rows:
        def batch():
            return {"u": (rng.zipf(1.05, (args.batch, args.ids_per_example)) - 1) % rows}, \
                np.zeros(args.batch, np.float32)
        hot_rows = int(rows * args.hot_share)
        model = picasso_tf.optimize(model_of(rows, args.ids_per_example), hybrid_hash=True,
                                    hot_storage_bytes=hot_rows * (2 * 16 * 4 + 16), hot_warmup_steps=10 ** 9)
        model.compile(tf.keras.optimizers.Adagrad(0.01), "binary_crossentropy")
        for _ in range(3):
            model.train_on_batch(*batch())
        (storage,) = model.picasso.storages.values()
        (table,) = [m.name for m in storage.layout.members]
        upcoming = [{table: batch()[0]["u"]} for _ in range(args.ahead)]
        scheduled = timed(storage._refresh, args.repeats)
        ahead = timed(lambda: storage.refresh_ahead(upcoming), args.repeats)
        print(f"{rows:>10,} {storage.hot.capacity:>9,} {1e3 * scheduled:>13.1f} {1e3 * ahead:>13.1f}", flush=True)
        del model, storage


if __name__ == "__main__":
    main()
