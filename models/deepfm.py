"""DeepFM (Guo et al., "DeepFM: A Factorization-Machine based Neural Network for CTR
Prediction", IJCAI 2017).

Every feature is a field with one k-dimensional embedding shared by the FM component
(first-order weights + pairwise <v_i, v_j> interactions) and the deep MLP. Sparse fields
use one `tf.keras.layers.Embedding` each; multi-hot fields (and behaviour sequences,
which DeepFM treats as bags) are mean-pooled with explicit masking arithmetic. A dense
feature is a field whose embedding is its value times a learned vector (Dense without bias).

FM needs one width for all fields, so the schema's per-feature dims are ignored
(embedding_dim for all). Paper defaults: MLP 400-400-400, dropout 0.5, k = 10. Scaled
for small data: MLP 64-32, k = 8, no dropout.
"""
import tensorflow as tf

from . import inputs as zin
from .blocks import MLP, SumLogits

TRAINING = dict(optimizer="adam", learning_rate=0.002, epochs=2, batch_size=512)
META = dict(paper="Guo et al. 2017, DeepFM", needs=(),
            description="FM (1st + 2nd order) and MLP over shared field embeddings")


def _mean_bag(emb, ids):
    mask = tf.expand_dims(tf.cast(tf.not_equal(ids, 0), emb.dtype), -1)
    return tf.reduce_sum(emb * mask, axis=1) / tf.maximum(tf.reduce_sum(mask, axis=1), 1.0)


def field_embeddings(schema, inputs, k, prefix):
    """One [B, k] vector per field (order: dense, categorical, sequences)."""
    fields = []
    for f in schema.dense:
        x = inputs[f.name]
        if f.dim == 1:
            x = tf.keras.layers.Reshape((1,))(x)
        fields.append(tf.keras.layers.Dense(k, use_bias=False, name=f"{prefix}_{f.name}")(x))
    for f in schema.categorical:
        fields.append(tf.keras.layers.Embedding(f.vocab_size, k, name=f"{prefix}_{f.name}")(inputs[f.name]))
    for f in schema.sequences:
        ids = inputs[f.name]
        emb = tf.keras.layers.Embedding(f.vocab_size, k, name=f"{prefix}_{f.name}")(ids)
        fields.append(_mean_bag(emb, ids))
    return fields


def build_deepfm(schema, embedding_dim=8, hidden=(64, 32), dropout=0.0):
    inputs = schema.keras_inputs()
    first = field_embeddings(schema, inputs, 1, "w")                     # first order
    fields = field_embeddings(schema, inputs, embedding_dim, "v")        # shared by FM and DNN
    v = tf.stack(fields, axis=1)                                         # [B, F, k]

    # FM second order: 0.5 * sum_k ((sum_i v_i)^2 - sum_i v_i^2)
    square_of_sum = tf.square(tf.reduce_sum(v, axis=1))
    sum_of_square = tf.reduce_sum(tf.square(v), axis=1)
    fm = 0.5 * tf.reduce_sum(square_of_sum - sum_of_square, axis=1, keepdims=True)

    deep = MLP(hidden, dropout=dropout, name="dnn")(tf.keras.layers.Flatten()(v))
    deep_logit = tf.keras.layers.Dense(1, name="dnn_logit")(deep)
    logit = SumLogits(name="deepfm_logit")(first + [fm, deep_logit])
    return tf.keras.Model(inputs, zin.sigmoid_output(logit, schema), name="deepfm")
