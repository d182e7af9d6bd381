"""Conversion between schema'd columns and Apache Arrow, the in-memory form of Parquet.

On disk (write_parquet) a label or dense feature is a float32 column (a dense feature of
dim > 1 a fixed_size_list<float32>), a categorical feature an int64 column of ids, and a
sequence a list<int64> of its ids without the padding. Readers accept any integer or
floating type where those are expected, and any list type for sequences.
"""
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from picasso_tf.data.errors import DataFormatError
from picasso_tf.data.schema import CATEGORICAL, DENSE, SEQUENCE


def sequence_lengths(array):
    """Lengths of right-padded sequences [N, L]: up to and including the last non-zero id."""
    nonzero = array != 0
    last = array.shape[1] - np.argmax(nonzero[:, ::-1], axis=1)
    return np.where(nonzero.any(axis=1), last, 0)


def to_arrow(data):
    """TabularData -> pa.Table with the labels first, then the features in schema order."""
    columns = {name: pa.array(values) for name, values in data.label_dict.items()}
    for f in data.schema.features:
        array = data.features[f.name]
        if f.kind == SEQUENCE:
            lengths = sequence_lengths(array)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            values = array[np.arange(f.max_len) < lengths[:, None]]
            columns[f.name] = pa.ListArray.from_arrays(offsets, values)
        elif f.kind == DENSE and f.dim > 1:
            columns[f.name] = pa.FixedSizeListArray.from_arrays(array.ravel(), f.dim)
        else:
            columns[f.name] = pa.array(array)
    return pa.table(columns)


def _is_number(t):
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _is_list_of(t, predicate):
    return (pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)) \
        and predicate(t.value_type)


def _expected_type(kind, dim=1):
    """(predicate on an Arrow type, its description) for a label or feature kind."""
    if kind == DENSE and dim > 1:
        return (lambda t: _is_list_of(t, _is_number)), f"a list of {dim} numbers"
    if kind in ("label", DENSE):
        return _is_number, "numbers"
    if kind == CATEGORICAL:
        return pa.types.is_integer, "integer ids"
    return (lambda t: _is_list_of(t, pa.types.is_integer)), "lists of integer ids"


def check_schema(arrow_schema, schema, path):
    """Every label and feature of `schema` is a column of `arrow_schema` of a usable type."""
    names = arrow_schema.names
    wanted = [(n, "label", 1) for n in schema.labels] + [(f.name, f.kind, f.dim) for f in schema.features]
    for name, kind, dim in wanted:
        if name not in names:
            raise DataFormatError(f"{path}: no column {name!r} (a {kind}); the file has {names}. "
                                  "Rename the column or pass a schema that matches the file")
        column_type = arrow_schema.field(name).type
        accepts, description = _expected_type(kind, dim)
        if not accepts(column_type):
            raise DataFormatError(f"{path}, column {name!r}: type {column_type} cannot hold {kind} values; "
                                  f"expected {description}. Cast the column (e.g. write it with "
                                  "picasso_tf.data.write_parquet) or fix the schema")


def _padded(lists, max_len):
    """A list array -> int64 [N, max_len] right-padded with 0 (longer lists are cut)."""
    if pa.types.is_fixed_size_list(lists.type):
        lists = lists.cast(pa.list_(lists.type.value_type))
    offsets = np.asarray(lists.offsets, dtype=np.int64)   # of this slice, into lists.values
    values = pc.fill_null(lists.values, 0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    lengths = np.minimum(np.diff(offsets), max_len)
    if lists.null_count:
        lengths[lists.is_null().to_numpy(zero_copy_only=False)] = 0
    positions = np.arange(max_len)
    keep = positions < lengths[:, None]
    out = np.zeros((len(lengths), max_len), np.int64)
    out[keep] = values[(offsets[:-1, None] + positions)[keep]]
    return out


def numpy_columns(batch, schema, path, first_row, dense_default=0.0):
    """A pa.RecordBatch -> {name: numpy array} laid out as schema.py says.

    Missing (null) dense values become dense_default and missing ids 0; a missing
    label, a dense list of the wrong length, a NaN or an id outside [0, vocab_size)
    raises DataFormatError naming the file, the row (0-based, counted from the file's
    start as first_row + index in the batch) and the column.
    """
    def fail(name, mask, problem):
        row = first_row + int(np.flatnonzero(mask)[0])
        raise DataFormatError(f"{path}, row {row}, column {name!r}: {problem}")

    columns = {}
    for name in schema.labels:
        column = batch.column(name)
        if column.null_count:
            fail(name, column.is_null().to_numpy(zero_copy_only=False), "missing label; drop the row")
        columns[name] = column.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    for f in schema.features:
        column = batch.column(f.name)
        if f.kind == SEQUENCE:
            array = _padded(column, f.max_len)
        elif f.kind == DENSE and f.dim > 1:
            lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
            if (lengths != f.dim).any():
                fail(f.name, lengths != f.dim, f"expected lists of {f.dim} values")
            array = pc.fill_null(column.flatten(), dense_default).to_numpy(zero_copy_only=False)
            array = array.astype(np.float32, copy=False).reshape(-1, f.dim)
        elif f.kind == DENSE:
            array = pc.fill_null(column, dense_default).to_numpy(zero_copy_only=False).astype(np.float32,
                                                                                             copy=False)
        else:
            array = pc.fill_null(column, 0).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        if f.kind == DENSE and np.isnan(array).any():
            fail(f.name, np.isnan(array).reshape(len(array), -1).any(axis=1),
                 "NaN; replace missing values (e.g. by 0) when writing the data")
        if f.kind != DENSE and array.size and (array.min() < 0 or array.max() >= f.vocab_size):
            bad = ((array < 0) | (array >= f.vocab_size)).reshape(len(array), -1).any(axis=1)
            fail(f.name, bad, f"an id outside [0, {f.vocab_size}) (0 means missing); re-index the "
                              "values or raise vocab_size in the schema")
        columns[f.name] = array
    return columns
