"""Hybrid parallelism over Horovod (paper §III-A): embedding tables row-sharded across
ranks and reached over AllToAllv (exchange.py), dense layers replicated and averaged
with one grouped Allreduce (picasso_tf.runtime.step), the ranks agreeing on what
they plan and how many batches they run (world.py)."""
