"""Trains a model with dynamic vocabularies (dynamic_vocabulary=True) under
`horovodrun -np N --gloo` or as one process, for tests/test_dynamic_vocabulary_horovod.py.

    vocabulary_training.py OUT_DIR [--runs sgd,adagrad,adagrad-admit2,adagrad-admit2-bloom] [--save DIR]
                                   [--restore DIR --format weights|checkpoint] [--crowd]

The model hashes three features (user ids by Keras Hashing, string tags by Keras
Hashing, item ids by a modulo) and reads a fourth table by id (city), which Horovod
row-shards: its ids share the exchange's one AllToAllv with the raw keys. The ranks
read shares of the same global batches (hybrid_training.rank_share). Per run (an
optimizer, "-admit2": admit_after=2, "-bloom": counted by a Bloom filter), rank 0 writes
OUT_DIR/RUN.json (the losses, the mean over the ranks after each step; the collectives
of one training step's graph; the passes' reports) and every rank writes
OUT_DIR/RUN.rankR.npz: the vocabulary that model.picasso.vocabulary() gave it
("TABLE|keys", "TABLE|rows"), the keys its own tables hold ("TABLE|held") and its Bloom
filters' counters ("TABLE|bloom").

--save writes DIR/RUN/weights (save_weights) and DIR/RUN/checkpoint (tf.train.Checkpoint
after model.picasso.write_back() on every rank, written by rank 0); --restore reads one
of them (--format) instead of training; where the restore is refused, every rank writes
OUT_DIR/RUN.rankR.json with the error and whether its tables and Bloom filters stayed as
they were. --crowd trains 3 steps with vocabulary_capacity
48, then a batch whose 64 distinct user ids rank 1 owns, and writes OUT_DIR/crowd.rankR.json:
the error each rank got, whether its tables stayed as they were, the loss of one more
step, the collectives of a step's graph, and (rank 0) the error of a tf.train.Checkpoint
written without write_back.
"""
import argparse
import json
import os

import numpy as np
import tensorflow as tf

import picasso_tf
from hybrid_training import GLOBAL_BATCH, OPTIMIZERS, STEPS, Losses, collectives, hvd, rank_share, world
from picasso_tf.embedding.dynamic_vocabulary import BloomCounts
from picasso_tf.embedding.row_keys import raw_key_owner

CAPACITY = 48


def build():
    tf.keras.utils.set_random_seed(5)
    user = tf.keras.Input((1,), dtype=tf.int64, name="user")
    tags = tf.keras.Input((2,), dtype=tf.string, name="tags")
    item = tf.keras.Input((1,), dtype=tf.int64, name="item")
    city = tf.keras.Input((1,), dtype=tf.int64, name="city")
    numeric = tf.keras.Input((3,), name="numeric")
    flat = tf.keras.layers.Flatten()
    parts = [flat(tf.keras.layers.Embedding(7, 4, name="emb_user")(tf.keras.layers.Hashing(7)(user))),
             tf.keras.layers.GlobalAveragePooling1D()(
                 tf.keras.layers.Embedding(5, 4, name="emb_tags")(tf.keras.layers.Hashing(5)(tags))),
             flat(tf.keras.layers.Embedding(6, 8, name="emb_item")(tf.keras.layers.Lambda(lambda x: x % 6)(item))),
             flat(tf.keras.layers.Embedding(50, 8, name="emb_city")(city)), numeric]
    x = tf.keras.layers.Dense(8, activation="relu")(tf.keras.layers.Concatenate()(parts))
    return tf.keras.Model([user, tags, item, city, numeric], tf.keras.layers.Dense(1, activation="sigmoid")(x))


def data(batches):
    """Skewed user ids, all 7 mod 1000 (the same residue for any small number of ranks)."""
    rng = np.random.default_rng(11)
    n = GLOBAL_BATCH * batches
    words = np.array([f"tag{i}" for i in range(30)])
    features = {"user": (rng.zipf(1.4, (n, 1)) % 5000) * 1000 + 7, "tags": words[rng.integers(0, 30, (n, 2))],
                "item": rng.integers(0, 40, (n, 1)) * 13, "city": rng.integers(0, 50, (n, 1)),
                "numeric": rng.normal(size=(n, 3)).astype(np.float32)}
    return features, (rng.random((n, 1)) < 0.4).astype(np.float32)


class MeanLosses(Losses):
    """The loss after each step, averaged over the ranks (each reports its share's)."""

    def on_train_batch_end(self, batch, logs=None):
        loss = float(logs["loss"])
        if world()[0] > 1:
            loss = float(hvd.allreduce(tf.constant(loss, tf.float64), op=hvd.Average, name="worker_loss"))
        self.losses.append(loss)


def make(run, **options):
    optimizer, _, admission = run.partition("-admit")
    admit, _, admission_filter = admission.partition("-")
    model = picasso_tf.optimize(build(), dynamic_vocabulary=True, replicate_tables_below=0,
                                admit_after=int(admit or 1), admission_filter=admission_filter or "exact",
                                bloom_filter_counters=1 << 16, **options)
    model.compile(OPTIMIZERS[optimizer](), "binary_crossentropy")
    return model


def exported(model):
    """{table name: what this rank's hash table of it holds (HashTable.export)}."""
    return {m.name: table.export() for s in model.picasso.storages.values()
            if s.kind == "dynamic_vocabulary" for m, table in zip(s.layout.members, s.tables)}


def held(model):
    """What this rank's tables hold (keys, rows, slots, lookup counts, last steps) and its
    Bloom filters' counters, as NumPy arrays."""
    arrays = [a.numpy() for table in exported(model).values() for a in table]
    return arrays + [f.counters.numpy() for s in model.picasso.storages.values()
                     for f in getattr(s, "filters", ()) if isinstance(f, BloomCounts)]


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def write_vocabulary(model, path):
    arrays = {}
    for name, (keys, rows) in model.picasso.vocabulary().items():
        arrays[f"{name}|keys"], arrays[f"{name}|rows"] = keys, rows
    for name, table in exported(model).items():
        arrays[f"{name}|held"] = table.keys.numpy()
    for s in model.picasso.storages.values():
        for m, counter in zip(s.layout.members, getattr(s, "filters", ())):
            if isinstance(counter, BloomCounts):
                arrays[f"{m.name}|bloom"] = counter.counters.numpy()
    np.savez(path, **arrays)


def run(args, name, size, rank):
    model = make(name)
    features, labels = data(STEPS)
    dataset = rank_share(features, labels, STEPS, size, rank)
    report = {"size": size}
    if args.restore:
        path = os.path.join(args.restore, name, args.format)
        before = held(model)
        try:
            if args.format == "weights":
                model.load_weights(path)
            else:
                tf.train.Checkpoint(model=model).read(path).expect_partial()
                model.picasso.read_back()
        except (ValueError, tf.errors.OpError) as e:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"{name}.rank{rank}.json"), "w") as f:
                json.dump({"restore_error": str(e), "unchanged": same(before, held(model))}, f)
            return
    else:
        losses = MeanLosses()
        model.fit(dataset, epochs=1, verbose=0, shuffle=False, callbacks=[losses])
        passes = model.picasso.reports["training"]["passes"]
        report.update(losses=losses.losses, collectives=collectives(model, dataset),
                      steps=int(model.optimizer.iterations.numpy()),
                      **{p["pass"]: p for p in passes if p["pass"] in ("distribute", "dynamic_vocabulary")})
    if args.save:
        model.save_weights(os.path.join(args.save, name, "weights"))
        model.picasso.write_back()
        if rank == 0:
            tf.train.Checkpoint(model=model).write(os.path.join(args.save, name, "checkpoint"))
        model.picasso.release()
    os.makedirs(args.out, exist_ok=True)
    write_vocabulary(model, os.path.join(args.out, f"{name}.rank{rank}.npz"))
    if rank == 0:
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump(report, f, default=str)


def crowd(args, size, rank):
    """A batch beyond the capacity on one owner only: every rank refuses it, nothing changes, training goes on."""
    model = make("sgd", vocabulary_capacity=CAPACITY)
    features, labels = data(4)
    shares = list(rank_share(features, labels, 4, size, rank))
    for x, y in shares[:3]:
        model.train_on_batch(x, y)
    candidates = np.arange(10**6, 10**6 + 4 * GLOBAL_BATCH * size)
    owned_by_one = candidates[raw_key_owner(candidates, size).numpy() == size - 1][:GLOBAL_BATCH]
    x, y = shares[3]
    per = GLOBAL_BATCH // size
    crowded = dict(x, user=owned_by_one[rank * per:(rank + 1) * per, None])
    before = held(model)
    error = None
    try:
        model.train_on_batch(crowded, y)
    except tf.errors.InvalidArgumentError as e:
        error = e.message
    unchanged = same(before, held(model))
    loss = float(model.train_on_batch(x, y, return_dict=True)["loss"])
    counts = collectives(model, tf.data.Dataset.from_tensors((x, y)))
    unsaved = None
    if rank == 0:       # without model.picasso.write_back() on every rank first
        try:
            tf.train.Checkpoint(model=model).write(os.path.join(args.out, "unsaved"))
        except RuntimeError as e:
            unsaved = str(e)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"crowd.rank{rank}.json"), "w") as f:
        json.dump({"error": error, "unchanged": unchanged, "loss_after": loss, "distinct": len(owned_by_one),
                   "unsaved": unsaved, "collectives": counts}, f)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--runs", default="sgd,adagrad,adagrad-admit2,adagrad-admit2-bloom")
    parser.add_argument("--save")
    parser.add_argument("--restore", help="a directory --save wrote, by any number of ranks")
    parser.add_argument("--format", default="weights", choices=["weights", "checkpoint"])
    parser.add_argument("--crowd", action="store_true", help="the capacity run, instead of the runs")
    args = parser.parse_args(argv)
    size, rank = world()
    if args.crowd:
        crowd(args, size, rank)
        return
    for name in args.runs.split(","):
        run(args, name, size, rank)


if __name__ == "__main__":
    main()
