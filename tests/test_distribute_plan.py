"""The distribute pass's plan for 2 ranks: which packed groups are sharded and which stay
whole. The plan is made by the real pass on the real rewritten graph; only the world it
plans for is given (rank 0 of 2), so that no launch is needed: the launches in
test_horovod.py train such plans end to end."""
import numpy as np
import pytest
import tensorflow as tf

from picasso_tf import compiler
from picasso_tf.config import Config
from picasso_tf.distributed.world import World
from picasso_tf.passes import distribute as distribute_pass

BATCH = 64


def wide_and_deep(wide_rows):
    """4 width-1 tables of wide_rows rows (the wide part) and 2 of 100,000 rows, dim 8."""
    ids = {f"f{i}": tf.keras.Input((1,), dtype=tf.int64, name=f"f{i}") for i in range(4)}
    wide = [tf.keras.layers.Embedding(wide_rows, 1, name=f"wide{i}")(ids[f"f{i}"]) for i in range(4)]
    deep = [tf.keras.layers.Embedding(100_000, 8, name=f"deep{i}")(ids[f"f{i}"]) for i in range(2)]
    hidden = tf.keras.layers.Dense(4, activation="relu")(tf.keras.layers.Flatten()(tf.concat(deep, -1)))
    logit = tf.keras.layers.Flatten()(tf.add_n(wide)) + tf.keras.layers.Dense(1)(hidden)
    return tf.keras.Model(ids, tf.sigmoid(logit))


def warmup(rows):
    rng = np.random.default_rng(0)
    features = {f"f{i}": rng.integers(0, rows, (BATCH * 4, 1)) for i in range(4)}
    return tf.data.Dataset.from_tensor_slices((features, np.zeros((BATCH * 4, 1), np.float32))).batch(BATCH)


def plan(model, warmup_data=None):
    """The distribute pass's report for rank 0 of 2; deep groups (6.4 MB) are above the
    threshold, the wide group (wide_rows x 4 x 4 bytes) below it."""
    config = Config(replicate_tables_below=1 << 20)
    world = World(2, 0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(distribute_pass, "current_world", lambda: world)
        program = compiler.compile_program(model, config, warmup_data=warmup_data)
    report = next(p for p in program.reports["training"]["passes"] if p["pass"] == "distribute")
    wide = [t.name for t in program.tables if t.dim == 1]
    return report, wide[0]


def test_a_small_group_of_many_rows_joins_the_exchange_that_runs_anyway():
    report, wide = plan(wide_and_deep(20_000), warmup(20_000))
    assert wide in report["sharded"] and wide not in report["replicated"]
    assert "below replicate_tables_below" in report["joined_the_exchange"][wide]


def test_a_small_group_whose_rows_a_batch_mostly_reads_stays_whole():
    report, wide = plan(wide_and_deep(30), warmup(30))
    assert wide in report["replicated"] and "joined_the_exchange" not in report
    assert report["replicated"][wide].endswith("cheaper summed whole than exchanged")


def test_without_warm_up_data_a_small_group_stays_whole():
    report, wide = plan(wide_and_deep(20_000))
    assert wide in report["replicated"] and wide not in report["sharded"] and report["sharded"]
