"""Avazu's CTR format and its bundled 100-row sample (bundled/avazu_sample.csv).

Columns: id (not a feature), click (the label), hour as YYMMDDHH -- turned into the
categoricals hour_of_day (id = hour + 1) and weekday (id = Monday 1 .. Sunday 7) --
and 21 categorical columns whose raw strings are hashed into `buckets` ids each with
hashing.hash_strings (FarmHash Fingerprint64; an empty value is id 0).
"""
import csv
import datetime

import numpy as np

from picasso_tf.data.dataset import TabularData
from picasso_tf.data.errors import DataFormatError
from picasso_tf.data.hashing import hash_strings
from picasso_tf.data.samples import bundled_path
from picasso_tf.data.schema import CATEGORICAL, Feature, Schema

HASHED_COLUMNS = ("C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id", "app_domain",
                  "app_category", "device_id", "device_ip", "device_model", "device_type", "device_conn_type",
                  "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21")


def avazu_schema(buckets=1000, embedding_dim=16):
    """hour_of_day, weekday and the 21 hashed columns (vocab_size buckets + 1); label "click"."""
    features = [Feature("hour_of_day", CATEGORICAL, vocab_size=25, embedding_dim=embedding_dim),
                Feature("weekday", CATEGORICAL, vocab_size=8, embedding_dim=embedding_dim)]
    features += [Feature(n, CATEGORICAL, vocab_size=buckets + 1, hashed=True, embedding_dim=embedding_dim)
                 for n in HASHED_COLUMNS]
    return Schema(features, labels=["click"], name="avazu")


def _hour(path, line, value):
    """(hour of day, weekday 0-6) of a YYMMDDHH value."""
    try:
        if len(value) != 8 or not value.isdigit():
            raise ValueError
        when = datetime.datetime(2000 + int(value[:2]), int(value[2:4]), int(value[4:6]), int(value[6:]))
    except ValueError:
        raise DataFormatError(f"{path}, line {line}, column hour: value {value!r} is not a date and hour "
                              "written YYMMDDHH") from None
    return when.hour, when.weekday()


def read_avazu_csv(path, buckets=1000):
    """An Avazu CSV file with its header, read whole into TabularData (for small files:
    it parses in Python)."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    header = rows[0]
    missing = [c for c in ("click", "hour") + HASHED_COLUMNS if c not in header]
    if missing:
        raise DataFormatError(f"{path}, line 1: the header has no column {', '.join(missing)}")
    columns = {name: [] for name in header}
    for line, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise DataFormatError(f"{path}, line {line}: {len(row)} fields, expected {len(header)}")
        if row[header.index("click")] not in ("0", "1"):
            raise DataFormatError(f"{path}, line {line}, column click: value {row[header.index('click')]!r} "
                                  "is not 0 or 1")
        for name, value in zip(header, row):
            columns[name].append(value)
    hours = np.array([_hour(path, line, v) for line, v in enumerate(columns["hour"], start=2)], np.int64)
    features = {"hour_of_day": hours[:, 0] + 1, "weekday": hours[:, 1] + 1}
    features.update({n: hash_strings(np.array(columns[n]), buckets + 1).numpy() for n in HASHED_COLUMNS})
    return TabularData(avazu_schema(buckets), features, np.array(columns["click"], np.float32))


def load_avazu_sample(buckets=1000):
    """The bundled 100-row Avazu sample as TabularData."""
    return read_avazu_csv(bundled_path("avazu_sample.csv"), buckets)
