"""MovieLens-100K in a CTR framing, from the bundled RecBole copy (bundled/ml-100k).

One example per rating, label = rating >= 4. Features:
  user_id, item_id     the dataset's own ids (1..943, 1..1682)
  age                  bucket of the user's age: <18, 18-24, 25-34, 35-44, 45-49, 50-55, 56+
  gender, occupation   categorical, ids in sorted order of the values
  zip_prefix           the first two characters of the zip code
  release_year         categorical over the years present; unparseable years (items
                       267 and 1412) are missing (id 0)
  genres               multi-hot sequence of the movie's genres (group "genre")
  hist_item_id         the items the user rated strictly before this rating's
                       timestamp, oldest first, the most recent max_history of them,
                       right-padded (group "item", shared with item_id). All earlier
                       ratings count, whatever their value; ratings sharing a
                       timestamp never see each other, so nothing leaks from the
                       current or a simultaneous example.
extras: "rating" and "timestamp" per example.
"""
import numpy as np

from picasso_tf.data.dataset import TabularData
from picasso_tf.data.errors import DataFormatError
from picasso_tf.data.samples import bundled_path
from picasso_tf.data.schema import CATEGORICAL, SEQUENCE, Feature, Schema

AGE_EDGES = (18, 25, 35, 45, 50, 56)
SPLITS = ("random", "time")


def _read_atomic(name):
    """A RecBole atomic file -> {column name: list of strings} (header "name:type\\t...")."""
    path = bundled_path(f"ml-100k/{name}")
    with open(path, encoding="utf-8") as f:
        header = [h.split(":")[0] for h in f.readline().rstrip("\n").split("\t")]
        rows = [line.rstrip("\n").split("\t") for line in f]
    for number, row in enumerate(rows, start=2):
        if len(row) != len(header):
            raise DataFormatError(f"{path}, line {number}: {len(row)} fields, expected {len(header)} "
                                  f"({header})")
    return {h: [row[i] for row in rows] for i, h in enumerate(header)}


def _index(values):
    """Sorted distinct values -> ids 1..K."""
    return {v: i + 1 for i, v in enumerate(sorted(set(values)))}


def _encode(values):
    """Ids 1..K of `values`, numbered in sorted order of the distinct values."""
    index = _index(values)
    return np.array([index[v] for v in values], np.int64)


def _rows(ids, keys, what):
    """The row of each of `keys` in the table whose ids are `ids`; all must be there."""
    order = np.argsort(ids)
    rows = order[np.minimum(np.searchsorted(ids[order], keys), len(ids) - 1)]
    missing = ids[rows] != keys
    if missing.any():
        raise DataFormatError(f"ml-100k.inter: {what} {keys[missing][0]} is not in ml-100k.{what.split('_')[0]}")
    return rows


def _schema(max_history, *, users, items, occupations, zip_prefixes, years, genres, max_genres):
    """The schema of load_movielens, given the counts of distinct values in the data."""
    def categorical(name, count, dim=8, group=None):
        return Feature(name, CATEGORICAL, vocab_size=count + 1, embedding_dim=dim, group=group)

    return Schema([
        categorical("user_id", users, 16),
        categorical("item_id", items, 16, group="item"),
        categorical("age", len(AGE_EDGES) + 1),
        categorical("gender", 2),
        categorical("occupation", occupations),
        categorical("zip_prefix", zip_prefixes),
        categorical("release_year", years),
        Feature("genres", SEQUENCE, vocab_size=genres + 1, max_len=max_genres, embedding_dim=8, group="genre"),
        Feature("hist_item_id", SEQUENCE, vocab_size=items + 1, max_len=max_history, embedding_dim=16,
                group="item"),
    ], labels=["label"], name="movielens-100k")


def _history(users, items, timestamps, max_history):
    """For each rating, the user's items rated strictly earlier, oldest first, the last
    max_history of them, right-padded with 0 ([N, max_history])."""
    order = np.lexsort((timestamps, users))           # by user, then time
    u, t = users[order], timestamps[order]
    n = len(order)
    new_user = np.r_[True, u[1:] != u[:-1]]
    user_start = np.maximum.accumulate(np.where(new_user, np.arange(n), 0))
    new_time = new_user | np.r_[True, t[1:] != t[:-1]]
    cutoff = np.maximum.accumulate(np.where(new_time, np.arange(n), 0))   # first rating at this time
    length = np.minimum(cutoff - user_start, max_history)
    positions = (cutoff - length)[:, None] + np.arange(max_history)
    valid = np.arange(max_history) < length[:, None]
    history = np.where(valid, items[order][np.minimum(positions, n - 1)], 0)
    out = np.empty_like(history)
    out[order] = history
    return out


def load_movielens(split="random", test_fraction=0.2, seed=0, max_history=20):
    """(train, test) TabularData of MovieLens-100K (see the module docstring).

    split="random": a seeded random split of the ratings; "time": the latest
    test_fraction of the ratings (by timestamp) form the test set.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    ratings, users, movies = (_read_atomic(f"ml-100k.{k}") for k in ("inter", "user", "item"))
    user_ids = np.array(users["user_id"], np.int64)
    item_ids = np.array(movies["item_id"], np.int64)

    zips = [z[:2] for z in users["zip_code"]]
    user_columns = {
        "age": np.searchsorted(AGE_EDGES, np.array(users["age"], np.int64), side="right") + 1,
        "gender": _encode(users["gender"]),
        "occupation": _encode(users["occupation"]),
        "zip_prefix": _encode(zips),
    }
    years = _index(y for y in movies["release_year"] if y.isdigit() and len(y) == 4)
    genre_ids = _index(g for c in movies["class"] for g in c.split())
    max_genres = max(len(c.split()) for c in movies["class"])
    genres = np.zeros((len(item_ids), max_genres), np.int64)
    for row, names in enumerate(movies["class"]):
        genres[row, :len(names.split())] = [genre_ids[g] for g in names.split()]

    user = np.array(ratings["user_id"], np.int64)
    item = np.array(ratings["item_id"], np.int64)
    rating = np.array(ratings["rating"], np.float32)
    timestamp = np.array(ratings["timestamp"], np.float64).astype(np.int64)
    user_row = _rows(user_ids, user, "user_id")
    item_row = _rows(item_ids, item, "item_id")
    features = {
        "user_id": user,
        "item_id": item,
        **{k: v[user_row] for k, v in user_columns.items()},
        "release_year": np.array([years.get(y, 0) for y in movies["release_year"]], np.int64)[item_row],
        "genres": genres[item_row],
        "hist_item_id": _history(user, item, timestamp, max_history),
    }
    schema = _schema(max_history, users=int(user_ids.max()), items=int(item_ids.max()),
                              occupations=len(set(users["occupation"])), zip_prefixes=len(set(zips)),
                              years=len(years), genres=len(genre_ids), max_genres=max_genres)
    data = TabularData(schema, features, (rating >= 4).astype(np.float32),
                       extras={"rating": rating, "timestamp": timestamp})
    if split == "random":
        return data.split(test_fraction, seed)
    order = np.argsort(timestamp, kind="stable")
    num_test = int(round(len(order) * test_fraction))
    return data.take(order[:len(order) - num_test]), data.take(order[len(order) - num_test:])
