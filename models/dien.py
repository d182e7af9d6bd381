"""DIEN: Deep Interest Evolution Network (Zhou et al., "Deep Interest Evolution Network
for Click-Through Rate Prediction", AAAI 2019).

Per behaviour pair: the behaviour embeddings go through a GRU (interest extractor);
softmax attention scores each hidden state against the target; an AUGRU (GRU whose
update gate is scaled by the attention score, `AUGRUCell` below, run by
`tf.keras.layers.RNN`) evolves the interest; its final state, the target embedding and
the other features feed an MLP. Optional auxiliary loss (aux_loss_weight > 0): each
hidden state h_t should score the next behaviour e_{t+1} above a negative taken from
another example of the batch (the paper samples a non-clicked item; here in-batch).

Embedding style: the target and its sequence share ONE `Embedding` (called twice);
padding masks (`ids != 0`) go to the RNNs explicitly. Paper defaults: embedding 18,
GRU/AUGRU hidden = embedding size, MLP 200-80, aux loss on. Scaled: embedding 8,
hidden 8, MLP 64-32; aux loss weight 0 by default (off): with the short recipe it did
not help on MovieLens (test AUC 0.7752 with weight 1.0 vs 0.7754 without on the random
split, 0.6991 vs 0.7009 on the time split) and slows training; aux_loss_weight=1.0 gives
the paper's setting.
"""
import tensorflow as tf

from . import inputs as zin
from .blocks import MLP, NotPadding, TargetAttention, serializable
from .din import embed_others, require_pairs

TRAINING = dict(optimizer="adam", learning_rate=0.002, epochs=2, batch_size=512)
META = dict(paper="Zhou et al. 2019, Deep Interest Evolution Network", needs=("behaviour",),
            description="GRU interest extractor + attention-gated AUGRU")


@serializable
class AUGRUCell(tf.keras.layers.Layer):
    """GRU cell with attentional update gate. Input per step: [x_t ; a_t] (score last)."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = int(units)
        self.state_size = self.units
        self.output_size = self.units

    def build(self, input_shape):
        n = int(input_shape[-1]) - 1
        self.kernel = self.add_weight(name="kernel", shape=(n, 3 * self.units), initializer="glorot_uniform")
        self.recurrent_kernel = self.add_weight(name="recurrent_kernel", shape=(self.units, 3 * self.units),
                                                initializer="orthogonal")
        self.bias = self.add_weight(name="bias", shape=(3 * self.units,), initializer="zeros")
        super().build(input_shape)

    def call(self, inputs, states):
        h = states[0] if isinstance(states, (list, tuple)) else states
        x, att = inputs[:, :-1], inputs[:, -1:]
        xz, xr, xh = tf.split(tf.matmul(x, self.kernel) + self.bias, 3, axis=-1)
        rk_zr, rk_h = self.recurrent_kernel[:, :2 * self.units], self.recurrent_kernel[:, 2 * self.units:]
        hz, hr = tf.split(tf.matmul(h, rk_zr), 2, axis=-1)
        z = tf.sigmoid(xz + hz)
        r = tf.sigmoid(xr + hr)
        candidate = tf.tanh(xh + tf.matmul(r * h, rk_h))
        z = att * z                                                   # the attentional update gate
        h_new = (1.0 - z) * h + z * candidate
        return h_new, [h_new]

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@serializable
class NextBehaviourLoss(tf.keras.layers.Layer):
    """Adds DIEN's auxiliary loss; call([hidden [B,L,h], emb [B,L,h], mask [B,L]]) -> hidden."""

    def __init__(self, weight=1.0, **kwargs):
        super().__init__(**kwargs)
        self.weight = float(weight)

    def call(self, inputs):
        hidden, emb, mask = inputs
        h, pos = hidden[:, :-1], emb[:, 1:]
        neg = tf.roll(pos, shift=1, axis=0)                         # another example's behaviour
        valid = tf.cast(tf.logical_and(mask[:, 1:], mask[:, :-1]), h.dtype)
        pos_logit = tf.reduce_sum(h * pos, -1)
        neg_logit = tf.reduce_sum(h * neg, -1)
        loss = (tf.nn.softplus(-pos_logit) + tf.nn.softplus(neg_logit)) * valid
        self.add_loss(self.weight * tf.reduce_sum(loss) / tf.maximum(tf.reduce_sum(valid), 1.0))
        return hidden

    def get_config(self):
        return {**super().get_config(), "weight": self.weight}


def build_dien(schema, embedding_dim=8, hidden=(64, 32), attention_units=(32, 16), aux_loss_weight=0.0):
    pairs = require_pairs(schema, "dien")
    inputs = schema.keras_inputs()
    tables = zin.shared_tables(pairs, lambda vocab, target: tf.keras.layers.Embedding(
        vocab, zin.dim_of(target, embedding_dim), name=f"emb_{target.group}"))
    targets, parts = {}, []
    for p in pairs:
        dim = zin.dim_of(p.target, embedding_dim)
        if p.target.name not in targets:
            targets[p.target.name] = tables[p.target.group](inputs[p.target.name])
            parts.append(targets[p.target.name])
        target = targets[p.target.name]
        behaviours = tables[p.target.group](inputs[p.sequence.name])
        mask = NotPadding(name=f"mask_{p.sequence.name}")(inputs[p.sequence.name])
        states = tf.keras.layers.GRU(dim, return_sequences=True, name=f"interest_gru_{p.sequence.name}")(
            behaviours, mask=mask)
        if aux_loss_weight:
            states = NextBehaviourLoss(aux_loss_weight, name=f"aux_loss_{p.sequence.name}")(
                [states, behaviours, mask])
        scores = TargetAttention(attention_units, softmax=True, return_scores=True,
                                 name=f"attention_{p.sequence.name}")([target, states, mask])
        gated = tf.keras.layers.Concatenate(name=f"augru_input_{p.sequence.name}")(
            [states, tf.expand_dims(scores, -1)])
        interest = tf.keras.layers.RNN(AUGRUCell(dim), name=f"augru_{p.sequence.name}")(gated, mask=mask)
        parts.append(interest)
    parts += embed_others(schema, inputs, embedding_dim, zin.behaviour_names(schema))
    x = MLP(hidden, name="mlp")(zin.concat(parts, "dien_concat"))
    return tf.keras.Model(inputs, zin.prediction(x, schema), name="dien")
