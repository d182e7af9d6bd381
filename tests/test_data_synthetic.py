"""Synthetic generators: determinism, Zipf skew, planted labels, groups, stream, presets."""
import itertools

import numpy as np
import pytest

from picasso_tf.data import (CATEGORICAL, DENSE, Feature, Schema, alibaba_schema, criteo_schema, generate,
                             generate_chunks, roc_auc, stream, wide_schema)
from test_data_dataset import assert_specs

ALIBABA = alibaba_schema(num_onehot=3, num_sequences=4, seq_len=10, vocab_size=[5000, 300, 2000])


def _equal(a, b):
    return all(np.array_equal(a.features[n], b.features[n]) for n in a.features) and \
        np.array_equal(a.labels, b.labels)


def test_same_seed_same_data_other_seed_other_data():
    schema = criteo_schema(max_buckets=10_000)
    a, b, c = generate(schema, 2000, seed=1), generate(schema, 2000, seed=1), generate(schema, 2000, seed=2)
    assert _equal(a, b)
    assert np.array_equal(a.extras["planted_probability"], b.extras["planted_probability"])
    assert not any(np.array_equal(a.features[n], c.features[n]) for n in a.features)
    assert not np.array_equal(a.labels, c.labels)


def test_default_zipf_skew_meets_the_paper():
    """At the default exponent the hottest 20% of ids cover at least 70% of accesses
    (PICASSO §II-B), and the hot ids are scattered, not the smallest ones."""
    data = generate(wide_schema(num_fields=2, vocab_size=20_000), 200_000, seed=0)
    for ids in data.features.values():
        counts = np.sort(np.bincount(ids, minlength=20_000)[1:])[::-1]
        assert counts[:len(counts) // 5].sum() / counts.sum() >= 0.70
        hottest = np.argsort(np.bincount(ids))[::-1][:10]
        assert hottest.max() > 1000
    flat = generate(wide_schema(num_fields=1, vocab_size=20_000), 200_000, seed=0, zipf_exponent=0.0)
    counts = np.sort(np.bincount(flat.features["f0"], minlength=20_000)[1:])[::-1]
    assert counts[:4000].sum() / counts.sum() < 0.3   # exponent 0 is uniform


def test_planted_labels_are_learnable():
    data = generate(criteo_schema(max_buckets=50_000), 50_000, seed=3)
    probability = data.extras["planted_probability"]
    assert roc_auc(data.labels, probability) > 0.7
    assert abs(roc_auc(data.labels, np.random.default_rng(0).random(data.num_examples)) - 0.5) < 0.02
    assert abs(data.labels.mean() - 0.25) < 0.03
    assert abs(roc_auc(data.labels, data.features["C7"] * 0.0) - 0.5) < 1e-9   # constant scores: 0.5


def test_sequences_share_their_groups_vocabulary_and_are_right_padded():
    data = generate(ALIBABA, 5000, seed=0)
    for j in range(4):
        seq, target = data.features[f"seq{j}"], data.features[f"cat{j % 3}"]
        lengths = (seq != 0).sum(axis=1)
        assert lengths.min() >= 1 and lengths.max() == 10
        assert np.array_equal(seq != 0, np.arange(10) < lengths[:, None])   # ids first, then padding
        hot_seq = set(np.argsort(np.bincount(seq[seq != 0]))[::-1][:5])
        hot_target = set(np.argsort(np.bincount(target))[::-1][:5])
        assert len(hot_seq & hot_target) >= 3   # one vocabulary, one popularity order
    assert roc_auc(data.labels, data.extras["planted_probability"]) > 0.7


def test_several_labels_and_dense_vectors():
    schema = Schema([Feature("v", DENSE, dim=4), Feature("c", CATEGORICAL, vocab_size=100)],
                    labels=["click", "buy"])
    data = generate(schema, 3000, seed=0)
    assert data.features["v"].shape == (3000, 4) and sorted(data.labels) == ["buy", "click"]
    planted = data.extras["planted_probability"]
    assert not np.array_equal(planted["click"], planted["buy"])
    assert roc_auc(data.labels["click"], planted["click"]) > 0.65


def test_stream_is_seeded_and_finite_on_request():
    schema = wide_schema(num_fields=3, vocab_size=100)
    first = stream(schema, 16, num_batches=3, seed=5)
    assert_specs(first, schema, 16)
    batches = [(f["f1"].numpy(), y.numpy()) for f, y in first]
    again = [(f["f1"].numpy(), y.numpy()) for f, y in stream(schema, 16, num_batches=3, seed=5)]
    other = [f["f1"].numpy() for f, _ in stream(schema, 16, num_batches=3, seed=6)]
    assert len(batches) == 3 and all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
                                     for a, b in zip(batches, again))
    assert not np.array_equal(batches[0][0], other[0])
    endless = stream(schema, 8, seed=5)
    assert sum(1 for _ in itertools.islice(endless, 50)) == 50


def test_chunks():
    chunks = list(generate_chunks(ALIBABA, 250, chunk_size=100, seed=1))
    assert [c.num_examples for c in chunks] == [100, 100, 50]
    again = list(generate_chunks(ALIBABA, 250, chunk_size=100, seed=1))
    assert all(_equal(a, b) for a, b in zip(chunks, again))


def test_bad_generator_options():
    with pytest.raises(ValueError, match="zipf_exponent"):
        generate(wide_schema(2), 10, zipf_exponent=-1)
    mixed = Schema([Feature("a", CATEGORICAL, vocab_size=10, group="g"),
                    Feature("b", "sequence", vocab_size=20, max_len=2, group="g")])
    with pytest.raises(ValueError, match="group 'g' mixes vocab sizes"):
        generate(mixed, 10)


def test_roc_auc_matches_pair_counting():
    rng = np.random.default_rng(1)
    labels, scores = rng.integers(0, 2, 300), rng.integers(0, 20, 300)   # many ties
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairs = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    assert roc_auc(labels, scores) == pytest.approx(pairs / (len(pos) * len(neg)))
    with pytest.raises(ValueError, match="both classes"):
        roc_auc(np.ones(3), np.arange(3))
