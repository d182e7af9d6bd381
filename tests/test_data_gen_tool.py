"""picasso-gen-data: every preset and format is written with its schema and reads back."""
import json
import os

import pytest

from picasso_tf.data import Schema, TabularData, read_criteo, read_csv, read_parquet, read_tfrecord
from picasso_tf.tools import gen_data

READERS = {"parquet": read_parquet, "tfrecord": read_tfrecord, "csv": read_csv}


@pytest.mark.parametrize("preset, options, fmt", [
    ("wide", ["--num-fields", "4", "--vocab-size", "50"], "csv"),
    ("alibaba", ["--num-onehot", "2", "--num-sequences", "3", "--seq-len", "4", "--vocab-size", "100"], "tfrecord"),
    ("criteo", ["--scale", "0.001"], "parquet"),
    ("criteo", ["--max-buckets", "100"], "csv"),
])
def test_presets_and_formats(tmp_path, capsys, preset, options, fmt):
    out = str(tmp_path / "out")
    assert gen_data.main(["--preset", preset, "--rows", "250", "--chunk-rows", "100", "--out", out,
                          "--format", fmt, "--seed", "3", *options]) == 0
    schema = Schema.load(os.path.join(out, "schema.json"))
    reader = read_criteo if (preset, fmt) == ("criteo", "csv") else READERS[fmt]
    kwargs = {"dense_transform": None} if reader is read_criteo else {}
    data = TabularData.from_dataset(schema, reader(os.path.join(out, f"data.{fmt}"), schema, 64, **kwargs))
    assert data.num_examples == 250
    assert reader.__name__ in capsys.readouterr().out
    json.loads(open(os.path.join(out, "schema.json")).read())


def test_options_of_another_preset_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        gen_data.main(["--preset", "wide", "--rows", "10", "--out", str(tmp_path), "--seq-len", "3"])
