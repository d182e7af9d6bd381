"""An id outside its table in one rank's batch, under Horovod (Gloo on loopback): every
rank refuses the step with the same error, naming the feature, the id and the rank,
before any table of any rank changes and without a collective the others do not
issue, so that a script that catches it trains on in step on every rank. Exchanged
tables and tables replicated on every rank alike. The check rides in the ids'
AllToAllv: a step that exchanges rows runs the same collectives; one that exchanges
none (every table replicated) sends that AllToAllv for the check alone; with
micro-batches, each micro-batch's (the bad id in the last one). The worker is
tests/workers/bad_ids.py."""
import json

import pytest

from launching import Job, ran

EXPECTED = {"hashed": "ids of feature] [user] [must lie in [0,] [1000] [): got] [5000] [in the batch of rank] [1]",
            "vocabulary": "ids of feature] [city] [must lie in [0,] [50] [): got] [500] [in the batch of rank] [1]",
            "replicated": "ids of feature] [user] [must lie in [0,] [1000] [): got] [5000] [in the batch of rank] [1]",
            "mixed": "ids of feature] [history] [must lie in [0,] [500] [): got] [5000] [in the batch of rank] [1]"}
EXPECTED["mixed_micro_batches"] = EXPECTED["mixed"]
# The groups each model shards and replicates (hybrid_training's: 8 and 4 wide).
GROUPS = {"hashed": (["packed_float32_d4", "packed_float32_d8"], []),
          "replicated": ([], ["packed_float32_d4", "packed_float32_d8"]),
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
        # Trained on as if the bad batch had never come: losses and every array held, to the bit.
        assert len(result["losses"]) == 6 and result["losses"] == result["expected"]
        assert result["same_state"]
        # The ids' alone, or with the rows' both ways; per micro-batch.
        alltoall = (1 if model == "replicated" else 3) * (2 if "micro" in model else 1)
        assert result["collectives"] == {"HorovodAlltoall": alltoall, "HorovodGroupedAllreduce": 1}
        if model in GROUPS:
            report = result["distribute"]
            assert (report.get("sharded", []), sorted(report["replicated"])) == GROUPS[model]
