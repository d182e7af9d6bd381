"""Fused lookups of a group of embedding tables: op wrappers and the lookup's gradient.

One op looks up every site (feature) of a group: site i reads table
``tables[table_index[i]]`` at rows ``[offsets[i], offsets[i] + vocab_sizes[i])``, so
its id ``x`` reads row ``x + offsets[i]`` (a table may hold several features' rows
stacked; the tables of a D-packed group are usually the original tables themselves,
offset 0). The kernels are in ``custom_ops/packed_lookup_ops.cc``.

Gradients of ``packed_lookup``: each table gets a ``tf.IndexedSlices`` (ascending
unique rows, one summed row each; never a dense table-shaped tensor). Through a
``ReadVariableOp`` it reaches the variable as such, so ``tf.gradients(loss, var)`` and
``GradientTape.gradient(loss, var)`` both give row-sparse gradients. Weights get a
gradient too (computed with stock TF ops, only when asked for: weights of embedding
lookups are rarely trained); ids, segment ids and num_segments get none. Inside
``in_gradient.update_tables_in_gradient`` the gradient kernel may instead apply the
tables' rows itself (PicassoPackedLookupGradApply), and the tables get no gradient.
"""
import tensorflow as tf

from picasso_tf.ops.in_gradient import apply_in_gradient, gradient_wanted, planned_updates
from picasso_tf.ops.library import load

COMBINERS = ("none", "sum", "mean", "sqrtn")


@tf.autograph.experimental.do_not_convert
def _ops():
    """The op module (not converted by AutoGraph when first called inside tf.function)."""
    return load()


def packed_unique(ids_list, offsets, vocab_sizes, feature_names, name=None):
    """Deduplicates the packed rows of all sites' ids.

    Args:
      ids_list: one int32 or int64 tensor (any shape) of ids per site (mixed dtypes are
        cast to int64).
      offsets, vocab_sizes, feature_names: per site, where its rows lie and its name
        (for error messages).

    Returns:
      ``(unique_rows, inverse_list, counts)``: the distinct packed rows (int64,
      ascending), for each site an int32 tensor shaped like its ids holding each id's
      index into ``unique_rows``, and how many ids map to each unique row (int32).
    """
    unique_rows, inverse, counts = _ops().picasso_packed_unique(
        ids=_same_id_dtype(ids_list), offsets=list(offsets), vocab_sizes=list(vocab_sizes),
        feature_names=list(feature_names), name=name)
    return unique_rows, list(inverse), counts


def packed_lookup(tables, ids_list, segment_ids_list=None, weights_list=None,
                  num_segments_list=None, *, offsets, vocab_sizes, combiners,
                  feature_names, table_index=None, name=None):
    """Looks up every site in one fused kernel; returns one output per site.

    Args:
      tables: a list of table values ``[R_t, D]`` of one float dtype (or one table),
        e.g. ``var.read_value()``; gradients flow to the variables.
      ids_list: per site an int32/int64 tensor of ids (mixed dtypes are cast to int64):
        any shape for "none"; for pooled combiners 1-D with segment ids, or of rank 2
        or more without, to pool each row (the last axis: [B, L] ids give [B, D]).
      segment_ids_list: per site, for pooled combiners, the 1-D output row of each id
        (unsorted allowed; ``None`` or an empty tensor for combiner "none" and for
        pooling by row).
      weights_list: per site a weight per id (1-D; pooling by row: the ids' shape, or it
        and [1]), or None (all weights 1).
      num_segments_list: per pooled site the number of output rows (scalar); None
        means ``max(segment_ids) + 1``. Ignored for combiner "none".
      offsets, vocab_sizes: per site, where its rows lie in the table.
      combiners: per site "none" (output ``ids.shape + [D]``, row j = w_j * row of id j) or
        "sum" / "mean" / "sqrtn" (output ``[num_segments, D]``, or ``ids.shape[:-1] + [D]``
        pooling by row, as ``tf.nn.embedding_lookup_sparse``: empty segments give zero
        rows, and a zero weight sum gives a zero row).
      feature_names: per site, for error messages.
      table_index: per site, which of ``tables`` it reads (default: all the first).
    """
    tables = [tf.convert_to_tensor(t) for t in (tables if isinstance(tables, (list, tuple)) else [tables])]
    table_index = [0] * len(ids_list) if table_index is None else list(table_index)
    ids, segment_ids, weights, num_segments = site_inputs(
        tables[0].dtype, ids_list, segment_ids_list, weights_list, num_segments_list,
        offsets=offsets, vocab_sizes=vocab_sizes, combiners=combiners,
        feature_names=feature_names, op_name="packed_lookup")
    return list(_ops().picasso_packed_lookup(
        tables=tables, table_index=table_index, ids=ids, segment_ids=segment_ids, weights=weights,
        num_segments=num_segments, offsets=list(offsets), vocab_sizes=list(vocab_sizes),
        combiners=list(combiners), feature_names=list(feature_names), name=name))


def site_inputs(dtype, ids_list, segment_ids_list, weights_list, num_segments_list, *,
                offsets, vocab_sizes, combiners, feature_names, op_name):
    """Checks the per-site arguments of a lookup op and returns its per-site inputs
    ``(ids, segment_ids, weights, num_segments)``, with empty tensors (and a count of
    0) where a site has no segment ids, no weights or no pooling."""
    n = len(ids_list)
    for arg, values in (("offsets", offsets), ("vocab_sizes", vocab_sizes),
                        ("combiners", combiners), ("feature_names", feature_names)):
        if len(values) != n:
            raise ValueError(f"{op_name}: {arg} needs one entry per site ({n}); "
                             f"got {len(values)}")
    for combiner, feature in zip(combiners, feature_names):
        if combiner not in COMBINERS:
            raise ValueError(f"{op_name}: feature '{feature}' has combiner '{combiner}'; "
                             f"use one of {', '.join(COMBINERS)}")
    ids = _same_id_dtype(ids_list)
    segment_ids_list = _per_site(segment_ids_list, n)
    weights_list = _per_site(weights_list, n)
    num_segments_list = _per_site(num_segments_list, n)
    segment_ids, weights, num_segments = [], [], []
    for i in range(n):
        pooled = combiners[i] != "none"
        seg = segment_ids_list[i]
        by_row = pooled and seg is None and (ids[i].shape.rank or 0) >= 2
        if pooled and seg is None and not by_row:
            raise ValueError(f"{op_name}: feature '{feature_names[i]}' has combiner "
                             f"'{combiners[i]}' but no segment ids, and its ids are not of rank 2 or "
                             "more (to pool each row); give segment ids")
        seg = tf.zeros([0], tf.int64) if seg is None else tf.cast(seg, tf.int64)
        segment_ids.append(seg)
        w = weights_list[i]
        weights.append(tf.zeros([0], dtype) if w is None else tf.convert_to_tensor(w, dtype=dtype))
        count = num_segments_list[i]
        if count is None:
            count = tf.maximum(tf.reduce_max(seg), -1) + 1 if pooled and not by_row else 0
        num_segments.append(tf.cast(count, tf.int64))
    return ids, segment_ids, weights, num_segments


def packed_lookup_grad(grads, ids_list, segment_ids_list, weights_list, num_segments_list,
                       *, num_rows, dims, offsets, vocab_sizes, combiners, feature_names,
                       table_index=None, name=None):
    """The tables' gradients of ``packed_lookup`` as ``(unique_rows, row_grads)``, one
    entry per table (num_rows and dims: one per table).

    Takes the raw per-site inputs of the lookup op (empty tensors, not None, for absent
    segment ids and weights) and the gradients of its outputs.
    """
    table_index = [0] * len(ids_list) if table_index is None else list(table_index)
    unique_rows, row_grads = _ops().picasso_packed_lookup_grad(
        grads=list(grads), ids=list(ids_list), segment_ids=list(segment_ids_list),
        weights=list(weights_list), num_segments=list(num_segments_list), G=len(num_rows),
        table_index=table_index, num_rows=list(num_rows), dims=list(dims),
        offsets=list(offsets), vocab_sizes=list(vocab_sizes), combiners=list(combiners),
        feature_names=list(feature_names), name=name)
    return list(unique_rows), list(row_grads)


def table_num_rows(table, offsets, vocab_sizes):
    """The table's static row count; else any bound: the op only checks the layout."""
    if table.shape[0] is not None:
        return table.shape[0]
    return max(o + v for o, v in zip(offsets, vocab_sizes))


def row_sparse_gradient(table, unique_rows, row_grads):
    """The IndexedSlices gradient of a table."""
    # A static shape keeps the gradient from holding the table's value: a tensor still
    # alive when the optimizer updates the table would make it copy the whole table.
    dense_shape = (tf.constant(table.shape.as_list(), tf.int64) if table.shape.is_fully_defined()
                   else tf.shape(table, out_type=tf.int64))
    return tf.IndexedSlices(row_grads, unique_rows, dense_shape=dense_shape)


def _same_id_dtype(ids_list):
    """The ids as tensors of one dtype: int64 where the sites' dtypes differ."""
    ids = [tf.convert_to_tensor(x) for x in ids_list]
    if len({x.dtype for x in ids}) > 1:
        ids = [tf.cast(x, tf.int64) for x in ids]
    return ids


def _per_site(values, n):
    return [None] * n if values is None else list(values)


def lookup_attrs(op):
    return {"offsets": op.get_attr("offsets"), "vocab_sizes": op.get_attr("vocab_sizes"),
            "combiners": [c.decode() for c in op.get_attr("combiners")],
            "feature_names": [f.decode() for f in op.get_attr("feature_names")]}


def tables_rows(tables, table_index, attrs):
    """Per table, its row count for a gradient op (any bound where it is not static)."""
    rows = []
    for t, table in enumerate(tables):
        sites = [i for i, ti in enumerate(table_index) if ti == t]
        rows.append(table_num_rows(table, [attrs["offsets"][i] for i in sites],
                                   [attrs["vocab_sizes"][i] for i in sites]))
    return rows


@tf.RegisterGradient("PicassoPackedLookup")
def _packed_lookup_gradient(op, *grads):
    g, n = op.get_attr("G"), op.get_attr("N")
    tables = op.inputs[:g]
    table_index = list(op.get_attr("table_index"))
    ids = op.inputs[g:g + n]
    segment_ids = op.inputs[g + n:g + 2 * n]
    weights = op.inputs[g + 2 * n:g + 3 * n]
    num_segments = op.inputs[g + 3 * n:g + 4 * n]
    # An output's gradient may come as IndexedSlices (e.g. from a gather): [n_i, D] dense.
    grads = [tf.zeros_like(out) if g is None else tf.convert_to_tensor(g)
             for g, out in zip(grads, op.outputs)]
    attrs = lookup_attrs(op)
    # Eager tapes say which inputs need no gradient; graph mode prunes unused ones.
    skip = set(getattr(op, "skip_input_indices", None) or ())
    weight_grads = []
    for i in range(n):
        empty = weights[i].shape.rank == 1 and weights[i].shape[0] == 0  # "all ones"
        weight_grads.append(None if empty or not gradient_wanted(op, g + 2 * n + i) else weight_gradient(
            tables[table_index[i]], grads[i], op.outputs[i], ids[i], segment_ids[i], weights[i],
            num_segments[i], attrs["offsets"][i], attrs["combiners"][i]))
    table_grads = [None] * g
    if any(t not in skip for t in range(g)):
        site_inputs = (grads, list(ids), list(segment_ids), list(weights), list(num_segments))
        layout = dict(table_index=table_index, num_rows=tables_rows(tables, table_index, attrs),
                      dims=[grads_dim(grads, table_index, t, table) for t, table in enumerate(tables)], **attrs)
        # The kernel may update the tables itself when it computes all their gradients
        # and no weight's gradient reads their values after it.
        in_kernel = (not skip.intersection(range(g)) and all(w is None for w in weight_grads)
                     and all(t.shape.is_fully_defined() for t in tables))
        planned = planned_updates(tables) if in_kernel else None
        if planned:
            apply_in_gradient(_ops().picasso_packed_lookup_grad_apply, planned, tables[0].dtype,
                              **dict(zip(("grads", "ids", "segment_ids", "weights", "num_segments"), site_inputs)),
                              **layout)
        else:
            unique_rows, row_grads = packed_lookup_grad(*site_inputs, **layout)
            table_grads = [None if t in skip else row_sparse_gradient(table, rows, values)
                           for t, (table, rows, values) in enumerate(zip(tables, unique_rows, row_grads))]
    return table_grads + [None] * (2 * n) + weight_grads + [None] * n


def grads_dim(grads, table_index, t, table):
    """Table t's row width: static from the table, else from one of its sites' gradients."""
    if table.shape.rank == 2 and table.shape[1] is not None:
        return table.shape[1]
    return next(grads[i].shape[-1] for i, ti in enumerate(table_index) if ti == t)


def weight_gradient(table, grad, output, ids, segment_ids, weights, num_segments, offset,
                    combiner):
    """d loss / d weights of one site (stock TF ops; runs only when it is needed)."""
    if combiner != "none" and segment_ids.shape.rank == 1 and segment_ids.shape[0] == 0:
        # Pooled by row: the same as pooling the flat ids by segment ids j // L.
        length = tf.cast(tf.shape(ids)[-1], tf.int64)
        flat_ids = tf.reshape(ids, [-1])
        segments = tf.range(tf.size(flat_ids, out_type=tf.int64)) // tf.maximum(length, 1)
        flat = weight_gradient(table, tf.reshape(grad, [-1, tf.shape(grad)[-1]]),
                               tf.reshape(output, [-1, tf.shape(output)[-1]]), flat_ids, segments,
                               tf.reshape(weights, [-1]), tf.size(flat_ids, out_type=tf.int64) //
                               tf.maximum(length, 1), offset, combiner)
        return tf.reshape(flat, tf.shape(weights))
    rows = tf.gather(table, tf.cast(ids, tf.int64) + offset)
    if combiner == "none":
        return tf.reduce_sum(grad * rows, axis=1)
    dot = tf.reduce_sum(tf.gather(grad, segment_ids) * rows, axis=1)
    if combiner == "sum":
        return dot
    # out_s = sum_j w_j e_j / den_s, so d out_s / d w_j = (e_j - out_s * dden_s/dw_j) / den_s
    # with dden/dw_j = 1 (mean, den = sum w) or w_j / den (sqrtn, den = sqrt(sum w^2)).
    out_dot = tf.gather(tf.reduce_sum(grad * output, axis=1), segment_ids)
    if combiner == "mean":
        den = tf.math.unsorted_segment_sum(weights, segment_ids, num_segments)
        return tf.math.divide_no_nan(dot - out_dot, tf.gather(den, segment_ids))
    den = tf.gather(tf.sqrt(tf.math.unsorted_segment_sum(weights * weights, segment_ids,
                                                         num_segments)), segment_ids)
    return tf.math.divide_no_nan(dot - weights * tf.math.divide_no_nan(out_dot, den), den)
