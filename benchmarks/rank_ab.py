"""Two versions of one picasso_tf class side by side on several ranks (issue 39): does a
change to, say, the exchange make a rank's step cheaper? Separate 2-rank runs of the
same code spread by tens of percent in CPU per step on a shared 2-core machine;
alternating `fit` calls of both versions inside one process resolves a few percent.

    picasso-run -np 2 --mpi .venv/bin/python benchmarks/rank_ab.py --before OLD_CHECKOUT
        [--module picasso_tf/distributed/exchange.py --cls RowExchange]
        [--model dlrm] [--batch 4096] [--buckets 999] [--replicate-below 0]
        [--steps 40] [--rounds 10]

The zoo model, on the criteo preset, is built and traced twice: once with the class's
methods taken from OLD_CHECKOUT's copy of --module, once with this checkout's. Methods
are looked up when a graph is traced, so each model keeps the version it was traced
with. Then `fit` calls of --steps steps take turns, --rounds times, on every rank (each
rank on one intra-op and one inter-op thread). Printed and appended to
benchmarks/rank_ab.txt: each rank's CPU ms per step, median over the calls, and the
median of the paired differences (after - before).
"""
import argparse
import importlib.util
import inspect
import os
import statistics
import subprocess
import sys
import time

import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import horovod.tensorflow as hvd  # noqa: E402

import picasso_tf  # noqa: E402
from picasso_tf import data as pdata  # noqa: E402
from picasso_tf import models as zoo  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def methods_of(path, module, cls):
    """The functions class `cls` defines in `path`'s copy of picasso_tf module `module`."""
    spec = importlib.util.spec_from_file_location(f"before_{module.replace('/', '_')}", path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return {name: f for name, f in vars(getattr(loaded, cls)).items() if inspect.isfunction(f)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="a checkout of picasso_tf holding the version to compare")
    parser.add_argument("--module", default="picasso_tf/distributed/exchange.py")
    parser.add_argument("--cls", default="RowExchange")
    parser.add_argument("--model", default="dlrm")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--buckets", type=int, default=999, help="rows of each table")
    parser.add_argument("--replicate-below", type=int, default=0, help="bytes (0: every group sharded)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    module_name = args.module[:-3].replace("/", ".")
    target = getattr(importlib.import_module(module_name), args.cls)
    versions = {"before": methods_of(os.path.join(args.before, args.module), module_name, args.cls),
                "after": {name: f for name, f in vars(target).items() if inspect.isfunction(f)}}

    schema = pdata.preset_schema("criteo", buckets=args.buckets)
    data = pdata.generate(schema, args.batch * size * 16, seed=0)

    def batches():
        return data.dataset(args.batch, shuffle=False, repeat=True, rank=rank, world=size)

    info = zoo.info(args.model)
    models = {}
    for name, methods in versions.items():
        for attr, f in methods.items():
            setattr(target, attr, f)
        tf.keras.utils.set_random_seed(0)
        original = info.builder(schema, **(dict(info.prepare(schema, data.features)) if info.prepare else {}))
        model = picasso_tf.optimize(original, warmup_data=batches(), replicate_tables_below=args.replicate_below)
        model.compile(tf.keras.optimizers.Adam(0.002), "binary_crossentropy")
        model.fit(batches(), epochs=1, steps_per_epoch=10, verbose=0)      # traced with this version
        models[name] = model
    for attr, f in versions["after"].items():
        setattr(target, attr, f)

    cpu_ms = {name: [] for name in models}
    for r in range(args.rounds):
        for name in (("before", "after") if r % 2 == 0 else ("after", "before")):
            start = time.process_time()
            models[name].fit(batches(), epochs=1, steps_per_epoch=args.steps, verbose=0)
            cpu_ms[name].append(1e3 * (time.process_time() - start) / args.steps)
    every_rank = hvd.allgather_object(cpu_ms)
    if rank == 0:
        report(args, every_rank)


def report(args, every_rank):
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                            text=True).stdout.strip()
    lines = [f"$ picasso-run -np {len(every_rank)} .venv/bin/python {' '.join(['benchmarks/rank_ab.py'] + sys.argv[1:])}",
             f"after: this checkout at {commit}; before: {args.before}; {len(every_rank)} ranks; load average "
             f"{os.getloadavg()[0]:.2f} at the end; {args.model}, batch {args.batch} per rank, "
             f"{args.rounds} calls of {args.steps} steps per version, taking turns",
             "rank  CPU ms/step before  after  paired (after - before), median [min, max]"]
    for rank, cpu_ms in enumerate(every_rank):
        paired = [a - b for a, b in zip(cpu_ms["after"], cpu_ms["before"])]
        lines.append(f"{rank:4d}  {statistics.median(cpu_ms['before']):19.1f}  "
                     f"{statistics.median(cpu_ms['after']):5.1f}  {statistics.median(paired):+.1f} "
                     f"[{min(paired):+.1f}, {max(paired):+.1f}]")
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    with open(os.path.join(HERE, "rank_ab.txt"), "a") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
