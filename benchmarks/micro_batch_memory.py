"""Peak memory of a training step over K micro-batches (D-interleaving).

    python benchmarks/micro_batch_memory.py [batch] [--models wide_deep,dlrm,can,mmoe] [--ks 2,4,8]
                                            [--starts embedding,mlp]

batch: default 65536. For the zoo's wide_deep, dlrm, can and mmoe on criteo-like data
(picasso_tf.data.synthetic), K=1 and each K of --ks from each start of --starts (the
embedding layer, Fig. 8b; the MLP, Fig. 8a), each in a fresh process: build,
picasso_tf.optimize(micro_batches=K), compile (Adagrad); train a small step (the
optimizer's slots) and one of `batch` examples (the trace); then, PEAK_STEPS times,
reset the peak and train a step: the step's memory is the median of their peak RSS
(VmHWM) above the RSS before them, under PEAK_ENV. Beside K=1's, the activation bytes
that micro_batches="auto" plans with (the forward pass's tensors on the batch,
runtime.micro_batch_planner.activation_bytes). Speed is not timed here
(benchmarks/interleaving_sweep.py times it).
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
PEAK_STEPS = 3

CHILD = r"""
import json, sys
import tensorflow as tf
import picasso_tf
import picasso_tf.models as zoo
from picasso_tf.data import synthetic
from picasso_tf.runtime.micro_batch_planner import activation_bytes
name, k, start, batch, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
schema = synthetic.preset_schema("criteo", max_buckets=100_000)
data = synthetic.generate(schema, batch, seed=1)
x, y = data.features, data.label_dict
model = picasso_tf.optimize(zoo.build(name, schema), micro_batches=k, interleave_from=start)
model.compile(optimizer=tf.keras.optimizers.Adagrad(0.01), loss="binary_crossentropy")
small = synthetic.generate(schema, 64, seed=2)
model.train_on_batch(small.features, small.label_dict)      # the optimizer's slots, made once
model.train_on_batch(x, y)                                  # traced for this batch size
activations = activation_bytes(model.rewritten_forward(), x) if k == 1 else None
sys.path.insert(0, sys.argv[6])
from micro_batch_memory import step_peaks
peaks = step_peaks(model, x, y, steps)
print(json.dumps({"peak": sorted(peaks)[len(peaks) // 2], "peaks": peaks, "activations": activations}))
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


def run(name, k, start, batch):
    """{"peak": the median step's peak RSS above the RSS before it, "peaks": each step's,
    "activations": the planner's activation bytes of the whole batch (K=1 only)}, from
    a fresh process."""
    out = subprocess.run([sys.executable, "-c", CHILD, name, str(k), start, str(batch), str(PEAK_STEPS),
                          os.path.dirname(os.path.abspath(__file__))],
                         capture_output=True, text=True, env=dict(os.environ, **PEAK_ENV))
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(batch=65536, models=MODELS, ks=(2, 4, 8), starts=("embedding", "mlp")):
    print(f"batch {batch}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; command: python {' '.join(sys.argv)}")
    print(f"{'model':<10} {'K':>2} {'from':<10} {'step peak GiB':>14} {'x of K=1':>9} {'(min-max)':>11} "
          f"{'planned activations GiB':>24}")
    for name in models:
        first = None
        for k, start in [(1, "embedding")] + [(k, s) for s in starts for k in ks]:
            r = run(name, k, start, batch)
            first = first or r
            planned = f"{r['activations'] / 2**30:.3f}" if r["activations"] is not None else ""
            spread = f"{min(r['peaks']) / 2**30:.3f}-{max(r['peaks']) / 2**30:.3f}"
            print(f"{name:<10} {k:>2} {start:<10} {r['peak'] / 2**30:>14.3f} {r['peak'] / first['peak']:>9.2f} "
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
    parser.add_argument("--starts", type=lambda t: _names(t, ("embedding", "mlp"), "starts"),
                        default=("embedding", "mlp"), help="where the micro-batches start (default both)")
    args = parser.parse_args()
    main(args.batch, args.models, args.ks, args.starts)
