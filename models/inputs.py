"""Reading a picasso_tf Schema the way the zoo's models need it.

Plain-Python views of the schema plus a few small Keras helpers; the embedding code
itself lives in each model (the zoo deliberately shows several embedding styles).

Conventions (see picasso_tf/data/schema.py): dense float32 [B] or [B, dim]; one-hot
int64 [B]; multi-hot / sequence int64 [B, max_len], right-padded with id 0.
A *behaviour sequence* is a sequence feature whose `group` is shared by a one-hot
feature (its *target*, e.g. ("item", "hist_item")): the two share one table. Any other
sequence feature is a plain multi-hot field (e.g. genres) and is pooled.
"""
from typing import List, NamedTuple, Optional

import tensorflow as tf

DEFAULT_DIM = 8


class BehaviourPair(NamedTuple):
    target: "object"     # Feature, kind categorical
    sequence: "object"   # Feature, kind sequence, same group


def behaviour_pairs(schema) -> List[BehaviourPair]:
    """(target, sequence) pairs sharing a group, in the schema's sequence order."""
    pairs = []
    for seq in schema.sequences:
        if seq.group is None:
            continue
        targets = [f for f in schema.categorical if f.group == seq.group]
        if targets:
            pairs.append(BehaviourPair(targets[0], seq))
    return pairs


def shared_tables(pairs, make):
    """One table per behaviour group, shared by its target and all its sequences:
    {group: make(vocab_size, target)}, vocab_size covering every feature of the group."""
    tables = {}
    for p in pairs:
        group = p.target.group
        if group not in tables:
            members = [f for q in pairs if q.target.group == group for f in q]
            tables[group] = make(max(f.vocab_size for f in members), p.target)
    return tables


def behaviour_names(schema):
    """Names of the features that take part in a behaviour pair (targets and sequences)."""
    return {f.name for p in behaviour_pairs(schema) for f in p}


def table_size(feature, *others):
    """Rows a table shared by these features needs (their largest vocabulary)."""
    return max(f.vocab_size for f in (feature,) + others)


def dim_of(feature, default=DEFAULT_DIM, use_hint=True):
    """The feature's embedding width: its schema hint if any (and use_hint), else default."""
    return feature.embedding_dim if (use_hint and feature.embedding_dim) else default


def dense_block(schema, inputs, name="dense_concat"):
    """All dense features as one float32 [B, total_dim] tensor, or None when there are none."""
    parts = []
    for f in schema.dense:
        x = inputs[f.name]
        if f.dim == 1:
            x = tf.keras.layers.Reshape((1,), name=f"{f.name}_as_column")(x)
        parts.append(x)
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else tf.keras.layers.Concatenate(name=name)(parts)


def concat(tensors, name):
    """Concatenate along the last axis; a single tensor passes through."""
    tensors = [t for t in tensors if t is not None]
    if not tensors:
        raise ValueError(f"{name}: nothing to concatenate (the schema has no usable features)")
    return tensors[0] if len(tensors) == 1 else tf.keras.layers.Concatenate(name=name)(tensors)


def prediction(x, schema, name: Optional[str] = None):
    """The final sigmoid unit, named after the (single) label: probabilities [B, 1]."""
    return tf.keras.layers.Dense(1, activation="sigmoid", name=name or schema.labels[0])(x)


def sigmoid_output(logit, schema, name: Optional[str] = None):
    """A logit [B, 1] turned into the model's probability output, named after the label."""
    return tf.keras.layers.Activation("sigmoid", name=name or schema.labels[0])(logit)


def pick_categorical(schema, name=None, smallest=True, min_vocab=3, role="feature"):
    """A one-hot feature by name, or (name None) the one with the smallest/largest vocab."""
    if name is not None:
        f = schema[name]
        if f.kind != "categorical":
            raise ValueError(f"{role} {name!r} must be a one-hot categorical feature, it is {f.kind}")
        return f
    cands = [f for f in schema.categorical if f.vocab_size >= min_vocab] or list(schema.categorical)
    if not cands:
        raise ValueError(f"the schema has no one-hot categorical feature to use as {role}")
    key = (lambda f: f.vocab_size) if smallest else (lambda f: -f.vocab_size)
    return sorted(cands, key=key)[0]
