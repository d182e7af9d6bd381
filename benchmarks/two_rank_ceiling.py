"""What two ranks can reach on this machine, before picasso_tf's exchange does anything:
samples per CPU-second of a pair of processes against one process alone, for

  one process        benchmarks/hybrid_parallel_worker.py alone (the reference)
  two processes      two of them at once, no Horovod: what sharing the machine costs
  Horovod, idle      `picasso-run -np 2` of benchmarks/horovod_idle_rank.py: Horovod up
                     (its background thread cycling), each rank training as one process
                     and issuing no collective
  2 ranks            `picasso-run -np 2` of the worker: the real hybrid-parallel step

Every process trains the same model on the same per-rank batch with one intra-op and one
inter-op thread (the worker's setting), so CPU seconds compare like for like. Issue 39's
target (2 ranks at 0.85 of one process's samples per CPU-second) is out of reach of any
exchange where the runs that issue no collective (two processes, Horovod idle) already
fall below it; and the idle ranks' samples/s bound what the real step can reach on 2
ranks (benchmarks/horovod_baseline.py times the stock Keras alternative).

    .venv/bin/python benchmarks/two_rank_ceiling.py [--model dlrm] [--batch 4096]
        [--steps 150] [--rounds 2] [--buckets 999] [--replicate-below BYTES] [--transport mpi]

Rounds alternate the four runs; prints each run's CPU ms per step of each process, wall
ms per step (the slower process's), samples/s of the processes together and the first
process's busiest threads, then the median share per run.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from hybrid_parallel import PICASSO_RUN, PY, ROOT, WORKER, run_worker

IDLE_RANK = os.path.join(ROOT, "benchmarks", "horovod_idle_rank.py")


def worker_args(args, out):
    command = [out, "--model", args.model, "--batch", str(args.batch), "--warmup", "8",
               "--steps", str(args.steps), "--buckets", str(args.buckets)]
    if args.replicate_below is not None:
        command += ["--replicate-below", str(args.replicate_below)]
    return command


def two_plain_processes(args, work):
    """Two one-process workers started together; their rank0.json results."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    outs = [os.path.join(work, f"p{i}") for i in range(2)]
    for out in outs:
        shutil.rmtree(out, ignore_errors=True)
    procs = [subprocess.Popen([PY, WORKER] + worker_args(args, out), env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for out in outs]
    for p in procs:
        _, err = p.communicate(timeout=600)
        if p.returncode != 0:
            sys.exit(f"worker failed ({p.returncode}):\n{err[-3000:]}")
    return [json.load(open(os.path.join(out, "rank0.json"))) for out in outs]


def horovod_idle(args, work):
    """Two ranks with Horovod up and no collective (benchmarks/horovod_idle_rank.py)."""
    out = os.path.join(work, "idle")
    shutil.rmtree(out, ignore_errors=True)
    command = [PICASSO_RUN, "-np", "2", f"--{args.transport}", PY, IDLE_RANK] + worker_args(args, out)
    done = subprocess.run(command, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        sys.exit(f"idle ranks failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [json.load(open(os.path.join(out, f"r{r}", "rank0.json"))) for r in range(2)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dlrm")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--buckets", type=int, default=999)
    parser.add_argument("--replicate-below", type=int, default=None)
    parser.add_argument("--transport", choices=("mpi", "gloo"), default="mpi")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="two_rank_ceiling_")
    runs = {
        "one process": lambda: run_worker(os.path.join(work, "one"), args.model, args.batch, 8, args.steps, 1,
                                          args.replicate_below, buckets=args.buckets),
        "two processes, no Horovod": lambda: two_plain_processes(args, work),
        "2 ranks, Horovod idle": lambda: horovod_idle(args, work),
        "2 ranks, the real step": lambda: run_worker(os.path.join(work, "two"), args.model, args.batch, 8,
                                                     args.steps, 2, args.replicate_below, buckets=args.buckets,
                                                     transport=args.transport),
    }
    samples_per_cpu_s = {name: [] for name in runs}
    print(f"{args.model}, batch {args.batch} per process, {args.steps} timed steps, load average "
          f"{os.getloadavg()[0]:.2f} at the start", flush=True)
    for r in range(args.rounds):
        reference = None
        for name, run in runs.items():
            results = run()
            cpu_ms = [1e3 * res["cpu_s"] / res["steps"] for res in results]
            wall_ms = max(1e3 * res["wall_s"] / res["steps"] for res in results)
            rate = sum(res["batch"] * res["steps"] for res in results) / sum(res["cpu_s"] for res in results)
            reference = reference or rate
            samples_per_cpu_s[name].append(rate / reference)
            samples_per_s = sum(res["batch"] for res in results) / wall_ms * 1e3
            print(f"round {r + 1} {name:28} CPU ms/step {', '.join(f'{c:.1f}' for c in cpu_ms):14} "
                  f"wall ms/step {wall_ms:6.1f}  samples/s {samples_per_s:9,.0f}  "
                  f"share of one process's samples per CPU-second "
                  f"{rate / reference:.2f}   (load {os.getloadavg()[0]:.2f})", flush=True)
            threads = sorted(results[0]["threads_cpu_s"].items(), key=lambda kv: -kv[1])[:4]
            print("    first process's busiest threads, CPU ms/step: " + ", ".join(
                f"{thread} {1e3 * cpu / results[0]['steps']:.1f}" for thread, cpu in threads), flush=True)
    print("median share of one process's samples per CPU-second:")
    for name, shares in samples_per_cpu_s.items():
        print(f"  {name:28} {statistics.median(shares):.2f} ({min(shares):.2f}-{max(shares):.2f})")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
