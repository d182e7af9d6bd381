"""DCN: Deep & Cross Network (Wang et al., "Deep & Cross Network for Ad Click
Predictions", ADKDD 2017).

x0 = [embeddings; dense]; cross layers x_{l+1} = x0 * (x_l . w_l) + b_l + x_l run beside
an MLP; both outputs are concatenated into the logit. Embedding style: per-feature
`Embedding` (width from the schema hint, else embedding_dim); multi-hot fields and
behaviour sequences use `mask_zero=True` and masked mean pooling (`MaskedPooling`).
Paper defaults (Criteo): 6 cross layers, deep 2 x 1024, embedding 6 * vocab^(1/4).
Scaled for small data: 3 cross layers, MLP 64-32, 8-d embeddings.
"""
import tensorflow as tf

from . import inputs as zin
from .blocks import MLP, MaskedPooling, serializable

TRAINING = dict(optimizer="adam", learning_rate=0.002, epochs=2, batch_size=512)
META = dict(paper="Wang et al. 2017, Deep & Cross Network", needs=(),
            description="cross network (vector weights) beside an MLP")


@serializable
class CrossNet(tf.keras.layers.Layer):
    """DCN's cross network: num_layers of x0 * (x . w) + b + x."""

    def __init__(self, num_layers=3, **kwargs):
        super().__init__(**kwargs)
        self.num_layers = int(num_layers)

    def build(self, input_shape):
        d = int(input_shape[-1])
        self.w = [self.add_weight(name=f"w{i}", shape=(d, 1), initializer="glorot_uniform")
                  for i in range(self.num_layers)]
        self.b = [self.add_weight(name=f"b{i}", shape=(d,), initializer="zeros")
                  for i in range(self.num_layers)]
        super().build(input_shape)

    def call(self, x0):
        x = x0
        for w, b in zip(self.w, self.b):
            x = x0 * tf.matmul(x, w) + b + x
        return x

    def get_config(self):
        return {**super().get_config(), "num_layers": self.num_layers}


def embed_all(schema, inputs, embedding_dim, use_hint=True):
    """Per-feature Embedding; bags (multi-hot and sequences) masked-mean pooled."""
    parts = []
    for f in schema.categorical:
        dim = zin.dim_of(f, embedding_dim, use_hint)
        parts.append(tf.keras.layers.Embedding(f.vocab_size, dim, name=f"emb_{f.name}")(inputs[f.name]))
    for f in schema.sequences:
        dim = zin.dim_of(f, embedding_dim, use_hint)
        emb = tf.keras.layers.Embedding(f.vocab_size, dim, mask_zero=True, name=f"emb_{f.name}")
        parts.append(MaskedPooling("mean", name=f"mean_{f.name}")(emb(inputs[f.name])))
    parts.append(zin.dense_block(schema, inputs))
    return zin.concat(parts, "x0")


def build_dcn(schema, embedding_dim=8, cross_layers=3, hidden=(64, 32)):
    inputs = schema.keras_inputs()
    x0 = embed_all(schema, inputs, embedding_dim)
    cross = CrossNet(cross_layers, name="cross_net")(x0)
    deep = MLP(hidden, name="deep")(x0)
    x = tf.keras.layers.Concatenate(name="cross_and_deep")([cross, deep])
    return tf.keras.Model(inputs, zin.prediction(x, schema), name="dcn")
