"""tf.data plumbing the readers share: input paths, the record pipeline, labels, checks."""
import numbers
import os

import tensorflow as tf

from picasso_tf.data.schema import DENSE

AUTOTUNE = tf.data.AUTOTUNE


def expand_paths(paths):
    """A path, glob pattern or list of them -> a non-empty list of existing files."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = []
    for pattern in map(os.fspath, paths):
        if any(c in pattern for c in "*?["):
            matches = sorted(tf.io.gfile.glob(pattern))
            if not matches:
                raise FileNotFoundError(f"no file matches {pattern!r}")
            files.extend(matches)
        elif tf.io.gfile.exists(pattern):
            files.append(pattern)
        else:
            raise FileNotFoundError(f"{pattern}: no such file")
    if not files:
        raise ValueError("no input files given")
    return files


def check_shard(rank, world):
    integers = isinstance(rank, numbers.Integral) and isinstance(world, numbers.Integral)
    if not (integers and world >= 1 and 0 <= rank < world):
        raise ValueError(f"shard (rank={rank!r}, world={world!r}) needs integers with 0 <= rank < world")


def without_autotuner(dataset):
    """`dataset` with tf.data's autotuner off. With it on, Keras' fit (and evaluate) can
    return long after its last step: the iterator's teardown waits on the autotuner's
    background thread, for up to about as long as the steps took (docs/benchmarks.md,
    "fit's return held by tf.data's autotuner"). Off, num_parallel_calls=AUTOTUNE runs
    min(16, tf.data's threads: the cores) calls, fixed. A caller who wants it back sets
    the option again with Dataset.with_options."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def finish(dataset, prefetch, autotuner=False):
    """The readers' last stage: prefetching, and the autotuner off (without_autotuner)
    unless `autotuner` (a reader whose own stages it speeds up keeps it)."""
    if not autotuner:
        dataset = without_autotuner(dataset)
    return dataset.prefetch(AUTOTUNE) if prefetch else dataset


def record_pipeline(files, open_records, parse_block, *, batch_size, shuffle, shuffle_buffer, seed, repeat,
                    drop_remainder, rank, world, prefetch, shuffle_block=256):
    """The pipeline of the record-per-example readers (text lines, TFRecords).

    open_records(path tensor) -> Dataset of the file's records (strings).
    parse_block(file_index scalar int64, record_index [n] int64 (0-based within the
    file), records [n] string) -> (features, label) of those n records.

    Records are parsed in blocks of consecutive records of one file, whole blocks at
    a time, then cut into batches of batch_size (Dataset.rebatch): nothing runs per
    record, which is what makes text readable at the rate of its parsing ops.
    Sharding: record i of each file belongs to rank i % world, so every rank reads
    every file and parses only its own records; shards are disjoint and cover the
    input whatever the file order. Shuffling (anew on every pass): the file order,
    then blocks of shuffle_block records drawn from a buffer of about shuffle_buffer
    records, so a batch gathers batch_size / shuffle_block random blocks.
    """
    check_shard(rank, world)
    block = min(batch_size, shuffle_block) if shuffle else batch_size
    file_names = tf.constant(files)
    order = tf.data.Dataset.range(len(files))
    if shuffle:
        order = order.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)
    if repeat:
        order = order.repeat()

    def blocks_of(file_index):
        def numbered(block_index, records):
            index = block_index * block + tf.range(tf.size(records, out_type=tf.int64))
            if world > 1:
                mine = tf.equal(index % world, rank)
                index, records = index[mine], records[mine]
            return file_index, index, records
        blocks = open_records(file_names[file_index]).batch(block).enumerate().map(numbered)
        return blocks.filter(lambda f, i, records: tf.size(records) > 0) if world > 1 else blocks

    blocks = order.flat_map(blocks_of)
    if shuffle:
        blocks = blocks.shuffle(max(1, shuffle_buffer // block), seed=seed)
    parsed = blocks.map(parse_block, num_parallel_calls=AUTOTUNE)
    return finish(parsed.rebatch(batch_size, drop_remainder=drop_remainder), prefetch)


def split_labels(schema, columns):
    """(features in schema order, label or {name: label}) from a dict of all columns."""
    features = {f.name: columns[f.name] for f in schema.features}
    if len(schema.labels) == 1:
        return features, columns[schema.labels[0]]
    return features, {n: columns[n] for n in schema.labels}


def checked(ok, message, outputs):
    """`outputs`, released only if the scalar `ok` holds; otherwise the pipeline fails
    with tf.errors.InvalidArgumentError("assertion failed: [message]")."""
    check = tf.debugging.Assert(ok, [message])
    with tf.control_dependencies([check]):
        return tf.nest.map_structure(tf.identity, outputs)


def first_true(mask):
    """(row, column) of the first True of a [B, C] bool tensor in row-major order."""
    flat = tf.argmax(tf.cast(tf.reshape(mask, [-1]), tf.int32), output_type=tf.int64)
    columns = tf.cast(tf.shape(mask)[1], tf.int64)
    return flat // columns, flat % columns


def pad_ragged(ragged, max_len):
    """[B, None] ragged -> [B, max_len] dense, right-padded with 0, longer rows cut."""
    return ragged[:, :max_len].to_tensor(0, shape=[None, max_len])


def checked_values(schema, features, example_name):
    """`features`, released only if every categorical and sequence id lies in
    [0, vocab_size) and no dense value is NaN; otherwise the pipeline fails naming the
    example, the feature and the value.

    example_name(row) -> scalar string tensor naming the row (file and record).
    """
    lows, highs, bad = [], [], []
    for f in schema.features:
        values = features[f.name]
        values = tf.reshape(values, [tf.shape(values)[0], -1])
        if f.kind == DENSE:
            nan = tf.reduce_any(tf.math.is_nan(values), axis=1)
            lows.append(tf.zeros_like(nan, tf.int64))
            highs.append(tf.zeros_like(nan, tf.int64))
            bad.append(nan)
        else:
            lows.append(tf.reduce_min(values, axis=1))
            highs.append(tf.reduce_max(values, axis=1))
            bad.append((lows[-1] < 0) | (highs[-1] >= f.vocab_size))
    bad = tf.stack(bad, axis=1)
    row, col = first_true(bad)
    vocab = tf.constant([f.vocab_size or 0 for f in schema.features], tf.int64)
    high, low = tf.stack(highs, 1)[row, col], tf.stack(lows, 1)[row, col]
    problem = tf.where(
        tf.constant([f.kind == DENSE for f in schema.features])[col],
        "NaN; replace missing values (e.g. by 0) when writing the data",
        tf.strings.join(["id ", tf.strings.as_string(tf.where(high >= vocab[col], high, low)), " is outside [0, ",
                         tf.strings.as_string(vocab[col]), "); id 0 means missing. Re-index the values or raise "
                         "vocab_size in the schema"]))
    message = tf.strings.join([example_name(row), ", feature ", tf.constant([f.name for f in schema.features])[col],
                               ": ", problem])
    return checked(~tf.reduce_any(bad), message, features)
