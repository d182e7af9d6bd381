"""A wrapped model's Keras lifecycle (issue 20, items 12, 14, 15): .keras files round-trip, model.picasso.export serves with stock
TensorFlow, and repeated optimize + compile + fit does not grow the process."""
import gc
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import picasso_tf as picasso
from picasso_tf.api import PicassoModel

FIELDS, VOCAB, BATCH = 4, 30, 16


def features(n=BATCH * 3, seed=0):
    rng = np.random.default_rng(seed)
    x = {f"c{i}": rng.integers(0, VOCAB, n) for i in range(FIELDS)}
    x["d"] = rng.random((n, 2)).astype("float32")
    return x, (rng.random(n) < 0.5).astype("float32")


def wide_deep():
    """A small Wide & Deep over FIELDS categorical features: packed tables of two widths."""
    tf.keras.utils.set_random_seed(5)
    x = {f"c{i}": tf.keras.Input((), dtype="int64", name=f"c{i}") for i in range(FIELDS)}
    x["d"] = tf.keras.Input((2,), name="d")
    deep = tf.keras.layers.Concatenate()([tf.keras.layers.Embedding(VOCAB, 4)(x[f"c{i}"]) for i in range(FIELDS)]
                                         + [x["d"]])
    deep = tf.keras.layers.Dense(1)(tf.keras.layers.Dense(8, activation="relu")(deep))
    wide = [tf.keras.layers.Embedding(VOCAB, 1)(x[f"c{i}"]) for i in range(FIELDS)]
    return tf.keras.Model(x, tf.keras.layers.Activation("sigmoid")(tf.keras.layers.Add()([deep] + wide)))


def trained(optimizer="adam"):
    model = picasso.optimize(wide_deep())
    assert model.picasso.program.describe_tables(), "the test model must have packed tables"
    model.compile(optimizer=optimizer, loss="binary_crossentropy")
    x, y = features()
    model.fit(x, y, batch_size=BATCH, verbose=0)
    return model


class Tower(tf.keras.Model):
    def __init__(self):
        super().__init__()
        self.table = tf.keras.layers.Embedding(VOCAB, 4)
        self.head = tf.keras.layers.Dense(1, activation="sigmoid")

    def call(self, inputs, training=None):
        return self.head(tf.reduce_sum(self.table(inputs["c0"]), -1, keepdims=True))


# -- the first step, traced once -------------------------------------------------------
def test_the_step_that_builds_the_storage_and_the_slots_is_traced_once():
    """The first fit rewrites the model and builds its storage and the optimizer's slots
    while Keras traces the step. Those variables are made eagerly, so they do not make
    tf.function trace the step again (picasso_tf.runtime.first_trace), and it trains as
    the plain model does; so for predict on a model not yet rewritten."""
    x, y = features()
    plain, model = wide_deep(), picasso.optimize(wide_deep())
    tf.keras.Model.compile.__wrapped__(plain, optimizer="adam", loss="binary_crossentropy")   # Keras' alone: conftest
    model.compile(optimizer="adam", loss="binary_crossentropy")
    fits = [m.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history["loss"] for m in (plain, model)]
    np.testing.assert_allclose(fits[1], fits[0], rtol=1e-5)
    assert model.train_function.experimental_get_tracing_count() == 1
    assert plain.train_function.experimental_get_tracing_count() == 2     # Keras makes Adam's slots in the trace
    fresh = picasso.optimize(wide_deep())
    np.testing.assert_allclose(fresh.predict(x, batch_size=BATCH, verbose=0),
                               wide_deep().predict(x, batch_size=BATCH, verbose=0), rtol=1e-5)
    assert fresh.predict_function.experimental_get_tracing_count() == 1


def test_a_plain_model_whose_optimizer_is_built_at_compile_is_traced_once_and_trains_as_keras():
    """models.training.build_optimizer (the zoo's trainer, picasso-bench's and the tests'
    plain models): the slots Keras would make in the first trace, made before it; the
    same losses and slots. Models whose slots are not known at compile are left to Keras."""
    from picasso_tf.models.training import build_optimizer
    x, y = features()
    lazy, built = wide_deep(), wide_deep()
    tf.keras.Model.compile.__wrapped__(lazy, optimizer="adam", loss="binary_crossentropy")   # Keras' alone: conftest
    tf.keras.Model.compile.__wrapped__(built, optimizer="adam", loss="binary_crossentropy")
    build_optimizer(built)
    assert len(built.optimizer.variables) == 1 + 2 * len(built.trainable_variables)      # before any step
    fits = [m.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0).history["loss"] for m in (lazy, built)]
    np.testing.assert_allclose(fits[1], fits[0], rtol=1e-6)
    for m in (lazy, built):                         # the same names (each model's own layers)
        assert [v.name for v in m.optimizer.variables] == ["iteration:0"] + [
            f"Adam/{slot}/{v.name}" for v in m.trainable_variables for slot in "mv"]
    for a, b in zip(built.optimizer.variables, lazy.optimizer.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)
    assert [m.train_function.experimental_get_tracing_count() for m in (built, lazy)] == [1, 2]

    unbuilt = Tower()
    tf.keras.Model.compile.__wrapped__(unbuilt, optimizer="adam", loss="binary_crossentropy")
    build_optimizer(unbuilt)                        # its variables do not exist yet
    assert [v.name for v in unbuilt.optimizer.variables] == ["iteration:0"]          # no slots


# -- 12: .keras save and load -----------------------------------------------------------
def test_keras_file_round_trips_through_save_and_model_checkpoint(tmp_path):
    model = picasso.optimize(wide_deep())
    model.compile(optimizer="adam", loss="binary_crossentropy")
    x, y = features()
    checkpoint = tf.keras.callbacks.ModelCheckpoint(str(tmp_path / "epoch.keras"))
    model.fit(x, y, batch_size=BATCH, verbose=0, callbacks=[checkpoint])
    model.save(tmp_path / "m.keras")
    for path in ("m.keras", "epoch.keras"):
        loaded = tf.keras.models.load_model(tmp_path / path)     # registered: no custom_objects
        assert isinstance(loaded, PicassoModel) and loaded.picasso.config == model.picasso.config
        assert [w.name for w in loaded.weights] == [w.name for w in model.weights]
        for saved, restored in zip(model.get_weights(), loaded.get_weights()):
            np.testing.assert_array_equal(restored, saved)
        np.testing.assert_array_equal(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
    # The optimizer state came back too: one more step gives the same weights.
    assert int(loaded.optimizer.iterations) == int(model.optimizer.iterations) == 3
    for m in (model, loaded):
        m.fit(x, y, batch_size=BATCH, verbose=0)
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(b, a)


# -- 14: export for serving without picasso_tf ------------------------------------------
SERVE = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    directory, batch, out = sys.argv[1:]
    serve = tf.saved_model.load(directory).signatures["serving_default"]
    graph = serve.graph.as_graph_def()
    ops = {n.op for n in graph.node} | {n.op for f in graph.library.function for n in f.node_def}
    x = dict(np.load(batch))
    outputs = serve(**{k: tf.constant(v) for k, v in x.items()})
    (prediction,) = outputs.values()
    np.save(out, prediction.numpy())
    print(json.dumps({"ops": sorted(ops), "picasso_imported": any(m.startswith("picasso_tf") for m in sys.modules)}))
""")


def test_export_is_served_by_stock_tensorflow_without_picasso_ops(tmp_path):
    model = trained()
    model.picasso.export(str(tmp_path / "export"))
    x, _ = features(BATCH, seed=1)
    np.savez(tmp_path / "batch.npz", **x)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PICASSO")}
    run = subprocess.run([sys.executable, "-c", SERVE, str(tmp_path / "export"), str(tmp_path / "batch.npz"),
                          str(tmp_path / "served.npy")], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    served = json.loads(run.stdout.strip().splitlines()[-1])
    assert not served["picasso_imported"]
    assert "ReadVariableOp" in served["ops"] and not [op for op in served["ops"] if op.startswith("Picasso")]
    np.testing.assert_allclose(np.load(tmp_path / "served.npy"), model.predict(x, verbose=0), rtol=1e-6, atol=1e-7)


def test_export_refuses_a_model_whose_signature_keras_does_not_know(tmp_path):
    model = picasso.optimize(Tower())          # subclassed, never called: no serving signature
    with pytest.raises(ValueError, match="cannot export .*input signature"):
        model.picasso.export(str(tmp_path / "export"))


# -- 15: memory over repeated optimize + compile + fit ----------------------------------
def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_rss_stays_flat_over_repeated_optimize_compile_fit():
    x, y = features()

    def cycle():
        model = picasso.optimize(wide_deep())      # the fused optimizer (default)
        model.compile(optimizer="adam", loss="binary_crossentropy")
        model.fit(x, y, batch_size=BATCH, verbose=0)
        del model
        gc.collect()
        tf.keras.backend.clear_session()
        gc.collect()

    # Late in the suite a collection scans every object the earlier tests left (0.7 s a
    # cycle); frozen, they are skipped. Freezing only keeps objects alive: it can raise
    # the RSS, never hide a leak of the cycles' own objects, which are still collected.
    gc.collect()
    gc.freeze()
    try:
        for _ in range(3):                          # warm-up: caches, the op library, Keras' state
            cycle()
        start = rss_mb()
        for _ in range(10):
            cycle()
    finally:
        gc.unfreeze()
    assert rss_mb() <= start * 1.05, f"RSS grew from {start:.0f} MB to {rss_mb():.0f} MB over 10 cycles"
