"""Stitched projections (PicassoStitchedProjection and its gradient): the product of a
stitched lookup with a narrow kernel, against the unfused stitched lookup and MatMul."""
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
    return stitched_projection(table_values, [s["ids"] for s in sites], [s["seg"] for s in sites],
                               [s["num_segments"] for s in sites], kernel=kernel, **site_kwargs(kwargs))


@pytest.mark.parametrize("units", [1, 3])
@pytest.mark.parametrize("rows", [0, 1, 37, 3000])   # 3000: large enough to run threaded
@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_projection_and_its_gradients_match_the_unfused_product(units, rows, id_dtype):
    rng = np.random.default_rng(rows + units)
    tables, sites, dense, kwargs, _ = make_stitch(rng, rows, SPECS, DENSE, id_dtype)
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
    np.testing.assert_allclose(out.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)
    for k, (g, r) in enumerate(zip(grads, ref_grads)):
        if k < len(tables) and rows:
            assert isinstance(g, tf.IndexedSlices), "table gradients stay row-sparse"
            assert np.all(np.diff(g.indices.numpy()) > 0), "unique rows, ascending"
        np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), tf.convert_to_tensor(r).numpy(),
                                   rtol=1e-4, atol=1e-4, err_msg=f"gradient {k}")


def test_projection_gradients_are_bit_identical_across_runs():
    rng = np.random.default_rng(5)
    tables, sites, _, kwargs, _ = make_stitch(rng, 3000, SPECS, DENSE)
    kernel = tf.constant(rng.normal(size=(kwargs["width"], 2)).astype(np.float32))
    upstream = tf.constant(rng.normal(size=(3000, 2)).astype(np.float32))

    def run():
        table_vars = [tf.Variable(t) for t in tables]
        with tf.GradientTape() as tape:
            tape.watch(kernel)
            out = project([v.read_value() for v in table_vars], sites, kernel, kwargs)
            loss = tf.reduce_sum(out * upstream)
        grads = tape.gradient(loss, table_vars + [kernel])
        return [out.numpy()] + [tf.convert_to_tensor(g).numpy() for g in grads]

    for a, b in zip(run(), run()):
        np.testing.assert_array_equal(a, b)


def test_bad_ids_weights_and_kernels_are_named():
    rng = np.random.default_rng(1)
    tables, sites, _, kwargs, _ = make_stitch(rng, 10, SPECS[:2], {})
    kernel = np.ones((kwargs["width"], 1), np.float32)
    sites[1]["ids"][4] = 999
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"feature 'F1'.*got 999"):
        project(tables, sites, kernel, kwargs)
    sites[1]["ids"][4] = 0
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"kernel must be \[width"):
        project(tables, sites, np.ones((kwargs["width"], 9), np.float32), kwargs)
    with pytest.raises(tf.errors.InvalidArgumentError, match="feature 'F0' has per-id weights"):
        load().picasso_stitched_projection(
            tables=tables, ids=[s["ids"] for s in sites], segment_ids=[np.zeros(0, np.int64)] * 2,
            weights=[np.ones(len(sites[0]["ids"]), np.float32), np.zeros(0, np.float32)],
            num_segments=[np.int64(0)] * 2, kernel=kernel, **site_kwargs(kwargs))
