"""D-interleaving (paper §III-C, Fig. 8): one training step over K micro-batches.

The batch is split along its first axis into K micro-batches whose sizes differ by at
most one (a batch smaller than K leaves some empty). Each runs the rewritten forward
pass and its own backward; TrainingStep.accumulate sums the K gradients (row-sparse
ones per id, for lookups left unfused) and they are applied once. Each micro-batch's
mean loss is weighted by its share of the batch, so the step equals the whole batch's
up to summation order.

Micro-batch i's inputs wait for micro-batch i-2's gradients: two micro-batches run at
a time, TensorFlow's inter-op threads running their ops as they become ready (one's
lookups beside the other's dense part, forward or backward), and at most two
micro-batches' activations are alive at once instead of the whole batch's. (Waiting
for micro-batch i-1's loss too, a strict pipeline, measured slower: each forward pass
then ran alone.) micro_batches="auto", which picks K for memory, runs them one at a
time instead (micro-batch i+1 waits for micro-batch i's gradients): one micro-batch's
activations alive, no overlap (benchmarks/micro_batch_memory.py measures the peak).
So does a step under Horovod that exchanges rows: there each micro-batch's forward
begins with a collective (its ids' AllToAllv, which checks them on every rank), and a
step that one refuses must leave no earlier micro-batch's collective (its row
gradients' reverse AllToAllv) submitted on one rank and cancelled on another. (A step
that exchanges none has one collective, after the micro-batches.)

What the forward pass computes from the dense weights alone (dense packing's stacked
kernels) runs once per step, before the micro-batches, which read its values
(BatchInvariants); their backwards stop there, and its own backward runs once, on the
values' summed gradients.

From the embedding layer (Fig. 8b, the default; LookupCopies) each micro-batch runs
the whole model, its own copy of the fused lookups included, and its backward stops
at their outputs. From the MLP (Fig. 8a, EmbeddingCut) the fused lookups and the
pooling of their outputs run once on the whole batch and the micro-batches share the
pooled embeddings. Either way the fused lookups' backward runs once per step, from
their outputs' gradients gathered from the micro-batches: a table's row gradients
need no summing across micro-batches, and a gradient kernel may update its tables in
place as in a step without micro-batches. A stitched lookup's dense inputs (MMoE's
pooled sequences, stitched beside its one-hot embeddings) take their gradients, their
columns of its output's, back in each micro-batch, to the lookup they were pooled from,
whose gathered gradient they join. The price is the whole batch of those
gradients, held until the last micro-batch's backward: from the embedding,
micro_batches="auto" (K chosen to fit a memory budget) does not pay it, and each
micro-batch keeps its lookups' backward. So does a lookup reading rows fetched per
step (hybrid parallelism): from the embedding each micro-batch fetches its own rows,
and its backward returns their gradients to their owners; from the MLP the embedding
part fetches the whole batch's once.
"""
import copy

import tensorflow as tf

from picasso_tf.errors import UnsupportedModelError
from picasso_tf.graph.cut import cut_tensors, dense_part, embedding_part
from picasso_tf.graph.graph_def_util import split_tensor_name
from picasso_tf.graph.invariants import batch_invariant
from picasso_tf.graph.rebuild import conform_inputs, import_forward
from picasso_tf.ops.stitched_lookup import dense_gradients
from picasso_tf.runtime.step import GatheredLookupUpdates

# Keras losses whose value is a mean over the batch's elements: a micro-batch's mean,
# weighted by its share of the batch, sums to the batch's.
MEAN_REDUCTIONS = ("auto", "sum_over_batch_size")
# The fused lookups' op types (picasso_tf.ops), whose inputs whole_batch_lookup joins.
LOOKUP_OPS = ("PicassoPackedLookup", "PicassoStitchedLookup", "PicassoStitchedProjection")


def run_micro_batches(step, optimizer, forward_and_loss, data, k, forward, cut=None, one_at_a_time=False):
    """Trains one step of `step` (a TrainingStep) over k micro-batches of `data`
    ((x, y, sample_weight)); forward_and_loss(x, y, sample_weight, forward) gives a
    micro-batch's (predictions, mean loss) from `forward` (a RewrittenForward: the
    model's, or the dense part's), whose batch-invariant part runs once (BatchInvariants).
    `cut` (embedding_cut's): with an EmbeddingCut
    (interleave_from="mlp") the fused lookups run once on the whole batch and only the
    rest per micro-batch; with LookupCopies each micro-batch runs its own copy of them,
    and the backward of those LookupCopies.find gathers runs once. one_at_a_time:
    micro-batch i waits for micro-batch i-1's gradients, not only i-2's. Returns the
    whole batch's predictions."""
    parts, shares, bounds = split_batch(data, k)
    mlp = isinstance(cut, EmbeddingCut)
    embeddings = cut.embed(data[0]) if mlp else []
    sizes = tf.stack([e - b for b, e in bounds])
    cut_parts = [_parts(e, bounds, sizes) for e in embeddings]
    gradients, done, predictions, gathered_grads, copies, invariant_grads = [], [], [], [], [], []
    invariants = None
    graph = tf.compat.v1.get_default_graph()
    for i, ((x, y, sample_weight), share) in enumerate(zip(parts, shares)):
        ready = done[-1] if one_at_a_time and i else done[-2] if i >= 2 else []
        rows = [parts[i] for parts in cut_parts]
        with tf.control_dependencies(ready), tf.name_scope(f"picasso_micro_batch_{i}"):
            x = tf.nest.map_structure(_identity, x)
            # Stopped past the split: the split's gradient (a whole batch of zeros but
            # the micro-batch's rows) is not built only to be dropped.
            rows = [tf.stop_gradient(r) for r in rows]
        micro_batch_forward = cut.dense(rows) if mlp else forward
        if invariants is None:
            invariants = BatchInvariants(micro_batch_forward, step)
        first = len(graph.get_operations())
        y_pred, loss = forward_and_loss(x, y, sample_weight, forward=invariants.fed(micro_batch_forward))
        _refuse_masked(y_pred, k)
        if isinstance(cut, LookupCopies):
            copies.append(cut.find(graph.get_operations()[first:]))
            rows = [t for op in copies[-1] for t in op.outputs]
        grads, rows_grads = step.backward_to(loss * tf.cast(share, loss.dtype), optimizer.iterations,
                                             rows + invariants.values)
        rows_grads, at_invariants = rows_grads[:len(rows)], rows_grads[len(rows):]
        invariant_grads.append(at_invariants)
        mine = len(gradients)
        gradients.append(grads)
        if copies and copies[-1]:
            # Past the copies' outputs: their dense inputs (a pooled sequence stitched in).
            gradients.extend(_dense_inputs_backward(step, optimizer.iterations, copies[-1], rows_grads))
        rows_grads = [tf.zeros_like(t) if g is None else g for g, t in zip(rows_grads, rows)]
        done.append([t for g in gradients[mine:] for t in _computed(g)] + rows_grads +
                    [g for g in at_invariants if g is not None])
        gathered_grads.append(rows_grads)
        predictions.append(y_pred)
    if mlp:
        gathered = [tf.concat(list(parts), 0) for parts in zip(*gathered_grads)]
        gradients.append(_gathered_backward(step, optimizer.iterations, embeddings, gathered,
                                            step.in_gradient_updates(optimizer.iterations)))
    elif any(copies):
        gradients.append(_lookups_backward(step, optimizer.iterations, copies, gathered_grads))
    gradients.extend(invariants.backward(step, optimizer.iterations, invariant_grads))
    step.apply(optimizer, step.exchange(step.accumulate(gradients)))
    return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *predictions)


def _dense_inputs_backward(step, iteration, copies, rows_grads):
    """The backward of a micro-batch's gathered `copies` past their dense inputs (a
    stitched lookup's tensors copied into its columns): their columns of the copy's
    output gradient, in `rows_grads` (one per output of `copies`, None where it has
    none), back to the other copies' outputs, whose entries in rows_grads it adds to,
    and to the trainable variables on the way (a dense layer between). A lookup read
    there but not gathered (an unpooled sequence) is differentiated here, and if other
    ops read it too, in the micro-batch's own backward as well: the two are summed.
    The whole-batch op takes its dense inputs with their gradient stopped
    (whole_batch_lookup): through them it would reach each micro-batch's copies of the
    lookups they read, differentiating those in each micro-batch again. Returns the
    micro-batch's Gradients of these backwards."""
    outputs = [t for op in copies for t in op.outputs]
    position = {id(t): i for i, t in enumerate(outputs)}
    gradients = []
    for op in reversed(copies):     # readers first: copies are in the order they were made
        upstream = rows_grads[position[id(op.outputs[0])]]
        if op.type != "PicassoStitchedLookup" or upstream is None:
            continue
        terms = [_with_gradient(x, g) for x, g in zip(_inputs_by_arg(op)["dense"], dense_gradients(op, upstream))
                 if x.dtype.is_floating]
        if not terms:
            continue
        grads, more = step.backward_to(tf.add_n(terms), iteration, outputs)
        gradients.append(grads)
        for i, g in enumerate(more):
            if g is not None:
                rows_grads[i] = g if rows_grads[i] is None else rows_grads[i] + g
    return gradients


def _lookups_backward(step, iteration, copies, micro_batch_grads):
    """From the embedding layer: the fused lookups' backward once over the whole batch.
    Per fused lookup, an op of its kind on the joined inputs of its micro-batch copies
    (whole_batch_lookup) takes their outputs' gathered gradients: its gradient kernel
    sums each table's rows over the whole batch, as without micro-batches, so no table
    gradient is summed across micro-batches, and the kernel may update its tables in
    place (config.apply_in_gradient) once every copy has read them."""
    per_lookup = list(zip(*copies))
    wholes = [whole_batch_lookup(ops) for ops in per_lookup]
    # The kernels' in-place updates follow every copy's read of the tables.
    with tf.control_dependencies([op for ops in per_lookup for op in ops]):
        gathered = [tf.concat(list(parts), 0) for parts in zip(*micro_batch_grads)]
    in_gradient = step.in_gradient_updates(iteration, GatheredLookupUpdates,
                                           readers=[ops + (whole,) for ops, whole in zip(per_lookup, wholes)])
    return _gathered_backward(step, iteration, [t for whole in wholes for t in whole.outputs], gathered, in_gradient)


def _gathered_backward(step, iteration, tensors, gathered, in_gradient):
    """step.backward from the whole batch's `tensors` (the cut's, or the whole-batch
    lookups' outputs) with their `gathered` gradients: each tensor enters the loss
    through a term whose gradient is the gathered one, so the ops computing it take that
    as their outputs' gradient. A whole-batch lookup's forward never runs: nothing reads
    its outputs' values."""
    terms = [_with_gradient(t, g) for t, g in zip(tensors, gathered) if t.dtype.is_floating]
    return step.backward(tf.add_n(terms), iteration, in_gradient)


def _with_gradient(tensor, gradient):
    """A scalar zero whose gradient with respect to `tensor` is `gradient`, added
    unscaled into the loss tf.gradients starts from (its upstream gradient is one).
    Not sum(tensor * gradient): that product, the sum's broadcast gradient and their
    product each hold another whole batch of the cut tensor."""
    @tf.custom_gradient
    def term(t):
        return tf.zeros([], tf.float32), lambda upstream: gradient
    return term(tensor)


class BatchInvariants:
    """The part of a micro-batch's forward graph that reads dense variables and no batch
    (graph/invariants.py: dense packing's stacked kernels), computed once per step:
    each micro-batch reads its `values`, and its backward stops at them; their
    gradients, summed over the micro-batches, go through that part once."""

    def __init__(self, forward, step):
        c = forward.captured
        variables = [name for name, value in c.captures.items()
                     if isinstance(value, tf.Variable) and value.ref() not in step.tables]
        needed = c.output_tensors + c.mask_tensors + c.logit_tensors + (
            [c.regularization_loss] if c.regularization_loss else [])
        tensors, graph_def = batch_invariant(c.graph_def, variables, needed)
        values = import_forward(graph_def, [], [], _present(graph_def, forward.captures), tensors,
                                name="picasso_invariants") if tensors else []
        # Numbers only: a gradient through another kind of value (a TensorList) is not summed here.
        numeric = [i for i, v in enumerate(values) if v.dtype.is_floating or v.dtype.is_integer]
        self.tensors, self.values = [tensors[i] for i in numeric], [values[i] for i in numeric]

    def fed(self, forward):
        """`forward` reading the values instead of computing them."""
        if not self.tensors:
            return forward
        fed = copy.copy(forward)
        fed.captures = {**forward.captures, **dict(zip(self.tensors, self.values))}
        return fed

    def backward(self, step, iteration, micro_batch_grads):
        """[the Gradients of the invariant part], from the values' gradients in each
        micro-batch (None where it has none)."""
        summed = [[g for g in grads if g is not None] for grads in zip(*micro_batch_grads)]
        terms = [_with_gradient(v, tf.add_n(grads)) for v, grads in zip(self.values, summed)
                 if grads and v.dtype.is_floating]
        return [step.backward(tf.add_n(terms), iteration)] if terms else []


def whole_batch_lookup(ops):
    """An op of the type and attributes of `ops` (one fused lookup's copies in the
    micro-batches, picasso_tf.ops) on their inputs joined: per site the ids, weights
    and dense inputs concatenated, segment ids shifted past the previous copies'
    segments, their counts summed; the tables and a projection's kernel the first
    copy's. Its outputs are the copies' concatenated, and its gradient the sum of
    theirs."""
    args = [_inputs_by_arg(op) for op in ops]
    first = args[0]
    joined = {}
    for name in first:
        if name in ("tables", "kernel"):
            joined[name] = first[name]
        elif name in ("ids", "weights"):
            joined[name] = [_joined(site) for site in zip(*(a[name] for a in args))]
        elif name == "dense":      # their gradients are the micro-batches' (_dense_inputs_backward)
            joined[name] = [tf.stop_gradient(_joined(site)) for site in zip(*(a[name] for a in args))]
        elif name == "num_segments":
            joined[name] = [tf.add_n(list(site)) for site in zip(*(a[name] for a in args))]
        elif name == "segment_ids":
            joined[name] = []
            for site, counts in zip(zip(*(a[name] for a in args)), zip(*(a["num_segments"] for a in args))):
                shifts = tf.cumsum(tf.stack(counts), exclusive=True)
                joined[name].append(tf.concat([s + shifts[c] for c, s in enumerate(site)], 0))
        else:
            raise AssertionError(f"picasso_tf: micro-batches do not know how to join the input {name!r} of "
                                 f"{ops[0].type}; please report this model")
    return tf.compat.v1.get_default_graph().create_op(
        ops[0].type, [t for name in first for t in joined[name]], [t.dtype for t in ops[0].outputs],
        name="picasso_whole_batch/" + ops[0].name.rsplit("/", 1)[-1], attrs=dict(ops[0].node_def.attr))


def _joined(parts):
    """`parts` (a tensor per micro-batch) concatenated. Where they are the micro-batches'
    parts of one tensor in order (a feature read as it was fed: split_batch's split),
    that tensor: concatenating them again would copy the whole batch of ids for nothing.
    It is read past the micro-batches' gates (control dependencies, a collective's ids
    check): the op's gradient runs after every copy all the same (_lookups_backward)."""
    sources = [_split_output(t) for t in parts]
    split = sources[0][0] if sources[0] else None
    if split is not None and len(split.outputs) == len(parts) and sources == [(split, i) for i in range(len(parts))]:
        return split.inputs[0]
    return tf.concat(list(parts), 0)


def _split_output(tensor):
    """(the SplitV along the first axis, which of its outputs) that `tensor` is, past
    Identity ops; None if it is not one."""
    while tensor.op.type == "Identity":
        tensor = tensor.op.inputs[0]
    op = tensor.op
    if op.type != "SplitV" or tf.get_static_value(op.inputs[2]) != 0:
        return None
    return op, tensor.value_index


def _inputs_by_arg(op):
    """{input argument name: its tensors} of `op`, in its op definition's order."""
    flat, args = list(op.inputs), {}
    for arg in op.op_def.input_arg:
        count = (op.get_attr(arg.number_attr) if arg.number_attr
                 else len(op.get_attr(arg.type_list_attr)) if arg.type_list_attr else 1)
        args[arg.name], flat = flat[:count], flat[count:]
    return args


class LookupCopies:
    """interleave_from="embedding" (paper Fig. 8b): each micro-batch runs the whole
    rewritten forward pass, its own copy of the fused lookups named in `lookup_nodes`
    included; run_micro_batches stops each micro-batch's backward at the outputs of the
    copies find() gives and runs those lookups' backward once (_lookups_backward)."""

    def __init__(self, lookup_nodes, gather=True):
        self.nodes = list(lookup_nodes)
        self.gathered = None if gather else []

    def find(self, operations):
        """The copies among `operations` (one micro-batch's import of the forward pass)
        of the fused lookups whose backward is gathered, in the order of lookup_nodes."""
        by_node = {node: [op for op in operations if op.type in LOOKUP_OPS and op.name.endswith("/" + node)]
                   for node in self.nodes}
        missing = [node for node, found in by_node.items() if len(found) != 1]
        if missing:
            raise AssertionError(f"picasso_tf: a micro-batch's forward pass has not one copy of the fused "
                                 f"lookups {missing}; please report this model")
        copies = {node: found[0] for node, found in by_node.items()}
        if self.gathered is None:
            self.gathered = _gathered(copies, operations)
        return tuple(copies[node] for node in self.gathered)


def _gathered(copies, operations):
    """The nodes of `copies` ({node: its copy in one micro-batch}) whose backward can be
    gathered, in the order their copies were made (a lookup before those reading it).
    Not: unpooled sequences, exchanged rows, or an op whose inputs but its tables and
    dense inputs come from another lookup: gathered, its input gradient would reach the
    other lookups' copies past their gathered gradients."""
    within, others = set(operations), set(copies.values())
    gathered = [node for node, op in copies.items() if _one_row_per_example(op) and not _exchanged(op)
                and not _reads_lookups(op, others - {op}, within)]
    made = {id(op): i for i, op in enumerate(operations) if op.type in LOOKUP_OPS}
    return sorted(gathered, key=lambda node: made[id(copies[node])])


def _exchanged(op):
    """Whether the lookup `op` reads rows its micro-batch fetched (hybrid parallelism,
    passes/fetched_rows.py): each copy reads other rows, so no one op can take the
    copies' joined inputs, and each micro-batch differentiates its own copy, the row
    gradients going back to their owners in its reverse AllToAllv."""
    return "exchanged" in op.node_def.attr and op.get_attr("exchanged")


def _one_row_per_example(op):
    """Whether each output of the lookup `op` has one row per example (one-hot or pooled
    sites, a projection). An unpooled sequence's gradient ([batch, L, D]) gathered over
    the whole batch costs more to copy and hold than its micro-batches' row gradients
    cost to sum (MMoE's behaviour sequences, benchmarks/interleaving_sweep.txt)."""
    if op.type == "PicassoStitchedProjection":
        return True
    if op.type == "PicassoStitchedLookup":
        return all(blocks == 1 for blocks in op.get_attr("row_blocks"))
    return all(t.shape.rank is not None and t.shape.rank <= 2 for t in op.outputs)


def _reads_lookups(op, lookups, within):
    """Whether a differentiable input of `op` other than its tables and dense inputs is
    computed, among the ops `within`, from one of `lookups`."""
    todo = [t.op for name, tensors in _inputs_by_arg(op).items() if name not in ("tables", "dense")
            for t in tensors if t.dtype.is_floating]
    seen = set()
    while todo:
        source = todo.pop()
        if source in lookups:
            return True
        if source.name not in seen and source in within:
            seen.add(source.name)
            todo.extend(t.op for t in source.inputs)
    return False


class EmbeddingCut:
    """interleave_from="mlp" (paper Fig. 8a): the rewritten forward pass (a
    RewrittenForward) cut where the embedding layer of the fused lookups named in
    `lookup_nodes` ends, their pooling included (graph/cut.py): the embedding part runs
    on the whole batch, the dense part on each micro-batch with its rows of the cut
    tensors."""

    def __init__(self, forward, lookup_nodes):
        self.forward = forward
        captured = forward.captured
        needed = captured.output_tensors + captured.mask_tensors + captured.logit_tensors + (
            [captured.regularization_loss] if captured.regularization_loss else [])
        self.tensors = cut_tensors(captured.graph_def, lookup_nodes, captured.input_tensors, needed)
        self.embedding_graph = embedding_part(captured.graph_def, self.tensors, keep=captured.input_tensors)
        self.dense_graph = None

    def embed(self, features):
        """The cut tensors' values on the whole batch (its rows fetched once, under
        hybrid parallelism)."""
        c = self.forward.captured
        features = conform_inputs(c.input_specs, features)
        captures = dict(self.forward.captures)
        if self.forward.fetch is not None:
            captures.update(self.forward.fetch_rows(features))
        return import_forward(self.embedding_graph, c.input_tensors, features,
                              _present(self.embedding_graph, captures), self.tensors, name="picasso_embedding")

    def dense(self, rows):
        """A RewrittenForward of the dense part, with `rows` (a micro-batch's rows of the
        cut tensors) fed in."""
        if self.dense_graph is None:
            self.dense_graph, self.placeholders = dense_part(self.forward.captured, self.tensors, rows)
        forward = copy.copy(self.forward)
        forward.captured = self.dense_graph
        forward.fetch = None        # the embedding part fetched the whole batch's rows
        forward.captures = _present(self.dense_graph.graph_def, {**self.forward.captures,
                                                                 **dict(zip(self.placeholders, rows))})
        return forward


def embedding_cut(forward, program, config):
    """Where run_micro_batches splits the fused lookups off: the EmbeddingCut of
    interleave_from="mlp", LookupCopies from the embedding; None with no fused lookups
    (every lookup then runs and differentiates in each micro-batch)."""
    nodes = [r.node for r in program.lookups.get("training", [])]
    if not nodes:
        return None
    if config.interleave_from == "mlp":
        return EmbeddingCut(forward, nodes)
    return LookupCopies(nodes, gather=config.micro_batches != "auto")


def _present(graph_def, captures):
    """The entries of captures whose placeholder graph_def still has."""
    names = {n.name for n in graph_def.node}
    return {t: v for t, v in captures.items() if split_tensor_name(t)[0] in names}


def split_batch(structure, k):
    """([structure's rows of micro-batch i], [its share of the batch], [its (begin, end)
    rows]) for i < k."""
    rows = _batch_size(next(t for t in tf.nest.flatten(structure) if t is not None))
    bounds = [(rows * i) // k for i in range(k + 1)]
    bounds = list(zip(bounds[:-1], bounds[1:]))
    sizes = tf.stack([e - b for b, e in bounds])
    flat = [_parts(t, bounds, sizes) for t in tf.nest.flatten(structure)]
    parts = [tf.nest.pack_sequence_as(structure, [p[i] for p in flat]) for i in range(k)]
    total = tf.cast(tf.maximum(rows, 1), tf.float64)
    shares = [tf.cast(e - b, tf.float64) / total for b, e in bounds]
    return parts, shares, bounds


def check_losses(compiled_loss, k):
    """Refuses losses that are not means over the batch (their micro-batch parts would
    not sum to the batch's)."""
    refusal = loss_refusal(compiled_loss)
    if refusal:
        raise ValueError(
            f"picasso_tf: micro_batches={k} splits the batch, and {refusal}, so its micro-batch parts would not "
            "add up to the batch's loss. Use a mean reduction (Keras' default), or micro_batches=1.")


def loss_refusal(compiled_loss):
    """Why the compiled loss cannot be split into micro-batches, or None."""
    for loss in tf.nest.flatten(getattr(compiled_loss, "_losses", None) or []):
        reduction = getattr(loss, "reduction", "auto")
        if reduction not in MEAN_REDUCTIONS:
            return (f"the loss {getattr(loss, 'name', loss)!r} has reduction={reduction!r}, not a mean over "
                    "the batch")
    return None


def _batch_size(tensor):
    if isinstance(tensor, tf.RaggedTensor):
        return tensor.nrows(out_type=tf.int32)
    if isinstance(tensor, tf.SparseTensor):
        return tf.cast(tensor.dense_shape[0], tf.int32)
    return tf.shape(tensor, out_type=tf.int32)[0]


def _parts(tensor, bounds, sizes):
    """tensor's rows [begin, end) for each (begin, end) of `bounds` (`sizes`: their end - begin)."""
    if tensor is None:
        return [None] * len(bounds)
    if isinstance(tensor, tf.SparseTensor):
        rank = tf.size(tensor.dense_shape)
        return [tf.sparse.slice(tensor, tf.concat([[tf.cast(b, tf.int64)], tf.zeros([rank - 1], tf.int64)], 0),
                                tf.concat([[tf.cast(e - b, tf.int64)], tensor.dense_shape[1:]], 0))
                for b, e in bounds]
    if isinstance(tensor, tf.RaggedTensor):
        return [tensor[b:e] for b, e in bounds]
    # One split for all micro-batches: a slice per micro-batch and feature is an op each,
    # with three more packing its bounds, over hundreds of features.
    return tf.split(tensor, sizes, axis=0, num=len(bounds))


def _refuse_masked(y_pred, k):
    # Keras weights metrics by an output's mask, which the whole batch's predictions,
    # concatenated from the micro-batches', would not carry.
    if any(getattr(t, "_keras_mask", None) is not None for t in tf.nest.flatten(y_pred)):
        raise UnsupportedModelError(
            f"picasso_tf: micro_batches={k}: the model's output carries a Keras mask, which its metrics are "
            "weighted by and the micro-batches' concatenated predictions would not carry. Use micro_batches=1 "
            "for this model.")


def _computed(gradients):
    """The tensors of a micro-batch's Gradients: once they exist, its backward is done."""
    return [t for grad, _ in gradients.tables + gradients.dense
            for t in ((grad.values, grad.indices) if isinstance(grad, tf.IndexedSlices) else (grad,))]


def _identity(tensor):
    if isinstance(tensor, (tf.RaggedTensor, tf.SparseTensor)):
        return tf.nest.map_structure(tf.identity, tensor, expand_composites=True)
    return tf.identity(tensor)
