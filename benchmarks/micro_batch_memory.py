"""Peak memory of a training step over K micro-batches (D-interleaving).

    python benchmarks/micro_batch_memory.py [batch]          # default 65536

For the zoo's wide_deep, dlrm, can and mmoe on criteo-like data
(picasso_tf.data.synthetic), K in 1, 2, 4, 8 from the embedding layer and 2, 4, 8 from
the MLP, each in a fresh process: build, picasso_tf.optimize(micro_batches=K), compile
(Adagrad); train a small step (the optimizer's slots) and one of `batch` examples (the
trace); reset the peak; the step's memory is the peak RSS (VmHWM) of a further step
above the RSS before it, with TensorFlow's default CPU allocator (oneDNN off). Beside
it, the activation bytes that micro_batches="auto" plans with (the forward pass's
tensors on the batch, runtime.micro_batch_planner.activation_bytes). Speed is not
timed here (benchmarks/interleaving_sweep.py times it).
"""
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys
import tensorflow as tf
import picasso_tf
import picasso_tf.models as zoo
from picasso_tf.data import synthetic
from picasso_tf.runtime.micro_batch_planner import activation_bytes
name, k, start, batch = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
schema = synthetic.preset_schema("criteo", max_buckets=100_000)
data = synthetic.generate(schema, batch, seed=1)
x, y = data.features, data.label_dict
model = picasso_tf.optimize(zoo.build(name, schema), micro_batches=k, interleave_from=start)
model.compile(optimizer=tf.keras.optimizers.Adagrad(0.01), loss="binary_crossentropy")
small = synthetic.generate(schema, 64, seed=2)
model.train_on_batch(small.features, small.label_dict)      # the optimizer's slots, made once
model.train_on_batch(x, y)                                  # traced for this batch size
activations = activation_bytes(model.rewritten_forward(), x) if k == 1 else None
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                                            # VmHWM := VmRSS
before = status("VmRSS")
model.train_on_batch(x, y)
print(json.dumps({"peak": status("VmHWM") - before, "activations": activations}))
"""

MODELS = ("wide_deep", "dlrm", "can", "mmoe")
SETTINGS = ((1, "embedding"), (2, "embedding"), (4, "embedding"), (8, "embedding"), (2, "mlp"), (4, "mlp"),
            (8, "mlp"))


def run(name, k, start, batch):
    """{"peak": the step's peak RSS above the RSS before it, "activations": the planner's
    activation bytes of the whole batch (K=1 only)}, from a fresh process."""
    # TensorFlow's oneDNN CPU allocator keeps what it freed, so the peak of a later step
    # would read zero; the default allocator returns it, and the peak is the step's own.
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0")
    out = subprocess.run([sys.executable, "-c", CHILD, name, str(k), start, str(batch)], capture_output=True,
                         text=True, env=env)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(batch=65536):
    print(f"batch {batch}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; command: python {' '.join(sys.argv)}")
    print(f"{'model':<10} {'K':>2} {'from':<10} {'step peak GiB':>14} {'x of K=1':>9} {'planned activations GiB':>24}")
    for name in MODELS:
        first = None
        for k, start in SETTINGS:
            r = run(name, k, start, batch)
            first = first or r
            planned = f"{r['activations'] / 2**30:.3f}" if r["activations"] is not None else ""
            print(f"{name:<10} {k:>2} {start:<10} {r['peak'] / 2**30:>14.3f} {r['peak'] / first['peak']:>9.2f} "
                  f"{planned:>24}", flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
