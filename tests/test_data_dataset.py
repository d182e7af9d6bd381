"""TabularData: checks on construction, take/split, the tf.data pipeline and its shards."""
import numpy as np
import pytest
import tensorflow as tf

from picasso_tf.data import CATEGORICAL, DENSE, SEQUENCE, DataFormatError, Feature, Schema, TabularData

SCHEMA = Schema([Feature("x", DENSE), Feature("row", CATEGORICAL, vocab_size=1000),
                 Feature("seq", SEQUENCE, vocab_size=50, max_len=3)], name="toy")
N = 103


def _data(n=N):
    rng = np.random.default_rng(0)
    return TabularData(SCHEMA, {"x": rng.random(n), "row": np.arange(1, n + 1),
                                "seq": rng.integers(0, 50, (n, 3))},
                       rng.integers(0, 2, n), extras={"weight": np.arange(n) * 2.0})


def assert_specs(dataset, schema, batch_size=None):
    """The dataset's elements are what schema.tensor_specs(batch_size) declares."""
    expected = schema.tensor_specs(batch_size)
    tf.nest.assert_same_structure(dataset.element_spec, expected)
    for actual, spec in zip(tf.nest.flatten(dataset.element_spec), tf.nest.flatten(expected)):
        assert spec.dtype == actual.dtype and spec.shape.as_list() == actual.shape.as_list(), (actual, spec)


def _rows(dataset):
    """The `row` ids of every example of a dataset, in order."""
    return np.concatenate([f["row"].numpy() for f, _ in dataset])


def test_arrays_are_cast_to_the_conventions():
    data = _data()
    assert data.num_examples == len(data) == N
    assert data.features["x"].dtype == np.float32 and data.features["row"].dtype == np.int64
    assert data.labels.dtype == np.float32 and data.labels.shape == (N,)


@pytest.mark.parametrize("change, message", [
    (lambda f: f.pop("x"), r"missing \['x'\]"),
    (lambda f: f.update(extra=np.zeros(N)), r"not in the schema \['extra'\]"),
    (lambda f: f.update(seq=np.zeros((N, 4), np.int64)), r"'seq' \(sequence\): expected shape \(103, 3\)"),
    (lambda f: f.update(row=np.ones(N, np.float32)), "'row' .*expected integer ids"),
    (lambda f: f.__setitem__("row", np.r_[np.arange(1, N), 1000]), "'row' .*row 102: id 1000 is outside "
                                                                   r"\[0, 1000\)"),
    (lambda f: f["seq"].__setitem__((5, 1), -3), r"'seq' .*row 5: id -3 is outside"),
    (lambda f: f["x"].__setitem__(7, np.nan), "'x' .*row 7: NaN"),
])
def test_bad_arrays_are_named(change, message):
    features = dict(_data().features)
    features = {k: v.copy() for k, v in features.items()}
    change(features)
    with pytest.raises(DataFormatError, match=message):
        TabularData(SCHEMA, features, np.zeros(N))


def test_labels_must_match_the_schema():
    features = _data().features
    with pytest.raises(DataFormatError, match="do not match"):
        TabularData(SCHEMA, features, {"click": np.zeros(N)})
    with pytest.raises(DataFormatError, match="shape"):
        TabularData(SCHEMA, features, np.zeros(N + 1))


def test_take_and_split():
    data = _data()
    part = data.take([5, 2])
    assert part.features["row"].tolist() == [6, 3] and part.extras["weight"].tolist() == [10.0, 4.0]
    assert data.take(data.features["row"] % 2 == 0).num_examples == N // 2
    train, test = data.split(0.25, seed=1)
    assert (train.num_examples, test.num_examples) == (77, 26)
    rows = np.r_[train.features["row"], test.features["row"]]
    assert sorted(rows.tolist()) == list(range(1, N + 1))
    assert np.all(np.diff(test.features["row"]) > 0)   # each part keeps the original order
    assert np.array_equal(data.split(0.25, seed=1)[1].features["row"], test.features["row"])
    assert not np.array_equal(data.split(0.25, seed=2)[1].features["row"], test.features["row"])
    with pytest.raises(ValueError, match="strictly between"):
        data.split(1.0)


def test_dataset_batches_in_order_with_the_declared_specs():
    data = _data()
    dataset = data.dataset(10)
    assert_specs(dataset, SCHEMA)
    batches = list(dataset)
    assert [len(label) for _, label in batches] == [10] * 10 + [3]
    assert _rows(dataset).tolist() == list(range(1, N + 1))
    features, label = batches[1]
    assert np.array_equal(features["seq"].numpy(), data.features["seq"][10:20])
    assert np.array_equal(features["x"].numpy(), data.features["x"][10:20])
    assert np.array_equal(label.numpy(), data.labels[10:20])
    assert [len(label) for _, label in data.dataset(10, drop_remainder=True)] == [10] * 10


def test_shuffle_is_seeded_and_reshuffles_each_epoch():
    data = _data()
    dataset = data.dataset(16, shuffle=True, seed=3)
    first, second = _rows(dataset), _rows(dataset)   # two passes, as two Keras epochs make
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(1, N + 1))
    assert not np.array_equal(first, np.arange(1, N + 1)) and not np.array_equal(first, second)
    assert np.array_equal(_rows(data.dataset(16, shuffle=True, seed=3)), first)   # same seed, same epochs
    assert not np.array_equal(_rows(data.dataset(16, shuffle=True, seed=4)), first)
    repeated = _rows(data.dataset(N, shuffle=True, seed=3, repeat=True).take(2))
    assert np.array_equal(repeated[:N], first) and np.array_equal(repeated[N:], second)


@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_are_disjoint_and_cover_everything(shuffle):
    data = _data()
    shards = [_rows(data.dataset(8, shuffle=shuffle, seed=5, rank=r, world=3)) for r in range(3)]
    assert sorted(len(s) for s in shards) == [34, 34, 35]
    assert sorted(np.concatenate(shards).tolist()) == list(range(1, N + 1))
    with pytest.raises(ValueError, match="rank"):
        data.dataset(8, rank=3, world=3)


def test_from_dataset_round_trip():
    data = _data()
    back = TabularData.from_dataset(SCHEMA, data.dataset(7))
    for name in data.features:
        assert np.array_equal(back.features[name], data.features[name])
    assert np.array_equal(back.labels, data.labels)


def test_several_labels():
    schema = Schema([Feature("x", DENSE)], labels=["click", "buy"])
    data = TabularData(schema, {"x": np.arange(4)}, {"click": np.ones(4), "buy": np.zeros(4)})
    _, labels = next(iter(data.dataset(4)))
    assert sorted(labels) == ["buy", "click"] and labels["click"].numpy().tolist() == [1, 1, 1, 1]
    with pytest.raises(DataFormatError, match="pass them as a dict"):
        TabularData(schema, {"x": np.arange(4)}, np.ones(4))
