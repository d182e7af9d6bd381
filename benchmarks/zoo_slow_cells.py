"""Issue 24's slow zoo cells: is picasso_tf really slower than Keras on criteo/star and
criteo/dcn_v2, and if so which pass costs? (results: benchmarks/zoo_slow_cells.txt)
Issue 38's cells below 95% of their dense-only bound: how near can they get?

  python benchmarks/zoo_slow_cells.py spread star dcn_v2      # the zoo cell, repeated
  python benchmarks/zoo_slow_cells.py ablation star dcn_v2    # one pass off at a time
  python benchmarks/zoo_slow_cells.py breakdown star dcn_v2   # per-op time: Keras, picasso_tf, bound
  python benchmarks/zoo_slow_cells.py teardown dcn_v2         # fit's duration vs its steps, traced
  python benchmarks/zoo_slow_cells.py ceiling lr alibaba/lr   # picasso_tf's kernels against the bound

Every part builds the cell as picasso-bench's zoo section does (criteo-like data unless a
model is named DATASET/MODEL, batch 1024, Adagrad, the zoo's default hyper-parameters) and
times it with the suite's interleaved `measure`.

spread: the zoo cell (5 rounds) REPEATS times, alternating the suite's 3 steps a round
with 20 (rounds of about 0.25 s instead of 40 ms: does a longer round steady the cell?);
prints each cell's picasso/baseline median and how many fall below 1.0.
ablation: picasso_tf with all passes, and with each of the passes that act on these models
switched off, against Keras in one interleaved measurement of 12 rounds of 20 steps.
breakdown: per-op kernel time of 30 traced steps (tools/benchmarking/breakdown.py), Keras,
picasso_tf and the dense-only bound alternated twice; per op type the two traces' ms/step and
kernels/step.
teardown: why op_breakdown times each step instead of dividing fit's duration by the steps:
three traced fits of 30 steps per variant, fit's duration per step beside the median traced
step and the longest TFE_DeleteTensorHandle after the last step.
ceiling: the dense-only bound is the model with an embedding layer that costs nothing, so
picasso_tf's own kernels (every op type named Picasso*: the lookups, their gradients and
the fused updates) are time the bound never spends. 30 traced steps of picasso_tf and of
the bound, alternated twice; per cell the traced steps, the kernels' time, the time of
the op types the bound spends more on than picasso_tf (its slices of the dense input),
and the ceiling: the bound's step over the step picasso_tf would take if everything but
its kernels ran as in the bound, bound / (bound + kernels - bound's extra). Summing only
the positive differences errs high, so where ops do not run at once (op time per step at
or below 1) a cell whose ceiling is below 95% cannot reach issue 38's target without
faster kernels; above 1 the ceiling, which counts op time as step time, is indicative.
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


def cell(spec, extra=None, with_bound=False):
    """The variants of zoo cell `spec` (MODEL, criteo-like, or DATASET/MODEL)."""
    dataset, name = spec.split("/") if "/" in spec else ("criteo", spec)
    rows = SIZES.zoo_batch * SIZES.batches
    data = bench.criteo_data(SIZES, rows, SIZES.zoo_max_buckets) if dataset == "criteo" \
        else bench.alibaba_data(SIZES, rows)
    build = bench.zoo_builder(name, data.schema, data, SIZES)
    trio, _ = bench.build_trio(build, data, SIZES.zoo_batch, "adagrad", SIZES, with_bound=with_bound, extra=extra)
    print(f"\n== {dataset}/{name}")
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


def alternated_traces(variants, top):
    """Two op_breakdown traces of 30 steps per variant, the variants in turn, after a warm-up
    (tracing stays out of the traces)."""
    for v in variants:
        step_times(v.model, v.dataset, 5)
    traces = {v.name: [] for v in variants}
    for order in (variants, variants[::-1]):
        for v in order:
            traces[v.name].append(op_breakdown(v.model, v.dataset, steps=30, top=top))
    return traces


def breakdown(name):
    variants = cell(name, with_bound=True)
    traces = alternated_traces(variants, top=80)
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


def ceiling(spec):
    variants = [v for v in cell(spec, with_bound=True) if v.name in ("picasso", "bound")]
    if len(variants) < 2:
        print("  no dense-only bound for this cell")
        return
    traces = alternated_traces(variants, top=10_000)

    def mean_ms(name):
        """Per op type, ms per step averaged over the variant's traces."""
        out = {}
        for b in traces[name]:
            for t in b["by_type"]:
                out[t["op"]] = out.get(t["op"], 0.0) + t["ms_per_step"] / len(traces[name])
        return out

    picasso, bound = mean_ms("picasso"), mean_ms("bound")
    walls = {n: statistics.mean(b["wall_ms_per_step"] for b in bs) for n, bs in traces.items()}
    kernels = {op: ms for op, ms in picasso.items() if op.startswith("Picasso")}
    bound_extra = sum(max(0.0, ms - picasso.get(op, 0.0)) for op, ms in bound.items())
    top = ", ".join(f"{op} {ms:.2f}" for op, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:4])
    print(f"load {load()}; traced step (mean of 2 traces of 30): bound {walls['bound']:.2f} ms, picasso_tf "
          f"{walls['picasso']:.2f} ms: {walls['bound'] / walls['picasso']:.0%} of the bound")
    print(f"  picasso_tf's kernels {sum(kernels.values()):.2f} ms a step ({top}); the bound's extra op time "
          f"{bound_extra:.2f} ms")
    overlap = {n: statistics.mean(b["op_ms_per_step"] for b in bs) / walls[n] for n, bs in traces.items()}
    print(f"  ceiling {walls['bound'] / (walls['bound'] + sum(kernels.values()) - bound_extra):.0%} of the bound; "
          f"op time / step: picasso_tf {overlap['picasso']:.2f}, bound {overlap['bound']:.2f} (above 1, ops ran "
          "at once and the ceiling, which counts op time as step time, is only indicative)")


if __name__ == "__main__":
    part, models = sys.argv[1], sys.argv[2:] or ["star", "dcn_v2"]
    for model in models:
        {"spread": spread, "ablation": ablation, "breakdown": breakdown, "teardown": teardown,
         "ceiling": ceiling}[part](model)
