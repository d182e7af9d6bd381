"""The zoo's quality checks: MovieLens-100K (random and time-ordered splits) and planted
synthetic data. Used by tests/test_zoo.py (small settings) and benchmarks/zoo_quality.py
(the README table). The models themselves never import this module.

Synthetic task. picasso_tf.data.synthetic draws Zipf ids and labels from a planted
model; a model is judged by the gap between the planted probabilities' AUC and its own
on the same test examples. The zoo's schema is small enough that every term of the
planted model can be learnt from SYNTHETIC_ROWS examples: four one-hot features (vocab
10-50, mixed embedding hints), a multi-hot field and a behaviour pair (item /
hist_item), num_interactions=2 planted pairwise interactions. It has no dense
features on purpose: the generator shows a dense value as log1p(floor(exp(mu + sigma z)))
while the planted logit uses z itself, so part of that signal is censored away and no
model can reach the planted AUC (measured: ~0.02 extra gap with two dense features).
LR is linear and cannot represent the planted interactions or the DIN-style
target x behaviour term, so its check uses `linear=True`: the same features with
hist_item as a plain multi-hot field (no group) and no planted interactions, a planted
model inside LR's class; its gap on the full task is reported too.
"""
import numpy as np

MOVIELENS_SEED = 0
SYNTHETIC_ROWS = 100_000
SYNTHETIC_SEED = 1
# The synthetic task trains longer, on bigger batches (the recipe's learning rate scaled
# with the batch size). 4 epochs is the fewest that keeps every zoo model within
# GAP_LIMIT: at 2, most models stay outside it, so the tests cannot train less.
SYNTHETIC_EPOCHS = 4
SYNTHETIC_BATCH = 1024
SYNTHETIC_INTERACTIONS = 2
GAP_LIMIT = 0.02
AUC_LIMIT = 0.75


def movielens(split="random", seed=MOVIELENS_SEED):
    """(train, test) of MovieLens-100K in the CTR framing, 80/20."""
    from picasso_tf.data import load_movielens
    return load_movielens(split=split, test_fraction=0.2, seed=seed)


def synthetic_schema(linear=False):
    from picasso_tf.data import Feature, Schema
    return Schema([
        Feature("user", "categorical", vocab_size=50, embedding_dim=16),
        Feature("item", "categorical", vocab_size=50, embedding_dim=8, group="item"),
        Feature("c0", "categorical", vocab_size=50),
        Feature("c1", "categorical", vocab_size=10, embedding_dim=4),
        Feature("tags", "sequence", vocab_size=30, max_len=5),
        Feature("hist_item", "sequence", vocab_size=50, max_len=10, group=None if linear else "item"),
    ], labels=["label"], name="zoo-synthetic-linear" if linear else "zoo-synthetic")


def synthetic(rows=SYNTHETIC_ROWS, seed=SYNTHETIC_SEED, linear=False):
    """(train, test, planted_auc): an 80/20 split and the planted model's test AUC."""
    from picasso_tf.data import generate, roc_auc
    data = generate(synthetic_schema(linear), rows, seed=seed,
                    num_interactions=0 if linear else SYNTHETIC_INTERACTIONS)
    train, test = data.split(0.2, seed=seed)
    return train, test, roc_auc(test.labels, test.extras["planted_probability"])


def synthetic_recipe(name):
    """Overrides of `name`'s recipe for the synthetic task: SYNTHETIC_EPOCHS epochs of
    SYNTHETIC_BATCH, the learning rate scaled linearly with the batch size."""
    from picasso_tf import models as zoo
    base = zoo.info(name).training
    return dict(epochs=SYNTHETIC_EPOCHS, batch_size=SYNTHETIC_BATCH,
                learning_rate=base["learning_rate"] * SYNTHETIC_BATCH / base["batch_size"])


def synthetic_is_linear(name):
    """Whether `name`'s synthetic check runs on the linear planted model."""
    return name == "lr"


def trainable_params(model):
    return int(sum(np.prod(w.shape) for w in model.trainable_weights))


def default_size(name, schema):
    """Trainable parameters of `name` built with its defaults for `schema`."""
    import tensorflow as tf
    from picasso_tf import models as zoo
    model = zoo.get(name)(schema)
    count = trainable_params(model)
    del model
    tf.keras.backend.clear_session()
    return count
