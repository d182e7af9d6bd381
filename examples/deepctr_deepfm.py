"""A DeepCTR DeepFM (a model written by others) on the bundled Criteo sample, plain and
wrapped, from the same weights: both print the same losses.

DeepCTR regularises every table and nests its embeddings in its own layers; picasso_tf
recognises them from the graph alone, so the model is used exactly as DeepCTR builds it.

    python examples/deepctr_deepfm.py
"""
import numpy as np
from deepctr.feature_column import DenseFeat, SparseFeat
from deepctr.models import DeepFM

import picasso_tf
from picasso_tf.data import load_criteo_sample

data = load_criteo_sample(buckets=100)
x = {name: column / max(column.max(), 1) if name.startswith("I") else column      # dense I1..I13 to [0, 1]
     for name, column in data.features.items()}
columns = ([SparseFeat(f.name, f.vocab_size, embedding_dim=4) for f in data.schema.categorical]
           + [DenseFeat(f.name, 1) for f in data.schema.dense])

plain = DeepFM(columns, columns, dnn_hidden_units=(32, 16), seed=1)
wrapped = DeepFM(columns, columns, dnn_hidden_units=(32, 16), seed=1)
wrapped.set_weights(plain.get_weights())
wrapped = picasso_tf.optimize(wrapped)

for name, model in (("plain", plain), ("picasso_tf", wrapped)):
    model.compile(optimizer="adam", loss="binary_crossentropy")
    history = model.fit(x, data.labels, batch_size=32, epochs=2, shuffle=False, verbose=0)
    print(f"{name:>10} loss per epoch: {np.round(history.history['loss'], 5)}")

analysis = wrapped.picasso.reports["training"]["analysis"]
print(f"embedding sites recognised: {len(analysis['sites'])}, left alone: {len(analysis['left_alone'])}")
