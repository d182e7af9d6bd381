"""The model zoo (picasso_tf.models): registry, every model builds and trains on a mixed
schema, serialises, and reaches its quality bar on MovieLens-100K and planted data.

The quality tests (marked slow, still in the default run) use short settings: one
epoch on MovieLens (LR: two) and quality.synthetic_recipe on the synthetic task;
benchmarks/zoo_quality.py runs the full default recipes for the README table.
"""
import math

import numpy as np
import pytest
import tensorflow as tf

import picasso_tf.models as zoo
from picasso_tf.data import Feature, Schema, TabularData, alibaba_schema, roc_auc
from picasso_tf.models import quality

ALL = zoo.list()
SEQUENCE_MODELS = ("din", "dien", "dsin", "atbrg")

MIXED = Schema([
    Feature("price", "dense"),
    Feature("vec", "dense", dim=3),
    Feature("user", "categorical", vocab_size=60, embedding_dim=16),
    Feature("item", "categorical", vocab_size=40, embedding_dim=8, group="item"),
    Feature("gender", "categorical", vocab_size=3),
    Feature("city", "categorical", vocab_size=25, embedding_dim=4),
    Feature("genres", "sequence", vocab_size=20, max_len=4, embedding_dim=4),
    Feature("hist_item", "sequence", vocab_size=40, max_len=9, group="item"),
], labels=["click"], name="mixed")

# Table II's Alibaba layout in miniature: one-hot targets, several behaviour sequences per group
ALIBABA = alibaba_schema(num_onehot=3, num_sequences=5, seq_len=6, vocab_size=[30, 40, 50], embedding_dim=8)

FLAT = Schema([Feature("a", "categorical", vocab_size=30), Feature("b", "categorical", vocab_size=7),
               Feature("tags", "sequence", vocab_size=11, max_len=3)], name="flat")


def random_features(schema, n, seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for f in schema.features:
        if f.kind == "dense":
            out[f.name] = rng.normal(size=(n,) + f.shape).astype(np.float32)
        elif f.kind == "categorical":
            out[f.name] = rng.integers(0, f.vocab_size, n).astype(np.int64)
        else:
            ids = rng.integers(1, f.vocab_size, (n, f.max_len))
            lengths = rng.integers(0, f.max_len + 1, n)          # includes empty rows
            ids[np.arange(f.max_len) >= lengths[:, None]] = 0
            out[f.name] = ids.astype(np.int64)
    return out


def random_data(schema, n, seed=0):
    rng = np.random.default_rng(seed + 1)
    labels = {name: rng.integers(0, 2, n).astype(np.float32) for name in schema.labels}
    return TabularData(schema, random_features(schema, n, seed), labels)


def eager_step(model, data):
    with tf.GradientTape() as tape:                                     # one eager step: cheap
        loss = tf.keras.losses.binary_crossentropy(data.labels[:, None], model(data.features, training=True))
        loss = tf.reduce_mean(loss)
    grads = tape.gradient(loss, model.trainable_weights)
    return float(loss), grads


# ---------------------------------------------------------------- registry

def test_registry_lists_the_papers_models():
    assert ALL == ["lr", "wide_deep", "deepfm", "dlrm", "dcn", "dcn_v2", "xdeepfm", "two_tower", "mmoe",
                   "star", "din", "dien", "dsin", "can", "atbrg"]
    for name in ALL:
        meta = zoo.info(name)
        assert callable(zoo.get(name)) and meta.builder is zoo.get(name)
        assert meta.paper and meta.description
        assert set(meta.training) >= {"optimizer", "learning_rate", "epochs", "batch_size"}


def test_unknown_model_error_lists_valid_names():
    with pytest.raises(ValueError, match="unknown model 'dinn'.*din, dien"):
        zoo.get("dinn")


def test_schema_check_names_what_is_missing():
    assert zoo.missing_inputs("din", MIXED) == []
    for name in SEQUENCE_MODELS:
        missing = zoo.missing_inputs(name, FLAT)
        assert len(missing) == 1 and "behaviour sequence" in missing[0]
        with pytest.raises(ValueError, match=f"model '{name}' cannot run on schema 'flat'.*group"):
            zoo.build(name, FLAT)
    assert set(zoo.compatible(FLAT)) == set(ALL) - set(SEQUENCE_MODELS)
    assert zoo.compatible(MIXED) == ALL


# ---------------------------------------------------------------- every model builds and trains

@pytest.mark.parametrize("name", ALL)
def test_builds_trains_and_serialises(name):
    tf.keras.utils.set_random_seed(0)
    data = random_data(MIXED, 64)
    params = zoo.info(name).prepare(MIXED, data.features) if zoo.info(name).prepare else {}
    model = zoo.build(name, MIXED, **params)
    assert isinstance(model, tf.keras.Model) and model.optimizer is None   # builders do not compile
    assert sorted(model.input_names) == sorted(f.name for f in MIXED.features)
    assert model.output_names == ["click"]
    assert getattr(model.outputs[0], "_keras_mask", None) is None        # no sample is masked out of the loss
    zoo.compile_model(model, zoo.recipe(name))
    before = [w.numpy().copy() for w in model.trainable_weights]
    loss = model.train_on_batch(data.features, data.labels, return_dict=True)["loss"]
    assert math.isfinite(loss)
    changed = [not np.array_equal(b, w.numpy()) for b, w in zip(before, model.trainable_weights)]
    assert sum(changed) >= len(changed) // 2, f"{name}: most weights should move in one step"
    probs = model(data.features).numpy()                                # eager: no second trace
    assert probs.shape == (64, 1) and np.all((probs >= 0) & (probs <= 1))

    clone = tf.keras.Model.from_config(model.get_config())
    assert [w.shape for w in clone.weights] == [w.shape for w in model.weights]
    clone.set_weights(model.get_weights())
    np.testing.assert_allclose(clone(data.features).numpy(), probs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", [n for n in ALL if n not in SEQUENCE_MODELS])
def test_flat_schema_without_dense_or_behaviour(name):
    data = random_data(FLAT, 32)
    loss, grads = eager_step(zoo.build(name, FLAT), data)
    assert math.isfinite(loss) and all(g is not None for g in grads)


@pytest.mark.parametrize("name", ALL)
def test_several_sequences_share_a_group_table(name):
    data = random_data(ALIBABA, 32)
    params = zoo.info(name).prepare(ALIBABA, data.features) if zoo.info(name).prepare else {}
    model = zoo.build(name, ALIBABA, **params)
    loss, grads = eager_step(model, data)
    assert math.isfinite(loss) and all(g is not None for g in grads)
    if name in SEQUENCE_MODELS + ("can", "two_tower"):
        groups = {f.group for f in ALIBABA.features}
        tables = [layer for layer in model.layers if layer.name.split("_", 1)[-1] in groups
                  and layer.name.startswith(("emb_", "table_"))]
        assert len(tables) == len(groups), f"{name}: one table per group, got {[t.name for t in tables]}"


def test_mmoe_has_one_head_per_label_and_single_task_models_use_the_first():
    schema = Schema(MIXED.features, labels=["click", "like"], name="two-tasks")
    data = random_data(schema, 128)
    model = zoo.get("mmoe")(schema)
    assert sorted(model.output_names) == ["click", "like"]
    result = zoo.build_and_train("mmoe", data, data, epochs=1)
    assert sorted(result.auc) == ["click", "like"]
    result = zoo.build_and_train("deepfm", data, data, epochs=1)
    assert list(result.auc) == ["click"]


def test_build_and_train_wrap_hook_sees_the_built_model():
    seen = []

    def wrap(model):
        seen.append(model.name)
        return model

    data = random_data(MIXED, 128)
    result = zoo.build_and_train("dcn", data, data, wrap=wrap, epochs=1, batch_size=64)
    assert seen == ["dcn"] and len(result.history["loss"]) == 1 and math.isfinite(result.test_auc)


def test_hparams_reach_the_builder():
    model = zoo.get("star")(MIXED, domain_feature="city", hidden=(8,))
    assert model.get_layer("partitioned_norm").num_domains == 25
    with pytest.raises(ValueError, match="domain_feature 'genres' must be a one-hot"):
        zoo.get("star")(MIXED, domain_feature="genres")
    with pytest.raises(ValueError, match="not in the schema"):
        zoo.get("two_tower")(MIXED, item_features=["nope"])


def test_dien_auxiliary_loss_is_added_when_asked():
    data = random_data(MIXED, 32)
    assert not zoo.get("dien")(MIXED).losses
    model = zoo.get("dien")(MIXED, aux_loss_weight=1.0)
    model(data.features)
    assert len(model.losses) == 1 and float(model.losses[0]) > 0


def test_two_tower_finds_item_attributes_in_the_data():
    from picasso_tf.models.two_tower import item_attributes
    rng = np.random.default_rng(0)
    item = rng.integers(1, 40, 400)
    features = random_features(MIXED, 400)
    features["item"] = item
    features["city"] = (item * 7) % 25                        # a function of the item: item side
    assert item_attributes(MIXED, features) == ["item", "city"]
    assert item_attributes(MIXED, random_features(MIXED, 30)) == ["item"]   # too few repeats: by name


# ---------------------------------------------------------------- embedding styles

def _layers(model):
    return {layer.name: layer for layer in model.layers}


def test_embedding_styles_vary_across_the_zoo():
    # a table shared by a target and its behaviour sequence: one Embedding called twice
    din = zoo.get("din")(MIXED)
    shared = _layers(din)["emb_item"]
    assert isinstance(shared, tf.keras.layers.Embedding) and len(shared.inbound_nodes) == 2
    # add_weight tables looked up with tf.nn ops in custom layers
    dlrm = zoo.get("dlrm")(MIXED)
    assert type(_layers(dlrm)["bag_genres"]).__name__ == "EmbeddingBag"
    assert type(_layers(zoo.get("xdeepfm")(MIXED))["embedding"]).__name__ == "OffsetEmbedding"
    # mask_zero embeddings for bags
    wd = zoo.get("wide_deep")(MIXED)
    assert _layers(wd)["emb_genres"].mask_zero and not _layers(wd)["emb_user"].mask_zero
    # per-feature widths follow the schema's hints
    assert _layers(wd)["emb_user"].output_dim == 16 and _layers(wd)["emb_city"].output_dim == 4


def test_masked_pooling_ignores_padding_and_empty_rows():
    from picasso_tf.models.blocks import MaskedPooling
    emb = tf.constant([[[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]], [[5.0, 5.0], [7.0, 7.0], [8.0, 8.0]]])
    ids = tf.constant([[3, 1, 0], [0, 0, 0]], tf.int64)
    np.testing.assert_allclose(MaskedPooling("mean")([emb, ids]), [[2.0, 3.0], [0.0, 0.0]])
    np.testing.assert_allclose(MaskedPooling("sum")([emb, ids]), [[4.0, 6.0], [0.0, 0.0]])


def test_augru_with_zero_attention_keeps_its_state():
    from picasso_tf.models.dien import AUGRUCell
    cell = AUGRUCell(4)
    rnn = tf.keras.layers.RNN(cell, return_sequences=True)
    x = tf.random.stateless_normal([2, 3, 5], seed=[1, 2])
    att = tf.constant([[0.0, 0.0, 0.0], [1.0, 0.0, 1.0]])[..., None]
    out = rnn(tf.concat([x, att], -1)).numpy()
    np.testing.assert_allclose(out[0], 0.0, atol=1e-7)           # never updated from the zero state
    np.testing.assert_allclose(out[1, 1], out[1, 0], atol=1e-7)  # step with attention 0 is a no-op
    assert np.abs(out[1, 2] - out[1, 1]).max() > 1e-4


def test_atbrg_cooccurrence_graph():
    from picasso_tf.models.atbrg import build_graph
    schema = Schema([Feature("item", "categorical", vocab_size=6, group="item"),
                     Feature("hist", "sequence", vocab_size=6, max_len=3, group="item")])
    features = {"item": np.array([1, 1, 2]), "hist": np.array([[2, 3, 0], [2, 4, 0], [5, 0, 0]])}
    graph = build_graph(schema, features, num_neighbors=2, window=1)["item"]
    assert graph.shape == (6, 2)
    assert graph[1, 0] == 2                     # item 1 co-occurs twice with 2
    assert set(graph[2]) <= {1, 3, 4, 5} and 1 in graph[2]
    assert list(graph[0]) == [0, 0]             # padding has no neighbours


def test_auc_matches_the_data_package():
    rng = np.random.default_rng(0)
    labels, scores = rng.integers(0, 2, 500), np.round(rng.random(500), 2)
    assert zoo.auc(labels, scores) == pytest.approx(roc_auc(labels, scores))
    assert math.isnan(zoo.auc(np.ones(4), np.arange(4)))


# ---------------------------------------------------------------- quality (slow)

QUICK_MOVIELENS_EPOCHS = {"lr": 2}       # LR's recipe is 5 short epochs at a high rate


@pytest.fixture(scope="module")
def movielens():
    return quality.movielens("random")


@pytest.fixture(scope="module")
def synthetic():
    return {linear: quality.synthetic(linear=linear) for linear in (False, True)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_movielens_random_split_auc(name, movielens):
    train, test = movielens
    result = zoo.build_and_train(name, train, test, epochs=QUICK_MOVIELENS_EPOCHS.get(name, 1))
    tf.keras.backend.clear_session()
    assert result.test_auc >= quality.AUC_LIMIT, f"{name}: test AUC {result.test_auc:.4f}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_synthetic_close_to_planted_model(name, synthetic):
    train, test, planted = synthetic[quality.synthetic_is_linear(name)]
    result = zoo.build_and_train(name, train, test, **quality.synthetic_recipe(name))
    tf.keras.backend.clear_session()
    gap = planted - result.test_auc
    assert gap <= quality.GAP_LIMIT, f"{name}: AUC {result.test_auc:.4f}, planted {planted:.4f}, gap {gap:.4f}"
