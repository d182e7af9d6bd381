"""Interleaving. D-interleaving: a step over K micro-batches equals the whole batch's
(losses and weights, SGD / Adagrad / exact Adam, K dividing the batch or not, a batch
smaller than K, recurrent and zoo models, mixed precision), starting from the embedding
layer or from the MLP (whose fused lookups run once), the fused lookups' backward once
per step (a stitched lookup reading a pooled sequence too); micro-batch i waits for
micro-batch i-2's backward, and under "auto" for micro-batch i-1's; batch
normalisation, masked outputs and losses that are not batch means are refused with the
reason; "auto" picks K by Eq. 2 (hand-computed examples) and trains like the whole
batch, or keeps a coupled batch whole. K-interleaving: Eq. 3's groups, chained by
control dependencies as planned, training unchanged."""
import functools

import numpy as np
import pytest
import tensorflow as tf

import picasso_tf as picasso
from picasso_tf.errors import UnsupportedModelError
from picasso_tf.passes.interleaving import interleaving_groups
from picasso_tf.runtime.micro_batches import _inputs_by_arg
from picasso_tf.runtime.micro_batch_planner import eq2_micro_batch_size, micro_batch_count

# Its tests run on one pytest-xdist worker: they share the whole-batch and zoo trainings, cached for the module.
pytestmark = pytest.mark.xdist_group("test_interleaving")

BATCH = 30
FIELDS = [("u", 40, 8), ("i", 60, 8), ("c", 20, 16)]


def build(batch_norm=False, bias=False, regularizer="l2"):
    """Three embeddings concatenated into an MLP; with `bias`, a per-user bias embedding
    added to the logit, concatenated with nothing. The regularizer reads the tables
    beside the lookups, so their gradient kernels cannot update them in place."""
    tf.keras.utils.set_random_seed(3)
    x = {n: tf.keras.Input((), dtype="int64", name=n) for n, _, _ in FIELDS}
    x["price"] = tf.keras.Input((1,), name="price")
    parts = [tf.keras.layers.Embedding(v, d, name=f"emb_{n}", embeddings_regularizer=regularizer)(x[n])
             for n, v, d in FIELDS]
    h = tf.keras.layers.Concatenate()(parts + [x["price"]])
    if batch_norm:
        h = tf.keras.layers.BatchNormalization()(h)
    h = tf.keras.layers.Dense(8, activation="relu")(h)
    if not bias:
        return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(h))
    logit = tf.keras.layers.Add()([tf.keras.layers.Dense(1)(h), tf.keras.layers.Embedding(40, 1, name="bias_u")(x["u"])])
    return tf.keras.Model(x, tf.keras.layers.Activation("sigmoid")(logit))


def batches(steps, rows=BATCH, seed=0):
    rng = np.random.default_rng(seed)
    return [({**{n: rng.zipf(1.3, rows) % v for n, v, _ in FIELDS}, "price": rng.random((rows, 1), np.float32)},
             (rng.random(rows) < 0.4).astype("float32")) for _ in range(steps)]


def train(k, optimizer, data, regularizer="l2", **options):
    model = picasso.optimize(build(regularizer=regularizer), micro_batches=k, **options)
    model.compile(optimizer=tf.keras.optimizers.get(optimizer), loss="binary_crossentropy", metrics=["AUC"])
    losses = [model.train_on_batch(x, y, return_dict=True) for x, y in data]
    return [r["loss"] for r in losses], [r["auc"] for r in losses], [w.numpy() for w in model.weights]


@functools.lru_cache(maxsize=None)
def whole_batch(optimizer, steps, regularizer="l2", stitching=True):
    """train(1, ...) on batches(steps): the whole batch's step, which several tests
    compare their micro-batches with, trained once for all of them."""
    return train(1, optimizer, batches(steps), regularizer, stitching=stitching)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_micro_batches_train_like_the_whole_batch(optimizer):
    data = batches(4)
    whole_losses, whole_auc, whole_weights = whole_batch(optimizer, 4)
    for k in (2, 4, 7):                   # 7 does not divide the batch of 30
        losses, auc, weights = train(k, optimizer, data)
        np.testing.assert_allclose(losses, whole_losses, rtol=1e-5, err_msg=f"k={k}")
        np.testing.assert_allclose(auc, whole_auc, rtol=1e-6, err_msg=f"k={k}")
        for a, b in zip(weights, whole_weights):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"k={k}")


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
@pytest.mark.parametrize("stitching", [True, False])      # a projection / packed lookups into a concat
def test_micro_batches_from_the_mlp_train_like_the_whole_batch(optimizer, stitching):
    data = batches(4)
    whole_losses, whole_auc, whole_weights = whole_batch(optimizer, 4, stitching=stitching)
    for k in (2, 4, 7):
        losses, auc, weights = train(k, optimizer, data, interleave_from="mlp", stitching=stitching)
        np.testing.assert_allclose(losses, whole_losses, rtol=1e-5, err_msg=f"k={k}")
        np.testing.assert_allclose(auc, whole_auc, rtol=1e-6, err_msg=f"k={k}")
        for a, b in zip(weights, whole_weights):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"k={k}")


def _step_graph(model, batch=None):
    x, y = batch or batches(1)[0]
    specs = ({k: tf.TensorSpec([None] + list(np.shape(v))[1:], tf.as_dtype(v.dtype)) for k, v in x.items()},
             tf.TensorSpec([None], tf.float32))
    return tf.function(model.train_step, autograph=False).get_concrete_function(specs).graph


def _op_counts(model, types, batch=None):
    ops = [op.type for op in _step_graph(model, batch).get_operations()
           if not op.name.startswith("picasso_whole_batch/")]
    return {t: ops.count(t) for t in types}


@pytest.mark.parametrize("start, copies", [("embedding", 3), ("mlp", 1)])
def test_fused_lookups_are_differentiated_once_per_step(start, copies):
    """From the MLP the fused lookups run once on the whole batch; from the embedding
    each micro-batch runs its own copy of them. Either way their backward runs once
    (from the embedding, on the copies' inputs joined, whose whole-batch lookup is
    never run)."""
    model = picasso.optimize(build(), micro_batches=3, interleave_from=start, stitching=False)
    model.compile(optimizer="adagrad", loss="binary_crossentropy")
    fused = len(model.picasso.program.lookups["training"])
    counts = _op_counts(model, ["PicassoPackedLookup", "PicassoPackedLookupGrad"])
    assert counts == {"PicassoPackedLookup": fused * copies, "PicassoPackedLookupGrad": fused}


@pytest.mark.parametrize("stitching", [True, False])
def test_the_whole_batch_lookup_reads_the_ids_as_fed(stitching):
    """From the embedding, the gathered backward's lookup takes each feature's ids as
    they were fed to the step, not its micro-batches' parts concatenated again."""
    model = picasso.optimize(build(), micro_batches=3, stitching=stitching)
    model.compile(optimizer="adagrad", loss="binary_crossentropy")
    wholes = [op for op in _step_graph(model).get_operations() if op.name.startswith("picasso_whole_batch/")]
    ids = [_inputs_by_arg(op)["ids"] for op in wholes]
    assert wholes and all(t.op.type == "Placeholder" for site in ids for t in site), \
        [(t.name, t.op.type) for site in ids for t in site]


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("stitching", [True, False])      # a projection / packed lookups into a concat
def test_micro_batches_from_the_embedding_update_tables_as_the_whole_batch_does(optimizer, stitching):
    """From the embedding, the step's table updates are those of the whole batch's
    step: one gradient kernel per fused lookup whatever K, updating its tables in place
    where K=1's does (config.apply_in_gradient), the same separate row-sparse updates
    otherwise, and no table's row gradients summed across micro-batches (no Unique or
    UnsortedSegmentSum); and it trains like the whole batch."""
    kernels = ["PicassoStitchedProjection", "PicassoStitchedProjectionGrad", "PicassoStitchedProjectionGradApply",
               "PicassoPackedLookupGrad", "PicassoPackedLookupGradApply", "PicassoSparseApplySgd",
               "PicassoSparseApplyAdagrad", "Unique", "UnsortedSegmentSum"]
    counts = {}
    for k in (1, 3):
        model = picasso.optimize(build(regularizer=None), micro_batches=k, stitching=stitching)
        model.compile(optimizer=optimizer, loss="binary_crossentropy")
        counts[k] = _op_counts(model, kernels)
    assert counts[1]["PicassoStitchedProjectionGradApply" if stitching else "PicassoPackedLookupGradApply"] > 0, \
        counts[1]
    assert counts[3] == dict(counts[1], PicassoStitchedProjection=3 * counts[1]["PicassoStitchedProjection"])
    data = batches(3)
    whole_losses, _, whole_weights = whole_batch(optimizer, 3, regularizer=None, stitching=stitching)
    for k in (2, 7):
        losses, _, weights = train(k, optimizer, data, regularizer=None, stitching=stitching)
        np.testing.assert_allclose(losses, whole_losses, rtol=1e-5, err_msg=f"k={k}")
        for a, b in zip(weights, whole_weights):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"k={k}")


def build_sequence(experts=1):
    """A behaviour sequence mean-pooled by its mask, as the zoo's MMoE pools one, beside
    the users' embeddings; with two `experts` their concatenation is not one MatMul's
    input, so it is stitched as it is, the pooled sequence copied in (MMoE's layout)."""
    tf.keras.utils.set_random_seed(5)
    x = {"u": tf.keras.Input((), dtype="int64", name="u"), "hist": tf.keras.Input((SEQ,), dtype="int64", name="hist")}
    emb = tf.keras.layers.Embedding(60, 8, name="emb_hist")(x["hist"])
    mask = tf.expand_dims(tf.cast(tf.not_equal(x["hist"], 0), tf.float32), -1)
    pooled = tf.reduce_sum(emb * mask, 1) / tf.maximum(tf.reduce_sum(mask, 1), 1.0)
    h = tf.keras.layers.Concatenate()([pooled, tf.keras.layers.Embedding(40, 8, name="emb_u")(x["u"])])
    h = tf.keras.layers.Add()([tf.keras.layers.Dense(8, activation="relu")(h) for _ in range(experts)]
                              ) if experts > 1 else tf.keras.layers.Dense(8, activation="relu")(h)
    return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(h))


SEQ = 6


def sequence_batches(steps, rows=BATCH):
    rng = np.random.default_rng(4)
    return [({"u": rng.zipf(1.3, rows) % 40, "hist": rng.zipf(1.3, (rows, SEQ)) % 60},
             (rng.random(rows) < 0.4).astype("float32")) for _ in range(steps)]


def _unpooled_tensors(model):
    """The float tensors of the traced step whose shape is a behaviour sequence's
    unpooled rows [batch, SEQ, 8]."""
    return [t for op in _step_graph(model, sequence_batches(1)[0]).get_operations() for t in op.outputs
            if t.dtype == tf.float32 and t.shape.rank == 3 and t.shape[1:] == [SEQ, 8]]


def test_micro_batches_from_the_mlp_share_pooled_embeddings():
    """From the MLP, the whole batch's unpooled sequence rows are computed, and their
    gradient taken, as often as in a step without micro-batches: the cut lies past the
    pooling, and the lookups' backward takes the gathered gradient as it is. (Cut at
    the lookups' outputs, every micro-batch sliced, pooled and differentiated the
    unpooled rows, and the lookups' backward went through their product with the
    gathered gradient: at batch 1024 MMoE's step peaked at 3.6x the whole batch's.)"""
    steps = {}
    for k, start in ((1, "embedding"), (3, "mlp")):
        # sequence_pooling=False: else the lookups pool the sequences, and no unpooled rows exist.
        model = picasso.optimize(build_sequence(), micro_batches=k, interleave_from=start, stitching=False,
                                 sequence_pooling=False)
        model.compile(optimizer="adagrad", loss="binary_crossentropy")
        steps[k] = model
    whole = _unpooled_tensors(steps[1])
    assert whole, "the model has no unpooled sequence tensor to look for"
    assert len(_unpooled_tensors(steps[3])) == len(whole), [t.op.type for t in _unpooled_tensors(steps[3])]
    data = sequence_batches(3)
    losses = {k: [m.train_on_batch(x, y) for x, y in data] for k, m in steps.items()}
    np.testing.assert_allclose(losses[3], losses[1], rtol=1e-5)
    for a, b in zip(steps[3].weights, steps[1].weights):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def test_a_stitched_lookup_reading_a_pooled_sequence_is_differentiated_once_per_step():
    """MMoE's layout: a stitched lookup whose dense input is a pooled sequence, another
    fused lookup's output. From the embedding its backward too runs once per step, as at
    K=1 (its tables updated in place, no row gradient summed across micro-batches): each
    micro-batch takes its dense input's gradient back to the sequence lookup's output,
    whose backward is gathered with the rest. It trains like the whole batch."""
    kernels = ["PicassoStitchedLookup", "PicassoStitchedLookupGrad", "PicassoStitchedLookupGradApply",
               "PicassoPackedLookup", "PicassoPackedLookupGrad", "PicassoSparseApplyAdagrad", "Unique",
               "UnsortedSegmentSum"]
    counts = {}
    for k in (1, 3):
        model = picasso.optimize(build_sequence(experts=2), micro_batches=k)
        model.compile(optimizer="adagrad", loss="binary_crossentropy")
        counts[k] = _op_counts(model, kernels, sequence_batches(1)[0])
    assert counts[1]["PicassoStitchedLookupGradApply"] == 1, counts[1]
    assert counts[3] == dict(counts[1], PicassoStitchedLookup=3, PicassoPackedLookup=3)
    data = sequence_batches(3)
    # sequence_pooling=False: the sequence's lookup, unpooled, is not gathered, and is
    # differentiated in each micro-batch from the stitched lookup's dense input.
    for optimizer, k, options in (("adagrad", 7, {}), ("adam", 2, {}), ("adagrad", 3, {"sequence_pooling": False})):
        results = []
        for micro_batches in (1, k):
            model = picasso.optimize(build_sequence(experts=2), micro_batches=micro_batches, **options)
            model.compile(optimizer=optimizer, loss="binary_crossentropy")
            results.append(([model.train_on_batch(x, y) for x, y in data], [w.numpy() for w in model.weights]))
        np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5, err_msg=optimizer)
        for a, b in zip(results[1][1], results[0][1]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=optimizer)


@pytest.mark.parametrize("start", ["embedding", "mlp"])
def test_what_reads_only_weights_runs_once_per_step(start):
    """Dense packing stacks and lays out the experts' kernels each step, from the weights
    alone: with micro-batches that part runs once per step, each micro-batch reads its
    result, and the stacked kernels' gradient (Unpack, into the experts' kernels) is
    taken once from the micro-batches' summed, as at K=1. (The test above trains this
    model like the whole batch.)"""
    def step_ops(k):
        model = picasso.optimize(build_sequence(experts=2), micro_batches=k, interleave_from=start)
        model.compile(optimizer="adagrad", loss="binary_crossentropy")
        return _step_graph(model, sequence_batches(1)[0]).get_operations()

    whole, micro = step_ops(1), step_ops(3)
    unpacks = [[op for op in ops if op.type == "Unpack" and "dense_pack" in op.name and "_grad" in op.name]
               for ops in (whole, micro)]
    assert len(unpacks[0]) == 2 and len(unpacks[1]) == 2, unpacks
    products = [op for op in micro if op.type == "MatMul" and "dense_pack" in op.name and "_grad" not in op.name
                and op.outputs[0].consumers()]
    assert len(products) == 3 and all(op.inputs[1].name.startswith("picasso_invariants/") for op in products), \
        [(op.name, op.inputs[1].name) for op in products]


@pytest.mark.parametrize("start", ["embedding", "mlp"])
def test_micro_batches_under_mixed_precision_train_like_the_whole_batch(start):
    """The loss scale (a LossScaleOptimizer) is applied once to the gathered gradients
    of the fused lookups' outputs, as to every other gradient. (They were unscaled
    twice, and the tables barely moved.)"""
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        data = batches(3)
        results = []
        for k in (1, 3):
            model = picasso.optimize(build(regularizer=None), micro_batches=k, interleave_from=start)
            model.compile(optimizer=tf.keras.optimizers.SGD(0.5), loss="binary_crossentropy")
            results.append(([model.train_on_batch(x, y) for x, y in data], [w.numpy() for w in model.weights]))
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    # float16 activations: the micro-batches' losses differ from the batch's in the
    # fourth digit, and the weights by much less than a step's update (about 1e-2).
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=2e-3)
    for a, b in zip(results[1][1], results[0][1]):
        np.testing.assert_allclose(a, b, atol=2e-4)


def test_a_batch_smaller_than_k_trains_like_the_whole_batch():
    data = batches(2, rows=3)
    whole, _, whole_weights = train(1, "adagrad", data)
    losses, _, weights = train(4, "adagrad", data)
    np.testing.assert_allclose(losses, whole, rtol=1e-5)
    for a, b in zip(weights, whole_weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _backwards_waited_for(model, k):
    """Per micro-batch, the backward passes (tf.gradients scopes: "gradients" is
    micro-batch 0's, "gradients_1" micro-batch 1's, ...) its inputs wait for."""
    graph = _step_graph(model)
    waits = {}
    for i in range(k):
        gates = [op for op in graph.get_operations() if f"picasso_micro_batch_{i}/" in op.name]
        waits[i] = {c.name.split("/")[0] for op in gates for c in op.control_inputs if c.name.startswith("gradients")}
    return waits


def _scope(i):
    return "gradients" if i == 0 else f"gradients_{i}"


@pytest.mark.parametrize("start", ["embedding", "mlp"])
def test_an_explicit_k_runs_two_micro_batches_at_a_time(start):
    """With an explicit K, micro-batch i waits for micro-batch i-2's backward: two run at
    a time (their ops scheduled as they become ready), at most two alive."""
    explicit = picasso.optimize(build(), micro_batches=4, interleave_from=start)
    explicit.compile(optimizer="adagrad", loss="binary_crossentropy")
    assert _backwards_waited_for(explicit, 4) == {0: set(), 1: set(), 2: {_scope(0)}, 3: {_scope(1)}}
    second = [op for op in _step_graph(explicit).get_operations() if "picasso_micro_batch_1/" in op.name]
    assert second and not any(op.control_inputs for op in second), "micro-batch 1 waits for micro-batch 0"


def test_auto_runs_micro_batches_one_at_a_time():
    """Under "auto", chosen for memory, micro-batch i waits for micro-batch i-1's
    backward, so one micro-batch's activations are alive at a time."""
    roomy, data = _auto(2**40)
    roomy.compile(optimizer="adagrad", loss="binary_crossentropy")
    roomy.train_on_batch(*data[0])
    auto, _ = _auto(int(_auto_plan(roomy)["per_sample_bytes"] * 8.5))
    auto.compile(optimizer="adagrad", loss="binary_crossentropy")
    assert _backwards_waited_for(auto, 4) == {0: set(), 1: {_scope(0)}, 2: {_scope(1)}, 3: {_scope(2)}}
    assert _auto_plan(auto)["chosen"] == 4


def test_batch_normalisation_is_refused_with_the_reason():
    with pytest.raises(UnsupportedModelError, match="batch_normalization.*reduces over the batch"):
        picasso.optimize(build(batch_norm=True), micro_batches=2)
    # The check is the interleaving pass's: micro-batches without it are refused, never unchecked.
    with pytest.raises(ValueError, match="micro_batches=2 needs the interleaving pass"):
        picasso.optimize(build(batch_norm=True), micro_batches=2, interleaving=False)


def test_a_loss_that_is_not_a_batch_mean_is_refused():
    model = picasso.optimize(build(), micro_batches=2)
    model.compile(optimizer="adagrad", loss=tf.keras.losses.BinaryCrossentropy(reduction="sum"))
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match="reduction='sum'"):
        model.train_on_batch(x, y)


def test_a_masked_output_is_refused():
    x = tf.keras.Input((5,), dtype="int64", name="seq")
    out = tf.keras.layers.Dense(1, activation="sigmoid")(tf.keras.layers.Embedding(20, 4, mask_zero=True)(x))
    model = picasso.optimize(tf.keras.Model(x, out), micro_batches=2)
    model.compile(optimizer="adagrad", loss="binary_crossentropy")
    ids = np.array([[1, 2, 0, 0, 0], [3, 4, 5, 0, 0]] * 4)
    with pytest.raises(UnsupportedModelError, match="carries a Keras mask"):
        model.train_on_batch({"seq": ids}, np.ones((8, 5, 1), np.float32))


def test_a_recurrent_model_trains_like_the_whole_batch():
    """A GRU's loop functions are imported once per micro-batch, each its own copy."""
    def build_gru():
        tf.keras.utils.set_random_seed(4)
        x = tf.keras.Input((5,), dtype="int64", name="hist")
        h = tf.keras.layers.GRU(4)(tf.keras.layers.Embedding(30, 8)(x))
        return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(h))

    rng = np.random.default_rng(2)
    data = [({"hist": rng.integers(0, 30, (12, 5))}, (rng.random(12) < 0.5).astype("float32")) for _ in range(3)]
    results = []
    for k in (1, 3):
        model = picasso.optimize(build_gru(), micro_batches=k)
        model.compile(optimizer="adam", loss="binary_crossentropy")
        results.append(([model.train_on_batch(x, y) for x, y in data], [w.numpy() for w in model.weights]))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5)
    for a, b in zip(results[1][1], results[0][1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@functools.lru_cache(maxsize=None)
def zoo_training(name, k, start="embedding"):
    """Zoo model `name`'s losses and weights over two steps of micro_batches=k from
    `start`. K=1's step (where `start` means nothing) is trained once for both starts."""
    from test_zoo import MIXED, random_data, zoo
    data = random_data(MIXED, 64 * 2, seed=3)
    steps = [(data.take(np.arange(s * 64, (s + 1) * 64)).features, data.take(np.arange(s * 64, (s + 1) * 64)).label_dict)
             for s in range(2)]
    tf.keras.utils.set_random_seed(1)
    model = picasso.optimize(zoo.build(name, MIXED), micro_batches=k, interleave_from=start)
    model.compile(optimizer=tf.keras.optimizers.Adagrad(0.05), loss="binary_crossentropy")
    return np.ravel([model.train_on_batch(x, y) for x, y in steps]), [w.numpy() for w in model.weights]


@pytest.mark.parametrize("name, start", [("din", "embedding"), ("dien", "embedding"), ("mmoe", "embedding"),
                                         ("din", "mlp"), ("dien", "mlp"), ("can", "mlp")])
def test_zoo_models_train_like_the_whole_batch(name, start):     # sequences and attention, a GRU, two heads
    (whole_losses, whole_weights), (losses, weights) = zoo_training(name, 1), zoo_training(name, 3, start)
    np.testing.assert_allclose(losses, whole_losses, rtol=1e-5)
    for a, b in zip(weights, whole_weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_interleaving_groups_follow_eq_3_capacity():
    assert interleaving_groups([4, 4, 2, 6], 2) == [[0, 1], [2, 3]]     # capacity 8
    assert interleaving_groups([10, 1, 1], 2) == [[0], [1, 2]]          # a lookup above capacity alone
    assert interleaving_groups([1, 1, 1], 5) == [[0], [1], [2]]         # never more groups than lookups
    assert interleaving_groups([3, 3], 1) == [[0, 1]]


def test_interleaving_groups_are_chained_and_training_is_unchanged():
    def optimized(groups):
        return picasso.optimize(build(), interleave_groups=groups, stitching=False)

    chained = optimized(2)
    [report] = [p for p in chained.picasso.reports["training"]["passes"] if p["pass"] == "k_interleave"]
    assert report["changed"] and len(report["groups"]) == 2
    nodes = {n.name: n for n in chained.rewritten_forward().captured.graph_def.node}
    first, second = report["groups"]
    for name in first:
        assert not [i for i in nodes[name].input if i.startswith("^picasso")]
    for name in second:
        assert {f"^{b}" for b in first} <= set(nodes[name].input), name
    data = batches(3)
    losses = {}
    for groups, model in ((1, optimized(1)), (2, chained)):
        model.compile(optimizer="adagrad", loss="binary_crossentropy")
        losses[groups] = [model.train_on_batch(x, y) for x, y in data]
    np.testing.assert_array_equal(losses[2], losses[1])


def _interleave_report(model):
    [report] = [p for p in model.picasso.reports["training"]["passes"] if p["pass"] == "k_interleave"]
    return report


def _control_inputs(model):
    """Per fused lookup node, the nodes it has control inputs on."""
    nodes = {n.name: n for n in model.rewritten_forward().captured.graph_def.node}
    return {r.node: {i[1:] for i in nodes[r.node].input if i.startswith("^")}
            for r in model.picasso.program.lookups["training"]}


def test_lookups_not_concatenated_with_other_embeddings_are_excluded_from_the_chains():
    model = picasso.optimize(build(bias=True), interleave_groups=2, stitching=False)
    report = _interleave_report(model)
    [excluded] = report["excluded"]
    assert excluded["features"] == ["u"] and "not concatenated" in excluded["why"]
    controls = _control_inputs(model)
    assert report["changed"]
    assert not controls[excluded["node"]], "an excluded lookup waits for a group"
    assert not any(excluded["node"] in c for c in controls.values()), "a group waits for an excluded lookup"
    first, second = report["groups"]
    assert excluded["node"] not in first + second
    assert all(controls[n] == set(first) for n in second) and all(not controls[n] for n in first)
    data = batches(3)
    losses = []
    for groups in (1, 2):
        model = picasso.optimize(build(bias=True), interleave_groups=groups, stitching=False)
        model.compile(optimizer="adagrad", loss="binary_crossentropy")
        losses.append([model.train_on_batch(x, y) for x, y in data])
    np.testing.assert_array_equal(losses[1], losses[0])


def test_a_preset_of_excluded_embeddings_replaces_the_rule():
    model = picasso.optimize(build(bias=True), interleave_groups=2, stitching=False, interleave_excluded=["c"])
    report = _interleave_report(model)
    [excluded] = report["excluded"]
    assert excluded["features"] == ["c"] and "interleave_excluded names ['c']" in excluded["why"]
    controls = _control_inputs(model)
    first, second = report["groups"]
    assert not controls[excluded["node"]] and not any(excluded["node"] in c for c in controls.values())
    assert all(controls[n] == set(first) for n in second)     # the bias lookup is chained now
    with pytest.raises(ValueError, match="no fused lookup reads"):
        picasso.optimize(build(), interleave_groups=2, stitching=False, interleave_excluded=["nope"])


def test_eq_2_on_hand_computed_examples():
    assert eq2_micro_batch_size([(1000, 10)]) == 100
    assert eq2_micro_batch_size([(1000, 10), (600, 12)]) == 50        # the min over ops' bounds
    assert eq2_micro_batch_size([(1000, 30)]) == 33                   # whole samples
    assert eq2_micro_batch_size([(10, 30)]) == 0                      # one sample is over the bound
    assert micro_batch_count(30, 10) == 3
    assert micro_batch_count(30, 7) == 5                              # 5 x 6 <= 7, not a divisor
    assert micro_batch_count(31, 10) == 4                             # 8, 8, 8, 7
    assert micro_batch_count(30, 30) == micro_batch_count(30, 100) == 1
    assert micro_batch_count(30, eq2_micro_batch_size([(10, 0)])) == 1
    assert micro_batch_count(30, 0) == 30


def _auto(budget, model=None, **options):
    data = batches(4)
    warmup = tf.data.Dataset.from_tensor_slices(data[0]).batch(BATCH)
    return picasso.optimize(model or build(), micro_batches="auto", micro_batch_memory_budget=budget,
                            warmup_data=warmup, **options), data


def _auto_plan(model):
    [report] = [p for p in model.picasso.reports["training"]["passes"] if p["pass"] == "k_interleave"]
    return report["micro_batches"]


def test_auto_picks_k_by_eq_2_and_trains_like_the_whole_batch():
    roomy, data = _auto(2**40)
    roomy.compile(optimizer="adagrad", loss="binary_crossentropy")
    roomy.train_on_batch(*data[0])
    plan = _auto_plan(roomy)
    assert plan["chosen"] == 1 and "stays whole" in plan["why"] and plan["per_sample_bytes"] > 0
    # Room for 8 samples' activations: Eq. 2 gives micro-batches of 8, so 4 for the batch of 30.
    tight, data = _auto(int(plan["per_sample_bytes"] * 8.5))
    whole_losses, _, whole_weights = whole_batch("adagrad", 4)
    tight.compile(optimizer="adagrad", loss="binary_crossentropy")
    losses = [tight.train_on_batch(x, y) for x, y in data]
    plan = _auto_plan(tight)
    assert (plan["chosen"], plan["micro_batch_size"]) == (4, 8), plan
    assert "Eq. 2" in plan["why"] and "4 of them" in tight.picasso.report()
    np.testing.assert_allclose(losses, whole_losses, rtol=1e-5)
    for a, b in zip([w.numpy() for w in tight.weights], whole_weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_auto_keeps_each_micro_batchs_lookup_backward():
    """K chosen for memory does not hold the whole batch's lookup output gradients: each
    micro-batch differentiates its own copy of the fused lookups, and the step trains
    like the whole batch."""
    roomy, _ = _auto(2**40, stitching=False)
    roomy.compile(optimizer="adagrad", loss="binary_crossentropy")
    roomy.train_on_batch(*batches(1)[0])
    model, data = _auto(int(_auto_plan(roomy)["per_sample_bytes"] * 8.5), stitching=False)
    model.compile(optimizer="adagrad", loss="binary_crossentropy")
    losses = [model.train_on_batch(x, y) for x, y in data]
    assert _auto_plan(model)["chosen"] == 4
    fused = len(model.picasso.program.lookups["training"])
    assert _op_counts(model, ["PicassoPackedLookupGrad"]) == {"PicassoPackedLookupGrad": 4 * fused}
    whole_losses, _, _ = whole_batch("adagrad", 4, stitching=False)
    np.testing.assert_allclose(losses, whole_losses, rtol=1e-5)


def test_auto_keeps_a_coupled_batch_whole_with_the_reason():
    model, data = _auto(1, build(batch_norm=True))
    model.compile(optimizer="adagrad", loss="binary_crossentropy")
    model.train_on_batch(*data[0])
    plan = _auto_plan(model)
    assert plan["chosen"] == 1 and "batch_normalization" in plan["why"], plan
