"""Checkpoints, .keras files and a serving export of a wrapped model.

A wrapped model's checkpoints are the plain model's (the same variables under the same
names, optimizer slots included), so a checkpoint restores into the model as written,
without picasso_tf's rewrite. model.picasso.export writes a SavedModel of the original
model that stock TensorFlow serves: examples/serve_export.py loads it without
importing picasso_tf. See docs/checkpoints-and-serving.md.

    python examples/save_restore_serve.py [--out runs/serving]
"""
import argparse
import os
import subprocess
import sys

import numpy as np
import tensorflow as tf

import picasso_tf
import picasso_tf.models as zoo
from picasso_tf.data import generate, wide_schema

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="runs/serving")
out = parser.parse_args().out

tf.keras.utils.set_random_seed(0)
schema = wide_schema(num_fields=8, vocab_size=500)
train, test = generate(schema, 2048, seed=0).split(0.25)
model = picasso_tf.optimize(zoo.get("deepfm")(schema))
model.compile(optimizer="adam", loss="binary_crossentropy")
model.fit(train.dataset(128), epochs=2, verbose=0)
expected = model.predict(test.features, verbose=0)

# 1. A checkpoint restores into the plain model: no picasso_tf in the way.
model.save_weights(os.path.join(out, "ckpt", "weights"))
plain = zoo.get("deepfm")(schema)
plain.load_weights(os.path.join(out, "ckpt", "weights")).expect_partial()   # the optimizer's slots are left
print("plain model restored from the checkpoint, same predictions:",
      np.allclose(plain.predict(test.features, verbose=0), expected, atol=1e-6))

# 2. A .keras file loads back as a wrapped model, optimizer state included.
model.save(os.path.join(out, "model.keras"))
loaded = tf.keras.models.load_model(os.path.join(out, "model.keras"))
print(f"loaded {type(loaded).__name__} from model.keras, same predictions:",
      np.allclose(loaded.predict(test.features, verbose=0), expected, atol=1e-6))

# 3. Export for serving, and serve it in a process that never imports picasso_tf.
model.picasso.export(os.path.join(out, "export"))
np.savez(os.path.join(out, "batch.npz"), expected=expected, **test.features)
serve = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_export.py")
subprocess.run([sys.executable, serve, os.path.join(out, "export"), os.path.join(out, "batch.npz")], check=True)
