"""Dynamic vocabularies under Horovod (Gloo on loopback): each rank holds the raw keys it
owns, and the exchange serves them in the same AllToAllv as the row-sharded tables' ids.
Two ranks with half the batch each train like one process with the whole batch,
admission included (exact, and by a Bloom filter on each owner); a checkpoint holds
every rank's keys and restores into another number of ranks (the Bloom filters into one
process or as many ranks); a batch beyond one rank's capacity fails on every rank,
changing nothing.
The worker is tests/workers/vocabulary_training.py."""
import json
import re
import sys

import numpy as np
import pytest

from launching import WORKERS, Job, ran

RUNS = ("sgd", "adagrad", "adagrad-admit2", "adagrad-admit2-bloom")
TABLES = ("emb_user/embeddings", "emb_tags/embeddings", "emb_item/embeddings")
# Restores of a checkpoint of 2 ranks or one process, into one process, 2 or 3 ranks:
# (saved_by, restored_by, format).
BLOOM_RESTORES = [(2, 1, "checkpoint"), (2, 2, "weights"), (1, 2, "checkpoint"), (2, 3, "weights")]
RESTORES = [(2, 1, "weights"), (2, 1, "checkpoint"), (1, 2, "weights"), (1, 2, "checkpoint")]
LAUNCH = {1: "one_after", 2: "gloo", 3: "three"}       # of a restore, by its ranks


def restore(run, saved_by, restored_by, format):
    """The job restoring `run` from the checkpoint saved_by ranks wrote."""
    return Job(LAUNCH[restored_by], f"vocabulary/{run}_{saved_by}_on_{restored_by}_{format}", "vocabulary_training",
               ["--runs", run, "--restore", f"vocabulary/ckpt{saved_by}", "--format", format])


JOBS = {job.out.split("/")[1]: job for job in [
    # Every run trained 20 steps by one process (batch 64) and by 2 ranks (32 each),
    # each saving save_weights and tf.train.Checkpoint files.
    *(Job(launch, f"vocabulary/out{np_}", "vocabulary_training", ["--save", f"vocabulary/ckpt{np_}"])
      for np_, launch in ((1, "one"), (2, "gloo"))),
    *(restore("adagrad-admit2-bloom", *case) for case in BLOOM_RESTORES),
    *(restore("adagrad-admit2", *case) for case in RESTORES),
    Job("gloo", "vocabulary/crowd", "vocabulary_training", ["--crowd"]),
]}
HOROVOD_JOBS = tuple(JOBS.values())


@pytest.fixture(scope="module")
def trained(horovod_jobs):
    """The output directory of this module's job of a name, once it ran on every rank."""
    return lambda name: ran(horovod_jobs, JOBS[name])


def vocabulary(path):
    """{table: (keys, rows, the keys the writing rank holds)} of a worker's npz."""
    with np.load(path) as f:
        return {t: (f[f"{t}|keys"], f[f"{t}|rows"], f[f"{t}|held"]) for t in TABLES}


def bloom_counters(path):
    """{table: the writing rank's Bloom counters} of a worker's npz."""
    with np.load(path) as f:
        return {t: f[f"{t}|bloom"] for t in TABLES}


@pytest.mark.parametrize("run", RUNS)
def test_two_ranks_train_like_one_process_with_the_whole_batch(trained, run):
    one, two = (json.load(open(trained(out) / f"{run}.json")) for out in ("out1", "out2"))
    assert two["size"] == 2 and one["steps"] == two["steps"] == 20
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=0, atol=1e-6)
    # The raw keys' ids go out in the row-sharded table's AllToAllv: no collective of their own.
    assert two["collectives"] == {"HorovodAlltoall": 3, "HorovodGroupedAllreduce": 1}
    assert set(two["dynamic_vocabulary"]["groups"]) < set(two["distribute"]["sharded"])
    expected, got = vocabulary(trained("out1") / f"{run}.rank0.npz"), vocabulary(trained("out2") / f"{run}.rank0.npz")
    for table in TABLES:
        np.testing.assert_array_equal(got[table][0], expected[table][0])
        np.testing.assert_allclose(got[table][1], expected[table][1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("run", ["adagrad-admit2", "adagrad-admit2-bloom"])
def test_admission_counts_every_ranks_lookups(trained, run):
    """admit_after=2 admits exactly the user ids looked up twice in all, among them ids
    that each rank looked up once: the owner sums the ranks' lookups (the Bloom filter's
    65,536 counters do not saturate on these few hundred keys)."""
    sys.path.insert(0, WORKERS)
    import vocabulary_training as worker
    users = worker.data(worker.STEPS)[0]["user"].reshape(worker.STEPS, 2, -1)     # step, rank's half, sample
    keys, total = np.unique(users, return_counts=True)
    per_rank = [dict(zip(*np.unique(users[:, r], return_counts=True))) for r in range(2)]
    across = [k for k, n in zip(keys, total) if n == 2 and per_rank[0].get(k) == per_rank[1].get(k) == 1]
    assert across       # the data has such ids
    admitted = vocabulary(trained("out2") / f"{run}.rank0.npz")["emb_user/embeddings"][0]
    np.testing.assert_array_equal(admitted, keys[total >= 2])


def test_the_owners_bloom_filters_add_up_to_one_process_filter(trained):
    """Each owner counts the lookups of the keys it owns: the ranks' counters sum to the
    counters of one process that counted every key, to the last one."""
    one = bloom_counters(trained("out1") / "adagrad-admit2-bloom.rank0.npz")
    ranks = [bloom_counters(trained("out2") / f"adagrad-admit2-bloom.rank{r}.npz") for r in range(2)]
    for table in TABLES:
        assert one[table].sum() > 0 and all(r[table].sum() > 0 for r in ranks)
        np.testing.assert_array_equal(ranks[0][table] + ranks[1][table], one[table])


@pytest.mark.parametrize("saved_by,restored_by,format", BLOOM_RESTORES)
def test_bloom_counters_restore_on_one_process_or_as_many_ranks_else_are_refused(trained, saved_by, restored_by,
                                                                                 format):
    """Into one process, a 2-rank checkpoint's Bloom filter is the sum of the ranks'
    (one process's filter, as above); into as many ranks, each rank's own; the filters
    of another number of ranks cannot be split by owner, and are refused by name,
    changing nothing."""
    run = "adagrad-admit2-bloom"
    out = trained(f"{run}_{saved_by}_on_{restored_by}_{format}")
    if restored_by not in (1, saved_by):
        saver = "one process" if saved_by == 1 else f"{saved_by} ranks"
        for rank in range(restored_by):
            error = json.load(open(out / f"{run}.rank{rank}.json"))["restore_error"]
            assert re.search(f"Bloom admission counters of table emb_(user|tags|item)/embeddings "
                             f"\\(admission_filter='bloom'\\) were saved by {saver}, and this model runs on "
                             f"{restored_by} ranks", error), error
            assert "admission_filter='exact'" in error
            # Refused before any table or filter took anything of the checkpoint.
            assert json.load(open(out / f"{run}.rank{rank}.json"))["unchanged"]
        return
    saved = [bloom_counters(trained(f"out{saved_by}") / f"{run}.rank{r}.npz") for r in range(saved_by)]
    for rank in range(restored_by):
        restored = bloom_counters(out / f"{run}.rank{rank}.npz")
        for table in TABLES:
            expected = saved[rank][table] if restored_by == saved_by else sum(s[table] for s in saved)
            np.testing.assert_array_equal(restored[table], expected)


def test_each_rank_holds_the_keys_it_owns_and_every_rank_gets_them_all(trained):
    from picasso_tf.embedding.row_keys import raw_key_owner
    ranks = [vocabulary(trained("out2") / f"sgd.rank{r}.npz") for r in range(2)]
    for table in TABLES:
        keys, rows, _ = ranks[0][table]
        np.testing.assert_array_equal(ranks[1][table][0], keys)
        np.testing.assert_array_equal(ranks[1][table][1], rows)
        held = [r[table][2] for r in ranks]
        np.testing.assert_array_equal(np.sort(np.concatenate(held)), keys)
        for rank, mine in enumerate(held):
            assert (raw_key_owner(mine, 2).numpy() == rank).all(), table
    # User ids are all 7 mod 1000, yet both ranks own a fair share of them.
    users = [len(r["emb_user/embeddings"][2]) for r in ranks]
    assert min(users) > 0.3 * sum(users), users


@pytest.mark.parametrize("saved_by,restored_by,format", RESTORES)
def test_a_checkpoint_restores_the_vocabulary_into_another_number_of_ranks(trained, saved_by, restored_by, format):
    run = "adagrad-admit2"
    out = trained(f"{run}_{saved_by}_on_{restored_by}_{format}")
    saved = vocabulary(trained(f"out{saved_by}") / f"{run}.rank0.npz")
    for rank in range(restored_by):
        restored = vocabulary(out / f"{run}.rank{rank}.npz")
        for table in TABLES:
            np.testing.assert_array_equal(restored[table][0], saved[table][0])
            np.testing.assert_array_equal(restored[table][1], saved[table][1])
    if restored_by == 2:
        held = [vocabulary(out / f"{run}.rank{r}.npz")["emb_user/embeddings"][2] for r in range(2)]
        assert len(held[0]) and len(held[1]) and not np.intersect1d(*held).size


def test_a_batch_beyond_one_ranks_capacity_fails_on_every_rank_and_changes_nothing(trained):
    """The crowded batch's 64 user ids are all rank 1's: rank 0's own keys are within the
    capacity, and it refuses the step all the same (else it would wait for rank 1 in the
    next collective). Training then goes on, in step."""
    out = trained("crowd")
    for rank in range(2):
        result = json.load(open(out / f"crowd.rank{rank}.json"))
        assert result["distinct"] == 64
        assert "distinct ids of user (table emb_user/embeddings) than vocabulary_capacity=48 keys on the rank " \
               "that owns them" in result["error"], result["error"][-600:]
        assert result["unchanged"] and np.isfinite(result["loss_after"])
        # The capacity's check costs one small Allreduce of its own.
        assert result["collectives"] == {"HorovodAlltoall": 3, "HorovodAllreduce": 1, "HorovodGroupedAllreduce": 1}
    unsaved = json.load(open(out / "crowd.rank0.json"))["unsaved"]
    assert "call model.picasso.write_back() on every rank before writing a checkpoint" in unsaved
