"""Two-Tower DNN (the query/user-vs-ad/item towers of Baidu's Mobius, Fan et al., KDD
2019, cited as TwoTowerDNN [36] in PICASSO Table VII; the classic DSSM layout).

A user tower and an item tower, each an MLP over its own features' embeddings, end in
vectors u, v of width `out_dim`; the click probability is sigmoid(<u, v> + b).

Which features go to the item tower: `item_features` (a list of names). The schema does
not say which features describe the item, so `prepare(schema, train_features)` (called
by the zoo's training helper) finds them in the data: the targets of behaviour pairs
(e.g. "item_id") plus every other feature that is a function of such a target (one value
per item id in the training data: on MovieLens release_year and genres). Without data,
the default is the targets plus features whose name starts with a target's group name;
when the schema has no behaviour pair, the second half of the sparse features.
Everything else, behaviour sequences included, is user side.

Embedding style: per-feature `Embedding`; a behaviour sequence (in the user tower)
shares its target's table (the same layer called on both) and is sum-pooled over
`ids != 0`; other bags use `mask_zero=True` + masked sum pooling. Scaled defaults:
towers 64-32, out_dim 16.
"""
import numpy as np
import tensorflow as tf

from . import inputs as zin
from .blocks import MLP, MaskedPooling, SumLogits

TRAINING = dict(optimizer="adam", learning_rate=0.002, epochs=2, batch_size=512)
META = dict(paper="Fan et al. 2019, Mobius (TwoTowerDNN)", needs=(),
            description="user and item MLP towers, dot product")


def default_item_features(schema):
    pairs = zin.behaviour_pairs(schema)
    if pairs:
        prefixes = {p.target.group for p in pairs} | {p.target.name for p in pairs}
        seqs = {p.sequence.name for p in pairs}
        return [f.name for f in schema.features
                if f.name not in seqs and any(f.name == p or f.name.startswith(p + "_") for p in prefixes)]
    sparse = schema.categorical + schema.sequences
    return [f.name for f in sparse[len(sparse) // 2:]]


def item_attributes(schema, features):
    """Targets of behaviour pairs plus the features with one value per target id.

    Only targets seen at least twice per id on average count as evidence, and the user
    side is never left empty (else the name-based default is used)."""
    pairs = zin.behaviour_pairs(schema)
    if not pairs:
        return default_item_features(schema)
    seqs = {p.sequence.name for p in pairs}
    names = [p.target.name for p in pairs]
    for p in pairs:
        ids = np.asarray(features[p.target.name]).reshape(-1, 1)
        distinct = len(np.unique(ids))
        if len(ids) < 2 * distinct:
            continue
        for f in schema.features:
            if f.name in names or f.name in seqs:
                continue
            values = np.asarray(features[f.name], np.float64).reshape(len(ids), -1)
            if len(np.unique(np.concatenate([ids, values], axis=1), axis=0)) == distinct:
                names.append(f.name)
    if len(names) + len(seqs) >= len(schema.features):
        return default_item_features(schema)
    return names


def prepare(schema, features):
    """Hparams derived from training data: the item tower's features."""
    return {"item_features": item_attributes(schema, features)}


def build_two_tower(schema, embedding_dim=8, hidden=(64, 32), out_dim=16, item_features=None):
    inputs = schema.keras_inputs()
    item_side = set(item_features if item_features is not None else default_item_features(schema))
    unknown = item_side - {f.name for f in schema.features}
    if unknown:
        raise ValueError(f"item_features {sorted(unknown)} are not in the schema")
    pairs = zin.behaviour_pairs(schema)        # a target and its sequences: one table
    by_group = zin.shared_tables(pairs, lambda vocab, t: tf.keras.layers.Embedding(
        vocab, zin.dim_of(t, embedding_dim), name=f"emb_{t.group}"))
    tables = {f.name: by_group[p.target.group] for p in pairs for f in p}
    towers = {"user": [], "item": []}
    for f in schema.features:
        side = towers["item" if f.name in item_side else "user"]
        x = inputs[f.name]
        if f.kind == "dense":
            side.append(x if f.dim > 1 else tf.keras.layers.Reshape((1,), name=f"{f.name}_col")(x))
            continue
        if f.name in tables:     # shared table: pool with the explicit ids != 0 mask
            e = tables[f.name](x)
            side.append(MaskedPooling("sum", name=f"sum_{f.name}")([e, x]) if f.kind == "sequence" else e)
        elif f.kind == "sequence":
            emb = tf.keras.layers.Embedding(f.vocab_size, zin.dim_of(f, embedding_dim), mask_zero=True,
                                            name=f"emb_{f.name}")
            side.append(MaskedPooling("sum", name=f"sum_{f.name}")(emb(x)))
        else:
            side.append(tf.keras.layers.Embedding(f.vocab_size, zin.dim_of(f, embedding_dim),
                                                  name=f"emb_{f.name}")(x))
    if not towers["user"] or not towers["item"]:
        raise ValueError(f"two_tower needs features on both sides; item side = {sorted(item_side)}")
    vecs = []
    for side in ("user", "item"):
        h = MLP(hidden, name=f"{side}_tower")(zin.concat(towers[side], f"{side}_concat"))
        vecs.append(tf.keras.layers.Dense(out_dim, name=f"{side}_vector")(h))
    logit = SumLogits(name="score")(tf.keras.layers.Dot(axes=1, name="dot")(vecs))
    return tf.keras.Model(inputs, zin.sigmoid_output(logit, schema), name="two_tower")
