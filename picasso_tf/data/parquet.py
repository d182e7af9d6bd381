"""Parquet reading, by two engines, and writing.

engine="pyarrow" (the default, and the fast one): pyarrow.parquet.ParquetFile.iter_batches
  decodes column chunks to numpy, batches are cut in Python and handed to tf.data
  through Dataset.from_generator. benchmarks/readers.py measures it at tens of times the
  rate of the tfio engine; a block shuffle permutes rows within each chunk of read_rows
  rows and the file order per epoch.
engine="tfio": tensorflow_io's IODataset.from_parquet, which yields one row at a time
  (then tf.data's shuffle buffer and batch). Flat columns only: no sequences and no dense
  lists. Kept for tensorflow-io's filesystems and streaming sources.

Both check every file's column types up front (an error names the file and column),
every id against its vocabulary and every dense value for NaN (an error names the
file, row and column).
"""
import functools
import itertools

import numpy as np
import pyarrow.parquet as pq
import tensorflow as tf

from picasso_tf.data import arrow, pipeline
from picasso_tf.data.dataset import iter_chunks
from picasso_tf.data.schema import DENSE, SEQUENCE

ENGINES = ("pyarrow", "tfio")


def write_parquet(data, path, *, row_group_size=131_072, compression="snappy"):
    """Writes TabularData (or an iterable of TabularData chunks) as one Parquet file in
    the layout described in arrow.py."""
    writer = None
    try:
        for chunk in iter_chunks(data):
            table = arrow.to_arrow(chunk)
            if writer is None:
                writer = pq.ParquetWriter(str(path), table.schema, compression=compression)
            writer.write_table(table, row_group_size=row_group_size)
    finally:
        if writer is not None:
            writer.close()


def read_parquet(paths, schema, batch_size=1024, *, engine="pyarrow", shuffle=False, seed=0, repeat=False,
                 drop_remainder=False, rank=0, world=1, prefetch=True, dense_default=0.0, read_rows=65_536,
                 shuffle_buffer=10_000):
    """tf.data.Dataset of (features, label) batches from Parquet files.

    Row r of each file belongs to rank r % world: every rank reads every file and
    keeps its own rows, so the shards are disjoint and cover the input. Nulls become
    dense_default (dense) or id 0 (categorical, sequence); a null label is an error.
    read_rows is the pyarrow engine's decoding (and block-shuffle) unit;
    shuffle_buffer is the tfio engine's shuffle buffer, in rows.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    pipeline.check_shard(rank, world)
    files = pipeline.expand_paths(paths)
    for path in files:
        arrow.check_schema(pq.ParquetFile(path).schema_arrow, schema, path)
    if engine == "tfio":
        return _read_tfio(files, schema, batch_size, shuffle=shuffle, seed=seed, repeat=repeat,
                          drop_remainder=drop_remainder, rank=rank, world=world, prefetch=prefetch,
                          shuffle_buffer=shuffle_buffer)
    passes = itertools.count()   # each new iterator (a Keras epoch) shuffles anew
    batches = functools.partial(_pyarrow_batches, files, schema, batch_size, shuffle=shuffle, seed=seed,
                                repeat=repeat, drop_remainder=drop_remainder, rank=rank, world=world,
                                dense_default=dense_default, read_rows=read_rows)
    dataset = tf.data.Dataset.from_generator(lambda: batches(next(passes)), output_signature=schema.tensor_specs())
    return pipeline.finish(dataset, prefetch)


def _pyarrow_batches(files, schema, batch_size, pass_number, *, shuffle, seed, repeat, drop_remainder, rank,
                     world, dense_default, read_rows):
    """Yields (features, label) numpy batches; see read_parquet."""
    names = list(schema.labels) + [f.name for f in schema.features]
    rng = np.random.default_rng([seed, rank, pass_number])
    buffer = None
    while True:
        epoch_rows = 0
        for i in (rng.permutation(len(files)) if shuffle else range(len(files))):
            first_row = 0
            for batch in pq.ParquetFile(files[i]).iter_batches(batch_size=read_rows, columns=names):
                # Every rank decodes and checks the whole chunk, so all ranks fail alike.
                columns = arrow.numpy_columns(batch, schema, files[i], first_row, dense_default)
                keep = np.arange((rank - first_row) % world, batch.num_rows, world)   # row r -> rank r % world
                first_row += batch.num_rows
                if shuffle:
                    keep = rng.permutation(keep)
                if world > 1 or shuffle:
                    columns = {k: v[keep] for k, v in columns.items()}
                epoch_rows += len(keep)
                buffer = columns if buffer is None else {k: np.concatenate([buffer[k], columns[k]])
                                                         for k in columns}
                full = len(buffer[names[0]]) // batch_size * batch_size
                for start in range(0, full, batch_size):
                    yield pipeline.split_labels(schema, {k: v[start:start + batch_size]
                                                         for k, v in buffer.items()})
                buffer = {k: v[full:] for k, v in buffer.items()}
        if not repeat or epoch_rows == 0:   # an empty input repeats to nothing, as in tf.data
            break
    if buffer is not None and len(buffer[names[0]]) and not drop_remainder:
        yield pipeline.split_labels(schema, buffer)


def _read_tfio(files, schema, batch_size, *, shuffle, seed, repeat, drop_remainder, rank, world, prefetch,
               shuffle_buffer):
    import tensorflow_io as tfio   # imported here: slow to load, and only this engine needs it

    nested = [f.name for f in schema.features if f.kind == SEQUENCE or (f.kind == DENSE and f.dim > 1)]
    if nested:
        raise ValueError(f"engine='tfio' reads flat columns only, not the list columns of {nested}; "
                         "use engine='pyarrow'")
    names = list(schema.labels) + [f.name for f in schema.features]
    order = np.random.default_rng(seed).permutation(len(files)) if shuffle else range(len(files))

    def rows_of(i):
        rows = tfio.IODataset.from_parquet(files[i], columns=names).enumerate()
        if world > 1:
            rows = rows.filter(lambda n, row: n % world == rank)   # row r of each file -> rank r % world
        return rows.map(lambda n, row: (tf.constant(i, tf.int64), n, row))

    ds = functools.reduce(lambda a, b: a.concatenate(b), [rows_of(i) for i in order])
    if repeat:
        ds = ds.repeat()
    if shuffle:
        ds = ds.shuffle(shuffle_buffer, seed=seed)
    file_names = tf.constant(files)

    def convert(file_index, row_index, row):
        columns = {n: tf.cast(row[n], tf.float32) for n in schema.labels}
        columns.update({f.name: tf.cast(row[f.name], f.dtype) for f in schema.features})
        features, label = pipeline.split_labels(schema, columns)
        features = pipeline.checked_values(schema, features, lambda r: tf.strings.join(
            [file_names[file_index[r]], ", row ", tf.strings.as_string(row_index[r])]))
        return features, label

    ds = ds.batch(batch_size, drop_remainder=drop_remainder).map(convert, num_parallel_calls=pipeline.AUTOTUNE)
    # Rows come one at a time from tensorflow-io, and this pipeline reads about a third
    # faster with the autotuner on (docs/benchmarks.md, "fit's return held by tf.data's
    # autotuner"): it keeps it, and with it the tail after fit's last step.
    return pipeline.finish(ds, prefetch, autotuner=True)
