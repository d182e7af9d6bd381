"""The float16 wire format of the row exchange (config.wire_dtype="float16", Persia's
idea): the rows an owner sends back and the row gradients a requester returns travel as
float16, half the bytes of float32; both sides compute in float32.

Rows are cast as they are: embedding values sit well inside float16's range, and
rounding one to 11 significant bits is the format's whole cost. Row gradients are not:
under a batch-mean loss they are often far below float16's smallest normal number
(2**-14), where they would lose their precision or vanish. Each requester therefore
scales its gradients by a power of two that brings the largest of them to about 2**14
(exact in both directions) and sends the exponent, one float16, at the head of its part
for each owner, inside the same AllToAllv.
"""
import tensorflow as tf

from picasso_tf.distributed.world import hvd

_LARGEST_EXPONENT = 14        # float16's largest finite value is 65504, about 2**16
_EXPONENT_LIMIT = 120         # 2**±120 is a normal float32


def alltoall_rows(rows, splits, name, wire_dtype):
    """hvd.alltoall(rows, splits) of a flat buffer of rows (and, as its gradient, the
    reverse AllToAllv of their gradients), carried as `wire_dtype` ("float32": as they
    are; "float16": halved unless rows are 16-bit already). Returns the received rows
    in rows' dtype."""
    if wire_dtype == "float32" or rows.dtype.size <= 2:
        received, _ = hvd().alltoall(rows, splits=splits, name=name)
        return received

    @tf.custom_gradient
    def exchange(rows):
        received, received_splits = hvd().alltoall(tf.cast(rows, tf.float16), splits=splits, name=name)

        def gradient(grads):
            return tf.cast(_return_gradients(grads, received_splits, splits, f"{name}_grads"), rows.dtype)

        return tf.cast(received, rows.dtype), gradient

    return exchange(rows)


def _return_gradients(grads, grad_splits, row_splits, name):
    """The requester's `grads` (grad_splits[d] of them for owner d) sent to their owners
    as scaled float16; returns the owner's float32 gradients of its rows (row_splits[s]
    of them from requester s)."""
    size = hvd().size()
    grads = tf.cast(grads, tf.float32)
    largest = tf.reduce_max(tf.concat([tf.abs(grads), [0.0]], 0))
    exponent = tf.where(largest > 0, tf.floor(_LARGEST_EXPONENT - tf.math.log(largest) / tf.math.log(2.0)), 0.0)
    exponent = tf.clip_by_value(exponent, -_EXPONENT_LIMIT, _EXPONENT_LIMIT)
    scaled = tf.split(tf.cast(grads * tf.pow(2.0, exponent), tf.float16), grad_splits, num=size)
    head = tf.reshape(tf.cast(exponent, tf.float16), [1])
    send = tf.concat([part for owner in range(size) for part in (head, scaled[owner])], 0)
    received, _ = hvd().alltoall(send, splits=grad_splits + 1, name=name)
    parts = tf.split(received, row_splits + 1, num=size)
    exponents = tf.cast(tf.stack([part[0] for part in parts]), tf.float32)
    values = tf.cast(tf.concat([part[1:] for part in parts], 0), tf.float32)
    return values * tf.repeat(tf.pow(2.0, -exponents), row_splits)
