"""Interleaving sweeps (the paper's Fig. 14/15 on this CPU): samples/s and peak memory
of the zoo's wide_deep, can and mmoe on criteo-like data with micro_batches 1-8 from
the embedding layer, 2, 4 and 8 from the MLP, and interleave_groups 2-11, as ratios
against the same model at micro_batches=1, interleave_groups=1.

    python benchmarks/interleaving_sweep.py [batch]          # default 4096
    python benchmarks/interleaving_sweep.py breakdown [batch]  # W&D's per-op times, K=1 / 2 / 2 from the MLP

Every timed variant is a copy of one model with the same weights and batches
(picasso_tf.tools.benchmarking: build_trio, measure; 5 rounds of 6 steps, variants
taking turns); the ratio is the median over rounds of variant / (K=1, N=1), with its
min-max. Groups chain every fused lookup (interleave_excluded=()), and a model has
only as many groups as fused lookups, so N stops there. Peak memory is the step's
peak RSS in a fresh process per setting (benchmarks/micro_batch_memory.py).
"""
import dataclasses
import os
import platform
import sys

import picasso_tf
import picasso_tf.models as zoo
from picasso_tf.tools.benchmarking import sections as bench_sections
from picasso_tf.tools.benchmarking.timing import measure

sys.path.insert(0, os.path.dirname(__file__))
from micro_batch_memory import run as peak_memory  # noqa: E402

MODELS = ("wide_deep", "can", "mmoe")


def variants(lookups):
    out = {f"K={k}": {"micro_batches": k} for k in range(2, 9)}
    out.update({f"K={k} mlp": {"micro_batches": k, "interleave_from": "mlp"} for k in (2, 4, 8)})
    out.update({f"N={n}": {"interleave_groups": n, "interleave_excluded": ()} for n in range(2, min(11, lookups) + 1)})
    return out


def main(batch=4096):
    sizes = dataclasses.replace(bench_sections.MODES["full"], rounds=5, steps=6, batches=2)
    print(f"batch {batch}; {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
          f"load {os.getloadavg()[0]:.1f}; command: python {' '.join(sys.argv)}")
    data = bench_sections.criteo_data(sizes, batch * sizes.batches, max_buckets=100_000)
    print(f"{'model':<10} {'variant':<10} {'samples/s':>10} {'vs K=1':>7} {'(min-max)':>11} {'peak MiB':>9} "
          f"{'vs K=1':>7}")
    for name in MODELS:
        build = lambda: zoo.build(name, data.schema)                       # noqa: E731
        lookups = len(picasso_tf.optimize(build(), example_inputs=data.take(range(8)).features)
                      .picasso.program.lookups["training"])
        extra = variants(lookups)
        trio, _ = bench_sections.build_trio(build, data, batch, "adagrad", sizes, with_bound=False, extra=extra)
        timed = [v for v in trio.variants if v.name != "baseline"]
        result = measure(timed, sizes.rounds, sizes.steps, sizes.warmup_steps,
                         pairs=[(v, "picasso") for v in extra])
        peaks = {}
        for variant, options in [("picasso", {})] + list(extra.items()):
            if "interleave_groups" not in options:
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


def breakdown(batch=4096):
    """Where W&D's step time goes at K=1, K=2 and K=2 from the MLP: per-op times from a
    profiler trace (picasso_tf.tools.benchmarking.breakdown)."""
    import tensorflow as tf
    from picasso_tf.data import synthetic
    from picasso_tf.tools.benchmarking.breakdown import op_breakdown
    print(f"batch {batch}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; command: python {' '.join(sys.argv)}")
    schema = synthetic.preset_schema("criteo", max_buckets=100_000)
    data = synthetic.generate(schema, batch * 2, seed=1)
    dataset = tf.data.Dataset.from_tensor_slices((data.features, data.label_dict)).batch(batch).cache().repeat()
    for label, options in (("K=1", {}), ("K=2", {"micro_batches": 2}),
                           ("K=2 mlp", {"micro_batches": 2, "interleave_from": "mlp"})):
        tf.keras.utils.set_random_seed(1)
        model = picasso_tf.optimize(zoo.build("wide_deep", schema), warmup_data=dataset.take(2), **options)
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.01), loss="binary_crossentropy")
        model.fit(dataset, steps_per_epoch=3, epochs=1, verbose=0)
        b = op_breakdown(model, dataset, steps=6, top=14)
        print(f"{label}: wall {b['wall_ms_per_step']:.1f} ms/step, ops {b['op_ms_per_step']:.1f} ms/step")
        for r in b["by_type"]:
            print(f"   {r['op']:<36} {r['ms_per_step']:7.2f} ms  x{r['ops_per_step']:.0f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["breakdown"]:
        breakdown(*(int(a) for a in sys.argv[2:]))
    else:
        main(*(int(a) for a in sys.argv[1:]))
