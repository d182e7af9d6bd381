"""Trains a small wide-and-deep model with picasso_tf, under `picasso-run -np N` (MPI or
Gloo) or as one process (no Horovod), for tests/test_horovod.py.

    hybrid_training.py OUT_DIR [--optimizers sgd,adagrad,adam] [--batches-rank1 K]
                               [--restore DIR] [--save DIR] [--no-train] [--hybrid-hash]
                               [--wire-dtype float16] [--count-bytes] [--micro-batches K]
                               [--interleave-from mlp] [--interleave-groups N] [--no-stitching]
                               [--no-check-ids-rank1]

Every rank reads the same global batches of 64 samples and keeps its contiguous share,
so N ranks train on the samples one process trains on. Per optimizer, rank 0 writes
OUT_DIR/OPT.npz (the model's get_weights and the optimizer's table-shaped slots,
after write_back) and OUT_DIR/OPT.json (the transport Horovod ran on, the collectives
in one training step's graph, the steps run, the loss after each step, and with
--count-bytes the bytes each AllToAllv of the step sent, per step); every rank writes
OUT_DIR/OPT.rankR.rows.json (the rows its variables of each row-sharded table hold).
"""
import argparse
import json
import os

import numpy as np
import tensorflow as tf

import picasso_tf
from picasso_tf.distributed.world import horovod_transport, launched_world

try:
    import horovod.tensorflow as hvd
    if launched_world()[0] > 1:
        hvd.init()
except ImportError:
    hvd = None

GLOBAL_BATCH, STEPS = 64, 20


# Bytes passed to each AllToAllv, by its name, over the steps run: filled inside the
# training step's graph by the wrapper install_byte_counter puts around Horovod's
# alltoall, in a job run with --count-bytes.
SENT = {}
count_bytes = False


def install_byte_counter():
    """Wraps Horovod's alltoall (the exchange's calls, and Horovod's registered gradient
    of the rows' one) to add up the bytes of the buffers each call really sends. Once per
    process: tests/workers/jobs.py runs jobs with and without --count-bytes in one."""
    from horovod.tensorflow import mpi_ops
    original = mpi_ops.alltoall

    def alltoall(tensor, splits=None, name=None, **kwargs):
        if count_bytes:
            key = name or "reverse_of_picasso_exchange_rows"       # Horovod's gradient names none
            if key not in SENT:
                with tf.init_scope():
                    SENT[key] = tf.Variable(0, dtype=tf.int64, trainable=False)
            SENT[key].assign_add(tf.size(tensor, out_type=tf.int64) * tensor.dtype.size)
        return original(tensor, splits=splits, name=name, **kwargs)

    mpi_ops.alltoall = hvd.alltoall = alltoall


if hvd is not None and hvd.is_initialized():
    install_byte_counter()


class Losses(tf.keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def world():
    return (hvd.size(), hvd.rank()) if hvd is not None and hvd.is_initialized() else (1, 0)


def build():
    tf.keras.utils.set_random_seed(7)
    ins = {name: tf.keras.Input((1,), dtype=tf.int64, name=name) for name in ("user", "item", "city", "flag")}
    ins["history"] = tf.keras.Input((5,), dtype=tf.int64, name="history")
    ins["numeric"] = tf.keras.Input((3,), name="numeric")
    flat = tf.keras.layers.Flatten()
    parts = [flat(tf.keras.layers.Embedding(1000, 8, name="user_emb")(ins["user"])),
             flat(tf.keras.layers.Embedding(700, 8, name="item_emb")(ins["item"])),
             flat(tf.keras.layers.Embedding(3, 8, name="city_emb")(ins["city"])),      # 3 rows
             flat(tf.keras.layers.Embedding(1, 4, name="flag_emb")(ins["flag"])),      # fewer rows than ranks
             tf.keras.layers.GlobalAveragePooling1D()(tf.keras.layers.Embedding(500, 4, name="hist_emb")(ins["history"])),
             ins["numeric"]]
    x = tf.keras.layers.Concatenate()(parts)
    x = tf.keras.layers.Dense(16, activation="relu")(x)
    out = tf.keras.layers.Dense(1, activation="sigmoid")(x)
    return tf.keras.Model(ins, out)


def data(batches):
    rng = np.random.default_rng(3)
    n = GLOBAL_BATCH * batches
    zipf = lambda vocab, shape: np.minimum(rng.zipf(1.3, shape) - 1, vocab - 1).astype(np.int64)
    features = {"user": zipf(1000, (n, 1)), "item": zipf(700, (n, 1)), "city": rng.integers(0, 3, (n, 1)),
                "flag": np.zeros((n, 1), np.int64), "history": zipf(500, (n, 5)),
                "numeric": rng.normal(size=(n, 3)).astype(np.float32)}
    labels = (rng.random((n, 1)) < 0.3).astype(np.float32)
    return features, labels


def rank_share(features, labels, batches, size, rank):
    """This rank's contiguous share of every global batch."""
    per = GLOBAL_BATCH // size
    take = np.concatenate([np.arange(b * GLOBAL_BATCH + rank * per, b * GLOBAL_BATCH + (rank + 1) * per)
                           for b in range(batches)])
    ds = tf.data.Dataset.from_tensor_slices(({k: v[take] for k, v in features.items()}, labels[take]))
    return ds.batch(per)


OPTIMIZERS = {"sgd": lambda: tf.keras.optimizers.SGD(0.5), "adagrad": lambda: tf.keras.optimizers.Adagrad(0.3),
              "adam": lambda: tf.keras.optimizers.Adam(0.01)}


def collectives(model, dataset):
    graph = tf.function(model.train_step).get_concrete_function(next(iter(dataset))).graph
    ops = [op.type for op in graph.get_operations()]
    for f in graph._functions.values():
        ops += [n.op for n in f.definition.node_def]
    return {t: ops.count(t) for t in sorted(set(ops)) if t.startswith("Horovod")}


def rows_held(model):
    """Per variable of a row-sharded table (the table, and each optimizer slot of it made
    so far): the logical table's rows, this rank's block of them, the rows of its shard
    variable and those left in the original variable."""
    out = {}
    for storage in model.picasso.storages.values():
        for block in storage.held_blocks() if storage.kind == "sharded" else ():
            out[block.original.name] = {"rows": int(block.original.shape[0]), "held": block.held,
                                        "shard": int(tf.shape(block.variable)[0]),
                                        "original": int(tf.shape(block.original)[0])}
    return out


class DieAt(tf.keras.callbacks.Callback):
    """Rank 1 exits abruptly at step `step`, as a crashed or killed process would."""

    def __init__(self, step, rank):
        super().__init__()
        self.step, self.rank = step, rank

    def on_train_batch_begin(self, batch, logs=None):
        if self.step is not None and self.rank == 1 and batch == self.step:
            os._exit(17)


def run(args, optimizer, size, rank):
    """Trains (or only restores) one model; rank 0 writes its weights and what it ran."""
    features, labels = data(STEPS)
    batches = args.batches_rank1 if rank == 1 else STEPS
    dataset = rank_share(features, labels, batches, size, rank)
    model = picasso_tf.optimize(build(), replicate_tables_below=args.replicate_below, hybrid_hash=args.hybrid_hash,
                                hot_storage_bytes=args.hot_bytes, hot_warmup_steps=3, hot_refresh_every=4,
                                wire_dtype=args.wire_dtype, micro_batches=args.micro_batches,
                                interleave_from=args.interleave_from, interleave_groups=args.interleave_groups,
                                interleave_excluded=(), stitching=args.stitching,
                                check_ids=not (args.no_check_ids_rank1 and rank == 1))
    model.compile(OPTIMIZERS[optimizer](), "binary_crossentropy")
    if args.restore:
        model.load_weights(os.path.join(args.restore, optimizer, "ckpt"))
    counts, losses = {}, Losses()
    for sent in SENT.values():
        sent.assign(0)          # the previous optimizer's run
    if not args.train:
        model.optimizer.build(model.original.trainable_variables)    # its slots restore too
    if args.train:
        model.fit(dataset, epochs=1, verbose=0, shuffle=False, callbacks=[DieAt(args.die_at, rank), losses])
        counts = collectives(model, dataset)
    if args.save:
        model.save_weights(os.path.join(args.save, optimizer, "ckpt"))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{optimizer}.rank{rank}.rows.json"), "w") as f:
        json.dump(rows_held(model), f)
    weights = model.get_weights()       # gathers the sharded tables (a collective)
    model.picasso.write_back()          # and the slots of them
    if rank == 0:
        slots = [v.numpy() for v in model.optimizer.variables if v.shape.rank == 2]
        np.savez(os.path.join(args.out, f"{optimizer}.npz"), *weights, *slots)
        report = model.picasso.reports["training"]["passes"]
        with open(os.path.join(args.out, f"{optimizer}.json"), "w") as f:
            json.dump({"size": size, "transport": horovod_transport(), "collectives": counts,
                       "steps": int(model.optimizer.iterations.numpy()),
                       "losses": losses.losses, "bytes_per_step": {
                           k: int(v.numpy()) / max(len(losses.losses), 1) for k, v in SENT.items()},
                       "distribute": next(p for p in report if p["pass"] == "distribute"),
                       "k_interleave": next(p for p in report if p["pass"] == "k_interleave")}, f, default=str)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--optimizers", default="sgd,adagrad,adam")
    parser.add_argument("--batches-rank1", type=int, default=STEPS)
    parser.add_argument("--restore", help="a directory --save wrote, by any number of ranks")
    parser.add_argument("--save")
    parser.add_argument("--no-train", dest="train", action="store_false")
    parser.add_argument("--die-at", type=int, help="rank 1 exits at this step (a rank that dies)")
    parser.add_argument("--replicate-below", type=int, default=0, help="bytes; 0 shards every table")
    parser.add_argument("--hybrid-hash", action="store_true", help="hash-backed tables (hybrid_hash=True)")
    parser.add_argument("--hot-bytes", type=int, default=2000, help="their hot tier, refreshed every 4 steps")
    parser.add_argument("--wire-dtype", default="float32", help="config.wire_dtype")
    parser.add_argument("--count-bytes", action="store_true", help="count the bytes each AllToAllv sends")
    parser.add_argument("--micro-batches", type=lambda a: a if a == "auto" else int(a), default=1,
                        help="config.micro_batches")
    parser.add_argument("--interleave-from", default="embedding", help="config.interleave_from")
    parser.add_argument("--interleave-groups", type=int, default=1, help="config.interleave_groups (none excluded)")
    parser.add_argument("--no-stitching", dest="stitching", action="store_false", help="config.stitching=False")
    parser.add_argument("--no-check-ids-rank1", action="store_true", help="rank 1 alone: config.check_ids=False")
    args = parser.parse_args(argv)
    size, rank = world()
    global count_bytes
    count_bytes = args.count_bytes
    for optimizer in args.optimizers.split(","):
        run(args, optimizer, size, rank)


if __name__ == "__main__":
    main()
