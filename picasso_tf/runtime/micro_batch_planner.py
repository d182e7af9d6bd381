"""micro_batches="auto": the number of micro-batches by the paper's Eq. 2.

Eq. 2 sizes a micro-batch so that no op's dominant resource exceeds its bound:
BS_micro = min over ops of RBound_op / RInstance_op. On a CPU the resource that grows
with the batch is memory, one pool every op shares, so its bound is the budget
(config.micro_batch_memory_budget) and its per-instance cost the step's activation
bytes per sample. K is then the fewest micro-batches of at most BS_micro samples:
ceil(batch / BS_micro), not necessarily a divisor of the batch.

The per-sample cost is measured on the first warm-up batch: the rewritten forward pass
runs on it and the bytes of every tensor it computes from the batch are summed (the
activations a step keeps for its backward; the tables and optimizer slots do not grow
with the batch and are not counted). Not RSS: TensorFlow's CPU allocators keep what
they free, so a process's RSS growth over a step reads the allocator's history rather
than the step. Ops that return a view of their input allocate nothing and are skipped;
tensors inside function bodies (a recurrent loop's steps) are not seen, only the
loop's outputs.
"""
import math

import tensorflow as tf

from picasso_tf.graph.batch_coupling import batch_dependent_nodes
from picasso_tf.graph.rebuild import conform_inputs, import_forward

# Ops whose output shares its input's buffer.
VIEWS = {"Identity", "IdentityN", "Reshape", "ExpandDims", "Squeeze", "StopGradient", "Snapshot",
         "PreventGradient", "Placeholder", "PlaceholderWithDefault"}
# More micro-batches than this import the forward this many times into one step: refused.
MAX_AUTO_MICRO_BATCHES = 64


def eq2_micro_batch_size(costs):
    """Eq. 2: the largest micro-batch within every bound, min over (bound, cost per
    sample) of bound / cost, in whole samples (0: one sample is already over a bound)."""
    size = min(bound / cost if cost > 0 else math.inf for bound, cost in costs)
    return size if size == math.inf else math.floor(size)


def micro_batch_count(batch, micro_batch_size):
    """The fewest micro-batches of at most micro_batch_size samples (sizes differ by at
    most one, runtime.micro_batches.split_batch) that hold `batch`."""
    return max(1, math.ceil(batch / micro_batch_size)) if micro_batch_size >= 1 else max(1, batch)


def default_budget():
    """A quarter of the memory available now: "auto" runs one micro-batch at a time, and
    the rest is left to the whole batch's tensors (its inputs, predictions and gathered
    gradients), the data pipeline and the allocators' slack."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        import os
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // 4


def activation_bytes(forward, features):
    """Bytes of the tensors that the rewritten forward pass (a RewrittenForward)
    computes from `features`, views of their input left out."""
    captured = forward.captured
    from_batch = batch_dependent_nodes(captured)
    nodes = [n for n in captured.graph_def.node if n.name in from_batch and n.op not in VIEWS]

    @tf.function
    def measure(features):
        import_forward(captured.graph_def, captured.input_tensors, conform_inputs(captured.input_specs, features),
                       forward.captures, [], name="picasso_measure")
        graph = tf.compat.v1.get_default_graph()
        sizes = [tf.size(t, out_type=tf.int64) * t.dtype.size
                 for n in nodes for t in graph.get_operation_by_name(f"picasso_measure/{n.name}").outputs
                 if t.dtype.is_numpy_compatible and t.dtype != tf.string]
        return tf.add_n(sizes) if sizes else tf.constant(0, tf.int64)

    return int(measure(features))


def plan_micro_batches(program, forward, warmup_data, features, loss_refusal, config):
    """K for micro_batches="auto" in this trace of the training step. The plan (K, the
    batch, the cost per sample, the budget and why) is written into the training
    graph's k_interleave report, where model.picasso.report() shows it."""
    report = next((p for p in program.reports["training"]["passes"] if p["pass"] == "k_interleave"), {})
    plan = report.get("micro_batches") if isinstance(report.get("micro_batches"), dict) else {}
    plan = _plan(plan, report, forward, warmup_data, features, loss_refusal, config)
    if report:
        report["micro_batches"] = plan
    return plan["chosen"]


def _plan(previous, report, forward, warmup_data, features, loss_refusal, config):
    if not report.get("enabled"):
        return {"chosen": 1, "why": "interleaving=False: the batch stays whole"}
    if report.get("batch_coupling"):
        coupled = report["batch_coupling"]
        return {"chosen": 1, "why": f"{coupled[0]} ({len(coupled)} such op(s)) normalises or reduces over the "
                                    "batch: the batch stays whole"}
    if loss_refusal:
        return {"chosen": 1, "why": f"{loss_refusal}: the batch stays whole"}
    if warmup_data is None:
        raise ValueError("picasso_tf: micro_batches='auto' measures a step's memory per sample on warm-up data; "
                         "pass warmup_data=<a tf.data.Dataset of training-sized batches> to picasso_tf.optimize, "
                         "or give micro_batches a number")
    budget = config.micro_batch_memory_budget or previous.get("budget_bytes") or default_budget()
    if "per_sample_bytes" in previous and "warmup_batch" in previous:
        per_sample, warmup_rows = previous["per_sample_bytes"], previous["warmup_batch"]
    else:
        with tf.init_scope():
            first = next(iter(warmup_data))
            warm = tf.keras.utils.unpack_x_y_sample_weight(first)[0] if isinstance(first, tuple) else first
            warmup_rows = int(_rows(warm))
            per_sample = activation_bytes(forward, warm) / max(warmup_rows, 1)
    static = _rows(features)
    batch, source = (static, "the traced batch") if isinstance(static, int) else (warmup_rows, "the warm-up batch")
    size = eq2_micro_batch_size([(budget, per_sample)])
    k = micro_batch_count(batch, size)
    plan = {"chosen": k, "batch": batch, "batch_from": source, "warmup_batch": warmup_rows,
            "per_sample_bytes": per_sample, "budget_bytes": int(budget), "micro_batch_size": size}
    need = f"{batch} samples x {per_sample:,.0f} B of activations per sample = {batch * per_sample:,.0f} B"
    if k == 1:
        plan["why"] = f"{need}, within the budget of {budget:,} B: the batch stays whole"
    elif size < 1:
        plan["why"] = f"one sample's activations ({per_sample:,.0f} B) exceed the budget of {budget:,} B"
    else:
        plan["why"] = (f"{need}, over the budget of {budget:,} B; Eq. 2: micro-batches of at most "
                       f"{size} samples, so {k} of them")
    if k > MAX_AUTO_MICRO_BATCHES:
        raise ValueError(f"picasso_tf: micro_batches='auto': {plan['why']}, which needs {k} micro-batches "
                         f"(more than {MAX_AUTO_MICRO_BATCHES}, each a copy of the forward pass in the step); "
                         "raise micro_batch_memory_budget or train on smaller batches")
    return plan


def _rows(features):
    """The batch's rows: an int when the first feature's static shape says, else a tensor."""
    first = tf.nest.flatten(features)[0]
    if not isinstance(first, (tf.RaggedTensor, tf.SparseTensor)):
        first = tf.convert_to_tensor(first)
    if first.shape.rank and first.shape[0] is not None:
        return int(first.shape[0])
    if isinstance(first, tf.RaggedTensor):
        return first.nrows()
    return first.dense_shape[0] if isinstance(first, tf.SparseTensor) else tf.shape(first)[0]
