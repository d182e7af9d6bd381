"""The fused packed-table ops (custom_ops/packed_lookup_ops.cc) against NumPy and stock TF."""
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from picasso_tf.ops.packed_lookup import packed_lookup, packed_lookup_grad, packed_unique


# ---------------------------------------------------------------------------------
# Random sites and a NumPy reference

def make_sites(rng, specs, id_dtype=np.int64):
    """specs: (vocab, n, combiner, num_segments, weighted, sorted_segments) per site.

    Returns the site inputs plus the attrs, with sites packed one after another and a
    gap of unused rows between them (offsets are not contiguous).
    """
    sites, offsets, vocab_sizes, combiners, names = [], [], [], [], []
    offset = 3
    for k, (vocab, n, combiner, num_segments, weighted, sorted_segments) in enumerate(specs):
        # Zipf-like: many repeats of small ids, some distinct large ones.
        ids = np.minimum(rng.zipf(1.3, size=n) - 1, vocab - 1).astype(id_dtype)
        rng.shuffle(ids)
        seg = None
        if combiner != "none":
            seg = rng.integers(0, num_segments, size=n) if num_segments else np.zeros(0, np.int64)
            if sorted_segments:
                seg = np.sort(seg)
        w = rng.uniform(0.2, 2.0, size=n).astype(np.float32) if weighted else None
        sites.append(dict(ids=ids, seg=seg, w=w, num_segments=num_segments))
        offsets.append(offset)
        vocab_sizes.append(vocab)
        combiners.append(combiner)
        names.append(f"F{k}")
        offset += vocab + 5
    return sites, dict(offsets=offsets, vocab_sizes=vocab_sizes, combiners=combiners,
                       feature_names=names), offset


def np_lookup(table, site, offset, combiner):
    rows = table[site["ids"].astype(np.int64) + offset].astype(np.float64)
    w = np.ones(len(site["ids"])) if site["w"] is None else site["w"].astype(np.float64)
    rows = rows * w[:, None]
    if combiner == "none":
        return rows
    out = np.zeros((site["num_segments"], table.shape[1]))
    den = np.zeros(site["num_segments"])
    np.add.at(out, site["seg"], rows)
    np.add.at(den, site["seg"], w * w if combiner == "sqrtn" else w)
    if combiner == "sum":
        return out
    den = den if combiner == "mean" else np.sqrt(den)
    return np.divide(out, den[:, None], out=np.zeros_like(out), where=den[:, None] != 0)


def run_lookup(table, sites, attrs):
    return packed_lookup(
        table, [s["ids"] for s in sites], [s["seg"] for s in sites],
        [s["w"] for s in sites], [s["num_segments"] for s in sites], **attrs)


MIXED_SPECS = [
    # vocab, n, combiner, num_segments, weighted, sorted segments
    (50, 300, "none", 0, False, True),
    (7, 200, "none", 0, True, True),        # heavy duplicates, weighted
    (1000, 0, "none", 0, False, True),      # empty batch
    (100, 400, "sum", 64, False, True),
    (100, 400, "sum", 64, True, False),     # unsorted segment ids
    (30, 250, "mean", 100, False, True),    # some empty segments
    (30, 250, "mean", 40, True, False),
    (500, 300, "sqrtn", 90, False, False),
    (500, 300, "sqrtn", 90, True, True),
    (20, 0, "mean", 5, True, True),         # no ids: all rows zero
    (2, 60, "sum", 3, False, True),         # two distinct ids only
    # Vocabularies much wider than their ids: grouped by sorting (radix, std::sort).
    (200000, 3000, "none", 0, True, True),
    (200000, 100, "mean", 30, True, False),
]


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_lookup_matches_numpy(id_dtype):
    rng = np.random.default_rng(0)
    sites, attrs, rows = make_sites(rng, MIXED_SPECS, id_dtype)
    table = rng.normal(size=(rows, 6)).astype(np.float32)
    outs = run_lookup(tf.constant(table), sites, attrs)
    assert len(outs) == len(sites)
    for site, out, offset, combiner in zip(sites, outs, attrs["offsets"], attrs["combiners"]):
        np.testing.assert_allclose(out.numpy(), np_lookup(table, site, offset, combiner),
                                   rtol=1e-5, atol=1e-5)


def test_lookup_large_inputs_use_threads_and_match_numpy():
    # Big enough for the multithreaded path (several work items per site).
    rng = np.random.default_rng(1)
    specs = [(20000, 60000, "none", 0, False, True), (20000, 60000, "sum", 4096, True, True),
             (5000, 50000, "mean", 3000, False, False), (30000, 40000, "sqrtn", 4096, True, True)]
    sites, attrs, rows = make_sites(rng, specs)
    table = rng.normal(size=(rows, 16)).astype(np.float32)
    outs = run_lookup(tf.constant(table), sites, attrs)
    for site, out, offset, combiner in zip(sites, outs, attrs["offsets"], attrs["combiners"]):
        np.testing.assert_allclose(out.numpy(), np_lookup(table, site, offset, combiner),
                                   rtol=1e-4, atol=1e-4)


def test_lookup_float64_and_static_shapes():
    table = tf.constant(np.arange(40, dtype=np.float64).reshape(10, 4))

    @tf.function
    def f(ids_a, ids_b, seg_b):
        return packed_lookup(table, [ids_a, ids_b], [None, seg_b], num_segments_list=[None, 3],
                             offsets=[0, 5], vocab_sizes=[5, 5], combiners=["none", "mean"],
                             feature_names=["a", "b"])

    concrete = f.get_concrete_function(tf.TensorSpec([7], tf.int64), tf.TensorSpec([None], tf.int64),
                                       tf.TensorSpec([None], tf.int64))
    assert [o.shape.as_list() for o in concrete.structured_outputs] == [[7, 4], [3, 4]]
    a, b = f(tf.constant([3, 1, 3, 0, 0, 4, 2], tf.int64), tf.constant([0, 2, 2, 4], tf.int64),
             tf.constant([1, 0, 1, 1], tf.int64))
    np.testing.assert_array_equal(a.numpy(), table.numpy()[[3, 1, 3, 0, 0, 4, 2]])
    np.testing.assert_array_equal(b.numpy(), [[28, 29, 30, 31], [28, 29, 30, 31], [0, 0, 0, 0]])


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_lookup_matches_tf_embedding_lookup_sparse(combiner, weighted):
    rng = np.random.default_rng(2)
    batch, dim, vocabs = 33, 5, [40, 9]
    tables = [rng.normal(size=(v, dim)).astype(np.float32) for v in vocabs]
    packed = np.concatenate(tables)
    offsets = [0, vocabs[0]]
    ids_list, seg_list, w_list, expected, expected_safe = [], [], [], [], []
    for vocab, table in zip(vocabs, tables):
        lengths = rng.integers(0, 5, size=batch)  # some examples have no ids
        ragged_ids = tf.RaggedTensor.from_row_lengths(
            rng.integers(0, vocab, size=lengths.sum()), lengths)
        ragged_w = tf.RaggedTensor.from_row_lengths(
            rng.uniform(0.5, 2.0, size=lengths.sum()).astype(np.float32), lengths)
        sp_ids, sp_w = ragged_ids.to_sparse(), ragged_w.to_sparse() if weighted else None
        expected.append(tf.nn.embedding_lookup_sparse(table, sp_ids, sp_w, combiner=combiner))
        expected_safe.append(tf.nn.safe_embedding_lookup_sparse(table, sp_ids, sp_w,
                                                                combiner=combiner))
        ids_list.append(sp_ids.values)
        seg_list.append(sp_ids.indices[:, 0])
        w_list.append(sp_w.values if weighted else None)
    outs = packed_lookup(packed, ids_list, seg_list, w_list, [batch, batch], offsets=offsets,
                         vocab_sizes=vocabs, combiners=[combiner] * 2, feature_names=["a", "b"])
    for out, exp, safe in zip(outs, expected, expected_safe):
        # embedding_lookup_sparse drops trailing empty examples; those rows are zeros here.
        np.testing.assert_allclose(out.numpy()[:exp.shape[0]], exp.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out.numpy()[exp.shape[0]:], 0)
        np.testing.assert_allclose(out.numpy(), safe.numpy(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------
# PicassoPackedUnique

@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
def test_unique_matches_numpy(id_dtype):
    rng = np.random.default_rng(3)
    ids_list = [rng.integers(0, 10, size=(20, 3)), rng.integers(0, 1000, size=5000),
                np.zeros(0), rng.integers(0, 10, size=7), rng.integers(0, 300, size=70000),
                rng.integers(0, 10**7, size=5000), rng.zipf(1.2, size=(10, 5)) % 10**6]
    ids_list = [x.astype(id_dtype) for x in ids_list]
    # Sites 0 and 3 share rows (a shared table); site 1 overlaps site 4's range. Sites
    # 5 and 6 have wide vocabularies (grouped by radix sort and by std::sort).
    offsets = [5, 2000, 0, 5, 2500, 3000, 3000 + 10**7]
    vocab_sizes = [10, 1000, 3, 10, 300, 10**7, 10**6]
    unique_rows, inverse, counts = packed_unique(ids_list, offsets, vocab_sizes,
                                                 [f"F{i}" for i in range(len(ids_list))])
    packed = np.concatenate([x.reshape(-1).astype(np.int64) + o for x, o in zip(ids_list, offsets)])
    want_rows, want_inverse, want_counts = np.unique(packed, return_inverse=True, return_counts=True)
    np.testing.assert_array_equal(unique_rows.numpy(), want_rows)
    np.testing.assert_array_equal(counts.numpy(), want_counts)
    got_inverse = np.concatenate([i.numpy().reshape(-1) for i in inverse])
    np.testing.assert_array_equal(got_inverse, want_inverse)
    assert [i.shape for i in inverse] == [x.shape for x in ids_list]
    assert all(i.dtype == tf.int32 for i in inverse)


def test_unique_with_vocabularies_beyond_2_pow_32():
    ids = [np.array([2**40 - 1, 7, 2**35, 7], np.int64), np.array([9, 2**33], np.int64)]
    unique_rows, inverse, counts = packed_unique(ids, [0, 2**40], [2**40, 2**41], ["h0", "h1"])
    np.testing.assert_array_equal(unique_rows.numpy(),
                                  [7, 2**35, 2**40 - 1, 2**40 + 9, 2**40 + 2**33])
    np.testing.assert_array_equal(inverse[0].numpy(), [2, 0, 1, 0])
    np.testing.assert_array_equal(inverse[1].numpy(), [3, 4])
    np.testing.assert_array_equal(counts.numpy(), [2, 1, 1, 1, 1])


def test_unique_rejects_out_of_range_ids():
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"ids of feature 'C7' must lie in \[0, 1000\): got 1234 at position 17"):
        ids = np.arange(30) % 1000
        ids[17], ids[25] = 1234, 5000
        packed_unique([np.arange(5), ids], [0, 5], [5, 1000], ["C1", "C7"])


def test_a_rejected_call_leaves_nothing_behind_for_the_next():
    # Grouping keeps its byte map between calls on a thread (small inputs run on the
    # calling thread); rows marked before a bad id must not reappear in the next call.
    for _ in range(2):
        with pytest.raises(tf.errors.InvalidArgumentError, match="feature 'C1'"):
            packed_unique([np.array([3, 1, 4, 1000]), np.array([2])], [0, 0], [1000, 1000], ["C1", "C2"])
        unique_rows, inverse, counts = packed_unique([np.array([9, 9, 2])], [0], [1000], ["C1"])
        np.testing.assert_array_equal(unique_rows.numpy(), [2, 9])
        np.testing.assert_array_equal(inverse[0].numpy(), [1, 1, 0])
        np.testing.assert_array_equal(counts.numpy(), [1, 2])


# ---------------------------------------------------------------------------------
# Gradients

def stock_lookup(table, sites, attrs):
    """The same lookups with stock TF ops (gather + unsorted segment sums)."""
    outs = []
    for site, offset, combiner in zip(sites, attrs["offsets"], attrs["combiners"]):
        rows = tf.gather(table, tf.cast(site["ids"], tf.int64) + offset)
        w = site["w"] if site["w"] is not None else tf.ones(len(site["ids"]), table.dtype)
        rows = rows * w[:, None]
        if combiner == "none":
            outs.append(rows)
            continue
        out = tf.math.unsorted_segment_sum(rows, site["seg"], site["num_segments"])
        if combiner != "sum":
            den = tf.math.unsorted_segment_sum(w if combiner == "mean" else w * w, site["seg"],
                                               site["num_segments"])
            den = den if combiner == "mean" else tf.sqrt(den)
            out = tf.math.divide_no_nan(out, den[:, None])
        outs.append(out)
    return outs


def weighted_loss(outs, coefficients):
    return tf.add_n([tf.reduce_sum(o * c) for o, c in zip(outs, coefficients)])


def densify(grad):
    assert isinstance(grad, tf.IndexedSlices), type(grad)
    return tf.convert_to_tensor(grad).numpy()


def gradient_case(seed=4):
    rng = np.random.default_rng(seed)
    sites, attrs, rows = make_sites(rng, MIXED_SPECS)
    table = rng.normal(size=(rows, 6)).astype(np.float32)
    coefficients = []
    for site, combiner in zip(sites, attrs["combiners"]):
        out_rows = len(site["ids"]) if combiner == "none" else site["num_segments"]
        coefficients.append(rng.normal(size=(out_rows, 6)).astype(np.float32))
    return sites, attrs, table, coefficients


def test_gradient_graph_mode_tf_gradients():
    sites, attrs, table, coefficients = gradient_case()
    var = tf.Variable(table)

    @tf.function
    def grads():
        fused = weighted_loss(run_lookup(var.read_value(), sites, attrs), coefficients)
        stock = weighted_loss(stock_lookup(var, sites, attrs), coefficients)
        return tf.gradients(fused, var)[0], tf.gradients(stock, var)[0]

    fused, stock = grads()
    assert isinstance(fused, tf.IndexedSlices)
    rows = fused.indices.numpy()
    assert np.all(np.diff(rows) > 0), "unique rows must ascend"
    np.testing.assert_allclose(densify(fused), densify(stock), rtol=1e-5, atol=1e-5)


def test_gradient_eager_tape_and_weights():
    sites, attrs, table, coefficients = gradient_case(seed=5)
    var = tf.Variable(table)
    weights = {i: tf.Variable(s["w"]) for i, s in enumerate(sites) if s["w"] is not None}

    def with_weights():
        return [dict(s, w=weights.get(i)) for i, s in enumerate(sites)]

    with tf.GradientTape(persistent=True) as tape:
        fused = weighted_loss(run_lookup(var, with_weights(), attrs), coefficients)
        stock = weighted_loss(stock_lookup(var, with_weights(), attrs), coefficients)
    fused_grads = tape.gradient(fused, [var] + list(weights.values()))
    stock_grads = tape.gradient(stock, [var] + list(weights.values()))
    np.testing.assert_allclose(densify(fused_grads[0]), densify(stock_grads[0]),
                               rtol=1e-5, atol=1e-5)
    for f, s, w in zip(fused_grads[1:], stock_grads[1:], weights.values()):
        if w.shape[0] == 0:  # an empty weights tensor means "all ones": no gradient
            assert f is None
        else:
            np.testing.assert_allclose(f.numpy(), s.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(fused.numpy(), stock.numpy(), rtol=1e-5)


def test_gradient_when_an_output_gradient_is_indexed_slices():
    var = tf.Variable(np.arange(40, dtype=np.float32).reshape(10, 4))
    with tf.GradientTape() as tape:
        out, = packed_lookup(var, [tf.constant([3, 1, 3])], offsets=[2], vocab_sizes=[5],
                             combiners=["none"], feature_names=["a"])
        loss = tf.reduce_sum(tf.gather(out, [0, 2]) * 3.0)  # gather: IndexedSlices for `out`
    expected = np.zeros((10, 4), np.float32)
    expected[5] = 6.0
    np.testing.assert_array_equal(densify(tape.gradient(loss, var)), expected)


LARGE_CASES = {
    # Clusters of about a third of the work each: one work item per cluster.
    "several clusters": [(20000, 80000, "none", 0, True, True), (20000, 80000, "mean", 4096, True, False),
                         (20000, 80000, "sqrtn", 4096, False, True), (500, 20000, "sum", 1000, True, True)],
    # One cluster holding nearly all the work: cut by rows into a work item per thread.
    "one dominant cluster": [(20000, 160000, "sum", 8192, True, False), (500, 2000, "none", 0, False, True)],
}


def large_case(case="several clusters"):
    """Sites big enough for several work items per site and per thread."""
    rng = np.random.default_rng(6)
    sites, attrs, rows = make_sites(rng, LARGE_CASES[case])
    table = tf.constant(rng.normal(size=(rows, 16)).astype(np.float32))
    grads = [tf.constant(rng.normal(size=(len(s["ids"]) if c == "none" else s["num_segments"], 16))
                         .astype(np.float32)) for s, c in zip(sites, attrs["combiners"])]
    args = ([tf.constant(s["ids"]) for s in sites],
            [tf.zeros([0], tf.int64) if s["seg"] is None else tf.constant(s["seg"]) for s in sites],
            [tf.zeros([0]) if s["w"] is None else tf.constant(s["w"]) for s in sites],
            [tf.constant(s["num_segments"], tf.int64) for s in sites])
    return sites, attrs, rows, table, grads, args


def large_case_digest(case="several clusters"):
    """SHA-256 of a large case's lookup outputs and table gradient."""
    sites, attrs, rows, table, grads, args = large_case(case)
    digest = hashlib.sha256()
    for out in run_lookup(table, sites, attrs):
        digest.update(out.numpy().tobytes())
    for out in packed_lookup_grad(grads, *args, num_rows=[rows], dims=[16], **attrs):
        digest.update(out[0].numpy().tobytes())
    return digest.hexdigest()


def test_grad_op_is_sparse_and_bit_identical_across_runs():
    sites, attrs, rows, table, grads, args = large_case()
    first, second = ([t for (t,) in packed_lookup_grad(grads, *args, num_rows=[rows], dims=[16], **attrs)]
                     for _ in range(2))
    assert first[1].shape[0] < rows  # one row per distinct id, not the table
    np.testing.assert_array_equal(first[0].numpy(), second[0].numpy())
    assert first[1].numpy().tobytes() == second[1].numpy().tobytes()
    out1 = run_lookup(table, sites, attrs)
    out2 = run_lookup(table, sites, attrs)
    assert all(a.numpy().tobytes() == b.numpy().tobytes() for a, b in zip(out1, out2))
    # And the values: the stock-TF gradient of sum(out * grads), densified here only.
    with tf.GradientTape() as tape:
        tape.watch(table)
        loss = weighted_loss(stock_lookup(table, sites, attrs), grads)
    dense = tf.convert_to_tensor(tape.gradient(loss, table)).numpy()
    np.testing.assert_allclose(first[1].numpy(), dense[first[0].numpy()], rtol=1e-4, atol=1e-4)
    untouched = np.setdiff1d(np.arange(rows), first[0].numpy())
    assert not dense[untouched].any()


@pytest.mark.parametrize("case", sorted(LARGE_CASES))
def test_bit_identical_with_one_thread(case):
    # This process uses every core; a fresh one is limited to one intra-op thread.
    script = ("import tensorflow as tf; tf.config.threading.set_intra_op_parallelism_threads(1); "
              "from tests.test_ops_packed_lookup import large_case_digest; "
              f"print(large_case_digest({case!r}))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == large_case_digest(case)


# ---------------------------------------------------------------------------------
# Errors

def lookup_one(ids, combiner="none", seg=None, w=None, num_segments=None, vocab=1000,
               name="C7", table_rows=1010):
    table = tf.zeros([table_rows, 4])
    return packed_lookup(table, [tf.constant(np.arange(3)), ids], [None, seg], [None, w],
                         [None, num_segments], offsets=[0, 10], vocab_sizes=[10, vocab],
                         combiners=["none", combiner], feature_names=["C1", name])


@pytest.mark.parametrize("id_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("combiner", ["none", "sum"])
def test_out_of_range_ids_name_feature_value_and_position(id_dtype, combiner):
    ids = (np.arange(40) % 1000).astype(id_dtype)
    ids[17], ids[30] = 1234, -3
    seg = np.arange(40) % 4 if combiner != "none" else None
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"ids of feature 'C7' must lie in \[0, 1000\): got 1234 at "
                             r"position 17; raise the feature's vocabulary size"):
        lookup_one(ids, combiner, seg, num_segments=4)
    ids[17] = 5
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"'C7'.*got -3 at position 30"):
        lookup_one(ids, combiner, seg, num_segments=4)


def test_an_id_weighted_zero_is_checked_though_its_row_is_not_read():
    """The kernels skip the row of an id weighted 0 (a padded position: it adds nothing),
    not the id's check."""
    ids = np.arange(40) % 1000
    ids[17] = 1234
    w = np.ones(40, np.float32)
    w[17] = 0.0
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"'C7'.*got 1234 at position 17"):
        lookup_one(ids, "sum", np.arange(40) % 4, w=w, num_segments=4)


def test_bad_segment_ids_and_shapes_name_feature():
    ids = np.arange(6)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"segment ids of feature 'C7' must lie in \[0, 3\).*got 3 at position 4"):
        lookup_one(ids, "mean", np.array([0, 0, 1, 2, 3, 1]), num_segments=3)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"feature 'C7' has combiner 'sum' and 6 ids, so segment_ids needs 6"):
        lookup_one(ids, "sum", np.array([0, 0, 1]), num_segments=3)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"weights of feature 'C7'.*got 2"):
        lookup_one(ids, "none", w=np.ones(2, np.float32))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"feature 'C7' has combiner 'none' \(no pooling\), so its segment_ids"):
        lookup_one(ids, "none", np.zeros(6, np.int64))
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"feature 'C7' occupies rows \[10, 1010\) of table 0 of the op, which has 500"):
        lookup_one(ids, table_rows=500)
    with pytest.raises(ValueError, match=r"feature 'C7' has combiner 'max'"):
        lookup_one(ids, "max")


def test_unpooled_ids_of_any_shape_give_ids_shape_plus_dim():
    rng = np.random.default_rng(5)
    table = tf.Variable(rng.standard_normal((30, 4)).astype(np.float32))
    seq, flat = rng.integers(0, 10, (6, 3)), rng.integers(0, 20, 5)
    kwargs = dict(offsets=[0, 10], vocab_sizes=[10, 20], combiners=["none", "none"], feature_names=["seq", "one"])
    with tf.GradientTape() as tape:
        out_seq, out_flat = packed_lookup(table.read_value(), [seq, flat], **kwargs)
        loss = tf.reduce_sum(out_seq * out_seq) + tf.reduce_sum(out_flat)
    assert out_seq.shape == (6, 3, 4) and out_flat.shape == (5, 4)
    np.testing.assert_array_equal(out_seq.numpy(), table.numpy()[seq])
    np.testing.assert_array_equal(out_flat.numpy(), table.numpy()[flat + 10])
    grad = tape.gradient(loss, table)
    with tf.GradientTape() as tape:
        ref = tf.gather(table, seq)
        ref_loss = tf.reduce_sum(ref * ref) + tf.reduce_sum(tf.gather(table, flat + 10))
    np.testing.assert_allclose(tf.convert_to_tensor(grad).numpy(),
                               tf.convert_to_tensor(tape.gradient(ref_loss, table)).numpy(), rtol=1e-6)


@pytest.mark.parametrize("combiner", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_pooling_by_row_matches_the_masked_reduction_it_replaces(combiner, weighted):
    """ids [B, L] pooled without segment ids: each row of ids pools into one output row,
    weighted by a [B, L, 1] tensor, with the gradients of the table and of the weights."""
    rng = np.random.default_rng(6)
    table = tf.Variable(rng.standard_normal((30, 4)).astype(np.float32))
    seq = rng.integers(0, 30, (7, 5))
    w_value = (rng.random((7, 5, 1)) < 0.6).astype(np.float32) * rng.uniform(0.5, 2, (7, 5, 1)).astype(np.float32)
    w_value[2] = 0.0          # a row with no weight: the mean gives zeros, like divide_no_nan
    weights = tf.Variable(w_value) if weighted else None
    upstream = rng.standard_normal((7, 4)).astype(np.float32)
    with tf.GradientTape(persistent=True) as tape:
        [out] = packed_lookup(table.read_value(), [seq], weights_list=[weights], offsets=[0], vocab_sizes=[30],
                              combiners=[combiner], feature_names=["seq"])
        loss = tf.reduce_sum(out * upstream)
        rows = tf.gather(table, seq)
        w = weights if weighted else tf.ones((7, 5, 1))
        ref = tf.reduce_sum(rows * w, 1)
        if combiner == "mean":
            ref = tf.math.divide_no_nan(ref, tf.reduce_sum(w, 1))
        ref_loss = tf.reduce_sum(ref * upstream)
    assert out.shape == (7, 4)
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(tf.convert_to_tensor(tape.gradient(loss, table)).numpy(),
                               tf.convert_to_tensor(tape.gradient(ref_loss, table)).numpy(), rtol=1e-5, atol=1e-6)
    if weighted:
        np.testing.assert_allclose(tape.gradient(loss, weights).numpy(), tape.gradient(ref_loss, weights).numpy(),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("length, combiner", [(1, "mean"), (3, "mean"), (7, "mean"), (49, "mean"), (50, "mean"),
                                              (97, "mean"), (3, "sum"), (49, "sum"), (3, "sqrtn"), (49, "sqrtn")])
def test_pooling_by_row_equals_pooling_by_the_same_segment_ids(length, combiner):
    """Without segment ids the kernels work out each entry's segment (j // L) from its
    position: over 10^5 rows they pool, scale and sum the gradient exactly as with those
    segment ids given."""
    rng = np.random.default_rng(length)
    rows, vocab = 100_000, 1000
    table = tf.Variable(rng.standard_normal((vocab, 4)).astype(np.float32))
    ids = rng.integers(0, vocab, (rows, length))
    weights = rng.uniform(0.5, 2, (rows, length)).astype(np.float32)
    upstream = tf.constant(rng.standard_normal((rows, 4)).astype(np.float32))
    kwargs = dict(offsets=[0], vocab_sizes=[vocab], combiners=[combiner], feature_names=["seq"])
    with tf.GradientTape(persistent=True) as tape:
        [by_row] = packed_lookup(table.read_value(), [ids], weights_list=[weights], **kwargs)
        [by_ids] = packed_lookup(table.read_value(), [ids.reshape(-1)], [np.arange(rows * length) // length],
                                 [weights.reshape(-1)], [rows], **kwargs)
        loss_row, loss_ids = tf.reduce_sum(by_row * upstream), tf.reduce_sum(by_ids * upstream)
    np.testing.assert_array_equal(by_row.numpy(), by_ids.numpy())
    np.testing.assert_array_equal(tf.convert_to_tensor(tape.gradient(loss_row, table)).numpy(),
                                  tf.convert_to_tensor(tape.gradient(loss_ids, table)).numpy())


def test_pooling_by_row_of_empty_sequences_and_bad_weights():
    table = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4))
    kwargs = dict(offsets=[0], vocab_sizes=[3], combiners=["mean"], feature_names=["seq"])
    variable = tf.Variable(table)
    with tf.GradientTape() as tape:
        [out] = packed_lookup(variable.read_value(), [tf.zeros((4, 0), tf.int64)], **kwargs)
    np.testing.assert_array_equal(out.numpy(), np.zeros((4, 4)))
    np.testing.assert_array_equal(tf.convert_to_tensor(tape.gradient(out, variable)).numpy(), np.zeros((3, 4)))
    with pytest.raises(tf.errors.InvalidArgumentError, match="weights of feature 'seq'"):
        packed_lookup(table, [tf.zeros((4, 2), tf.int64)], weights_list=[tf.ones((4, 1, 1))], **kwargs)
