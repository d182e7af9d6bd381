"""Dynamic vocabularies against hash bins: what collisions cost in AUC, what each keeps
in memory, and the step's speed.

    .venv/bin/python benchmarks/dynamic_vocabulary.py [--ids 200000] [--zipf 1.1]
        [--train 200000] [--test 40000] [--batch 1024] [--bins 4096 65536]
        [--capacity 30000] [--rounds 3] [--steps 20] [--out benchmarks/dynamic_vocabulary.txt]

Data (planted, so the best AUC is known): two features, user and item, each a Zipf
(--zipf) draw over --ids ranks mapped to raw int64 ids by a random permutation of
[0, 2**40); every rank has a true effect N(0, 1), and a label is 1 with probability
sigmoid(effect(user) + effect(item) - 1). The model, in plain Keras: per feature Keras
Hashing(bins) then an Embedding(bins, 8), concatenated, one sigmoid unit; Adagrad(0.5).
Every variant trains one epoch of --train samples (batches of --batch, in order) and is
scored on --test held-out samples:
  keras bins=B              the model as written
  picasso bins=B            the same model through picasso_tf.optimize (the same bins)
  dynamic                   picasso_tf.optimize(dynamic_vocabulary=True): keyed by raw id
  dynamic admit_after=2     a row only from an id's second lookup
  dynamic capacity=C        at most C keys per table, LFU eviction
Memory is the tables' with Adagrad's accumulators: bins x 8 x 4 bytes x 2 for the fixed
tables; for the hash tables, keys held x (24-byte row header + 8 x 4 bytes x 2) plus
16-byte buckets at most 3/4 full (custom_ops/hash_table.h), a lower bound (a table that
has just grown holds twice the buckets). Then the step's speed: keras, picasso and
dynamic at the largest --bins, interleaved (tools/benchmarking/timing.measure) over
--rounds rounds of --steps steps on batches of the training stream.
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import tensorflow as tf  # noqa: E402

import picasso_tf  # noqa: E402
from picasso_tf.data import roc_auc  # noqa: E402
from tools.benchmarking.timing import Variant, StepTimer, in_memory_dataset, measure  # noqa: E402

DIM = 8
FEATURES = ("user", "item")


def planted_data(args):
    rng = np.random.default_rng(0)
    n = args.train + args.test
    raw, effects, ranks = {}, {}, {}
    for f in FEATURES:
        raw[f] = rng.permutation(np.unique(rng.integers(0, 1 << 40, 2 * args.ids)))[:args.ids]
        effects[f] = rng.normal(size=args.ids)
        r = rng.zipf(args.zipf, n * 2)
        ranks[f] = (r[r <= args.ids] - 1)[:n]
    logit = sum(effects[f][ranks[f]] for f in FEATURES) - 1.0
    probability = 1 / (1 + np.exp(-logit))
    labels = (rng.random(n) < probability).astype(np.float32)
    x = {f: raw[f][ranks[f]][:, None] for f in FEATURES}
    split = args.train
    return ({f: v[:split] for f, v in x.items()}, labels[:split]), \
        ({f: v[split:] for f, v in x.items()}, labels[split:]), roc_auc(labels[split:], probability[split:])


def keras_model(bins):
    tf.keras.utils.set_random_seed(1)
    inputs = {f: tf.keras.Input(shape=(1,), dtype=tf.int64, name=f) for f in FEATURES}
    parts = [tf.keras.layers.Flatten()(tf.keras.layers.Embedding(bins, DIM, name=f"emb_{f}")(
        tf.keras.layers.Hashing(bins)(inputs[f]))) for f in FEATURES]
    out = tf.keras.layers.Dense(1, activation="sigmoid")(tf.keras.layers.Concatenate()(parts))
    return tf.keras.Model(inputs, out)


def variants(args):
    big = max(args.bins)
    out = []
    for bins in args.bins:
        out.append((f"keras bins={bins}", lambda b=bins: keras_model(b), 2 * bins * len(FEATURES)))
        out.append((f"picasso bins={bins}", lambda b=bins: picasso_tf.optimize(keras_model(b)),
                    2 * bins * len(FEATURES)))
    out.append(("dynamic", lambda: picasso_tf.optimize(keras_model(big), dynamic_vocabulary=True), None))
    out.append(("dynamic admit_after=2",
                lambda: picasso_tf.optimize(keras_model(big), dynamic_vocabulary=True, admit_after=2), None))
    out.append((f"dynamic capacity={args.capacity}",
                lambda: picasso_tf.optimize(keras_model(big), dynamic_vocabulary=True,
                                            vocabulary_capacity=args.capacity), None))
    return out


def hash_table_bytes(keys):
    return keys * (24 + 2 * DIM * 4 + 16 / 0.75)


def compiled(model):
    model.compile(tf.keras.optimizers.Adagrad(0.5), "binary_crossentropy")
    return model


def quality(args, train, test):
    rows = []
    for name, make, table_rows in variants(args):
        model = compiled(make())
        timer = StepTimer()
        model.fit(train[0], train[1], batch_size=args.batch, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
        seconds = timer.times[-1] - timer.times[0]      # from the end of the first step: no tracing
        auc = roc_auc(test[1], model.predict(test[0], batch_size=8192, verbose=0)[:, 0])
        if table_rows is None:
            keys = sum(len(k) for k, _ in model.picasso.vocabulary().values())
            memory, held = hash_table_bytes(keys), f"{keys:,} keys"
        else:
            memory, held = table_rows * DIM * 4, f"{table_rows // 2:,} rows"
        rows.append((name, auc, held, memory, (len(timer.times) - 1) * args.batch / seconds))
        print(f"  {name}: AUC {auc:.4f}", flush=True)
    return rows


def speed(args, train):
    big = max(args.bins)
    batches = [({f: v[i * args.batch:(i + 1) * args.batch] for f, v in train[0].items()},
                train[1][i * args.batch:(i + 1) * args.batch]) for i in range(args.steps)]
    made = {"keras": keras_model(big), "picasso": picasso_tf.optimize(keras_model(big)),
            "dynamic": picasso_tf.optimize(keras_model(big), dynamic_vocabulary=True)}
    timed = [Variant(name, compiled(model), in_memory_dataset(batches), args.batch) for name, model in made.items()]
    return measure(timed, args.rounds, args.steps, pairs=[("picasso", "keras"), ("dynamic", "keras"),
                                                         ("dynamic", "picasso")])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ids", type=int, default=200000)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--train", type=int, default=200000)
    parser.add_argument("--test", type=int, default=40000)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--bins", type=int, nargs="+", default=[4096, 65536])
    parser.add_argument("--capacity", type=int, default=30000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(HERE, "dynamic_vocabulary.txt"))
    args = parser.parse_args(argv)
    train, test, best = planted_data(args)
    distinct = {f: len(np.unique(train[0][f])) for f in FEATURES}
    lines = [f"$ python benchmarks/dynamic_vocabulary.py {' '.join(argv or sys.argv[1:])}",
             f"distinct ids in the training stream: {distinct}; planted (best possible) test AUC {best:.4f}", "",
             "| variant | test AUC | tables hold | table bytes | samples/s over the epoch (first step left out) |",
             "|---|---|---|---|---|"]
    for name, auc, held, memory, sps in quality(args, train, test):
        lines.append(f"| {name} | {auc:.4f} | {held} | {memory / 2**20:.1f} MiB | {sps:,.0f} |")
    result = speed(args, train)
    lines += ["", f"Step speed, bins={max(args.bins)}, {args.rounds} rounds of {args.steps} steps, batch {args.batch} "
              f"(load average {result['load_average']}):", "", "| variant | samples/s (median, min-max) |", "|---|---|"]
    for name, v in result["variants"].items():
        lines.append(f"| {name} | {v['samples_per_s']:,.0f} ({v['samples_per_s_min']:,.0f}-"
                     f"{v['samples_per_s_max']:,.0f}) |")
    for pair, r in result["ratios"].items():
        lines.append(f"| ratio {pair} | {r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f}) |")
    text = "\n".join(lines)
    print(text)
    with open(args.out, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
