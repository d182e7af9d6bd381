"""One rank of benchmarks/hybrid_parallel.py and benchmarks/horovod_baseline.py: trains a
zoo model with picasso_tf on the synthetic criteo preset, as one process or under
`picasso-run` (MPI or Gloo), and writes what it measured to OUT_DIR/rank<R>.json.

    hybrid_parallel_worker.py OUT_DIR --model wide_deep --batch 2048 --warmup 8 --steps 30
                              [--replicate-below BYTES]   # absent: picasso_tf's default
                              [--buckets 999]             # rows of each hashed table
                              [--wire-dtype float16]      # config.wire_dtype
                              [--heldout 20000]           # AUC on these examples after training
                              [--no-check-ids]            # config.check_ids=False
                              [--stock sparse|dense]      # the stock Keras model instead
                              [--breakdown 5]             # then trace 5 more steps' ops
                              [--count-ops]               # the training step's ops by type

--stock trains the original Keras model as a Horovod user does today instead: rank 0's
weights broadcast, then horovod.tensorflow.keras.DistributedOptimizer, with its default
sparse handling (the tables' IndexedSlices gradients allgathered) or sparse_as_dense=True
(Allreduced as dense tensors); as one process, plain Keras.

Measured per rank over the timed steps (after warm-up): CPU seconds of the process
(time.process_time: every thread of it, Horovod's background thread included) and wall
seconds, and the CPU seconds of each of its threads (/proc: Horovod's background
thread apart from TensorFlow's); its minor page faults (mostly pages of memory the
kernel handed it afresh, zeroed); the bytes each AllToAllv sent to each rank and the bytes each grouped
Allreduce reduced (counted in the graph by wrapping Horovod's alltoall and
grouped_allreduce, from the buffers actually passed); the loopback interface's bytes;
and, independently of the exchange code, the analytic minimum from the same batches:
per table, the distinct ids of the batch, owned by id // ceil(rows / size); and the
bytes held in the variables and the resident memory, after training. With --heldout N,
N more examples of the same data are held out of training, and every rank predicts all
of them after training (the same batches on every rank, as the exchange needs): their
AUC and log loss. With --breakdown N, N more steps are traced with TensorFlow's
profiler after the timed ones (tools/benchmarking/breakdown.py): each rank's time per
op type and node. With --count-ops, the ops of a training step's graph (its functions'
included) by type.
"""
import argparse
import json
import os
import resource
import time

import tensorflow as tf

# Before any op runs: one intra-op and one inter-op thread per rank, so that 2 ranks on
# 2 cores do not oversubscribe them and CPU seconds compare like for like.
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import numpy as np  # noqa: E402

try:
    import horovod.tensorflow as hvd  # noqa: E402
    import horovod.tensorflow.mpi_ops as hvd_ops  # noqa: E402
except ImportError:
    hvd = hvd_ops = None

from picasso_tf.distributed.world import horovod_transport, launched_world  # noqa: E402

DISTRIBUTED = launched_world()[0] > 1
if DISTRIBUTED:
    hvd.init()
SIZE, RANK = (hvd.size(), hvd.rank()) if DISTRIBUTED else (1, 0)

import picasso_tf  # noqa: E402
from picasso_tf import data as pdata  # noqa: E402
from picasso_tf import models as zoo  # noqa: E402

# Bytes sent per destination rank by each kind of AllToAllv, and executions of each
# collective; filled by the wrappers below inside the training step's graph.
COUNTERS = {}


def _counter(name, shape):
    COUNTERS[name] = tf.Variable(tf.zeros(shape, tf.int64), trainable=False, name=f"bench_{name}")


def install_counters():
    """Wraps Horovod's alltoall and grouped_allreduce so that the step's graph adds up
    what it really passes to them (the reverse AllToAllv of the gradients comes from
    Horovod's registered gradient, which calls mpi_ops.alltoall: wrapped too)."""
    for kind in ("ids", "rows", "grads"):
        _counter(f"alltoall_{kind}_bytes", [SIZE])
        _counter(f"alltoall_{kind}_calls", [])
    _counter("allreduce_bytes", [])
    _counter("allreduce_calls", [])
    _counter("allreduce_tensors", [])
    original_alltoall, original_grouped = hvd_ops.alltoall, hvd.grouped_allreduce

    def alltoall(tensor, splits=None, name=None, **kwargs):
        result = original_alltoall(tensor, splits=splits, name=name, **kwargs)
        if splits is not None:
            kind = {"picasso_exchange_ids": "ids", "picasso_exchange_rows": "rows"}.get(name, "grads")
            per_row = tf.reduce_prod(tf.shape(tensor, out_type=tf.int64)[1:]) * tensor.dtype.size
            COUNTERS[f"alltoall_{kind}_bytes"].assign_add(tf.cast(splits, tf.int64) * per_row)
            COUNTERS[f"alltoall_{kind}_calls"].assign_add(1)
        return result

    def grouped_allreduce(tensors, *args, **kwargs):
        result = original_grouped(tensors, *args, **kwargs)
        COUNTERS["allreduce_bytes"].assign_add(
            tf.add_n([tf.size(t, out_type=tf.int64) * t.dtype.size for t in tensors]))
        COUNTERS["allreduce_calls"].assign_add(1)
        COUNTERS["allreduce_tensors"].assign_add(len(tensors))
        return result

    hvd_ops.alltoall = hvd.alltoall = alltoall
    hvd.grouped_allreduce = grouped_allreduce


def loopback_bytes():
    """Bytes sent over the loopback interface so far (whole machine: both ranks)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    return 0


def thread_cpu():
    """{"name tid": CPU seconds} of this process's threads ("main" for the Python one)."""
    ticks, seconds = os.sysconf("SC_CLK_TCK"), {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                stat = f.read()
        except FileNotFoundError:       # the thread ended meanwhile
            continue
        name = "main" if int(task) == os.getpid() else stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        seconds[f"{name} {task}"] = (int(fields[11]) + int(fields[12])) / ticks    # utime + stime
    return seconds


def snapshot():
    return {"cpu": time.process_time(), "wall": time.perf_counter(), "lo": loopback_bytes(), "threads": thread_cpu(),
            "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
            **{k: v.numpy().tolist() for k, v in COUNTERS.items()}}


class StepTimer(tf.keras.callbacks.Callback):
    """Snapshots after the last warm-up step and after the last timed one. A custom
    callback gets its logs as numbers, so every step ends synchronised here."""

    def __init__(self, warmup, steps):
        super().__init__()
        self.marks, self.at = {}, {warmup - 1: "start", warmup + steps - 1: "end"}

    def on_train_batch_end(self, batch, logs=None):
        if batch in self.at:
            self.marks[self.at[batch]] = snapshot()


def table_ids_model(original):
    """The original Keras model cut at every embedding table's ids: (its outputs, the
    tables' names, widths and rows). Built from the user's model, not from picasso_tf."""
    layers = [layer for layer in original.layers
              if any("embeddings" in w.name or layer.__class__.__name__ == "EmbeddingBag" for w in layer.weights)
              and len(layer.weights) == 1 and layer.weights[0].shape.rank == 2]
    model = tf.keras.Model(original.inputs, [layer.input for layer in layers])
    return model, [layer.name for layer in layers], [int(layer.weights[0].shape[1]) for layer in layers], \
        [int(layer.weights[0].shape[0]) for layer in layers]


def analytic_exchange(ids_model, dims, vocabs, batches, size, rank):
    """Per step of `batches`: the distinct ids of each table that this rank needs from
    each other owner (rank id // ceil(rows / size), as row-sharded tables are cut), and the bytes they cost on the wire: 8 per id, 4·D per
    row fetched and 4·D per row gradient returned (the issue's minimum)."""
    ids_per_step, bytes_per_step, distinct_per_step, distinct_bytes = [], [], [], []
    for features, _ in batches:
        outs = ids_model(features, training=False)
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        remote_ids, remote_bytes, distinct, all_bytes = 0, 0, 0, 0
        for ids, dim, rows in zip(outs, dims, vocabs):
            values = ids.flat_values if isinstance(ids, tf.RaggedTensor) else ids
            unique = np.unique(np.asarray(values).reshape(-1))
            distinct += unique.size
            all_bytes += unique.size * (8 + 2 * dim * 4)
            remote = int(np.count_nonzero(unique // -(-rows // size) != rank))
            remote_ids += remote
            remote_bytes += remote * (8 + 2 * dim * 4)
        ids_per_step.append(remote_ids)
        bytes_per_step.append(remote_bytes)
        distinct_per_step.append(distinct)
        distinct_bytes.append(all_bytes)
    # distinct_bytes: what every distinct id would cost if all were remote; the cost
    # model scales it by (P-1)/P.
    return {"remote_ids": float(np.mean(ids_per_step)), "remote_bytes": float(np.mean(bytes_per_step)),
            "distinct_ids": float(np.mean(distinct_per_step)), "distinct_bytes": float(np.mean(distinct_bytes))}


def step_op_types(model, batch):
    """{op type: count} in the graph of model.train_step traced on `batch` (not run),
    the functions it calls (tf.cond's branches) included."""
    graph = tf.function(model.train_step).get_concrete_function(batch).graph
    types = [op.type for op in graph.get_operations()]
    types += [node.op for f in graph._functions.values() for node in f.definition.node_def]
    return {t: types.count(t) for t in sorted(set(types))}


def memory(model):
    """What this rank holds: the bytes in every variable's buffer (the model's, the
    optimizer's, the storages' shards and slots of them: a released original holds
    none), and the process's resident and peak resident memory."""
    variables = list(model.variables) + list(model.optimizer.variables)
    for storage in (model.picasso.storages.values() if hasattr(model, "picasso") else ()):
        variables += storage.variables() + [b.variable for b in (storage.held_blocks() if storage.kind == "sharded" else ())]
    unique = {v.ref(): v for v in variables}.values()
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {"variable_bytes": sum(int(tf.size(v)) * v.dtype.size for v in unique),
            "rss_bytes": int(status["VmRSS"].split()[0]) * 1024, "peak_rss_bytes": int(status["VmHWM"].split()[0]) * 1024}


def loopback_bandwidth(megabytes=64, repeats=3):
    """Bytes per second one rank sends the other through Horovod's AllToAllv (MPI or Gloo) on
    loopback: half of a large float buffer goes to each rank, the best of a few."""
    n = megabytes * (1 << 20) // 4
    buffer = tf.ones([n], tf.float32)
    splits = tf.constant([n // SIZE] * SIZE, tf.int32)
    hvd.alltoall(buffer, splits=splits, name="bench_bandwidth")       # connect and allocate first
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        out, _ = hvd.alltoall(buffer, splits=splits, name="bench_bandwidth")
        out.numpy()
        best = min(best, time.perf_counter() - began)
    return (n // SIZE) * 4 * (SIZE - 1) / best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model", default="wide_deep")
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--replicate-below", type=int, help="bytes; absent: picasso_tf's default")
    parser.add_argument("--buckets", type=int, default=999, help="rows of each table (picasso-train's default)")
    parser.add_argument("--instrument", action="store_true",
                        help="count the collectives' bytes in the graph and measure loopback bandwidth (kept out "
                             "of the timed runs: the counters cost a little CPU)")
    parser.add_argument("--wire-dtype", default="float32", help="config.wire_dtype")
    parser.add_argument("--heldout", type=int, default=0, help="examples held out for AUC (0: none)")
    parser.add_argument("--no-check-ids", dest="check_ids", action="store_false",
                        help="config.check_ids=False: a step exchanging no rows then sends no AllToAllv of ids")
    parser.add_argument("--stock", choices=("sparse", "dense"),
                        help="train the stock Keras model with Horovod's DistributedOptimizer (sparse_as_dense "
                             "False or True) instead of picasso_tf's")
    parser.add_argument("--breakdown", type=int, default=0, help="steps traced per op after the timed ones (0: none)")
    parser.add_argument("--count-ops", action="store_true", help="count the training step's ops by type")
    args = parser.parse_args()
    if DISTRIBUTED and args.instrument:
        install_counters()

    schema = pdata.preset_schema("criteo", buckets=args.buckets)
    steps = args.warmup + args.steps
    trained = args.batch * SIZE * steps
    data = pdata.generate(schema, trained + args.heldout, seed=0)
    heldout = data.take(np.arange(trained, trained + args.heldout)) if args.heldout else None
    data = data.take(np.arange(trained)) if args.heldout else data

    def batches():
        # Unshuffled: every new iterator yields the same batches, so the analytic count
        # below sees exactly the batches fit() trained on.
        return data.dataset(args.batch, shuffle=False, repeat=True, rank=RANK, world=SIZE)

    info = zoo.info(args.model)
    tf.keras.utils.set_random_seed(0)
    original = info.builder(schema, **(dict(info.prepare(schema, data.features)) if info.prepare else {}))
    began = time.perf_counter()
    optimizer = tf.keras.optimizers.Adam(0.002)         # the zoo recipe's optimizer
    if args.stock:
        model = original
        if DISTRIBUTED:
            import horovod.tensorflow.keras as hvd_keras
            hvd.broadcast_variables(model.variables, root_rank=0)
            optimizer = hvd_keras.DistributedOptimizer(optimizer, sparse_as_dense=args.stock == "dense")
    else:
        options = {"wire_dtype": args.wire_dtype, "check_ids": args.check_ids}
        if args.replicate_below is not None:
            options["replicate_tables_below"] = args.replicate_below
        model = picasso_tf.optimize(original, warmup_data=batches(), **options)
    model.compile(optimizer, "binary_crossentropy")
    timer = StepTimer(args.warmup, args.steps)
    model.fit(batches(), epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False, callbacks=[timer])
    setup_and_train = time.perf_counter() - began

    start, end = timer.marks["start"], timer.marks["end"]
    result = {"size": SIZE, "rank": RANK, "transport": horovod_transport() if DISTRIBUTED else None,
              "stock": args.stock, "model": args.model, "batch": args.batch, "warmup": args.warmup,
              "steps": args.steps, "replicate_below": args.replicate_below, "wire_dtype": args.wire_dtype,
              "seconds_total": setup_and_train,
              "cpu_s": end["cpu"] - start["cpu"], "wall_s": end["wall"] - start["wall"],
              "lo_bytes": end["lo"] - start["lo"], "page_faults": end["faults"] - start["faults"],
              "threads_cpu_s": {name: cpu - start["threads"].get(name, 0.0) for name, cpu in end["threads"].items()}}
    for k in COUNTERS:
        result[k] = (np.asarray(end[k]) - np.asarray(start[k])).tolist()
    if not args.stock:
        report = model.picasso.reports["training"]["passes"]
        dist = next((p for p in report if p["pass"] == "distribute"), {})
        result["distribute"] = {k: dist.get(k) for k in ("changed", "sharded", "replicated", "exchanged_ops", "why")}
        program = model.picasso.program
        tables = list(program.tables or ()) if program is not None else []
        result["groups"] = [{"name": t.name, "dim": t.dim, "tables": len(t.members), "rows": t.num_rows,
                             "kind": getattr(t, "kind", None)} for t in tables]
    keras_model = original if args.stock else model.original
    trainable = keras_model.trainable_variables
    table_vars = set()
    ids_model, names, dims, vocabs = table_ids_model(keras_model)
    for layer in keras_model.layers:
        if layer.name in names:
            table_vars.add(layer.weights[0].ref())
    result["table_bytes"] = sum(int(np.prod(v.shape)) * 4 for v in trainable if v.ref() in table_vars)
    result["dense_bytes"] = sum(int(np.prod(v.shape)) * 4 for v in trainable if v.ref() not in table_vars)
    result["tables"], result["table_rows"], result["table_dims"] = len(names), vocabs, dims
    if not args.stock:
        timed = batches().skip(args.warmup).take(args.steps)
        result["analytic"] = analytic_exchange(ids_model, dims, vocabs, timed, SIZE, RANK)
    result.update(memory(model))
    if heldout is not None:
        scores = model.predict(heldout.dataset(args.batch, shuffle=False).map(lambda x, _: x), verbose=0)
        result["heldout_auc"] = float(pdata.roc_auc(heldout.labels, scores))
        result["heldout_log_loss"] = float(tf.keras.losses.binary_crossentropy(
            np.reshape(heldout.labels, [-1, 1]).astype(np.float32), scores).numpy().mean())
    if args.count_ops:
        result["step_op_types"] = step_op_types(model, next(iter(batches())))
    if args.breakdown:
        from picasso_tf.tools.benchmarking.breakdown import op_breakdown
        result["breakdown"] = op_breakdown(model, batches(), steps=args.breakdown, top=1000)
    # For the projection: the same batches' distinct ids split over 8/64/256 owners.
    if DISTRIBUTED and args.instrument:
        result["loopback_bytes_per_s"] = loopback_bandwidth()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{RANK}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
