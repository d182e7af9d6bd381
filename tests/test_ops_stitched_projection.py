"""Stitched projections (PicassoStitchedProjection and its gradient): the product of a
stitched lookup with a narrow kernel (per entry) or a wide one (per unique row),
against the unfused stitched lookup and MatMul; and the gradient applied to the
tables inside its kernel, against the gradient then the sparse update."""
import numpy as np
import pytest
import tensorflow as tf

from picasso_tf.ops import sparse_apply
from picasso_tf.ops.library import load
from picasso_tf.ops.stitched_lookup import stitched_lookup
from picasso_tf.ops.stitched_projection import FixedTableUpdates, stitched_projection, update_tables_in_gradient
from test_ops_sparse_apply import FTRL_HP, HP, _adam_hp, _rms_hp
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


# -- the gradient applied inside the kernel (PicassoStitchedProjectionGradApply) ----------

# name -> (slots per table, the update of a table from its slot variables)
IN_KERNEL_UPDATES = {
    "sgd": (0, lambda s: sparse_apply.sgd_update(lr=HP["lr"])),
    "sgd_nesterov": (1, lambda s: sparse_apply.sgd_update(lr=HP["lr"], momentum_slot=s[0],
                                                          momentum=HP["momentum"], nesterov=True)),
    "adagrad_weight_decay": (1, lambda s: sparse_apply.adagrad_update(s[0], lr=HP["lr"], epsilon=HP["epsilon"],
                                                                      weight_decay=0.01)),
    "ftrl": (2, lambda s: sparse_apply.ftrl_update(*s, **FTRL_HP)),
    "amsgrad": (3, lambda s: sparse_apply.adam_update(s[0], s[1], vhat=s[2], **_adam_hp(tf.float32))),
    "rmsprop_centered_momentum": (3, lambda s: sparse_apply.rmsprop_update(
        s[0], average_gradient=s[1], momentum_slot=s[2], momentum=HP["momentum"], **_rms_hp())),
}


def _train_step(tables, slots, sites, kernel, upstream, kwargs, make_update, in_kernel):
    """One step of the projection's tables and slots (variables made from the arrays),
    the update applied inside the gradient kernel or after it (lazy: the rows with a
    gradient). Returns the kernel gradient and every variable's new value."""
    table_vars = [tf.Variable(t) for t in tables]
    slot_vars = [[tf.Variable(s) for s in per_table] for per_table in slots]
    updates = [make_update(s) for s in slot_vars]

    @tf.function
    def step():
        values = [v.read_value() for v in table_vars]
        loss = tf.reduce_sum(project(values, sites, kernel, kwargs) * upstream)
        if in_kernel:
            hook = FixedTableUpdates(zip(table_vars, updates))
            with update_tables_in_gradient(hook):
                *table_grads, kernel_grad = tf.gradients(loss, values + [kernel])
            assert table_grads == [None] * len(values), "the tables get no gradient of their own"
            ops = hook.ops
        else:
            *grads, kernel_grad = tf.gradients(loss, values + [kernel])
            ops = [sparse_apply.apply(v, g.indices, g.values, u, lazy=True)
                   for v, g, u in zip(table_vars, grads, updates)]
        with tf.control_dependencies(ops):
            return tf.identity(kernel_grad)

    kernel_grad = step().numpy()
    return [kernel_grad] + [v.numpy() for v in table_vars + [s for per in slot_vars for s in per]]


@pytest.mark.parametrize("units", [2, 20])   # a narrow projection, a wide one
@pytest.mark.parametrize("case", sorted(IN_KERNEL_UPDATES))
def test_gradient_applied_inside_the_kernel_equals_the_gradient_then_the_update(case, units):
    """Bit for bit, for every optimizer form it serves: 3 tables (one of width 5, which
    takes the kernel's generic row path), one-hot, sequence and pooled sites, 3000 rows."""
    rng = np.random.default_rng(11)
    tables, sites, _, kwargs, _ = make_stitch(rng, 3000, SPECS, DENSE)
    kernel = tf.constant(rng.normal(size=(kwargs["width"], units)).astype(np.float32))
    upstream = tf.constant(rng.normal(size=(3000, units)).astype(np.float32))
    num_slots, make_update = IN_KERNEL_UPDATES[case]
    slots = [[rng.uniform(0.1, 1.0, size=t.shape).astype(np.float32) for _ in range(num_slots)] for t in tables]
    args = (tables, slots, sites, kernel, upstream, kwargs, make_update)
    fused, separate = _train_step(*args, in_kernel=True), _train_step(*args, in_kernel=False)
    assert not np.array_equal(fused[1], tables[0]), "the tables were updated"
    for k, (a, b) in enumerate(zip(fused, separate)):
        np.testing.assert_array_equal(a, b, err_msg=f"output {k} (0: kernel gradient, then tables, slots)")


def test_gradient_apply_errors_name_the_problem():
    rng = np.random.default_rng(2)
    tables, sites, _, kwargs, _ = make_stitch(rng, 50, SPECS, DENSE)
    kernel = tf.constant(rng.normal(size=(kwargs["width"], 1)).astype(np.float32))
    upstream = tf.ones([50, 1])
    good = [[np.ones(t.shape, np.float32)] for t in tables]
    no_epsilon = lambda s: sparse_apply.Update("adagrad", s, dict(lr=0.1, weight_decay=0.0))  # noqa: E731
    with pytest.raises(tf.errors.InvalidArgumentError, match="no hyper-parameter named `epsilon`"):
        _train_step(tables, good, sites, kernel, upstream, kwargs, no_epsilon, in_kernel=True)
    adagrad = IN_KERNEL_UPDATES["adagrad_weight_decay"][1]
    mixed = iter([adagrad, lambda s: sparse_apply.sgd_update(lr=0.1, momentum_slot=s[0], momentum=0.9)] * 2)
    with pytest.raises(ValueError, match="one projection's tables need one update.*sgd"):
        _train_step(tables, good, sites, kernel, upstream, kwargs, lambda s: next(mixed)(s), in_kernel=True)
    short = [[np.ones((t.shape[0] - 1, t.shape[1]), np.float32)] for t in tables]
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"slot 0 of table 0 has shape \[399,4\]"):
        _train_step(tables, short, sites, kernel, upstream, kwargs, adagrad, in_kernel=True)
