"""Fused packed lookup (forward + backward) vs stock TF per-field lookups on CPU.

200 fields, each with its own [20000, D] table, batch 4096 one id per field per
example, ids Zipf-distributed (exponent 1.2). One step = the lookups of all fields
plus the gradient of the tables for a fixed upstream gradient. Three variants:

  fused         one PicassoPackedLookup on the packed [200 * 20000, D] table and its
                gradient (PicassoPackedLookupGrad: ascending unique rows, summed rows)
  stitched      one PicassoStitchedLookup writing every field's rows straight into
                one [batch, 200 * D] tensor (the layout a model concatenating its
                embeddings reads, and the layout fbgemm's TBE outputs) and its
                gradient from a [batch, 200 * D] upstream gradient
  stock         200 x tf.nn.embedding_lookup (ResourceGather) and their gradients,
                i.e. IndexedSlices holding one gradient row per id, duplicates included
  stock+dedup   stock, plus the duplicate summing (tf.unique + unsorted_segment_sum
                per field) that Keras optimizers other than SGD do before applying
  fused+sgd     fused, plus picasso_tf's fused row-sparse SGD update of the table
  stitched+sgd  stitched, plus the same update
  fbgemm        (with --fbgemm-python) fbgemm's CPU TableBatchedEmbedding forward +
                backward with its fused exact SGD update, on the same ids, run by
                benchmarks/fbgemm_tbe_worker.py in a venv holding torch 2.13.0 and
                fbgemm-gpu-cpu 1.8.0 (not a project dependency); compare with stitched+sgd

GB/s counts the embedding-row bytes the work needs: the forward reads and writes one
row per id, the backward reads one gradient row per id and writes one row per unique
(field, id). The same byte count is used for every variant. The machine's memory
bandwidth is measured with a large NumPy copy (one thread; read + write bytes).

Run: .venv/bin/python benchmarks/lookup_kernel.py [--dims 8 16 32] [--steps 20]
       [--fbgemm-python /path/to/fbgemm-venv/bin/python]
"""
import argparse
import os
import platform
import statistics
import subprocess
import tempfile
import time

import numpy as np
import tensorflow as tf

from picasso_tf.ops import sparse_apply
from picasso_tf.ops.packed_lookup import packed_lookup
from picasso_tf.ops.stitched_lookup import stitched_lookup


def zipf_ids(rng, fields, batch, vocab, exponent):
    ids = (rng.zipf(exponent, size=(fields, batch)) - 1) % vocab
    # A different hot set per field, as real features have.
    return [rng.permutation(vocab)[row].astype(np.int64) for row in ids]


def memory_bandwidth_gbs(megabytes=512, repeats=5):
    src = np.ones(megabytes << 18, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


def build_steps(dim, fields, vocab, batch):
    names = [f"C{i}" for i in range(fields)]
    offsets = [i * vocab for i in range(fields)]
    packed = tf.Variable(tf.random.normal([fields * vocab, dim]), name="packed")
    tables = [tf.Variable(tf.random.normal([vocab, dim]), name=f"table{i}") for i in range(fields)]
    rng = np.random.default_rng(1)
    upstream = [tf.constant(rng.normal(size=(batch, dim)), tf.float32) for _ in range(fields)]
    specs = [tf.TensorSpec([batch], tf.int64)] * fields

    def packed_step(lookup, grad_ys, update):
        """A step of `lookup` (ids -> outputs) on the packed table: outputs, the table's
        row-sparse gradient and, with `update`, the fused SGD update."""
        def step(ids_list):
            outs = lookup(ids_list)
            grad = tf.gradients(outs, [packed], grad_ys=grad_ys)[0]
            deps = outs + [grad.values, grad.indices]
            if update:
                deps.append(sparse_apply.sgd(packed, grad.indices, grad.values, lr=0.01))
            with tf.control_dependencies(deps):
                return tf.size(grad.indices)
        return tf.function(step, input_signature=[specs])

    def fused_lookup(ids_list):
        return packed_lookup(packed.read_value(), ids_list, offsets=offsets, vocab_sizes=[vocab] * fields,
                             combiners=["none"] * fields, feature_names=names)

    def stitched_outputs(ids_list):
        return [stitched_lookup([packed.read_value()], ids_list, table_index=[0] * fields,
                                columns=[i * dim for i in range(fields)], row_blocks=[1] * fields,
                                width=fields * dim, offsets=offsets, vocab_sizes=[vocab] * fields,
                                combiners=["none"] * fields, feature_names=names)]

    stitched_upstream = [tf.concat(upstream, axis=1)]
    fused, fused_sgd = (packed_step(fused_lookup, upstream, u) for u in (False, True))
    stitched, stitched_sgd = (packed_step(stitched_outputs, stitched_upstream, u) for u in (False, True))

    def stock_body(ids_list, dedup):
        outs = [tf.nn.embedding_lookup(t, i) for t, i in zip(tables, ids_list)]
        grads = tf.gradients(outs, tables, grad_ys=upstream)
        deps, unique = [], []
        for g in grads:
            if dedup:
                rows, position = tf.unique(g.indices)
                values = tf.math.unsorted_segment_sum(g.values, position, tf.size(rows))
                g = tf.IndexedSlices(values, rows)
            deps += [g.values, g.indices]
            unique.append(tf.size(g.indices))
        with tf.control_dependencies(outs + deps):
            return tf.add_n(unique)

    stock = tf.function(lambda ids: stock_body(ids, False), input_signature=[specs])
    stock_dedup = tf.function(lambda ids: stock_body(ids, True), input_signature=[specs])
    return ({"fused": fused, "stitched": stitched, "stock": stock, "stock+dedup": stock_dedup,
             "fused+sgd": fused_sgd, "stitched+sgd": stitched_sgd}, [packed] + tables)


def fbgemm_ms(python, ids, vocab, dim, steps):
    """Median ms/step of fbgemm's TBE on the same ids, timed in its own venv."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ids.npz")
        np.savez(path, ids=np.stack(ids), vocab=vocab)
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fbgemm_tbe_worker.py")
        out = subprocess.run([python, worker, path, str(dim), str(steps)], capture_output=True, text=True,
                             check=True)
        return float(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--fields", type=int, default=200)
    parser.add_argument("--vocab", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--zipf", type=float, default=1.2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fbgemm-python", help="python of a venv with torch 2.13.0 + fbgemm-gpu-cpu 1.8.0")
    args = parser.parse_args()

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    threads = tf.config.threading.get_intra_op_parallelism_threads() or "default"
    print(f"machine: {os.cpu_count()} cores, {cpu}; TensorFlow {tf.__version__}; "
          f"intra-op threads {threads}; load average {os.getloadavg()[0]:.1f} at start")
    print(f"memory bandwidth (NumPy copy, 1 thread, read+write): {memory_bandwidth_gbs():.1f} GB/s")
    print(f"{args.fields} fields x vocab {args.vocab}, batch {args.batch}, Zipf {args.zipf}, "
          f"median of {args.steps} interleaved steps after warm-up\n")
    rng = np.random.default_rng(0)
    raw_ids = zipf_ids(rng, args.fields, args.batch, args.vocab, args.zipf)
    ids = [tf.constant(x) for x in raw_ids]
    num_ids = args.fields * args.batch
    for dim in args.dims:
        steps, variables = build_steps(dim, args.fields, args.vocab, args.batch)
        unique = int(steps["fused"](ids))
        for step in steps.values():  # trace and warm up
            for _ in range(2):
                step(ids)
        times = {name: [] for name in steps}
        for _ in range(args.steps):
            for name, step in steps.items():
                start = time.perf_counter()
                step(ids).numpy()
                times[name].append(time.perf_counter() - start)
        row_bytes = dim * 4
        moved = (2 * num_ids + num_ids + unique) * row_bytes
        print(f"D={dim}: {num_ids} ids, {unique} unique (field, id) rows, "
              f"{moved / 1e6:.0f} MB of rows per step")
        medians = {name: statistics.median(samples) * 1e3 for name, samples in times.items()}
        if args.fbgemm_python:
            medians["fbgemm"] = fbgemm_ms(args.fbgemm_python, raw_ids, args.vocab, dim, args.steps)
        for name, ms in medians.items():
            base = "stitched+sgd" if name.endswith("sgd") or name == "fbgemm" else "stitched"
            print(f"  {name:12s} {ms:8.2f} ms/step  {moved / ms / 1e6:6.2f} GB/s  "
                  f"{base} speed-up x{ms / medians[base]:.2f}")
        del steps, variables


if __name__ == "__main__":
    main()
