"""What Horovod's collectives cost each rank on this machine, alone: the floor under the
2-rank CPU efficiency of benchmarks/hybrid_parallel.py.

    .venv/bin/python benchmarks/collective_cost.py [--sizes 65536 524288 2097152] [--ops 200]
        [--transport mpi|gloo]

Starts `picasso-run -np 2 --mpi` (or --gloo) on itself. Each rank, with 1 intra-op and 1 inter-op
thread as the training benchmark's ranks, runs --ops AllToAllv (half the buffer to each
rank) and --ops Allreduce of each size back to back inside a tf.function, both ranks
ready together, and prints per op: the rank's CPU time (time.process_time: every thread
of the process, Horovod's background thread and the transport's included) and the wall
time. Then rank 1 enters one AllToAllv a second late, and rank 0 prints the CPU it spent
waiting. No model, no data: what is left of a training step's CPU above these is the
exchange code's own.
"""
import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_main(sizes, ops):
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import horovod.tensorflow as hvd
    hvd.init()

    def per_op(collective, buffer):
        step = tf.function(lambda x: collective(x))
        step(buffer).numpy()
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(ops):
            step(buffer).numpy()
        return 1e3 * (time.process_time() - cpu) / ops, 1e3 * (time.perf_counter() - wall) / ops

    lines = []
    for size in sizes:
        buffer = tf.ones([size // 4])
        splits = tf.constant([size // 8, size // 8], tf.int32)
        for name, collective in (("AllToAllv", lambda x: hvd.alltoall(x, splits=splits, name="cost_a2a")[0]),
                                 ("Allreduce", lambda x: hvd.allreduce(x, op=hvd.Sum, name="cost_ar"))):
            cpu, wall = per_op(collective, buffer)
            lines.append(f"rank {hvd.rank()}  {name:9s} {size >> 10:6,d} KiB: {cpu:6.2f} ms CPU, {wall:6.2f} ms wall per op")
    buffer = tf.ones([1 << 14])
    splits = tf.constant([1 << 13, 1 << 13], tf.int32)
    hvd.alltoall(buffer, splits=splits, name="cost_late")[0].numpy()
    if hvd.rank() == 1:
        time.sleep(1.0)
    cpu, wall = time.process_time(), time.perf_counter()
    hvd.alltoall(buffer, splits=splits, name="cost_late")[0].numpy()
    if hvd.rank() == 0:
        lines.append(f"rank 0  waiting {time.perf_counter() - wall:.2f} s for rank 1 to enter an AllToAllv: "
                     f"{time.process_time() - cpu:.2f} s CPU")
    print("\n".join(lines), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[64 << 10, 512 << 10, 2 << 20])
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--transport", choices=("mpi", "gloo"), default="mpi")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        return rank_main(args.sizes, args.ops)
    command = [os.path.join(ROOT, ".venv", "bin", "picasso-run"), "-np", "2", f"--{args.transport}",
               sys.executable, os.path.abspath(__file__), "--rank", "--ops", str(args.ops),
               "--sizes", *map(str, args.sizes)]
    print(f"2 ranks on loopback over {args.transport}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; {args.ops} ops of each kind and size, back to back", flush=True)
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    # Each launcher tags a rank's lines: Gloo "[0]<stdout>:rank 0 ...", MPI "[1,0]<stdout>: rank 0 ...".
    tagged = (line.split("<stdout>:", 1)[1].strip() for line in out.splitlines() if "<stdout>:" in line)
    print("\n".join(sorted(line for line in tagged if line.startswith("rank "))))


if __name__ == "__main__":
    main()
