"""A tf.GradientTape training loop around a wrapped model: the zoo's DLRM on generated
Criteo-like data.

The tape differentiates the rewritten forward pass. Inside model.picasso.fused_gradients
the tables' gradient kernels update them (their gradients come back None), and
model.picasso.apply_gradients applies the rest, as fit's step does. A plain
optimizer.apply_gradients(zip(grads, variables)) without the block gives the same
result, more slowly. See docs/custom_loops.md.

    python examples/custom_loop.py
"""
import tensorflow as tf

import picasso_tf
import picasso_tf.models as zoo
from picasso_tf.data import criteo_schema, generate

tf.keras.utils.set_random_seed(0)
schema = criteo_schema(buckets=1000)                    # 13 dense + 26 categorical features
dataset = generate(schema, 2048, seed=0).dataset(128, shuffle=True)

model = picasso_tf.optimize(zoo.get("dlrm")(schema))
optimizer = tf.keras.optimizers.Adagrad(0.05)
loss_fn = tf.keras.losses.BinaryCrossentropy()


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
        if model.losses:                                # regularisers, as for the plain model
            loss += tf.add_n(model.losses)
    with model.picasso.fused_gradients(optimizer):     # tables updated in their gradient kernels
        grads = tape.gradient(loss, model.trainable_variables)
    model.picasso.apply_gradients(optimizer, zip(grads, model.trainable_variables))
    return loss


for epoch in range(2):
    losses = [float(train_step(x, y)) for x, y in dataset]
    print(f"epoch {epoch + 1}: mean loss {sum(losses) / len(losses):.4f} over {len(losses)} steps")
print("optimizer:", model.picasso.optimizer_note)
