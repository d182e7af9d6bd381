"""LR: logistic regression over all features (optionally LS-PLM's piece-wise form).

PICASSO's Table VII lists "LR [35]", citing Gai et al., "Learning Piece-wise Linear
Models from Large Scale Data for Ad Click Prediction" (LS-PLM / MLR, 2017). With
pieces=1 (the default) this is plain logistic regression; pieces=m > 1 gives LS-PLM:
p(y|x) = sum_i softmax_i(u_i . x) * sigmoid(w_i . x) (the paper uses m = 12).

Embedding style: one `tf.keras.layers.Embedding(vocab, pieces)` per sparse feature
holding its weights (an "embedding" of width 1 is a linear weight); multi-hot fields
are summed with an explicit `tf.reduce_sum(emb * mask, axis=1)`. Dense features go
through a Dense(pieces) layer. Behaviour sequences are treated as multi-hot bags.
"""
import tensorflow as tf

from . import inputs as zin
from .blocks import SumLogits

TRAINING = dict(optimizer="adam", learning_rate=0.01, epochs=5, batch_size=512)
META = dict(paper="Gai et al. 2017, LS-PLM (cited as LR [35] in PICASSO Table VII)",
            needs=(), description="logistic regression (pieces=1) / LS-PLM (pieces>1)")


def _linear_terms(schema, inputs, width, prefix):
    terms = []
    for f in schema.categorical:
        emb = tf.keras.layers.Embedding(f.vocab_size, width, name=f"{prefix}_{f.name}")
        terms.append(emb(inputs[f.name]))                                   # [B, width]
    for f in schema.sequences:
        ids = inputs[f.name]
        emb = tf.keras.layers.Embedding(f.vocab_size, width, name=f"{prefix}_{f.name}")(ids)
        mask = tf.expand_dims(tf.cast(tf.not_equal(ids, 0), tf.float32), -1)
        terms.append(tf.reduce_sum(emb * mask, axis=1))                     # sum combiner
    dense = zin.dense_block(schema, inputs, name=f"{prefix}_dense_concat")
    if dense is not None:
        terms.append(tf.keras.layers.Dense(width, use_bias=False, name=f"{prefix}_dense")(dense))
    return terms


def build_lr(schema, pieces=1):
    """Logistic regression (pieces=1) or LS-PLM with `pieces` regions; output [B, 1]."""
    inputs = schema.keras_inputs()
    if pieces == 1:
        logit = SumLogits(name="lr_logit")(_linear_terms(schema, inputs, 1, "w"))
        out = zin.sigmoid_output(logit, schema)
    else:
        w = SumLogits(name="piece_logits")(_linear_terms(schema, inputs, pieces, "w"))
        u = SumLogits(name="region_logits")(_linear_terms(schema, inputs, pieces, "u"))
        p = tf.reduce_sum(tf.nn.softmax(u, axis=-1) * tf.sigmoid(w), axis=-1, keepdims=True)
        out = tf.keras.layers.Activation("linear", name=schema.labels[0])(p)
    return tf.keras.Model(inputs, out, name="lr" if pieces == 1 else "ls_plm")
