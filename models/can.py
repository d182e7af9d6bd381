"""CAN: Co-Action Network (Zhou, Bian et al., "CAN: Revisiting Feature Co-Action for
Click-Through Rate Prediction", arXiv 2011.05625, 2020; PICASSO [8]).

Co-action unit: the *induction* feature (the target item) owns a long embedding that is
reshaped into the weights and biases of a micro-MLP (here feeder_dim -> 4 -> 4, tanh);
each *feeder* feature (the behaviour sequence, and the other one-hot features) is
embedded in its own feeder table and passed through that micro-MLP, with multi-order
enhancement (x, x^2, ... up to `orders`, sharing the micro-MLP). A sequence's outputs
are summed over its non-padding behaviours. The co-action outputs are concatenated to a
DIN base model (target attention + embeddings + MLP).

Induction/feeders: with behaviour pairs, each pair's target induces co-action with its
sequence and with every other one-hot feature (or those in `feeders`); without pairs,
`target_feature` (default: the largest-vocabulary one-hot feature) induces co-action
with the other one-hot and multi-hot features. Embedding style: plain per-feature
`Embedding` layers everywhere (the co-action tables are ordinary Embeddings whose rows
are reinterpreted as weights); sequences masked with `ids != 0`. The paper uses
small multi-layer micro-MLPs with multi-order inputs on a DIEN-like base. Here: feeder
8 -> 4 -> 4, orders 2 sharing the micro-MLP, DIN base, MLP 64-32.
"""
import tensorflow as tf

from . import inputs as zin
from .blocks import MLP, NotPadding, TargetAttention, serializable
from .din import embed_others

TRAINING = dict(optimizer="adam", learning_rate=0.002, epochs=2, batch_size=512)
META = dict(paper="Zhou/Bian et al. 2020, CAN: Feature Co-Action Network", needs=("target",),
            description="co-action units: target embedding as micro-MLP weights (+ DIN base)")


@serializable
class CoAction(tf.keras.layers.Layer):
    """call([induction [B, P], feeder [B, d] or [B, L, d], (mask [B, L])]) -> [B, layers[-1]].

    P must equal sum over micro-MLP layers of (in * out + out), starting from in = d.
    """

    def __init__(self, layers=(4, 4), orders=2, **kwargs):
        super().__init__(**kwargs)
        self.layers_ = [int(u) for u in layers]
        self.orders = int(orders)

    @staticmethod
    def param_size(feeder_dim, layers):
        size, n = 0, feeder_dim
        for u in layers:
            size, n = size + n * u + u, u
        return size

    def call(self, inputs):
        induction, feeder = inputs[0], inputs[1]
        mask = inputs[2] if len(inputs) > 2 else None
        seq = feeder.shape.rank == 3
        if not seq:
            feeder = feeder[:, None, :]                                 # [B, 1, d]
        outs = []
        for c in range(1, self.orders + 1):
            h, offset, n = feeder ** c, 0, feeder.shape[-1]
            for u in self.layers_:
                w = tf.reshape(induction[:, offset:offset + n * u], [-1, n, u])
                b = induction[:, offset + n * u:offset + n * u + u]
                h = tf.tanh(tf.matmul(h, w) + b[:, None, :])             # [B, L, u]
                offset, n = offset + n * u + u, u
            outs.append(h)
        h = tf.add_n(outs)
        if mask is not None:
            h = h * tf.cast(mask, h.dtype)[..., None]
        return tf.reduce_sum(h, axis=1)

    def get_config(self):
        return {**super().get_config(), "layers": self.layers_, "orders": self.orders}


def build_can(schema, embedding_dim=8, hidden=(64, 32), attention_units=(32, 16), feeder_dim=8,
              micro_layers=(4, 4), orders=2, feeders=None, target_feature=None):
    inputs = schema.keras_inputs()
    pairs = zin.behaviour_pairs(schema)
    param_size = CoAction.param_size(feeder_dim, micro_layers)
    parts = []

    def coact(target, feeder_features, sequences=()):
        induction = tf.keras.layers.Embedding(target.vocab_size, param_size, name=f"coaction_{target.name}")(
            inputs[target.name])
        out = []
        for f in list(sequences) + list(feeder_features):
            ids = inputs[f.name]
            emb = tf.keras.layers.Embedding(f.vocab_size, feeder_dim, name=f"feeder_{f.name}_{target.name}")(ids)
            args = [induction, emb] + ([NotPadding()(ids)] if f.kind == "sequence" else [])
            out.append(CoAction(micro_layers, orders, name=f"co_{target.name}_{f.name}")(args))
        return out

    behaviour = zin.behaviour_names(schema)
    if pairs:
        # DIN base: one table per group for targets and behaviours, target attention
        tables = zin.shared_tables(pairs, lambda vocab, t: tf.keras.layers.Embedding(
            vocab, zin.dim_of(t, embedding_dim), name=f"emb_{t.group}"))
        others = [f for f in schema.categorical if f.name not in behaviour]
        if feeders is not None:
            others = [schema[n] for n in feeders]
        for target in {p.target.name: p.target for p in pairs}.values():
            sequences = [p.sequence for p in pairs if p.target.name == target.name]
            query = tables[target.group](inputs[target.name])
            parts.append(query)
            for seq in sequences:
                keys = tables[target.group](inputs[seq.name])
                mask = NotPadding(name=f"mask_{seq.name}")(inputs[seq.name])
                parts.append(TargetAttention(attention_units, name=f"attention_{seq.name}")([query, keys, mask]))
            parts += coact(target, others, sequences)
    else:
        target = zin.pick_categorical(schema, target_feature, smallest=False, role="CAN's target_feature")
        others = [f for f in schema.categorical + schema.sequences if f.name != target.name]
        if feeders is not None:
            others = [schema[n] for n in feeders]
        parts += coact(target, others)
    parts += embed_others(schema, inputs, embedding_dim, behaviour)
    x = MLP(hidden, name="mlp")(zin.concat(parts, "can_concat"))
    return tf.keras.Model(inputs, zin.prediction(x, schema), name="can")
