"""TabularData: examples held in memory as numpy arrays, and their tf.data pipeline."""
import numpy as np
import tensorflow as tf

from picasso_tf.data import pipeline
from picasso_tf.data.errors import DataFormatError
from picasso_tf.data.schema import DENSE


class TabularData:
    """Examples in memory: one numpy array per schema feature, laid out as schema.py
    says (dense float32 [N] or [N, dim]; categorical int64 [N]; sequence int64
    [N, max_len]), labels float32 [N] (a dict {name: [N]} when the schema has several),
    and `extras`: per-example arrays that are not model inputs (a generator's planted
    probabilities, ratings, timestamps), sliced along with the examples.

    The arrays are checked once, here (shapes, dtypes, ids within [0, vocab_size), no
    NaN), so the datasets built from them need no per-batch checks. Treat them as
    read-only.
    """

    def __init__(self, schema, features, labels, extras=None):
        label_dict = _label_dict(schema, labels)
        num_examples = len(next(iter(label_dict.values())))
        self.schema = schema
        self.features = _checked_features(schema, features, num_examples)
        self._labels = {n: _checked_label(n, v, num_examples) for n, v in label_dict.items()}
        self.extras = dict(extras or {})
        for name, value in self.extras.items():
            for array in (value.values() if isinstance(value, dict) else [value]):
                if len(array) != num_examples:
                    raise DataFormatError(f"extra {name!r} has {len(array)} rows, expected {num_examples}")

    @classmethod
    def _trusted(cls, schema, features, labels, extras):
        """Builds from arrays already checked (slices of checked data)."""
        data = cls.__new__(cls)
        data.schema, data.features, data._labels, data.extras = schema, features, labels, extras
        return data

    @property
    def num_examples(self):
        return len(next(iter(self._labels.values())))

    def __len__(self):
        return self.num_examples

    @property
    def labels(self):
        """float32 [N], or {name: [N]} when the schema has several labels."""
        return self._labels[self.schema.labels[0]] if len(self._labels) == 1 else dict(self._labels)

    @property
    def label_dict(self):
        """{label name: float32 [N]}, whatever the number of labels."""
        return dict(self._labels)

    def __repr__(self):
        return (f"TabularData({self.schema.name or 'unnamed'}: {self.num_examples} examples, "
                f"{len(self.features)} features, labels {list(self._labels)})")

    def take(self, indices):
        """The examples at `indices` (an int array or a boolean mask), in that order."""
        indices = np.asarray(indices)
        if indices.dtype == bool:
            indices = np.flatnonzero(indices)

        def pick(value):
            return {k: v[indices] for k, v in value.items()} if isinstance(value, dict) else value[indices]

        return TabularData._trusted(self.schema, pick(self.features), pick(self._labels),
                                    {k: pick(v) for k, v in self.extras.items()})

    def split(self, test_fraction, seed=0):
        """(train, test): a seeded random split; each part keeps the original order."""
        if not 0 < test_fraction < 1:
            raise ValueError(f"test_fraction must lie strictly between 0 and 1, got {test_fraction}")
        num_test = int(round(self.num_examples * test_fraction))
        if not 0 < num_test < self.num_examples:
            raise ValueError(f"test_fraction={test_fraction} of {self.num_examples} examples leaves "
                             "one part empty")
        order = np.random.default_rng(seed).permutation(self.num_examples)
        return self.take(np.sort(order[num_test:])), self.take(np.sort(order[:num_test]))

    def dataset(self, batch_size, shuffle=False, seed=0, repeat=False, drop_remainder=False, rank=0,
                world=1, prefetch=True):
        """tf.data.Dataset of (features, label) batches.

        (rank, world) keeps the examples whose position in each epoch's order is
        rank modulo world: disjoint shards covering every example. With shuffle, the
        order is a stateless shuffle of (seed, epoch), where epoch counts the passes
        over this dataset (each new iterator, as Keras makes per epoch, and each
        repetition): a new order every epoch, the same on every rank whatever the
        global TensorFlow seed, so the shards change but never overlap.

        The columns are packed row-major into one matrix per dtype, so that a batch
        is one gather of contiguous rows per dtype: a gather per column would cost a
        cache miss per example and feature once the data outgrows the caches.
        """
        pipeline.check_shard(rank, world)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        n = self.num_examples
        packed = [(tf.constant(matrix), layout) for matrix, layout in _packed({**self.features, **self._labels})]

        def epoch_order(epoch):
            order = tf.range(n, dtype=tf.int64)
            if shuffle:
                order = tf.random.experimental.stateless_shuffle(order, seed=tf.stack([tf.cast(seed, tf.int64),
                                                                                       epoch]))
            return tf.data.Dataset.from_tensor_slices(order[rank::world]).batch(batch_size, drop_remainder)

        def gather(indices):
            columns = {}
            for matrix, layout in packed:
                rows = tf.gather(matrix, indices)
                for name, start, shape in layout:
                    width = int(np.prod(shape))
                    columns[name] = tf.reshape(rows[:, start:start + width], (-1,) + shape)
            return pipeline.split_labels(self.schema, columns)

        passes = tf.Variable(0, dtype=tf.int64, trainable=False)   # survives new iterators
        epochs = tf.data.Dataset.range(tf.int64.max if repeat else 1).map(lambda _: passes.assign_add(1) - 1)
        batches = epochs.flat_map(epoch_order).map(gather, num_parallel_calls=pipeline.AUTOTUNE)
        return pipeline.finish(batches, prefetch)

    @classmethod
    def from_dataset(cls, schema, dataset):
        """Collects a finite dataset of (features, label) batches into memory."""
        parts = {}
        for features, label in dataset.as_numpy_iterator():
            labels = label if isinstance(label, dict) else {schema.labels[0]: label}
            for name, value in {**features, **labels}.items():
                parts.setdefault(name, []).append(value)
        if not parts:
            raise ValueError("the dataset holds no examples")
        columns = {name: np.concatenate(values) for name, values in parts.items()}
        return cls(schema, {f.name: columns[f.name] for f in schema.features},
                   {n: columns[n] for n in schema.labels})


def iter_chunks(data):
    """TabularData, or an iterable of TabularData sharing one schema, as an iterator of
    chunks (what writers accept, so that big synthetic sets can be written in pieces)."""
    chunks = iter([data] if isinstance(data, TabularData) else data)
    first = next(chunks, None)
    if first is None:
        raise ValueError("nothing to write: no TabularData given")
    yield first
    for chunk in chunks:
        if chunk.schema != first.schema:
            raise ValueError(f"chunks have different schemas: {first.schema.name!r} then {chunk.schema.name!r}")
        yield chunk


def _packed(columns):
    """[(matrix [N, width] of one dtype, [(name, first column, per-example shape)])]."""
    by_dtype = {}
    for name, array in columns.items():
        by_dtype.setdefault(array.dtype, []).append((name, array))
    packed = []
    for items in by_dtype.values():
        layout, start = [], 0
        for name, array in items:
            layout.append((name, start, array.shape[1:]))
            start += int(np.prod(array.shape[1:]))
        matrix = np.concatenate([array.reshape(len(array), -1) for _, array in items], axis=1)
        packed.append((matrix, layout))
    return packed


def _label_dict(schema, labels):
    if not isinstance(labels, dict):
        if len(schema.labels) != 1:
            raise DataFormatError(f"schema {schema.name!r} has labels {schema.labels}: pass them as a dict")
        labels = {schema.labels[0]: labels}
    if sorted(labels) != sorted(schema.labels):
        raise DataFormatError(f"labels {sorted(labels)} do not match the schema's labels {schema.labels}")
    return {n: labels[n] for n in schema.labels}


def _checked_label(name, value, num_examples):
    array = np.asarray(value)
    if array.shape != (num_examples,) or not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
        raise DataFormatError(f"label {name!r}: expected numbers of shape ({num_examples},), "
                              f"got {array.dtype} of shape {array.shape}")
    array = array.astype(np.float32, copy=False)
    _reject_nan(f"label {name!r}", array)
    return array


def _checked_features(schema, features, num_examples):
    unknown = sorted(set(features) - {f.name for f in schema.features})
    missing = [f.name for f in schema.features if f.name not in features]
    if unknown or missing:
        raise DataFormatError(f"features do not match schema {schema.name!r}: missing {missing}, "
                              f"not in the schema {unknown}")
    return {f.name: _checked_feature(f, features[f.name], num_examples) for f in schema.features}


def _checked_feature(feature, value, num_examples):
    array = np.asarray(value)
    shape = (num_examples,) + feature.shape
    what = f"feature {feature.name!r} ({feature.kind})"
    if array.shape != shape:
        raise DataFormatError(f"{what}: expected shape {shape}, got {array.shape}")
    if feature.kind == DENSE:
        if not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
            raise DataFormatError(f"{what}: expected numbers, got dtype {array.dtype}")
        array = array.astype(np.float32, copy=False)
        _reject_nan(what, array)
        return array
    if not np.issubdtype(array.dtype, np.integer):
        raise DataFormatError(f"{what}: expected integer ids, got dtype {array.dtype}; "
                              "hash or index raw values first (see picasso_tf.data.hash_strings)")
    array = array.astype(np.int64, copy=False)
    if array.size and (array.min() < 0 or array.max() >= feature.vocab_size):
        bad = (array < 0) | (array >= feature.vocab_size)
        row = int(np.flatnonzero(bad.reshape(num_examples, -1).any(axis=1))[0])
        value = np.asarray(array[row])[np.asarray(bad[row])].flat[0]
        raise DataFormatError(f"{what}, row {row}: id {value} is outside [0, {feature.vocab_size}); id 0 "
                              "means missing. Re-index the values or raise vocab_size in the schema")
    return array


def _reject_nan(what, array):
    if np.isnan(array).any():
        row = int(np.flatnonzero(np.isnan(array).reshape(len(array), -1).any(axis=1))[0])
        raise DataFormatError(f"{what}, row {row}: NaN; replace missing values (e.g. by 0) first")
