"""Tables updated inside their gradient kernels (PicassoStitchedProjectionGradApply,
PicassoStitchedLookupGradApply): bit for bit the gradient then the sparse update, for
every optimizer form they serve; and the cases that must fall back or fail."""
import numpy as np
import pytest
import tensorflow as tf

from picasso_tf.ops import sparse_apply
from picasso_tf.ops.in_gradient import FixedTableUpdates, update_tables_in_gradient
from picasso_tf.ops.library import load
from picasso_tf.ops.packed_lookup import site_inputs
from picasso_tf.ops.stitched_lookup import stitched_lookup
from picasso_tf.ops.stitched_projection import stitched_projection
from test_ops_sparse_apply import FTRL_HP, HP, _adam_hp, _rms_hp
from test_ops_stitched_lookup import SPECS as LOOKUP_SPECS, make_stitch
from test_ops_stitched_projection import DENSE, SPECS, project

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


def shared_stitch(rng, rows, specs=SPECS):
    """make_stitch's, with sites 0 and 5 (both of table 0) reading the same rows, as a
    shared embedding does: their entries meet in one row's gradient and update."""
    tables, sites, dense, kwargs, _ = make_stitch(rng, rows, specs, DENSE)
    kwargs["offsets"][5] = kwargs["offsets"][0]
    return tables, sites, dense, kwargs


def projection(rng, rows, units):
    """(tables, forward(table values) -> output, its other differentiated inputs, upstream)."""
    tables, sites, _, kwargs = shared_stitch(rng, rows)
    kernel = tf.constant(rng.normal(size=(kwargs["width"], units)).astype(np.float32))
    upstream = tf.constant(rng.normal(size=(rows, units)).astype(np.float32))
    return tables, lambda values: project(values, sites, kernel, kwargs), [kernel], upstream


def lookup(rng, rows, specs=SPECS):
    tables, sites, dense, kwargs = shared_stitch(rng, rows, specs)
    dense = [tf.constant(x) for x in dense]

    def forward(values):
        return stitched_lookup(values, [s["ids"] for s in sites], [s["seg"] for s in sites],
                               [s["w"] for s in sites], [s["num_segments"] for s in sites], dense, **kwargs)
    upstream = tf.constant(rng.normal(size=(rows, kwargs["width"])).astype(np.float32))
    return tables, forward, dense, upstream


def _train_step(tables, slots, forward, others, upstream, make_update, in_kernel, name_sources=False):
    """One step of the tables and slots (variables made from the arrays), the update
    applied inside the gradient kernel or after it (lazy: the rows with a gradient),
    the hook told tf.gradients' sources if `name_sources`. Returns the gradients of
    `others`, then every variable's new value."""
    table_vars = [tf.Variable(t) for t in tables]
    slot_vars = [[tf.Variable(s) for s in per_table] for per_table in slots]
    updates = [make_update(s) for s in slot_vars]

    @tf.function
    def step():
        values = [v.read_value() for v in table_vars]
        loss = tf.reduce_sum(forward(values) * upstream)
        if in_kernel:
            hook = FixedTableUpdates(zip(table_vars, updates))
            with update_tables_in_gradient(hook, values + others if name_sources else None):
                grads = tf.gradients(loss, values + others)
            assert grads[:len(values)] == [None] * len(values), "the tables get no gradient of their own"
            ops = hook.ops
        else:
            grads = tf.gradients(loss, values + others)
            ops = [sparse_apply.apply(v, g.indices, g.values, u, lazy=True)
                   for v, g, u in zip(table_vars, grads, updates)]
        with tf.control_dependencies(ops):
            return [tf.identity(g) for g in grads[len(values):]]

    other_grads = [g.numpy() for g in step()]
    return other_grads + [v.numpy() for v in table_vars + [s for per in slot_vars for s in per]]


def _random_slots(rng, tables, num_slots):
    return [[rng.uniform(0.1, 1.0, size=t.shape).astype(np.float32) for _ in range(num_slots)] for t in tables]


@pytest.mark.parametrize("kernel", ["projection_narrow", "projection_wide", "lookup"])
@pytest.mark.parametrize("case", sorted(IN_KERNEL_UPDATES))
def test_gradient_applied_inside_the_kernel_equals_the_gradient_then_the_update(case, kernel):
    """3 tables (one of width 5, which takes the kernels' generic row path), one-hot,
    sequence and pooled sites, dense inputs of the lookup, 3000 rows (threaded)."""
    rng = np.random.default_rng(11)
    tables, forward, others, upstream = (lookup(rng, 3000) if kernel == "lookup" else
                                         projection(rng, 3000, 2 if kernel == "projection_narrow" else 20))
    num_slots, make_update = IN_KERNEL_UPDATES[case]
    args = (tables, _random_slots(rng, tables, num_slots), forward, others, upstream, make_update)
    fused, separate = _train_step(*args, in_kernel=True), _train_step(*args, in_kernel=False)
    assert not np.array_equal(fused[len(others)], tables[0]), "the tables were updated"
    for k, (a, b) in enumerate(zip(fused, separate)):
        np.testing.assert_array_equal(a, b, err_msg=f"output {k} (the others' gradients, then tables, slots)")


@pytest.mark.parametrize("case", ["adagrad_weight_decay", "amsgrad", "ftrl"])
def test_a_narrow_projection_updates_many_rows_block_by_block_as_the_update_after_it(case):
    """One-site tables with far more unique rows than the narrow projection's blocks of
    final rows (their optimizer rows prefetched beside the table rows), widths 8 and 5
    (the generic row path): bit for bit the gradient, then the update."""
    rng = np.random.default_rng(5)
    rows, vocabs, dims = 4000, (2000, 1500), (8, 5)
    tables = [rng.normal(size=(v, d)).astype(np.float32) for v, d in zip(vocabs, dims)]
    ids = [rng.integers(0, v, size=rows) for v in vocabs]
    kernel = tf.constant(rng.normal(size=(sum(dims), 1)).astype(np.float32))
    upstream = tf.constant(rng.normal(size=(rows, 1)).astype(np.float32))

    def forward(values):
        return stitched_projection(values, ids, kernel=kernel, table_index=[0, 1], columns=[0, dims[0]],
                                   row_blocks=[1, 1], width=sum(dims), offsets=[0, 0], vocab_sizes=list(vocabs),
                                   combiners=["none", "none"], feature_names=["a", "b"])

    num_slots, make_update = IN_KERNEL_UPDATES[case]
    args = (tables, _random_slots(rng, tables, num_slots), forward, [kernel], upstream, make_update)
    fused, separate = _train_step(*args, in_kernel=True), _train_step(*args, in_kernel=False)
    assert len(np.unique(ids[0])) > 1500, "many blocks of rows"
    assert not np.array_equal(fused[1], tables[0]), "the tables were updated"
    for k, (a, b) in enumerate(zip(fused, separate)):
        np.testing.assert_array_equal(a, b, err_msg=f"output {k} (the kernel's gradient, then tables, slots)")


@pytest.mark.parametrize("weights", ["sources_unnamed", "from_a_variable"])
def test_a_lookup_with_weighted_sites_returns_its_gradients_instead(weights):
    """A per-id weight's gradient reads the tables' values, so the tables cannot be
    updated before it: the gradient falls back to IndexedSlices where the weights may
    need one (tf.gradients' sources not named, or the weights made from a variable)."""
    rng = np.random.default_rng(3)
    tables, sites, dense, kwargs = shared_stitch(rng, 40, LOOKUP_SPECS)
    table_vars = [tf.Variable(t) for t in tables]
    scale = tf.Variable(1.0)
    accumulators = [tf.Variable(tf.ones_like(t)) for t in tables]
    hook = FixedTableUpdates((v, sparse_apply.adagrad_update(a, lr=0.1, epsilon=1e-7))
                             for v, a in zip(table_vars, accumulators))
    upstream = tf.constant(rng.normal(size=(40, kwargs["width"])).astype(np.float32))

    @tf.function
    def grads():
        values = [v.read_value() for v in table_vars]
        site_weights = [s["w"] if s["w"] is None or weights == "sources_unnamed" else s["w"] * scale
                        for s in sites]
        out = stitched_lookup(values, [s["ids"] for s in sites], [s["seg"] for s in sites], site_weights,
                              [s["num_segments"] for s in sites], [tf.constant(x) for x in dense], **kwargs)
        with update_tables_in_gradient(hook, None if weights == "sources_unnamed" else values + [scale]):
            return tf.gradients(tf.reduce_sum(out * upstream), values)

    assert all(isinstance(g, tf.IndexedSlices) for g in grads())
    assert hook.ops == []


def test_weights_no_source_reaches_leave_the_update_in_the_kernel():
    """Weighted sites whose weights no differentiable path joins to tf.gradients'
    sources (constants here; a sequence's mask made from its ids in a model) need no
    gradient: the kernel updates the tables, bit for bit as the separate update."""
    rng = np.random.default_rng(5)
    tables, forward, others, upstream = lookup(rng, 3000, LOOKUP_SPECS)
    num_slots, make_update = IN_KERNEL_UPDATES["adagrad_weight_decay"]
    args = (tables, _random_slots(rng, tables, num_slots), forward, others, upstream, make_update)
    fused = _train_step(*args, in_kernel=True, name_sources=True)
    separate = _train_step(*args, in_kernel=False)
    assert not np.array_equal(fused[len(others)], tables[0]), "the tables were updated"
    for k, (a, b) in enumerate(zip(fused, separate)):
        np.testing.assert_array_equal(a, b, err_msg=f"output {k} (the others' gradients, then tables, slots)")


@pytest.mark.parametrize("kernel", ["projection", "lookup"])
def test_gradient_apply_errors_name_the_problem(kernel):
    rng = np.random.default_rng(2)
    tables, forward, others, upstream = lookup(rng, 50) if kernel == "lookup" else projection(rng, 50, 1)
    args = (forward, others, upstream)
    good = _random_slots(rng, tables, 1)
    no_epsilon = lambda s: sparse_apply.Update("adagrad", s, dict(lr=0.1, weight_decay=0.0))  # noqa: E731
    with pytest.raises(tf.errors.InvalidArgumentError, match="no hyper-parameter named `epsilon`"):
        _train_step(tables, good, *args, no_epsilon, in_kernel=True)
    adagrad = IN_KERNEL_UPDATES["adagrad_weight_decay"][1]
    mixed = iter([adagrad, lambda s: sparse_apply.sgd_update(lr=0.1, momentum_slot=s[0], momentum=0.9)] * 2)
    with pytest.raises(ValueError, match="one kernel's tables need one update.*sgd"):
        _train_step(tables, good, *args, lambda s: next(mixed)(s), in_kernel=True)
    short = [[np.ones((t.shape[0] - 1, t.shape[1]), np.float32)] for t in tables]
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"slot 0 of table 0 has shape \[399,4\]"):
        _train_step(tables, short, *args, adagrad, in_kernel=True)


def test_bad_ids_and_tables_fail_before_any_table_or_slot_is_written():
    """The apply kernel called directly (in a step the forward lookup would catch a bad
    id first): each error leaves the tables and slots as they were."""
    rng = np.random.default_rng(5)
    tables, sites, dense, kwargs = shared_stitch(rng, 300)
    table_vars = [tf.Variable(t) for t in tables]
    accumulators = [tf.Variable(tf.fill(t.shape, 0.5)) for t in tables]
    site_kwargs = {k: kwargs[k] for k in ("offsets", "vocab_sizes", "combiners", "feature_names")}
    upstream = tf.constant(rng.normal(size=(300, kwargs["width"])).astype(np.float32))

    def apply(ids_of, num_rows=(400, 400, 400)):
        ids, segments, weights, num_segments = site_inputs(
            tf.float32, ids_of, [s["seg"] for s in sites], None, [s["num_segments"] for s in sites],
            op_name="test", **site_kwargs)
        load().picasso_stitched_lookup_grad_apply(
            grad=upstream, vars=[v.handle for v in table_vars], slots=[a.handle for a in accumulators],
            ids=ids, segment_ids=segments, weights=weights, num_segments=num_segments,
            hyper=[tf.constant(0.1), tf.constant(1e-7), tf.constant(0.0)],
            hyper_names=["lr", "epsilon", "weight_decay"], optimizer="adagrad", num_slots=1,
            table_index=kwargs["table_index"], num_rows=list(num_rows), dims=[t.shape[1] for t in tables],
            columns=kwargs["columns"], row_blocks=kwargs["row_blocks"], **site_kwargs)

    bad = [s["ids"].copy() for s in sites]
    bad[3][7] = 1000   # site F3: vocabulary 7
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"feature 'F3'.*1000"):
        apply(bad)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"table 1 has shape \[400,8\]; expected \[500,8\]"):
        apply([s["ids"] for s in sites], num_rows=(400, 500, 400))
    for variable, table in zip(table_vars, tables):
        np.testing.assert_array_equal(variable.numpy(), table)
    for accumulator in accumulators:
        np.testing.assert_array_equal(accumulator.numpy(), 0.5)
    apply([s["ids"] for s in sites])   # the same call with good inputs updates the tables
    assert not np.array_equal(table_vars[0].numpy(), tables[0])
