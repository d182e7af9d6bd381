"""Readers and writers: exact values on the real samples, round trips, shards, bad input."""
import csv
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from picasso_tf.data import (CATEGORICAL, DENSE, DataFormatError, Feature, Schema, TabularData, alibaba_schema,
                             bundled_path, criteo_schema, generate, read_criteo, read_csv, read_parquet,
                             read_tfrecord, stream, write_criteo, write_csv, write_parquet, write_tfrecord)
from test_data_dataset import assert_specs

CRITEO_CSV = bundled_path("criteo_sample.csv")
SMALL_CRITEO = criteo_schema(max_buckets=1000)
ALIBABA = alibaba_schema(num_onehot=3, num_sequences=2, seq_len=6, vocab_size=[50, 200, 1000])


def _collect(dataset, schema):
    return TabularData.from_dataset(schema, dataset)


def _assert_same(a, b):
    assert a.num_examples == b.num_examples
    for name in a.features:
        np.testing.assert_array_equal(a.features[name], b.features[name], err_msg=name)
    np.testing.assert_array_equal(a.labels, b.labels)


def _sample_rows():
    with open(CRITEO_CSV, newline="") as f:
        return list(csv.DictReader(f))


# --- Criteo, on the real sample ----------------------------------------------------------

def test_criteo_csv_sample_exact_values():
    rows = _sample_rows()
    schema = criteo_schema(1000)
    raw = _collect(read_criteo(CRITEO_CSV, schema, 64, dense_transform=None), schema)
    logged = _collect(read_criteo(CRITEO_CSV, schema, 64), schema)
    assert raw.num_examples == len(rows) == 200
    for i in (0, 1, 57, 199):
        row = rows[i]
        assert raw.labels[i] == float(row["label"])
        for n in (f"I{k}" for k in range(1, 14)):
            value = float(row[n]) if row[n] else 0.0
            assert raw.features[n][i] == np.float32(value), (i, n)
            assert logged.features[n][i] == pytest.approx(math.log1p(max(value, 0.0)) if row[n] else 0.0, rel=1e-6)
        for n in (f"C{k}" for k in range(1, 27)):
            assert raw.features[n][i] == (int(row[n], 16) % 1000 + 1 if row[n] else 0), (i, n)
    # Verified by hand on the file's first line: label 0, I2 = 3, I3 = 260.0, I1 empty,
    # C1 = 05db9164 (98275684 % 1000 + 1 = 685), C19 empty.
    assert raw.labels[0] == 0 and raw.features["I3"][0] == 260 and raw.features["I1"][0] == 0
    assert raw.features["C1"][0] == 685 and raw.features["C19"][0] == 0
    assert raw.labels.sum() == sum(r["label"] == "1" for r in rows)


def test_criteo_tsv_without_header_equals_the_csv(tmp_path):
    lines = open(CRITEO_CSV).read().splitlines()[1:]
    tsv = tmp_path / "day_0"
    tsv.write_text("".join(line.replace(",", "\t") + "\n" for line in lines))
    from_csv = _collect(read_criteo(CRITEO_CSV, SMALL_CRITEO, 50), SMALL_CRITEO)
    from_tsv = _collect(read_criteo(str(tsv), SMALL_CRITEO, 50), SMALL_CRITEO)
    _assert_same(from_csv, from_tsv)


def test_criteo_subset_schema_and_dense_default():
    schema = Schema([Feature("I1", DENSE), Feature("C3", CATEGORICAL, vocab_size=11, hashed=True)])
    data = _collect(read_criteo(CRITEO_CSV, schema, 200, dense_default=-1.0), schema)
    rows = _sample_rows()
    expected = [math.log1p(max(float(r["I1"]), 0)) if r["I1"] else -1.0 for r in rows]
    np.testing.assert_allclose(data.features["I1"], expected, rtol=1e-6)
    with pytest.raises(ValueError, match="not a Criteo column"):
        read_criteo(CRITEO_CSV, Schema([Feature("price", DENSE)]))


def test_criteo_write_read_round_trip(tmp_path):
    data = generate(SMALL_CRITEO, 300, seed=4)
    for delimiter, header in (("\t", False), (",", True)):
        path = str(tmp_path / f"data{header}")
        write_criteo(data, path, delimiter=delimiter, header=header)
        back = read_criteo(path, SMALL_CRITEO, 128, dense_transform=None)
        assert_specs(back, SMALL_CRITEO)
        _assert_same(_collect(back, SMALL_CRITEO), data)


# --- generic CSV, Parquet, TFRecord round trips --------------------------------------------

def test_csv_round_trip(tmp_path):
    data = generate(ALIBABA, 257, seed=1)
    path = str(tmp_path / "data.csv")
    write_csv([data.take(np.arange(100)), data.take(np.arange(100, 257))], path)
    back = read_csv(path, ALIBABA, 64)
    assert_specs(back, ALIBABA)
    _assert_same(_collect(back, ALIBABA), data)


FLAT = Schema([Feature("x", DENSE), Feature("a", CATEGORICAL, vocab_size=30), Feature("b", CATEGORICAL, vocab_size=7)],
              name="flat")


@pytest.mark.parametrize("engine", ["pyarrow", "tfio"])
def test_parquet_round_trip(tmp_path, engine):
    schema = ALIBABA if engine == "pyarrow" else FLAT   # tfio reads flat columns only
    data = generate(schema, 500, seed=2)
    paths = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    write_parquet(data.take(np.arange(300)), paths[0], row_group_size=128)
    write_parquet(data.take(np.arange(300, 500)), paths[1])
    back = read_parquet(str(tmp_path / "*.parquet"), schema, 64, engine=engine, read_rows=100)
    assert_specs(back, schema)
    assert [len(label) for _, label in back] == [64] * 7 + [52]
    _assert_same(_collect(back, schema), data)


def test_parquet_tfio_engine_refuses_list_columns(tmp_path):
    write_parquet(generate(ALIBABA, 10), str(tmp_path / "a.parquet"))
    with pytest.raises(ValueError, match=r"engine='tfio' reads flat columns only.*'seq0', 'seq1'"):
        read_parquet(str(tmp_path / "a.parquet"), ALIBABA, engine="tfio")


def test_parquet_nulls_and_foreign_types(tmp_path):
    schema = Schema([Feature("x", DENSE), Feature("c", CATEGORICAL, vocab_size=10),
                     Feature("s", "sequence", vocab_size=10, max_len=3)])
    table = pa.table({"label": pa.array([1, 0, 1], pa.int8()), "x": pa.array([1.5, None, 2], pa.float64()),
                      "c": pa.array([3, None, 9], pa.int32()),
                      "s": pa.array([[1, 2, 3, 4], None, []], pa.large_list(pa.int16()))})
    pq.write_table(table, tmp_path / "t.parquet")
    data = _collect(read_parquet(str(tmp_path / "t.parquet"), schema, 8, dense_default=-1), schema)
    assert data.features["x"].tolist() == [1.5, -1.0, 2.0] and data.features["c"].tolist() == [3, 0, 9]
    assert data.features["s"].tolist() == [[1, 2, 3], [0, 0, 0], [0, 0, 0]]
    assert data.labels.tolist() == [1, 0, 1]


def test_tfrecord_round_trip(tmp_path):
    data = generate(ALIBABA, 200, seed=3)
    path = str(tmp_path / "data.tfrecord.gz")
    write_tfrecord(data, path, compression="GZIP")
    back = read_tfrecord(path, ALIBABA, 64, compression="GZIP")
    assert_specs(back, ALIBABA)
    _assert_same(_collect(back, ALIBABA), data)


# --- shards, shuffling, batching ------------------------------------------------------------

ROWS = Schema([Feature("row", CATEGORICAL, vocab_size=1000), Feature("x", DENSE)], name="rows")


def _numbered(n=230):
    return TabularData(ROWS, {"row": np.arange(1, n + 1), "x": np.arange(n) / 7}, np.arange(n) % 2)


def _write_numbered(tmp_path):
    """The same numbered rows in CSV, Parquet and TFRecord, split over two files each."""
    data, files = _numbered(), {}
    halves = [data.take(np.arange(150)), data.take(np.arange(150, 230))]
    for fmt, write in (("csv", write_csv), ("parquet", write_parquet), ("tfrecord", write_tfrecord)):
        files[fmt] = [str(tmp_path / f"{i}.{fmt}") for i in range(2)]
        for half, path in zip(halves, files[fmt]):
            write(half, path)
    return files


READERS = {"csv": read_csv, "parquet": read_parquet, "tfrecord": read_tfrecord}


@pytest.mark.parametrize("fmt", sorted(READERS))
def test_reader_shards_are_disjoint_and_cover_everything(tmp_path, fmt):
    files = _write_numbered(tmp_path)[fmt]
    for shuffle, world in ((False, 3), (True, 2)):
        shards = [_collect(READERS[fmt](files, ROWS, 16, shuffle=shuffle, seed=7, rank=r, world=world), ROWS)
                  for r in range(world)]
        rows = np.concatenate([s.features["row"] for s in shards])
        assert sorted(rows.tolist()) == list(range(1, 231)), (fmt, shuffle)
        assert max(len(s) for s in shards) - min(len(s) for s in shards) <= 2


@pytest.mark.parametrize("fmt", sorted(READERS))
def test_reader_order_shuffle_and_repeat(tmp_path, fmt):
    files = _write_numbered(tmp_path)[fmt]
    ordered = READERS[fmt](files, ROWS, 32)
    assert [len(label) for _, label in ordered] == [32] * 7 + [6]
    assert _collect(ordered, ROWS).features["row"].tolist() == list(range(1, 231))
    shuffled = READERS[fmt](files, ROWS, 32, shuffle=True, seed=1, shuffle_buffer=64)
    rows, again = (_collect(shuffled, ROWS).features["row"] for _ in range(2))   # two epochs
    assert sorted(rows.tolist()) == list(range(1, 231)) and rows.tolist() != list(range(1, 231))
    assert sorted(again.tolist()) == list(range(1, 231)) and again.tolist() != rows.tolist()
    repeated = _collect(READERS[fmt](files, ROWS, 100, repeat=True, drop_remainder=True).take(5), ROWS)
    assert repeated.features["row"].tolist() == (list(range(1, 231)) * 3)[:500]


@pytest.mark.parametrize("fmt", sorted(READERS) + ["memory", "stream"])
def test_readers_leave_the_autotuner_off_and_can_have_it_back(tmp_path, fmt):
    """tf.data's autotuner holds fit's return after its last step (pipeline.finish); the
    readers turn it off (Parquet: the default pyarrow engine), and a caller's with_options
    turns it back on, same batches."""
    if fmt == "memory":
        data = generate(SMALL_CRITEO, 230, seed=3)
        schema, read = SMALL_CRITEO, lambda: data.dataset(32)
    elif fmt == "stream":
        schema, read = SMALL_CRITEO, lambda: stream(SMALL_CRITEO, 32, num_batches=4, seed=3)
    else:
        files = _write_numbered(tmp_path)[fmt]
        schema, read = ROWS, lambda: READERS[fmt](files, ROWS, 32)
    off = read()
    assert off.options().autotune.enabled is False
    on = tf.data.Options()
    on.autotune.enabled = True
    again = off.with_options(on)
    assert again.options().autotune.enabled is True
    _assert_same(_collect(off, schema), _collect(again, schema))


def test_the_tfio_parquet_engine_keeps_the_autotuner(tmp_path):
    """It reads a third faster with it (pipeline.finish's autotuner=True)."""
    files = _write_numbered(tmp_path)["parquet"]
    dataset = read_parquet(files, ROWS, 32, engine="tfio")
    assert dataset.options().autotune.enabled is not False
    assert _collect(dataset, ROWS).features["row"].tolist() == list(range(1, 231))


# --- bad input ------------------------------------------------------------------------------

def _bad_criteo(tmp_path, line_number, change):
    """The sample with line `line_number` (1-based, header = 1) changed by `change`."""
    lines = open(CRITEO_CSV).read().splitlines()
    fields = lines[line_number - 1].split(",")
    lines[line_number - 1] = ",".join(change(fields))
    path = tmp_path / "criteo_bad.csv"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _set(index, value):
    def change(fields):
        fields[index] = value
        return fields
    return change


@pytest.mark.parametrize("line, change, message", [
    (5, lambda f: f[:-1], r"criteo_bad.csv, line 5: found 39 fields separated by commas, expected 40"),
    (130, _set(18, "xyz1"), r"criteo_bad.csv, line 130, column C5: value xyz1 is not a hexadecimal string"),
    (7, _set(18, "123456789"), r"line 7, column C5: value 123456789 is not a hexadecimal string of 1 to 8"),
    (3, _set(3, "2.5.1"), r"criteo_bad.csv, line 3, column I3: value 2.5.1 is not a number"),
    (201, _set(0, ""), r"criteo_bad.csv, line 201, column label: value \(empty\) is not a number"),
])
def test_bad_criteo_lines_are_named(tmp_path, line, change, message):
    schema = Schema([Feature("I3", DENSE), Feature("C5", CATEGORICAL, vocab_size=100)])   # fast to trace
    dataset = read_criteo(_bad_criteo(tmp_path, line, change), schema, 64)
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        list(dataset)


def test_bad_csv_cells_and_headers(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("label,row,x\n1,5,0.5\n0,1000,0.25\n")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"bad.csv, line 3, column row: value 1000 is not an integer id in \[0, 1000\)"):
        list(read_csv(str(path), ROWS))
    path.write_text("label,rows,x\n1,5,0.5\n")
    with pytest.raises(DataFormatError, match=r"bad.csv, line 1: the header has no column row"):
        read_csv(str(path), ROWS)
    seq = Schema([Feature("s", "sequence", vocab_size=10, max_len=2)])
    path.write_text("label,s\n1,1 2\n1,3  4\n")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"line 3, column s: value 3  4 is not integer ids in \[0, 10\) separated by single"):
        list(read_csv(str(path), seq))


def test_bad_parquet_is_named(tmp_path):
    path = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"label": [1.0, 0.0], "row": ["a", "b"], "x": [1.0, 2.0]}), path)
    with pytest.raises(DataFormatError, match=r"wrong.parquet, column 'row': type string cannot hold categorical "
                                              "values; expected integer ids"):
        read_parquet(str(path), ROWS)
    pq.write_table(pa.table({"label": [1.0, 0.0], "x": [1.0, 2.0]}), path)
    with pytest.raises(DataFormatError, match=r"wrong.parquet: no column 'row'"):
        read_parquet(str(path), ROWS)
    pq.write_table(pa.table({"label": [1.0, 0.0, 1.0], "row": [1, 2, 5000], "x": [1.0, 2.0, 3.0]}), path)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"wrong.parquet, row 2, column 'row': an id outside "
                                                             r"\[0, 1000\)"):
        list(read_parquet(str(path), ROWS))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"wrong.parquet, row 2, feature row: id 5000 is "
                                                             r"outside \[0, 1000\)"):
        list(read_parquet(str(path), ROWS, engine="tfio"))
    pq.write_table(pa.table({"label": [1.0, 0.0], "row": [1, 2], "x": [1.0, float("nan")]}), path)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"wrong.parquet, row 1, column 'x': NaN"):
        list(read_parquet(str(path), ROWS))


def test_bad_tfrecord_is_named(tmp_path):
    path = str(tmp_path / "bad.tfrecord")
    write_tfrecord(_numbered(), path)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"bad.tfrecord, record 9, feature row: id 10 is "
                                                             r"outside \[0, 10\)"):
        list(read_tfrecord(path, Schema([Feature("row", CATEGORICAL, vocab_size=10), Feature("x", DENSE)])))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"bad.tfrecord, record 0.*Feature: y"):
        list(read_tfrecord(path, Schema(ROWS.features + [Feature("y", DENSE)])))
    with tf.io.TFRecordWriter(path) as writer:
        for x in (1.0, float("nan")):
            writer.write(tf.train.Example(features=tf.train.Features(feature={
                "label": tf.train.Feature(float_list=tf.train.FloatList(value=[1.0])),
                "row": tf.train.Feature(int64_list=tf.train.Int64List(value=[3])),
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=[x]))})).SerializeToString())
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"bad.tfrecord, record 1, feature x: NaN"):
        list(read_tfrecord(path, ROWS))
