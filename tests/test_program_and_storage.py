"""The compiled Program (no Keras, no TF state in the passes), the storage interface
(the tables read in place: one copy of every row), and checkpoints: the wrapped
model's is the plain model's, so each restores the other's (optimizer state
included), a differently planned model restores exactly, and a checkpoint that does
not fit names the table."""
import dataclasses

import numpy as np
import pytest
import tensorflow as tf

import picasso_tf as picasso
from picasso_tf.passes import manager
from picasso_tf.program import StorageRef

BATCH = 32
FIELDS = [("u", 50, 32), ("i", 70, 32), ("c", 20, 32), ("g", 30, 8)]   # name, vocab, dim


def build(vocab_of_u=50, seed=5, frozen=(), constraint_of_u=None):
    tf.keras.utils.set_random_seed(seed)
    x = {n: tf.keras.Input((), dtype="int64", name=n) for n, _, _ in FIELDS}
    parts = [tf.keras.layers.Embedding(vocab_of_u if n == "u" else v, d, name=f"emb_{n}", trainable=n not in frozen,
                                       embeddings_constraint=constraint_of_u if n == "u" else None)(x[n])
             for n, v, d in FIELDS]
    h = tf.keras.layers.Dense(8, activation="relu")(tf.keras.layers.Concatenate()(parts))
    return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(h))


def batches(steps, seed=0, skew=1.2):
    rng = np.random.default_rng(seed)
    return [({n: rng.zipf(skew, BATCH) % v for n, v, _ in FIELDS}, (rng.random(BATCH) < 0.3).astype("float32"))
            for _ in range(steps)]


def train(model, data, optimizer=None):
    if not model.optimizer:
        model.compile(optimizer=optimizer or tf.keras.optimizers.Adagrad(0.2), loss="binary_crossentropy")
    return [float(model.train_on_batch(x, y)) for x, y in data]


def test_program_is_built_without_keras_and_its_records_name_graph_nodes():
    program = picasso.compile(build())
    for graph in program.graphs.values():
        for value in graph.captures.values():
            assert isinstance(value, (tf.Variable, StorageRef, tf.Tensor)), type(value)
            assert not isinstance(value, (tf.keras.layers.Layer, tf.keras.Model))
    assert {t.name for t in program.tables} == set(program.storage_refs())
    for name, records in program.lookups.items():
        nodes = {n.name for n in program.graphs[name].graph_def.node}
        assert records and all(r.node in nodes for r in records)
        assert {g for r in records for g in r.groups} <= {t.name for t in program.tables}
    # Every original table is in exactly one layout, whole.
    members = [m for t in program.tables for m in t.members]
    assert sorted(m.name for m in members) == sorted(f"emb_{n}/embeddings" for n, _, _ in FIELDS)
    assert all(m.rows == m.variable.shape[0] for m in members)


def test_a_pass_cannot_create_variables(monkeypatch):
    def greedy(program, graph, config):
        tf.Variable(1.0)
        return program, {}

    monkeypatch.setattr(manager, "PASSES", (("greedy", greedy),))
    monkeypatch.setattr(picasso.Config, "pass_enabled", lambda self, name: True)
    with pytest.raises(manager.PassCreatedStateError, match="greedy"):
        picasso.compile(build())


def test_a_pass_that_breaks_the_program_is_caught(monkeypatch):
    def drops_a_capture(program, graph, config):
        captured = program.graphs[graph]
        kept = dict(list(captured.captures.items())[1:])
        return dataclasses.replace(program, graphs={**program.graphs,
                                                    graph: dataclasses.replace(captured, captures=kept)}), {}

    monkeypatch.setattr(manager, "PASSES", (("drops_a_capture", drops_a_capture),))
    monkeypatch.setattr(picasso.Config, "pass_enabled", lambda self, name: True)
    with pytest.raises(AssertionError, match="placeholders fed by nothing"):
        picasso.compile(build())


def warmup():
    return tf.data.Dataset.from_tensor_slices(batches(1, seed=9, skew=1.05)[0]).batch(BATCH)


def save(model, path, kind):
    if kind == "save_weights":
        model.save_weights(path)
    else:
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(path)


def restore(model, path, kind):
    if kind == "save_weights":
        model.load_weights(path)
    else:
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(path).assert_existing_objects_matched()


def plain_weights(model):
    return [w.numpy() for w in getattr(model, "original", model).weights]


@pytest.mark.parametrize("kind", ["save_weights", "tf.train.Checkpoint"])
@pytest.mark.parametrize("direction", ["wrapped to plain", "plain to wrapped", "wrapped to wrapped planned otherwise",
                                       "wrapped to wrapped without packing"])
def test_checkpoints_interchange_with_the_plain_model(tmp_path, kind, direction):
    """A checkpoint (weights and Adam's slots) written by one model restores into the
    other, and training continues identically: the wrapped model's checkpoint is the
    plain model's, whatever the plan (warm-up statistics, shards)."""
    make = {"plain": lambda seed: build(seed=seed),
            "wrapped": lambda seed: picasso.optimize(build(seed=seed), warmup_data=warmup(), max_shards=3),
            "wrapped planned otherwise": lambda seed: picasso.optimize(build(seed=seed), max_shards=2),
            "wrapped without packing": lambda seed: picasso.optimize(build(seed=seed), packing=False)}
    source, target = direction.split(" to ")
    first, second = make[source](5), make[target](6)
    for model in (first, second):
        model.compile(optimizer=tf.keras.optimizers.Adam(0.02), loss="binary_crossentropy")
    train(first, batches(4))
    save(first, str(tmp_path / "ckpt"), kind)
    after = batches(3, seed=1)
    restore(second, str(tmp_path / "ckpt"), kind)
    np.testing.assert_allclose(train(second, after), train(first, after), rtol=1e-6)
    for a, b in zip(plain_weights(first), plain_weights(second)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)   # summation order
    assert first.optimizer.iterations.numpy() == second.optimizer.iterations.numpy() == 7


def test_a_wrapped_model_holds_every_table_once():
    """The storage reads the original tables in place, and its fused optimizer uses
    the Keras optimizer's slots: after training, the wrapped model's variables and
    optimizer variables are the plain model's, byte for byte."""
    plain, wrapped = build(), picasso.optimize(build())
    for model in (plain, wrapped):
        model.compile(optimizer=tf.keras.optimizers.Adam(0.01), loss="binary_crossentropy")
        train(model, batches(3))
    assert "fused Adam" in wrapped.picasso.optimizer_note
    for storage in wrapped.picasso.storages.values():
        assert all(v is m.variable for v, m in zip(storage.kernel_inputs(), storage.layout.members))

    def state_bytes(model):
        return sum(v.numpy().nbytes for v in model.variables + model.optimizer.variables)

    assert state_bytes(wrapped) == state_bytes(plain)
    assert [v.shape for v in wrapped.optimizer.variables] == [v.shape for v in plain.optimizer.variables]


def test_checkpoint_that_does_not_fit_names_the_table(tmp_path):
    trained = picasso.optimize(build())
    train(trained, batches(2))
    trained.save_weights(str(tmp_path / "w"))
    smaller = picasso.optimize(build(vocab_of_u=40))
    with pytest.raises(ValueError, match="emb_u/embeddings") as error:
        smaller.load_weights(str(tmp_path / "w"))
    assert "shape" in str(error.value)


def test_frozen_table_keeps_its_values_like_keras():
    baseline, wrapped = build(frozen=("c",)), picasso.optimize(build(frozen=("c",)))
    initial = baseline.get_layer("emb_c").embeddings.numpy()
    data = batches(5)
    np.testing.assert_allclose(train(wrapped, data), train(baseline, data), rtol=1e-5)
    wrapped.picasso.write_back()
    np.testing.assert_array_equal(wrapped.original.get_layer("emb_c").embeddings.numpy(), initial)
    for a, b in zip(baseline.weights, wrapped.original.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=a.name)


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_embeddings_constraint_is_applied_after_the_update_like_keras(optimizer):
    """Keras applies a variable's constraint after its update; so does the fused step."""
    def constrained():
        return build(constraint_of_u=tf.keras.constraints.MaxNorm(0.1, axis=1))

    baseline, wrapped = constrained(), picasso.optimize(constrained())
    data = batches(5)
    np.testing.assert_allclose(train(wrapped, data, tf.keras.optimizers.get(optimizer)),
                               train(baseline, data, tf.keras.optimizers.get(optimizer)), rtol=1e-5)
    assert "fused" in wrapped.picasso.optimizer_note
    table = wrapped.original.get_layer("emb_u").embeddings.numpy()
    assert np.linalg.norm(table, axis=1).max() <= 0.1 + 1e-6
    for a, b in zip(baseline.weights, wrapped.original.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=a.name)


def test_clipnorm_is_refused_on_every_optimizer_path():
    for options in ({}, {"fused_optimizer": False}):
        model = picasso.optimize(build(), **options)
        with pytest.raises(ValueError, match="clipnorm"):
            train(model, batches(1), tf.keras.optimizers.SGD(0.1, clipnorm=1.0))


def test_storage_state_is_not_a_model_weight():
    """Keras' weight lists are the plain model's: training adds no packed variable or slot."""
    model = picasso.optimize(build())
    names = [w.name for w in model.weights]
    train(model, batches(2), tf.keras.optimizers.Adam(0.01))
    assert [w.name for w in model.weights] == names == [w.name for w in model.original.weights]


def test_weight_lists_and_h5_files_move_between_models_like_the_plain_models(tmp_path):
    """get_weights/set_weights and .h5 weights of a trained wrapped model go into a fresh
    wrapped model (not yet trained) and into the plain model, with the same predictions."""
    trained, plain = picasso.optimize(build()), build(seed=7)
    train(trained, batches(3), tf.keras.optimizers.Adam(0.01))
    x = batches(1, seed=4)[0][0]
    expected = trained.predict_on_batch(x)
    assert [w.shape for w in trained.get_weights()] == [w.shape for w in plain.get_weights()]
    fresh = picasso.optimize(build(seed=8))
    fresh.set_weights(trained.get_weights())
    plain.set_weights(trained.get_weights())
    for model in (fresh, plain):
        np.testing.assert_allclose(model.predict_on_batch(x), expected, rtol=1e-6)
    trained.save_weights(str(tmp_path / "w.h5"))
    from_file = picasso.optimize(build(seed=9))
    from_file.load_weights(str(tmp_path / "w.h5"))
    np.testing.assert_allclose(from_file.predict_on_batch(x), expected, rtol=1e-6)


@pytest.mark.parametrize("make", [lambda: tf.keras.optimizers.legacy.Adam(0.01),
                                  lambda: tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.Adam(0.01))],
                         ids=["legacy Adam", "LossScaleOptimizer"])
def test_optimizers_without_a_fused_form_train_the_tables_like_keras(make):
    """The Keras optimizer updates the tables in place (its own slots, legacy or wrapped)."""
    baseline, wrapped = build(), picasso.optimize(build())
    data = batches(3)
    np.testing.assert_allclose(train(wrapped, data, make()), train(baseline, data, make()), rtol=1e-6)
    assert "updated by the Keras optimizer" in wrapped.picasso.optimizer_note
    for a, b in zip(baseline.weights, wrapped.original.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=a.name)


def test_recompiling_with_another_optimizer_or_other_trainable_layers_trains_like_keras():
    """compile() again (a new optimizer; a table frozen for fine-tuning) takes effect."""
    baseline, wrapped = build(), picasso.optimize(build())
    losses = {}
    for name, model in (("baseline", baseline), ("wrapped", wrapped)):
        original = getattr(model, "original", model)
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.2), loss="binary_crossentropy")
        losses[name] = [float(model.train_on_batch(x, y)) for x, y in batches(2)]
        model.compile(optimizer=tf.keras.optimizers.SGD(0.5), loss="binary_crossentropy")
        losses[name] += [float(model.train_on_batch(x, y)) for x, y in batches(2, seed=1)]
        original.get_layer("emb_u").trainable = False
        model.compile(optimizer=tf.keras.optimizers.Adam(0.05), loss="binary_crossentropy")
        losses[name] += [float(model.train_on_batch(x, y)) for x, y in batches(2, seed=2)]
    np.testing.assert_allclose(losses["wrapped"], losses["baseline"], rtol=1e-5)
    for a, b in zip(baseline.weights, wrapped.original.weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=a.name)
