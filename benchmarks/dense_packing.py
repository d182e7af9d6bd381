"""Dense packing (issue 24): what the pass gains on the models it packs, and why it
stands down on products that multiply each unit's own input by its own weights.

  python benchmarks/dense_packing.py            # both parts
  python benchmarks/dense_packing.py models     # MMoE and CAN, dense_packing on vs off
  python benchmarks/dense_packing.py products   # K products apart vs batched over stacked operands

models: the paper's MMoE (94 fields) and CAN (scaled to 0.2 of 364 fields, as
picasso-bench's ablation) layouts, batch 1024, Adagrad; samples/s of picasso_tf with
dense_packing=True and False, and the ratio taken round by round (the order of the
two alternates each round), plus the training step's op counts.

products: the forward and backward of K ReLU layers relu(x W_k), over one shared
input x or each over its own, written apart and batched as the pass batches them
(tf.vectorized_map over the stacked weights and, where they differ, inputs).
"""
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np            # noqa: E402
import tensorflow as tf       # noqa: E402

ROUNDS, STEPS = 7, 5


def alternating(runs, rounds=ROUNDS, steps=STEPS):
    """{name: median seconds per call} and {name: per-round ratio to the first run's
    time}, the order of the runs reversed every other round."""
    names = list(runs)
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            for _ in range(steps):
                runs[n]()
            times[n].append((time.perf_counter() - start) / steps)
    first = names[0]
    ratios = {n: float(np.median([a / b for a, b in zip(times[first], times[n])])) for n in names[1:]}
    return {n: float(np.median(t)) for n, t in times.items()}, ratios


def models(batch=1024):
    import picasso_tf
    from picasso_tf.data import generate
    from tools.benchmarking.models import targets
    from tools.benchmarking.sections import Sizes, paper_schema, zoo_builder
    sizes = Sizes()
    print(f"models: batch {batch}, Adagrad(0.01); speedup = dense_packing on / off (samples/s, per-round median)")
    for name, scale in (("mmoe", 1.0), ("can", 0.2)):
        schema = paper_schema(name, scale, vocab=sizes.scaling_vocab, seq_len=sizes.alibaba_seq_len)
        data = generate(schema, batch, seed=0, zipf_exponent=sizes.zipf)
        build = zoo_builder(name, schema, data, sizes, limit_feeders=True)
        x = {k: tf.constant(v) for k, v in data.features.items()}
        runs, packed, ops = {}, None, {}
        for variant, on in (("off", False), ("on", True)):
            tf.keras.utils.set_random_seed(0)
            keras_model = build()
            y = tf.nest.map_structure(tf.constant, targets(keras_model, data.label_dict))
            model = picasso_tf.optimize(keras_model, example_inputs=x, dense_packing=on)
            model.compile(optimizer=tf.keras.optimizers.Adagrad(0.01), loss="binary_crossentropy")
            model.train_on_batch(x, y)
            runs[variant] = (lambda m=model, y=y: m.train_on_batch(x, y))
            ops[variant] = picasso_tf.profile(model, (x, y))["ops"]["step_picasso"]["total"]
            if on:
                [report] = [p for p in model.picasso.reports["training"]["passes"] if p["pass"] == "dense_packing"]
                packed = report["packed"]
        seconds, ratios = alternating(runs)
        print(f"  {name} ({len(schema.categorical) + len(schema.sequences)} fields): off {batch / seconds['off']:,.0f}"
              f" samples/s, on {batch / seconds['on']:,.0f}: speedup {ratios['on']:.2f}x; step ops {ops['off']:,} -> "
              f"{ops['on']:,}; packed {len(packed)} groups of {[g['units'] for g in packed]} units")


def products(k=4, batch=1024, shapes=((64, 16), (64, 64), (256, 64), (512, 64), (2048, 64), (2048, 256))):
    print(f"products: K={k} ReLU layers x -> relu(x W_k), batch {batch}, forward + backward; speedup = apart / "
          "batched time (per-round median)")
    rng = np.random.default_rng(0)
    for width, units in shapes:
        weights = [tf.Variable(rng.normal(size=(width, units)).astype("float32") * 0.1) for _ in range(k)]
        own = [tf.constant(rng.normal(size=(batch, width)).astype("float32")) for _ in range(k)]

        def step(batched, inputs):
            with tf.GradientTape() as tape:
                if not batched:
                    outs = [tf.nn.relu(tf.matmul(x, w)) for x, w in zip(inputs, weights)]
                elif all(x is inputs[0] for x in inputs):
                    outs = tf.unstack(tf.vectorized_map(lambda w: tf.nn.relu(tf.matmul(inputs[0], w)),
                                                        tf.stack(weights)))
                else:
                    outs = tf.unstack(tf.vectorized_map(lambda a: tf.nn.relu(tf.matmul(a[0], a[1])),
                                                        [tf.stack(inputs), tf.stack(weights)]))
                loss = tf.add_n([tf.reduce_sum(o) for o in outs])
            return tape.gradient(loss, weights)

        for label, inputs in (("shared input", [own[0]] * k), ("own inputs", own)):
            runs = {"apart": tf.function(lambda i=inputs: step(False, i)),
                    "batched": tf.function(lambda i=inputs: step(True, i))}
            for f in runs.values():
                f()
            seconds, ratios = alternating(runs)
            print(f"  {width}->{units}, {label}: apart {seconds['apart'] * 1e3:.2f} ms, batched "
                  f"{seconds['batched'] * 1e3:.2f} ms: speedup {ratios['batched']:.2f}x")


if __name__ == "__main__":
    tf.config.threading.set_inter_op_parallelism_threads(2)
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    print(f"load average {os.getloadavg()[0]:.1f}, TensorFlow {tf.__version__}")
    if which in ("all", "products"):
        products()
    if which in ("all", "models"):
        models()
