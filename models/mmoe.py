"""MMoE: Multi-gate Mixture-of-Experts (Ma et al., "Modeling Task Relationships in
Multi-task Learning with Multi-gate Mixture-of-Experts", KDD 2018).

Shared experts (MLPs) over the concatenated embeddings; one softmax gate per task mixes
the experts' outputs; one tower + sigmoid per task. The tasks are `schema.labels`: with
several labels the model outputs a dict {label: probability [B, 1]} (so Keras matches
dict labels by name); with a single label it still is an MMoE with one gate and one
tower, and outputs a plain [B, 1] tensor named after that label.

Embedding style: per-feature `Embedding` (schema hint or embedding_dim wide); bags are
mean-pooled with explicit `tf.reduce_sum(emb * mask, 1) / count`. The paper uses about 8
small experts and small towers. Defaults here: 4 experts of (64, 32), towers of 16
units.
"""
import tensorflow as tf

from . import inputs as zin
from .blocks import MLP, serializable

TRAINING = dict(optimizer="adam", learning_rate=0.002, epochs=2, batch_size=512)
META = dict(paper="Ma et al. 2018, MMoE", needs=(),
            description="multi-task: shared experts, a gate and a tower per label")


@serializable
class MixtureOfExperts(tf.keras.layers.Layer):
    """x [B, n] -> one gated mixture [B, expert_units[-1]] per task."""

    def __init__(self, num_experts=4, expert_units=(64, 32), num_tasks=1, **kwargs):
        super().__init__(**kwargs)
        self.num_experts, self.num_tasks = int(num_experts), int(num_tasks)
        self.expert_units = [int(u) for u in expert_units]
        self.experts = [MLP(self.expert_units, name=f"expert_{i}") for i in range(self.num_experts)]
        self.gates = [tf.keras.layers.Dense(self.num_experts, activation="softmax", name=f"gate_{t}")
                      for t in range(self.num_tasks)]

    def call(self, x):
        experts = tf.stack([e(x) for e in self.experts], axis=1)       # [B, E, u]
        return [tf.reduce_sum(tf.expand_dims(g(x), -1) * experts, axis=1) for g in self.gates]

    def get_config(self):
        return {**super().get_config(), "num_experts": self.num_experts,
                "expert_units": self.expert_units, "num_tasks": self.num_tasks}


def build_mmoe(schema, embedding_dim=8, num_experts=4, expert_units=(64, 32), tower_units=(16,)):
    inputs = schema.keras_inputs()
    parts = [tf.keras.layers.Embedding(f.vocab_size, zin.dim_of(f, embedding_dim), name=f"emb_{f.name}")(
        inputs[f.name]) for f in schema.categorical]
    for f in schema.sequences:
        ids = inputs[f.name]
        emb = tf.keras.layers.Embedding(f.vocab_size, zin.dim_of(f, embedding_dim), name=f"emb_{f.name}")(ids)
        mask = tf.expand_dims(tf.cast(tf.not_equal(ids, 0), tf.float32), -1)
        parts.append(tf.reduce_sum(emb * mask, 1) / tf.maximum(tf.reduce_sum(mask, 1), 1.0))
    parts.append(zin.dense_block(schema, inputs))
    x = zin.concat(parts, "shared_input")
    tasks = list(schema.labels)
    mixed = MixtureOfExperts(num_experts, expert_units, len(tasks), name="mmoe")(x)
    outputs = {}
    for task, h in zip(tasks, mixed):
        h = MLP(tower_units, name=f"tower_{task}")(h)
        outputs[task] = zin.prediction(h, schema, name=task)
    if len(tasks) == 1:
        outputs = outputs[tasks[0]]
    return tf.keras.Model(inputs, outputs, name="mmoe")
