"""DLRM (Naumov et al., "Deep Learning Recommendation Model for Personalization and
Recommendation Systems", 2019; PICASSO cites Mudigere et al. [23] for it).

Dense features -> bottom MLP -> a d-vector; each sparse feature -> an EmbeddingBag of
width d (the PyTorch reference's `nn.EmbeddingBag(mode="sum")`); pairwise dot products
of all these vectors (strictly lower triangle) concatenated with the bottom output feed
the top MLP. When the schema has no dense features, the top MLP reads the embeddings
themselves in place of the bottom-MLP output.

Embedding style: a custom `EmbeddingBag` layer whose table is created with `add_weight`;
one-hot ids use `tf.nn.embedding_lookup`, multi-hot ids become a SparseTensor
(`tf.sparse.from_dense`, dropping padding 0) for `tf.nn.safe_embedding_lookup_sparse`
with combiner "sum". Paper's Criteo config: d = 16, bottom 512-256-64-16, top 512-256-1.
Scaled for small data: d = 16, bottom 64-16, top 64-32.
"""
import tensorflow as tf

from . import inputs as zin
from .blocks import MLP, serializable

TRAINING = dict(optimizer="adam", learning_rate=0.002, epochs=2, batch_size=512)
META = dict(paper="Naumov et al. 2019, DLRM", needs=(),
            description="bottom MLP + embedding bags, pairwise dot interactions, top MLP")


@serializable
class EmbeddingBag(tf.keras.layers.Layer):
    """A table (add_weight) looked up with tf.nn ops: [B] -> [B, d]; [B, L] -> pooled [B, d]."""

    def __init__(self, vocab_size, dim, combiner="sum", initializer="uniform", **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.dim, self.combiner = int(vocab_size), int(dim), combiner
        self.initializer = tf.keras.initializers.get(initializer)

    def build(self, input_shape):
        self.table = self.add_weight(name="table", shape=(self.vocab_size, self.dim),
                                     initializer=self.initializer, trainable=True)
        super().build(input_shape)

    def call(self, ids):
        if ids.shape.rank == 1:
            return tf.nn.embedding_lookup(self.table, ids)
        sparse_ids = tf.sparse.from_dense(ids)                    # drops the 0 padding
        return tf.nn.safe_embedding_lookup_sparse(self.table, sparse_ids, combiner=self.combiner)

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size, "dim": self.dim,
                "combiner": self.combiner,
                "initializer": tf.keras.initializers.serialize(self.initializer)}


@serializable
class DotInteraction(tf.keras.layers.Layer):
    """[B, F, d] -> the F(F-1)/2 pairwise dot products [B, F(F-1)/2] (lower triangle)."""

    def call(self, x):
        n = x.shape[1]
        z = tf.matmul(x, x, transpose_b=True)                          # [B, F, F]
        flat = tf.reshape(z, [-1, n * n])
        idx = [i * n + j for i in range(n) for j in range(i)]
        return tf.gather(flat, idx, axis=1)


def build_dlrm(schema, embedding_dim=16, bottom=(64,), top=(64, 32)):
    inputs = schema.keras_inputs()
    embs = []
    for f in schema.categorical + schema.sequences:
        bag = EmbeddingBag(f.vocab_size, embedding_dim, name=f"bag_{f.name}",
                           initializer=tf.keras.initializers.RandomUniform(-0.05, 0.05))
        embs.append(bag(inputs[f.name]))
    dense = zin.dense_block(schema, inputs)
    vectors = list(embs)
    if dense is not None:
        bottom_out = MLP(tuple(bottom) + (embedding_dim,), name="bottom_mlp")(dense)
        vectors.insert(0, bottom_out)
        head = [bottom_out]
    else:
        head = embs
    if len(vectors) > 1:
        head = head + [DotInteraction(name="interaction")(tf.stack(vectors, axis=1))]
    x = MLP(top, name="top_mlp")(zin.concat(head, "top_input"))
    return tf.keras.Model(inputs, zin.prediction(x, schema), name="dlrm")
