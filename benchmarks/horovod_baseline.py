"""picasso_tf on 2 Horovod ranks against what a Horovod user runs today: the same stock
Keras model trained data-parallel with horovod.tensorflow.keras.DistributedOptimizer,
with its default sparse handling (the tables' IndexedSlices gradients allgathered) and
with sparse_as_dense=True (Allreduced dense), over MPI and over Gloo; beside it, the
same comparison in one process (picasso_tf against plain Keras).

    .venv/bin/python benchmarks/horovod_baseline.py [--models dlrm,wide_deep]
        [--table-rows 1000,100000] [--transports mpi,gloo] [--batch 4096]
        [--warmup 8] [--steps 20] [--repeats 2]

Every run is one benchmarks/hybrid_parallel_worker.py (--stock for the stock model),
on the synthetic criteo preset with every table --table-rows rows, --batch examples
per rank and step, Adam, 1 intra-op and 1 inter-op thread per rank; picasso_tf with
its default plan (tables replicated below replicate_tables_below, sharded above). The
configurations of a model and table size run one after the other within each repeat,
so that a change in the machine's load falls on all of them.

Per configuration, over the timed steps after warm-up: samples/s (all ranks' samples
over the slowest rank's wall seconds), CPU ms per step and rank (time.process_time
of each rank's process), samples per CPU-second (over the ranks' summed CPU); mean of
the repeats, with the range of samples/s. Then picasso_tf's lead over the faster stock
variant on 2 ranks, beside its lead over plain Keras in one process.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hybrid_parallel import fmt, run_worker  # noqa: E402

# The two ways horovod.tensorflow.keras.DistributedOptimizer reduces the tables' gradients.
STOCK = {"sparse": "IndexedSlices (default)", "dense": "sparse_as_dense=True"}


def figures(runs):
    """Mean figures over repeated runs of one configuration (each a list of rank dicts)."""
    rates, cpu_ms, per_cpu = [], [], []
    for ranks in runs:
        steps, size = ranks[0]["steps"], len(ranks)
        samples = ranks[0]["batch"] * steps * size
        cpu = sum(r["cpu_s"] for r in ranks)
        rates.append(samples / max(r["wall_s"] for r in ranks))
        cpu_ms.append(1e3 * cpu / steps / size)
        per_cpu.append(samples / cpu)
    return {"rate": statistics.mean(rates), "lo": min(rates), "hi": max(rates),
            "cpu_ms": statistics.mean(cpu_ms), "per_cpu": statistics.mean(per_cpu)}


def configurations(transports):
    """(size, transport, stock) of every run of one model and table size."""
    two_ranks = [(2, t, stock) for t in transports for stock in (None,) + tuple(STOCK)]
    return [(1, None, None), (1, None, "sparse")] + two_ranks


def label(size, transport, stock):
    where = "1 process" if size == 1 else f"2 ranks, {transport}"
    what = "picasso_tf" if stock is None else "plain Keras" if size == 1 else f"stock Keras, {STOCK[stock]}"
    return f"{where:<14}{what}"


def measure(work, model, rows, args):
    """Every configuration's runs, the configurations taking turns within each repeat."""
    runs = {c: [] for c in configurations(args.transports)}
    for repeat in range(args.repeats):
        for size, transport, stock in runs:
            out = os.path.join(work, f"{model}_{rows}_{size}_{transport}_{stock}_{repeat}")
            runs[size, transport, stock].append(run_worker(out, model, args.batch, args.warmup, args.steps, size,
                                                           buckets=rows - 1, transport=transport, stock=stock))
    return runs


def report(model, rows, runs, args):
    """Prints one model and table size; returns its summary rows."""
    first = runs[1, None, None][0][0]
    print(f"\n=== {model}: {first['tables']} tables of {fmt(rows)} rows (table bytes {fmt(first['table_bytes'])}, "
          f"dense {fmt(first['dense_bytes'])}), batch {args.batch} per rank; {args.steps} steps after "
          f"{args.warmup} warm-up, {args.repeats} repeat(s)")
    print(f"  {'run':<52}{'samples/s':>11}{'range':>20}{'CPU ms/step/rank':>18}{'samples/CPU-s':>15}  plan")
    fig = {}
    for (size, transport, stock), repeats in runs.items():
        f = fig[size, transport, stock] = figures(repeats)
        d = repeats[0][0].get("distribute") or {}
        plan = (f"{len(d.get('sharded') or [])} group(s) sharded, {len(d.get('replicated') or [])} replicated"
                if stock is None and size > 1 else "")
        print(f"  {label(size, transport, stock):<52}{fmt(f['rate']):>11}{fmt(f['lo']) + '-' + fmt(f['hi']):>20}"
              f"{f['cpu_ms']:>18.1f}{fmt(f['per_cpu']):>15}  {plan}".rstrip())
    one = leads(fig[1, None, None], fig[1, None, "sparse"])
    print(f"  picasso_tf / plain Keras, 1 process: {one[0]:.2f}x samples/s, {one[1]:.2f}x samples/CPU-s")
    summary = []
    for t in args.transports:
        faster, slower = sorted(STOCK, key=lambda s: -fig[2, t, s]["rate"])
        two = leads(fig[2, t, None], fig[2, t, faster])
        print(f"  picasso_tf / stock Keras {STOCK[faster]}, 2 ranks {t}: {two[0]:.2f}x samples/s, {two[1]:.2f}x "
              f"samples/CPU-s (the faster stock variant: {STOCK[slower]} ran "
              f"{fig[2, t, slower]['rate'] / fig[2, t, faster]['rate']:.2f}x its samples/s)")
        summary.append((model, rows, t, faster, two[0], one[0]))
    return summary


def leads(picasso, stock):
    return picasso["rate"] / stock["rate"], picasso["per_cpu"] / stock["per_cpu"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="dlrm,wide_deep")
    parser.add_argument("--table-rows", default="1000,100000", help="rows of every table, one run set each")
    parser.add_argument("--transports", default="mpi,gloo")
    parser.add_argument("--batch", type=int, default=4096, help="examples per rank and step")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    args.transports = args.transports.split(",")
    if not set(args.transports) <= {"mpi", "gloo"}:
        parser.error("--transports: mpi, gloo or both")
    began = time.perf_counter()
    print(f"$ {' '.join(['.venv/bin/python', 'benchmarks/horovod_baseline.py'] + sys.argv[1:])}")
    print(f"host: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")
    summary = []
    with tempfile.TemporaryDirectory(prefix="horovod_baseline_") as work:
        for model in args.models.split(","):
            for rows in (int(r) for r in args.table_rows.split(",")):
                summary += report(model, rows, measure(work, model, rows, args), args)
    print("\nsummary: picasso_tf's lead in samples/s over the faster stock variant on 2 ranks, against its lead "
          "over plain Keras in one process")
    print(f"  {'model':<12}{'rows':>9}  {'transport':<11}{'faster stock':<26}{'2 ranks':>9}{'1 process':>11}  "
          "2 ranks >= 1 process")
    for model, rows, t, faster, two, one in summary:
        print(f"  {model:<12}{fmt(rows):>9}  {t:<11}{STOCK[faster]:<26}{two:>8.2f}x{one:>10.2f}x  "
              f"{'yes' if two >= one else 'no'}")
    print(f"total {time.perf_counter() - began:.0f} s, load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
