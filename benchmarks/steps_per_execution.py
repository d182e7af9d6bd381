"""What Keras' per-call overhead costs a short step (issue 38, item 5): the packing
benchmark's wide_lr (200 fields, batch 4096, Adagrad) through stock Keras, picasso_tf and
the dense-only bound, each compiled with steps_per_execution 1 and 8, timed by whole fit
calls on the suite's in-memory dataset, the six taking turns.

    python benchmarks/steps_per_execution.py [--rounds 5] [--execution 8]

With steps_per_execution=N Keras runs N steps per call of its train function, so the
Python loop, the callbacks and the call itself (its arguments: one resource handle per
variable the step reads) are paid once per N steps; callbacks then see every N-th batch.
It is the user's setting, the same for every variant here; picasso_tf does not change it.
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from picasso_tf.tools.benchmarking import models as bm, sections as bench  # noqa: E402


def ms_per_step(variant, steps, execution):
    model = variant.model
    model.compile(optimizer=model.optimizer, loss=model.loss, steps_per_execution=execution)
    model.fit(variant.dataset, epochs=1, steps_per_epoch=2 * execution, verbose=0)
    start = time.perf_counter()
    model.fit(variant.dataset, epochs=1, steps_per_epoch=steps, verbose=0)
    return (time.perf_counter() - start) / steps * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--execution", type=int, default=8)
    args = parser.parse_args()
    sizes = bench.MODES["full"]
    data = bench.wide_data(sizes, sizes.packing_batch * sizes.batches)
    trio, _ = bench.build_trio(lambda: bm.build_wide_lr(data.schema), data, sizes.packing_batch, "adagrad", sizes)
    variants = {v.name: v for v in trio.variants}
    print(f"load average {os.getloadavg()[0]:.2f} at the start; command: python {' '.join(sys.argv)}")
    times = {}
    for _ in range(args.rounds):
        for name, variant in variants.items():
            # At least 1 s a call: stock Keras' step is several times the others'.
            steps = 24 if name == "baseline" else 96
            for execution in (1, args.execution):
                times.setdefault((name, execution), []).append(ms_per_step(variant, steps, execution))
    for (name, execution), values in times.items():
        print(f"{name:9} steps_per_execution={execution}: {statistics.median(values):6.2f} ms a step (median; "
              + " ".join(f"{v:.2f}" for v in values) + ")")
    for execution in (1, args.execution):
        stock, picasso = (statistics.median(times[name, execution]) for name in ("baseline", "picasso"))
        print(f"picasso_tf / stock Keras at steps_per_execution={execution}: {stock / picasso:.2f}x")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
