"""Every way TensorFlow 2 trains a Keras model (issue 37): a tf.GradientTape loop, in a
tf.function and eagerly, a model's own train_step / test_step / compute_loss (and a
TensorFlow Recommenders model), train exactly like the plain model; what cannot is
refused by name (XLA, hash-backed tables under a tape, own steps with micro-batches).
Horovod's DistributedGradientTape is refused by name, its DistributedOptimizer trains."""
import contextlib
import json

import numpy as np
import pytest
import tensorflow as tf

import picasso_tf as picasso
from launching import Job, ran
from picasso_tf.errors import UnsupportedModelError

FIELDS, VOCAB, BATCH, STEPS = 4, 30, 16, 20
OPTIMIZERS = {"sgd": lambda: tf.keras.optimizers.SGD(0.1), "adagrad": lambda: tf.keras.optimizers.Adagrad(0.1),
              "adam": lambda: tf.keras.optimizers.Adam(0.01)}


def features(n=BATCH * 3, seed=0):
    rng = np.random.default_rng(seed)
    x = {f"c{i}": rng.integers(0, VOCAB, n) for i in range(FIELDS)}
    x["d"] = rng.random((n, 2)).astype("float32")
    return x, (rng.random((n, 1)) < 0.5).astype("float32"), rng.random(n).astype("float32")


def batches(steps=STEPS):
    x, y, w = features()
    for i in range(steps):
        rows = slice((i % 3) * BATCH, (i % 3 + 1) * BATCH)
        yield {k: tf.constant(v[rows]) for k, v in x.items()}, tf.constant(y[rows]), tf.constant(w[rows])


def wide_deep(regularizer=None, frozen=False, constraint=None):
    """A Wide & Deep over FIELDS features: packed tables of two widths, a dense feature;
    optionally L2-regularised tables and kernel, a frozen table, a MaxNorm table."""
    tf.keras.utils.set_random_seed(5)
    x = {f"c{i}": tf.keras.Input((), dtype="int64", name=f"c{i}") for i in range(FIELDS)}
    x["d"] = tf.keras.Input((2,), name="d")
    tables = [tf.keras.layers.Embedding(VOCAB, 4, embeddings_regularizer=regularizer,
                                        embeddings_constraint=constraint if i == 1 else None) for i in range(FIELDS)]
    tables[0].trainable = not frozen
    deep = tf.keras.layers.Concatenate()([t(x[f"c{i}"]) for i, t in enumerate(tables)] + [x["d"]])
    deep = tf.keras.layers.Dense(8, activation="relu", kernel_regularizer=regularizer)(deep)
    wide = [tf.keras.layers.Embedding(VOCAB, 1)(x[f"c{i}"]) for i in range(FIELDS)]
    return tf.keras.Model(x, tf.keras.layers.Activation("sigmoid")(tf.keras.layers.Add()([tf.keras.layers.Dense(1)(deep)]
                                                                                        + wide)))


def tape_loop(model, optimizer, eagerly, steps=STEPS):
    """The plain TF2 custom loop: losses with sample weights and model.losses."""
    loss_fn = tf.keras.losses.BinaryCrossentropy()

    def step(x, y, w):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True), sample_weight=w)
            if model.losses:
                loss += tf.add_n(model.losses)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss, [type(g).__name__ for g in grads]

    step = step if eagerly else tf.function(step)
    out = [step(*batch) for batch in batches(steps)]
    return [float(loss) for loss, _ in out], out[-1][1]


def assert_same_weights(plain, wrapped):
    wrapped.picasso.write_back()
    for p, w in zip(plain.weights, wrapped.original.weights):
        np.testing.assert_allclose(w.numpy(), p.numpy(), rtol=1e-5, atol=1e-7, err_msg=p.name)


@pytest.mark.parametrize("eagerly", [False, True], ids=["tf.function", "eager"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_gradient_tape_loop_trains_exactly_like_the_plain_model(optimizer, eagerly):
    regularizer = tf.keras.regularizers.L2(1e-3)
    plain, wrapped = wide_deep(regularizer), picasso.optimize(wide_deep(regularizer))
    assert wrapped.picasso.program.describe_tables(), "the test model must have packed tables"
    expected, plain_kinds = tape_loop(plain, OPTIMIZERS[optimizer](), eagerly)
    got, kinds = tape_loop(wrapped, OPTIMIZERS[optimizer](), eagerly)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert_same_weights(plain, wrapped)
    # The same kinds of gradient: the regularised tables dense, the others row-sparse.
    assert kinds == plain_kinds and "IndexedSlices" in kinds, (kinds, plain_kinds)


def test_tape_options_inputs_and_persistence_give_the_plain_model_s_gradients():
    plain, wrapped = wide_deep(), picasso.optimize(wide_deep())
    x, y, _ = next(batches())
    loss_fn = tf.keras.losses.BinaryCrossentropy()

    @tf.function
    def gradients(model):
        kernel = [v for v in model.trainable_variables if "dense" in v.name][0]
        with tf.GradientTape(watch_accessed_variables=False, persistent=True) as tape:
            tape.watch([kernel, x["d"]])
            loss = loss_fn(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables), tape.gradient(loss, x["d"]), tape.gradient(loss, kernel)

    (expected, expected_input, expected_kernel), (got, got_input, got_kernel) = gradients(plain), gradients(wrapped)
    # Only the watched kernel has a gradient, as for the plain model.
    assert [g is None for g in got] == [g is None for g in expected] and sum(g is not None for g in got) == 1
    # The project's tolerance: the fused kernels sum in another order than Keras' ops, and
    # how far that moves a float32 sum depends on the CPU's vector width (one element of
    # the kernel's gradient differs by 3e-6 relative on an AVX2-only CPU).
    np.testing.assert_allclose(got_input, expected_input, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(got_kernel, expected_kernel, rtol=1e-5, atol=1e-9)


def test_frozen_tables_and_constraints_keep_their_meaning_in_a_tape_loop():
    build = lambda: wide_deep(frozen=True, constraint=tf.keras.constraints.MaxNorm(0.05))
    plain, wrapped = build(), picasso.optimize(build())
    expected, _ = tape_loop(plain, tf.keras.optimizers.Adagrad(0.5), eagerly=False)
    got, _ = tape_loop(wrapped, tf.keras.optimizers.Adagrad(0.5), eagerly=False)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert_same_weights(plain, wrapped)
    (frozen,) = [layer for layer in wrapped.original.layers if not layer.trainable]
    assert frozen.embeddings.ref() not in {v.ref() for v in wrapped.trainable_variables}


def test_hash_backed_tables_under_a_tape_are_refused_by_name():
    wrapped = picasso.optimize(wide_deep(), hybrid_hash=True)
    x, y, _ = next(batches())
    with pytest.raises(UnsupportedModelError, match=r"tf.GradientTape cannot differentiate tables held in "
                                                    r"hybrid_hash storage.*fit\(\)"):
        with tf.GradientTape():
            wrapped(x, training=True)
    wrapped(x, training=False)      # without a tape it runs


def test_train_on_batch_returns_what_the_plain_model_returns():
    """Keras' contract: without return_dict, the values of metrics_names (a lone loss as
    a scalar); the hot tier's figures come with return_dict=True, and in fit's logs."""
    wrapped = picasso.optimize(wide_deep(), hybrid_hash=True)
    wrapped.compile(optimizer=tf.keras.optimizers.Adagrad(0.1), loss="binary_crossentropy")
    x, y, _ = next(batches())
    assert isinstance(wrapped.train_on_batch(x, y), float) and wrapped.metrics_names == ["loss"]
    logs = wrapped.train_on_batch(x, y, return_dict=True)
    assert {"loss", "hot_hit_ratio", "hot_tier_rows"} <= set(logs), logs
    assert "hot_hit_ratio" in wrapped.fit(x, y, batch_size=BATCH, verbose=0).history


def test_xla_is_refused_by_name():
    wrapped = picasso.optimize(wide_deep())
    x, y, _ = next(batches())
    wrapped.compile(optimizer="sgd", loss="binary_crossentropy", jit_compile=True)
    with pytest.raises(UnsupportedModelError, match=r"XLA-compiled function \(compile\(jit_compile=True\)"):
        wrapped.train_on_batch(x, y)
    with pytest.raises(UnsupportedModelError, match=r"Compile without jit_compile"):
        tf.function(lambda x: wrapped(x), jit_compile=True)(x)


# -- a model's own steps ------------------------------------------------------------------
class Tower(tf.keras.Model):
    def __init__(self):
        super().__init__()
        self.tables = [tf.keras.layers.Embedding(VOCAB, 4) for _ in range(2)]
        self.head = tf.keras.layers.Dense(1, activation="sigmoid")

    def call(self, inputs, training=None):
        return self.head(tf.concat([t(inputs[f"c{i}"]) for i, t in enumerate(self.tables)] + [inputs["d"]], -1))


class OwnTrainStep(Tower):
    """The Keras guide's custom train_step."""

    def train_step(self, data):
        x, y, w = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compiled_loss(y, y_pred, w, regularization_losses=self.losses)
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
        self.compiled_metrics.update_state(y, y_pred, w)
        return {m.name: m.result() for m in self.metrics}


class OwnComputeLoss(Tower):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
        return tf.reduce_mean(tf.abs(y_pred - y) * sample_weight[:, None]) + 0.1 * tf.reduce_mean(y_pred)


class OwnTestStep(Tower):
    def test_step(self, data):
        x, y, _ = data
        return {"error": tf.reduce_mean(tf.abs(self(x) - y))}


# The loss branches in Python on a tensor: autograph converts it inside picasso_tf's
# traced step (whose own code it leaves alone, as Keras') as it does inside Keras'.
def cross_entropy_unless_empty(y, y_pred):
    if tf.size(y) > 0:
        return tf.keras.losses.binary_crossentropy(y, y_pred)
    return tf.zeros_like(y[:, 0])


def test_autograph_leaves_picasso_tf_alone_as_it_leaves_keras_and_converts_the_user_s_code():
    from tensorflow.python.autograph.impl.conversion import is_allowlisted
    assert is_allowlisted(picasso.PicassoModel.train_step) and is_allowlisted(tf.keras.Model.train_step)
    assert not is_allowlisted(cross_entropy_unless_empty) and not is_allowlisted(OwnTestStep.test_step)


def build_tower(cls):
    model = cls()
    model(next(batches())[0])
    return model


# test_step trains through picasso_tf's own step: one optimizer is enough there.
@pytest.mark.parametrize("cls, optimizer", [(cls, name) for cls in (OwnTrainStep, OwnComputeLoss)
                                            for name in sorted(OPTIMIZERS)] + [(OwnTestStep, "adagrad")])
def test_a_model_s_own_steps_run_with_the_rewritten_forward(cls, optimizer):
    tf.keras.utils.set_random_seed(7)
    plain = build_tower(cls)
    tf.keras.utils.set_random_seed(7)
    wrapped = picasso.optimize(build_tower(cls), example_inputs=next(batches())[0])
    assert wrapped.picasso.program.describe_tables(), "the test model must have packed tables"
    data = list(batches())
    logs = {}
    for name, model in (("plain", plain), ("wrapped", wrapped)):
        model.compile(optimizer=OPTIMIZERS[optimizer](), loss=cross_entropy_unless_empty, metrics=["AUC"])
        logs[name] = ([model.train_on_batch(*batch, return_dict=True) for batch in data],
                      model.evaluate(data[0][0], data[0][1], sample_weight=data[0][2], verbose=0, return_dict=True))
    for key in logs["plain"][0][-1]:
        np.testing.assert_allclose([l[key] for l in logs["wrapped"][0]], [l[key] for l in logs["plain"][0]],
                                   rtol=1e-6, err_msg=key)
    assert logs["wrapped"][1].keys() == logs["plain"][1].keys()
    for key in logs["plain"][1]:
        np.testing.assert_allclose(logs["wrapped"][1][key], logs["plain"][1][key], rtol=1e-6, err_msg=key)
    assert_same_weights(plain, wrapped)
    # The model's own step too is traced once: the rewrite's and the slots' variables are eager.
    assert wrapped.train_function.experimental_get_tracing_count() == 1


def test_own_train_step_refuses_a_clipping_optimizer_as_fit_does():
    wrapped = picasso.optimize(build_tower(OwnTrainStep))
    wrapped.compile(optimizer=tf.keras.optimizers.SGD(0.1, clipnorm=1.0), loss="binary_crossentropy")
    with pytest.raises(ValueError, match=r"the optimizer clips gradients \(clipnorm=1.0\).*one summed row per id"):
        wrapped.train_on_batch(*next(batches()))


def test_own_steps_refuse_micro_batches_and_forward_losses_by_name():
    with pytest.raises(UnsupportedModelError, match=r"OwnTrainStep overrides keras.Model.train_step.*micro_batches=1"):
        picasso.optimize(build_tower(OwnTrainStep), micro_batches=2)

    class ActivityPenalty(OwnComputeLoss):
        def call(self, inputs, training=None):
            out = super().call(inputs, training)
            self.add_loss(tf.reduce_mean(out))
            return out
    with pytest.raises(UnsupportedModelError, match=r"ActivityPenalty overrides keras.Model.compute_loss, and its "
                                                    r"forward pass adds losses of its own"):
        picasso.optimize(build_tower(ActivityPenalty), example_inputs=next(batches())[0])


def test_a_tensorflow_recommenders_ranking_model_trains_exactly():
    tfrs = pytest.importorskip("tensorflow_recommenders")
    users, items, n = 40, 60, 192
    rng = np.random.default_rng(1)
    data = {"user": rng.integers(0, users, n), "item": rng.integers(0, items, n),
            "rating": (rng.random(n) * 5).astype("float32")}

    class Ranking(tfrs.models.Model):
        """TFRS' ranking tutorial: the towers in a sub-model, the loss in compute_loss."""

        def __init__(self):
            super().__init__()
            self.ranking_model = tf.keras.Sequential([tf.keras.layers.Dense(16, activation="relu"),
                                                      tf.keras.layers.Dense(1)])
            self.user, self.item = tf.keras.layers.Embedding(users, 8), tf.keras.layers.Embedding(items, 8)
            self.task = tfrs.tasks.Ranking(loss=tf.keras.losses.MeanSquaredError(),
                                           metrics=[tf.keras.metrics.RootMeanSquaredError()])

        def call(self, features):
            return self.ranking_model(tf.concat([self.user(features["user"]), self.item(features["item"])], -1))

        def compute_loss(self, features, training=False):
            labels = features.pop("rating")
            return self.task(labels=labels, predictions=self(features))

    def build():
        tf.keras.utils.set_random_seed(3)
        model = Ranking()
        model({k: v[:2] for k, v in data.items() if k != "rating"})
        return model

    dataset = tf.data.Dataset.from_tensor_slices(data).batch(32)
    plain, wrapped = build(), picasso.optimize(build())
    history = {}
    for name, model in (("plain", plain), ("wrapped", wrapped)):
        model.compile(optimizer=tf.keras.optimizers.Adam(0.01))
        history[name] = model.fit(dataset, epochs=2, verbose=0).history
        history[name]["evaluate"] = model.evaluate(dataset, verbose=0, return_dict=True)
    assert wrapped.picasso.program.describe_tables() and "Ranking.train_step" in wrapped.picasso.report()
    for key in ("loss", "root_mean_squared_error", "total_loss"):
        np.testing.assert_allclose(history["wrapped"][key], history["plain"][key], rtol=1e-6, err_msg=key)
        np.testing.assert_allclose(history["wrapped"]["evaluate"][key], history["plain"]["evaluate"][key], rtol=1e-6)
    assert_same_weights(plain, wrapped)


def test_a_tensorflow_recommenders_retrieval_model_trains_with_its_towers_optimised():
    """TFRS' retrieval tutorial: no call(), the query and candidate towers called from
    compute_loss; picasso_tf.optimize on each tower, inside the TFRS model."""
    tfrs = pytest.importorskip("tensorflow_recommenders")
    users, items, n = 40, 60, 192
    rng = np.random.default_rng(1)
    data = {"user": rng.integers(0, users, n), "item": rng.integers(0, items, n)}

    def tower(vocab, name):
        x = tf.keras.Input((), dtype="int64", name=name)
        return tf.keras.Model(x, tf.keras.layers.Dense(8)(tf.keras.layers.Embedding(vocab, 8)(x)))

    class Retrieval(tfrs.Model):
        def __init__(self, optimize):
            super().__init__()
            tf.keras.utils.set_random_seed(3)
            query, candidate = tower(users, "user"), tower(items, "item")
            self.query = picasso.optimize(query) if optimize else query
            self.candidate = picasso.optimize(candidate) if optimize else candidate
            self.task = tfrs.tasks.Retrieval()

        def compute_loss(self, features, training=False):
            return self.task(self.query(features["user"], training=training),
                             self.candidate(features["item"], training=training))

    dataset = tf.data.Dataset.from_tensor_slices(data).batch(32)
    losses, models = {}, {}
    for optimize in (False, True):
        models[optimize] = Retrieval(optimize)
        models[optimize].compile(optimizer=tf.keras.optimizers.Adagrad(0.1))
        losses[optimize] = models[optimize].fit(dataset, epochs=2, verbose=0).history["loss"]
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-6)
    for wrapped in (models[True].query, models[True].candidate):
        assert wrapped.picasso.program.describe_tables()
        wrapped.picasso.write_back()
    for p, w in zip(models[False].get_weights(), models[True].get_weights()):
        np.testing.assert_allclose(w, p, rtol=1e-5, atol=1e-7)


# -- Horovod's idioms ---------------------------------------------------------------------
HOROVOD_JOBS = tuple(Job(launch, f"custom_loops/np{np_}", "custom_loops", ()) for np_, launch in ((1, "one"),
                                                                                                    (2, "gloo")))


def test_horovod_s_distributed_tape_is_refused_and_its_optimizer_trains_like_one_process(horovod_jobs):
    """On 2 Gloo ranks: hvd.DistributedGradientTape over the model is refused by name
    (the hybrid plan's exchange runs only in picasso_tf's step); fit's step with
    hvd.DistributedOptimizer trains like one process with the whole batch, the wrapper
    adding no Allreduce of its own (the fused dense update does not stand down)."""
    one, two = (ran(horovod_jobs, job) for job in HOROVOD_JOBS)
    result = json.load(open(two / "result.json"))
    assert "hvd.DistributedGradientTape included" in result["tape"] and "Train with model.fit()" in result["tape"]
    assert "dense variables: fused Adagrad" in result["optimizer_note"], result["optimizer_note"]
    one, two = np.load(one / "weights.npz"), np.load(two / "weights.npz")
    for key in one:
        np.testing.assert_allclose(two[key], one[key], rtol=1e-6, atol=1e-7, err_msg=key)


@pytest.mark.parametrize("in_gradient", [False, True], ids=["apply_gradients", "fused_gradients"])
def test_the_fused_updates_train_a_tape_loop_exactly(in_gradient):
    """model.picasso.apply_gradients: the tables' IndexedSlices through the fused
    row-sparse kernels, the rest through the fused dense update; with tape.gradient
    inside model.picasso.fused_gradients, the tables updated in their gradient kernels
    where the optimizer allows (not Adam's exact form), their gradients None."""
    regularizer = None if in_gradient else tf.keras.regularizers.L2(1e-3)
    loss_fn = tf.keras.losses.BinaryCrossentropy()
    for name in sorted(OPTIMIZERS):
        plain, wrapped = wide_deep(regularizer), picasso.optimize(wide_deep(regularizer))
        expected, _ = tape_loop(plain, OPTIMIZERS[name](), eagerly=False)
        optimizer = OPTIMIZERS[name]()

        @tf.function
        def step(x, y, w):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, wrapped(x, training=True), sample_weight=w)
                if wrapped.losses:
                    loss += tf.add_n(wrapped.losses)
            with wrapped.picasso.fused_gradients(optimizer) if in_gradient else contextlib.nullcontext():
                grads = tape.gradient(loss, wrapped.trainable_variables)
            wrapped.picasso.apply_gradients(optimizer, zip(grads, wrapped.trainable_variables))
            return loss, sum(g is None for g in grads)

        got = [step(*batch) for batch in batches()]
        # Traced once: the rewrite's and the optimizer's variables, made in the first trace, are eager.
        assert step.experimental_get_tracing_count() == 1, name
        np.testing.assert_allclose([float(loss) for loss, _ in got], expected, rtol=1e-6, err_msg=name)
        assert_same_weights(plain, wrapped)
        assert wrapped.picasso.optimizer_note.startswith(f"packed tables: fused {type(optimizer).__name__}")
        # In their kernels: the deep part's tables (a projection) and the wide part's (packed lookups).
        assert int(got[-1][1]) == (2 * FIELDS if in_gradient and name != "adam" else 0), name
