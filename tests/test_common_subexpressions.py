"""Common subexpressions merged before differentiation (picasso_tf.graph.common_subexpressions):
identical pure ops merge, anything stateful or a source never does, and a model written
by others that slices each field out once per pair (DeepCTR's FwFM) trains as Keras does
with one stack-sized slice gradient per field instead of one per pair."""
import numpy as np
import pytest
import tensorflow as tf

import picasso_tf as picasso
from picasso_tf.graph.common_subexpressions import merge_common_subexpressions
from picasso_tf.graph.graph_def_util import prune

deepctr_models = pytest.importorskip("deepctr.models")
from deepctr.feature_column import SparseFeat  # noqa: E402

FIELDS, BATCH, STEPS = 5, 32, 8


def test_identical_pure_ops_merge_and_stateful_ops_and_placeholders_do_not():
    @tf.function(autograph=False)
    def f(a, b):
        first = tf.reshape(a[:, 1:2], [-1]) * 2.0
        second = tf.reshape(a[:, 1:2], [-1]) * 2.0          # the same ops again: merges
        noise = tf.random.uniform([3]) + tf.random.uniform([3])   # stateful: both draws stay
        scoped = []
        for scope in ("unit_0", "unit_1"):        # the same op in two layers' scopes: both stay
            with tf.name_scope(scope):
                scoped.append(a * 3.0)
        return first + second, a + b, noise, scoped[0] - scoped[1]

    graph = f.get_concrete_function(tf.TensorSpec([None, 3]), tf.TensorSpec([None, 3])).graph
    graph_def = graph.as_graph_def()
    outputs = [t.name for t in graph.outputs]
    merged, replacements, count = merge_common_subexpressions(graph_def, outputs)
    ops = [n.op for n in merged.node]
    assert ops.count("StridedSlice") == 1 and ops.count("Reshape") == 1
    assert ops.count("Mul") == 3                  # the two copies merged, the two scoped ones not
    assert ops.count("RandomUniform") == 2 and ops.count("Placeholder") == 2
    # Constants are compared by value, never merged: each stays in its own scope.
    assert ops.count("Const") == [n.op for n in graph_def.node].count("Const")
    assert count == sum(1 for n in graph_def.node) - len(merged.node)
    a = np.arange(6, dtype="float32").reshape(2, 3)
    outputs = [replacements.get(t, t) for t in outputs]
    got = tf.compat.v1.wrap_function(
        lambda x, y: tf.graph_util.import_graph_def(merged, {"a:0": x, "b:0": y}, outputs[:2]),
        [tf.TensorSpec([None, 3]), tf.TensorSpec([None, 3])])(a, 2 * a)
    np.testing.assert_array_equal(got[0], 4 * a[:, 1])
    np.testing.assert_array_equal(got[1], 3 * a)


def fwfm():
    features = [SparseFeat(f"c{i}", 30 + i, embedding_dim=4) for i in range(FIELDS)]
    return deepctr_models.FwFM(features, features, dnn_hidden_units=(8,), seed=1)


def batches():
    rng = np.random.default_rng(0)
    return [({f"c{i}": rng.integers(0, 30, (BATCH, 1)) for i in range(FIELDS)},
             (rng.random((BATCH, 1)) < 0.3).astype("float32")) for _ in range(STEPS)]


def slice_gradients(model, x, y):
    """The StridedSliceGrad ops the training step runs, on the [B, fields, dim] stack."""
    specs = ({k: tf.TensorSpec([None, 1], tf.int64) for k in x}, tf.TensorSpec([None, 1], tf.float32))
    graph = tf.function(model.train_step).get_concrete_function(specs).graph
    run = {n.name for n in prune(graph.as_graph_def(), [t.name for t in graph.outputs],
                                 keep=[op.name for op in graph.control_outputs]).node}
    return [op for op in graph.get_operations() if op.name in run and op.type == "StridedSliceGrad"
            and op.outputs[0].shape.rank == 3]


def test_deepctr_fwfm_trains_as_keras_with_one_slice_gradient_per_field():
    baseline = fwfm()
    models = {}
    for name, merge in (("merged", True), ("apart", False)):
        models[name] = picasso.optimize(fwfm(), merge_common_subexpressions=merge)
        models[name].original.set_weights(baseline.get_weights())
    assert models["merged"].picasso.reports["training"]["common_subexpressions_merged"] > 0
    assert models["apart"].picasso.reports["training"]["common_subexpressions_merged"] is None
    data = batches()
    losses = {}
    for name, model in (("baseline", baseline), *models.items()):
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.1), loss="binary_crossentropy")
        losses[name] = [model.train_on_batch(x, y) for x, y in data]
    np.testing.assert_allclose(losses["merged"], losses["baseline"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses["apart"], losses["baseline"], rtol=1e-5, atol=1e-6)
    models["merged"].picasso.write_back()
    for b, o in zip(baseline.weights, models["merged"].original.weights):
        np.testing.assert_allclose(o.numpy(), b.numpy(), rtol=1e-4, atol=1e-6, err_msg=b.name)
    pairs = FIELDS * (FIELDS - 1) // 2
    x, y = data[0]
    assert len(slice_gradients(models["apart"], x, y)) == 2 * pairs
    assert len(slice_gradients(models["merged"], x, y)) == FIELDS
