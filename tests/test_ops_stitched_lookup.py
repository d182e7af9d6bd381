"""Stitched lookups (PicassoStitchedLookup and its gradient) against NumPy: several
packed tables and dense inputs written straight into one [rows, width] tensor."""
import numpy as np
import pytest
import tensorflow as tf

from picasso_tf.ops.stitched_lookup import stitched_lookup
from test_ops_packed_lookup import np_lookup


def make_stitch(rng, rows, specs, dense_widths, id_dtype=np.int64, dims=(4, 8, 5)):
    """specs: (table, vocab, combiner, row_blocks, weighted) per site, in column order
    after the dense inputs interleaved at the positions in dense_widths ({position: w}),
    with tables of widths dims. Returns the tables, per-site inputs, the kwargs of
    stitched_lookup and a NumPy reference of its output."""
    tables = [rng.normal(size=(400, d)).astype(np.float32) for d in dims]
    next_offset = [0, 0, 0]
    kwargs = {k: [] for k in ("table_index", "columns", "row_blocks", "dense_columns", "offsets",
                              "vocab_sizes", "combiners", "feature_names")}
    sites, dense, pieces, column = [], [], [], 0
    for position, (t, vocab, combiner, blocks, weighted) in enumerate(specs):
        if position in dense_widths:
            x = rng.normal(size=(rows, dense_widths[position])).astype(np.float32)
            dense.append(x)
            kwargs["dense_columns"].append(column)
            pieces.append(x)
            column += x.shape[1]
        n = rows * blocks if combiner == "none" else int(rows * 2.5)
        ids = np.minimum(rng.zipf(1.3, size=n) - 1, vocab - 1).astype(id_dtype)
        seg = None if combiner == "none" else rng.integers(0, rows, size=n)
        w = rng.uniform(0.2, 2.0, size=n).astype(np.float32) if weighted else None
        site = dict(ids=ids, seg=seg, w=w, num_segments=rows if combiner != "none" else None)
        sites.append(site)
        offset = next_offset[t]
        next_offset[t] += vocab
        for key, value in (("table_index", t), ("columns", column), ("row_blocks", blocks),
                           ("offsets", offset), ("vocab_sizes", vocab), ("combiners", combiner),
                           ("feature_names", f"F{position}")):
            kwargs[key].append(value)
        width = blocks * dims[t] if combiner == "none" else dims[t]
        pieces.append(np_lookup(tables[t], site, offset, combiner).reshape(rows, width))
        column += width
    kwargs["width"] = column
    return tables, sites, dense, kwargs, np.concatenate(pieces, axis=1)


def call(tables, sites, dense, kwargs):
    return stitched_lookup(
        [tf.constant(t) for t in tables], [s["ids"] for s in sites], [s["seg"] for s in sites],
        [s["w"] for s in sites], [s["num_segments"] for s in sites], [tf.constant(x) for x in dense],
        **kwargs)


SPECS = [
    # table, vocab, combiner, row_blocks, weighted
    (0, 50, "none", 1, False),
    (1, 30, "none", 3, True),      # a sequence of 3 ids flattened into the row
    (0, 40, "mean", 1, True),      # pooled, unsorted segments, some empty
    (2, 7, "none", 1, False),      # heavy duplicates
    (1, 60, "sum", 1, False),
    (0, 20, "none", 2, False),     # table 0 again: one gradient for its three sites
    (2, 90, "sqrtn", 1, True),
]


@pytest.mark.parametrize("rows", [0, 1, 37, 3000])   # 3000: large enough to run threaded
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dims", [(4, 8, 5), (8, 8, 8)])  # the one-hot columns' gradient: mixed widths, one width
def test_stitched_output_and_gradients_match_numpy(rows, id_dtype, dims):
    rng = np.random.default_rng(rows)
    tables, sites, dense, kwargs, expected = make_stitch(rng, rows, SPECS, {0: 3, 4: 2}, id_dtype, dims)
    table_vars = [tf.Variable(t) for t in tables]
    dense_t = [tf.constant(x) for x in dense]
    weights = [None if s["w"] is None else tf.constant(s["w"]) for s in sites]
    upstream = rng.normal(size=expected.shape).astype(np.float32)
    with tf.GradientTape() as tape:
        tape.watch(dense_t + [w for w in weights if w is not None])
        out = stitched_lookup([v.read_value() for v in table_vars], [s["ids"] for s in sites],
                              [s["seg"] for s in sites], weights, [s["num_segments"] for s in sites],
                              dense_t, **kwargs)
        loss = tf.reduce_sum(out * upstream)
    assert out.shape == expected.shape
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)
    grads = tape.gradient(loss, table_vars + dense_t + [w for w in weights if w is not None])
    # Reference: the same loss with every lookup done by tf.gather/segment ops.
    with tf.GradientTape() as tape:
        ref_tables = [tf.constant(t) for t in tables]
        ref_weights = [None if s["w"] is None else tf.constant(s["w"]) for s in sites]
        tape.watch(ref_tables + dense_t + [w for w in ref_weights if w is not None])
        pieces, d = [], iter(dense_t)
        for i, s in enumerate(sites):
            if i in (0, 4):
                pieces.append(next(d))
            t = ref_tables[kwargs["table_index"][i]]
            r = tf.gather(t, s["ids"].astype(np.int64) + kwargs["offsets"][i])
            w = ref_weights[i] if ref_weights[i] is not None else tf.ones([len(s["ids"])])
            r = r * w[:, None]
            combiner = kwargs["combiners"][i]
            if combiner != "none":
                den = w if combiner != "sqrtn" else w * w
                r = tf.math.unsorted_segment_sum(r, s["seg"], rows)
                den = tf.math.unsorted_segment_sum(den, s["seg"], rows)
                den = den if combiner != "sqrtn" else tf.sqrt(den)
                r = r if combiner == "sum" else tf.math.divide_no_nan(r, den[:, None])
            pieces.append(tf.reshape(r, [rows, r.shape[-1] * kwargs["row_blocks"][i]]))
        ref_loss = tf.reduce_sum(tf.concat(pieces, 1) * upstream)
    ref_grads = tape.gradient(ref_loss, ref_tables + dense_t + [w for w in ref_weights if w is not None])
    sources = ref_tables + dense_t + [w for w in ref_weights if w is not None]
    for k, (g, r, x) in enumerate(zip(grads, ref_grads, sources)):
        g = tf.zeros_like(x) if g is None else g
        r = tf.zeros_like(x) if r is None else r
        if k < len(tables) and rows:
            assert isinstance(g, tf.IndexedSlices), "table gradients stay row-sparse"
            rows_seen = g.indices.numpy()
            assert np.all(np.diff(rows_seen) > 0), "unique rows, ascending"
        np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), tf.convert_to_tensor(r).numpy(),
                                   rtol=1e-4, atol=1e-4, err_msg=f"gradient {k}")


def test_stitched_gradient_is_bit_identical_across_runs():
    rng = np.random.default_rng(5)
    tables, sites, dense, kwargs, _ = make_stitch(rng, 3000, SPECS, {0: 3})
    upstream = tf.constant(rng.normal(size=(3000, kwargs["width"])).astype(np.float32))

    def grads():
        vars_ = [tf.Variable(t) for t in tables]
        with tf.GradientTape() as tape:
            out = stitched_lookup([v.read_value() for v in vars_], [s["ids"] for s in sites],
                                  [s["seg"] for s in sites], [s["w"] for s in sites],
                                  [s["num_segments"] for s in sites], [tf.constant(x) for x in dense],
                                  **kwargs)
            loss = tf.reduce_sum(out * upstream)
        return [g.values.numpy() for g in tape.gradient(loss, vars_)]

    for a, b in zip(grads(), grads()):
        np.testing.assert_array_equal(a, b)


def test_bad_id_names_the_feature_and_value():
    rng = np.random.default_rng(1)
    tables, sites, dense, kwargs, _ = make_stitch(rng, 10, SPECS[:2], {})
    sites[1]["ids"][4] = 999
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"feature 'F1'.*got 999"):
        call(tables, sites, dense, kwargs)


def test_columns_that_do_not_tile_the_width_are_rejected():
    rng = np.random.default_rng(2)
    tables, sites, dense, kwargs, _ = make_stitch(rng, 10, SPECS[:2], {})
    kwargs["width"] += 1
    with pytest.raises(tf.errors.InvalidArgumentError, match="fill"):
        call(tables, sites, dense, kwargs)
    kwargs["width"] -= 1
    kwargs["row_blocks"][1] = 2      # 30 ids of F1 do not make 2 per row of 10 rows
    with pytest.raises(tf.errors.InvalidArgumentError, match="feature 'F1'"):
        call(tables, sites, dense, kwargs)
