"""What makes a whole fit call bimodal (issue 38, item 1): the time between a fit call's
last step and its return, with tf.data's autotuner on and off.

    python benchmarks/fit_tail.py [--calls 5] [--steps 20,100,500]

Two models, each fitted in calls of --steps steps, the autotuner on and off taking
turns on the same dataset: a plain Keras MLP (64 inputs, 256 units) on an in-memory
`from_tensor_slices` pipeline (shuffle, batch 1024, prefetch AUTOTUNE), with no
picasso_tf in it; and the packing benchmark's wide_lr (200 fields, batch 4096, Adagrad)
through picasso_tf on picasso_tf's own in-memory reader (TabularData.dataset,
shuffled), whose autotuner is off unless turned back on here. Per call: the steps'
time (fit's start to the end of its last batch) and the tail (the end of the last
batch to fit's return); printed per setting, the steps' median and every call's tail.
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np                                                   # noqa: E402
import tensorflow as tf                                              # noqa: E402

import picasso_tf                                                    # noqa: E402
from picasso_tf.tools.benchmarking import models as bm, sections as bench  # noqa: E402


class LastBatch(tf.keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        self.at = time.perf_counter()


def autotuner(dataset, enabled):
    options = tf.data.Options()
    options.autotune.enabled = enabled
    return dataset.with_options(options)


def plain_keras():
    rng = np.random.default_rng(0)
    x = rng.random((65536, 64), dtype=np.float32)
    y = (x.sum(1) > 32).astype(np.float32)
    model = tf.keras.Sequential([tf.keras.layers.Dense(256, activation="relu"), tf.keras.layers.Dense(1)])
    model.compile("adagrad", "mse")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(65536).batch(1024).repeat()
    return model, dataset.prefetch(tf.data.AUTOTUNE)


def picasso_wide_lr():
    sizes = bench.MODES["full"]
    data = bench.wide_data(sizes, 4096 * 16)
    tf.keras.utils.set_random_seed(0)
    model = picasso_tf.optimize(bm.build_wide_lr(data.schema))
    model.compile(optimizer=tf.keras.optimizers.Adagrad(0.01), loss="binary_crossentropy")
    return model, data.dataset(4096, shuffle=True, repeat=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--steps", default="20,100,500")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} at the start; command: python {' '.join(sys.argv)}")
    for name, make in (("plain Keras MLP", plain_keras), ("picasso_tf wide_lr", picasso_wide_lr)):
        model, dataset = make()
        model.fit(dataset, steps_per_epoch=5, verbose=0)
        for steps in map(int, args.steps.split(",")):
            seen = {True: ([], []), False: ([], [])}
            for _ in range(args.calls):
                for enabled in (True, False):
                    last = LastBatch()
                    start = time.perf_counter()
                    model.fit(autotuner(dataset, enabled), steps_per_epoch=steps, verbose=0, callbacks=[last])
                    seen[enabled][0].append((last.at - start) * 1e3)
                    seen[enabled][1].append((time.perf_counter() - last.at) * 1e3)
            for enabled, (step_ms, tail_ms) in seen.items():
                print(f"{name}, {steps} steps, autotuner {'on ' if enabled else 'off'}: steps "
                      f"{statistics.median(step_ms):,.0f} ms (median); after the last step, ms: "
                      + " ".join(f"{t:,.0f}" for t in tail_ms), flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
