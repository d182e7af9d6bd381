"""An id outside its table in one rank's batch, under Horovod (Gloo on loopback): every
rank refuses the step with the same error, naming the feature, the id and the rank,
before any table of any rank changes and without a collective the others do not
issue, so that a script that catches it trains on in step on every rank. Exchanged
tables and tables replicated on every rank alike. A step that exchanges rows carries
the check in the ids' AllToAllv it sends anyway (with micro-batches, each micro-batch's;
the bad id in the last one); one that exchanges none (every table replicated) in the
gradients' grouped Allreduce, its only collective (with micro-batches too). The worker
is tests/workers/bad_ids.py."""
import json

import pytest

from launching import Job, ran

EXPECTED = {"hashed": "ids of feature] [user] [must lie in [0,] [1000] [): got] [5000] [in the batch of rank] [1]",
            "vocabulary": "ids of feature] [city] [must lie in [0,] [50] [): got] [500] [in the batch of rank] [1]",
            "replicated": "ids of feature] [user] [must lie in [0,] [1000] [): got] [5000] [in the batch of rank] [1]",
            "mixed": "ids of feature] [history] [must lie in [0,] [500] [): got] [5000] [in the batch of rank] [1]"}
EXPECTED["mixed_micro_batches"] = EXPECTED["mixed"]
EXPECTED["replicated_micro_batches"] = EXPECTED["replicated"]
# The groups each model shards and replicates (hybrid_training's: 8 and 4 wide).
GROUPS = {"hashed": (["packed_float32_d4", "packed_float32_d8"], []),
          "replicated": ([], ["packed_float32_d4", "packed_float32_d8"]),
          "replicated_micro_batches": ([], ["packed_float32_d4", "packed_float32_d8"]),
          "mixed": (["packed_float32_d8"], ["packed_float32_d4"]),
          "mixed_micro_batches": (["packed_float32_d8"], ["packed_float32_d4"])}


HOROVOD_JOBS = (Job("gloo", "bad_ids", "bad_ids", ["--models", ",".join(sorted(EXPECTED))]),)


@pytest.fixture(scope="module")
def refused(horovod_jobs):
    """Every model's run, on 2 ranks."""
    return ran(horovod_jobs, HOROVOD_JOBS[0])


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_a_bad_id_on_one_rank_fails_the_step_on_every_rank_and_training_goes_on(refused, model):
    for rank in range(2):
        result = json.load(open(refused / model / f"rank{rank}.json"))
        assert result["size"] == 2
        assert EXPECTED[model] in result["error"], result["error"][-600:]
        assert "every rank refused the step, and no table of any rank changed" in result["error"]
        assert result["unchanged"]
        # The batch in a forward pass outside the step: one that exchanges rows refuses it on
        # every rank in the ids' AllToAllv; with every table replicated it issues no
        # collective, so rank 1's kernels alone raise, as in inference, and both ranks train
        # on in step (the losses below).
        if not model.startswith("replicated"):
            assert EXPECTED[model] in result["forward_error"], result["forward_error"][-600:]
        elif rank == 1:
            assert "ids of feature 'user' must lie in [0, 1000): got 5000" in result["forward_error"]
        else:
            assert result["forward_error"] is None, result["forward_error"]
        # Trained on as if the bad batch had never come: losses and every array held, to the bit.
        assert len(result["losses"]) == 6 and result["losses"] == result["expected"]
        assert result["same_state"]
        # Every table replicated: the Allreduce alone. Else the ids' and the rows' both ways, per micro-batch.
        expected = {"HorovodGroupedAllreduce": 1}
        if not model.startswith("replicated"):
            expected["HorovodAlltoall"] = 3 * (2 if "micro" in model else 1)
        assert result["collectives"] == expected
        if model in GROUPS:
            report = result["distribute"]
            assert (report.get("sharded", []), sorted(report["replicated"])) == GROUPS[model]


@pytest.mark.parametrize("value", [5000, -1, (1 << 62) + 12345, -(1 << 63)])
def test_a_report_comes_back_exact_from_the_average_of_three_ranks(value):
    """The report of an id outside its table, as rank 1 of 3 packs it into the gradients'
    Allreduce, averaged in float32 as Horovod averages (the sum times 1/size): every
    rank decodes the same rank, feature and id, to the bit, for any int64 id."""
    import numpy as np
    import tensorflow as tf

    from picasso_tf.distributed.reported_ids import IdsReport, InPlaceIdsCheck
    from picasso_tf.distributed.world import World

    features, limits = ["user", "item"], [1000, 2000]
    good = IdsReport(tf.constant(False), tf.constant(0), tf.constant(0, tf.int64), features, limits)
    bad = IdsReport(tf.constant(True), tf.constant(1), tf.constant(value, tf.int64), features, limits)
    parts = [InPlaceIdsCheck(World(3, rank)).packed([good, bad] if rank == 1 else [good, good]) for rank in range(3)]
    averaged = (np.sum([p.numpy() for p in parts], 0, dtype=np.float32) * (1 / 3)).astype(np.float32)
    # As in the step: traced (the error's data then reads as the workers' does).
    refuse = tf.function(lambda averaged: InPlaceIdsCheck(World(3, 0)).refuse_reported(averaged, [good]))
    with pytest.raises(tf.errors.InvalidArgumentError) as refused:
        refuse(tf.constant(averaged))
    assert f"ids of feature] [item] [must lie in [0,] [2000] [): got] [{value}] [in the batch of rank] [1]" in \
        refused.value.message
    assert refuse(tf.constant(np.zeros_like(averaged))).numpy()
