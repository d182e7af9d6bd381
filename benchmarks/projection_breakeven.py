"""Where a wide stitched projection stops paying: W&D step time, projection against
the MatMul on the stitched lookup, as the share of distinct ids per batch grows.

    python benchmarks/projection_breakeven.py 1.2 0.9 0.6 0.4 0.0

For each Zipf exponent (0: uniform ids): the picasso-bench packing W&D (200 one-hot
fields, dims 8/16/32, vocabulary 20,000, MLP 256-128, Adagrad, batch 4096), optimized
twice from the same weights: with the projection forced (projection_max_distinct=1)
and without it (projection=False); their samples/s are timed interleaved
(benchmarking.timing.measure, 7 rounds of 5 steps). Prints the distinct share the warm-up
statistics saw and the projection's speed ratio. Config.projection_max_distinct is
set from these figures.
"""
import dataclasses
import os
import platform
import statistics
import sys

from picasso_tf.tools.benchmarking import models as bench_models
from picasso_tf.tools.benchmarking import sections as bench_sections
from picasso_tf.tools.benchmarking.timing import measure


def main(exponents):
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.1f}; command: python {' '.join(sys.argv)}")
    print(f"{'zipf':>5} {'distinct':>9} {'projection / MatMul':>20} {'(min-max)':>12}")
    for zipf in exponents:
        sizes = dataclasses.replace(bench_sections.MODES["full"], zipf=zipf)
        data = bench_sections.wide_data(sizes, sizes.packing_batch * sizes.batches)
        trio, copies = bench_sections.build_trio(
            lambda: bench_models.build_wide_wd(data.schema), data, sizes.packing_batch, "adagrad", sizes,
            with_bound=False, options={"projection_max_distinct": 1.0},
            extra={"matmul": {"projection": False}})
        share = statistics.mean(copies["picasso"][1].picasso.program.statistics.distinct_ids.values())
        variants = [v for v in trio.variants if v.name != "baseline"]
        ratio = measure(variants, sizes.rounds, sizes.steps, sizes.warmup_steps,
                        pairs=[("picasso", "matmul")])["ratios"]["picasso/matmul"]
        print(f"{zipf:>5} {share:>9.0%} {ratio['median']:>19.2f}x {ratio['min']:>6.2f}-{ratio['max']:.2f}")


if __name__ == "__main__":
    main([float(a) for a in sys.argv[1:]] or [1.2, 0.9, 0.6, 0.4, 0.0])
