"""How far are wide_lr's fused kernels from the least memory work their step needs?

wide_lr (the packing benchmark's 200-field logistic regression, batch 4096, Adagrad)
spends most of its picasso_tf step in two kernels: the stitched projection (one row read
per id) and its gradient with Adagrad applied in the kernel (per unique row: the table
row and its accumulator row read and written). `memory_floor.cc` does the same memory
work as a plain C++ loop on the same ids, with two threads and no TensorFlow, id checks
or fixed summation order (a reference, not a kernel picasso_tf could ship), and the same
cache lines touched with no arithmetic (the memory traffic alone). It also runs the
update with each table row and its accumulator row side by side in one array, a layout
Keras' separate slot variables (which checkpoints hold) do not have.

  python benchmarks/memory_floor.py [--rounds 3] [--ahead 8,32]

The C++ loop is compiled here once per prefetch distance in --ahead (rows prefetched
ahead; picasso_tf's kernels take 8 to 32 by row size, `PrefetchDistance`, its projection
16 to 64), with
g++ -O3 -march=native -ffast-math (the floor may reorder sums). Rounds alternate the kernels
(tools/benchmarking/stages.py, 15 timings a round after warm-up) and the floor (15
repeats a round); prints each round and the medians over rounds.
"""
import argparse
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np                                  # noqa: E402

from row_bytes import prepared                       # noqa: E402  (wide_lr as the packing benchmark builds it)
from picasso_tf.tools.benchmarking import sections   # noqa: E402
from picasso_tf.tools.benchmarking.stages import stage_times   # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
KERNELS = {"projection": "picasso: projection", "grad + Adagrad": "picasso: grad + Adagrad in the kernel"}
FLOORS = ("forward", "update", "update, one row", "lines read", "lines updated")


def compile_floor(directory, ahead):
    binary = os.path.join(directory, f"memory_floor_{ahead}")
    subprocess.run(["g++", "-O3", "-march=native", "-ffast-math", "-pthread", f"-DAHEAD={ahead}", "-o", binary,
                    os.path.join(HERE, "memory_floor.cc")], check=True)
    return binary


def write_ids(path, schema, features, batch):
    fields = list(schema.categorical)
    with open(path, "wb") as out:
        np.array([len(fields), batch], np.int64).tofile(out)
        np.array([(f.vocab_size, f.embedding_dim) for f in fields], np.int64).tofile(out)
        np.stack([np.asarray(features[f.name][:batch], np.int64) for f in fields]).tofile(out)


def floor_times(binary, ids_path, repeats=15):
    done = subprocess.run([binary, ids_path, str(repeats)], check=True, capture_output=True, text=True)
    return {name: float(ms) for name, ms in (line.split("\t") for line in done.stdout.strip().splitlines())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ahead", default="8,32", help="the floor's prefetch distances, in rows")
    args = parser.parse_args(argv)
    distances = [int(a) for a in args.ahead.split(",")]
    data, sizes, layouts, tables = prepared(sections.MODES["full"].packing_dims)
    batch = sizes.packing_batch
    kernels = {name: [] for name in KERNELS}
    floors = {a: {name: [] for name in FLOORS} for a in distances}
    with tempfile.TemporaryDirectory() as scratch:
        binaries = {a: compile_floor(scratch, a) for a in distances}
        ids_path = os.path.join(scratch, "ids.bin")
        write_ids(ids_path, data.schema, data.features, batch)
        for r in range(args.rounds):
            out = stage_times(data.schema, data.features, data.labels, batch, layouts, tables)
            measured = {name.split(" (")[0]: value["ms"] for name, value in out["stages"].items()}
            for name, stage in KERNELS.items():
                kernels[name].append(measured[stage])
            print(f"round {r}, kernels: " + ", ".join(f"{n} {v[-1]:.2f} ms" for n, v in kernels.items()), flush=True)
            for a, binary in binaries.items():
                for name, ms in floor_times(binary, ids_path).items():
                    floors[a][name].append(ms)
                print(f"round {r}, floor {a} rows ahead: " + ", ".join(f"{n} {v[-1]:.2f} ms" for n, v in floors[a].items()),
                      flush=True)
    kernel = {name: float(np.median(v)) for name, v in kernels.items()}
    print(f"ids a step {out['ids']:,}, unique rows {out['unique_rows']:,}; medians over {args.rounds} rounds:")
    print(f"kernels: projection {kernel['projection']:.2f} ms, grad + Adagrad {kernel['grad + Adagrad']:.2f} ms")
    for a in distances:
        floor = {name: float(np.median(v)) for name, v in floors[a].items()}
        print(f"floor, {a} rows ahead: forward {floor['forward']:.2f} ms, update {floor['update']:.2f} ms, "
              f"update with one row per id {floor['update, one row']:.2f} ms; memory only: the forward's lines "
              f"{floor['lines read']:.2f} ms, the update's {floor['lines updated']:.2f} ms; kernel / floor: "
              f"projection {kernel['projection'] / floor['forward']:.2f}x, "
              f"grad + Adagrad {kernel['grad + Adagrad'] / floor['update']:.2f}x")


if __name__ == "__main__":
    main()
