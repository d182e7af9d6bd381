"""xDeepFM (Lian et al., "xDeepFM: Combining Explicit and Implicit Feature Interactions
for Recommender Systems", KDD 2018).

Linear part + CIN (Compressed Interaction Network: explicit vector-wise interactions,
X^k_h = sum_ij W^{k,h}_ij (X^{k-1}_i o X^0_j), sum-pooled over the embedding axis)
+ a plain DNN, all on the same field embeddings.

Embedding style: torchfm-like "one big table with field offsets": a custom
`OffsetEmbedding` layer holds a single add_weight table of sum(vocab) rows; each field's
ids are shifted by the field's offset and looked up with `tf.nn.embedding_lookup`.
Multi-hot fields (and behaviour sequences) are mean-pooled over non-padding ids.
CIN needs one width for all fields (embedding_dim; schema hints are ignored).
Paper (Criteo): D = 10, CIN layers of 200 feature maps, DNN 400-400. Scaled for small data:
D = 8, CIN 16-16, DNN 64-32.
"""
import numpy as np
import tensorflow as tf

from . import inputs as zin
from .blocks import MLP, SumLogits, serializable

TRAINING = dict(optimizer="adam", learning_rate=0.002, epochs=2, batch_size=512)
META = dict(paper="Lian et al. 2018, xDeepFM", needs=(),
            description="linear + CIN + DNN over one offset-indexed table")


@serializable
class OffsetEmbedding(tf.keras.layers.Layer):
    """One table for all fields; field i's id x is row offsets[i] + x.

    call(list of ids, one per field: [B] or [B, L]) -> [B, fields, dim].
    """

    def __init__(self, vocab_sizes, dim, **kwargs):
        super().__init__(**kwargs)
        self.vocab_sizes = [int(v) for v in vocab_sizes]
        self.dim = int(dim)
        self.offsets = [int(o) for o in np.concatenate([[0], np.cumsum(self.vocab_sizes)[:-1]])]

    def build(self, input_shape):
        self.table = self.add_weight(name="table", shape=(sum(self.vocab_sizes), self.dim),
                                     initializer=tf.keras.initializers.RandomNormal(stddev=0.01))
        super().build(input_shape)

    def call(self, ids_list):
        fields = []
        for offset, ids in zip(self.offsets, ids_list):
            emb = tf.nn.embedding_lookup(self.table, ids + offset)
            if ids.shape.rank == 2:
                mask = tf.cast(ids > 0, emb.dtype)[..., None]
                emb = tf.math.divide_no_nan(tf.reduce_sum(emb * mask, 1), tf.reduce_sum(mask, 1))
            fields.append(emb)
        return tf.stack(fields, axis=1)

    def get_config(self):
        return {**super().get_config(), "vocab_sizes": self.vocab_sizes, "dim": self.dim}


@serializable
class CIN(tf.keras.layers.Layer):
    """Compressed Interaction Network: [B, m, D] -> [B, sum(layer_sizes)]."""

    def __init__(self, layer_sizes=(16, 16), **kwargs):
        super().__init__(**kwargs)
        self.layer_sizes = [int(h) for h in layer_sizes]

    def build(self, input_shape):
        m = int(input_shape[1])
        prev = m
        self.kernels, self.biases = [], []
        for i, h in enumerate(self.layer_sizes):
            self.kernels.append(self.add_weight(name=f"w{i}", shape=(prev * m, h),
                                                initializer="glorot_uniform"))
            self.biases.append(self.add_weight(name=f"b{i}", shape=(h,), initializer="zeros"))
            prev = h
        super().build(input_shape)

    def call(self, x0):
        m, d = x0.shape[1], x0.shape[2]
        xk, pooled = x0, []
        for w, b in zip(self.kernels, self.biases):
            z = tf.einsum("bhd,bmd->bhmd", xk, x0)                      # outer product per dim
            z = tf.reshape(z, [-1, xk.shape[1] * m, d])
            xk = tf.nn.relu(tf.einsum("bnd,nh->bhd", z, w) + b[None, :, None])
            pooled.append(tf.reduce_sum(xk, axis=2))
        return tf.concat(pooled, axis=1)

    def get_config(self):
        return {**super().get_config(), "layer_sizes": self.layer_sizes}


def build_xdeepfm(schema, embedding_dim=8, cin_layers=(16, 16), hidden=(64, 32)):
    inputs = schema.keras_inputs()
    sparse = schema.categorical + schema.sequences
    dense = zin.dense_block(schema, inputs)
    fields = []
    if sparse:
        fields.append(OffsetEmbedding([f.vocab_size for f in sparse], embedding_dim, name="embedding")(
            [inputs[f.name] for f in sparse]))
        linear = OffsetEmbedding([f.vocab_size for f in sparse], 1, name="linear")(
            [inputs[f.name] for f in sparse])
        linear_logit = tf.reduce_sum(linear, axis=1)                     # [B, 1]
    if dense is not None:
        dense_field = tf.keras.layers.Dense(embedding_dim, use_bias=False, name="dense_field")(dense)
        fields.append(tf.keras.layers.Reshape((1, embedding_dim))(dense_field))
    v = fields[0] if len(fields) == 1 else tf.keras.layers.Concatenate(axis=1, name="fields")(fields)

    logits = [tf.keras.layers.Dense(1, name="cin_logit")(CIN(cin_layers, name="cin")(v)),
              tf.keras.layers.Dense(1, name="dnn_logit")(MLP(hidden, name="dnn")(tf.keras.layers.Flatten()(v)))]
    if sparse:
        logits.append(linear_logit)
    if dense is not None:
        logits.append(tf.keras.layers.Dense(1, use_bias=False, name="linear_dense")(dense))
    logit = SumLogits(name="xdeepfm_logit")(logits)
    return tf.keras.Model(inputs, zin.sigmoid_output(logit, schema), name="xdeepfm")
