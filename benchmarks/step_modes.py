"""Why a step is bimodal (issue 38, item 1): wide_lr (the packing benchmark's 200-field
logistic regression, batch 4096, Adagrad, an in-memory dataset) timed per fit call of 32
steps, picasso_tf and plain Keras taking turns, and with --steps the step times of
picasso_tf's calls as percentiles and a histogram. Run it with TF_NUM_INTEROP_THREADS=1
beside the default to see what two inter-op threads cost.

    python benchmarks/step_modes.py [picasso,keras] [calls] [--steps]
"""
import os
import statistics
import sys

import tensorflow as tf

import picasso_tf
from picasso_tf.tools.benchmarking import sections as S, models as bm
from picasso_tf.tools.benchmarking.timing import in_memory_dataset, step_times
sizes = S.MODES["full"]
data = S.wide_data(sizes, 4096 * 4)
args = [a for a in sys.argv[1:] if a != "--steps"]
variants = args[0].split(",") if args else ["picasso", "keras"]
calls = int(args[1]) if len(args) > 1 else 8
models = {}
for v in variants:
    tf.keras.utils.set_random_seed(0)
    m = bm.build_wide_lr(data.schema)
    if v == "picasso":
        m = picasso_tf.optimize(m)
    m.compile(optimizer=tf.keras.optimizers.Adagrad(0.01), loss="binary_crossentropy")
    ds = in_memory_dataset(bm.batches(data, m if v != "picasso" else m.original, 4096, 4))
    models[v] = (m, ds)
    step_times(m, ds, 4)
rates = {v: [] for v in variants}
for c in range(calls):
    for v in variants:
        m, ds = models[v]
        t = step_times(m, ds, 33)
        rates[v].append(4096 / statistics.median(t))
for v in variants:
    print(v, " ".join(f"{r/1e3:.0f}k" for r in rates[v]), f"median {statistics.median(rates[v])/1e3:.0f}k samples/s")
if "--steps" in sys.argv and "picasso" in models:
    import numpy as np
    m, ds = models["picasso"]
    t = np.array([s for _ in range(6) for s in step_times(m, ds, 65)]) * 1e3
    print("picasso steps", len(t), "ms at percentiles 5/25/50/75/95/99:",
          np.percentile(t, [5, 25, 50, 75, 95, 99]).round(1))
    edges = [0, 11, 12, 13, 14, 15, 16, 18, 20, 23, 26, 30, 1000]
    print("histogram:", ", ".join(f"{a}-{b} ms: {n}" for a, b, n in zip(edges, edges[1:], np.histogram(t, edges)[0])))
print(f"load {os.getloadavg()[0]:.2f}; TF_NUM_INTEROP_THREADS={os.environ.get('TF_NUM_INTEROP_THREADS', 'default')}")
