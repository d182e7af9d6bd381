"""PicassoPairwiseDots and its gradient: the dot products of feature pairs of x
[B, F, d], against the MatMul-and-gather that models write (and NumPy)."""
import numpy as np
import pytest
import tensorflow as tf

from picasso_tf.ops.pairwise_dots import pairwise_dots


def lower_triangle(f, with_diagonal=False):
    pairs = [(i, j) for i in range(f) for j in range(i + with_diagonal)]
    return [i for i, _ in pairs], [j for _, j in pairs]


def matmul_and_gather(x, left, right):
    f = x.shape[1]
    z = tf.reshape(tf.matmul(x, x, transpose_b=True), [-1, f * f])
    return tf.gather(z, tf.constant([i * f + j for i, j in zip(left, right)], tf.int32), axis=1)


def values_and_gradient(op, x, left, right, upstream):
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = op(x, left, right)
        loss = tf.reduce_sum(out * upstream)
    return out.numpy(), tape.gradient(loss, x).numpy()


# (batch, features, dim, pairs): DLRM's strictly lower triangle of 27 features of width
# 16, with the diagonal, F * d and pair counts that are not whole vector registers
# (9 x 5, 7 x 3), features past 16 lanes (40), a batch large enough to run threaded,
# batches that end in a part of a block of lanes (33, 17, 5, 3000), an empty batch,
# pairs in any order with repeats, with a feature paired with itself, and with unpaired
# features, no pairs, and every pair of 16 features.
CASES = [
    (64, 27, 16, lower_triangle(27)),
    (33, 9, 5, lower_triangle(9, with_diagonal=True)),
    (8, 40, 20, lower_triangle(40)),
    (3000, 27, 16, lower_triangle(27)),
    (0, 6, 16, lower_triangle(6)),
    (17, 7, 3, ([6, 0, 3, 3, 5, 2], [1, 0, 4, 4, 5, 6])),
    (5, 4, 8, ([], [])),
    (40, 16, 16, ([i for i in range(16) for _ in range(16)], list(range(16)) * 16)),
]


@pytest.mark.parametrize("batch, features, dim, pairs", CASES,
                         ids=lambda c: str(c) if not isinstance(c, tuple) else f"{len(c[0])}pairs")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dots_and_gradient_match_the_matmul_and_gather(batch, features, dim, pairs, dtype):
    rng = np.random.default_rng(batch * 100 + features)
    x = rng.normal(size=(batch, features, dim)).astype(dtype)
    left, right = pairs
    upstream = rng.normal(size=(batch, len(left))).astype(dtype)
    out, grad = values_and_gradient(pairwise_dots, x, left, right, upstream)
    want_out, want_grad = values_and_gradient(matmul_and_gather, x, left, right, upstream)
    assert out.shape == (batch, len(left)) and grad.shape == x.shape
    # Sums of dim (resp. up to 2 * features) products in another order.
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, want_out, rtol=tol, atol=tol * dim)
    np.testing.assert_allclose(grad, want_grad, rtol=tol, atol=tol * dim * features)
    # NumPy, independently of TensorFlow's MatMul.
    np.testing.assert_allclose(out, np.einsum("bpk,bpk->bp", x[:, left], x[:, right]),
                               rtol=tol, atol=tol * dim)


def test_static_shape_and_tf_function():
    left, right = lower_triangle(5)
    fn = tf.function(lambda x: pairwise_dots(x, left, right),
                     input_signature=[tf.TensorSpec([None, 5, 4], tf.float32)])
    assert fn.get_concrete_function().structured_outputs.shape.as_list() == [None, 10]


def test_errors_name_the_pair_and_the_shape():
    x = tf.zeros([2, 3, 4])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"pair 1 is \(3, 0\), outside the 3 features"):
        pairwise_dots(x, [1, 3], [0, 0])
    with pytest.raises(ValueError, match="one entry per pair; got 2 and 1"):
        pairwise_dots(x, [1, 2], [0])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"x must be \[batch, features, dim\]; got shape \[2,12\]"):
        pairwise_dots(tf.zeros([2, 12]), [1], [0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_products_beside_dense_inputs_are_their_concatenation(dtype):
    # DLRM's top-MLP input: [bottom output, products], here with the products between
    # two dense inputs, and a batch that ends in a part of a block of lanes.
    rng = np.random.default_rng(7)
    batch, features, dim = 37, 6, 4
    left, right = lower_triangle(features)
    x = tf.constant(rng.normal(size=(batch, features, dim)).astype(dtype))
    first = tf.constant(rng.normal(size=(batch, 3)).astype(dtype))
    last = tf.constant(rng.normal(size=(batch, 2)).astype(dtype))
    upstream = tf.constant(rng.normal(size=(batch, 3 + len(left) + 2)).astype(dtype))

    def run(op):
        with tf.GradientTape() as tape:
            tape.watch([x, first, last])
            out = op()
            loss = tf.reduce_sum(out * upstream)
        return [out.numpy()] + [g.numpy() for g in tape.gradient(loss, [x, first, last])]

    fused = run(lambda: pairwise_dots(x, left, right, dense=[last, first], dense_columns=[3 + len(left), 0],
                                      pairs_column=3, width=3 + len(left) + 2))
    stock = run(lambda: tf.concat([first, matmul_and_gather(x, left, right), last], axis=1))
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for got, want in zip(fused, stock):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * dim)


def test_columns_that_do_not_fill_the_output_are_an_error():
    x, dense = tf.zeros([2, 3, 4]), tf.zeros([2, 2])
    left, right = lower_triangle(3)
    with pytest.raises(tf.errors.InvalidArgumentError, match="column 2 is followed by one at 3"):
        pairwise_dots(x, left, right, dense=[dense], dense_columns=[0], pairs_column=3, width=6)
    with pytest.raises(tf.errors.InvalidArgumentError, match="the inputs fill 5 columns, not width 6"):
        pairwise_dots(x, left, right, dense=[dense], dense_columns=[0], pairs_column=2, width=6)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"dense input 0 must be \[2, width\]"):
        pairwise_dots(x, left, right, dense=[tf.zeros([3, 2])], dense_columns=[0], pairs_column=2, width=5)
    with pytest.raises(ValueError, match="give the output's width"):
        pairwise_dots(x, left, right, dense=[dense], dense_columns=[0], pairs_column=2)
