"""The stages of one `wide_lr` training step timed in isolation, picasso_tf path vs stock.

The `wide_lr` model (one Embedding per one-hot field, concatenated, one sigmoid unit)
is taken apart: each stage is its own tf.function on the stage's real inputs (the
benchmark's ids, the previous stage's outputs), and the stages are run in turn,
interleaved, `repeats` times after warm-up; medians and quartiles are reported.

picasso_tf path (packed groups exactly as the PicassoModel's plan made them; the
sigmoid unit's MatMul folded into the lookup, as K-packing does for a narrow Dense):
  projection  PicassoStitchedProjection: the logits from every group's rows and the
              unit's weights, without building the concatenation [B, sum(dims)]
  loss        the sigmoid and the loss, forward + backward to the logits
  grad + apply  PicassoStitchedProjectionGradApply: every group's deduplicated, summed
              rows, each applied by Adagrad in the kernel, and the unit's weight
              gradient, from the logits' gradient
separate (apply_in_gradient=False; not in the picasso sum): the same gradient written
  out by PicassoStitchedProjectionGrad, then PicassoSparseApplyAdagrad per group.
stock path (what Keras does per field): ResourceGather per field, ConcatV2 of the
  per-field outputs (the model's Concatenate), the dense stage (the sigmoid unit
  forward + backward, including the input gradient dx), SplitV of dx (the
  Concatenate's gradient), Keras Adagrad's _deduplicate_sparse_grad (Unique +
  UnsortedSegmentSum) and update (two scatters and a gather) per field.
bound: the dense stage without dx (a model whose input is the [B, sum(dims)] tensor).
"""
import statistics
import time

import numpy as np
import tensorflow as tf


def _groups_of_layouts(layouts, tables_by_field):
    """[(dim, [field indices])] of the program's table layouts."""
    field_of = {t.ref(): i for i, t in enumerate(tables_by_field)}
    out = []
    for g in layouts or ():
        members = [field_of[m.variable.ref()] for m in g.members if m.variable.ref() in field_of]
        if members:
            out.append((g.dim, members))
    return out


def stage_times(schema, features, labels, batch_size, layouts, tables_by_field, repeats=15, seed=0,
                learning_rate=0.01, epsilon=1e-7):
    """{stage: {"ms": median, "q1", "q3"}} plus "unique_rows" and "groups"."""
    from picasso_tf.ops import sparse_apply
    from picasso_tf.ops.in_gradient import FixedTableUpdates, update_tables_in_gradient
    from picasso_tf.ops.read_tables import read_tables
    from picasso_tf.ops.stitched_projection import stitched_projection

    fields = list(schema.categorical)
    dims = [f.embedding_dim for f in fields]
    ids = [tf.constant(features[f.name][:batch_size]) for f in fields]
    groups = _groups_of_layouts(layouts, tables_by_field)
    rng = np.random.default_rng(seed)
    # The model's tables, read in place by group (one PicassoReadTables each), as the rewritten step.
    tables = [tf.Variable(rng.uniform(-0.05, 0.05, (f.vocab_size, d)).astype(np.float32)) for f, d in zip(fields, dims)]
    accumulators = [tf.Variable(tf.fill([f.vocab_size, d], 0.1)) for f, d in zip(fields, dims)]
    weights = tf.Variable(rng.normal(size=(sum(dims), 1)).astype(np.float32) * 0.01)
    y = tf.constant(np.asarray(labels[:batch_size], np.float32).reshape(-1, 1))

    def read_all():
        values = [None] * len(fields)
        for _, members in groups:
            for i, value in zip(members, read_tables([tables[i].handle for i in members], tf.float32)):
                values[i] = value
        return [v if v is not None else t.read_value() for v, t in zip(values, tables)]

    def projected(values, kernel):
        return stitched_projection(values, ids, kernel=kernel, table_index=list(range(len(fields))),
                                   columns=np.concatenate([[0], np.cumsum(dims)[:-1]]).tolist(),
                                   row_blocks=[1] * len(fields), width=sum(dims), offsets=[0] * len(fields),
                                   vocab_sizes=[f.vocab_size for f in fields], combiners=["none"] * len(fields),
                                   feature_names=[f.name for f in fields])

    project = tf.function(lambda: projected(read_all(), weights.read_value()))
    concat = tf.function(lambda xs: tf.concat(xs, 1))

    def loss_of_logits(logits):
        return tf.reduce_mean(tf.keras.losses.binary_crossentropy(y, tf.sigmoid(logits)))

    def loss_of(x):
        return loss_of_logits(x @ weights)

    @tf.function
    def head(logits):
        with tf.GradientTape() as tape:
            tape.watch(logits)
            loss = loss_of_logits(logits)
        return tape.gradient(loss, logits)

    @tf.function
    def dense(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = loss_of(x)
        return tape.gradient(loss, [x, weights])

    @tf.function
    def dense_bound(x):
        with tf.GradientTape() as tape:
            loss = loss_of(x)
        return tape.gradient(loss, weights)

    split = tf.function(lambda g: tf.split(g, dims, axis=1))

    @tf.function
    def grad(dy):
        values, kernel = read_all(), weights.read_value()
        grads = tf.gradients(projected(values, kernel), values + [kernel], grad_ys=dy)
        return [(g.indices, g.values) for g in grads[:-1]], grads[-1]

    @tf.function
    def grad_apply(dy):
        values, kernel = read_all(), weights.read_value()
        updates = FixedTableUpdates((t, sparse_apply.adagrad_update(a, lr=learning_rate, epsilon=epsilon))
                                    for t, a in zip(tables, accumulators))
        with update_tables_in_gradient(updates):
            kernel_grad = tf.gradients(projected(values, kernel), values + [kernel], grad_ys=dy)[-1]
        with tf.control_dependencies(updates.ops):
            return tf.identity(kernel_grad)

    @tf.function
    def apply(grads):
        ops = [sparse_apply.adagrad(t, a, rows, values, lr=learning_rate, epsilon=epsilon)
               for (rows, values), t, a in zip(grads, tables, accumulators)]
        with tf.control_dependencies(ops):
            return tf.constant(0)

    stock_tables = [tf.Variable(rng.uniform(-0.05, 0.05, (f.vocab_size, d)).astype(np.float32))
                    for f, d in zip(fields, dims)]
    stock_accumulators = [tf.Variable(tf.fill([f.vocab_size, d], 0.1)) for f, d in zip(fields, dims)]

    @tf.function
    def stock_lookup():
        return [tf.nn.embedding_lookup(t, i) for t, i in zip(stock_tables, ids)]

    @tf.function
    def stock_update(pieces):
        ops = []
        for t, a, i, g in zip(stock_tables, stock_accumulators, ids, pieces):
            rows, position = tf.unique(i)                       # Keras' _deduplicate_sparse_grad
            values = tf.math.unsorted_segment_sum(g, position, tf.size(rows))
            a.scatter_add(tf.IndexedSlices(values * values, rows))
            denominator = tf.sqrt(tf.gather(a, rows) + epsilon)
            ops.append(t.scatter_add(tf.IndexedSlices(-learning_rate * values / denominator, rows)))
        with tf.control_dependencies(ops):
            return tf.constant(0)

    outs = stock_lookup()
    x = concat(outs)
    dx, _ = dense(x)
    pieces = split(dx)
    logits = project()
    dy = head(logits)
    grads, _ = grad(dy)
    stages = {
        "picasso: projection (PicassoStitchedProjection)": lambda: project(),
        "picasso: loss forward + backward": lambda: head(logits),
        "picasso: grad + Adagrad in the kernel (PicassoStitchedProjectionGradApply)": lambda: grad_apply(dy),
        "separate: projection grad (PicassoStitchedProjectionGrad)": lambda: grad(dy),
        "separate: apply (PicassoSparseApplyAdagrad)": lambda: apply(grads),
        "stock: dense forward + backward incl. dx": lambda: dense(x),
        "bound: dense forward + backward, no dx": lambda: dense_bound(x),
        "stock: lookup (ResourceGather per field)": lambda: stock_lookup(),
        "stock: concat (ConcatV2)": lambda: concat(outs),
        "stock: split dx (SplitV)": lambda: split(dx),
        "stock: dedup + Adagrad update per field": lambda: stock_update(pieces),
    }
    for f in stages.values():
        f()
        f()
    times = {k: [] for k in stages}
    for _ in range(repeats):
        for name, f in stages.items():
            start = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - start)
    out = {"stages": {}, "repeats": repeats, "groups": [(d, len(m)) for d, m in groups],
           "unique_rows": int(sum(int(g[0].shape[0]) for g in grads)),
           "ids": len(fields) * batch_size}
    for name, samples in times.items():
        q1, med, q3 = np.percentile(samples, [25, 50, 75]) * 1e3
        out["stages"][name] = {"ms": float(med), "q1": float(q1), "q3": float(q3)}
    picasso = [k for k in out["stages"] if k.startswith("picasso")]
    stock = [k for k in out["stages"] if k.startswith("stock")]
    out["picasso_sum_ms"] = statistics.fsum(out["stages"][k]["ms"] for k in picasso)
    out["stock_sum_ms"] = statistics.fsum(out["stages"][k]["ms"] for k in stock)
    out["bound_ms"] = out["stages"]["bound: dense forward + backward, no dx"]["ms"]
    return out
