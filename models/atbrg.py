"""ATBRG: Adaptive Target-Behavior Relational Graph network (Feng et al., "ATBRG:
Adaptive Target-Behavior Relational Graph Network for Effective Recommendation",
SIGIR 2020).

The paper links the target item and the user's behaviours through a knowledge graph,
prunes the paths that do not connect them, aggregates with relation-aware graph
attention, and pools the behaviours with target attention. We have no knowledge graph,
so the graph is built from what the data has:

  * item-item co-occurrence: two items are neighbours when they appear close together
    (within `window` positions) in a behaviour sequence, or as a target and one of its
    behaviours; each item keeps its `num_neighbors` most frequent neighbours.
    `build_graph(schema, features)` computes this from training features and
    `prepare(schema, features)` returns it as the `graph` hparam (the zoo's training
    helper calls it); without it (graph=None) the neighbour table is empty and only the
    in-sample edges below remain. The table is a non-trainable weight, saved with the
    model's weights (get_config carries only its shape).
  * in-sample edges: each behaviour is linked to its previous and next behaviour.

Relation types: 1 = co-occurrence, 2 = bridge (a target's neighbour that is among the
behaviours, or a behaviour's neighbour that is the target or a neighbour of the target:
the paths ATBRG keeps), 3 = sequence adjacency; 0 = padding. Instead of hard pruning,
relation embeddings and GAT-style attention over each node's neighbours weigh them
(soft pruning). One relation-aware aggregation hop updates the target and every
behaviour; DIN attention of the updated target over the updated behaviours follows.

Embedding style: ONE `Embedding` per item group shared by targets, behaviours and graph
neighbours. The paper aggregates over multi-hop KG paths with a deep MLP on top.
Scaled here: 1 hop, embedding 8, 4 neighbours, MLP 64-32.
"""
import numpy as np
import tensorflow as tf

from . import inputs as zin
from .blocks import MLP, NotPadding, TargetAttention, serializable
from .din import embed_others, require_pairs

TRAINING = dict(optimizer="adam", learning_rate=0.002, epochs=2, batch_size=512)
META = dict(paper="Feng et al. 2020, ATBRG", needs=("behaviour",),
            description="relational graph of target + behaviours (co-occurrence graph), "
                        "relation-aware aggregation, target attention")


def build_graph(schema, features, num_neighbors=4, window=2):
    """{group: int64 [vocab, num_neighbors]} of most frequent co-occurring items (0 = none)."""
    pairs = zin.behaviour_pairs(schema)
    graph = {}
    for group in dict.fromkeys(p.target.group for p in pairs):
        members = [p for p in pairs if p.target.group == group]
        vocab = max(zin.table_size(p.target, p.sequence) for p in members)
        src, dst = [], []
        for p in members:
            seq = np.asarray(features[p.sequence.name], np.int64)
            tgt = np.asarray(features[p.target.name], np.int64)
            for off in range(1, window + 1):                   # behaviours close together
                a, b = seq[:, :-off].ravel(), seq[:, off:].ravel()
                src += [a, b]
                dst += [b, a]
            for j in range(min(window * 2, seq.shape[1])):     # target with its behaviours
                src += [tgt, seq[:, j]]
                dst += [seq[:, j], tgt]
        a, b = np.concatenate(src), np.concatenate(dst)
        ok = (a > 0) & (b > 0) & (a != b) & (a < vocab) & (b < vocab)
        codes, counts = np.unique(a[ok] * vocab + b[ok], return_counts=True)
        a, b = codes // vocab, codes % vocab
        order = np.lexsort((-counts, a))
        a, b = a[order], b[order]
        rank = np.arange(len(a)) - np.searchsorted(a, a, side="left")
        keep = rank < num_neighbors
        table = np.zeros((vocab, num_neighbors), np.int64)
        table[a[keep], rank[keep]] = b[keep]
        graph[group] = table
    return graph


def prepare(schema, features, num_neighbors=4):
    """Hparams derived from training data: the co-occurrence graph."""
    return {"graph": build_graph(schema, features, num_neighbors), "num_neighbors": num_neighbors}


@serializable
class NeighborTable(tf.keras.layers.Layer):
    """A fixed (non-trainable) id -> neighbour ids table: ids [...] -> [..., K]."""

    def __init__(self, vocab_size, num_neighbors, table=None, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.num_neighbors = int(vocab_size), int(num_neighbors)
        self._initial = None if table is None else np.asarray(table, np.int64)

    def build(self, input_shape):
        init = "zeros" if self._initial is None else tf.keras.initializers.Constant(self._initial)
        self.table = self.add_weight(name="neighbors", shape=(self.vocab_size, self.num_neighbors),
                                     dtype=tf.int64, initializer=init, trainable=False)
        super().build(input_shape)

    def call(self, ids):
        return tf.gather(self.table, ids)

    def get_config(self):       # the table itself is state (weights), not config
        return {**super().get_config(), "vocab_size": self.vocab_size, "num_neighbors": self.num_neighbors}


@serializable
class RelationalAggregation(tf.keras.layers.Layer):
    """call([node [..., d], neighbours [..., K, d], relations [..., K] int]) -> [..., d].

    GAT-style: messages = neighbour + relation embedding, attention over the valid
    (relation != 0) neighbours, output tanh(W [node ; sum alpha * message]).
    """

    def __init__(self, num_relations=4, **kwargs):
        super().__init__(**kwargs)
        self.num_relations = int(num_relations)

    def build(self, input_shape):
        d = int(input_shape[0][-1])
        self.relation_emb = self.add_weight(name="relation_emb", shape=(self.num_relations, d),
                                            initializer=tf.keras.initializers.RandomNormal(stddev=0.05))
        self.att = tf.keras.layers.Dense(1, name="att")
        self.out = tf.keras.layers.Dense(d, activation="tanh", name="out")
        super().build(input_shape)

    def call(self, inputs):
        node, nbrs, rel = inputs
        msg = nbrs + tf.gather(self.relation_emb, rel)                   # [..., K, d]
        node_k = tf.broadcast_to(tf.expand_dims(node, -2), tf.shape(msg))
        logits = tf.squeeze(self.att(tf.concat([node_k, msg], -1)), -1)
        logits = tf.nn.leaky_relu(logits)
        valid = rel > 0
        logits = tf.where(valid, logits, tf.fill(tf.shape(logits), -1e9))
        alpha = tf.nn.softmax(logits, -1) * tf.cast(valid, logits.dtype)
        agg = tf.reduce_sum(tf.expand_dims(alpha, -1) * msg, -2)
        return self.out(tf.concat([node, agg], -1))

    def get_config(self):
        return {**super().get_config(), "num_relations": self.num_relations}


@serializable
class TargetBehaviourGraph(tf.keras.layers.Layer):
    """Neighbour ids and relation types of the per-example target-behaviour graph.

    call([target [B], behaviours [B, L], target_nbrs [B, K], behaviour_nbrs [B, L, K]])
      -> (target_nbrs [B, K], target_rel [B, K], beh_nbrs [B, L, K+2], beh_rel [B, L, K+2])
    """

    def call(self, inputs):
        target, beh, t_nbr, b_nbr = inputs
        beh_valid = beh > 0
        # target's neighbours: bridge when they are among the behaviours
        in_beh = tf.reduce_any(tf.logical_and(tf.equal(t_nbr[:, :, None], beh[:, None, :]),
                                              beh_valid[:, None, :]), -1)
        t_rel = tf.where(t_nbr > 0, tf.where(in_beh, 2, 1), 0)
        # behaviours' neighbours: bridge when they are the target or a target neighbour
        to_target = tf.logical_or(tf.equal(b_nbr, target[:, None, None]),
                                  tf.reduce_any(tf.logical_and(tf.equal(b_nbr[..., None], t_nbr[:, None, None, :]),
                                                               t_nbr[:, None, None, :] > 0), -1))
        b_rel = tf.where(b_nbr > 0, tf.where(to_target, 2, 1), 0)
        b_rel = tf.where(beh_valid[..., None], b_rel, 0)
        # in-sample sequence edges: previous and next behaviour
        prev = tf.pad(beh[:, :-1], [[0, 0], [1, 0]])
        nxt = tf.pad(beh[:, 1:], [[0, 0], [0, 1]])
        seq_nbr = tf.stack([prev, nxt], -1)                              # [B, L, 2]
        seq_rel = tf.where(tf.logical_and(seq_nbr > 0, beh_valid[..., None]), 3, 0)
        return (t_nbr, tf.cast(t_rel, tf.int32), tf.concat([b_nbr, seq_nbr], -1),
                tf.cast(tf.concat([b_rel, seq_rel], -1), tf.int32))


def build_atbrg(schema, embedding_dim=8, hidden=(64, 32), attention_units=(32, 16), num_neighbors=4,
                graph=None):
    pairs = require_pairs(schema, "atbrg")
    inputs = schema.keras_inputs()
    graph = graph or {}
    tables = zin.shared_tables(pairs, lambda vocab, t: tf.keras.layers.Embedding(
        vocab, zin.dim_of(t, embedding_dim), name=f"emb_{t.group}"))
    neighbours = zin.shared_tables(pairs, lambda vocab, t: NeighborTable(
        vocab, num_neighbors, graph.get(t.group), name=f"graph_{t.group}"))
    targets, parts = {}, []
    for p in pairs:
        table, nbr_table = tables[p.target.group], neighbours[p.target.group]
        t_ids, b_ids = inputs[p.target.name], inputs[p.sequence.name]
        t_nbr, t_rel, b_nbr, b_rel = TargetBehaviourGraph(name=f"tbg_{p.sequence.name}")(
            [t_ids, b_ids, nbr_table(t_ids), nbr_table(b_ids)])
        agg = RelationalAggregation(name=f"relational_{p.sequence.name}")
        if p.target.name not in targets:
            targets[p.target.name] = table(t_ids)
            parts.append(targets[p.target.name])
        target = targets[p.target.name]
        target_g = agg([target, table(t_nbr), t_rel])                      # [B, d]
        beh_g = agg([table(b_ids), table(b_nbr), b_rel])                  # [B, L, d]
        mask = NotPadding(name=f"mask_{p.sequence.name}")(b_ids)
        interest = TargetAttention(attention_units, name=f"attention_{p.sequence.name}")([target_g, beh_g, mask])
        parts += [target_g, interest]
    parts += embed_others(schema, inputs, embedding_dim, zin.behaviour_names(schema))
    x = MLP(hidden, name="mlp")(zin.concat(parts, "atbrg_concat"))
    return tf.keras.Model(inputs, zin.prediction(x, schema), name="atbrg")
