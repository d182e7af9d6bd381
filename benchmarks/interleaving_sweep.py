"""Interleaving sweeps (the paper's Fig. 14/15 on this CPU): samples/s of the zoo's
wide_deep and dlrm on criteo-like data with micro_batches = 2, 4, 8 and
interleave_groups = 2, 4, against the same model at 1 and 1, timed interleaved.

    python benchmarks/interleaving_sweep.py [batch]          # default 4096

Every variant is a copy of one model with the same weights and batches
(picasso_tf.tools.benchmarking: build_trio, measure; 5 rounds of 8 steps); the ratio
is the median over rounds of variant / (micro_batches=1, interleave_groups=1).
"""
import dataclasses
import os
import sys

import picasso_tf.models as zoo
from picasso_tf.tools.benchmarking import sections as bench_sections
from picasso_tf.tools.benchmarking.timing import measure

VARIANTS = {"micro_batches=2": {"micro_batches": 2}, "micro_batches=4": {"micro_batches": 4},
            "micro_batches=8": {"micro_batches": 8}, "interleave_groups=2": {"interleave_groups": 2},
            "interleave_groups=4": {"interleave_groups": 4}}


def main(batch=4096):
    sizes = dataclasses.replace(bench_sections.MODES["full"], rounds=5, steps=8, batches=2)
    print(f"batch {batch}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
          f"command: python {' '.join(sys.argv)}")
    data = bench_sections.criteo_data(sizes, batch * sizes.batches, max_buckets=100_000)
    print(f"{'model':<10} {'variant':<20} {'samples/s vs K=1, N=1':>22} {'(min-max)':>12}")
    for name in ("wide_deep", "dlrm"):
        trio, _ = bench_sections.build_trio(lambda: zoo.build(name, data.schema), data, batch, "adagrad", sizes,
                                            with_bound=False, extra=VARIANTS)
        variants = [v for v in trio.variants if v.name != "baseline"]
        ratios = measure(variants, sizes.rounds, sizes.steps, sizes.warmup_steps,
                         pairs=[(v, "picasso") for v in VARIANTS])["ratios"]
        for v in VARIANTS:
            r = ratios[f"{v}/picasso"]
            print(f"{name:<10} {v:<20} {r['median']:>21.2f}x {r['min']:>6.2f}-{r['max']:.2f}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
