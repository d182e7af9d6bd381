"""Schema conventions: JSON round trip, keras_inputs, tensor_specs."""
import pytest
import tensorflow as tf

from picasso_tf.data import (CATEGORICAL, DENSE, SEQUENCE, Feature, Schema, alibaba_schema, criteo_schema,
                             load_movielens, wide_schema)


def _mixed_schema():
    return Schema([Feature("price", DENSE), Feature("vec", DENSE, dim=3),
                   Feature("item", CATEGORICAL, vocab_size=100, embedding_dim=8, group="item"),
                   Feature("hist", SEQUENCE, vocab_size=100, max_len=5, group="item")],
                  labels=["click", "buy"], name="mixed")


@pytest.mark.parametrize("schema", [criteo_schema(), alibaba_schema(2, 3, 4, 50), wide_schema(5), _mixed_schema()],
                         ids=["criteo", "alibaba", "wide", "mixed"])
def test_json_round_trip(schema, tmp_path):
    assert Schema.from_json(schema.to_json()) == schema
    schema.save(tmp_path / "schema.json")
    assert Schema.load(tmp_path / "schema.json") == schema


def test_movielens_schema_round_trip():
    train, _ = load_movielens()
    assert Schema.from_json(train.schema.to_json()) == train.schema
    assert train.schema["item_id"].group == train.schema["hist_item_id"].group == "item"


def test_keras_inputs_follow_the_conventions():
    inputs = _mixed_schema().keras_inputs()
    assert list(inputs) == ["price", "vec", "item", "hist"]
    assert inputs["price"].shape.as_list() == [None] and inputs["price"].dtype == tf.float32
    assert inputs["vec"].shape.as_list() == [None, 3]
    assert inputs["item"].shape.as_list() == [None] and inputs["item"].dtype == tf.int64
    assert inputs["hist"].shape.as_list() == [None, 5] and inputs["hist"].dtype == tf.int64


def test_tensor_specs_single_and_several_labels():
    features, label = criteo_schema().tensor_specs(32)
    assert features["I1"] == tf.TensorSpec([32], tf.float32, name="I1")
    assert features["C1"].dtype == tf.int64 and label.shape.as_list() == [32]
    _, labels = _mixed_schema().tensor_specs()
    assert sorted(labels) == ["buy", "click"] and labels["buy"].shape.as_list() == [None]


def test_criteo_schema_sizes():
    full = criteo_schema()
    assert [f.vocab_size - 1 for f in full.categorical][:3] == [1460, 583, 10131227]
    assert len(full.dense) == 13 and all(f.hashed for f in full.categorical)
    small = criteo_schema(scale=0.01, max_buckets=5000)
    assert max(f.vocab_size for f in small.categorical) == 5001
    assert small["C9"].vocab_size == 2   # ceil(3 * 0.01) = 1 bucket, plus id 0
    assert all(f.vocab_size == 101 for f in criteo_schema(100).categorical)
    with pytest.raises(ValueError, match="26"):
        criteo_schema([10, 20])


def test_presets_layout():
    ali = alibaba_schema()
    assert len(ali.categorical) == 7 and len(ali.sequences) == 12
    assert len(ali.categorical) + sum(f.max_len for f in ali.sequences) == 1207   # Table II's field count
    assert ali["seq8"].group == "cat1" and ali["seq8"].vocab_size == ali["cat1"].vocab_size
    wide = wide_schema(6)
    assert [f.embedding_dim for f in wide.features] == [8, 16, 32, 8, 16, 32]
    assert all(f.vocab_size == 20_000 for f in wide.features)
