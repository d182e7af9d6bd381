"""A TensorFlow Recommenders ranking model on the bundled MovieLens-100K.

tfrs.Model has its own train_step, which calls the model's compute_loss; the wrapped
model runs it as written, with the rewritten forward pass inside (docs/custom_loops.md).

    python examples/tfrs_ranking.py
"""
import tensorflow as tf
import tensorflow_recommenders as tfrs

import picasso_tf
from picasso_tf.data import load_movielens


class Ranking(tfrs.models.Model):
    """TFRS' ranking tutorial on implicit labels: user and movie embeddings, an MLP."""

    def __init__(self, users, movies):
        super().__init__()
        self.user = tf.keras.layers.Embedding(users, 16)
        self.movie = tf.keras.layers.Embedding(movies, 16)
        self.mlp = tf.keras.Sequential([tf.keras.layers.Dense(32, activation="relu"), tf.keras.layers.Dense(1)])
        self.task = tfrs.tasks.Ranking(loss=tf.keras.losses.BinaryCrossentropy(from_logits=True),
                                       metrics=[tf.keras.metrics.AUC(from_logits=True, name="auc")])

    def call(self, features):
        return self.mlp(tf.concat([self.user(features["user_id"]), self.movie(features["item_id"])], -1))

    def compute_loss(self, inputs, training=False):
        features, labels = inputs
        return self.task(labels=labels, predictions=self(features))


tf.keras.utils.set_random_seed(0)
train, test = load_movielens()                           # rating >= 4 is the label
train = train.take(range(20_000))                        # a quarter, to run in seconds
keep = ("user_id", "item_id")
as_pairs = lambda x, y: ({k: x[k] for k in keep}, y)    # noqa: E731
train_ds, test_ds = (d.dataset(512, shuffle=True).map(as_pairs) for d in (train, test))

model = picasso_tf.optimize(Ranking(train.schema["user_id"].vocab_size, train.schema["item_id"].vocab_size))
model.compile(optimizer=tf.keras.optimizers.Adagrad(0.1))
model.fit(train_ds, epochs=3, verbose=2)
print("test:", {k: round(float(v), 4) for k, v in model.evaluate(test_ds, return_dict=True, verbose=0).items()})
print("optimizer:", model.picasso.optimizer_note)
