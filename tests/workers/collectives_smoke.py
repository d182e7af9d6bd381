"""A job of tests/test_horovod.py under `picasso-run -np 2` (MPI or Gloo): one AllToAllv
with uneven splits and one Allreduce, and the same AllToAllv over the float16 wire
(picasso_tf.distributed.wire) with its gradient; then both ranks sleep with nothing to
do. Each rank writes as JSON what it got, the transport Horovod ran on, the CPU
seconds it used while asleep (a rank spinning in its transport's wait loop uses ~1 per
second), and the thread pools' sizes it was started with, beside its cores."""
import json
import os
import sys
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from picasso_tf.distributed.wire import alltoall_rows
from picasso_tf.distributed.world import horovod_transport
from picasso_tf.tools.rank_env import MALLOC, POOLS

IDLE_S = 2.0


def weight(sender, receiver, k):
    # Far below float16's smallest normal number (6e-5), and 1000x apart from one receiver to the next.
    return 1e-9 * 1000.0 ** receiver * (1 + sender + 0.1 * k)


def main(argv):
    (out_dir,) = argv
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    # Rank r sends (j + 1) values to rank j, each value encoding (sender, receiver, position).
    splits = tf.constant([j + 1 for j in range(size)], tf.int32)
    values = tf.constant([100 * rank + 10 * j + k for j in range(size) for k in range(j + 1)], tf.float32)
    received, received_splits = hvd.alltoall(values, splits=splits)
    summed = hvd.allreduce(tf.constant([float(rank + 1), 2.0 * rank]), op=hvd.Sum)
    with tf.GradientTape() as tape:
        tape.watch(values)
        over_wire = alltoall_rows(values, splits, "smoke_rows", "float16")
        weights = tf.constant([weight(s, rank, k) for s in range(size) for k in range(rank + 1)], tf.float32)
        loss = tf.reduce_sum(over_wire * weights)
    gradient = tape.gradient(loss, values).numpy()
    hvd.allreduce(tf.constant([0.0]), name="smoke_idle_start").numpy()       # both ranks idle from here
    began = time.process_time()
    time.sleep(IDLE_S)
    idle_cpu_s = time.process_time() - began
    expected = np.array([weight(rank, j, k) for j in range(size) for k in range(j + 1)], np.float32)
    os.makedirs(out_dir, exist_ok=True)
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"size": size, "transport": horovod_transport(),
                   "idle_s": IDLE_S, "idle_cpu_s": idle_cpu_s, "received": received.numpy().tolist(),
                   "received_splits": received_splits.numpy().tolist(),
                   "allreduce": summed.numpy().tolist(), "wire_received": over_wire.numpy().tolist(),
                   "wire_dtype": over_wire.dtype.name, "cores": len(os.sched_getaffinity(0)),
                   "thread_pools": {k: os.environ.get(k) for k in POOLS},     # set by picasso-run
                   "malloc": {k: os.environ.get(k) for k in MALLOC},
                   "wire_gradient_error": float(np.max(np.abs(gradient - expected) / expected))}, f)


if __name__ == "__main__":
    main(sys.argv[1:])
