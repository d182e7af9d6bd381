"""Lookahead refresh of HybridHash's hot tier (Config.hot_refresh="lookahead", Bagpipe's
idea: the future is known). `fit` hands Keras a PeekedDataset in place of its
tf.data.Dataset: the same batches in the same order (a shuffle's too), read from the
dataset a few batches ahead of Keras. Before a step, LookaheadRefresh (a Keras callback) makes each hash-backed
group's hot set the ids the next batches look up (HybridHashTables.refresh_ahead): at
the first step of each pass over the dataset and every `every` steps of it, from the
next `ahead` batches of the pass (fewer at its end: the next pass is not read ahead).

A pass is one iterator of the dataset: Keras makes a new one each epoch unless
steps_per_epoch leaves batches for the next epoch, in which case a pass spans epochs.
Keras must iterate the dataset it is given (fit refuses class_weight, which Keras maps
over it).
The refresh runs between steps, in the thread that runs them, so no step reads the hot
tier while it changes.
"""
import collections
import threading

import tensorflow as tf


class PeekedDataset:
    """`dataset`'s batches, handed to Keras through ``dataset`` (same order, elements,
    cardinality), with ``position`` and ``peek`` telling which batches Keras reads next.
    Each iterator Keras makes of ``dataset`` makes one of `dataset` at once (a pass), as
    it would make of `dataset` itself: a shuffle draws its order then."""

    def __init__(self, dataset):
        self._source_dataset = dataset
        self._lock = threading.Lock()   # tf.data runs the generator in threads of its own
        self._passes = 0                # iterators Keras has made
        self._source = None             # the latest one's iterator of `dataset`
        self._ended = False             # it has no batch left
        self._ahead = collections.deque()   # batches of the current pass read, not yet handed to Keras
        self._handed = 0                # batches of the current pass handed to Keras
        peeked = tf.data.Dataset.from_generator(self._batches, output_signature=dataset.element_spec)
        cardinality = int(dataset.cardinality())
        if cardinality >= 0 or cardinality == tf.data.INFINITE_CARDINALITY:
            # Keras decides from it how many steps an epoch has and whether to make a new iterator each epoch.
            peeked = peeked.apply(tf.data.experimental.assert_cardinality(cardinality))
        # Read no batch before Keras asks for it: the peeks say which one it reads next.
        options = tf.data.Options()
        options.experimental_optimization.inject_prefetch = False
        self.dataset = _IteratedDataset(peeked.with_options(options), self._begin)

    def position(self):
        """(pass number, how many of its batches Keras has read) of the batch it reads next."""
        with self._lock:
            return self._passes, self._handed

    def peek(self, count):
        """The next `count` batches Keras reads in the current pass (fewer at its end)."""
        with self._lock:
            while len(self._ahead) < count and self._read():
                pass
            return list(self._ahead)[:count]

    def _begin(self):
        with self._lock:
            self._passes += 1
            self._source, self._ended, self._handed = iter(self._source_dataset), False, 0
            self._ahead.clear()

    def _read(self):
        """Reads one more batch of the current pass; False at its end."""
        if not self._ended:
            try:
                self._ahead.append(next(self._source))
            except StopIteration:
                self._ended = True
        return not self._ended

    def _batches(self):
        """The batches of the iterator Keras made last (it reads no other)."""
        with self._lock:
            mine = self._passes
        while True:
            with self._lock:
                if self._passes != mine or (not self._ahead and not self._read()):
                    return
                batch = self._ahead.popleft()
                self._handed += 1
            yield batch


class _IteratedDataset(tf.data.Dataset):
    """`dataset`, calling `on_iter()` whenever an iterator of it is made."""

    def __init__(self, dataset, on_iter):
        self._dataset, self._on_iter = dataset, on_iter
        super().__init__(dataset._variant_tensor)

    def _inputs(self):
        return [self._dataset]

    @property
    def element_spec(self):
        return self._dataset.element_spec

    def __iter__(self):
        self._on_iter()
        return super().__iter__()


class LookaheadRefresh(tf.keras.callbacks.Callback):
    """Before a step, refreshes the hot sets of `storages(features)` (the model rewritten
    on a batch's features if it has not been) from the next `ahead` batches of `peeked`
    when a pass begins and every `every` steps of it; `ids_of(features)` gives a batch's
    {table name: distinct ids}."""

    def __init__(self, peeked, storages, ids_of, every, ahead):
        super().__init__()
        self._peeked, self._storages, self._ids_of = peeked, storages, ids_of
        self._every, self._ahead = every, ahead
        self._last = None       # (pass, position) of the last refresh
        self._ids = {}          # (pass, position) -> a peeked batch's ids, while a later window may need them

    def on_train_batch_begin(self, batch, logs=None):
        where, position = self._peeked.position()
        if self._last is not None and self._last[0] == where and position - self._last[1] < self._every:
            return
        self._last = (where, position)
        ahead = self._peeked.peek(self._ahead)
        if not ahead:
            return      # the step will find no batch (Keras then ends the epoch)
        storages = self._storages(_features(ahead[0]))
        if not storages:
            return
        upcoming = []
        for i, later in enumerate(ahead):
            key = (where, position + i)
            if key not in self._ids:
                self._ids[key] = {name: ids.numpy() for name, ids in self._ids_of(_features(later)).items()}
            upcoming.append(self._ids[key])
        self._ids = {k: v for k, v in self._ids.items() if k[0] == where and k[1] >= position + self._every}
        for storage in storages:
            storage.refresh_ahead(upcoming)


def _features(batch):
    return tf.keras.utils.unpack_x_y_sample_weight(batch)[0]
