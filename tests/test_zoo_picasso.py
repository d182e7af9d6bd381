"""Every zoo model under picasso_tf.optimize: all its embedding sites are recognised,
and 20 Adagrad steps give the baseline's losses and AUC."""
import numpy as np
import pytest
import tensorflow as tf

import picasso_tf as picasso
from picasso_tf.data import roc_auc
from test_zoo import ALL, MIXED, random_data, zoo

BATCH, STEPS = 64, 20


def twins(name):
    """The zoo model twice with the same initial weights."""
    tf.keras.utils.set_random_seed(11)
    baseline = zoo.build(name, MIXED)
    original = zoo.build(name, MIXED)
    original.set_weights(baseline.get_weights())
    return baseline, original


def train(model, data):
    model.compile(optimizer=tf.keras.optimizers.Adagrad(0.05), loss="binary_crossentropy")
    losses = []
    for step in range(STEPS):
        batch = data.take(np.arange(step * BATCH, (step + 1) * BATCH))
        losses.append(model.train_on_batch(batch.features, batch.label_dict))
    return np.array(losses)


@pytest.mark.parametrize("name", ALL)
def test_zoo_model_is_fully_rewritten_and_trains_like_the_baseline(name):
    baseline, original = twins(name)
    optimized = picasso.optimize(original)
    analysis = optimized.picasso.reports["training"]["analysis"]
    assert analysis["sites"], optimized.picasso.report()
    assert not analysis["left_alone"], optimized.picasso.report()

    data = random_data(MIXED, BATCH * STEPS, seed=3)
    np.testing.assert_allclose(train(optimized, data), train(baseline, data), rtol=1e-5, atol=1e-5)

    test = random_data(MIXED, 512, seed=4)
    labels = test.label_dict["click"]
    # The baseline called directly: its own predict_function would be one more trace.
    auc = [roc_auc(labels, np.ravel(tf.nest.flatten(probs)[0]))
           for probs in (baseline(test.features), optimized.predict(test.features, verbose=0))]
    assert abs(auc[0] - auc[1]) <= 0.002, auc
