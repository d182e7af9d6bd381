"""Wide & Deep (Cheng et al., "Wide & Deep Learning for Recommender Systems", DLRS 2016).

Wide part: a linear model over every sparse id plus hashed cross-product features
(`tf.keras.layers.HashedCrossing`) of chosen one-hot pairs. Deep part: per-feature
`Embedding` tables (width from the schema's embedding_dim hint, else `embedding_dim`),
multi-hot and behaviour sequences embedded with `mask_zero=True` and mean-pooled using
the Keras mask, dense features concatenated, then an MLP. Logits of both parts add up.

Paper defaults: deep 1024-512-256 ReLU, 32-d embeddings, wide trained with FTRL and deep
with AdaGrad. Scaled for small data: MLP 64-32, 8-d embeddings, one Adam optimizer.
crosses="auto" crosses each pair of the three smallest-vocabulary one-hot features
(hashed into cross_bins buckets); pass a list of name pairs, or () for none.
"""
import itertools

import tensorflow as tf

from . import inputs as zin
from .blocks import MLP, MaskedPooling, SumLogits

TRAINING = dict(optimizer="adam", learning_rate=0.002, epochs=2, batch_size=512)
META = dict(paper="Cheng et al. 2016, Wide & Deep Learning for Recommender Systems",
            needs=(), description="linear (with hashed crosses) + MLP on embeddings")


def _auto_crosses(schema, k=3):
    small = sorted(schema.categorical, key=lambda f: f.vocab_size)[:k]
    return list(itertools.combinations([f.name for f in small], 2))


def build_wide_deep(schema, embedding_dim=8, hidden=(64, 32), dropout=0.0, crosses="auto",
                    cross_bins=1000):
    inputs = schema.keras_inputs()
    if crosses == "auto":
        crosses = _auto_crosses(schema)

    # wide: one weight per id, plus crossed features
    wide = []
    for f in schema.categorical:
        wide.append(tf.keras.layers.Embedding(f.vocab_size, 1, name=f"wide_{f.name}")(inputs[f.name]))
    for f in schema.sequences:
        emb = tf.keras.layers.Embedding(f.vocab_size, 1, mask_zero=True, name=f"wide_{f.name}")
        wide.append(MaskedPooling("sum", name=f"wide_sum_{f.name}")(emb(inputs[f.name])))
    for a, b in crosses:
        crossed = tf.keras.layers.HashedCrossing(cross_bins, name=f"cross_{a}_x_{b}")(
            (inputs[a], inputs[b]))
        wide.append(tf.keras.layers.Embedding(cross_bins, 1, name=f"wide_{a}_x_{b}")(crossed))
    dense = zin.dense_block(schema, inputs)
    if dense is not None:
        wide.append(tf.keras.layers.Dense(1, use_bias=False, name="wide_dense")(dense))
    wide_logit = SumLogits(name="wide_logit")(wide)

    # deep: embeddings -> MLP
    deep = []
    for f in schema.categorical:
        emb = tf.keras.layers.Embedding(f.vocab_size, zin.dim_of(f, embedding_dim), name=f"emb_{f.name}")
        deep.append(emb(inputs[f.name]))
    for f in schema.sequences:
        emb = tf.keras.layers.Embedding(f.vocab_size, zin.dim_of(f, embedding_dim), mask_zero=True,
                                        name=f"emb_{f.name}")
        deep.append(MaskedPooling("mean", name=f"mean_{f.name}")(emb(inputs[f.name])))
    deep.append(dense)
    x = MLP(hidden, dropout=dropout, name="deep_mlp")(zin.concat(deep, "deep_concat"))
    deep_logit = tf.keras.layers.Dense(1, name="deep_logit")(x)

    logit = tf.keras.layers.Add(name="wide_plus_deep")([wide_logit, deep_logit])
    return tf.keras.Model(inputs, zin.sigmoid_output(logit, schema), name="wide_deep")
