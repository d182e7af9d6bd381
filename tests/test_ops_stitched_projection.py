"""Stitched projections (PicassoStitchedProjection and its gradient): the product of a
stitched lookup with a narrow kernel (per entry) or a wide one (per unique row),
against the unfused stitched lookup and MatMul. The gradient that updates the tables
itself: test_ops_in_gradient.py."""
import numpy as np
import pytest
import tensorflow as tf

from picasso_tf.ops.library import load
from picasso_tf.ops.stitched_lookup import stitched_lookup
from picasso_tf.ops.stitched_projection import stitched_projection
from test_ops_stitched_lookup import SPECS as LOOKUP_SPECS, make_stitch

# The stitched lookup's sites without their weights (a projection takes none): one-hot,
# a 3-id sequence, pooled mean/sum/sqrtn with unsorted segments, three sites of one table.
SPECS = [(table, vocab, combiner, blocks, False) for table, vocab, combiner, blocks, _ in LOOKUP_SPECS]
DENSE = {0: 3, 4: 2}               # columns no site covers: left to the caller


def site_kwargs(kwargs):
    return {k: v for k, v in kwargs.items() if k != "dense_columns"}


def project(table_values, sites, kernel, kwargs):
    per_site = ([s["ids"] for s in sites], [s["seg"] for s in sites], [s["num_segments"] for s in sites])
    return stitched_projection(table_values, *per_site, kernel=kernel, **site_kwargs(kwargs))


# Narrow (per entry) and wide (per unique row): 70 units are a full block of output
# columns and a partial one. Table widths: the wide gradient works across d in packets
# of 16, 8 or 4 floats where d allows (with AVX-512: 16, 32; 8, 24; 4) and along units
# otherwise (5).
@pytest.mark.parametrize("units", [1, 3, 9, 70])
@pytest.mark.parametrize("rows", [0, 1, 37, 3000])   # 3000: large enough to run threaded
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dims", [(4, 8, 5), (16, 32, 24)])
def test_projection_and_its_gradients_match_the_unfused_product(units, rows, id_dtype, dims):
    rng = np.random.default_rng(rows + units)
    tables, sites, dense, kwargs, _ = make_stitch(rng, rows, SPECS, DENSE, id_dtype, dims)
    kernel = rng.normal(size=(kwargs["width"], units)).astype(np.float32)
    upstream = rng.normal(size=(rows, units)).astype(np.float32)

    def gradients(fused):
        table_vars, kernel_var = [tf.Variable(t) for t in tables], tf.Variable(kernel)
        with tf.GradientTape() as tape:
            values = [v.read_value() for v in table_vars]
            if fused:
                out = project(values, sites, kernel_var, kwargs)
            else:   # the dense columns as zeros: what the projection leaves out
                x = stitched_lookup(values, [s["ids"] for s in sites], [s["seg"] for s in sites], None,
                                    [s["num_segments"] for s in sites], [tf.zeros_like(d) for d in dense],
                                    **kwargs)
                out = x @ kernel_var
            loss = tf.reduce_sum(out * upstream)
        return out, tape.gradient(loss, table_vars + [kernel_var])

    out, grads = gradients(fused=True)
    expected, ref_grads = gradients(fused=False)
    assert out.shape == (rows, units)
    # Sums of hundreds of products, in another order: rounding relative to their size.
    expected = expected.numpy()
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5 + 1e-6 * np.abs(expected).max(initial=0))
    for k, (g, r) in enumerate(zip(grads, ref_grads)):
        if k < len(tables) and rows:
            assert isinstance(g, tf.IndexedSlices), "table gradients stay row-sparse"
            assert np.all(np.diff(g.indices.numpy()) > 0), "unique rows, ascending"
        # Sums of thousands of terms, in another order: rounding relative to their size.
        g, r = tf.convert_to_tensor(g).numpy(), tf.convert_to_tensor(r).numpy()
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4 + 1e-6 * np.abs(r).max(initial=0),
                                   err_msg=f"gradient {k}")


@pytest.mark.parametrize("units", [3, 40])
def test_double_tables_project_like_the_unfused_product(units):
    rng = np.random.default_rng(7)
    tables, sites, dense, kwargs, _ = make_stitch(rng, 500, SPECS, DENSE)
    tables = [t.astype(np.float64) for t in tables]
    kernel = rng.normal(size=(kwargs["width"], units))
    x = stitched_lookup(tables, [s["ids"] for s in sites], [s["seg"] for s in sites], None,
                        [s["num_segments"] for s in sites], [np.zeros(d.shape) for d in dense], **kwargs)
    out = project(tables, sites, kernel, kwargs)
    assert out.dtype == tf.float64
    np.testing.assert_allclose(out.numpy(), x.numpy() @ kernel, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("units", [2, 20])
def test_projection_gradients_are_bit_identical_across_runs(units):
    rng = np.random.default_rng(5)
    tables, sites, dense, kwargs, _ = make_stitch(rng, 3000, SPECS, DENSE)
    kernel = tf.constant(rng.normal(size=(kwargs["width"], units)).astype(np.float32))
    upstream = tf.constant(rng.normal(size=(3000, units)).astype(np.float32))

    def run():
        table_vars = [tf.Variable(t) for t in tables]

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                tape.watch(kernel)
                out = project([v.read_value() for v in table_vars], sites, kernel, kwargs)
                loss = tf.reduce_sum(out * upstream)
            return [out] + [tf.convert_to_tensor(g) for g in tape.gradient(loss, table_vars + [kernel])]
        return [x.numpy() for x in step()]

    for a, b in zip(run(), run()):
        np.testing.assert_array_equal(a, b)


def test_bad_ids_weights_and_kernels_are_named():
    rng = np.random.default_rng(1)
    tables, sites, _, kwargs, _ = make_stitch(rng, 10, SPECS[:2], {})
    kernel = np.ones((kwargs["width"], 1), np.float32)
    sites[1]["ids"][4] = 999
    for units in (1, 9):   # narrow, wide
        with pytest.raises(tf.errors.InvalidArgumentError, match=r"feature 'F1'.*got 999"):
            project(tables, sites, np.ones((kwargs["width"], units), np.float32), kwargs)
    sites[1]["ids"][4] = 0
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"kernel must be \[width"):
        project(tables, sites, np.ones((kwargs["width"] + 1, 9), np.float32), kwargs)
    with pytest.raises(tf.errors.InvalidArgumentError, match="feature 'F0' has per-id weights"):
        load().picasso_stitched_projection(
            tables=tables, ids=[s["ids"] for s in sites], segment_ids=[np.zeros(0, np.int64)] * 2,
            weights=[np.ones(len(sites[0]["ids"]), np.float32), np.zeros(0, np.float32)],
            num_segments=[np.int64(0)] * 2, kernel=kernel, **site_kwargs(kwargs))


def one_hot_row_gradient(ids, upstream, kernel):
    """A one-hot site's table gradient as the kernels compute it with one unit: per
    unique row (ascending), its entries' upstream summed in entry order in float32,
    times the kernel's column of that site."""
    rows = np.unique(ids)
    sums = {r: np.float32(0) for r in rows}
    for i, g in zip(ids, upstream[:, 0]):
        sums[i] = np.float32(sums[i] + g)
    return rows, np.stack([kernel[:, 0] * sums[r] for r in rows])


@pytest.mark.parametrize("rows", [37, 3000])   # 3000: large enough to run threaded
def test_a_one_hot_sites_gradient_sums_its_upstream_in_entry_order(rows):
    # The sums are made while the site's rows are grouped, from scratch kept between
    # calls; a call rejected for a bad id must leave none of its sums behind.
    rng = np.random.default_rng(rows)
    tables, sites, _, kwargs, _ = make_stitch(rng, rows, [(0, 50, "none", 1, False)], {})
    kernel = rng.normal(size=(kwargs["width"], 1)).astype(np.float32)
    upstream = rng.normal(size=(rows, 1)).astype(np.float32)

    def table_gradient(ids):
        # The gradient op itself: the forward would refuse a bad id before it runs.
        unique_rows, row_grads, _ = load().picasso_stitched_projection_grad(
            grad=upstream, kernel=kernel, tables=tables[:1], ids=[ids], segment_ids=[np.zeros(0, np.int64)],
            weights=[np.zeros(0, np.float32)], num_segments=[np.int64(0)], **site_kwargs(kwargs))
        return unique_rows[0].numpy(), row_grads[0].numpy()

    bad = sites[0]["ids"].copy()
    bad[-1] = 50
    expected_rows, expected = one_hot_row_gradient(sites[0]["ids"], upstream, kernel)
    for _ in range(2):
        with pytest.raises(tf.errors.InvalidArgumentError, match="feature 'F0'"):
            table_gradient(bad)
        unique_rows, row_grads = table_gradient(sites[0]["ids"])
        np.testing.assert_array_equal(unique_rows, expected_rows)
        np.testing.assert_array_equal(row_grads, expected)


def test_many_tables_clusters_are_grouped_together_and_the_first_bad_table_is_named():
    # Every table's clusters are grouped in one pass over the threads (6,000 rows: enough
    # entries to run threaded); a bad id is reported for the first table that has one.
    rng = np.random.default_rng(6)
    rows = 6000
    tables, sites, _, kwargs, _ = make_stitch(rng, rows, [(t, 50, "none", 1, False) for t in (0, 1, 2, 0, 1, 2)],
                                              {})
    kernel = rng.normal(size=(kwargs["width"], 1)).astype(np.float32)
    upstream = rng.normal(size=(rows, 1)).astype(np.float32)

    def table_gradients(ids):
        unique_rows, row_grads, _ = load().picasso_stitched_projection_grad(
            grad=upstream, kernel=kernel, tables=tables, ids=ids, segment_ids=[np.zeros(0, np.int64)] * 6,
            weights=[np.zeros(0, np.float32)] * 6, num_segments=[np.int64(0)] * 6, **site_kwargs(kwargs))
        return [u.numpy() for u in unique_rows], [g.numpy() for g in row_grads]

    ids = [s["ids"] for s in sites]
    unique_rows, row_grads = table_gradients(ids)
    for t in range(3):
        expected_rows, expected = [], []
        for i in (t, t + 3):   # the table's two sites, at offsets 0 and 50
            columns = slice(kwargs["columns"][i], kwargs["columns"][i] + tables[t].shape[1])
            r, g = one_hot_row_gradient(ids[i], upstream, kernel[columns])
            expected_rows.append(r + kwargs["offsets"][i])
            expected.append(g)
        np.testing.assert_array_equal(unique_rows[t], np.concatenate(expected_rows))
        np.testing.assert_array_equal(row_grads[t], np.concatenate(expected))
    bad = [x.copy() for x in ids]
    bad[5][0], bad[4][-1] = 77, 51   # tables 2 and 1
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"feature 'F4'.*got 51"):
        table_gradients(bad)
