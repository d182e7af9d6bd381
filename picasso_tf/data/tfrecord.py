"""TFRecord files of tf.train.Example, one example per record.

Each label and dense feature is a float_list (dim values), each categorical feature an
int64_list of one id, each sequence an int64_list of its ids without the padding.
"""
import tensorflow as tf

from picasso_tf.data import arrow, pipeline
from picasso_tf.data.dataset import iter_chunks
from picasso_tf.data.schema import DENSE, SEQUENCE


def write_tfrecord(data, path, *, compression=None):
    """Writes TabularData (or an iterable of TabularData chunks); compression: None or "GZIP"."""
    with tf.io.TFRecordWriter(str(path), options=compression) as writer:
        for chunk in iter_chunks(data):
            for example in _examples(chunk):
                writer.write(example.SerializeToString())


def _examples(data):
    """tf.train.Example protos of the rows of `data`."""
    def floats(values):
        return tf.train.Feature(float_list=tf.train.FloatList(value=values))

    def ints(values):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=values))

    columns = []   # (name, per-row python lists, proto maker)
    for name, values in data.label_dict.items():
        columns.append((name, values[:, None].tolist(), floats))
    for f in data.schema.features:
        array = data.features[f.name]
        if f.kind == SEQUENCE:
            lengths = arrow.sequence_lengths(array)
            rows = [row[:n] for row, n in zip(array.tolist(), lengths.tolist())]
        else:
            rows = array.reshape(len(array), -1).tolist()
        columns.append((f.name, rows, floats if f.kind == DENSE else ints))
    for i in range(data.num_examples):
        yield tf.train.Example(features=tf.train.Features(
            feature={name: make(rows[i]) for name, rows, make in columns}))


def read_tfrecord(paths, schema, batch_size=1024, *, compression=None, shuffle=False, shuffle_buffer=10_000,
                  seed=0, repeat=False, drop_remainder=False, rank=0, world=1, prefetch=True):
    """tf.data.Dataset of (features, label) batches from TFRecord files written as above.

    Sharding and shuffling as pipeline.record_pipeline describes. A record that lacks a
    feature or holds the wrong type fails in tf.io.parse_example, whose message names
    the example as "<file>, record <n>" (0-based); an id outside its vocabulary or a
    NaN dense value fails naming the record and feature.
    """
    spec = {n: tf.io.FixedLenFeature([], tf.float32) for n in schema.labels}
    for f in schema.features:
        if f.kind == SEQUENCE:
            spec[f.name] = tf.io.RaggedFeature(tf.int64, row_splits_dtype=tf.int64)
        else:
            spec[f.name] = tf.io.FixedLenFeature(f.shape, tf.as_dtype(f.dtype))
    files = pipeline.expand_paths(paths)
    file_names = tf.constant(files)

    def parse_block(file_index, record_index, records):
        names = tf.strings.join([file_names[file_index], ", record ",
                                 tf.strings.as_string(record_index)])
        columns = tf.io.parse_example(records, spec, example_names=names)
        for f in schema.sequences:
            columns[f.name] = pipeline.pad_ragged(columns[f.name], f.max_len)
        features, label = pipeline.split_labels(schema, columns)
        return pipeline.checked_values(schema, features, lambda row: names[row]), label

    return pipeline.record_pipeline(
        files, lambda path: tf.data.TFRecordDataset(path, compression_type=compression or ""), parse_block,
        batch_size=batch_size, shuffle=shuffle, shuffle_buffer=shuffle_buffer, seed=seed, repeat=repeat,
        drop_remainder=drop_remainder, rank=rank, world=world, prefetch=prefetch)
