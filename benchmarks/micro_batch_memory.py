"""Peak memory of a training step over K micro-batches (D-interleaving).

    python benchmarks/micro_batch_memory.py [batch]          # default 65536

For the zoo's wide_deep and dlrm on criteo-like data (picasso_tf.data.synthetic) and K
in 1, 2, 4, 8, each in a fresh process: build, picasso_tf.optimize(micro_batches=K),
compile (Adagrad); train a small step (the optimizer's slots) and one of `batch`
examples (the trace); reset the peak; the step's memory is the peak RSS (VmHWM) of a
further step above the RSS before it, with TensorFlow's default CPU allocator (oneDNN
off). Speed is not timed here: a few steps in separate processes say nothing on this
shared machine (picasso-bench times interleaved).
"""
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys
import numpy as np
import tensorflow as tf
import picasso_tf
import picasso_tf.models as zoo
from picasso_tf.data import synthetic
name, k, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
schema = synthetic.preset_schema("criteo", max_buckets=100_000)
data = synthetic.generate(schema, batch, seed=1)
x, y = data.features, data.label_dict
model = picasso_tf.optimize(zoo.build(name, schema), micro_batches=k)
model.compile(optimizer=tf.keras.optimizers.Adagrad(0.01), loss="binary_crossentropy")
small = synthetic.generate(schema, 64, seed=2)
model.train_on_batch(small.features, small.label_dict)      # the optimizer's slots, made once
model.train_on_batch(x, y)                                  # traced for this batch size
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                                            # VmHWM := VmRSS
before = status("VmRSS")
model.train_on_batch(x, y)
print(json.dumps({"peak": status("VmHWM") - before}))
"""


def run(name, k, batch):
    # TensorFlow's oneDNN CPU allocator keeps what it freed, so the peak of a later step
    # would read zero; the default allocator returns it, and the peak is the step's own.
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0")
    out = subprocess.run([sys.executable, "-c", CHILD, name, str(k), str(batch)], capture_output=True, text=True,
                         env=env)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(batch=65536):
    print(f"batch {batch}; {os.cpu_count()} cores; command: python {' '.join(sys.argv)}")
    print(f"{'model':<10} {'K':>2} {'step peak GiB':>14} {'x of K=1':>9}")
    for name in ("wide_deep", "dlrm"):
        first = None
        for k in (1, 2, 4, 8):
            r = run(name, k, batch)
            first = first or r
            print(f"{name:<10} {k:>2} {r['peak'] / 2**30:>14.3f} {r['peak'] / first['peak']:>9.2f}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
