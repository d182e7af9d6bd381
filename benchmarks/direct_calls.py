"""What calling Keras' step function without its per-call dispatch buys
(picasso_tf.runtime.direct_calls): a picasso_tf model trained with its step function
called directly (as picasso_tf.optimize returns it) and the same model with Keras'
ordinary call, beside stock Keras, the three taking turns as the suite's cells do
(rounds of at least 1 s).

    python benchmarks/direct_calls.py [--cells wide_lr,criteo/lr,criteo/dlrm] [--rounds 5]

A cell is wide_lr or wide_wd (the packing benchmark's 200 fields, batch 4096) or a zoo
cell DATA/MODEL (batch 1024), built as the suite builds it, Adagrad.
"""
import argparse
import dataclasses
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from picasso_tf.tools.benchmarking import models as bm, sections as bench, timing  # noqa: E402


class Dispatched:
    """A picasso_tf model whose fit calls Keras' step function as Keras does: each call
    dispatched by TensorFlow (its turns only; the model is shared with the direct variant)."""

    def __init__(self, model):
        self.model = model

    def fit(self, *args, **kwargs):
        direct = self.model.make_train_function()
        self.model.train_function = direct.function
        try:
            return self.model.fit(*args, **kwargs)
        finally:
            self.model.train_function = direct


def cell_data(cell, sizes):
    """(build, data, batch size, steps) of a cell, as the suite's sections build it."""
    if cell in ("wide_lr", "wide_wd"):
        data = bench.wide_data(sizes, sizes.packing_batch * sizes.batches)
        build = bm.build_wide_lr if cell == "wide_lr" else bm.build_wide_wd
        return (lambda: build(data.schema)), data, sizes.packing_batch, sizes.steps
    dataset, model = cell.split("/")
    rows = sizes.zoo_batch * sizes.batches
    data = (bench.criteo_data(sizes, rows, sizes.zoo_max_buckets) if dataset == "criteo"
            else bench.alibaba_data(sizes, rows))
    return bench.zoo_builder(model, data.schema, data, sizes), data, sizes.zoo_batch, sizes.zoo_steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", default="wide_lr,criteo/lr,criteo/dlrm")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    sizes = bench.MODES["full"]
    print(f"command: python {' '.join(sys.argv)}")
    for cell in args.cells.split(","):
        build, data, batch, steps = cell_data(cell, sizes)
        trio, _ = bench.build_trio(build, data, batch, "adagrad", sizes, with_bound=False)
        picasso = next(v for v in trio.variants if v.name == "picasso")
        trio.variants.append(dataclasses.replace(picasso, name="dispatched", model=Dispatched(picasso.model)))
        result = timing.measure(trio.variants, args.rounds, steps, sizes.warmup_steps,
                                pairs=[("picasso", "dispatched"), ("picasso", "baseline"), ("dispatched", "baseline")],
                                min_window_s=sizes.min_window_s)
        (before, _, _), (after, _, _) = result["load_average"]
        print(f"{cell}: load average {before:.2f} -> {after:.2f}; features {len(data.schema.features)}")
        for line in timing.summary_lines(result):
            print(f"  {line}")


if __name__ == "__main__":
    main()
