"""HybridHash's cold tier alone, one core: find-or-insert + row gather + Adagrad update.

Zipf-distributed ids (exponent --zipf over --keys ranks, scattered over int64 so that
hot ids are not neighbours) in batches of --batch. Each batch, timed after --warmup
batches, does: unique ids, find-or-insert of the unique keys (new keys initialised
uniform(-0.05, 0.05) per key, Adagrad accumulator 0.1), gather of a row per id, segment
sum of a gradient per id, Adagrad on the unique rows. Measured two ways:

  TF ops    picasso_tf.ops.hybrid_hash.HashTable in a tf.function: tf.unique,
            PicassoHashTableFindOrInsert, tf.gather, tf.math.unsorted_segment_sum,
            PicassoHashTableApplyAdagrad; intra- and inter-op threads set to 1
  harness   benchmarks/hash_table_bench.cc (g++ -O3, compiled here): the same steps in
            plain C++ with custom_ops/hash_table.h, absl::flat_hash_map (TensorFlow's
            own absl headers) and std::unordered_map, batches interleaved between them

ids/s = ids in the timed batches / CPU seconds of the process (all its threads) while
they ran, so that on a shared, loaded machine the time spent waiting for the core is
not counted (what neighbours do to the caches still is). Prints a table and writes it
to --out.

    .venv/bin/python benchmarks/hash_table.py
"""
import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def zipf_ids(n, keys, exponent, seed):
    """n ids: ranks drawn with P(rank r) ~ r^-exponent, r in [1, keys], scattered over int64."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(np.arange(1, keys + 1, dtype=np.float64) ** -exponent)
    cdf /= cdf[-1]
    ranks = np.searchsorted(cdf, rng.random(n), side="right").astype(np.uint64) + np.uint64(1)
    with np.errstate(over="ignore"):
        return ((ranks * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(1)).astype(np.int64)


def build_harness(workdir):
    import tensorflow as tf

    exe = os.path.join(workdir, "hash_table_bench")
    lib_dir = tf.sysconfig.get_lib()
    cmd = (["g++", "-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-std=c++17",
            "-DNDEBUG", "-D_GLIBCXX_USE_CXX11_ABI=1", "-I" + os.path.join(ROOT, "custom_ops"),
            "-I" + tf.sysconfig.get_include(), os.path.join(HERE, "hash_table_bench.cc"),
            "-o", exe]
           # absl's hash seed and empty-group symbols live in TensorFlow's framework library
           + [f"-L{lib_dir}", "-l:libtensorflow_framework.so.2", f"-Wl,-rpath,{lib_dir}"])
    subprocess.check_call(cmd)
    return exe


def run_harness(exe, ids_path, batch, dim, warmup):
    out = subprocess.check_output(["taskset", "-c", "0", exe, ids_path, str(batch), str(dim),
                                   str(warmup)], text=True)
    result = {}
    for line in out.strip().splitlines():
        name, d, rate, size, bytes_per_key = line.split()
        result[name] = (float(rate), int(size), float(bytes_per_key))
    return result


def run_tf(ids, batch, dim, warmup):
    import tensorflow as tf

    from picasso_tf.ops.hybrid_hash import HashTable

    table = HashTable(dim, num_slots=1, initializer=tf.keras.initializers.RandomUniform(-0.05, 0.05),
                      seed=1, slot_init=0.1, initial_capacity=1024)
    rng = np.random.default_rng(0)
    grads = tf.constant(((rng.random((batch, dim)) - 0.5) * 0.01).astype(np.float32))

    @tf.function
    def step(ids, step):
        uniq, idx = tf.unique(ids)
        rows = tf.gather(table.find_or_insert(uniq, step), idx)
        g = tf.math.unsorted_segment_sum(grads, idx, tf.size(uniq))
        with tf.control_dependencies([rows]):
            apply = table.apply_adagrad(uniq, g, 0.05)
        with tf.control_dependencies([apply]):
            return tf.identity(rows[0])

    batches = [tf.constant(ids[i * batch:(i + 1) * batch]) for i in range(len(ids) // batch)]
    step.get_concrete_function(tf.TensorSpec([batch], tf.int64), tf.TensorSpec([], tf.int64))
    seconds = 0.0
    for t, b in enumerate(batches):
        start = time.process_time()  # every thread's CPU time: the op's pool thread too
        step(b, tf.constant(t, tf.int64)).numpy()
        if t >= warmup:
            seconds += time.process_time() - start
    return (len(batches) - warmup) * batch / seconds, int(table.size())


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=65536)
    p.add_argument("--batches", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--keys", type=int, default=10_000_000)
    p.add_argument("--zipf", type=float, nargs="+", default=[1.2, 1.05],
                   help="one workload per exponent")
    p.add_argument("--prefill", type=int, nargs="+", default=[0, 2_000_000],
                   help="per workload: keys (uniform over the key space) inserted before the "
                        "Zipf batches, untimed, so that the table is large and mostly cold")
    p.add_argument("--dims", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--out", default=os.path.join(HERE, "hash_table.txt"))
    args = p.parse_args(argv)
    if len(args.prefill) != len(args.zipf):
        p.error("give one --prefill per --zipf")

    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    os.sched_setaffinity(0, {0})  # one core for this process and TensorFlow's threads

    lines = [
        "HybridHash cold tier, one core: unique + find-or-insert + row gather + Adagrad update",
        f"machine: {cpu_model()}, {os.cpu_count()} cores visible, pinned to 1 "
        f"(TF intra/inter-op threads 1; harness under taskset -c 0); load average at start "
        f"{os.getloadavg()[0]:.1f}",
        f"ids: Zipf over {args.keys:,} keys, {args.batches} batches of {args.batch:,}, the "
        f"first {args.warmup} untimed",
        "command: " + " ".join([os.path.relpath(sys.executable, ROOT),
                                os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)] + sys.argv[1:]),
        "",
        f"{'workload':<24} {'dim':>4}  {'TF ops (picasso)':>16}  {'harness: picasso':>16}  "
        f"{'absl::flat_hash_map':>19}  {'std::unordered_map':>18}  {'keys':>10}  {'table B/key':>11}",
    ]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        exe = build_harness(workdir)
        for exponent, prefill in zip(args.zipf, args.prefill):
            ids = zipf_ids(args.batch * args.batches, args.keys, exponent, seed=0)
            unique = np.mean([len(np.unique(ids[i * args.batch:(i + 1) * args.batch]))
                              for i in range(args.warmup, args.batches)])
            prefill_batches = -(-prefill // args.batch)
            if prefill_batches:
                ranks = np.random.default_rng(1).integers(1, args.keys + 1, prefill_batches * args.batch)
                with np.errstate(over="ignore"):
                    cold = ((ranks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
                            >> np.uint64(1)).astype(np.int64)
                ids = np.concatenate([cold, ids])
            ids_path = os.path.join(workdir, "ids.bin")
            ids.tofile(ids_path)
            warmup = prefill_batches + args.warmup
            name = f"Zipf({exponent})" + (f", {prefill / 1e6:g}M prefill" if prefill else "")
            for dim in args.dims:
                h = run_harness(exe, ids_path, args.batch, dim, warmup)
                tf_rate, tf_size = run_tf(ids, args.batch, dim, warmup)
                line = (f"{name:<24} {dim:>4}  {tf_rate / 1e6:>12.2f} M/s  {h['picasso'][0] / 1e6:>12.2f} M/s  "
                        f"{h['absl'][0] / 1e6:>15.2f} M/s  {h['std'][0] / 1e6:>14.2f} M/s  "
                        f"{tf_size:>10,}  {h['picasso'][2]:>11.1f}")
                print(line, flush=True)
                lines.append(line)
            lines.append(f"{'':<24} ({unique:,.0f} unique ids per timed batch on average)")
            print(lines[-1], flush=True)
    tail = [
        "",
        "ids per CPU-second of one core over the timed batches (higher is better). 'harness' runs",
        "the three maps interleaved batch by batch in one process; 'TF ops' runs alone after it.",
        "'keys': keys in the table at the end; 'table B/key': bytes the picasso table holds per",
        "key (buckets, and rows of 24-byte header + value + accumulator), against a raw",
        "8 + 8*dim bytes (key, value, slot).",
    ]
    print("\n".join(tail))
    with open(args.out, "w") as f:
        f.write("\n".join(lines + tail) + "\n")


if __name__ == "__main__":
    main()
