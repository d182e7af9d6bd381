"""Delimited text (CSV/TSV) reading and writing, one example per line.

The engine here parses blocks of lines with TensorFlow string ops and checks every
cell in the same pass (a regular expression, or byte arithmetic for hex), so
validation costs no Python per line. A bad line stops the pipeline with tf.errors.InvalidArgumentError
naming the file, line (1-based, header included), column, value and what was
expected. Fields are split on the delimiter alone: no quoting, so values may not
contain it.

Generic format (write_csv / read_csv): a header line naming the label and feature
columns, then dense values as numbers, categorical ids as integers, sequences as ids
separated by single spaces; an empty cell is missing (0.0 / id 0 / no ids).
Criteo's format builds on the same engine (see criteo.py).
"""
import dataclasses

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import tensorflow as tf

from picasso_tf.data import arrow, pipeline
from picasso_tf.data.dataset import iter_chunks
from picasso_tf.data.errors import DataFormatError
from picasso_tf.data.hashing import HEX_DIGITS, fold_hex_checked
from picasso_tf.data.schema import CATEGORICAL, DENSE

KINDS = ("label", "number", "id", "hex", "ids")   # how a column is decoded, see _decode
_INT = r"\d{1,18}"
PATTERNS = {   # what a cell of each kind may hold ("hex" is checked on its bytes)
    "label": r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?",
    "number": r"([-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?)?",
    "id": f"({_INT})?",
    "ids": f"({_INT}( {_INT})*)?",
}
_SHOWN_CHARS = 40   # longest value quoted in an error message


@dataclasses.dataclass(frozen=True)
class TextColumn:
    """How to decode one column: kind is one of KINDS."""
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


def _decode(kind, cells, columns, dense_default, dense_transform):
    """cells [B, k]: k columns of one kind -> (ok [B, k] bool, [value tensor of each column]).

    Columns of a kind are decoded together, a few ops per batch rather than per column.
    Cells that fail their check decode as missing; the caller reports them.
    """
    empty = tf.equal(cells, "")
    if kind == "hex":
        ids, ok = fold_hex_checked(cells, [c.vocab_size for c in columns])
        return ok, tf.unstack(ids, axis=1)
    if kind == "ids":   # one column: a sequence is ragged
        (column,) = columns
        ok = tf.strings.regex_full_match(cells[:, 0], PATTERNS[kind])
        ids = tf.ragged.map_flat_values(tf.strings.to_number, tf.strings.split(tf.where(ok, cells[:, 0], "")),
                                        tf.int64)
        ok &= tf.reduce_max(ids, axis=1) < column.vocab_size   # an empty row reduces to int64 min
        return ok[:, None], [pipeline.pad_ragged(ids, column.max_len)]
    ok = tf.strings.regex_full_match(cells, PATTERNS[kind])
    text = tf.where(ok & ~empty, cells, "0")
    if kind == "id":
        value = tf.strings.to_number(text, tf.int64)
        ok &= value < tf.constant([c.vocab_size for c in columns], tf.int64)
        return ok, tf.unstack(value, axis=1)
    value = tf.strings.to_number(text, tf.float32)
    if kind == "number":
        if dense_transform is not None:
            value = dense_transform(value)
        value = tf.where(empty, tf.constant(dense_default, tf.float32), value)
    return ok, tf.unstack(value, axis=1)


def _groups(columns, positions):
    """[(kind, columns, positions)]: the columns of each kind together, each sequence alone."""
    groups = []
    for kind in KINDS:
        members = [(c, p) for c, p in zip(columns, positions) if c.kind == kind]
        if kind == "ids":
            groups += [(kind, [c], [p]) for c, p in members]
        elif members:
            groups.append((kind, [c for c, _ in members], [p for _, p in members]))
    return groups


def read_delimited(files, schema, columns, positions, num_fields, delimiter, header_lines, *,
                   batch_size, dense_default=0.0, dense_transform=None, shuffle=False,
                   shuffle_buffer=10_000, seed=0, repeat=False, drop_remainder=False, rank=0, world=1,
                   prefetch=True):
    """tf.data.Dataset of (features, label) batches from delimited text files.

    columns: the TextColumns to decode (labels and schema features), found at
    `positions` among `num_fields` fields of each line; the first header_lines lines
    of every file are skipped. dense_transform maps parsed dense values (not labels).
    """
    if delimiter in ("", " "):
        raise ValueError(f"delimiter {delimiter!r} is not supported; spaces separate the ids of a sequence")
    groups = _groups(columns, positions)
    ordered = [(c, p) for _, cs, ps in groups for c, p in zip(cs, ps)]   # the columns of bad_cells
    file_names = tf.constant(files)
    column_names = tf.constant([c.name for c, _ in ordered])
    column_positions = tf.constant([p for _, p in ordered], tf.int64)
    expectations = tf.constant([c.expectation() for c, _ in ordered])
    delimiter_name = {"\t": "tabs", ",": "commas"}.get(delimiter, repr(delimiter))

    def parse_block(file_index, line_index, lines):
        fields = tf.strings.split(lines, sep=delimiter)
        counts = fields.row_lengths()
        cells = fields.to_tensor("", shape=[None, num_fields])
        oks, values = [], {}
        for kind, group, group_positions in groups:
            ok, decoded = _decode(kind, tf.gather(cells, group_positions, axis=1), group, dense_default,
                                  dense_transform)
            oks.append(ok)
            values.update(zip([c.name for c in group], decoded))
        bad_count = tf.not_equal(counts, num_fields)
        bad_cells = tf.logical_not(tf.concat(oks, axis=1))
        bad_rows = bad_count | tf.reduce_any(bad_cells, axis=1)
        row = tf.argmax(tf.cast(bad_rows, tf.int32), output_type=tf.int64)
        col = tf.argmax(tf.cast(bad_cells[row], tf.int32), output_type=tf.int64)
        value = cells[row, column_positions[col]]
        where = tf.strings.join([file_names[file_index], ", line ",
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
        files, lambda path: tf.data.TextLineDataset(path).skip(header_lines), parse_block,
        batch_size=batch_size, shuffle=shuffle, shuffle_buffer=shuffle_buffer, seed=seed, repeat=repeat,
        drop_remainder=drop_remainder, rank=rank, world=world, prefetch=prefetch)


def read_csv(paths, schema, batch_size=1024, *, delimiter=",", shuffle=False, shuffle_buffer=10_000, seed=0,
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
