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
  python benchmarks/memory_floor.py --cell alibaba/lr [--rounds 3] [--ahead 8,32]

--cell alibaba/lr runs the floor alone on the zoo's alibaba-like logistic regression (a
width-1 table per feature, behaviour sequences pooled by sum, their padding skipped),
whose kernels `benchmarks/zoo_slow_cells.py ceiling alibaba/lr` times inside the step.

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


def write_ids(path, schema, features, batch, width=None):
    """The ids file memory_floor.cc reads: one field per one-hot feature and sequence (its
    padded positions, id 0, as -1), each of its feature's embedding_dim or of `width`."""
    fields = list(schema.categorical) + list(schema.sequences)
    sequences = {f.name for f in schema.sequences}
    ids = [np.asarray(features[f.name][:batch], np.int64).reshape(batch, -1) for f in fields]
    with open(path, "wb") as out:
        np.array([len(fields), batch], np.int64).tofile(out)
        np.array([(f.vocab_size, width or f.embedding_dim, x.shape[1]) for f, x in zip(fields, ids)],
                 np.int64).tofile(out)
        for f, x in zip(fields, ids):
            (np.where(x == 0, -1, x) if f.name in sequences else x).tofile(out)


def alibaba_lr_floor(rounds, distances):
    """The floor of the zoo's alibaba/lr cell, per prefetch distance, medians over rounds."""
    sizes = sections.MODES["full"]
    data = sections.alibaba_data(sizes, sizes.zoo_batch)
    batch = sizes.zoo_batch
    filled = sum(int(np.count_nonzero(data.features[f.name][:batch])) for f in data.schema.sequences)
    print(f"alibaba/lr: batch {batch}, {len(data.schema.categorical)} one-hot features and "
          f"{len(data.schema.sequences)} sequences ({filled:,} filled positions), width-1 tables")
    floors = {a: {name: [] for name in FLOORS} for a in distances}
    with tempfile.TemporaryDirectory() as scratch:
        binaries = {a: compile_floor(scratch, a) for a in distances}
        ids_path = os.path.join(scratch, "ids.bin")
        write_ids(ids_path, data.schema, data.features, batch, width=1)
        for r in range(rounds):
            for a, binary in binaries.items():
                for name, ms in floor_times(binary, ids_path).items():
                    floors[a][name].append(ms)
                print(f"round {r}, floor {a} rows ahead: " + ", ".join(f"{n} {v[-1]:.3f} ms" for n, v in floors[a].items()),
                      flush=True)
    for a in distances:
        floor = {name: float(np.median(v)) for name, v in floors[a].items()}
        print(f"floor, {a} rows ahead: forward {floor['forward']:.3f} ms, update {floor['update']:.3f} ms")


def floor_times(binary, ids_path, repeats=15):
    done = subprocess.run([binary, ids_path, str(repeats)], check=True, capture_output=True, text=True)
    return {name: float(ms) for name, ms in (line.split("\t") for line in done.stdout.strip().splitlines())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ahead", default="8,32", help="the floor's prefetch distances, in rows")
    parser.add_argument("--cell", choices=["alibaba/lr"], help="the floor alone, of this zoo cell")
    args = parser.parse_args(argv)
    distances = [int(a) for a in args.ahead.split(",")]
    if args.cell:
        alibaba_lr_floor(args.rounds, distances)
        return
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
