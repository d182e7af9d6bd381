"""The ids check of a training step that exchanges no rows under Horovod (every table
read in place: replicated, or frozen), folded into the step's grouped Allreduce.

A fused kernel checks its own ids, but one failing on its rank alone would leave the
other ranks waiting in the step's Allreduce. So each forward pass of the training step
(one per micro-batch) first checks the ids of its sites (first_invalid) and hands the
kernels, forward and backward, ids that cannot fail: its own where every id is valid,
else zeros (every table has a row 0; the step is refused anyway). Its report (whether
an id is invalid, the site holding the first one, that id) goes into this rank's slot
of a small tensor that joins the gradients' grouped Allreduce, which every rank issues
whatever its data. After it every rank finds the first reporting rank and raises the
error the exchange raises for its ids (exchange.py: feature, id, table size, rank,
what to do). The step's apply stage, its compiled metrics and Keras' count of steps
wait for the check, so no weight, slot or count changes; Keras' loss tracker does not
(Keras updates it as it computes the loss, before the Allreduce), but train_on_batch
resets it at each call, and fit ends at the error.

The Allreduce averages, so a report travels as float32 numbers the average leaves
exact: each slot holds its rank's report and zeros from every other rank, so it comes
back divided by the number of ranks, and a whole number below 2**16 is recovered
exactly by multiplying back and rounding. Every int64 of the report (flag, site, id)
travels as four 16-bit pieces.

A forward pass outside the training step (called alone, under a tape) has no
Allreduce to report in: its kernels check the ids themselves, on this rank, as the
inference step's do (neither has a collective to leave waiting).
"""
import contextlib
import dataclasses
import functools
from typing import List

import tensorflow as tf

from picasso_tf.embedding.hybrid_hash import FetchedRowsLog
from picasso_tf.embedding.row_keys import first_invalid, flat_ids, invalid_id_message

_PIECE_BITS = 16
_PIECES = 64 // _PIECE_BITS
_FIELDS = 3                     # flag, site, id


@dataclasses.dataclass
class IdsReport:
    """One forward pass's report: flag (bool), site (int32), value (int64), as
    first_invalid gives them; features, limits: per site, its feature and its table's rows."""
    flag: tf.Tensor
    site: tf.Tensor
    value: tf.Tensor
    features: List[str]
    limits: List[int]


class InPlaceIdsCheck:
    """Stands in for the row exchange in the training forward pass when no group is
    exchanged (RewrittenForward's `fetch`): it fetches no rows, and checks the in-place
    sites' ids for the step's Allreduce (the module docstring)."""

    def __init__(self, world):
        self.world = world
        self.storages, self.log = [], FetchedRowsLog()    # no rows fetched, none to update
        self._reports = None    # while a training step is traced: its forward passes' reports
        self._checks = []       # and the checks of those taken

    @contextlib.contextmanager
    def reporting(self):
        """While active, the forward passes traced report their ids (take() gives them to
        the training step) instead of leaving the check to their kernels."""
        previous, self._reports, self._checks = (self._reports, self._checks), [], []
        try:
            yield
        finally:
            self._reports, self._checks = previous

    def checks(self):
        """The checks built so far in the reporting() block, for what must wait for them."""
        return list(self._checks)

    def fetch(self, requests, in_place=()):
        """RowExchange.fetch with no exchanged requests: ({}, the in-place sites' ids
        (in_place: [(feature, rows, ids tensor)]) the kernels read)."""
        assert not requests, "picasso_tf: exchanged ids reached the in-place check; please report this model"
        ids = [t for _, _, t in in_place]
        if self._reports is None:
            return {}, ids
        flag, site, value = first_invalid([rows for _, rows, _ in in_place], flat_ids(ids))
        self._reports.append(IdsReport(flag, site, value, [f for f, _, _ in in_place], [r for _, r, _ in in_place]))
        # Times one, or zero: one op per site (a tf.cond would run three).
        keep = {dtype: tf.cast(tf.logical_not(flag), dtype) for dtype in {t.dtype for t in ids}}
        return {}, [t * keep[t.dtype] for t in ids]

    def take(self):
        """The reports of the forward passes traced since the last take (in the current
        reporting() block)."""
        taken = self._reports or []
        if self._reports is not None:
            self._reports = []
        return taken

    def packed(self, reports):
        """This rank's part of the Allreduce: [size, 3 * 4] float32, zeros but for this
        rank's row, which holds the report of its first forward pass that has one (else
        zeros)."""
        flags = tf.stack([r.flag for r in reports])
        first = tf.argmax(tf.cast(flags, tf.int32), output_type=tf.int32)
        fields = tf.stack([tf.cast(tf.reduce_any(flags), tf.int64),
                           tf.cast(tf.gather(tf.stack([r.site for r in reports]), first), tf.int64),
                           tf.gather(tf.stack([r.value for r in reports]), first)])
        row = tf.cast(_pieces(fields), tf.float32)
        return tf.scatter_nd([[self.world.rank]], row[None], [self.world.size, _FIELDS * _PIECES])

    def refuse_reported(self, averaged, reports):
        """The op (after the Allreduce: `averaged`, the average of every rank's packed())
        that raises, alike on every rank, the error naming the first reporting rank's
        feature and id, when any rank reported one."""
        reported = averaged[:, 0] > 0       # a flag's lowest piece: 1 / size where set
        features, limits = reports[0].features, reports[0].limits   # every forward pass has the same sites

        def fail():
            sender = tf.argmax(tf.cast(reported, tf.int32), output_type=tf.int32)
            pieces = tf.cast(tf.round(tf.gather(averaged, sender) * self.world.size), tf.int64)
            _, site, value = tf.unstack(_joined(pieces))
            message = invalid_id_message(features, limits, tf.cast(site, tf.int32), value, rank=sender)
            with tf.control_dependencies([tf.debugging.Assert(False, message, summarize=1)]):
                return tf.constant(False)

        checked = tf.cond(tf.reduce_any(reported), fail, lambda: tf.constant(True))
        self._checks.append(checked)
        return checked


def _pieces(values):
    """int64 [n] as [n * 4] 16-bit pieces (lowest first), each in [0, 2**16)."""
    shifts = tf.constant([_PIECE_BITS * i for i in range(_PIECES)], tf.int64)
    mask = tf.constant((1 << _PIECE_BITS) - 1, tf.int64)
    return tf.reshape(tf.bitwise.bitwise_and(tf.bitwise.right_shift(values[:, None], shifts), mask), [-1])


def _joined(pieces):
    """The int64 values whose _pieces are `pieces`."""
    shifts = tf.constant([_PIECE_BITS * i for i in range(_PIECES)], tf.int64)
    shifted = tf.bitwise.left_shift(tf.reshape(pieces, [-1, _PIECES]), shifts)
    return functools.reduce(tf.bitwise.bitwise_or, tf.unstack(shifted, axis=1))
