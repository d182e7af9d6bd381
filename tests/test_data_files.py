"""picasso_tf.data.files: which files a path names, their format (from the extension or
the first bytes), and reading them whole into memory, on real files of every format."""
import numpy as np
import pytest

from picasso_tf.data import (DataFileError, DataFormatError, criteo_schema, data_files, file_format, generate,
                             load_schema, read_files, sniff_format, wide_schema, write_criteo, write_csv,
                             write_parquet, write_tfrecord)

# Its tests run on one pytest-xdist worker: they share the wide module fixture.
pytestmark = pytest.mark.xdist_group("test_data_files")

CRITEO = criteo_schema(49)
WIDE = wide_schema(num_fields=4, vocab_size=30, name="tiny-wide")
WRITERS = {"csv": write_csv, "parquet": write_parquet, "tfrecord": write_tfrecord}


def _assert_same_rows(read, written, features=None):
    assert read.num_examples == written.num_examples
    for name in features or written.features:
        np.testing.assert_array_equal(read.features[name], written.features[name], err_msg=name)
    np.testing.assert_array_equal(read.labels, written.labels)


@pytest.fixture(scope="module")
def wide():
    return generate(WIDE, 300, seed=1)


@pytest.mark.parametrize("delimiter, header, name", [("\t", False, "day_0.tsv"), (",", True, "day_0.csv")])
def test_criteo_text_reads_without_a_schema(tmp_path, delimiter, header, name):
    written = generate(CRITEO, 200, seed=2)
    path = tmp_path / name
    write_criteo(written, path, delimiter=delimiter, header=header)
    assert sniff_format(path) == "text" and file_format([str(path)]) == "criteo"
    read = read_files(path, CRITEO)
    _assert_same_rows(read, written, [f.name for f in CRITEO.features if f.name.startswith("C")])
    assert read_files(path).schema.name == "criteo"          # criteo_schema() when none is given


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_files_of_the_data_writers_read_back(tmp_path, wide, fmt):
    path = tmp_path / f"part-0.{fmt}"
    WRITERS[fmt](wide, path)
    assert sniff_format(path) == ("text" if fmt == "csv" else fmt)
    assert file_format([str(path)], schema=WIDE) == fmt       # text with a non-Criteo schema: write_csv's
    _assert_same_rows(read_files(str(path), WIDE), wide)


@pytest.mark.parametrize("fmt", ["parquet", "tfrecord"])
def test_format_without_an_extension_from_the_first_bytes(tmp_path, wide, fmt):
    path = tmp_path / "part-00000"
    WRITERS[fmt](wide, path)
    assert sniff_format(path) == fmt


def test_rows_caps_the_rows_read_in_file_order(tmp_path, wide):
    write_parquet(wide, tmp_path / "a.parquet")
    read = read_files(tmp_path / "a.parquet", WIDE, rows=250)
    _assert_same_rows(read, wide.take(range(250)))


def test_directories_and_patterns_name_their_data_files(tmp_path, wide):
    for i in range(2):
        write_tfrecord(wide, tmp_path / f"part-{i}.tfrecord")
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / ".hidden").write_text("")
    expected = [str(tmp_path / "part-0.tfrecord"), str(tmp_path / "part-1.tfrecord")]
    assert data_files(str(tmp_path)) == expected
    assert data_files(str(tmp_path / "part-*")) == expected
    assert read_files(str(tmp_path), WIDE).num_examples == 2 * wide.num_examples


def test_unknown_extension_and_contents_name_the_file(tmp_path):
    path = tmp_path / "table.bin"
    path.write_bytes(bytes(range(256)) * 20)                 # not UTF-8, not Parquet, not TFRecord
    with pytest.raises(DataFileError, match="table.bin.*unknown format.*'.bin'.*criteo, csv, parquet, tfrecord"):
        sniff_format(path)
    with pytest.raises(DataFileError, match="table.bin"):
        read_files(path, WIDE)


def test_errors_name_the_file_and_what_to_do(tmp_path, wide):
    with pytest.raises(DataFileError, match="absent.parquet.*no such file"):
        data_files(str(tmp_path / "absent.parquet"))
    with pytest.raises(DataFileError, match="no file matches"):
        data_files(str(tmp_path / "*.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataFileError, match="holds no data files"):
        data_files(str(tmp_path / "empty"))
    write_parquet(wide, tmp_path / "a.parquet")
    write_tfrecord(wide, tmp_path / "b.tfrecord")
    with pytest.raises(DataFileError, match="a.parquet is parquet but .*b.tfrecord is tfrecord"):
        file_format(data_files(str(tmp_path / "*.*")))
    with pytest.raises(DataFileError, match="a.parquet is parquet, which needs the schema"):
        read_files(tmp_path / "a.parquet")
    other = wide_schema(num_fields=6, vocab_size=30)         # f4, f5 are not in the file
    with pytest.raises(DataFormatError, match="a.parquet does not match the schema 'wide' as parquet: .*'f4'"):
        read_files(tmp_path / "a.parquet", other)
    with pytest.raises(DataFileError, match="format 'orc' is unknown"):
        read_files(tmp_path / "a.parquet", WIDE, format="orc")


def test_load_schema_names_the_file(tmp_path):
    WIDE.save(tmp_path / "schema.json")
    assert load_schema(tmp_path / "schema.json") == WIDE
    with pytest.raises(DataFileError, match="missing.json: cannot read the schema"):
        load_schema(tmp_path / "missing.json")
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(DataFileError, match="empty.json: not a picasso_tf schema JSON"):
        load_schema(tmp_path / "empty.json")
