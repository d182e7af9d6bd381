"""Custom-loop training (issue 37's benchmark): samples/s of a tf.GradientTape loop on
the zoo's W&D and DLRM (criteo-like data), four ways, all from the same weights and
batches:

  plain loop      the plain Keras model, tape + optimizer.apply_gradients
  picasso loop    the wrapped model, tape + optimizer.apply_gradients (Keras' updates)
  picasso apply   the wrapped model, tape + model.picasso.apply_gradients (fused updates)
  picasso fused   the same, tape.gradient inside model.picasso.fused_gradients (the tables
                  updated inside their gradient kernels, as fit's step does)
  picasso fit     the wrapped model's fit

    python benchmarks/custom_loops.py [--models wide_deep,dlrm] [--batch 4096] [--rounds 5] [--window 1.0]

Each loop is a tf.function step over an in-memory dataset of pre-built batches. The
variants take turns, round by round (the first rotating), each timing a window of at
least --window seconds (steps fixed per variant at warm-up); the figure per variant
is the median over rounds, and each ratio is taken round by round against the plain
loop, then its median (min-max) reported.
"""
import argparse
import contextlib
import os
import platform
import statistics
import sys
import time

import tensorflow as tf

import picasso_tf
import picasso_tf.models as zoo
from picasso_tf.tools.benchmarking import models as bm
from picasso_tf.tools.benchmarking import sections as bench_sections
from picasso_tf.tools.benchmarking.timing import in_memory_dataset, step_times


def loop(model, optimizer, dataset, apply="keras"):
    """A function running `steps` steps of the tape loop (the step a tf.function);
    apply: "keras" (optimizer.apply_gradients), "picasso" (model.picasso.apply_gradients)
    or "fused" (that, with tape.gradient inside model.picasso.fused_gradients)."""
    loss_fn = tf.keras.losses.BinaryCrossentropy()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            if model.losses:
                loss += tf.add_n(model.losses)
        with model.picasso.fused_gradients(optimizer) if apply == "fused" else contextlib.nullcontext():
            grads = tape.gradient(loss, model.trainable_variables)
        if apply == "keras":
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        else:
            model.picasso.apply_gradients(optimizer, zip(grads, model.trainable_variables))
        return loss

    batches = iter(dataset)

    def run(steps):
        start = time.perf_counter()
        for _ in range(steps):
            loss = step(*next(batches))
        float(loss)
        return steps, time.perf_counter() - start
    return run


def fit(model, optimizer, dataset):
    """As loop(), with fit: timed from the end of its first step to the end of its last
    (fit's own set-up left out, as picasso-bench times it)."""
    model.compile(optimizer=optimizer, loss="binary_crossentropy")

    def run(steps):
        intervals = step_times(model, dataset, steps + 1)
        return len(intervals), sum(intervals)
    return run


def variants(name, data, batch):
    build = lambda: zoo.build(name, data.schema)
    tf.keras.utils.set_random_seed(0)
    plain = build()
    weights = plain.get_weights()
    dataset = in_memory_dataset(bm.batches(data, plain, batch, 4))
    out = {"plain loop": loop(plain, tf.keras.optimizers.Adagrad(0.01), dataset)}
    for variant, apply in (("picasso loop", "keras"), ("picasso apply", "picasso"), ("picasso fused", "fused"),
                           ("picasso fit", None)):
        copy = build()
        copy.set_weights(weights)
        wrapped = picasso_tf.optimize(copy)
        optimizer = tf.keras.optimizers.Adagrad(0.01)
        out[variant] = fit(wrapped, optimizer, dataset) if apply is None else loop(wrapped, optimizer, dataset, apply)
    return out


def measure(runs, rounds, window):
    """{variant: [samples/s per round]} timing windows of >= `window` s."""
    steps = {}
    for name, run in runs.items():
        run(3)                                 # trace and warm up
        timed, seconds = run(5)
        steps[name] = max(5, int(window / (seconds / timed)))
    per_round = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            timed, seconds = runs[name](steps[name])
            per_round[name].append(timed / seconds)
    return per_round, steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="wide_deep,dlrm")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=float, default=1.0, help="seconds per variant and round")
    args = parser.parse_args()
    print(f"batch {args.batch}; {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
          f"load {os.getloadavg()[0]:.2f}; command: python {' '.join(sys.argv)}")
    print(f"{'model':<10} {'variant':<14} {'steps':>5} {'samples/s':>10} {'vs plain loop':>14} {'(min-max)':>11} "
          f"{'vs fit':>7}")
    for name in args.models.split(","):
        data = bench_sections.criteo_data(bench_sections.MODES["full"], args.batch * 4, max_buckets=100_000)
        per_round, steps = measure(variants(name, data, args.batch), args.rounds, args.window)
        for variant, rates in per_round.items():
            ratios = [a / b for a, b in zip(rates, per_round["plain loop"])]
            to_fit = statistics.median(a / b for a, b in zip(rates, per_round["picasso fit"]))
            print(f"{name:<10} {variant:<14} {steps[variant]:>5} {statistics.median(rates) * args.batch:>10,.0f} "
                  f"{statistics.median(ratios):>13.2f}x {min(ratios):>5.2f}-{max(ratios):<5.2f} {to_fit:>6.2f}x")
    print(f"load at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
