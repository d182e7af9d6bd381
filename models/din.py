"""DIN: Deep Interest Network (Zhou et al., "Deep Interest Network for Click-Through Rate
Prediction", KDD 2018).

For each behaviour pair (target one-hot feature + behaviour sequence of the same
group, e.g. item / hist_item), a local activation unit scores every behaviour against
the target (MLP over [q, k, q-k, q*k]) and the behaviours are summed with these
weights (no softmax, as in the paper). The pooled interest, the target's embedding and
all other features' embeddings feed an MLP.

Embedding style: per-feature `Embedding`; the target and its behaviour sequence share
ONE table (the same Embedding layer called twice; the sequence's padding is masked with
`ids != 0`); other bags are mean-pooled with `mask_zero=True`. Width: the target's
schema hint, else embedding_dim. Paper defaults: MLP 200-80 with Dice, attention 80-40,
embedding 12 per id. Scaled: MLP 64-32 (ReLU), attention 32-16, embedding 8.
"""
import tensorflow as tf

from . import inputs as zin
from .blocks import MLP, MaskedPooling, NotPadding, TargetAttention

TRAINING = dict(optimizer="adam", learning_rate=0.002, epochs=2, batch_size=512)
META = dict(paper="Zhou et al. 2018, Deep Interest Network", needs=("behaviour",),
            description="target attention over a behaviour sequence")


def embed_others(schema, inputs, embedding_dim, skip):
    """Embeddings of the features not in a behaviour pair (bags mean-pooled) + dense."""
    parts = []
    for f in schema.categorical:
        if f.name not in skip:
            parts.append(tf.keras.layers.Embedding(f.vocab_size, zin.dim_of(f, embedding_dim),
                                                   name=f"emb_{f.name}")(inputs[f.name]))
    for f in schema.sequences:
        if f.name not in skip:
            emb = tf.keras.layers.Embedding(f.vocab_size, zin.dim_of(f, embedding_dim), mask_zero=True,
                                            name=f"emb_{f.name}")
            parts.append(MaskedPooling("mean", name=f"mean_{f.name}")(emb(inputs[f.name])))
    parts.append(zin.dense_block(schema, inputs))
    return parts


def require_pairs(schema, model):
    pairs = zin.behaviour_pairs(schema)
    if not pairs:
        raise ValueError(f"{model} needs a behaviour sequence: a sequence feature whose `group` is "
                         f"shared by a one-hot feature (e.g. item / hist_item); schema "
                         f"{schema.name!r} has none")
    return pairs


def build_din(schema, embedding_dim=8, hidden=(64, 32), attention_units=(32, 16)):
    pairs = require_pairs(schema, "din")
    inputs = schema.keras_inputs()
    tables = zin.shared_tables(pairs, lambda vocab, target: tf.keras.layers.Embedding(
        vocab, zin.dim_of(target, embedding_dim), name=f"emb_{target.group}"))
    queries, parts = {}, []
    for p in pairs:
        if p.target.name not in queries:
            queries[p.target.name] = tables[p.target.group](inputs[p.target.name])     # [B, d]
            parts.append(queries[p.target.name])
        keys = tables[p.target.group](inputs[p.sequence.name])     # [B, L, d], the target's table
        mask = NotPadding(name=f"mask_{p.sequence.name}")(inputs[p.sequence.name])
        parts.append(TargetAttention(attention_units, name=f"attention_{p.sequence.name}")(
            [queries[p.target.name], keys, mask]))
    parts += embed_others(schema, inputs, embedding_dim, zin.behaviour_names(schema))
    x = MLP(hidden, name="mlp")(zin.concat(parts, "din_concat"))
    return tf.keras.Model(inputs, zin.prediction(x, schema), name="din")
