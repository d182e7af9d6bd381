"""A batch with an id outside its table on one rank only, under `horovodrun -np 2 --gloo`,
for tests/test_horovod_bad_ids.py.

    bad_ids.py OUT_DIR [--models hashed,vocabulary,replicated,replicated_micro_batches,mixed,mixed_micro_batches]

"hashed": hybrid_training's model with hash-backed tables (hybrid_hash=True, a small
hot tier), the bad id a user's (5000; the table has 1000 rows). "vocabulary":
vocabulary_training's model (dynamic vocabularies with admit_after=2, whose raw keys
make the exchange send pairs, beside a row-sharded table), the bad id a city's (500;
50 rows). "replicated": hybrid_training's model as picasso_tf.optimize makes it by
default, every table small enough to stay whole on each rank, the bad id a user's;
"replicated_micro_batches" the same at micro_batches=2, the bad id in rank 1's second
micro-batch.
"mixed": the same with its 8-wide group (user, item, city) row-sharded and its 4-wide
one (flag, history) replicated, the bad id a history's (5000; 500 rows).
"mixed_micro_batches": "mixed" at micro_batches=2, the bad id in rank 1's second
micro-batch. Each trains with Adagrad, one global batch per step: 3 steps, then a step
whose bad id is in rank 1's share only, whose error every rank catches, the same batch
in a forward pass outside the step (training=True: every rank raises where rows are
exchanged, rank 1 alone where every table is replicated; every rank catches), then 3 more
steps; and a second model the same 6 good steps with no bad one. The models run one
after the other in one launch (the ranks' start-up is most of a run). Every rank writes
OUT_DIR/MODEL/rankR.json: the error it caught, whether everything it holds of the model
(weights, shards, hash tables with their counts, hot tiers, vocabularies, optimizer
variables, Keras' step count) stayed as it was over the refused step, and is equal to
the undisturbed model's at the end, the losses of both models' good steps (mean over the ranks), and
the collectives of a training step's graph, and the distribute pass's report.
"""
import argparse
import json
import os

import numpy as np
import tensorflow as tf

import hybrid_training
import picasso_tf
import vocabulary_training
from hybrid_training import OPTIMIZERS, collectives, hvd, rank_share, world

MODELS = {"hashed": (hybrid_training, "user", 5000), "vocabulary": (vocabulary_training, "city", 500),
          "replicated": (hybrid_training, "user", 5000), "replicated_micro_batches": (hybrid_training, "user", 5000),
          "mixed": (hybrid_training, "history", 5000),
          "mixed_micro_batches": (hybrid_training, "history", 5000)}
# hybrid_training's groups: 8-wide 1703 rows (54,496 bytes), 4-wide 501 rows (8,016 bytes).
OPTIONS = {"hashed": dict(replicate_tables_below=0, hybrid_hash=True, hot_storage_bytes=2000, hot_warmup_steps=1,
                          hot_refresh_every=2),
           "replicated": {}, "replicated_micro_batches": dict(micro_batches=2),
           "mixed": dict(replicate_tables_below=20000),
           "mixed_micro_batches": dict(replicate_tables_below=20000, micro_batches=2)}


def make(name):
    if name == "vocabulary":
        return vocabulary_training.make("adagrad-admit2")
    model = picasso_tf.optimize(hybrid_training.build(), **OPTIONS[name])
    model.compile(OPTIMIZERS["adagrad"](), "binary_crossentropy")
    return model


def state(model):
    """Everything this rank holds of the model, as NumPy arrays (Keras' count of the
    steps trained included)."""
    arrays = [v.numpy() for v in model.original.weights + model.optimizer.variables + [model._train_counter]]
    for storage in model.picasso.storages.values():
        tables = [storage.table] if storage.kind.endswith("hybrid_hash") else list(getattr(storage, "tables", []))
        tables += [f.table for f in getattr(storage, "filters", []) if hasattr(f, "table")]
        arrays += [v.numpy() for v in storage.variables()] + [a.numpy() for t in tables for a in t.export()]
        hot = getattr(storage, "hot", None)
        if hot is not None:
            arrays += [v.numpy() for v in (hot.keys, hot.rows, *hot.slots, hot.counts, hot.hits, hot.lookups, hot.held)]
    return arrays


def equal(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def step(model, batch):
    loss = float(model.train_on_batch(*batch, return_dict=True)["loss"])
    return float(hvd.allreduce(tf.constant(loss, tf.float64), op=hvd.Average, name="worker_loss"))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--models", default=",".join(sorted(MODELS)), help="comma-separated, of " + ", ".join(MODELS))
    args = parser.parse_args(argv)
    for name in args.models.split(","):
        run(name, os.path.join(args.out, name))


def run(name, out):
    """One model's refused step and the steps around it; writes out/rankR.json."""
    size, rank = world()
    source, feature, bad_id = MODELS[name]
    features, labels = source.data(6)
    batches = list(rank_share(features, labels, 6, size, rank).as_numpy_iterator())
    model = make(name)
    losses = [step(model, b) for b in batches[:3]]
    x, y = batches[3]
    if rank == 1:       # row 1; with micro-batches the last row, in the last micro-batch
        row = len(y) - 1 if "micro" in name else 1
        x = dict(x, **{feature: np.where(np.arange(len(y))[:, None] == row, bad_id, x[feature])})
    before = state(model)
    error = None
    try:
        model.train_on_batch(x, y)
    except tf.errors.InvalidArgumentError as e:
        error = e.message
    unchanged = equal(before, state(model))
    # The same batch in a forward pass outside the training step: no collective there to
    # leave waiting, so the kernels check the ids on their own rank (as in inference).
    try:
        model(x, training=True)
        forward_error = None
    except tf.errors.InvalidArgumentError as e:
        forward_error = e.message
    unchanged = unchanged and equal(before, state(model))
    losses += [step(model, b) for b in batches[3:]]
    undisturbed = make(name)
    expected = [step(undisturbed, b) for b in batches]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"size": size, "error": error, "forward_error": forward_error, "unchanged": unchanged,
                   "losses": losses, "expected": expected,
                   "same_state": equal(state(model), state(undisturbed)),
                   "collectives": collectives(model, tf.data.Dataset.from_tensors(batches[0])),
                   "distribute": next(p for p in model.picasso.reports["training"]["passes"]
                                      if p["pass"] == "distribute")}, f, default=str)


if __name__ == "__main__":
    main()
