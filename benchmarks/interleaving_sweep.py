"""Interleaving sweeps (the paper's Fig. 14/15 on this CPU): samples/s and peak memory
of the zoo's wide_deep, can and mmoe with micro_batches 1-8 from the embedding layer,
2, 4 and 8 from the MLP, and interleave_groups 2-11, as ratios against the same model
at micro_batches=1, interleave_groups=1, beside a second copy of that model (row "K=1
copy": the spread between identical copies).

    python benchmarks/interleaving_sweep.py [batch] [--models can,mmoe] [--ks 2,4,8] [--groups 2,4]
                                            [--rounds 5] [--steps 6] [--no-peak]
    python benchmarks/interleaving_sweep.py breakdown [batch] [model] [K]  # per-op times, K=1 / K / K from the MLP

batch: default 4096. --models: default all three. --ks: the K > 1 to time, each from the
embedding and from the MLP (default 2-8 from the embedding, 2, 4, 8 from the MLP).
--groups: the N > 1 to time (default 2 up to min(11, fused lookups)).

Data: wide_deep on criteo-like data (picasso_tf.data.synthetic, 100,000 buckets); can
and mmoe on the paper's Product-2/3 field layouts as picasso-bench's ablation builds
them (tools/benchmarking/sections.py: paper_schema scaled by can 0.2, mmoe 1;
vocabulary 10,000, behaviour sequences of 50; CAN's co-action fed by 4 fields).

Every timed variant is a copy of one model with the same weights and batches
(picasso_tf.tools.benchmarking: build_trio, measure; 5 rounds of 6 steps, variants
taking turns); the ratio is the median over rounds of variant / (K=1, N=1), with its
min-max. Groups chain every fused lookup (interleave_excluded=()), and a model has
only as many groups as fused lookups, so N stops there. Peak memory is the step's
peak RSS in a fresh process per setting, measured as benchmarks/micro_batch_memory.py
does (that script: criteo-like data at batch 65536); not for the N variants.
"""
import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys

import picasso_tf
import picasso_tf.models as zoo
from micro_batch_memory import PEAK_ENV, step_peaks
from picasso_tf.tools.benchmarking import sections as bench_sections
from picasso_tf.tools.benchmarking.timing import measure

MODELS = ("wide_deep", "can", "mmoe")
SIZES = dataclasses.replace(bench_sections.MODES["full"], rounds=5, steps=6, batches=2)


def model_and_data(name, rows):
    """(a no-argument builder of zoo model `name`, `rows` examples of its data)."""
    if name == "wide_deep":
        data = bench_sections.criteo_data(SIZES, rows, max_buckets=100_000)
        return (lambda: zoo.build(name, data.schema)), data
    from picasso_tf.data import generate
    schema = bench_sections.paper_schema(name, SIZES.ablation_scale.get(name, 1.0), vocab=SIZES.scaling_vocab,
                                         seq_len=SIZES.alibaba_seq_len)
    data = generate(schema, rows, seed=SIZES.seed, zipf_exponent=SIZES.zipf)
    return bench_sections.zoo_builder(name, schema, data, SIZES, limit_feeders=True), data


def peak_child(name, k, start, batch):
    """In a fresh process (PEAK_ENV): the peak RSS of a step over `batch` examples above
    the RSS before it, the median of PEAK_STEPS steps (as benchmarks/micro_batch_memory.py
    measures it), printed as JSON."""
    import tensorflow as tf

    build, data = model_and_data(name, int(batch))
    x, y = data.features, data.label_dict
    small = data.take(range(64))
    model = picasso_tf.optimize(build(), micro_batches=int(k), interleave_from=start)
    model.compile(optimizer=tf.keras.optimizers.Adagrad(0.01), loss="binary_crossentropy")
    model.train_on_batch(small.features, small.label_dict)   # the optimizer's slots
    model.train_on_batch(x, y)                               # traced for this batch size
    peaks = step_peaks(model, x, y)
    print(json.dumps({"peak": sorted(peaks)[len(peaks) // 2], "peaks": peaks}))


def peak_memory(name, k, start, batch):
    out = subprocess.run([sys.executable, __file__, "peak", name, str(k), start, str(batch)], capture_output=True,
                         text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def variants(lookups, ks=None, groups=None):
    # A second copy of K=1: how far two identical copies read apart is the spread the
    # other ratios are judged against.
    out = {"K=1 copy": {}}
    out.update({f"K={k}": {"micro_batches": k} for k in (ks or range(2, 9))})
    out.update({f"K={k} mlp": {"micro_batches": k, "interleave_from": "mlp"} for k in (ks or (2, 4, 8))})
    out.update({f"N={n}": {"interleave_groups": n, "interleave_excluded": ()}
                for n in (groups or range(2, min(11, lookups) + 1)) if n <= lookups})
    return out


def main(batch=4096, models=MODELS, ks=None, groups=None, rounds=None, steps=None, with_peaks=True):
    sizes = dataclasses.replace(SIZES, rounds=rounds or SIZES.rounds, steps=steps or SIZES.steps)
    print(f"batch {batch}; {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
          f"load {os.getloadavg()[0]:.1f}; command: python {' '.join(sys.argv)}")
    print(f"{'model':<10} {'variant':<10} {'samples/s':>10} {'vs K=1':>7} {'(min-max)':>11} {'peak MiB':>9} "
          f"{'vs K=1':>7}")
    for name in models:
        build, data = model_and_data(name, batch * sizes.batches)
        lookups = len(picasso_tf.optimize(build(), example_inputs=data.take(range(8)).features)
                      .picasso.program.lookups["training"])
        extra = variants(lookups, ks, groups)
        trio, _ = bench_sections.build_trio(build, data, batch, "adagrad", sizes, with_bound=False, extra=extra)
        timed = [v for v in trio.variants if v.name != "baseline"]
        result = measure(timed, sizes.rounds, sizes.steps, sizes.warmup_steps,
                         pairs=[(v, "picasso") for v in extra])
        peaks = {}
        for variant, options in [("picasso", {"micro_batches": 1})] + list(extra.items()):
            if with_peaks and "micro_batches" in options:
                peaks[variant] = peak_memory(name, options.get("micro_batches", 1),
                                             options.get("interleave_from", "embedding"), batch)["peak"]
        for variant in ["picasso"] + list(extra):
            if variant not in result["variants"]:
                print(f"{name:<10} {variant:<10} failed: {trio.info.get(variant + '_error')}")
                continue
            sps = result["variants"][variant]["samples_per_s"]
            r = result["ratios"].get(f"{variant}/picasso", {"median": 1.0, "min": 1.0, "max": 1.0})
            memory = (f"{peaks[variant] / 2**20:>9.1f} {peaks[variant] / peaks['picasso']:>6.2f}x"
                      if variant in peaks else "")
            label = "K=1" if variant == "picasso" else variant
            print(f"{name:<10} {label:<10} {sps:>10,.0f} {r['median']:>6.2f}x {r['min']:>5.2f}-{r['max']:<5.2f} "
                  f"{memory}", flush=True)
        print(f"{name:<10} fused lookups: {lookups}; load {result['load_average']}", flush=True)


def breakdown(batch=4096, name="wide_deep", k=2):
    """Where a model's step time goes at K=1, K=k and K=k from the MLP: per-op times
    from a profiler trace (picasso_tf.tools.benchmarking.breakdown)."""
    import tensorflow as tf
    from picasso_tf.tools.benchmarking import models as bm
    from picasso_tf.tools.benchmarking.breakdown import op_breakdown
    print(f"batch {batch}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; command: python {' '.join(sys.argv)}")
    build, data = model_and_data(name, batch * 2)
    targets = bm.targets(build(), data.label_dict)
    dataset = tf.data.Dataset.from_tensor_slices((data.features, targets)).batch(batch).cache().repeat()
    for label, options in (("K=1", {}), (f"K={k}", {"micro_batches": k}),
                           (f"K={k} mlp", {"micro_batches": k, "interleave_from": "mlp"})):
        tf.keras.utils.set_random_seed(1)
        model = picasso_tf.optimize(build(), warmup_data=dataset.take(2), **options)
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.01), loss="binary_crossentropy")
        model.fit(dataset, steps_per_epoch=3, epochs=1, verbose=0)
        b = op_breakdown(model, dataset, steps=6, top=16)
        print(f"{label}: wall {b['wall_ms_per_step']:.1f} ms/step, ops {b['op_ms_per_step']:.1f} ms/step")
        for r in b["by_type"]:
            print(f"   {r['op']:<36} {r['ms_per_step']:7.2f} ms  x{r['ops_per_step']:.0f}")


def _ints(text):
    return tuple(int(a) for a in text.split(","))


if __name__ == "__main__":
    if sys.argv[1:2] == ["breakdown"]:
        batch, name, k = (sys.argv[2:] + [None] * 3)[:3]
        breakdown(int(batch or 4096), name or "wide_deep", int(k or 2))
    elif sys.argv[1:2] == ["peak"]:
        if any(os.environ.get(key) != value for key, value in PEAK_ENV.items()):
            # malloc reads its settings when the process starts
            os.execve(sys.executable, [sys.executable] + sys.argv, dict(os.environ, **PEAK_ENV))
        peak_child(*sys.argv[2:])
    else:
        parser = argparse.ArgumentParser(description="Interleaving sweeps (Fig. 14/15)")
        parser.add_argument("batch", nargs="?", type=int, default=4096)
        parser.add_argument("--models", type=lambda t: tuple(t.split(",")), default=MODELS)
        parser.add_argument("--ks", type=_ints, default=None, help="K > 1, from the embedding and from the MLP")
        parser.add_argument("--groups", type=_ints, default=None, help="interleave_groups N > 1")
        parser.add_argument("--rounds", type=int, default=None, help="default 5")
        parser.add_argument("--steps", type=int, default=None, help="steps per variant and round; default 6")
        parser.add_argument("--no-peak", action="store_true", help="no peak-memory column (a fresh process each)")
        args = parser.parse_args()
        unknown = set(args.models) - set(MODELS)
        if unknown:
            parser.error(f"unknown models {sorted(unknown)}; choose from {', '.join(MODELS)}")
        main(args.batch, args.models, args.ks, args.groups, args.rounds, args.steps, not args.no_peak)
