"""Memory of a wrapped model: RSS above the plain model's, per byte of its tables.

    python benchmarks/table_memory.py [tables] [rows] [dim]      # default 8 1000000 32

Each configuration runs in a fresh process: build the plain model (tables x rows x dim
float32 embeddings, summed by a Dense layer), read RSS; then either train it 3 SGD
steps as it is (Keras) or picasso_tf.optimize it and train 0 or 3 steps; read RSS again.
Prints the growth over the plain model just built, in GiB and per GiB of tables, and
the wrapped model's growth above Keras' own.
TensorFlow's CPU allocator keeps what it freed, so RSS is the high-water mark: a
second copy of the tables, even a transient one, shows.
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
tables, rows, dim, wrapped, steps = (int(a) for a in sys.argv[1:6])
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
x = {f"f{i}": tf.keras.Input((), dtype="int64", name=f"f{i}") for i in range(tables)}
parts = [tf.keras.layers.Embedding(rows, dim, name=f"emb_{i}")(x[f"f{i}"]) for i in range(tables)]
model = tf.keras.Model(x, tf.keras.layers.Dense(1)(tf.keras.layers.Concatenate()(parts)))
before = rss()
if wrapped:
    model = picasso_tf.optimize(model)
model.compile(optimizer=tf.keras.optimizers.SGD(0.1), loss="mse")
rng = np.random.default_rng(0)
for _ in range(steps):
    model.train_on_batch({f"f{i}": rng.integers(0, rows, 256) for i in range(tables)}, np.ones(256, np.float32))
print(json.dumps({"growth": rss() - before}))
"""


def growth(tables, rows, dim, wrapped, steps):
    out = subprocess.run([sys.executable, "-c", CHILD, str(tables), str(rows), str(dim), str(int(wrapped)), str(steps)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["growth"]


def main(tables=8, rows=1_000_000, dim=32):
    table_bytes = tables * rows * dim * 4
    print(f"{tables} tables of {rows} x {dim} float32: {table_bytes / 2**30:.2f} GiB; "
          f"{os.cpu_count()} cores; command: python {' '.join(sys.argv)}")
    grown = {}
    runs = (("picasso_tf.optimize + compile, no step", True, 0), ("Keras, 3 SGD steps", False, 3),
            ("picasso_tf.optimize + 3 SGD steps", True, 3))
    for name, wrapped, steps in runs:
        grown[wrapped, steps] = g = growth(tables, rows, dim, wrapped, steps)
        print(f"  {name:<38} RSS +{g / 2**30:.2f} GiB above the plain model built "
              f"({g / table_bytes:.2f} GiB per GiB of tables)")
    # After a step both hold Keras SGD's "m" slot of every variable, tables included (Keras
    # creates it even with momentum 0, and the wrapped model's checkpoint is the plain one's).
    extra = grown[True, 3] - grown[False, 3]
    print(f"  picasso_tf above Keras: {extra / 2**30:+.2f} GiB ({extra / table_bytes:+.2f} GiB per GiB of tables)")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
