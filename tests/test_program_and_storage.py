"""The compiled Program (no Keras, no TF state in the passes), the storage interface,
and checkpoints by logical table: a checkpoint restores into a model planned
differently, and one that does not fit names the table."""
import dataclasses

import numpy as np
import pytest
import tensorflow as tf

import picasso_tf as picasso
from picasso_tf.passes import manager
from picasso_tf.program import StorageRef

BATCH = 32
FIELDS = [("u", 50, 32), ("i", 70, 32), ("c", 20, 32), ("g", 30, 8)]   # name, vocab, dim


def build(vocab_of_u=50, seed=5, frozen=()):
    tf.keras.utils.set_random_seed(seed)
    x = {n: tf.keras.Input((), dtype="int64", name=n) for n, _, _ in FIELDS}
    parts = [tf.keras.layers.Embedding(vocab_of_u if n == "u" else v, d, name=f"emb_{n}",
                                       trainable=n not in frozen)(x[n]) for n, v, d in FIELDS]
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
    # Every original table is in exactly one layout, at rows that tile it.
    members = [m for t in program.tables for m in t.members]
    assert sorted(m.name for m in members) == sorted(f"emb_{n}/embeddings" for n, _, _ in FIELDS)
    for layout in program.tables:
        assert [m.offset for m in layout.members] == list(np.cumsum([0] + [m.rows for m in layout.members])[:-1])


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


@pytest.mark.parametrize("path", ["save_weights", "tf.train.Checkpoint"])
def test_checkpoint_restores_into_a_differently_planned_model(tmp_path, path):
    """Planned from warm-up data, the dim-32 tables land in shards; restored into
    models planned otherwise (no sharding, no warm-up), the state is the same table by
    table, and training continues identically."""
    first = picasso.optimize(build(), warmup_data=warmup(), max_shards=3)
    assert sum(t.dim == 32 for t in first.picasso.program.tables) > 1
    train(first, batches(4))
    others = {"one shard": picasso.optimize(build(seed=6), shard_heavy_groups=False),
              "no warm-up": picasso.optimize(build(seed=8), max_shards=2)}
    if path == "save_weights":
        first.save_weights(str(tmp_path / "w"))
    else:
        saved = tf.train.Checkpoint(model=first, optimizer=first.optimizer).write(str(tmp_path / "c"))
    after = batches(3, seed=1)
    expected = train(first, after)
    for name, other in others.items():
        other.compile(optimizer=tf.keras.optimizers.Adagrad(0.2), loss="binary_crossentropy")
        if path == "save_weights":
            other.load_weights(str(tmp_path / "w"))
        else:
            tf.train.Checkpoint(model=other, optimizer=other.optimizer).read(saved)
        np.testing.assert_allclose(train(other, after), expected, rtol=1e-6, err_msg=name)
        first.picasso.write_back()
        other.picasso.write_back()
        for a, b in zip(first.original.weights, other.original.weights):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7, err_msg=f"{name}: {a.name}")


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
