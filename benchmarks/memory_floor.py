"""How far are wide_lr's fused kernels from the least memory work their step needs?

wide_lr (the packing benchmark's 200-field logistic regression, batch 4096, Adagrad)
spends most of its picasso_tf step in two kernels: the stitched projection (one row read
per id) and its gradient with Adagrad applied in the kernel (per unique row: the table
row and its accumulator row read and written). `memory_floor.cc` does the same memory
work as a plain C++ loop on the same ids, with two threads and no TensorFlow, id checks
or fixed summation order: a floor, not a kernel picasso_tf could ship. It also runs the
update with each table row and its accumulator row side by side in one array, a layout
Keras' separate slot variables (which checkpoints hold) do not have.

  python benchmarks/memory_floor.py [--rounds 3]

The C++ loop is compiled here (g++ -O3 -march=native -ffast-math: the floor may reorder sums). Rounds alternate the kernels
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


def compile_floor(directory):
    binary = os.path.join(directory, "memory_floor")
    subprocess.run(["g++", "-O3", "-march=native", "-ffast-math", "-pthread", "-o", binary,
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
    args = parser.parse_args(argv)
    data, sizes, layouts, tables = prepared(sections.MODES["full"].packing_dims)
    batch = sizes.packing_batch
    times = {name: [] for name in list(KERNELS) + list(FLOORS)}
    with tempfile.TemporaryDirectory() as scratch:
        binary, ids_path = compile_floor(scratch), os.path.join(scratch, "ids.bin")
        write_ids(ids_path, data.schema, data.features, batch)
        for r in range(args.rounds):
            out = stage_times(data.schema, data.features, data.labels, batch, layouts, tables)
            measured = {name.split(" (")[0]: value["ms"] for name, value in out["stages"].items()}
            for name, stage in KERNELS.items():
                times[name].append(measured[stage])
            for name, ms in floor_times(binary, ids_path).items():
                times[name].append(ms)
            print(f"round {r}: " + ", ".join(f"{name} {v[-1]:.2f} ms" for name, v in times.items()), flush=True)
    medians = {name: float(np.median(v)) for name, v in times.items()}
    print(f"ids a step {out['ids']:,}, unique rows {out['unique_rows']:,}")
    print(f"kernels: projection {medians['projection']:.2f} ms, grad + Adagrad {medians['grad + Adagrad']:.2f} ms")
    print(f"floor:   forward {medians['forward']:.2f} ms, update {medians['update']:.2f} ms, "
          f"update with one row per id {medians['update, one row']:.2f} ms")
    print(f"memory only: the forward's lines read {medians['lines read']:.2f} ms, "
          f"the update's lines read and written {medians['lines updated']:.2f} ms")
    print(f"kernel / floor: projection {medians['projection'] / medians['forward']:.2f}x, "
          f"grad + Adagrad {medians['grad + Adagrad'] / medians['update']:.2f}x")


if __name__ == "__main__":
    main()
