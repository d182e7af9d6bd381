"""Peak memory of a training step over K micro-batches (D-interleaving).

    python benchmarks/micro_batch_memory.py [batch] [--models wide_deep,dlrm,can,mmoe] [--ks 2,4,8]
                                            [--starts embedding,mlp,auto] [--tensors]

batch: default 65536. For the zoo's wide_deep, dlrm, can and mmoe on criteo-like data
(picasso_tf.data.synthetic), K=1 and each K of --ks from each start of --starts (the
embedding layer, Fig. 8b; the MLP, Fig. 8a), each in a fresh process: build,
picasso_tf.optimize(micro_batches=K), compile (Adagrad); train a small step (the
optimizer's slots) and one of `batch` examples (the trace); then measure PEAK_STEPS
steps and print the median and the min-max:

- by default, each step's peak RSS (VmHWM) above the RSS before it, under PEAK_ENV;
- with --tensors, the bytes of the tensors the step made that are alive at its peak,
  from TensorFlow's memory profiler (TENSORS_ENV: oneDNN's CPU allocator, which keeps
  the statistics), the batch given as tensors made before the step. A diagnostic of
  which large tensors are alive at the peak: the profile does not see allocations
  under 256 KiB (oneDNN's allocator serves them from a pool of its own), so it
  undercounts, and more so at large K, whose micro-batches' tensors are smaller.

Beside K=1's, the activation bytes that micro_batches="auto" plans with (the forward
pass's tensors on the batch, runtime.micro_batch_planner.activation_bytes). Speed is not
timed here (benchmarks/interleaving_sweep.py times it).

The start "auto" is micro_batches="auto" (from the embedding), whose micro-batches run
one at a time, each with its own lookups' backward (runtime/micro_batches.py): the
memory mode. Its budget is K=1's planned activation bytes over K, so Eq. 2 picks that
K; the row prints the K it picked.
"""
import argparse
import json
import os
import subprocess
import sys

# TensorFlow's default CPU allocator (oneDNN's keeps what it frees) over glibc malloc
# with a fixed mmap threshold: every tensor above 64 KiB is mapped when allocated and
# unmapped when freed, so RSS follows the live tensors. With glibc's adaptive
# threshold, freed blocks of up to 32 MiB stay in the heap, and the same step's RSS
# growth read from 0.03x to 1.5x of its peak at K=1 from one process to the next.
PEAK_ENV = {"TF_ENABLE_ONEDNN_OPTS": "0", "MALLOC_MMAP_THRESHOLD_": "65536"}
# TensorFlow's CPU allocator keeps no statistics without oneDNN's.
TENSORS_ENV = {"TF_ENABLE_ONEDNN_OPTS": "1"}
PEAK_STEPS = 3

CHILD = r"""
import json, sys
import tensorflow as tf
import picasso_tf
import picasso_tf.models as zoo
from picasso_tf.data import synthetic
from picasso_tf.runtime.micro_batch_planner import activation_bytes
name, k, start, batch, steps, budget, tensors = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[7]), sys.argv[8] == "tensors"
schema = synthetic.preset_schema("criteo", max_buckets=100_000)
data = synthetic.generate(schema, batch, seed=1)
x, y = data.features, data.label_dict
if tensors:             # made before the steps, so that they are not the steps' tensors
    x, y = tf.nest.map_structure(tf.constant, (x, y))
if start == "auto":     # Eq. 2 picks K from the budget, measured on this batch
    model = picasso_tf.optimize(zoo.build(name, schema), micro_batches="auto", micro_batch_memory_budget=budget,
                                warmup_data=tf.data.Dataset.from_tensors((x, y)))
else:
    model = picasso_tf.optimize(zoo.build(name, schema), micro_batches=k, interleave_from=start)
model.compile(optimizer=tf.keras.optimizers.Adagrad(0.01), loss="binary_crossentropy")
small = synthetic.generate(schema, 64, seed=2)
model.train_on_batch(small.features, small.label_dict)      # the optimizer's slots, made once
model.train_on_batch(x, y)                                  # traced for this batch size
activations = activation_bytes(model.rewritten_forward(), x) if k == 1 else None
sys.path.insert(0, sys.argv[6])
from micro_batch_memory import step_peaks, tensor_peaks
peaks = (tensor_peaks if tensors else step_peaks)(model, x, y, steps)
chosen = next(p for p in model.picasso.reports["training"]["passes"] if p["pass"] == "k_interleave")
chosen = chosen["micro_batches"]["chosen"] if start == "auto" else k
print(json.dumps({"peak": sorted(peaks)[len(peaks) // 2], "peaks": peaks, "activations": activations,
                  "k": chosen}))
"""

MODELS = ("wide_deep", "dlrm", "can", "mmoe")


def step_peaks(model, x, y, steps=PEAK_STEPS):
    """Each of `steps` training steps' peak RSS above the RSS before it."""
    def status(key):
        return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
    peaks = []
    for _ in range(steps):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                                    # VmHWM := VmRSS
        before = status("VmRSS")
        model.train_on_batch(x, y)
        peaks.append(status("VmHWM") - before)
    return peaks


def tensor_peaks(model, x, y, steps=PEAK_STEPS):
    """Each of `steps` training steps' bytes of tensors alive at its peak, from
    TensorFlow's memory profiler: the allocations made while the step was traced and
    still alive at the peak of the CPU allocator's use (those of 256 KiB and more: see
    the module docstring)."""
    import glob
    import shutil
    import tempfile

    import tensorflow as tf
    from tensorflow.python.profiler.internal import _pywrap_profiler   # TF's own converter
    peaks = []
    for _ in range(steps):
        trace = tempfile.mkdtemp(prefix="picasso_memory_")
        try:
            tf.profiler.experimental.start(trace)
            model.train_on_batch(x, y)
            tf.profiler.experimental.stop()
            raw, ok = _pywrap_profiler.xspace_to_tools_data(
                sorted(glob.glob(f"{trace}/**/*.xplane.pb", recursive=True))[-1:], "memory_profile", {})
        finally:
            shutil.rmtree(trace, ignore_errors=True)
        if not ok:
            raise RuntimeError(f"TensorFlow's profiler gave no memory profile: {raw[:200]!r}")
        [cpu] = json.loads(raw)["memoryProfilePerAllocator"].values()
        snapshots = cpu["memoryProfileSnapshots"]
        peaks.append(sum(int(snapshots[int(a["snapshotIndex"])]["activityMetadata"]["allocationBytes"])
                         * int(a.get("numOccurrences", 1))
                         for a in cpu["activeAllocations"] if int(a["snapshotIndex"]) >= 0))
    return peaks


def run(name, k, start, batch, budget=0, tensors=False):
    """{"peak": the median step's peak RSS above the RSS before it, "peaks": each step's,
    "activations": the planner's activation bytes of the whole batch (K=1 only), "k":
    the micro-batches it ran}, from a fresh process; with `tensors`, "peak" is the
    step's tensors alive at its peak (tensor_peaks). budget: micro_batch_memory_budget
    for start "auto"."""
    out = subprocess.run([sys.executable, "-c", CHILD, name, str(k), start, str(batch), str(PEAK_STEPS),
                          os.path.dirname(os.path.abspath(__file__)), str(budget), "tensors" if tensors else "rss"],
                         capture_output=True, text=True,
                         env=dict(os.environ, **(TENSORS_ENV if tensors else PEAK_ENV)))
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(batch=65536, models=MODELS, ks=(2, 4, 8), starts=("embedding", "mlp", "auto"), tensors=False):
    print(f"batch {batch}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; command: python {' '.join(sys.argv)}")
    what = "tensors at peak GiB" if tensors else "step peak GiB"
    print(f"{'model':<10} {'K':>2} {'from':<10} {what:>14} {'x of K=1':>9} {'(min-max)':>11} "
          f"{'planned activations GiB':>24}")
    for name in models:
        first = None
        for k, start in [(1, "embedding")] + [(k, s) for s in starts for k in ks]:
            # Eq. 2 on K=1's activations: micro-batches of batch / k samples, half a sample to spare
            budget = (first["activations"] * (2 * batch // k + 1)) // (2 * batch) if start == "auto" else 0
            r = run(name, k, start, batch, budget, tensors)
            first = first or r
            planned = f"{r['activations'] / 2**30:.3f}" if r["activations"] is not None else ""
            spread = f"{min(r['peaks']) / 2**30:.3f}-{max(r['peaks']) / 2**30:.3f}"
            print(f"{name:<10} {r['k']:>2} {start:<10} {r['peak'] / 2**30:>14.3f} {r['peak'] / first['peak']:>9.2f} "
                  f"{spread:>11} {planned:>24}", flush=True)


def _names(text, known, what):
    names = tuple(text.split(","))
    if set(names) - set(known):
        raise argparse.ArgumentTypeError(f"unknown {what} {sorted(set(names) - set(known))}; choose from "
                                         f"{', '.join(known)}")
    return names


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Peak memory of a step over K micro-batches")
    parser.add_argument("batch", nargs="?", type=int, default=65536)
    parser.add_argument("--models", type=lambda t: _names(t, MODELS, "models"), default=MODELS)
    parser.add_argument("--ks", type=lambda t: tuple(int(a) for a in t.split(",")), default=(2, 4, 8),
                        help="the K > 1 to measure beside K=1 (default 2,4,8)")
    parser.add_argument("--starts", type=lambda t: _names(t, ("embedding", "mlp", "auto"), "starts"),
                        default=("embedding", "mlp", "auto"),
                        help="where the micro-batches start, or auto (default all three)")
    parser.add_argument("--tensors", action="store_true",
                        help="the step's tensors alive at its peak (TensorFlow's memory profiler), not RSS")
    args = parser.parse_args()
    main(args.batch, args.models, args.ks, args.starts, args.tensors)
