"""Data files of any format the readers take, read whole into memory.

  data_files(paths)                  the readable files a path, directory or glob names
  sniff_format(path)                 "parquet", "tfrecord" or "text": from the extension,
                                     else from the first bytes
  file_format(files, format, schema) the reader the files need: criteo, csv, parquet or
                                     tfrecord (text is Criteo's format when the schema is
                                     Criteo's or not given, else write_csv's)
  read_files(paths, schema, format, rows)   one TabularData of their rows, in file order
  load_schema(path)                  Schema.load

Each raises DataFileError (a DataFormatError) naming the file, what is wrong with it
and what to do; rows that do not match the schema raise DataFormatError naming the
file, the format and the reader's first line (line, column and value).
"""
import codecs
import glob
import math
import os

import tensorflow as tf

from picasso_tf.data.criteo import CATEGORICAL_NAMES, DENSE_NAMES, criteo_schema, read_criteo
from picasso_tf.data.dataset import TabularData
from picasso_tf.data.errors import DataFileError, DataFormatError, first_line
from picasso_tf.data.parquet import read_parquet
from picasso_tf.data.schema import Schema
from picasso_tf.data.text import read_csv, read_first_line
from picasso_tf.data.tfrecord import read_tfrecord

FORMATS = ("auto", "criteo", "csv", "parquet", "tfrecord")
PARQUET_EXTENSIONS = (".parquet", ".pq")
TFRECORD_EXTENSIONS = (".tfrecord", ".tfrecords", ".tfr")
TEXT_EXTENSIONS = (".csv", ".tsv", ".txt")
COMPRESSION_EXTENSIONS = (".gz", ".zz", ".zlib")
SNIFF_BYTES = 4096        # how much of a file without a known extension is looked at
READ_BATCH = 8192         # rows per batch while reading into memory


def data_files(paths):
    """The files that `paths` names, each readable: a file, a directory (its files, less
    hidden ones and those starting with "_", e.g. _SUCCESS), a glob pattern, or a list
    of these."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = [f for path in map(os.fspath, paths) for f in _files_of(path)]
    if not files:
        raise DataFileError("no data files given: pass a file, a directory or a glob pattern")
    for f in files:
        if not os.access(f, os.R_OK):
            raise DataFileError(f"{f}: cannot read it (permission denied)")
    return files


def _files_of(path):
    if any(c in path for c in "*?["):
        files = sorted(f for f in glob.glob(path) if os.path.isfile(f))
        if not files:
            raise DataFileError(f"{path!r}: no file matches the pattern")
        return files
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if not f.startswith((".", "_")) and os.path.isfile(os.path.join(path, f)))
        if not files:
            raise DataFileError(f"{path}: the directory holds no data files")
        return files
    if os.path.exists(path):
        return [path]
    raise DataFileError(f"{path!r}: no such file or directory")


def sniff_format(path):
    """"parquet", "tfrecord" or "text" from the extension (after a compression suffix),
    else from the first bytes: Parquet's magic number, UTF-8 text with a line break,
    or a first record whose TFRecord checksums hold. Anything else raises
    DataFileError: the caller has to name the format."""
    path = os.fspath(path)
    name = path.lower()
    for suffix in COMPRESSION_EXTENSIONS:
        name = name.removesuffix(suffix)
    if name.endswith(PARQUET_EXTENSIONS):
        return "parquet"
    if name.endswith(TFRECORD_EXTENSIONS):
        return "tfrecord"
    if name.endswith(TEXT_EXTENSIONS):
        return "text"
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError as e:
        raise DataFileError(f"{path}: cannot read it ({e.strerror})") from None
    if head[:4] == b"PAR1":
        return "parquet"
    try:   # final=False: a character cut by the end of `head` is not an error
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        if b"\n" in head or len(head) < SNIFF_BYTES:
            return "text"
    except UnicodeDecodeError:
        pass
    if _is_tfrecord(path):
        return "tfrecord"
    extension = os.path.splitext(name)[1] or "no extension"
    raise DataFileError(
        f"{path}: unknown format ({extension!r} is none of "
        f"{', '.join(PARQUET_EXTENSIONS + TFRECORD_EXTENSIONS + TEXT_EXTENSIONS)}, and the first bytes are "
        f"not Parquet, TFRecord or text); name its format: one of {', '.join(FORMATS[1:])}")


def _is_tfrecord(path):
    try:
        next(iter(tf.data.TFRecordDataset(path)), None)   # checks the first record's length and CRCs
        return True
    except tf.errors.OpError:
        return False


def _is_criteo_schema(schema):
    """True when every feature is a Criteo column and the label is Criteo's."""
    return schema.labels == ["label"] and all(f.name in DENSE_NAMES + CATEGORICAL_NAMES for f in schema.features)


def file_format(files, format="auto", schema=None):
    """The reader that `files` need: "criteo", "csv", "parquet" or "tfrecord". "auto"
    sniffs every file (they must agree); text is Criteo's format when `schema` is None
    or Criteo's, else the generic CSV of write_csv."""
    if format not in FORMATS:
        raise DataFileError(f"format {format!r} is unknown; choose one of {', '.join(FORMATS)}")
    if format != "auto":
        return format
    found = {f: sniff_format(f) for f in files}
    first = found[files[0]]
    other = next((f for f, fmt in found.items() if fmt != first), None)
    if other is not None:
        raise DataFileError(f"{files[0]} is {first} but {other} is {found[other]}: read files of one format "
                            "at a time, or name the format")
    if first == "text":
        return "criteo" if schema is None or _is_criteo_schema(schema) else "csv"
    return first


def read_files(paths, schema=None, format="auto", rows=None):
    """TabularData of the rows of data files, in file order.

    paths: a file, directory or glob pattern, or a list of them (data_files).
    schema: the Schema the files were written with (Schema.save / load_schema); None
      only for Criteo files, read with criteo_schema().
    format: "auto" (file_format) or one of criteo, csv, parquet, tfrecord.
    rows: read at most this many rows (default all).
    """
    if rows is not None and rows < 1:
        raise ValueError(f"rows must be >= 1 or None, got {rows}")
    files = data_files(paths)
    fmt = file_format(files, format, schema)
    if schema is None:
        if fmt != "criteo":
            raise DataFileError(f"{files[0]} is {fmt}, which needs the schema it was written with "
                                "(Schema.save wrote it; pass load_schema(path))")
        schema = criteo_schema()
    try:
        ds = _dataset(fmt, files, schema)
        if rows:
            ds = ds.take(math.ceil(rows / READ_BATCH))
        data = TabularData.from_dataset(schema, ds)
    except (DataFormatError, ValueError, KeyError, tf.errors.OpError) as e:
        more = f" (and {len(files) - 1} more)" if len(files) > 1 else ""
        named = f" {schema.name!r}" if schema.name else ""
        raise DataFormatError(f"{files[0]}{more} does not match the schema{named} as {fmt}: "
                              f"{first_line(e)}") from None
    return data.take(range(rows)) if rows and data.num_examples > rows else data


def _dataset(fmt, files, schema):
    if fmt == "criteo":
        return read_criteo(files, schema, batch_size=READ_BATCH, prefetch=False)
    if fmt == "csv":
        delimiter = "\t" if "\t" in read_first_line(files[0]) else ","
        return read_csv(files, schema, READ_BATCH, delimiter=delimiter, prefetch=False)
    if fmt == "parquet":
        return read_parquet(files, schema, batch_size=READ_BATCH, prefetch=False)
    compression = "GZIP" if files[0].endswith(".gz") else None
    return read_tfrecord(files, schema, batch_size=READ_BATCH, compression=compression, prefetch=False)


def load_schema(path):
    """Schema.load, with errors that name the file."""
    try:
        return Schema.load(path)
    except OSError as e:
        raise DataFileError(f"{path}: cannot read the schema ({e.strerror})") from None
    except (ValueError, TypeError, KeyError) as e:
        raise DataFileError(f"{path}: not a picasso_tf schema JSON (Schema.save writes one): "
                            f"{first_line(e)}") from None
