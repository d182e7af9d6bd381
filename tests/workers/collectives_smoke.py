"""Run by tests/test_horovod.py under `horovodrun -np 2 --gloo`: one AllToAllv with
uneven splits and one Allreduce; each rank writes what it received as JSON."""
import json
import sys

import horovod.tensorflow as hvd
import tensorflow as tf

hvd.init()
rank, size = hvd.rank(), hvd.size()
# Rank r sends (j + 1) values to rank j, each value encoding (sender, receiver, position).
splits = tf.constant([j + 1 for j in range(size)], tf.int32)
values = tf.constant([100 * rank + 10 * j + k for j in range(size) for k in range(j + 1)], tf.float32)
received, received_splits = hvd.alltoall(values, splits=splits)
summed = hvd.allreduce(tf.constant([float(rank + 1), 2.0 * rank]), op=hvd.Sum)
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump({"size": size, "received": received.numpy().tolist(),
               "received_splits": received_splits.numpy().tolist(),
               "allreduce": summed.numpy().tolist()}, f)
