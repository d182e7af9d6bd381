"""Does a lookup pay for its rows' bytes? Sizing split bfloat16 tables before building them.

Split bfloat16 (the Intel CPU DLRM paper's Split-SGD-BF16) keeps a float32 table as two
16-bit halves: the lookups read the top halves (a bfloat16 row: half the bytes), the
update reads and writes both (the float32 weight stays exact). On picasso_tf's step it
could only shorten the passes that read rows without writing them: the fused lookup or
projection. The update in the gradient kernel moves the same bytes as today.

So this times wide_lr's stages in isolation (tools/benchmarking/stages.py: the stitched
projection, the gradient with Adagrad in the kernel, on the packing benchmark's ids)
twice: on its tables, and on tables of the same fields, ids and groups whose rows take
half the bytes (every width halved, which is the bytes of a bfloat16 row of the full
width). The projection's time at half the bytes bounds what bfloat16 rows could save it.

  python benchmarks/row_bytes.py [--dims 8,16,32] [--rounds 3]

The two configurations alternate `rounds` times; each round times every stage 15 times
after warm-up (median). Prints the medians over rounds and the projection's ratio.
"""
import argparse
import dataclasses
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np            # noqa: E402
import tensorflow as tf       # noqa: E402

from picasso_tf.tools.benchmarking import models as bm, sections   # noqa: E402
from picasso_tf.tools.benchmarking.stages import stage_times        # noqa: E402

STAGES = ("picasso: projection", "picasso: grad + Adagrad in the kernel")


def prepared(dims):
    """(data, sizes, the program's table layouts, the model's tables) of wide_lr at `dims`."""
    sizes = dataclasses.replace(sections.MODES["full"], packing_dims=dims)
    data = sections.wide_data(sizes, sizes.packing_batch * 2)
    tf.keras.utils.set_random_seed(sizes.seed)
    model = bm.build_wide_lr(data.schema)
    features, labels = bm.batches(data, model, sizes.packing_batch, 1)[0]
    optimized = sections._picasso(model, features, None)
    sections._compile(optimized, "adagrad")
    optimized.fit(features, labels, batch_size=sizes.packing_batch, verbose=0)     # the program's layouts
    tables = [model.get_layer(f"emb_{f.name}").embeddings for f in data.schema.categorical]
    return data, sizes, optimized.picasso.program.tables, tables


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dims", default="8,16,32", help="the widths of the full tables")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    full = tuple(int(d) for d in args.dims.split(","))
    configurations = {f"float32 rows {full}": full, f"half the bytes {tuple(d // 2 for d in full)}":
                      tuple(d // 2 for d in full)}
    runs = {label: prepared(dims) for label, dims in configurations.items()}
    times = {label: {stage: [] for stage in STAGES} for label in runs}
    for r in range(args.rounds):
        for label, (data, sizes, layouts, tables) in runs.items():
            out = stage_times(data.schema, data.features, data.labels, sizes.packing_batch, layouts, tables)
            measured = {name.split(" (")[0]: value["ms"] for name, value in out["stages"].items()}
            for stage in STAGES:
                times[label][stage].append(measured[stage])
            print(f"round {r}, {label}: " + ", ".join(f"{s} {measured[s]:.2f} ms" for s in STAGES), flush=True)
    medians = {label: {stage: float(np.median(v)) for stage, v in stages.items()} for label, stages in times.items()}
    for label, stages in medians.items():
        print(f"{label}: " + ", ".join(f"{s} {ms:.2f} ms" for s, ms in stages.items()))
    full_label, half_label = list(medians)
    print(f"projection at half the bytes / float32: "
          f"{medians[half_label][STAGES[0]] / medians[full_label][STAGES[0]]:.2f}x the time")


if __name__ == "__main__":
    main()
