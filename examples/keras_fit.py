"""A Keras functional Wide & Deep on the bundled Criteo sample, trained with fit.

The model is plain Keras; picasso_tf.optimize is the only change. The report says
what was rewritten (docs/how-it-works.md).

    python examples/keras_fit.py
"""
import tensorflow as tf

import picasso_tf
from picasso_tf.data import load_criteo_sample


def build_model(schema):
    inputs = schema.keras_inputs()                      # one tf.keras.Input per column
    deep, wide = [], []
    for f in schema.categorical:
        deep.append(tf.keras.layers.Embedding(f.vocab_size, 8, name=f"emb_{f.name}")(inputs[f.name]))
        wide.append(tf.keras.layers.Embedding(f.vocab_size, 1, name=f"wide_{f.name}")(inputs[f.name]))
    dense = tf.keras.layers.Concatenate()([tf.reshape(inputs[f.name], (-1, 1)) for f in schema.dense])
    x = tf.keras.layers.Concatenate()(deep + [dense])
    x = tf.keras.layers.Dense(32, activation="relu")(x)
    logit = tf.keras.layers.Add()([tf.keras.layers.Dense(1)(x)] + wide)
    return tf.keras.Model(inputs, tf.keras.layers.Activation("sigmoid")(logit))


tf.keras.utils.set_random_seed(0)
data = load_criteo_sample(buckets=100)                   # 200 real rows, ids folded into 100 buckets
train, test = data.split(0.25)

model = picasso_tf.optimize(build_model(data.schema))   # the one line picasso_tf adds
model.compile(optimizer="adagrad", loss="binary_crossentropy", metrics=[tf.keras.metrics.AUC(name="auc")])
model.fit(train.dataset(32, shuffle=True), epochs=3, verbose=2)
print("test:", model.evaluate(test.dataset(64), verbose=0, return_dict=True))
print(model.picasso.report())
