"""Tables on transparent huge pages (the `huge_pages` option, custom_ops/huge_pages.h):
picasso_tf with huge_pages=True against huge_pages=False, stock Keras beside them.

    python benchmarks/huge_pages.py [cells] [rounds]

cells: comma-separated of wide_lr, wide_wd (the packing benchmark's 200-field models),
wide_lr_large (its logistic regression on 26 fields of 400,000 ids each: 1.4 GiB of
table and accumulator),
dlrm (the zoo's DLRM on criteo-like data, batch 1024) and alibaba_lr (the zoo's logistic
regression on alibaba-like data, batch 1024); default all but wide_lr_large. Each cell's three variants
are timed interleaved by picasso-bench's harness (rounds of at least 1 s), and the
per-round ratios printed with the rounds' spread. Run it on an idle machine: the load
average is printed before and after.
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from picasso_tf.tools.benchmarking import models as bm, sections as S   # noqa: E402
from picasso_tf.tools.benchmarking.timing import measure, summary_lines  # noqa: E402

SIZES = S.MODES["full"]
LARGE_VOCAB = 400_000


def cell(name):
    """(build, data, batch size) of a cell."""
    if name in ("wide_lr", "wide_wd"):
        data = S.wide_data(SIZES, SIZES.packing_batch * SIZES.batches)
        builder = bm.build_wide_lr if name == "wide_lr" else bm.build_wide_wd
        return (lambda: builder(data.schema)), data, SIZES.packing_batch
    if name == "wide_lr_large":
        data = S.wide_data(SIZES, SIZES.packing_batch * SIZES.batches, fields=26, vocab=LARGE_VOCAB)
        return (lambda: bm.build_wide_lr(data.schema)), data, SIZES.packing_batch
    if name == "dlrm":
        data = S.criteo_data(SIZES, SIZES.zoo_batch * SIZES.batches, SIZES.zoo_max_buckets)
        return S.zoo_builder("dlrm", data.schema, data, SIZES), data, SIZES.zoo_batch
    if name == "alibaba_lr":
        data = S.alibaba_data(SIZES, SIZES.zoo_batch * SIZES.batches)
        return S.zoo_builder("lr", data.schema, data, SIZES), data, SIZES.zoo_batch
    raise SystemExit(f"unknown cell {name!r}: wide_lr, wide_wd, wide_lr_large, dlrm or alibaba_lr")


def main():
    cells = sys.argv[1].split(",") if len(sys.argv) > 1 else ["wide_lr", "wide_wd", "dlrm", "alibaba_lr"]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else SIZES.rounds
    pairs = [("picasso", "small_pages"), ("picasso", "baseline"), ("small_pages", "baseline")]
    for name in cells:
        build, data, batch = cell(name)
        trio, _ = S.build_trio(build, data, batch, "adagrad", SIZES, with_bound=False,
                               extra={"small_pages": {"huge_pages": False}})
        result = measure(trio.variants, rounds, SIZES.steps, SIZES.warmup_steps, pairs=pairs,
                         min_window_s=SIZES.min_window_s)
        load = result["load_average"]
        print(f"{name} (batch {batch}, Adagrad, {rounds} rounds; load {load[0][0]:.2f} -> {load[1][0]:.2f})")
        print("\n".join("  " + line for line in summary_lines(result)))
        # The first steps hold the copy onto huge pages.
        print("  warm-up (the first steps, traced):",
              ", ".join(f"{v} {r['warmup_s']:.2f} s" for v, r in result["variants"].items()))
        del trio
        S.cleanup()


if __name__ == "__main__":
    main()
