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

--cell alibaba/MODEL runs the floor alone on the ids of a zoo cell on the alibaba-like data
(lr, dlrm, dcn_v2, xdeepfm): one table per feature of each of the model's widths (its
builder's default: lr 1, dlrm and dcn_v2 16, xdeepfm 8 and its linear part's 1),
behaviour sequences pooled by sum, their padding skipped (fewer reads than a model that
reads padding's row: a floor still). The forward's projection onto a vector stands for
whatever the model does with the rows, which it does not write out: less work than any
model's, so a floor still. `benchmarks/zoo_slow_cells.py ceiling alibaba/MODEL` times
the cell's kernels inside the step.

--cell deepctr/ONN does the same on DeepCTR's ONN at batch 4096 (picasso-bench's DeepCTR
section): each of the 26 fields' ids read from 25 tables of width 8, one per other field
(field-aware; its linear part's 26 width-1 tables left out). Its "whole tables" pass is
the one its default L2 regulariser costs every step: every element of every table and
its accumulator updated (see memory_floor.cc), which the dense-only bound, without the
tables, does not pay.

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
FLOORS = ("forward", "update", "update, one row", "lines read", "lines updated", "whole tables")


def compile_floor(directory, ahead):
    binary = os.path.join(directory, f"memory_floor_{ahead}")
    subprocess.run(["g++", "-O3", "-march=native", "-ffast-math", "-pthread", f"-DAHEAD={ahead}", "-o", binary,
                    os.path.join(HERE, "memory_floor.cc")], check=True)
    return binary


# The zoo builders' default table widths (models/*.py) on the alibaba-like data; None: the
# feature's embedding_dim. xdeepfm has a second, linear table of width 1.
CELL_WIDTHS = {"lr": (1,), "dlrm": (16,), "dcn_v2": (None,), "xdeepfm": (8, 1)}
# DeepCTR's ONN at batch 4096 (section 8's build): each field's ids read from one table
# of width 8 per other field (field-aware), every table under its default L2 regulariser.
ONN_BATCH = 4096


def write_ids(path, fields, features, batch, sequences=()):
    """The ids file memory_floor.cc reads: one field per (feature, width, vocab) of
    `fields`, the feature's ids (a sequence's padded positions, id 0, as -1)."""
    ids = [np.asarray(features[f.name][:batch], np.int64).reshape(batch, -1) for f, _, _ in fields]
    with open(path, "wb") as out:
        np.array([len(fields), batch], np.int64).tofile(out)
        np.array([(vocab, width, x.shape[1]) for (_, width, vocab), x in zip(fields, ids)], np.int64).tofile(out)
        for (f, _, _), x in zip(fields, ids):
            (np.where(x == 0, -1, x) if f.name in sequences else x).tofile(out)


def cell_ids(cell):
    """(description, fields, features, batch, sequences) of a --cell."""
    sizes = sections.MODES["full"]
    if cell == "deepctr/ONN":
        from picasso_tf.tools.benchmarking.deepctr_models import EMBEDDING_DIM
        data = sections.criteo_data(sizes, ONN_BATCH, sizes.deepctr_vocab - 1)
        sparse = list(data.schema.categorical)
        # A table per field and other field: DeepCTR's ONN calls the embeddings of pairs of
        # distinct fields only.
        fields = [(f, EMBEDDING_DIM, sizes.deepctr_vocab) for f in sparse for g in sparse if g is not f]
        return (f"{cell}: batch {ONN_BATCH}, {len(sparse)} features, each read from {len(sparse) - 1} tables of "
                f"{sizes.deepctr_vocab:,} x {EMBEDDING_DIM}", fields, data.features, ONN_BATCH, ())
    model = cell.split("/")[1]
    data = sections.alibaba_data(sizes, sizes.zoo_batch)
    batch = sizes.zoo_batch
    features = list(data.schema.categorical) + list(data.schema.sequences)
    fields = [(f, w or f.embedding_dim, f.vocab_size) for w in CELL_WIDTHS[model] for f in features]
    filled = sum(int(np.count_nonzero(data.features[f.name][:batch])) for f in data.schema.sequences)
    shown = ", ".join("the features' own" if w is None else str(w) for w in CELL_WIDTHS[model])
    return (f"{cell}: batch {batch}, {len(data.schema.categorical)} one-hot features and "
            f"{len(data.schema.sequences)} sequences ({filled:,} filled positions), tables of width {shown}",
            fields, data.features, batch, {f.name for f in data.schema.sequences})


def cell_floor(cell, rounds, distances):
    """The floor of a --cell, per prefetch distance, medians over rounds."""
    description, fields, features, batch, sequences = cell_ids(cell)
    print(description)
    floors = {a: {name: [] for name in FLOORS} for a in distances}
    with tempfile.TemporaryDirectory() as scratch:
        binaries = {a: compile_floor(scratch, a) for a in distances}
        ids_path = os.path.join(scratch, "ids.bin")
        write_ids(ids_path, fields, features, batch, sequences)
        for r in range(rounds):
            for a, binary in binaries.items():
                for name, ms in floor_times(binary, ids_path).items():
                    floors[a][name].append(ms)
                print(f"round {r}, floor {a} rows ahead: " + ", ".join(f"{n} {v[-1]:.3f} ms" for n, v in floors[a].items()),
                      flush=True)
    for a in distances:
        floor = {name: float(np.median(v)) for name, v in floors[a].items()}
        print(f"floor, {a} rows ahead: forward {floor['forward']:.3f} ms, update {floor['update']:.3f} ms, "
              f"whole tables {floor['whole tables']:.3f} ms")


def floor_times(binary, ids_path, repeats=15):
    done = subprocess.run([binary, ids_path, str(repeats)], check=True, capture_output=True, text=True)
    return {name: float(ms) for name, ms in (line.split("\t") for line in done.stdout.strip().splitlines())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ahead", default="8,32", help="the floor's prefetch distances, in rows")
    parser.add_argument("--cell", choices=[f"alibaba/{m}" for m in CELL_WIDTHS] + ["deepctr/ONN"],
                        help="the floor alone, on this cell's ids")
    args = parser.parse_args(argv)
    distances = [int(a) for a in args.ahead.split(",")]
    if args.cell:
        cell_floor(args.cell, args.rounds, distances)
        return
    data, sizes, layouts, tables = prepared(sections.MODES["full"].packing_dims)
    batch = sizes.packing_batch
    kernels = {name: [] for name in KERNELS}
    floors = {a: {name: [] for name in FLOORS} for a in distances}
    with tempfile.TemporaryDirectory() as scratch:
        binaries = {a: compile_floor(scratch, a) for a in distances}
        ids_path = os.path.join(scratch, "ids.bin")
        features = list(data.schema.categorical) + list(data.schema.sequences)
        write_ids(ids_path, [(f, f.embedding_dim, f.vocab_size) for f in features], data.features, batch,
                  {f.name for f in data.schema.sequences})
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
              f"{floor['lines read']:.2f} ms, the update's {floor['lines updated']:.2f} ms; whole tables "
              f"{floor['whole tables']:.2f} ms; kernel / floor: "
              f"projection {kernel['projection'] / floor['forward']:.2f}x, "
              f"grad + Adagrad {kernel['grad + Adagrad'] / floor['update']:.2f}x")


if __name__ == "__main__":
    main()
