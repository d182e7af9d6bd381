"""The fused lookup and its gradient alone, on the ids of alibaba/dlrm's batch: what
its padded behaviour sequences cost the kernels, read three ways.

  python benchmarks/sequence_kernels.py [--rounds 5] [--calls 200]

The zoo cell's first batch (1024 examples: 7 one-hot features, 6 sequences of 50
positions padded with 0, about half filled) on one packed [1,200,020, 16] table, as
the rewrite of the zoo's DLRM makes it (`EmbeddingBag`: `tf.sparse.from_dense` and a
summing `safe_embedding_lookup_sparse`):

  by row        the padded [B, 50] ids as they are, each row pooled, weighted by
                whether the conversion keeps the id (PicassoKeptIds): what the
                sparse_one_hot pass read before it read the kept ids alone
  segment ids   the same ids flattened, with their segment ids given as a constant
                (what pooling by row cost when the kernels wrote those ids out)
  kept only     the kept ids alone with their rows as segment ids (PicassoKeptSegments,
                whose own pass over the ids is not timed here): what the pass reads

Each variant's PicassoPackedLookup and PicassoPackedLookupGrad (without the optimizer's
update) are tf.functions called `--calls` times in a row; the rounds alternate the
variants. Prints the median ms per call over rounds (min-max) and the load average.
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import tensorflow as tf       # noqa: E402

from picasso_tf.ops.kept_ids import kept_ids, kept_segments                    # noqa: E402
from picasso_tf.ops.packed_lookup import packed_lookup, packed_lookup_grad, site_inputs  # noqa: E402
from tools.benchmarking import sections                                        # noqa: E402

DIM = 16


def first_batch():
    sizes = sections.MODES["full"]
    data = sections.alibaba_data(sizes, sizes.zoo_batch * sizes.batches)
    features, _ = next(iter(data.dataset(sizes.zoo_batch)))
    schema = data.schema
    return [(f.name, f.vocab_size, features[f.name]) for f in schema.categorical + schema.sequences]


def variant_inputs(kind, columns):
    """Per site: (ids, segment ids, weights, num_segments) and its combiner."""
    sites = []
    for _, _, ids in columns:
        if ids.shape.rank == 1:
            sites.append((ids, None, None, None, "none"))
            continue
        batch, length = ids.shape
        if kind == "kept only":
            kept, rows, count = kept_segments(ids, keep_zero=False)
            sites.append((kept, rows, None, count, "sum"))
            continue
        kept, weights = kept_ids(ids, tf.float32, keep_zero=False)
        weights = tf.reshape(weights, ids.shape)
        if kind == "by row":
            sites.append((kept, None, weights, None, "sum"))
        else:
            segments = tf.constant(tf.repeat(tf.range(batch, dtype=tf.int64), length))
            sites.append((tf.reshape(kept, [-1]), segments, tf.reshape(weights, [-1]), batch, "sum"))
    return sites


def calls(table, columns, kind):
    """(forward, gradient): tf.functions of the variant's two kernels."""
    names = [name for name, _, _ in columns]
    vocab = [v for _, v, _ in columns]
    sites = variant_inputs(kind, columns)
    kwargs = dict(offsets=[sum(vocab[:i]) for i in range(len(vocab))], vocab_sizes=vocab,
                  combiners=[s[4] for s in sites], feature_names=names)
    ids, segments, weights, counts = ([s[k] for s in sites] for k in range(4))
    forward = tf.function(lambda: packed_lookup(table, ids, segments, weights, counts, **kwargs))
    grads = [tf.random.normal(out.shape, seed=1) for out in forward()]
    inputs = site_inputs(tf.float32, ids, segments, weights, counts, op_name="sequence_kernels", **kwargs)
    gradient = tf.function(lambda: packed_lookup_grad(grads, *inputs, num_rows=[table.shape[0]], dims=[DIM],
                                                      **kwargs))
    gradient()
    return forward, gradient


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    columns = first_batch()
    table = tf.Variable(tf.random.uniform([sum(v for _, v, _ in columns), DIM], -0.05, 0.05, seed=0))
    kinds = ("by row", "segment ids", "kept only")
    fns = {kind: calls(table, columns, kind) for kind in kinds}
    times = {(kind, part): [] for kind in kinds for part in ("lookup", "gradient")}
    load_before = os.getloadavg()[0]
    for r in range(args.rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            for part, fn in zip(("lookup", "gradient"), fns[kind]):
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                times[(kind, part)].append((time.perf_counter() - start) / args.calls * 1e3)
    print(f"alibaba/dlrm's first batch, one packed table, {args.rounds} rounds of {args.calls} calls; "
          f"load average {load_before:.2f} -> {os.getloadavg()[0]:.2f}")
    for kind in kinds:
        cells = [f"{part} {statistics.median(v):.3f} ms ({min(v):.3f}-{max(v):.3f})"
                 for (k, part), v in times.items() if k == kind]
        print(f"  {kind:12} " + ", ".join(cells))


if __name__ == "__main__":
    main()
