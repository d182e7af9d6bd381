"""The interactions pass: a DLRM-style dot interaction (x times x transposed, gathered
at constant positions) becomes one PicassoPairwiseDots kernel, the model trains as
before, and any other self-product is left alone with the reason in the report."""
import functools

import numpy as np
import pytest
import tensorflow as tf

import picasso_tf as picasso
from test_zoo import MIXED, random_data, zoo

# Its tests run on one pytest-xdist worker: they share dlrm_baseline's training, cached for the module.
pytestmark = pytest.mark.xdist_group("test_interactions")

BATCH, STEPS, FIELDS, DIM = 64, 20, 6, 4


def interactions_report(model):
    [report] = [p for p in model.picasso.reports["training"]["passes"] if p["pass"] == "interactions"]
    return report


def forward_nodes(model, features):
    """(name, op type) of the nodes of the rewritten training forward."""
    graph_def = model.rewritten_forward(training=True, example_inputs=features).captured.graph_def
    return [(n.name, n.op) for n in graph_def.node]


def twin_models(build):
    tf.keras.utils.set_random_seed(5)
    baseline, original = build(), build()
    original.set_weights(baseline.get_weights())
    return baseline, original


def train(model, data):
    model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="binary_crossentropy")
    return np.array([model.train_on_batch(x, y) for x, y in data])


def dlrm_batches():
    data = random_data(MIXED, BATCH * STEPS, seed=3)
    return data, [(data.take(np.arange(s * BATCH, (s + 1) * BATCH)).features,
                   data.take(np.arange(s * BATCH, (s + 1) * BATCH)).label_dict) for s in range(STEPS)]


@functools.lru_cache(maxsize=None)
def dlrm_baseline():
    """The plain zoo DLRM's losses over dlrm_batches and its predictions after them:
    trained once for both settings of packing."""
    baseline, _ = twin_models(lambda: zoo.build("dlrm", MIXED))
    data, batches = dlrm_batches()
    return train(baseline, batches), baseline.predict(data.take(np.arange(256)).features, verbose=0)


@pytest.mark.parametrize("packing", [True, False])
def test_the_zoo_dlrm_interaction_is_fused_and_trains_like_the_baseline(packing):
    _, original = twin_models(lambda: zoo.build("dlrm", MIXED))     # the baseline's initial weights
    optimized = picasso.optimize(original, packing=packing)
    data, batches = dlrm_batches()
    baseline_losses, baseline_predictions = dlrm_baseline()

    [fused] = interactions_report(optimized)["fused"]
    features = 1 + len(MIXED.categorical) + len(MIXED.sequences)   # the bottom MLP's vector too
    assert fused["features"] == features and fused["pairs"] == features * (features - 1) // 2
    assert fused["concat"] is not None, "the top MLP's input is the fused kernel's output"
    nodes = forward_nodes(optimized, batches[0][0])
    assert "PicassoPairwiseDots" in [op for _, op in nodes]
    assert not [name for name, _ in nodes if name.startswith("dlrm/interaction/")], \
        "the product, its reshape and its gather are gone"
    assert fused["concat"] not in [name for name, _ in nodes], "and the concatenation"
    np.testing.assert_allclose(train(optimized, batches), baseline_losses, rtol=1e-5, atol=1e-5)
    # Adam at lr 0.01 amplifies the kernels' different summation order over 20 steps to
    # a few 1e-5 (with SGD the predictions agree to 1e-7).
    np.testing.assert_allclose(optimized.predict(data.take(np.arange(256)).features, verbose=0),
                               baseline_predictions, rtol=1e-4, atol=1e-5)


def interaction_model(product, gather=True, head=lambda z, stacked: z):
    """FIELDS embeddings of width DIM, stacked, their self-product (`product`) and, with
    `gather`, its strictly lower triangle; then a sigmoid unit on head(products, stacked)."""
    def build():
        x = {f"f{i}": tf.keras.Input((), dtype="int64", name=f"f{i}") for i in range(FIELDS)}
        stacked = tf.stack([tf.keras.layers.Embedding(50, DIM)(x[f"f{i}"]) for i in range(FIELDS)], axis=1)
        z = tf.reshape(product(stacked), [-1, FIELDS * FIELDS])
        if gather:
            z = tf.gather(z, [i * FIELDS + j for i in range(FIELDS) for j in range(i)], axis=1)
        return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(head(z, stacked)))
    return build


def beside_a_projection(z, stacked):
    return tf.concat([tf.keras.layers.Dense(3)(tf.reshape(stacked, [-1, FIELDS * DIM])), z], axis=1)


@pytest.mark.parametrize("head, fused_concat", [
    (beside_a_projection, True),
    (lambda z, stacked: beside_a_projection(z, stacked) + tf.reduce_sum(z, axis=1, keepdims=True), False),
], ids=["concatenated", "also_read_elsewhere"])
def test_a_concatenation_of_the_products_is_written_by_the_kernel(head, fused_concat):
    baseline, original = twin_models(interaction_model(lambda x: tf.matmul(x, x, transpose_b=True), head=head))
    optimized = picasso.optimize(original)
    [fused] = interactions_report(optimized)["fused"]
    assert (fused["concat"] is not None) == fused_concat
    nodes = forward_nodes(optimized, interaction_batches(1)[0][0])
    assert ("ConcatV2" in [op for _, op in nodes]) != fused_concat
    data = interaction_batches(10)
    np.testing.assert_allclose(train(optimized, data), train(baseline, data), rtol=1e-5, atol=1e-6)


def interaction_batches(steps):
    rng = np.random.default_rng(0)
    return [({f"f{i}": rng.integers(0, 50, BATCH) for i in range(FIELDS)},
             (rng.random(BATCH) < 0.4).astype("float32")) for _ in range(steps)]


@pytest.mark.parametrize("product", [
    lambda x: tf.matmul(x, x, transpose_b=True),
    lambda x: tf.matmul(x, tf.transpose(x, [0, 2, 1])),
], ids=["transpose_b", "explicit_transpose"])
def test_both_spellings_of_the_transposed_product_are_fused(product):
    baseline, original = twin_models(interaction_model(product))
    optimized = picasso.optimize(original)
    data = interaction_batches(10)
    assert interactions_report(optimized)["fused"] == [
        {"gather": interactions_report(optimized)["fused"][0]["gather"], "concat": None, "features": FIELDS,
         "pairs": FIELDS * (FIELDS - 1) // 2}]
    np.testing.assert_allclose(train(optimized, data), train(baseline, data), rtol=1e-5, atol=1e-6)


def half_precision_product(x):
    half = tf.cast(x, tf.float16)
    return tf.cast(tf.matmul(half, half, transpose_b=True), tf.float32)


@pytest.mark.parametrize("product, gather, why", [
    (lambda x: tf.matmul(x, x, transpose_b=True), False, "the reshaped product is not read by one gather"),
    (half_precision_product, True, "is float16; the fused kernel takes float32 and float64"),
], ids=["not_gathered", "float16"])
def test_other_self_products_are_left_alone_with_the_reason(product, gather, why):
    baseline, original = twin_models(interaction_model(product, gather=gather))
    optimized = picasso.optimize(original)
    report = interactions_report(optimized)
    assert report["fused"] == []
    [left] = report["left_alone"]
    assert why in left["why"]
    data = interaction_batches(5)
    np.testing.assert_allclose(train(optimized, data), train(baseline, data), rtol=1e-5, atol=1e-6)


def test_the_pass_can_be_switched_off():
    _, original = twin_models(interaction_model(lambda x: tf.matmul(x, x, transpose_b=True)))
    optimized = picasso.optimize(original, interactions=False)
    assert interactions_report(optimized) == {"pass": "interactions", "enabled": False}
    assert "PicassoPairwiseDots" not in [op for _, op in forward_nodes(optimized, interaction_batches(1)[0][0])]
