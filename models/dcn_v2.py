"""DCN-v2 (Wang et al., "DCN V2: Improved Deep & Cross Network and Practical Lessons for
Web-scale Learning to Rank Systems", WWW 2021).

Cross layers with full (or low-rank) matrices, x_{l+1} = x0 * (W_l x_l + b_l) + x_l,
stacked before an MLP (the paper's "stacked" structure). Embedding style: a custom
`FeatureTables` layer that owns one table per sparse feature (add_weight) and looks
them up with `tf.nn.embedding_lookup`; bags are mean-pooled with masking arithmetic.
The paper (Criteo) uses a few cross layers, full-rank or low-rank, and wide MLPs.
Scaled for small data: 2 cross layers, low rank 16 when the input is wider than 64,
MLP 64-32.
"""
import tensorflow as tf

from . import inputs as zin
from .blocks import MLP, serializable

TRAINING = dict(optimizer="adam", learning_rate=0.002, epochs=2, batch_size=512)
META = dict(paper="Wang et al. 2021, DCN V2", needs=(),
            description="matrix (low-rank) cross layers stacked before an MLP")


@serializable
class FeatureTables(tf.keras.layers.Layer):
    """One add_weight table per sparse feature; call({name: ids}) -> [B, sum(dims)].

    features: list of [name, vocab_size, dim]. Sequence ids [B, L] are mean-pooled over
    non-zero ids.
    """

    def __init__(self, features, **kwargs):
        super().__init__(**kwargs)
        self.features = [[str(n), int(v), int(d)] for n, v, d in features]

    def build(self, input_shape):
        self.tables = {}
        for n, v, d in self.features:
            init = tf.keras.initializers.RandomUniform(-0.05, 0.05)     # a fresh one per table
            self.tables[n] = self.add_weight(name=f"table_{n}", shape=(v, d), initializer=init)
        super().build(input_shape)

    def call(self, ids_by_name):
        out = []
        for name, _, _ in self.features:
            ids = ids_by_name[name]
            emb = tf.nn.embedding_lookup(self.tables[name], ids)
            if ids.shape.rank == 2:
                mask = tf.cast(tf.not_equal(ids, 0), emb.dtype)[..., None]
                emb = tf.math.divide_no_nan(tf.reduce_sum(emb * mask, 1), tf.reduce_sum(mask, 1))
            out.append(emb)
        return tf.concat(out, axis=-1)

    def get_config(self):
        return {**super().get_config(), "features": self.features}


@serializable
class CrossNetV2(tf.keras.layers.Layer):
    """num_layers of x0 * (W x + b) + x; W = U V^T when rank is set (low-rank)."""

    def __init__(self, num_layers=2, rank=None, **kwargs):
        super().__init__(**kwargs)
        self.num_layers = int(num_layers)
        self.rank = None if rank is None else int(rank)

    def build(self, input_shape):
        d = int(input_shape[-1])
        self.layers_ = []
        for i in range(self.num_layers):
            if self.rank:
                proj = [tf.keras.layers.Dense(self.rank, use_bias=False, name=f"v{i}"),
                        tf.keras.layers.Dense(d, name=f"u{i}")]
            else:
                proj = [tf.keras.layers.Dense(d, name=f"w{i}")]
            self.layers_.append(proj)
        super().build(input_shape)

    def call(self, x0):
        x = x0
        for proj in self.layers_:
            h = x
            for layer in proj:
                h = layer(h)
            x = x0 * h + x
        return x

    def get_config(self):
        return {**super().get_config(), "num_layers": self.num_layers, "rank": self.rank}


def build_dcn_v2(schema, embedding_dim=8, cross_layers=2, rank="auto", hidden=(64, 32)):
    inputs = schema.keras_inputs()
    sparse = schema.categorical + schema.sequences
    tables = FeatureTables([[f.name, f.vocab_size, zin.dim_of(f, embedding_dim)] for f in sparse],
                           name="tables")
    parts = [tables({f.name: inputs[f.name] for f in sparse}) if sparse else None,
             zin.dense_block(schema, inputs)]
    x0 = zin.concat(parts, "x0")
    if rank == "auto":
        rank = 16 if x0.shape[-1] > 64 else None
    x = CrossNetV2(cross_layers, rank, name="cross_net")(x0)
    x = MLP(hidden, name="deep")(x)
    return tf.keras.Model(inputs, zin.prediction(x, schema), name="dcn_v2")
