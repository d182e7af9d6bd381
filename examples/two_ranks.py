"""The same script on one process and on N Horovod ranks: the zoo's Wide & Deep on
generated Criteo-like data.

    python examples/two_ranks.py                           # one process
    picasso-run -np 2 python examples/two_ranks.py         # two ranks (MPI; --gloo for Gloo)

Under N ranks picasso_tf shards the embedding tables over the ranks (hybrid
parallelism: rows exchanged by AllToAllv, dense gradients allreduced); each rank reads
its share of every global batch, so N ranks train like one process on the whole batch.
See docs/multi-rank.md.
"""
import argparse
import os

import horovod.tensorflow as hvd
import tensorflow as tf

import picasso_tf
import picasso_tf.models as zoo
from picasso_tf.data import criteo_schema, generate

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="runs/two_ranks", help="checkpoint directory, shared by the ranks")
args = parser.parse_args()

hvd.init()                                               # a world of one without a launcher
tf.keras.utils.set_random_seed(0)                        # rank 0's initial weights go to every rank
GLOBAL_BATCH = 256
schema = criteo_schema(buckets=1000)
data = generate(schema, 2048, seed=0)                    # every rank generates the same examples...
dataset = data.dataset(GLOBAL_BATCH // hvd.size(), rank=hvd.rank(), world=hvd.size())  # ...and reads its share

# replicate_tables_below=0 shards even these small tables (the default keeps tables
# under 16 MiB whole on every rank, where exchanging rows costs more than it saves).
model = picasso_tf.optimize(zoo.get("wide_deep")(schema), replicate_tables_below=0)
model.compile(optimizer=tf.keras.optimizers.Adagrad(0.05), loss="binary_crossentropy")
model.fit(dataset, epochs=2, verbose=2 if hvd.rank() == 0 else 0)   # logs: rank 0's share of each batch
loss = model.evaluate(data.dataset(1024), verbose=0)    # every rank, all the data: the same figure

model.save_weights(os.path.join(args.out, "ckpt"))     # every rank calls it; one checkpoint
if hvd.rank() == 0:
    distribute = next(p for p in model.picasso.reports["training"]["passes"] if p["pass"] == "distribute")
    print(f"ranks: {hvd.size()}, loss on all the data after training: {loss:.5f}")
    print("distribute:", {k: v for k, v in distribute.items() if k in ("changed", "why", "sharded", "replicated")})
    print("checkpoint:", os.path.join(args.out, "ckpt"))
