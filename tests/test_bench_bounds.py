"""The dense-only bound (tools/benchmarking/models.dense_only) of every zoo model on the zoo
section's criteo-like and alibaba-like data, at toy sizes, from the tables picasso_tf's
analysis of the training forward finds (as the benchmark builds it): it is built, trains a
step without training any table but with the loss's gradient taken with respect to its
embeddings input (as a model whose tables train needs it), and that input is as wide as the
lookup outputs of the original model."""
import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from picasso_tf import models as zoo
from picasso_tf.graph.analysis import find_embedding_sites
from picasso_tf.graph.capture import capture, input_signature
from picasso_tf.tools.benchmarking import models as bm
from picasso_tf.tools.benchmarking import sections

# Its tests run on one pytest-xdist worker: they share the datasets module fixture.
pytestmark = pytest.mark.xdist_group("test_bench_bounds")

# The tiny mode's data with the fewest fields the alibaba-like models take: tracing the
# sequence models' steps dominates the time.
SIZES = dataclasses.replace(sections.MODES["tiny"], alibaba_onehot=2, alibaba_sequences=1, alibaba_seq_len=3)
ROWS = 16
PROBE_BATCH = 3


@pytest.fixture(scope="module")
def datasets():
    return {"criteo": sections.criteo_data(SIZES, ROWS, SIZES.zoo_max_buckets),
            "alibaba": sections.alibaba_data(SIZES, ROWS)}


def lookup_widths(model, tables):
    """Per-example widths of the lookup outputs one traced forward of `model` computes: the
    outputs of each call of a layer holding only tables, and each gather from a table held
    beside other weights. Found by running the model, not by walking its layer graph."""
    refs = {t.ref() for t in tables}
    pure = [layer for layer in model.layers if layer.weights and not isinstance(layer, tf.keras.Model)
            and {w.ref() for w in layer.weights} <= refs]
    in_pure = {w.ref() for layer in pure for w in layer.weights}
    widths = []

    def record(out):
        widths.extend(int(np.prod(o.shape[1:])) for o in tf.nest.flatten(out))
        return out

    def recording(call):
        return lambda *args, **kwargs: record(call(*args, **kwargs))

    for layer in pure:
        layer.call = recording(layer.call)
    specs = tf.nest.map_structure(lambda t: tf.TensorSpec([PROBE_BATCH] + t.shape[1:].as_list(), t.dtype),
                                  model.input)
    try:
        with bm.TableReads([t for t in tables if t.ref() not in in_pure]).replaced(
                lambda table, ids, original: record(original(ids))):
            tf.function(lambda x: model(x), autograph=False).get_concrete_function(specs)
    finally:
        for layer in pure:
            del layer.call
    return widths


@pytest.mark.parametrize("dataset", ["criteo", "alibaba"])
@pytest.mark.parametrize("name", zoo.list())
def test_every_zoo_cell_has_a_dense_only_bound(name, dataset, datasets):
    data = datasets[dataset]
    try:
        build = sections.zoo_builder(name, data.schema, data, SIZES)
    except sections.NotApplicable as e:
        pytest.skip(f"the zoo section records n/a: {e}")
    tf.keras.utils.set_random_seed(0)
    model = build()
    source = bm.batches(data, model, ROWS, 1)
    # The Program's training analysis (bm.analysed_tables) without the rest of the compile.
    tables = list(find_embedding_sites(capture(model, input_signature(model), training=True)).tables.values())
    assert tables

    bound, width = bm.dense_only(model, tables)
    assert width == sum(lookup_widths(model, tables))
    assert not {w.ref() for w in bound.trainable_weights} & {t.ref() for t in tables}
    # Eagerly: tracing the step would take most of the test's time; the bound's graph is
    # already traced when the model is built.
    bound.compile(optimizer=tf.keras.optimizers.Adagrad(0.01), loss="binary_crossentropy", run_eagerly=True)
    x, y = bm.bound_batches(bound, width, source)[0]
    gradients = [w for w in bound.trainable_weights if w.name.split("/")[-1].startswith("gradient")]
    # One per slice, and one per use of the whole input (DLRM reads it twice).
    assert sum(int(np.prod(w.shape)) for w in gradients) >= width
    assert np.isfinite(bound.train_on_batch(x, y))
    # The loss reaches the embeddings the model uses: they take a gradient (not every input:
    # a masked sequence position, or one behind a ReLU that is off for the whole batch).
    assert np.mean(np.concatenate([w.numpy().ravel() for w in gradients]) != 0) > 0.5
