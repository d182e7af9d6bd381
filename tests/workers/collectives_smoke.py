"""Run by tests/test_horovod.py under `horovodrun -np 2 --gloo`: one AllToAllv with
uneven splits and one Allreduce, and the same AllToAllv over the float16 wire
(picasso_tf.distributed.wire) with its gradient; each rank writes what it got as JSON."""
import json
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from picasso_tf.distributed.wire import alltoall_rows

hvd.init()
rank, size = hvd.rank(), hvd.size()
# Rank r sends (j + 1) values to rank j, each value encoding (sender, receiver, position).
splits = tf.constant([j + 1 for j in range(size)], tf.int32)
values = tf.constant([100 * rank + 10 * j + k for j in range(size) for k in range(j + 1)], tf.float32)
received, received_splits = hvd.alltoall(values, splits=splits)
summed = hvd.allreduce(tf.constant([float(rank + 1), 2.0 * rank]), op=hvd.Sum)


def weight(sender, receiver, k):
    # Far below float16's smallest normal number (6e-5), and 1000x apart from one receiver to the next.
    return 1e-9 * 1000.0 ** receiver * (1 + sender + 0.1 * k)


with tf.GradientTape() as tape:
    tape.watch(values)
    over_wire = alltoall_rows(values, splits, "smoke_rows", "float16")
    weights = tf.constant([weight(s, rank, k) for s in range(size) for k in range(rank + 1)], tf.float32)
    loss = tf.reduce_sum(over_wire * weights)
gradient = tape.gradient(loss, values).numpy()
expected = np.array([weight(rank, j, k) for j in range(size) for k in range(j + 1)], np.float32)
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump({"size": size, "received": received.numpy().tolist(),
               "received_splits": received_splits.numpy().tolist(),
               "allreduce": summed.numpy().tolist(), "wire_received": over_wire.numpy().tolist(),
               "wire_dtype": over_wire.dtype.name,
               "wire_gradient_error": float(np.max(np.abs(gradient - expected) / expected))}, f)
