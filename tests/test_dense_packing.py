"""The dense packing pass: layer calls that repeat the same computation per expert or
per field run as one vectorised computation, the model trains and predicts as without
the pass, what Keras does to a variable (trainable=False, constraints) still holds, and
calls that depend on each other are left alone with the reason in the report."""
import numpy as np
import pytest
import tensorflow as tf

import picasso_tf as picasso

BATCH, STEPS, FIELDS, EXPERTS = 32, 20, 3, 3
PRODUCTS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")


def features(rows, seed):
    rng = np.random.default_rng(seed)
    x = {f"f{i}": rng.integers(0, 40, rows).astype("int64") for i in range(FIELDS)}
    x["dense"] = rng.normal(size=(rows, 5)).astype("float32")
    return x, (rng.random((rows, 1)) < 0.3).astype("float32")


def experts_model(frozen_expert=None, constraint=None):
    """Embeddings and a dense input, EXPERTS experts (two Dense layers each, made by the
    same code), a softmax gate mixing them and a sigmoid head: MMoE with one task."""
    x = {f"f{i}": tf.keras.Input((), dtype="int64", name=f"f{i}") for i in range(FIELDS)}
    x["dense"] = tf.keras.Input((5,), name="dense")
    shared = tf.keras.layers.Concatenate()(
        [tf.keras.layers.Embedding(40, 4)(x[f"f{i}"]) for i in range(FIELDS)] + [x["dense"]])
    experts = []
    for e in range(EXPERTS):
        expert = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="relu", kernel_constraint=constraint),
                                      tf.keras.layers.Dense(4, activation="relu")], name=f"expert_{e}")
        expert.trainable = e != frozen_expert
        experts.append(expert(shared))
    gate = tf.keras.layers.Dense(EXPERTS, activation="softmax", name="gate")(shared)
    mixed = tf.reduce_sum(tf.stack(experts, axis=1) * gate[:, :, None], axis=1)
    return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid", name="head")(mixed))


class Residual(tf.keras.layers.Layer):
    """call([x, h]) -> tanh(x W) + h."""

    def build(self, shapes):
        self.w = self.add_weight("w", (shapes[0][-1], shapes[1][-1]))

    def call(self, inputs):
        x, h = inputs
        return tf.tanh(tf.matmul(x, self.w)) + h


def chained_model():
    """Two layers made by the same code, both reading x, the second reading the first's
    output too."""
    x = tf.keras.Input((8,), name="x")
    h = Residual(name="block_0")([x, x * 2.0])
    h = Residual(name="block_1")([x, h])
    return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid", name="head")(h))


def towers_model():
    """Two towers made by the same code over different inputs."""
    x = [tf.keras.Input((8,), name=f"x{k}") for k in range(2)]
    towers = [tf.keras.layers.Dense(4, activation="relu", name=f"tower_{k}")(x[k]) for k in range(2)]
    return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid", name="head")(tf.concat(towers, 1)))


def dense_packing_report(model):
    [report] = [p for p in model.picasso.reports["training"]["passes"] if p["pass"] == "dense_packing"]
    return report


def products_in_forward(model, example):
    graph_def = model.rewritten_forward(training=True, example_inputs=example).captured.graph_def
    return sum(n.op in PRODUCTS for n in graph_def.node)


def trained(model, optimizer, data):
    model.compile(optimizer=optimizer, loss="binary_crossentropy")
    losses = [model.train_on_batch(x, y) for x, y in data]
    return np.array(losses), model.get_weights()


def batches(seed=0):
    x, y = features(BATCH * STEPS, seed)
    return [({k: v[s * BATCH:(s + 1) * BATCH] for k, v in x.items()}, y[s * BATCH:(s + 1) * BATCH])
            for s in range(STEPS)]


def twins(build, **options):
    tf.keras.utils.set_random_seed(7)
    baseline, original = build(), build()
    original.set_weights(baseline.get_weights())
    return baseline, picasso.optimize(original, **options)


@pytest.mark.parametrize("optimizer", [
    lambda: tf.keras.optimizers.SGD(0.1), lambda: tf.keras.optimizers.Adagrad(0.05),
    lambda: tf.keras.optimizers.Adam(0.01)], ids=["sgd", "adagrad", "adam"])
def test_experts_run_as_one_computation_and_train_like_the_baseline(optimizer):
    data = batches()
    baseline, optimized = twins(experts_model)
    _, unpacked = twins(experts_model, dense_packing=False)
    report = dense_packing_report(optimized)
    [packed] = report["packed"]
    assert packed["units"] == EXPERTS and [s.split("/")[-2] for s in packed["scopes"]] == \
        [f"expert_{e}" for e in range(EXPERTS)], "the experts' first layers, which all read the same input"
    # Their products become one; the second layers (each its own input and weights) stand
    # down, and say why.
    assert products_in_forward(optimized, data[0][0]) == 1 + EXPERTS + 2
    assert products_in_forward(unpacked, data[0][0]) == 2 * EXPERTS + 2
    assert any(g["units"] == EXPERTS and "own input by its own weights" in g["why"] for g in report["left_alone"])

    losses, weights = trained(optimized, optimizer(), data)
    base_losses, base_weights = trained(baseline, optimizer(), data)
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5, atol=1e-6)
    for got, want in zip(weights, base_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    test = features(200, seed=9)[0]
    np.testing.assert_allclose(optimized.predict(test, verbose=0), baseline.predict(test, verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_a_frozen_expert_stays_frozen_and_a_constraint_still_holds():
    data = batches(seed=1)
    build = lambda: experts_model(frozen_expert=1, constraint=tf.keras.constraints.NonNeg())   # noqa: E731
    baseline, optimized = twins(build)
    assert [g["units"] for g in dense_packing_report(optimized)["packed"]] == [EXPERTS], \
        "the experts' first layers still have the same ops: only their variables' treatment differs"
    frozen_before = [w.numpy() for w in optimized.picasso.original.get_layer("expert_1").weights]
    _, weights = trained(optimized, tf.keras.optimizers.Adagrad(0.5), data)
    _, base_weights = trained(baseline, tf.keras.optimizers.Adagrad(0.5), data)
    for got, want in zip(weights, base_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for before, after in zip(frozen_before, optimized.picasso.original.get_layer("expert_1").weights):
        np.testing.assert_array_equal(before, after.numpy())
    for e in (0, 2):
        assert optimized.picasso.original.get_layer(f"expert_{e}").layers[0].kernel.numpy().min() >= 0.0


def test_layers_that_read_each_other_are_left_alone_with_the_reason():
    rng = np.random.default_rng(3)
    data = [(rng.normal(size=(BATCH, 8)).astype("float32"), (rng.random((BATCH, 1)) < 0.5).astype("float32"))
            for _ in range(5)]
    baseline, optimized = twins(chained_model)
    report = dense_packing_report(optimized)
    assert report["packed"] == []
    [left] = report["left_alone"]
    assert left["units"] == 2 and "not independent" in left["why"]
    losses, _ = trained(optimized, tf.keras.optimizers.SGD(0.1), data)
    base_losses, _ = trained(baseline, tf.keras.optimizers.SGD(0.1), data)
    np.testing.assert_allclose(losses, base_losses, rtol=1e-6)


def test_switched_off_it_leaves_the_graph_alone():
    _, optimized = twins(experts_model, dense_packing=False)
    x = batches()[0][0]
    assert products_in_forward(optimized, x) == 2 * EXPERTS + 2
    assert dense_packing_report(optimized) == {"pass": "dense_packing", "enabled": False}


def test_towers_over_their_own_inputs_stand_down_with_the_reason():
    _, optimized = twins(towers_model)
    report = dense_packing_report(optimized)
    assert report["packed"] == []
    [left] = report["left_alone"]
    assert left["units"] == 2 and "own input by its own weights" in left["why"]


class Noisy(tf.keras.layers.Layer):
    """x W times uniform noise drawn with a fixed op seed (the same op in every copy)."""

    def build(self, shape):
        self.w = self.add_weight("w", (shape[-1], 4))

    def call(self, x):
        return tf.matmul(x, self.w) * tf.random.uniform([4], seed=1)


def test_units_that_draw_random_numbers_are_left_alone():
    def build():
        x = tf.keras.Input((8,), name="x")
        units = [Noisy(name=f"noisy_{k}")(x) for k in range(3)]
        return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid", name="head")(tf.concat(units, 1)))
    _, optimized = twins(build)
    report = dense_packing_report(optimized)
    assert report["packed"] == []
    [left] = report["left_alone"]
    assert left["units"] == 3 and "RandomUniform" in left["why"] and "random" in left["why"]


@pytest.mark.parametrize("inputs", [300, 1200])
def test_mid_sized_experts_stand_down_with_the_reason_and_large_ones_pack(inputs):
    """Experts whose first layer takes 300 x 64 multiply-adds per example gain nothing
    packed (they would only add copies), so the group stands down and says why; at
    1200 x 64 the one wide product pays again (the small experts above, on the same
    code path, pack too)."""
    def build():
        x = tf.keras.Input((inputs,), name="x")
        experts = [tf.keras.layers.Dense(64, activation="relu", name=f"expert_{e}")(x) for e in range(3)]
        return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid", name="head")(tf.concat(experts, 1)))
    baseline, optimized = twins(build)
    report = dense_packing_report(optimized)
    if inputs == 300:
        assert report["packed"] == []
        [left] = report["left_alone"]
        assert left["units"] == 3 and "19,200 multiply-adds per example (between 8,192 and 65,536)" in left["why"]
    else:
        [packed] = report["packed"]
        assert packed["units"] == 3 and packed["macs_per_example"] == 76_800
        rng = np.random.default_rng(4)
        data = [(rng.normal(size=(32, inputs)).astype(np.float32), (rng.random((32, 1)) < 0.5).astype(np.float32))
                for _ in range(3)]
        losses, weights = trained(optimized, tf.keras.optimizers.Adagrad(0.05), data)
        base_losses, base_weights = trained(baseline, tf.keras.optimizers.Adagrad(0.05), data)
        np.testing.assert_allclose(losses, base_losses, rtol=1e-5, atol=1e-6)
        for got, want in zip(weights, base_weights):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
