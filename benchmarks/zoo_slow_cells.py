"""Issue 24's slow zoo cells: is picasso_tf really slower than Keras on criteo/star and
criteo/dcn_v2, and if so which pass costs? (results: benchmarks/zoo_slow_cells.txt)

  python benchmarks/zoo_slow_cells.py spread star dcn_v2      # the zoo cell, repeated
  python benchmarks/zoo_slow_cells.py ablation star dcn_v2    # one pass off at a time
  python benchmarks/zoo_slow_cells.py breakdown star dcn_v2   # per-op time, Keras vs picasso_tf
  python benchmarks/zoo_slow_cells.py teardown dcn_v2         # fit's duration vs its steps, traced

Every part builds the cell as picasso-bench's zoo section does (criteo-like data,
batch 1024, Adagrad, the zoo's default hyper-parameters) and times it with the suite's
interleaved `measure`.

spread: the zoo cell (5 rounds) REPEATS times, alternating the suite's 3 steps a round
with 20 (rounds of about 0.25 s instead of 40 ms: does a longer round steady the cell?);
prints each cell's picasso/baseline median and how many fall below 1.0.
ablation: picasso_tf with all passes, and with each of the passes that act on these models
switched off, against Keras in one interleaved measurement of 12 rounds of 20 steps.
breakdown: per-op kernel time of 30 traced steps (tools/benchmarking/breakdown.py), Keras
and picasso_tf alternated twice; per op type the two traces' ms/step and kernels/step.
teardown: why op_breakdown times each step instead of dividing fit's duration by the steps:
three traced fits of 30 steps per variant, fit's duration per step beside the median traced
step and the longest TFE_DeleteTensorHandle after the last step.
"""
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from picasso_tf.tools.benchmarking import sections as bench       # noqa: E402
import tensorflow as tf                                              # noqa: E402

from picasso_tf.tools.benchmarking.breakdown import _trace_events, op_breakdown  # noqa: E402
from picasso_tf.tools.benchmarking.timing import measure, step_times  # noqa: E402

SIZES = bench.MODES["full"]
REPEATS = 8
ABLATIONS = {"stitching=False": {"stitching": False},
             "fused_optimizer=False": {"fused_optimizer": False},
             "fused_dense_optimizer=False": {"fused_dense_optimizer": False},
             "apply_in_gradient=False": {"apply_in_gradient": False},
             "shard_heavy_groups=False": {"shard_heavy_groups": False},
             "packing=False": {"packing": False}}


def cell(name, extra=None):
    data = bench.criteo_data(SIZES, SIZES.zoo_batch * SIZES.batches, SIZES.zoo_max_buckets)
    build = bench.zoo_builder(name, data.schema, data, SIZES)
    trio, _ = bench.build_trio(build, data, SIZES.zoo_batch, "adagrad", SIZES, with_bound=False, extra=extra)
    print(f"\n== criteo/{name}")
    return trio.variants


def load():
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def spread(name):
    variants = cell(name)
    medians = {SIZES.zoo_steps: [], 20: []}
    print(f"load before {load()}")
    for r in range(REPEATS):
        for steps in (list(medians) if r % 2 == 0 else list(medians)[::-1]):
            res = measure(variants, SIZES.zoo_rounds, steps, SIZES.warmup_steps, pairs=[("picasso", "baseline")])
            medians[steps].append(res["ratios"]["picasso/baseline"]["median"])
    print(f"load after {load()}")
    for steps, m in medians.items():
        cells = " ".join(f"{x:.2f}" for x in sorted(m))
        print(f"  {steps:2d} steps a round: picasso/baseline of {REPEATS} cells: {cells}; "
              f"below 1.0: {sum(x < 1 for x in m)}; median {statistics.median(m):.2f}, stdev {statistics.stdev(m):.3f}")


def ablation(name):
    variants = cell(name, ABLATIONS)
    res = measure(variants, 12, 20, SIZES.warmup_steps,
                  pairs=[(v.name, "baseline") for v in variants if v.name != "baseline"])
    print(f"12 rounds of {res['steps']} steps; load {res['load_average'][0][0]:.1f} -> {res['load_average'][1][0]:.1f}")
    for v in variants[1:]:
        r = res["ratios"][f"{v.name}/baseline"]
        print(f"  {v.name:28s} /baseline median {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}), "
              f"rounds below 1.0: {sum(x < 1 for x in r['per_round'])}/12")


def breakdown(name):
    variants = cell(name)
    for v in variants:
        step_times(v.model, v.dataset, 5)                   # warm-up: tracing stays out of the traces
    traces = {v.name: [] for v in variants}
    for order in (variants, variants[::-1]):
        for v in order:
            traces[v.name].append(op_breakdown(v.model, v.dataset, steps=30, top=80))
    print(f"load {load()}; ms/step (trace 1 / trace 2), kernels/step")
    for n, bs in traces.items():
        walls = " / ".join(f"{b['wall_ms_per_step']:.1f}" for b in bs)
        sums = " / ".join(f"{b['op_ms_per_step']:.1f}" for b in bs)
        print(f"  {n:8s} wall {walls}, sum of op times {sums}, "
              f"kernels {sum(t['ops_per_step'] for t in bs[0]['by_type']):.0f}")
    ops = {}
    for n, bs in traces.items():
        for b in bs:
            for t in b["by_type"]:
                ops.setdefault(t["op"], {}).setdefault(n, []).append(t)
    rows = sorted(ops.items(), key=lambda kv: -max(sum(t["ms_per_step"] for t in ts) for ts in kv[1].values()))
    print(f"  {'op':32s}" + "".join(f"{n:>22s}" for n in traces))
    for op, by in rows:
        if max(t["ms_per_step"] for ts in by.values() for t in ts) < 0.05:
            continue
        cells = ["/".join(f"{t['ms_per_step']:.2f}" for t in by[n]) + f" {by[n][0]['ops_per_step']:4.0f}x"
                 if n in by else "-" for n in traces]
        print(f"  {op:32s}" + "".join(f"{c:>22s}" for c in cells))


def teardown(name):
    variants = cell(name)
    for v in variants:
        step_times(v.model, v.dataset, 5)
    for _ in range(3):
        for v in variants:
            logdir = tempfile.mkdtemp()
            tf.profiler.experimental.start(logdir)
            start = time.perf_counter()
            v.model.fit(v.dataset, epochs=1, steps_per_epoch=30, verbose=0)
            fit_ms = 1e3 * (time.perf_counter() - start)
            tf.profiler.experimental.stop()
            events = _trace_events(logdir)
            shutil.rmtree(logdir)
            host = [e for e in events if e.get("ph") == "X" and e.get("args", {}).get("is_eager") != 0]
            steps = sorted((e for e in host if e["name"] == "train_function"), key=lambda e: e["ts"])
            end = steps[-1]["ts"] + steps[-1]["dur"]
            deletes = [e["dur"] / 1e3 for e in host if e["name"] == "TFE_DeleteTensorHandle" and e["ts"] >= end]
            step_ms = statistics.median(b["ts"] - a["ts"] for a, b in zip(steps, steps[1:])) / 1e3
            print(f"  {v.name:8s} fit {fit_ms:6.1f} ms / 30 = {fit_ms / 30:5.1f} ms; median traced step {step_ms:5.1f} "
                  f"ms; after the last step a TFE_DeleteTensorHandle of {max(deletes, default=0.0):6.1f} ms")


if __name__ == "__main__":
    part, models = sys.argv[1], sys.argv[2:] or ["star", "dcn_v2"]
    for model in models:
        {"spread": spread, "ablation": ablation, "breakdown": breakdown, "teardown": teardown}[part](model)
