"""Hash-backed tables (hybrid_hash=True) under Horovod (Gloo on loopback): a checkpoint
written half way through training, with tf.train.Checkpoint or save_weights, restores
into a fresh model on 2 ranks or on one process, and training goes on as if it had never
stopped. The worker is tests/workers/hash_resume.py."""
import json

import numpy as np
import pytest

from launching import Job, ran
from test_horovod import _arrays

# 2 ranks train 12 steps straight and, in a second model, 6 steps, a checkpoint in both
# formats, 6 steps; fresh models restore it on 2 ranks and on one process and train the
# last 6 steps.
HOROVOD_JOBS = (Job("gloo", "hash_resume/saved", "hash_resume", ["--save", "hash_resume/ckpt"]),
                Job("gloo", "hash_resume/on2", "hash_resume", ["--restore", "hash_resume/ckpt"]),
                Job("one_after", "hash_resume/on1", "hash_resume", ["--restore", "hash_resume/ckpt"]))


@pytest.fixture(scope="module")
def resumed(horovod_jobs):
    """The jobs' directory, once each ran on every rank."""
    for job in HOROVOD_JOBS:
        ran(horovod_jobs, job)
    return horovod_jobs / "hash_resume"


def results(directory, name):
    return json.load(open(directory / f"{name}.json")), _arrays(directory / f"{name}.npz")


@pytest.mark.parametrize("restored_by,fmt", [(2, "checkpoint"), (2, "weights"), (1, "checkpoint"), (1, "weights")])
def test_training_resumed_from_a_checkpoint_goes_on_as_uninterrupted(resumed, restored_by, fmt):
    whole, whole_weights = results(resumed / "saved", "whole")
    run, weights = results(resumed / f"on{restored_by}", f"resumed-{fmt}")
    assert whole["steps"] == run["steps"] == 12 and len(run["losses"]) == 6
    # On the ranks that saved it, to the bit; on one process, up to the summation order of
    # the ranks' row gradients (as 2 ranks train like one, tests/test_horovod.py).
    atol = 0 if restored_by == 2 else 1e-6
    np.testing.assert_allclose(run["losses"], whole["losses"], rtol=0, atol=atol)
    assert len(weights) == len(whole_weights)
    for a, b in zip(whole_weights, weights):
        np.testing.assert_allclose(b, a, rtol=0, atol=atol)


def test_the_hot_set_restores_on_the_ranks_that_saved_it(resumed):
    """The checkpoint holds every rank's hot rows and counts: after the last 6 steps
    (two refreshes), each rank's hot set is the uninterrupted run's."""
    for rank in range(2):
        whole = json.load(open(resumed / "saved" / f"whole.rank{rank}.json"))
        assert whole and all(whole.values())
        for fmt in ("checkpoint", "weights"):
            assert json.load(open(resumed / "on2" / f"resumed-{fmt}.rank{rank}.json")) == whole


def test_saving_half_way_does_not_change_training(resumed):
    whole, whole_weights = results(resumed / "saved", "whole")
    saved, saved_weights = results(resumed / "saved", "saved")
    assert saved["losses"] == whole["losses"]
    for a, b in zip(whole_weights, saved_weights):
        np.testing.assert_array_equal(b, a)
