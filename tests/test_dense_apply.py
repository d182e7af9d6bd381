"""The fused update of the dense variables (picasso_tf.runtime.dense_update): one op per
dtype trains exactly like the Keras optimizer's apply_gradients, every weight, slot and
the step count; what Keras does that it does not makes it stand down, with the reason in
the report; it takes ops out of the step; packing=False leaves Keras' update alone."""
import numpy as np
import pytest
import tensorflow as tf

import picasso_tf as picasso
from picasso_tf.graph.graph_def_util import prune
from picasso_tf.ops import dense_apply
from picasso_tf.runtime import dense_update
from picasso_tf.runtime.dense_update import make_dense_update
from picasso_tf.config import Config

K = tf.keras.optimizers
BATCH, STEPS = 32, 20
FUSED_OP = "PicassoDenseApply"


def features(rows, seed):
    rng = np.random.default_rng(seed)
    x = {"item": rng.integers(0, 50, rows).astype("int64"), "dense": rng.normal(size=(rows, 6)).astype("float32")}
    return x, (rng.random((rows, 1)) < 0.3).astype("float32")


def batches(seed=0):
    x, y = features(BATCH * STEPS, seed)
    return [({k: v[s * BATCH:(s + 1) * BATCH] for k, v in x.items()}, y[s * BATCH:(s + 1) * BATCH])
            for s in range(STEPS)]


def model_with_embedding():
    """An embedding (a packed table), a constrained Dense, a frozen Dense and a head."""
    x = {"item": tf.keras.Input((), dtype="int64", name="item"), "dense": tf.keras.Input((6,), name="dense")}
    h = tf.keras.layers.Concatenate()([tf.keras.layers.Embedding(50, 4)(x["item"]), x["dense"]])
    h = tf.keras.layers.Dense(16, activation="relu", kernel_constraint=tf.keras.constraints.MaxNorm(0.5),
                              name="constrained")(h)
    h = tf.keras.layers.Dense(8, activation="tanh", trainable=False, name="frozen")(h)
    h = tf.keras.layers.Dense(8, activation="relu", name="hidden")(h)
    return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid", name="head")(h))


def dense_only_model():
    x = {"dense": tf.keras.Input((6,), name="dense")}
    h = tf.keras.layers.Dense(8, activation="relu", name="hidden")(x["dense"])
    return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid", name="head")(h))


def twins(build, **options):
    tf.keras.utils.set_random_seed(3)
    baseline, original = build(), build()
    original.set_weights(baseline.get_weights())
    return baseline, picasso.optimize(original, **options)


def trained(model, optimizer, data):
    model.compile(optimizer=optimizer, loss="binary_crossentropy")
    losses = [model.train_on_batch(x, y) for x, y in data]
    return np.array(losses), model.get_weights(), [v.numpy() for v in model.optimizer.variables]


def step_op_counts(model, data):
    return picasso.profile(model, data[0])["ops"]["step_picasso"]["by_op"]


def no_bias_decay(optimizer):
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


OPTIMIZERS = {
    "sgd": lambda: K.SGD(0.1),
    "sgd_momentum": lambda: K.SGD(0.1, momentum=0.9),
    "sgd_nesterov": lambda: K.SGD(0.1, momentum=0.9, nesterov=True),
    "adagrad": lambda: K.Adagrad(0.1),
    "adagrad_weight_decay": lambda: K.Adagrad(0.1, weight_decay=0.01),
    "ftrl": lambda: K.Ftrl(0.05, l1_regularization_strength=0.001),
    "adam": lambda: K.Adam(0.01),
    "adam_amsgrad_schedule": lambda: K.Adam(K.schedules.ExponentialDecay(0.02, 3, 0.7), amsgrad=True),
    "adamw_excluding_biases": lambda: no_bias_decay(K.AdamW(0.01, weight_decay=0.05)),
    "rmsprop": lambda: K.RMSprop(0.01),
    "rmsprop_centered_momentum": lambda: K.RMSprop(0.01, momentum=0.5, centered=True),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_trains_like_keras(name):
    """Against the same rewritten model updated by Keras' apply_gradients (the same
    forward and gradients: only the update differs) every weight and slot within 1e-6
    (SGD, Adam and FTRL to the bit; TF's graph optimisations round Keras' Adagrad and
    AdamW in places otherwise than its own formula, RMSprop's rsqrt differs in the last
    bit), and the weights against the plain Keras model as every rewrite is (1e-5)."""
    data = batches()
    baseline, optimized = twins(model_with_embedding)
    _, keras_update = twins(model_with_embedding, fused_dense_optimizer=False)
    losses, weights, slots = trained(optimized, OPTIMIZERS[name](), data)
    keras_losses, keras_weights, keras_slots = trained(keras_update, OPTIMIZERS[name](), data)
    base_losses, base_weights, base_slots = trained(baseline, OPTIMIZERS[name](), data)
    assert "dense variables: fused" in optimized.picasso.report()
    np.testing.assert_allclose(losses, keras_losses, rtol=1e-6, atol=2e-7)
    # The Keras optimizer's own slots, its step count (advanced once per step) and
    # learning rate hold what Keras' would.
    assert len(slots) == len(keras_slots) == len(base_slots) and slots[0] == base_slots[0] == STEPS
    for got, want in zip(weights + slots, keras_weights + keras_slots):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=2e-7)
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5, atol=1e-6)
    for got, want in zip(weights, base_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    frozen = optimized.original.get_layer("frozen")
    np.testing.assert_array_equal(frozen.kernel.numpy(), baseline.get_layer("frozen").kernel.numpy())
    assert np.linalg.norm(optimized.original.get_layer("constrained").kernel.numpy(), axis=0).max() <= 0.5 + 1e-6


def regularized_model():
    """DeepCTR's default: tables under an L2 regularizer (read whole by it, so their
    gradient is dense), and a Dense head."""
    x = {"item": tf.keras.Input((), dtype="int64", name="item"), "dense": tf.keras.Input((6,), name="dense")}
    l2 = tf.keras.regularizers.l2(1e-3)
    parts = [tf.keras.layers.Embedding(50, 4, embeddings_regularizer=l2, name="item_4")(x["item"]),
             tf.keras.layers.Embedding(50, 8, embeddings_regularizer=l2, name="item_8")(x["item"]),
             x["dense"]]
    h = tf.keras.layers.Dense(8, activation="relu", name="hidden")(tf.keras.layers.Concatenate()(parts))
    return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid", name="head")(h))


def step_ops_that_run(model, data):
    """The ops of the model's training step that TensorFlow runs (as its runtime prunes
    the step's graph)."""
    x, y = data[0]
    specs = ({k: tf.TensorSpec([None] + list(v.shape[1:]), tf.as_dtype(v.dtype)) for k, v in x.items()},
             tf.TensorSpec([None, 1], tf.float32))
    graph = tf.function(model.train_step).get_concrete_function(specs).graph
    run = {n.name for n in prune(graph.as_graph_def(), [t.name for t in graph.outputs],
                                 keep=[op.name for op in graph.control_outputs]).node}
    return [op for op in graph.get_operations() if op.name in run]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_regularized_table_gradient_reaches_the_op_in_parts(name, monkeypatch):
    """A regularised table's gradient, its lookup's rows plus the L2 regulariser's
    table * scale, reaches the op in those parts: the step builds no table-sized tensor
    of them (UnsortedSegmentSum, Mul, AddN), and trains bit for bit as with them built,
    and like the plain Keras model."""
    data = batches()[:8]
    baseline, optimized = twins(regularized_model)
    _, summed = twins(regularized_model)
    monkeypatch.setattr(dense_update, "_gradient_parts", lambda grad, var: (grad, None, False))   # TensorFlow's sum
    summed_losses, summed_weights, summed_slots = trained(summed, OPTIMIZERS[name](), data)
    monkeypatch.undo()
    losses, weights, slots = trained(optimized, OPTIMIZERS[name](), data)
    base_losses, base_weights, _ = trained(baseline, OPTIMIZERS[name](), data)
    tables = {tuple(v.shape) for v in optimized.picasso.table_variables}
    assert tables == {(50, 4), (50, 8)}
    ran = step_ops_that_run(optimized, data)
    built = [(op.type, op.name) for op in ran
             if op.type in ("UnsortedSegmentSum", "Mul", "AddN") and tuple(op.outputs[0].shape) in tables]
    assert not built, built
    assert [op.type for op in ran].count("PicassoDenseApply") == 1
    np.testing.assert_array_equal(losses, summed_losses)
    for got, want in zip(weights + slots, summed_weights + summed_slots):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5, atol=1e-6)
    for got, want in zip(weights, base_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_one_op_updates_the_dense_variables_and_the_step_has_fewer_ops():
    data = batches()
    _, fused = twins(model_with_embedding)
    _, keras = twins(model_with_embedding, fused_dense_optimizer=False)
    for model in (fused, keras):
        model.compile(optimizer=K.Adagrad(0.1), loss="binary_crossentropy")
    with_fused, without = step_op_counts(fused, data), step_op_counts(keras, data)
    assert with_fused[FUSED_OP] == 1 and FUSED_OP not in without
    # Keras' Adagrad: a read, a product, an add, a sqrt, a division... per variable.
    assert sum(with_fused.values()) <= sum(without.values()) - 4 * 5


@pytest.mark.parametrize("option", ["packing", "fused_dense_optimizer"])
def test_switched_off_it_leaves_keras_update(option):
    data = batches()
    baseline, optimized = twins(model_with_embedding, **{option: False})
    optimized.compile(optimizer=K.Adam(0.01), loss="binary_crossentropy")
    assert FUSED_OP not in step_op_counts(optimized, data)
    optimized.train_on_batch(*data[0])
    assert f"dense variables: Keras' apply_gradients ({option}=False)" in optimized.picasso.report()


class LoggedAdam(K.Adam):
    """An update_step of its own (this one changes nothing, which no check can know)."""

    def update_step(self, gradient, variable):
        return super().update_step(gradient, variable)


@pytest.mark.parametrize("build, optimizer, reason", [
    (dense_only_model, lambda: K.Adam(0.01, clipnorm=1.0), "clips gradients (clipnorm=1.0)"),
    (model_with_embedding, lambda: K.Adam(0.01, use_ema=True), "use_ema=True"),
    (model_with_embedding, lambda: LoggedAdam(0.01), "LoggedAdam overrides Adam.update_step"),
    (model_with_embedding, lambda: tf.keras.mixed_precision.LossScaleOptimizer(K.Adam(0.01)), "mixed precision"),
], ids=["clipnorm", "use_ema", "update_step", "loss_scale"])
def test_stands_down_where_keras_does_more_and_says_why(build, optimizer, reason):
    data = batches()
    baseline, optimized = twins(build)
    losses, weights, _ = trained(optimized, optimizer(), data[:5])
    base_losses, base_weights, _ = trained(baseline, optimizer(), data[:5])
    report = optimized.picasso.report()
    assert "dense variables: Keras' apply_gradients, the fused update stands down" in report and reason in report
    assert FUSED_OP not in step_op_counts(optimized, data)
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5, atol=1e-6)


def test_a_dense_only_model_trains_like_keras_under_sgd():
    data = batches()
    baseline, optimized = twins(dense_only_model)
    losses, weights, _ = trained(optimized, K.SGD(0.1, momentum=0.5, nesterov=True), data)
    base_losses, base_weights, _ = trained(baseline, K.SGD(0.1, momentum=0.5, nesterov=True), data)
    np.testing.assert_allclose(losses, base_losses, rtol=1e-6, atol=1e-7)
    for got, want in zip(weights, base_weights):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_the_op_matches_keras_update_step_on_float64_and_refuses_mixed_dtypes():
    optimizer = K.Adam(0.01, weight_decay=0.1)
    keras_optimizer = K.Adam(0.01, weight_decay=0.1)
    rng = np.random.default_rng(0)
    values = [rng.normal(size=s) for s in ((3, 5), (7,), (2, 3, 4))]
    ours = [tf.Variable(v) for v in values]
    theirs = [tf.Variable(v) for v in values]
    optimizer.build(ours)
    keras_optimizer.build(theirs)
    update, note = make_dense_update(optimizer, Config())
    assert "fused Adam" in note
    for _ in range(3):
        grads = [tf.constant(rng.normal(size=v.shape)) for v in values]
        update.apply(optimizer, list(zip(grads, ours)))
        keras_optimizer.apply_gradients(zip(grads, theirs))
    for got, want in zip(ours + optimizer.variables, theirs + keras_optimizer.variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12)
    with pytest.raises(ValueError, match="one dtype"):
        dense_apply.apply([ours[0], tf.Variable([1.0])], [values[0], [1.0]],
                          update.rows.updates(ours[:1], [update.rows.keras_slots(ours[0])], 0, [True]) * 2,
                          [True, True])


def test_the_op_sums_a_gradient_from_its_parts_as_tensorflow_does():
    """Rows added to a variable's gradient (a row repeated, a negative index skipped,
    int32 or int64 indices, a table cut into blocks of whole rows) and a gradient given
    as the variable times a scale (its value before the weight decay): the variables
    and slots are those of the same update from the gradients TensorFlow sums of these
    parts, to the bit."""
    rng = np.random.default_rng(1)
    shapes = [(7000, 3), (7, 5), (300, 8)]
    values = [rng.normal(size=s).astype("float32") for s in shapes]
    ours, theirs = [tf.Variable(v) for v in values], [tf.Variable(v) for v in values]
    updates = []
    for variables in (ours, theirs):
        optimizer = K.Adam(0.01, weight_decay=0.1)
        optimizer.build(variables)
        fused, _ = make_dense_update(optimizer, Config())
        updates.append(lambda variables=variables, optimizer=optimizer, fused=fused: fused.rows.updates(
            variables, [fused.rows.keras_slots(v) for v in variables], optimizer.iterations, [True] * 3))
    for _ in range(3):
        dense = tf.constant(rng.normal(size=shapes[0]), tf.float32)
        scale = tf.constant(rng.normal(), tf.float32)
        rows = [tf.IndexedSlices(tf.constant(rng.normal(size=(5, 3)), tf.float32),
                                 tf.constant([5, -1, 6999, 5, 2500], tf.int32), shapes[0]),
                None,
                tf.IndexedSlices(tf.constant(rng.normal(size=(4, 8)), tf.float32),
                                 tf.constant([299, 0, 7, 299], tf.int64), shapes[2])]
        summed = [tf.add_n([tf.convert_to_tensor(rows[0]), dense]), theirs[1] * scale,
                  tf.add_n([tf.convert_to_tensor(rows[2]), theirs[2] * scale])]
        dense_apply.apply(ours, [dense, scale, scale], updates[0](), [True] * 3, rows=rows, scaled=[False, True, True])
        dense_apply.apply(theirs, summed, updates[1](), [True] * 3)
    for got, want in zip(ours + [s for u in updates[0]() for s in u.slots],
                         theirs + [s for u in updates[1]() for s in u.slots]):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
