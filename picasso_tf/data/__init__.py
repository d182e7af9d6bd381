"""Feature schema, in-memory data, readers and writers, synthetic generators and bundled datasets.

Readers return tf.data.Dataset of (features, label) batches laid out as schema.py
says, with batching, shuffling, prefetching and a (rank, world) shard option:
  read_criteo    Criteo TSV (Kaggle/Terabyte) and CSV with a header
  read_csv       the generic text format of write_csv
  read_parquet   Parquet; engine="pyarrow" (default, fast) or "tfio" (tensorflow-io)
  read_tfrecord  tf.train.Example records
Whole files into memory, any of these formats (files.py): read_files(paths, schema,
format="auto", rows=None) -> TabularData; sniff_format(path), file_format(files),
data_files(paths), load_schema(path).
In memory: TabularData(schema, features, labels).dataset(batch_size, ...).
Synthetic data: generate / generate_chunks / stream for any schema, presets
criteo_schema, alibaba_schema, wide_schema (preset_schema(name)).
Bundled: load_movielens, load_criteo_sample, load_avazu_sample.
"""
from picasso_tf.data.avazu import avazu_schema, load_avazu_sample, read_avazu_csv
from picasso_tf.data.criteo import (CRITEO_KAGGLE_CARDINALITIES, criteo_schema, load_criteo_sample, read_criteo,
                                    write_criteo)
from picasso_tf.data.dataset import TabularData
from picasso_tf.data.errors import DataFileError, DataFormatError
from picasso_tf.data.files import data_files, file_format, load_schema, read_files, sniff_format
from picasso_tf.data.hashing import fold_hex, hash_strings
from picasso_tf.data.metrics import roc_auc
from picasso_tf.data.movielens import load_movielens
from picasso_tf.data.parquet import read_parquet, write_parquet
from picasso_tf.data.samples import bundled_path
from picasso_tf.data.schema import CATEGORICAL, DENSE, SEQUENCE, Feature, Schema
from picasso_tf.data.synthetic import (PRESETS, SyntheticGenerator, alibaba_schema, generate, generate_chunks,
                                       preset_schema, stream, wide_schema)
from picasso_tf.data.text import read_csv, write_csv
from picasso_tf.data.tfrecord import read_tfrecord, write_tfrecord

__all__ = [
    "CATEGORICAL", "CRITEO_KAGGLE_CARDINALITIES", "DENSE", "PRESETS", "SEQUENCE", "DataFileError",
    "DataFormatError", "Feature", "Schema", "SyntheticGenerator", "TabularData", "alibaba_schema", "avazu_schema",
    "bundled_path", "criteo_schema", "data_files", "file_format", "fold_hex", "generate", "generate_chunks",
    "hash_strings", "load_avazu_sample", "load_criteo_sample", "load_movielens", "load_schema", "preset_schema",
    "read_avazu_csv", "read_criteo", "read_csv", "read_files", "read_parquet", "read_tfrecord", "roc_auc",
    "sniff_format", "stream", "wide_schema", "write_criteo", "write_csv", "write_parquet", "write_tfrecord",
]
