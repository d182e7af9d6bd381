"""Imported loops get the static shapes of the tensors fed to them.

The rewritten graph is captured with an unknown batch size; Keras traces the original
model's step on the batch it is fed. The rewritten step's loops (a GRU, a custom RNN
cell reading its weights inside the loop) and their gradient loops must see the same
static shapes as the original's, or Grappler's fusions and constant folding in them are
lost. A loop variable that changes shape from one iteration to the next keeps the shape
it was captured with.
"""
import numpy as np
import tensorflow as tf

import picasso_tf as picasso

BATCH, SEQ_LEN, VOCAB, UNITS = 16, 5, 40, 4


class GatedCell(tf.keras.layers.Layer):
    """A minimal RNN cell whose weights are read inside the loop (as DIEN's AUGRU does)."""

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = self.state_size = self.output_size = units

    def build(self, input_shape):
        self.kernel = self.add_weight(name="kernel", shape=(int(input_shape[-1]), self.units))
        self.bias = self.add_weight(name="bias", shape=(self.units,), initializer="zeros")

    def call(self, inputs, states):
        h = tf.tanh(tf.matmul(inputs, self.kernel) + self.bias + states[0])
        return h, [h]


class Doubling(tf.keras.layers.Layer):
    """A loop whose variable doubles along its first axis every iteration."""

    def build(self, input_shape):
        self.scale = self.add_weight(name="scale", shape=(int(input_shape[-1]),), initializer="ones")

    def call(self, x):
        _, grown = tf.while_loop(lambda i, y: i < 2, lambda i, y: (i + 1, tf.concat([y, y * self.scale], 0)),
                                 (tf.constant(0), x),
                                 shape_invariants=(tf.TensorShape([]), tf.TensorShape([None, x.shape[-1]])))
        return tf.reduce_sum(tf.reshape(grown, [4, -1, x.shape[-1]]), 0)


def recurrent_model():
    ids = tf.keras.Input((SEQ_LEN,), dtype=tf.int64, name="hist")
    user = tf.keras.Input((), dtype=tf.int64, name="user")
    emb = tf.keras.layers.Embedding(VOCAB, 8)
    seq = emb(ids)
    parts = [tf.keras.layers.GRU(UNITS)(seq), tf.keras.layers.RNN(GatedCell(UNITS))(seq),
             Doubling()(emb(user))]
    out = tf.keras.layers.Dense(1, activation="sigmoid")(tf.keras.layers.Concatenate()(parts))
    return tf.keras.Model({"hist": ids, "user": user}, out)


def data(n=BATCH * 4, seed=0):
    rng = np.random.default_rng(seed)
    return ({"hist": rng.integers(0, VOCAB, (n, SEQ_LEN)), "user": rng.integers(0, VOCAB, n)},
            (rng.random(n) < 0.5).astype("float32"))


def pair():
    features, _ = data()
    example = {k: v[:2] for k, v in features.items()}
    tf.keras.utils.set_random_seed(3)
    baseline = recurrent_model()
    tf.keras.utils.set_random_seed(3)
    original = recurrent_model()
    original.set_weights(baseline.get_weights())
    return baseline, picasso.optimize(original, example_inputs=example)


def step_loops(model):
    """The While ops of the training step traced on a batch of static size BATCH, with
    the FunctionDefs of their bodies."""
    features, _ = data()
    step = tf.function(model.train_step).get_concrete_function(
        ({k: tf.TensorSpec((BATCH,) + v.shape[1:], tf.int64) for k, v in features.items()},
         tf.TensorSpec((BATCH,), tf.float32)))
    graph = step.graph
    return [(op, graph._get_function(op.get_attr("body").name).cached_definition)
            for op in graph.get_operations() if op.type in ("While", "StatelessWhile")]


def float_arg_shapes(body):
    return [tf.TensorShape(body.arg_attr[i].attr["_output_shapes"].list.shape[0])
            for i, arg in enumerate(body.signature.input_arg) if arg.type == tf.float32.as_datatype_enum]


def test_loops_of_the_rewritten_step_have_static_shapes():
    _, optimized = pair()
    optimized.compile(optimizer=tf.keras.optimizers.Adagrad(0.1), loss="binary_crossentropy")
    loops = step_loops(optimized)
    recurrent = [(op, body) for op, body in loops if "doubling" not in op.name]
    # The GRU's and the cell's loops, forward and gradient.
    assert len(recurrent) == 4, [op.name for op, _ in loops]
    for op, body in recurrent:
        shapes = float_arg_shapes(body)
        assert shapes and all(s.is_fully_defined() for s in shapes), (op.name, shapes)
        assert any(s[:1] == [BATCH] for s in shapes), (op.name, shapes)


def test_a_loop_variable_that_grows_keeps_its_open_shape_and_trains_like_the_original():
    baseline, optimized = pair()
    optimized.compile(optimizer=tf.keras.optimizers.Adagrad(0.1), loss="binary_crossentropy")
    doubling = [op for op, _ in step_loops(optimized) if "doubling" in op.name and "grad" not in op.name]
    assert doubling
    for op in doubling:
        shapes = [tf.TensorShape(s).as_list() for s in op.get_attr("output_shapes")]
        assert [None, 8] in shapes and [BATCH, 8] not in shapes, shapes
    features, labels = data()
    losses = {}
    for name, model in (("baseline", baseline), ("picasso", optimized)):
        model.compile(optimizer=tf.keras.optimizers.Adagrad(0.1), loss="binary_crossentropy")
        losses[name] = [model.train_on_batch({k: v[i:i + BATCH] for k, v in features.items()}, labels[i:i + BATCH])
                        for i in range(0, len(labels), BATCH)]
    np.testing.assert_allclose(losses["picasso"], losses["baseline"], rtol=1e-5, atol=1e-5)
