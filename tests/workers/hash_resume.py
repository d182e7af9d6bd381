"""Trains hybrid_training's model with hash-backed tables (hybrid_hash=True, a hot tier
smaller than the tables) under `horovodrun -np N --gloo` or as one process, saves it
half way and resumes from the checkpoint, for tests/test_hybrid_hash_horovod.py.

    hash_resume.py OUT_DIR --save DIR        # trains 2*HALF steps; saves after HALF
    hash_resume.py OUT_DIR --restore DIR     # restores DIR, trains the last HALF steps

--save trains two models on the same batches: "whole", HALF + HALF steps with no
checkpoint between, and "saved", which after HALF steps writes DIR/weights
(save_weights, TensorFlow's format) and DIR/checkpoint (tf.train.Checkpoint, after
model.picasso.write_back() on every rank, written by rank 0), then trains on.
--restore makes a fresh model per format, restores it (load_weights, or
tf.train.Checkpoint.restore and model.picasso.read_back()) and trains the last HALF
steps: "resumed-weights", "resumed-checkpoint". Per model, rank 0 writes OUT_DIR/NAME.json
(the losses of the last HALF steps, the mean over the ranks) and OUT_DIR/NAME.npz (the
model's get_weights and Adagrad's table-shaped slots); every rank writes
OUT_DIR/NAME.rankR.json (the row ids in its hot tiers, per table, as a checkpoint
would save them).
"""
import argparse
import json
import os

import numpy as np
import tensorflow as tf

import picasso_tf
from hybrid_training import OPTIMIZERS, build, data, rank_share, world
from vocabulary_training import MeanLosses

HALF = 6        # the hot set is chosen after step 3 and every 4 steps: saved between refreshes


def make():
    model = picasso_tf.optimize(build(), hybrid_hash=True, replicate_tables_below=0, hot_storage_bytes=2000,
                                hot_warmup_steps=3, hot_refresh_every=4)
    model.compile(OPTIMIZERS["adagrad"](), "binary_crossentropy")
    return model


def batches(first, size, rank):
    """This rank's shares of the global batches first .. first + HALF - 1."""
    features, labels = data(2 * HALF)
    return rank_share(features, labels, 2 * HALF, size, rank).skip(first).take(HALF)


def train(model, first, size, rank):
    losses = MeanLosses()
    model.fit(batches(first, size, rank), epochs=1, verbose=0, shuffle=False, callbacks=[losses])
    return losses.losses


def hot_ids(model):
    """Per logical table, the row ids in this rank's hot tier."""
    out = {}
    for storage in model.picasso.storages.values():
        if storage.kind.endswith("hybrid_hash") and storage.hot is not None:
            for m, member in enumerate(storage.layout.members):
                out[member.name] = storage.saved_state(m)[1].tolist()
    return out


def record(model, name, losses, out, rank):
    weights = model.get_weights()       # gathers the sharded tables (a collective)
    model.picasso.write_back()
    hot = hot_ids(model)            # as write_back kept them
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.rank{rank}.json"), "w") as f:
        json.dump(hot, f)
    if rank == 0:
        slots = [v.numpy() for v in model.optimizer.variables if v.shape.rank == 2]
        np.savez(os.path.join(out, f"{name}.npz"), *weights, *slots)
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump({"losses": losses, "steps": int(model.optimizer.iterations.numpy())}, f)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--save")
    parser.add_argument("--restore")
    args = parser.parse_args(argv)
    size, rank = world()
    if args.save:
        whole = make()
        train(whole, 0, size, rank)
        record(whole, "whole", train(whole, HALF, size, rank), args.out, rank)
        saved = make()
        train(saved, 0, size, rank)
        saved.save_weights(os.path.join(args.save, "weights"))
        saved.picasso.write_back()
        if rank == 0:
            tf.train.Checkpoint(model=saved).write(os.path.join(args.save, "checkpoint"))
        record(saved, "saved", train(saved, HALF, size, rank), args.out, rank)
        return
    for fmt in ("weights", "checkpoint"):
        model = make()
        path = os.path.join(args.restore, fmt)
        if fmt == "weights":
            model.load_weights(path)
        else:
            tf.train.Checkpoint(model=model).restore(path).expect_partial()
            model.picasso.read_back()
        record(model, f"resumed-{fmt}", train(model, HALF, size, rank), args.out, rank)


if __name__ == "__main__":
    main()
