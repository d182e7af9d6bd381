"""Serves a model.picasso.export directory with stock TensorFlow: no picasso_tf import,
no custom op. Used by examples/save_restore_serve.py.

    python examples/serve_export.py EXPORT_DIR BATCH.npz
"""
import sys

import numpy as np
import tensorflow as tf

export_dir, batch_file = sys.argv[1:]
serve = tf.saved_model.load(export_dir).signatures["serving_default"]
batch = dict(np.load(batch_file))
expected = batch.pop("expected")
(predictions,) = serve(**{name: tf.constant(value) for name, value in batch.items()}).values()
ops = {node.op for f in serve.graph.as_graph_def().library.function for node in f.node_def}
print("served with stock TensorFlow: picasso_tf imported:", any(m.startswith("picasso_tf") for m in sys.modules),
      "| Picasso ops:", sorted(op for op in ops if op.startswith("Picasso")),
      "| same predictions:", np.allclose(predictions.numpy(), expected, atol=1e-6))
