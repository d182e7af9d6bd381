"""Criteo's display-advertising format: its schema, reader, writer and bundled sample.

Each line holds a 0/1 label, 13 integer features I1..I13 and 26 categorical features
C1..C26 written as 32-bit hexadecimal hashes; any value but the label may be empty.
Two forms are read: the Kaggle/Terabyte files (tab-separated, no header) and CSV with
a header naming the columns (as in the bundled criteo_sample.csv). The delimiter and
the header are detected from each file's first line unless given.

Categoricals are folded by value into their feature's vocabulary
(hashing.fold_hex: int(hex, 16) % (vocab_size - 1) + 1; empty -> 0). Dense values
are by default transformed as log(1 + max(x, 0)) (negative counts clipped, as DLRM
does); dense_transform=None keeps them raw. An empty dense value becomes dense_default
as it is, untransformed.
"""
import math
import re

import numpy as np
import pyarrow as pa
import tensorflow as tf

from picasso_tf.data import pipeline, text
from picasso_tf.data.dataset import TabularData, iter_chunks
from picasso_tf.data.errors import DataFormatError
from picasso_tf.data.samples import bundled_path
from picasso_tf.data.schema import CATEGORICAL, DENSE, Feature, Schema

# Distinct values of C1..C26 in the Criteo Kaggle (display advertising challenge) data,
# as published with DLRM and used across the CTR literature.
CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
DENSE_NAMES = tuple(f"I{i}" for i in range(1, 14))
CATEGORICAL_NAMES = tuple(f"C{i}" for i in range(1, 27))
COLUMNS = ("label",) + DENSE_NAMES + CATEGORICAL_NAMES
DENSE_TRANSFORMS = {
    "log1p": lambda x: tf.math.log1p(tf.maximum(x, 0.0)),
    None: None,
}


def criteo_schema(buckets=None, *, scale=1.0, max_buckets=None, embedding_dim=16, name="criteo"):
    """The Criteo schema: dense I1..I13, categorical C1..C26 (hashed), label "label".

    buckets: ids per categorical feature, not counting the reserved id 0 (so each
      Feature.vocab_size is buckets + 1): None for the Kaggle cardinalities, an int for
      all 26, or a sequence of 26.
    scale, max_buckets: shrink those counts (ceil(b * scale), then at most max_buckets;
      at least 1), e.g. to generate a smaller synthetic Criteo.
    """
    if buckets is None:
        buckets = CRITEO_KAGGLE_CARDINALITIES
    elif isinstance(buckets, int):
        buckets = (buckets,) * len(CATEGORICAL_NAMES)
    if len(buckets) != len(CATEGORICAL_NAMES):
        raise ValueError(f"buckets: expected one count per categorical feature (26), got {len(buckets)}")
    sizes = [max(1, math.ceil(b * scale)) for b in buckets]
    if max_buckets is not None:
        sizes = [min(b, max_buckets) for b in sizes]
    features = [Feature(n, DENSE) for n in DENSE_NAMES]
    features += [Feature(n, CATEGORICAL, vocab_size=b + 1, hashed=True, embedding_dim=embedding_dim)
                 for n, b in zip(CATEGORICAL_NAMES, sizes)]
    return Schema(features, labels=["label"], name=name)


def read_criteo(paths, schema=None, batch_size=1024, *, delimiter=None, header=None, dense_transform="log1p",
                dense_default=0.0, shuffle=False, shuffle_buffer=10_000, seed=0, repeat=False,
                drop_remainder=False, rank=0, world=1, prefetch=True):
    """tf.data.Dataset of (features, label) batches from Criteo files.

    schema: criteo_schema(...) or a schema holding a subset of its features (only those
      columns are decoded); None for criteo_schema().
    delimiter, header: None to detect them per file from its first line ("\\t" if the
      line has a tab, else ","; a header if its first field is not a number).
    dense_transform: "log1p" (default) or None; see the module docstring.
    Sharding and shuffling as pipeline.record_pipeline describes; a malformed line
    stops the pipeline with an error naming the file, line and column.
    """
    schema = schema or criteo_schema()
    if dense_transform not in DENSE_TRANSFORMS:
        raise ValueError(f"dense_transform must be one of {list(DENSE_TRANSFORMS)}, got {dense_transform!r}")
    columns = _columns(schema)
    files = pipeline.expand_paths(paths)
    delimiter, header = _detect_layout(files, delimiter, header)
    names = [c.name for c in columns]
    if header:
        positions, num_fields = text.header_positions(files, delimiter, names)
    else:
        positions, num_fields = [COLUMNS.index(n) for n in names], len(COLUMNS)
    return text.read_delimited(
        files, schema, columns, positions, num_fields, delimiter, int(header), batch_size=batch_size,
        dense_default=dense_default, dense_transform=DENSE_TRANSFORMS[dense_transform], shuffle=shuffle,
        shuffle_buffer=shuffle_buffer, seed=seed, repeat=repeat, drop_remainder=drop_remainder, rank=rank,
        world=world, prefetch=prefetch)


def _columns(schema):
    if schema.labels != ["label"]:
        raise ValueError(f"a Criteo schema has the single label 'label', not {schema.labels}")
    columns = [text.TextColumn("label", "label")]
    for f in schema.features:
        if f.name in DENSE_NAMES and f.kind == DENSE and f.dim == 1:
            columns.append(text.TextColumn(f.name, "number"))
        elif f.name in CATEGORICAL_NAMES and f.kind == CATEGORICAL:
            columns.append(text.TextColumn(f.name, "hex", f.vocab_size))
        else:
            raise ValueError(f"feature {f.name!r} ({f.kind}) is not a Criteo column; Criteo has dense "
                             "I1..I13 and categorical C1..C26")
    return columns


def _detect_layout(files, delimiter, header):
    """(delimiter, header) shared by all files, detected from first lines where None."""
    layouts = set()
    for path in files:
        line = text.read_first_line(path)
        file_delimiter = delimiter or ("\t" if "\t" in line else ",")
        first = line.split(file_delimiter)[0]
        file_header = header if header is not None else not re.fullmatch(text.PATTERNS["label"], first)
        layouts.add((file_delimiter, file_header))
        if len(layouts) > 1:
            raise DataFormatError(f"{path}: its layout (delimiter {file_delimiter!r}, header {file_header}) "
                                  f"differs from that of {files[0]}; read them separately")
    return layouts.pop()


def write_criteo(data, path, *, delimiter="\t", header=False):
    """Writes TabularData of a Criteo schema in Criteo's format, all 40 columns.

    Dense values are written as they are in `data` (already transformed, if they were
    read with a transform); features the schema lacks are left empty. A categorical id
    i >= 1 is written as the hex of i - 1, which read_criteo folds back to i: the
    round trip is exact.
    """
    with open(path, "wb") as sink:
        for i, chunk in enumerate(iter_chunks(data)):
            if i == 0:
                _columns(chunk.schema)   # rejects a non-Criteo schema before writing
            n = chunk.num_examples
            columns = {"label": pa.array(chunk.label_dict["label"])}
            for name in DENSE_NAMES:
                columns[name] = pa.array(chunk.features[name]) if name in chunk.features else pa.nulls(n)
            for name in CATEGORICAL_NAMES:
                ids = chunk.features.get(name, np.zeros(n, np.int64))
                columns[name] = _hex_strings(np.maximum(ids, 1) - 1, missing=ids == 0)
            text.write_table(pa.table(columns), sink, delimiter, header=header and i == 0)


def _hex_strings(values, missing):
    """Non-negative integers -> lower-case hex of 8 digits (16 if needed); null where `missing`."""
    values = np.asarray(values).astype(np.uint64)
    digits = 8 if values.size == 0 or values.max() < 2 ** 32 else 16
    shifts = np.arange(4 * (digits - 1), -1, -4, dtype=np.uint64)
    nibbles = (values[:, None] >> shifts) & np.uint64(15)
    chars = np.frombuffer(b"0123456789abcdef", np.uint8)[nibbles]
    strings = np.ascontiguousarray(chars).view(f"S{digits}").ravel()
    return pa.array(strings, pa.binary(), mask=np.asarray(missing)).cast(pa.string())


def load_criteo_sample(buckets=1000, dense_transform="log1p"):
    """The bundled 200-row Criteo sample (bundled/criteo_sample.csv) as TabularData,
    its categoricals folded into `buckets` ids each."""
    schema = criteo_schema(buckets, name="criteo-sample")
    dataset = read_criteo(bundled_path("criteo_sample.csv"), schema, batch_size=256,
                          dense_transform=dense_transform, prefetch=False)
    return TabularData.from_dataset(schema, dataset)
