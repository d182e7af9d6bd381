"""Reader throughput, in examples per second, on synthetic Criteo written to disk.

    .venv/bin/python benchmarks/readers.py [--rows 200000] [--batch-size 4096]

Writes --rows examples of the synthetic criteo preset as Criteo TSV, Parquet and
TFRecord into a temporary directory, then times full passes of each reader (the best
of --repeats, each through a freshly built dataset, prefetch on), plus the in-memory
TabularData pipeline and the synthetic stream of the same number of batches. Building
the dataset (packing in-memory columns, setting up the generator) is timed apart from
the pass. Batches are consumed in Python without further work, so the figures are the
readers' ceiling on this machine. Besides wall-clock rows/s the table gives rows per
CPU-second of this process (all its threads): on a machine shared with other work the
wall-clock figure drops, the CPU figure much less. Prints the machine and the command.
--autotune turns tf.data's autotuner back on for every reader (the readers leave it
off), to compare the two.
"""
import argparse
import os
import platform
import sys
import tempfile
import time

import tensorflow as tf

from picasso_tf.data import (criteo_schema, generate, read_criteo, read_parquet, read_tfrecord, stream,
                             write_criteo, write_parquet, write_tfrecord)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def measure(make_dataset, repeats):
    """(rows, build seconds, rows/s, rows per CPU-second) of the fastest of `repeats`
    passes, each through a freshly built dataset."""
    best = None
    for _ in range(repeats):
        start = time.perf_counter()
        dataset = make_dataset()
        built, cpu = time.perf_counter(), time.process_time()
        rows = sum(int(tf.shape(label)[0]) for _, label in dataset)
        wall, cpu = time.perf_counter() - built, time.process_time() - cpu
        if best is None or wall < best[2]:
            best = (rows, built - start, wall, cpu)
    rows, build, wall, cpu = best
    return rows, build, rows / wall, rows / cpu


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--autotune", action="store_true", help="tf.data's autotuner on for every reader")
    args = parser.parse_args(argv)

    load_before = os.getloadavg()[0]
    schema = criteo_schema()
    data = generate(schema, args.rows, seed=0)
    batches = -(-args.rows // args.batch_size)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {name: os.path.join(tmp, name) for name in ("data.tsv", "data.parquet", "data.tfrecord")}
        write_criteo(data, paths["data.tsv"])
        write_parquet(data, paths["data.parquet"])
        write_tfrecord(data, paths["data.tfrecord"])
        cases = [
            ("Criteo TSV (read_criteo, log1p)", lambda: read_criteo(paths["data.tsv"], schema, args.batch_size)),
            ("Parquet, engine=pyarrow (read_parquet default)",
             lambda: read_parquet(paths["data.parquet"], schema, args.batch_size)),
            ("Parquet, engine=tfio (tfio.IODataset.from_parquet)",
             lambda: read_parquet(paths["data.parquet"], schema, args.batch_size, engine="tfio")),
            ("TFRecord (read_tfrecord)", lambda: read_tfrecord(paths["data.tfrecord"], schema, args.batch_size)),
            ("in memory (TabularData.dataset, shuffled)",
             lambda: data.dataset(args.batch_size, shuffle=True)),
            ("synthetic stream (generated on the fly)",
             lambda: stream(schema, args.batch_size, num_batches=batches)),
        ]
        sizes = {name: os.path.getsize(path) / 1e6 for name, path in paths.items()}
        if args.autotune:
            options = tf.data.Options()
            options.autotune.enabled = True
            cases = [(name, lambda make=make: make().with_options(options)) for name, make in cases]
        results = [(name, *measure(make, args.repeats)) for name, make in cases]

    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, load average {load_before:.1f} before and "
          f"{os.getloadavg()[0]:.1f} after; "
          f"Python {platform.python_version()}, TensorFlow {tf.__version__}")
    print(f"command: {' '.join([os.path.relpath(sys.executable), *sys.argv])}")
    print(f"data: {args.rows} rows of synthetic criteo (13 dense, 26 categorical), batch {args.batch_size}; "
          + ", ".join(f"{n} {mb:.1f} MB" for n, mb in sizes.items()))
    print("\n| reader | rows | build s | rows/s | rows per CPU-s |\n| --- | ---: | ---: | ---: | ---: |")
    for name, rows, build, rate, cpu_rate in results:
        print(f"| {name} | {rows} | {build:.2f} | {rate:,.0f} | {cpu_rate:,.0f} |")


if __name__ == "__main__":
    main()
