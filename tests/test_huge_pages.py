"""The huge_pages option (custom_ops/huge_pages.h): the tables the fused optimizer
updates, and their slots, go on transparent huge pages; with huge_pages=False they stay
on small pages. Linux reports a process's huge pages in /proc/self/smaps_rollup
(AnonHugePages), so each case runs in a fresh process, where nothing else asked for them."""
import os
import platform
import subprocess
import sys
import textwrap

import pytest

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode():
    try:
        with open(THP) as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _kernel_at_least(major, minor):
    numbers = platform.release().split("-")[0].split(".")
    return tuple(int(n) for n in numbers[:2]) >= (major, minor)


# Linux collapses pages already in use on request (MADV_COLLAPSE) from 6.1; under "always"
# every large buffer gets huge pages anyway, so the option could not be told apart.
pytestmark = pytest.mark.skipif(_thp_mode() != "madvise" or not _kernel_at_least(6, 1),
                                reason=f"needs Linux >= 6.1 with {THP} set to madvise")

TRAIN = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf
    import picasso_tf

    def huge_mib():
        for line in open("/proc/self/smaps_rollup"):
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) >> 10

    rows, dim = 50_000, 64          # 12.5 MiB of table and as much of Adagrad's accumulator
    ids = tf.keras.Input((4,), dtype=tf.int64, name="ids")
    x = tf.keras.layers.Embedding(rows, dim, name="table")(ids)
    out = tf.keras.layers.Dense(1, activation="sigmoid")(tf.keras.layers.Flatten()(x))
    model = picasso_tf.optimize(tf.keras.Model(ids, out), huge_pages=sys.argv[1] == "on")
    model.compile(optimizer=tf.keras.optimizers.Adagrad(0.01), loss="binary_crossentropy")
    rng = np.random.default_rng(0)
    features = {"ids": rng.integers(0, rows, (512, 4))}
    labels = rng.integers(0, 2, (512, 1)).astype("float32")
    before = huge_mib()
    model.fit(features, labels, batch_size=128, epochs=1, verbose=0)
    print("huge MiB", huge_mib() - before)
""")


def _huge_mib_gained(setting):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-c", TRAIN, setting], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split("huge MiB")[1])


def test_huge_pages_back_the_updated_table_and_its_slot():
    # The two 12.2 MiB buffers touch up to 8 huge pages each; the whole pages of a buffer
    # mapped on its own are at least 5.
    assert 20 <= _huge_mib_gained("on") <= 40


def test_huge_pages_false_leaves_the_tables_on_small_pages():
    assert _huge_mib_gained("off") == 0
