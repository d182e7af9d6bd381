"""tf.data plumbing the readers share: input paths, the record pipeline, labels, checks."""
import os

import tensorflow as tf

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
    if not (isinstance(world, int) and isinstance(rank, int) and world >= 1 and 0 <= rank < world):
        raise ValueError(f"shard (rank={rank!r}, world={world!r}) needs integers with 0 <= rank < world")


def finish(dataset, prefetch):
    return dataset.prefetch(AUTOTUNE) if prefetch else dataset


def record_pipeline(files, open_records, parse_batch, *, batch_size, shuffle, shuffle_buffer, seed,
                    repeat, drop_remainder, rank, world, prefetch):
    """The pipeline of the record-per-example readers (text lines, TFRecords).

    open_records(path tensor) -> Dataset of the file's records (strings).
    parse_batch(file_index [B] int64, record_index [B] int64 (0-based within its
    file), records [B] string) -> (features, label).

    Examples are sharded round-robin over (rank, world): every rank reads every file
    but parses only its own records. Files are visited in one order on all ranks
    (shuffled per epoch with the shared seed when shuffle=True), so the shards are
    disjoint and together cover the input; records are then shuffled per rank in a
    buffer of shuffle_buffer examples. Parsing runs on whole batches.
    """
    check_shard(rank, world)
    file_names = tf.constant(files)
    order = tf.data.Dataset.range(len(files))
    if shuffle:
        order = order.shuffle(len(files), seed=seed, reshuffle_each_iteration=True)
    if repeat:
        order = order.repeat()

    def records_of(i):
        records = open_records(file_names[i])
        return tf.data.Dataset.zip((tf.data.Dataset.from_tensors(i).repeat(), tf.data.Dataset.range(tf.int64.max),
                                    records))

    ds = order.flat_map(records_of)
    if world > 1:
        ds = ds.shard(world, rank)
    if shuffle:
        ds = ds.shuffle(shuffle_buffer, seed=seed)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    ds = ds.map(parse_batch, num_parallel_calls=AUTOTUNE)
    return finish(ds, prefetch)


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
