"""The fused dense optimizer update (issue 24, picasso_tf.runtime.dense_update): one op
per dtype for the Keras optimizer's update of the dense variables, on vs off.

  python benchmarks/dense_update.py [rounds]

update: the update alone, on the dense variables of the paper's MMoE layout (their
shapes, fixed random gradients), as a tf.function of Keras' apply_gradients against
one of the fused update (FusedDenseUpdate.apply), Adagrad and Adam, alternating rounds.

models: the whole training step. the paper's MMoE layout (94 fields, as picasso-bench's ops and ablation
sections) and the zoo's DLRM and W&D on criteo-like data (as picasso-bench's zoo
section), batch 1024, Adagrad(0.01) and Adam(0.001). For each, picasso_tf with
fused_dense_optimizer=True and False, timed in alternating rounds (the order of the
two flips every round) after warm-up; prints samples/s and the per-round ratio
on / off time (median, min and max: the machine is shared), plus the training
step's op counts.
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np            # noqa: E402
import tensorflow as tf       # noqa: E402

from benchmarks.dense_packing import alternating   # noqa: E402

BATCH, STEPS = 1024, 5
OPTIMIZERS = {"adagrad": lambda: tf.keras.optimizers.Adagrad(0.01), "adam": lambda: tf.keras.optimizers.Adam(0.001)}


def builds():
    """(name, build, data) of each model."""
    from picasso_tf.data import generate
    from tools.benchmarking.sections import Sizes, criteo_data, paper_schema, zoo_builder
    sizes = Sizes()
    schema = paper_schema("mmoe", 1.0, vocab=sizes.scaling_vocab, seq_len=sizes.alibaba_seq_len)
    data = generate(schema, BATCH, seed=0, zipf_exponent=sizes.zipf)
    yield "mmoe (94 fields)", zoo_builder("mmoe", schema, data, sizes, limit_feeders=True), data
    criteo = criteo_data(sizes, BATCH, sizes.zoo_max_buckets)
    for name in ("dlrm", "wide_deep"):
        yield f"criteo {name}", zoo_builder(name, criteo.schema, criteo, sizes), criteo


def compare(build, data, optimizer, rounds):
    import picasso_tf
    from tools.benchmarking.models import targets
    x = {k: tf.constant(v[:BATCH]) for k, v in data.features.items()}
    runs, ops = {}, {}
    for variant, on in (("off", False), ("on", True)):
        tf.keras.utils.set_random_seed(0)
        keras_model = build()
        y = tf.nest.map_structure(lambda t: tf.constant(t[:BATCH]), targets(keras_model, data.label_dict))
        model = picasso_tf.optimize(keras_model, example_inputs=x, fused_dense_optimizer=on)
        model.compile(optimizer=OPTIMIZERS[optimizer](), loss="binary_crossentropy")
        for _ in range(3):
            model.train_on_batch(x, y)
        runs[variant] = (lambda m=model, y=y: m.train_on_batch(x, y))
        ops[variant] = picasso_tf.profile(model, (x, y))["ops"]["step_picasso"]["total"]
    ratios, seconds = [], {"off": [], "on": []}
    for r in range(rounds):
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        times, _ = alternating({n: runs[n] for n in order}, rounds=1, steps=STEPS)
        ratios.append(times["off"] / times["on"])
        for n in order:
            seconds[n].append(times[n])
    return {n: float(np.median(t)) for n, t in seconds.items()}, ratios, ops


def update_alone(rounds):
    """(per-round ratios Keras / fused time per optimizer, number of variables)."""
    from picasso_tf.config import Config
    from picasso_tf.runtime.dense_update import make_dense_update
    name, build, _ = next(builds())
    shapes = [v.shape for v in build().trainable_variables if "embedding" not in v.name]
    rng = np.random.default_rng(0)
    grads = [tf.constant(rng.normal(size=s).astype("float32") * 0.01) for s in shapes]
    results = {}
    for optimizer in OPTIMIZERS:
        runs = {}
        for variant in ("keras", "fused"):
            variables = [tf.Variable(rng.normal(size=s).astype("float32")) for s in shapes]
            opt = OPTIMIZERS[optimizer]()
            opt.build(variables)
            if variant == "keras":
                step = tf.function(lambda o=opt, vs=variables: o.apply_gradients(zip(grads, vs)))
            else:
                update, _ = make_dense_update(opt, Config())
                step = tf.function(lambda o=opt, vs=variables, u=update: u.apply(o, list(zip(grads, vs))))
            step()
            runs[variant] = step
        ratios = []
        for r in range(rounds):
            order = ("keras", "fused") if r % 2 == 0 else ("fused", "keras")
            times, _ = alternating({n: runs[n] for n in order}, rounds=1, steps=50)
            ratios.append(times["keras"] / times["fused"])
        results[optimizer] = (ratios, times)
    return name, len(shapes), results


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 11
    tf.config.threading.set_inter_op_parallelism_threads(2)
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} cores, TensorFlow {tf.__version__}; batch {BATCH}, "
          f"{rounds} alternating rounds of {STEPS} steps; speedup = off / on step time per round")
    name, count, results = update_alone(rounds)
    for optimizer, (ratios, times) in results.items():
        print(f"  update alone, {name}'s {count} dense variables, {optimizer}: Keras {times['keras'] * 1e3:.2f} ms, "
              f"fused {times['fused'] * 1e3:.2f} ms (last round): speedup {np.median(ratios):.2f}x (rounds "
              f"{min(ratios):.2f}-{max(ratios):.2f})", flush=True)
    for name, build, data in builds():
        for optimizer in OPTIMIZERS:
            seconds, ratios, ops = compare(build, data, optimizer, rounds)
            print(f"  {name}, {optimizer}: off {BATCH / seconds['off']:,.0f} samples/s, on "
                  f"{BATCH / seconds['on']:,.0f}: speedup {np.median(ratios):.3f}x (rounds {min(ratios):.3f}-"
                  f"{max(ratios):.3f}); step ops {ops['off']:,} -> {ops['on']:,}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
