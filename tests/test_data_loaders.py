"""Bundled datasets: MovieLens-100K (CTR framing, behaviour history), Criteo and Avazu samples."""
import csv
import os

import numpy as np
import pytest
import tensorflow as tf

from picasso_tf.data import (DataFormatError, bundled_path, load_avazu_sample, load_criteo_sample, load_movielens,
                             read_avazu_csv)
from picasso_tf.data.samples import BUNDLED_DIR

# Its tests run on one pytest-xdist worker: they share the movielens module fixture.
pytestmark = pytest.mark.xdist_group("test_data_loaders")


def _ratings():
    """(user, item, rating, timestamp) rows of the raw file, parsed here independently."""
    with open(bundled_path("ml-100k/ml-100k.inter")) as f:
        next(f)
        return [tuple(int(float(v)) for v in line.split("\t")) for line in f]


@pytest.fixture(scope="module")
def movielens():
    return load_movielens()


def test_movielens_random_split(movielens):
    train, test = movielens
    assert (train.num_examples, test.num_examples) == (80_000, 20_000)
    for part in (train, test):
        np.testing.assert_array_equal(part.labels, part.extras["rating"] >= 4)
    ratings = _ratings()
    assert train.labels.sum() + test.labels.sum() == sum(r[2] >= 4 for r in ratings)
    keys = {(u, i) for u, i, _, _ in ratings}
    seen = set(zip(train.features["user_id"].tolist(), train.features["item_id"].tolist())) | \
        set(zip(test.features["user_id"].tolist(), test.features["item_id"].tolist()))
    assert seen == keys


def test_movielens_first_rating_exact(movielens):
    train, test = movielens
    both = {k: np.concatenate([train.features[k], test.features[k]]) for k in train.features}
    row = np.flatnonzero((both["user_id"] == 196) & (both["item_id"] == 242))[0]
    # user 196: age 49 (bucket 45-49, id 5), M (F=1, M=2), writer (the last of 21 sorted occupations)
    assert (both["age"][row], both["gender"][row], both["occupation"][row]) == (5, 2, 21)
    schema = train.schema
    assert schema["genres"].max_len == 6 and schema["genres"].vocab_size == 20
    assert schema["age"].vocab_size == 8 and schema["user_id"].vocab_size == 944


def test_movielens_history_uses_only_earlier_ratings(movielens):
    when = {(u, i): t for u, i, _, t in _ratings()}
    times_of_user = {}
    for (u, _), t in when.items():
        times_of_user.setdefault(u, []).append(t)
    for part in movielens:
        users, items, times = part.features["user_id"], part.features["item_id"], part.extras["timestamp"]
        history = part.features["hist_item_id"]
        assert history.shape[1] == 20
        for r in range(0, part.num_examples, 97):
            past = [i for i in history[r] if i]
            assert np.array_equal(history[r] != 0, np.arange(20) < len(past))   # right-padded
            stamps = [when[(users[r], i)] for i in past]
            assert all(t < times[r] for t in stamps) and stamps == sorted(stamps)
            assert items[r] not in past
            earlier = sum(t < times[r] for t in times_of_user[users[r]])
            assert len(past) == min(earlier, 20)


def test_movielens_time_split_and_history_length():
    train, test = load_movielens(split="time", test_fraction=0.1, max_history=5)
    assert test.num_examples == 10_000
    assert train.extras["timestamp"].max() <= test.extras["timestamp"].min()
    assert train.schema["hist_item_id"].max_len == 5
    with pytest.raises(ValueError, match="split"):
        load_movielens(split="user")


def test_criteo_sample_loader():
    data = load_criteo_sample(buckets=500)
    with open(bundled_path("criteo_sample.csv")) as f:
        rows = list(csv.DictReader(f))
    assert data.num_examples == 200 and data.labels.sum() == sum(r["label"] == "1" for r in rows)
    assert data.features["C2"][1] == int(rows[1]["C2"], 16) % 500 + 1
    assert data.features["C2"].max() <= 500


def test_avazu_sample_loader():
    data = load_avazu_sample(buckets=1000)
    with open(bundled_path("avazu_sample.csv")) as f:
        rows = list(csv.DictReader(f))
    assert data.num_examples == 100 and data.schema.labels == ["click"]
    np.testing.assert_array_equal(data.labels, [float(r["click"]) for r in rows])
    assert set(data.features["hour_of_day"]) == {1} and set(data.features["weekday"]) == {2}   # 14102100: Tue 00h
    # FarmHash Fingerprint64 of the bytes, computed here through tf.fingerprint.
    fingerprint = int.from_bytes(tf.fingerprint(tf.constant([rows[0]["site_id"]])).numpy()[0].tobytes(), "little")
    assert data.features["site_id"][0] == fingerprint % 1000 + 1


def test_avazu_bad_hour(tmp_path):
    lines = open(bundled_path("avazu_sample.csv")).read().splitlines()
    lines[3] = lines[3].replace(",14102100,", ",14133100,")
    path = tmp_path / "avazu.csv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFormatError, match=r"avazu.csv, line 4, column hour: value '14133100' is not a date"):
        read_avazu_csv(str(path))


def test_bundled_files_and_their_readme():
    names = {"criteo_sample.csv", "avazu_sample.csv", "README.md", "ml-100k"}
    assert names <= set(os.listdir(BUNDLED_DIR))
    readme = open(os.path.join(BUNDLED_DIR, "README.md")).read()
    assert "Apache-2.0" in readme and "Harper & Konstan" in readme
    with pytest.raises(FileNotFoundError, match="no such bundled file"):
        bundled_path("kdd.csv")
