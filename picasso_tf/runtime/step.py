"""The rewritten model at run time: its forward pass and a training step in stages.

Forward imports the rewritten GraphDef into the function being traced, with each
StorageRef placeholder fed its table group's storage. Gradients come from
tf.gradients (the tape does not see imported ops). Embedding tables (packed or not)
always receive row-sparse gradients (tf.IndexedSlices); a dense gradient for a table
is a bug and stops the trace instead of silently densifying the table.

The step's stages, in order (ARCHITECTURE.md §2):

  backward    the loss's gradients: row-sparse for the tables' storage, dense else
  accumulate  micro-batches' gradients summed into one step's (D-interleaving,
              picasso_tf.runtime.micro_batches; with one there is nothing to sum)
  exchange    collectives (Horovod: tables' row gradients to their owners over
              AllToAllv, dense gradients in one grouped Allreduce; one process: none)
  apply       fused row-sparse updates on the storage (a hash storage's fetched rows by
              its own ops), the Keras optimizer's update for the rest (fused into one op
              per dtype where it is exact, picasso_tf.runtime.dense_update)

When nothing stands between backward and apply (one process) the step may fuse
them: the stitched lookups' and projections' gradient kernels then update their
tables in place (config.apply_in_gradient). With micro-batches those kernels run once
per step too, on the micro-batches' gathered gradients (GatheredLookupUpdates).
"""
import dataclasses
from typing import List

import tensorflow as tf

from picasso_tf.distributed.world import World, hvd
from picasso_tf.graph.graph_def_util import split_off
from picasso_tf.graph.rebuild import conform_inputs, import_forward
from picasso_tf.ops.in_gradient import update_tables_in_gradient
from picasso_tf.passes.fetched_rows import in_place_sites
from picasso_tf.program import ExchangedIds, FetchedRows, StorageRef
from picasso_tf.runtime.dense_update import KerasDenseUpdate
from picasso_tf.runtime.fused_update import READS, InGradientUpdates, _captured_from


class RewrittenForward:
    """Calls a rewritten CapturedGraph on a batch of features; `storages` (group name
    -> EmbeddingStorage) feed its StorageRef placeholders. For the groups whose rows are
    fetched per step, `fetch` (the exchange of hybrid parallelism,
    picasso_tf.distributed.exchange.RowExchange, or the hash storage's HashRowFetch)
    feeds its FetchedRows and ExchangedIds placeholders: the graph's ids are computed
    first, the rows fetched, and then the rest of the graph runs. With check_in_place
    (under Horovod; `fetch` a RowExchange, or with no group exchanged an
    InPlaceIdsCheck) the ids of the tables the kernels read in place are computed first
    too, and reach the kernels once every rank has checked its own (exchange.py), or
    made harmless until the step's Allreduce has (distributed/reported_ids.py), so that
    an invalid one fails every rank alike."""

    def __init__(self, captured, storages, fetch=None, check_in_place=False):
        self.captured = captured
        self.captures = {name: storages[v.group].kernel_inputs()[v.member] if isinstance(v, StorageRef) else v
                         for name, v in captured.captures.items()
                         if not isinstance(v, (FetchedRows, ExchangedIds))}
        self.requests = {name: v for name, v in captured.captures.items() if isinstance(v, ExchangedIds)}
        self.fetched = {name: v for name, v in captured.captures.items() if isinstance(v, FetchedRows)}
        self.in_place = in_place_sites(captured.graph_def, self.requests) if check_in_place else []
        self.fetch = fetch if self.requests or self.in_place else None

    def __call__(self, inputs):
        c = self.captured
        outs, masks, logits = c.output_tensors, c.mask_tensors, c.logit_tensors
        names = outs + masks + logits + ([c.regularization_loss] if c.regularization_loss else [])
        inputs = conform_inputs(c.input_specs, inputs)
        captures = dict(self.captures)
        if self.fetch is not None:
            captures.update(self.fetch_rows(inputs))
        tensors = import_forward(c.graph_def, c.input_tensors, inputs, captures, names)
        flat_outputs = tensors[:len(outs)]
        mask_values = iter(tensors[len(outs):len(outs) + len(masks)])
        logit_values = iter(tensors[len(outs) + len(masks):len(outs) + len(masks) + len(logits)])
        for tensor, mask, logit in zip(flat_outputs, c.output_masks, c.output_logits):
            if mask:
                tensor._keras_mask = next(mask_values)  # Keras weights the loss by an output's mask
            if logit:
                tensor._keras_logits = next(logit_values)  # and computes crossentropy from these logits
        outputs = tf.nest.pack_sequence_as(c.output_structure, flat_outputs)
        reg = tensors[-1] if c.regularization_loss else None
        return outputs, reg

    def fetch_rows(self, inputs):
        """What the FetchedRows and ExchangedIds placeholders take: the part of the graph computing the ids
        runs first (its results then feed the whole graph's copy of it), the rows are
        fetched, and each site's ids become positions in its group's rows; and the
        in-place sites' ids, once checked, in place of theirs."""
        c = self.captured
        ids = sorted({v.ids for v in self.requests.values()} | {t for t, _, _ in self.in_place})
        prefix, consumed = split_off(c.graph_def, ids)
        present = {n.name for n in prefix.node}
        fed = [(t, x) for t, x in zip(c.input_tensors, inputs) if t.split(":")[0] in present]
        captures = {k: v for k, v in self.captures.items() if k.split(":")[0] in present}
        values = import_forward(prefix, [t for t, _ in fed], [x for _, x in fed], captures, ids + consumed,
                                name="picasso_ids")
        by_name = dict(zip(ids + consumed, values))
        names = list(self.requests)
        requests = [(self.requests[n], by_name[self.requests[n].ids]) for n in names]
        in_place = [(feature, rows, by_name[t]) for t, feature, rows in self.in_place]
        # Only a RowExchange or an InPlaceIdsCheck checks in-place ids (check_in_place).
        rows, positions = self.fetch.fetch(requests, in_place) if in_place else self.fetch.fetch(requests)
        names += [t for t, _, _ in self.in_place]
        return {**{t: by_name[t] for t in consumed}, **dict(zip(names, positions)),
                **{name: rows[v.group] for name, v in self.fetched.items()}}

    @property
    def variables(self):
        captured = [v for v in self.captures.values() if isinstance(v, tf.Variable)]
        return captured + ([v for s in self.fetch.storages for v in s.variables()] if self.fetch else [])


class GatheredLookupUpdates(InGradientUpdates):
    """InGradientUpdates for the gradient kernels of fused lookups over the whole batch,
    each built from the inputs of the micro-batches' copies of one lookup (runtime/
    micro_batches.py). `readers`: per lookup, its copies and its whole-batch op. A
    kernel may update a table that only the copies of its own lookup read (and its
    whole-batch op, never run): the copies run before it, as in a step without
    micro-batches the lookup runs before its gradient."""

    def __init__(self, fused, iteration, readers):
        super().__init__(fused, iteration)
        self.lookup_of = {op.name: i for i, ops in enumerate(readers) for op in ops}

    def _variable(self, value):
        """The fused table variable read as `value` whose every read feeds the copies of
        one lookup only, else None."""
        if value.op.type not in READS:
            return None
        handle = value.op.inputs[value.value_index]
        lookups = set()
        for read in handle.consumers():
            if read.type not in READS:
                return None
            lookups |= {self.lookup_of.get(use.name) for i, h in enumerate(read.inputs) if h is handle
                        for use in read.outputs[i].consumers()}
        if len(lookups) != 1 or None in lookups:
            return None
        outside = _captured_from(handle)
        return next((ref.deref() for ref in self.fused.tables if ref.deref().handle is outside), None)


@dataclasses.dataclass
class Gradients:
    """One step's gradients: the storages' (for the fused update), the rest (for the
    Keras optimizer), the hash storages' (storage, distinct keys, their summed row
    gradients), the tables a gradient kernel already updated, and the checks the
    updates wait for (the ranks' ids, reported in the Allreduce)."""
    tables: List[tuple]
    dense: List[tuple]
    fetched: List[tuple] = dataclasses.field(default_factory=list)
    updated_in_gradient: List[tf.Variable] = dataclasses.field(default_factory=list)
    update_ops: List[tf.Operation] = dataclasses.field(default_factory=list)
    checks: List[tf.Tensor] = dataclasses.field(default_factory=list)


class TrainingStep:
    """The gradient half of a training step, in the stages of the module docstring.

    trainable: the variables the forward pass reads that train; table_variables: every
    embedding table (original or storage) whose gradient must stay row-sparse, except
    those in densely_read (the model reads them whole, so their gradient is dense in the
    original model too, and goes to the dense update: one pass over the table, where the
    row-sparse kernels would walk every row by index); fused: the FusedTableUpdate of the storages, or None;
    fetched_rows: FetchedRowsLog.take of the forward pass's fetch (picasso_tf.embedding.
    hybrid_hash): the hash storages' rows fetched by the forward pass being traced,
    whose gradients update them; dense_update: the update of the other variables, which
    advances optimizer.iterations (picasso_tf.runtime.dense_update); loss_scale: a Keras
    LossScaleOptimizer (mixed precision), which scales the loss before backward and
    unscales the gradients after, as Keras does for it, or None; ids_check: the
    training forward pass's InPlaceIdsCheck (picasso_tf.distributed.reported_ids), whose
    reports join the gradients' Allreduce, or None."""

    def __init__(self, trainable, table_variables, fused=None, densely_read=(), world=World(), sharded=(),
                 fetched_rows=lambda: [], dense_update=KerasDenseUpdate(), loss_scale=None, ids_check=None):
        self.trainable = list(trainable)
        self.densely_read = {v.ref() for v in densely_read}
        self.tables = {v.ref() for v in table_variables} - self.densely_read
        self.fused = fused
        self.world = world
        self.sharded = {v.ref() for v in sharded}   # shard variables: their gradients reach their owner
        self.fetched_rows = fetched_rows
        self.dense_update = dense_update
        self.loss_scale = loss_scale
        self.ids_check = ids_check

    def run(self, optimizer, loss):
        """Adds the step's updates; returns the tables updated inside their gradient kernels."""
        gradients = self.backward(loss, optimizer.iterations, self.in_gradient_updates(optimizer.iterations))
        gradients = self.exchange(self.accumulate([gradients]))
        self.apply(optimizer, gradients)
        return gradients.updated_in_gradient

    def in_gradient_updates(self, iteration, kind=InGradientUpdates, **options):
        """A `kind` of InGradientUpdates for backward, or None where the gradient kernels
        may not update their tables: no fused updates, apply_in_gradient=False, or across
        ranks (a gradient must be summed there before it is applied)."""
        if self.fused is None or not self.fused.in_gradient or self.world.distributed:
            return None
        return kind(self.fused, iteration, **options)

    def backward(self, loss, iteration, in_gradient=None):
        """The Gradients of loss; inside in_gradient (an InGradientUpdates) the gradient
        kernels may update their tables."""
        return self.backward_to(loss, iteration, (), in_gradient)[0]

    def backward_to(self, loss, iteration, tensors, in_gradient=None):
        """(The Gradients of loss, its gradients with respect to `tensors`, None where it
        has none), the gradient stopping at `tensors`. Under loss scaling the latter stay
        scaled: they are the upstream gradients of a later backward (runtime/
        micro_batches.py), whose unscaling covers them; unscaled here, float16 ones could
        underflow."""
        tensors = list(tensors)
        fetched = self.fetched_rows()
        if self.loss_scale is not None:
            loss = self.loss_scale.get_scaled_loss(loss)    # so that float16 gradients do not underflow
        sources = self.trainable + [rows for _, _, rows in fetched] + tensors
        with update_tables_in_gradient(in_gradient, sources):
            grads = tf.gradients(loss, sources, stop_gradients=tensors)
        grads, at_tensors = grads[:len(grads) - len(tensors)], grads[len(grads) - len(tensors):]
        at_tensors = [None if g is None else tf.convert_to_tensor(g) for g in at_tensors]
        if self.loss_scale is not None:
            grads = self.loss_scale.get_unscaled_gradients(grads)
        grads, fetched_grads = grads[:len(self.trainable)], grads[len(self.trainable):]
        pairs = []
        for var, grad in zip(self.trainable, grads):
            if var.ref() in self.tables and grad is not None and not isinstance(grad, tf.IndexedSlices):
                raise AssertionError(f"picasso_tf: the gradient of embedding table {var.name} became dense "
                                     f"({grad.op.type}); please report this model")
            if grad is not None:
                pairs.append((grad, var))
        fetched = [(storage, keys, _per_key(g, rows)) for (storage, keys, rows), g in zip(fetched, fetched_grads)]
        return dataclasses.replace(self.split(pairs), fetched=fetched,
                                   updated_in_gradient=in_gradient.variables if in_gradient else [],
                                   update_ops=in_gradient.ops if in_gradient else []), at_tensors

    def split(self, grads_and_vars):
        """Gradients from a custom loop's (gradient, variable) pairs: the fused update's
        tables apart from the rest."""
        return Gradients(tables=[(g, v) for g, v in grads_and_vars if self._row_sparse(v)],
                         dense=[(g, v) for g, v in grads_and_vars if not self._row_sparse(v)])

    def _row_sparse(self, var):
        """Whether the fused row-sparse updates apply var's gradient (else the dense update).
        Decided per variable: a densely read table's gradient may come in parts (its
        lookups' rows per micro-batch, its regulariser's once), summed before the update."""
        return self.fused is not None and self.fused.handles(var) and var.ref() not in self.densely_read

    def accumulate(self, micro_batches):
        """One step's Gradients from the micro-batches': summed per variable, a table's
        row gradients summed per row (the fused updates take each row once)."""
        if len(micro_batches) == 1:
            return micro_batches[0]
        if any(g.fetched for g in micro_batches):
            # Each micro-batch's fetch would update its rows apart (the hybrid_hash pass refuses this).
            raise AssertionError("picasso_tf: micro-batches over hash storage; please report this model")
        return Gradients(tables=_sum_per_variable([g.tables for g in micro_batches]),
                         dense=_sum_per_variable([g.dense for g in micro_batches]),
                         updated_in_gradient=[v for g in micro_batches for v in g.updated_in_gradient],
                         update_ops=[op for g in micro_batches for op in g.update_ops])

    def exchange(self, gradients):
        """Across ranks: a shard's row gradients (and a hash storage's fetched rows'),
        which the exchange's reverse AllToAllv already summed on their owner, become the
        mean over the ranks' batches; every other gradient is averaged over the ranks in
        one grouped Allreduce (dense: a replicated table's IndexedSlices become its dense
        gradient, never an allgather; so does a densely read table's sum of rows and
        regulariser, which the fused dense update adds itself in one process), beside the
        forward passes' ids reports, whose check the updates wait for."""
        if not self.world.distributed:
            return gradients
        scale = 1.0 / self.world.size
        tables = [(tf.IndexedSlices(g.values * scale, g.indices, g.dense_shape), v)
                  for g, v in gradients.tables if v.ref() in self.sharded]
        fetched = [(storage, keys, g * scale) for storage, keys, g in gradients.fetched]
        summed = [(g, v) for g, v in gradients.tables + gradients.dense if v.ref() not in self.sharded]
        reports = self.ids_check.take() if self.ids_check is not None else []
        reduced = [tf.convert_to_tensor(g) for g, _ in summed] + ([self.ids_check.packed(reports)] if reports else [])
        checks = []
        if reduced:
            averaged = list(hvd().grouped_allreduce(reduced, op=hvd().Average, name="picasso_dense_gradients"))
            if reports:
                checks.append(self.ids_check.refuse_reported(averaged.pop(), reports))
            summed = [(g, v) for g, (_, v) in zip(averaged, summed)]
        return dataclasses.replace(gradients, tables=tables + [(g, v) for g, v in summed if self._row_sparse(v)],
                                   dense=[(g, v) for g, v in summed if not self._row_sparse(v)], fetched=fetched,
                                   checks=gradients.checks + checks)

    def apply(self, optimizer, gradients):
        # No variable changes before the checks pass (the iteration count included).
        with tf.control_dependencies(gradients.checks):
            self._apply(optimizer, gradients)

    def _apply(self, optimizer, gradients):
        if self.fused is None:
            self.dense_update.apply(optimizer, gradients.tables + gradients.dense)
            return
        # The fused updates read optimizer.iterations before Keras increments it, so both
        # halves of the step use the same step count.
        update = tf.group([self.fused.apply(gradients.tables, optimizer.iterations)] + gradients.update_ops +
                          [storage.apply_fetched(keys, grads, optimizer.iterations)
                           for storage, keys, grads in gradients.fetched])
        with tf.control_dependencies([update]):
            # As Keras does after its update: a variable's constraint (e.g. MaxNorm rows).
            updated = [v for _, v in gradients.tables] + gradients.updated_in_gradient
            update = tf.group([v.assign(v.constraint(v)) for v in updated if v.constraint is not None] + [update])
        with tf.control_dependencies([update]):
            self.dense_update.apply(optimizer, gradients.dense)


def _sum_per_variable(grads_and_vars_lists):
    """[(sum of the variable's gradients, variable)] in order of first appearance."""
    grads, variables = {}, {}
    for grads_and_vars in grads_and_vars_lists:
        for grad, var in grads_and_vars:
            grads.setdefault(var.ref(), []).append(grad)
            variables[var.ref()] = var
    return [(_sum(grads[ref]), variables[ref]) for ref in grads]


def _sum(grads):
    if len(grads) == 1:
        return grads[0]
    if all(isinstance(g, tf.IndexedSlices) for g in grads):
        rows, position = tf.unique(tf.concat([tf.cast(g.indices, tf.int64) for g in grads], 0))
        values = tf.math.unsorted_segment_sum(tf.concat([g.values for g in grads], 0), position, tf.size(rows))
        return tf.IndexedSlices(values, rows, grads[0].dense_shape)
    return tf.add_n([tf.convert_to_tensor(g) for g in grads])


def _per_key(grad, rows):
    """The gradient of fetched rows (one per key) as one summed row per key; zeros for
    rows the loss does not reach."""
    if grad is None:
        return tf.zeros_like(rows)
    if isinstance(grad, tf.IndexedSlices):
        return tf.math.unsorted_segment_sum(grad.values, grad.indices, tf.shape(rows)[0])
    return grad
