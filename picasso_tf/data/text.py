"""Delimited text (CSV/TSV) reading and writing, one example per line.

The engine here parses whole batches of lines with TensorFlow string ops and checks
every cell against a regular expression in the same pass, so validation costs no
Python per line. A bad line stops the pipeline with tf.errors.InvalidArgumentError
naming the file, line (1-based, header included), column, value and what was
expected. Fields are split on the delimiter alone: no quoting, so values may not
contain it.

Generic format (write_csv / read_csv): a header line naming the label and feature
columns, then dense values as numbers, categorical ids as integers, sequences as ids
separated by single spaces; an empty cell is missing (0.0 / id 0 / no ids).
Criteo's format builds on the same engine (see criteo.py).
"""
import dataclasses
from typing import Callable, Optional

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import tensorflow as tf

from picasso_tf.data import arrow, pipeline
from picasso_tf.data.dataset import iter_chunks
from picasso_tf.data.errors import DataFormatError
from picasso_tf.data.hashing import HEX_DIGITS, fold_hex
from picasso_tf.data.schema import CATEGORICAL, DENSE

_INT = r"\d{1,18}"
PATTERNS = {
    "label": r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?",
    "number": r"([-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?)?",
    "id": f"({_INT})?",
    "hex": f"([0-9a-fA-F]{{1,{HEX_DIGITS}}})?",
    "ids": f"({_INT}( {_INT})*)?",
}
_SHOWN_CHARS = 40   # longest value quoted in an error message


@dataclasses.dataclass(frozen=True)
class TextColumn:
    """How to decode one column: kind is a key of PATTERNS."""
    name: str
    kind: str
    vocab_size: int = 0
    max_len: int = 0

    def expectation(self):
        return {
            "label": "a number (labels may not be empty)",
            "number": "a number, or empty for missing",
            "id": f"an integer id in [0, {self.vocab_size}), or empty for missing",
            "hex": f"a hexadecimal string of 1 to {HEX_DIGITS} digits, or empty for missing",
            "ids": f"integer ids in [0, {self.vocab_size}) separated by single spaces",
        }[self.kind]


def schema_columns(schema):
    """The TextColumns of the generic format for every label and feature of `schema`."""
    columns = [TextColumn(n, "label") for n in schema.labels]
    for f in schema.features:
        if f.kind == DENSE:
            if f.dim != 1:
                raise ValueError(f"feature {f.name!r}: dense features of dim {f.dim} do not fit one "
                                 "text column; use Parquet or TFRecord for them")
            columns.append(TextColumn(f.name, "number"))
        elif f.kind == CATEGORICAL:
            columns.append(TextColumn(f.name, "id", f.vocab_size))
        else:
            columns.append(TextColumn(f.name, "ids", f.vocab_size, f.max_len))
    return columns


def read_first_line(path):
    with tf.io.gfile.GFile(path, "r") as f:
        return f.readline().rstrip("\n").rstrip("\r")


def header_positions(files, delimiter, names):
    """Column positions of `names` from the header line every file starts with."""
    header = read_first_line(files[0]).split(delimiter)
    for path in files[1:]:
        other = read_first_line(path).split(delimiter)
        if other != header:
            raise DataFormatError(f"{path}: header {other} differs from the header {header} of {files[0]}; "
                                  "read files with different columns separately")
    missing = [n for n in names if n not in header]
    if missing:
        raise DataFormatError(f"{files[0]}, line 1: the header has no column {', '.join(missing)}; "
                              f"it has {header}. Rename the columns, or pass a schema that matches the file")
    return [header.index(n) for n in names], len(header)


class _Decoder:
    """Decodes and checks one column of a batch of split lines."""

    def __init__(self, column: TextColumn, dense_default: float,
                 dense_transform: Optional[Callable[[tf.Tensor], tf.Tensor]]):
        self.column = column
        self.dense_default = dense_default
        self.dense_transform = dense_transform

    def __call__(self, cells):
        """cells [B] string -> (ok [B] bool, value tensor)."""
        col = self.column
        ok = tf.strings.regex_full_match(cells, PATTERNS[col.kind])
        empty = tf.equal(cells, "")
        clean = tf.where(ok, cells, "")   # bad cells decode as missing; the check reports them
        if col.kind in ("label", "number"):
            value = tf.strings.to_number(tf.where(empty | ~ok, "0", cells), tf.float32)
            if col.kind == "number":
                if self.dense_transform is not None:
                    value = self.dense_transform(value)
                value = tf.where(empty, tf.constant(self.dense_default, tf.float32), value)
            return ok, value
        if col.kind == "hex":
            return ok, fold_hex(clean, col.vocab_size)
        if col.kind == "id":
            value = tf.strings.to_number(tf.where(empty | ~ok, "0", cells), tf.int64)
            return ok & (value < col.vocab_size), value
        ids = tf.ragged.map_flat_values(tf.strings.to_number, tf.strings.split(clean), tf.int64)
        in_range = tf.reduce_max(ids, axis=1) < col.vocab_size   # an empty row reduces to int64 min
        return ok & in_range, pipeline.pad_ragged(ids, col.max_len)


def read_delimited(files, schema, columns, positions, num_fields, delimiter, header_lines, *,
                   batch_size, dense_default=0.0, dense_transform=None, shuffle=False,
                   shuffle_buffer=10_000, seed=0, repeat=False, drop_remainder=False, rank=0, world=1,
                   prefetch=True):
    """tf.data.Dataset of (features, label) batches from delimited text files.

    columns: the TextColumns to decode (labels and schema features), found at
    `positions` among `num_fields` fields of each line; the first header_lines lines
    of every file are skipped.
    """
    if delimiter in ("", " "):
        raise ValueError(f"delimiter {delimiter!r} is not supported; spaces separate the ids of a sequence")
    decoders = [_Decoder(c, dense_default, dense_transform) for c in columns]
    file_names = tf.constant(files)
    column_names = tf.constant([c.name for c in columns])
    expectations = tf.constant([c.expectation() for c in columns])
    delimiter_name = {"\t": "tabs", ",": "commas"}.get(delimiter, repr(delimiter))

    def parse_batch(file_index, line_index, lines):
        fields = tf.strings.split(lines, sep=delimiter)
        counts = fields.row_lengths()
        cells = fields.to_tensor("", shape=[None, num_fields])
        oks, values = [], {}
        for decoder, pos in zip(decoders, positions):
            ok, values[decoder.column.name] = decoder(cells[:, pos])
            oks.append(ok)
        bad_count = tf.not_equal(counts, num_fields)
        bad_cells = tf.logical_not(tf.stack(oks, axis=1))
        bad_rows = bad_count | tf.reduce_any(bad_cells, axis=1)
        row = tf.argmax(tf.cast(bad_rows, tf.int32), output_type=tf.int64)
        col = tf.argmax(tf.cast(bad_cells[row], tf.int32), output_type=tf.int64)
        value = cells[row, tf.gather(positions, col)]
        where = tf.strings.join([file_names[file_index[row]], ", line ",
                                 tf.strings.as_string(line_index[row] + 1 + header_lines)])
        count_message = tf.strings.join([
            where, ": found ", tf.strings.as_string(counts[row]), f" fields separated by {delimiter_name}, "
            f"expected {num_fields}. Fix or remove the line"])
        cell_message = tf.strings.join([
            where, ", column ", column_names[col], ": value ",
            tf.where(value == "", "(empty)", tf.strings.substr(value, 0, _SHOWN_CHARS)),
            " is not ", expectations[col], ". Fix or remove the line"])
        message = tf.where(bad_count[row], count_message, cell_message)
        return pipeline.checked(~tf.reduce_any(bad_rows), message, pipeline.split_labels(schema, values))

    return pipeline.record_pipeline(
        files, lambda path: tf.data.TextLineDataset(path).skip(header_lines), parse_batch,
        batch_size=batch_size, shuffle=shuffle, shuffle_buffer=shuffle_buffer, seed=seed, repeat=repeat,
        drop_remainder=drop_remainder, rank=rank, world=world, prefetch=prefetch)


def read_csv(paths, schema, batch_size, *, delimiter=",", shuffle=False, shuffle_buffer=10_000, seed=0,
             repeat=False, drop_remainder=False, rank=0, world=1, prefetch=True):
    """Reads the generic text format (see the module docstring) written by write_csv.

    Columns are found by the header's names, so their order is free and extra columns
    are ignored; all files must share one header.
    """
    files = pipeline.expand_paths(paths)
    columns = schema_columns(schema)
    positions, num_fields = header_positions(files, delimiter, [c.name for c in columns])
    return read_delimited(files, schema, columns, positions, num_fields, delimiter, 1,
                          batch_size=batch_size, shuffle=shuffle, shuffle_buffer=shuffle_buffer, seed=seed,
                          repeat=repeat, drop_remainder=drop_remainder, rank=rank, world=world,
                          prefetch=prefetch)


def write_table(table, sink, delimiter, header=True):
    """Writes an Arrow table of numbers and strings to a binary file object as delimited
    text, nulls as empty cells."""
    if header:
        sink.write((delimiter.join(table.column_names) + "\n").encode())
    pa_csv.write_csv(table, sink, pa_csv.WriteOptions(include_header=False, delimiter=delimiter,
                                                      quoting_style="none"))


def write_csv(data, path, *, delimiter=","):
    """Writes TabularData (or an iterable of TabularData chunks) in the generic text format."""
    with open(path, "wb") as sink:
        for i, chunk in enumerate(iter_chunks(data)):
            if i == 0:
                schema_columns(chunk.schema)   # rejects what text cannot hold
            table = arrow.to_arrow(chunk)
            table = pa.table({name: _joined(col) for name, col in zip(table.column_names, table.columns)})
            write_table(table, sink, delimiter, header=(i == 0))


def _joined(column):
    """A list<int> column as strings of ids separated by spaces; other columns as they are."""
    if pa.types.is_list(column.type):
        return pc.binary_join(column.cast(pa.list_(pa.string())), " ")
    return column
