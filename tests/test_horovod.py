"""Horovod on loopback, over Gloo and over MPI, started by picasso-run: the collectives
picasso_tf's hybrid parallelism uses, and training on 2 ranks against one process."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from launching import ENV, WORKERS, Job, horovodrun_worker, job_error, ran

hvd = pytest.importorskip("horovod.tensorflow", reason="horovod is built by scripts/setup_env.sh")

OPTIMIZERS = ("sgd", "adagrad", "adam")


def hybrid(launch, out, *args):
    """A job of tests/workers/hybrid_training.py writing hybrid/OUT."""
    return Job(launch, f"hybrid/{out}", "hybrid_training", args)


JOBS = {job.out.split("/")[1]: job for job in [
    # The collectives alone, on each transport (MPI's first in its launch: it measures idle ranks).
    Job("gloo", "hybrid/smoke_gloo", "collectives_smoke", ()),
    Job("mpi", "hybrid/smoke_mpi", "collectives_smoke", ()),
    # The worker's model trained 20 steps by one process (batch 64) and by 2 ranks (32
    # each), each saving a checkpoint; the 2 ranks count their AllToAllv's bytes.
    hybrid("one", "out1", "--save", "hybrid/ckpt1"),
    hybrid("gloo", "out2", "--save", "hybrid/ckpt2", "--count-bytes"),
    # The same on 2 ranks with the rows and row gradients on a float16 wire.
    hybrid("gloo", "half", "--optimizers", "adam", "--wire-dtype", "float16", "--count-bytes"),
    # The same with every table small enough to stay whole on each rank (the default for small tables).
    hybrid("gloo", "replicated", "--optimizers", "adagrad", "--replicate-below", 1 << 20),
    # Hash-backed tables with a small hot tier, sharded over the ranks.
    hybrid("gloo", "hashed", "--optimizers", "sgd,adagrad,adam", "--hybrid-hash", "--save", "hybrid/ckpt_hashed"),
    # One process restores them, into hash storage and into tables.
    *(hybrid("one_after", f"hashed_into_{variant}", "--optimizers", "adagrad", "--restore", "hybrid/ckpt_hashed",
             *flags) for variant, flags in (("tables", ()), ("hash", ("--hybrid-hash",)))),
    hybrid("mpi", "mpi", "--optimizers", "adam"),
    *(hybrid("gloo", f"micro_{start}", "--optimizers", optimizer, "--micro-batches", 2, "--interleave-from", start)
      for start, optimizer in (("embedding", "adam"), ("mlp", "sgd"))),
    hybrid("gloo", "uneven", "--optimizers", "sgd", "--batches-rank1", 13),
    *(hybrid(launch, f"restored_{saved_by}_on_{restored_by}", "--optimizers", "adam", "--no-train", "--restore",
             f"hybrid/ckpt{saved_by}") for saved_by, restored_by, launch in ((2, 1, "one_after"), (1, 2, "gloo"),
                                                                             (2, 3, "three"))),
    hybrid("gloo", "micro_auto", "--optimizers", "sgd", "--micro-batches", "auto"),
    # Rank 1 alone without the ids check: its keys would reach the owners unsorted.
    hybrid("gloo", "disagree", "--optimizers", "sgd", "--no-check-ids-rank1"),
    *(hybrid("gloo", f"groups{groups}", "--optimizers", "sgd", "--no-stitching", "--interleave-groups", groups)
      for groups in (1, 2)),
]}
HOROVOD_JOBS = tuple(JOBS.values())


@pytest.fixture(scope="module")
def trained(horovod_jobs):
    """The output directory of this module's job of a name, once it ran on every rank."""
    return lambda name: ran(horovod_jobs, JOBS[name])


@pytest.mark.parametrize("transport", ["gloo", "mpi"])
def test_collectives_on_two_ranks_and_idle_mpi_ranks_do_not_spin(trained, transport):
    from picasso_tf.tools import rank_env
    out = trained(f"smoke_{transport}")
    results = [json.load(open(out / f"rank{r}.json")) for r in range(2)]
    for rank, res in enumerate(results):
        assert res["size"] == 2 and res["transport"] == transport
        # Rank r receives rank+1 values from every sender s: 100*s + 10*r + k.
        expected = [100 * s + 10 * rank + k for s in range(2) for k in range(rank + 1)]
        assert res["received"] == expected
        assert res["received_splits"] == [rank + 1, rank + 1]
        assert res["allreduce"] == [3.0, 2.0]
        # Over the float16 wire: the same values (exact in float16), back in float32, and
        # gradients of 1e-9 to 1e-6 returned within float16's rounding (2**-11), not lost.
        assert res["wire_received"] == expected and res["wire_dtype"] == "float32"
        assert res["wire_gradient_error"] <= 2.0 ** -11, res["wire_gradient_error"]
        # picasso-run sized each rank's thread pools to its share of the 2-rank host's cores,
        # and fixed malloc's thresholds.
        share = str(max(1, res["cores"] // 2))
        assert res["thread_pools"] == {"TF_NUM_INTRAOP_THREADS": share, "TF_NUM_INTEROP_THREADS": share}
        assert res["malloc"] == rank_env.MALLOC
    if transport == "mpi":
        # Asleep with Horovod's background thread running, on picasso-run's yield settings:
        # measured 0.03-0.05 CPU-s per second; without them one rank spins at 0.4-1.0.
        # (Gloo has no such setting: one of its ranks measured 0.1-0.75, not asserted.)
        assert max(res["idle_cpu_s"] for res in results) <= 0.25 * results[0]["idle_s"], results


def test_horovod_is_built_with_tensorflow_gloo_and_mpi():
    # What `horovodrun --check-build` reports, asked of the TensorFlow extension imported
    # above, without the 8 s that command takes to probe every framework in a process each.
    assert hvd.mpi_built() and hvd.gloo_built()


def test_picasso_run_gives_each_transport_its_flags():
    from picasso_tf.tools import launch
    command = ["python", "train.py"]
    # Every rank runs the command through rank_env (thread pools, malloc's thresholds).
    ranked = [sys.executable, launch.RANK_ENV] + command
    argv, env = launch.horovodrun_command(2, command, "mpi", environ={"PATH": "/usr/bin",
                                                                      "OMPI_MCA_mpi_yield_when_idle": "0"})
    assert argv[1:] == ["-np", "2", "-H", "localhost:2", "--mpi", "--binding-args=--bind-to none --map-by slot"] \
        + ranked
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)      # mpirun, picasso-train
    assert env["OMPI_MCA_threads_pthreads_yield_strategy"] == "nanosleep"
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "0"                                # the user's value wins
    argv, env = launch.horovodrun_command(2, command, "gloo", hosts="a:1,b:1", environ={})
    assert argv[1:] == ["-np", "2", "-H", "a:1,b:1", "--gloo"] + ranked
    assert not any(name.startswith("OMPI_MCA") for name in env)
    with pytest.raises(launch.LaunchError, match="no command to run"):
        launch.horovodrun_command(2, [], "mpi")


def test_rank_env_sizes_each_pool_to_the_ranks_share_of_the_cores():
    from picasso_tf.tools import rank_env
    pools = lambda env: [env.get(name) for name in rank_env.POOLS]   # noqa: E731
    assert pools(rank_env.rank_environment({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 16)) == ["4", "4"]
    assert pools(rank_env.rank_environment({"HOROVOD_LOCAL_SIZE": "3"}, 2)) == ["1", "1"]   # at least 1
    assert pools(rank_env.rank_environment({}, 8)) == ["8", "8"]          # no launcher: one rank
    user = {"OMPI_COMM_WORLD_LOCAL_SIZE": "2", "TF_NUM_INTRAOP_THREADS": "0"}   # 0: TensorFlow's default
    assert pools(rank_env.rank_environment(user, 8)) == ["0", "4"]        # the user's value wins
    # The command runs with them (exec'd by the script, as picasso-run starts every rank).
    env = {k: v for k, v in ENV.items() if k not in rank_env.POOLS}
    done = subprocess.run([sys.executable, rank_env.__file__, sys.executable, "-c",
                           "import os; print(os.environ.get('TF_NUM_INTRAOP_THREADS'))"],
                          capture_output=True, text=True, env=dict(env, OMPI_COMM_WORLD_LOCAL_SIZE="2"))
    assert done.returncode == 0 and done.stdout.strip() == str(max(1, len(os.sched_getaffinity(0)) // 2)), done


# A fresh process mallocs 16 MiB and frees it: is the block mapped on its own (glibc's
# default above 128 KiB), and does the heap keep it once freed (or hand it back)?
_MALLOC_PROBE = """
import ctypes
libc = ctypes.CDLL("libc.so.6")
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
block = libc.malloc(16 << 20)
mapped = libc.mallinfo2().hblkhd >= 16 << 20
libc.free(block)
print(mapped, libc.mallinfo2().fordblks >= 16 << 20)
"""


def test_rank_env_makes_malloc_keep_what_a_step_frees():
    from picasso_tf.tools import rank_env
    env = {k: v for k, v in ENV.items() if k not in rank_env.MALLOC}
    probe = [sys.executable, "-c", _MALLOC_PROBE]
    alone = subprocess.run(probe, capture_output=True, text=True, env=env)
    ranked = subprocess.run([sys.executable, rank_env.__file__] + probe, capture_output=True, text=True, env=env)
    assert alone.stdout.split() == ["True", "False"], alone       # glibc's default: mapped, handed back
    assert ranked.stdout.split() == ["False", "True"], ranked     # from the heap, and kept for the next step
    user = {"MALLOC_TRIM_THRESHOLD_": "0"}
    assert rank_env.rank_environment(user, 2)["MALLOC_TRIM_THRESHOLD_"] == "0"      # the user's value wins
    assert rank_env.rank_environment(user, 2)["MALLOC_MMAP_THRESHOLD_"] == rank_env.MALLOC["MALLOC_MMAP_THRESHOLD_"]


def test_a_rank_on_malloc_s_default_thresholds_is_warned_with_picasso_run_s():
    from picasso_tf.distributed.world import MALLOC_THRESHOLDS, default_malloc_thresholds
    from picasso_tf.tools import rank_env
    assert MALLOC_THRESHOLDS == rank_env.MALLOC
    message = default_malloc_thresholds({}, "glibc")
    assert "MALLOC_MMAP_THRESHOLD_=33554432 and MALLOC_TRIM_THRESHOLD_=1073741824" in message
    assert default_malloc_thresholds(rank_env.rank_environment({}, 2), "glibc") is None     # started by picasso-run
    assert default_malloc_thresholds({"MALLOC_TRIM_THRESHOLD_": "0"}, "glibc") is None     # the user's choice
    assert default_malloc_thresholds({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "glibc") is None
    assert default_malloc_thresholds({}, "") is None                                       # not glibc


def test_a_rank_sharing_its_host_on_tensorflow_s_default_pools_is_warned():
    from picasso_tf.distributed.world import oversubscribed_threads
    two = {"HOROVOD_LOCAL_SIZE": "2"}
    message = oversubscribed_threads(two, 2, 2, (0, 0))
    assert "2 ranks share this host's 2 cores" in message and "TF_NUM_INTRAOP_THREADS=1" in message
    assert oversubscribed_threads(dict(two, TF_NUM_INTRAOP_THREADS="0"), 8, 8, (0, 0)).endswith(
        "TF_NUM_INTEROP_THREADS=4 in their environment")                 # 0 is TensorFlow's default
    assert oversubscribed_threads({"OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, 2, 2, (0, 0)) is None   # alone on its host
    assert oversubscribed_threads(dict(two, TF_NUM_INTEROP_THREADS="1"), 2, 2, (0, 0)) is None  # sized by the user
    assert oversubscribed_threads(two, 2, 2, (1, 0)) is None                                    # or by the script
    assert oversubscribed_threads(two, 1, 2, (0, 0)) is None        # bound by its launcher to 1 of 2 cores


def _arrays(path):
    with np.load(path) as f:
        return [f[k] for k in f.files]


@pytest.mark.parametrize("optimizer,variant", [(o, "out2") for o in OPTIMIZERS] +
                         [("adagrad", "replicated")] + [(o, "hashed") for o in OPTIMIZERS])
def test_two_ranks_train_like_one_rank_with_the_whole_batch(trained, optimizer, variant):
    one, two = _arrays(trained("out1") / f"{optimizer}.npz"), _arrays(trained(variant) / f"{optimizer}.npz")
    run = json.load(open(trained(variant) / f"{optimizer}.json"))
    assert run["size"] == 2 and run["steps"] == 20 and run["transport"] == "gloo"
    if variant in ("out2", "hashed"):
        assert run["distribute"]["sharded"] == ["packed_float32_d4", "packed_float32_d8"]
    else:
        assert "sharded" not in run["distribute"] and len(run["distribute"]["replicated"]) == 2
    _assert_equal_up_to_summation_order(one, two)


def _assert_equal_up_to_summation_order(one, two):
    assert len(one) == len(two)
    for a, b in zip(one, two):
        # Tables (2-D, embedding-shaped) are equal up to summation order; dense weights within 1e-6.
        scale = max(float(np.abs(a).max()), 1e-3)
        assert float(np.abs(a - b).max()) <= 1e-6 * max(scale, 1.0), (a.shape, float(np.abs(a - b).max()))


def test_two_ranks_over_mpi_train_like_one_rank_with_the_whole_batch(trained):
    """The same training on picasso-run's default transport, MPI (Horovod here is built
    with it): the same plan and collectives as over Gloo, and the step of one process."""
    run = json.load(open(trained("mpi") / "adam.json"))
    assert run["size"] == 2 and run["transport"] == "mpi" and run["steps"] == 20
    assert run["distribute"]["sharded"] == ["packed_float32_d4", "packed_float32_d8"]
    assert run["collectives"] == {"HorovodAlltoall": 3, "HorovodGroupedAllreduce": 1}
    _assert_equal_up_to_summation_order(_arrays(trained("out1") / "adam.npz"), _arrays(trained("mpi") / "adam.npz"))


@pytest.mark.parametrize("start, alltoalls, optimizer", [("embedding", 6, "adam"), ("mlp", 3, "sgd")])
def test_two_ranks_over_micro_batches_train_like_one_rank_with_the_whole_batch(trained, start, alltoalls, optimizer):
    """micro_batches=2 on each of 2 ranks: from the embedding each micro-batch exchanges
    its own rows (ids out, rows back, row gradients back) and differentiates its own
    lookups; from the MLP the whole batch's rows are exchanged once. Either way one
    Allreduce of the summed dense gradients, one update, and the step of one process
    on the whole batch."""
    run = json.load(open(trained(f"micro_{start}") / f"{optimizer}.json"))
    assert run["steps"] == 20 and run["distribute"]["sharded"] == ["packed_float32_d4", "packed_float32_d8"]
    assert run["collectives"] == {"HorovodAlltoall": alltoalls, "HorovodGroupedAllreduce": 1}
    _assert_equal_up_to_summation_order(_arrays(trained("out1") / f"{optimizer}.npz"),
                                        _arrays(trained(f"micro_{start}") / f"{optimizer}.npz"))


def test_one_alltoallv_each_way_and_one_allreduce_per_step(trained):
    """Five tables in two groups: ids out, rows back, row gradients back (the rows'
    AllToAllv reversed), and every dense gradient in one grouped Allreduce."""
    for variant in ("out2", "hashed"):
        run = json.load(open(trained(variant) / "sgd.json"))
        assert run["collectives"] == {"HorovodAlltoall": 3, "HorovodGroupedAllreduce": 1}, variant


def test_a_float16_wire_halves_the_rows_bytes_and_trains_like_float32(trained):
    """wire_dtype="float16": the same collectives, the ids' bytes as they were, the
    rows' halved, the row gradients' halved plus one float16 exponent per owner; 20
    steps of Adam stay within float16's rounding of the float32 wire's losses and
    weights (measured: losses 2e-6 apart, weights 8e-4)."""
    full, half = (json.load(open(trained(variant) / "adam.json")) for variant in ("out2", "half"))
    assert half["collectives"] == full["collectives"] == {"HorovodAlltoall": 3, "HorovodGroupedAllreduce": 1}
    f, h = full["bytes_per_step"], half["bytes_per_step"]
    assert f["picasso_exchange_rows"] > 0 and f["reverse_of_picasso_exchange_rows"] > 0
    assert h["picasso_exchange_ids"] == f["picasso_exchange_ids"]
    assert h["picasso_exchange_rows"] == f["picasso_exchange_rows"] / 2
    assert h["picasso_exchange_rows_grads"] == f["reverse_of_picasso_exchange_rows"] / 2 + 2 * 2
    assert len(half["losses"]) == len(full["losses"]) == 20
    np.testing.assert_allclose(half["losses"], full["losses"], rtol=0, atol=1e-4)
    for a, b in zip(_arrays(trained("out2") / "adam.npz"), _arrays(trained("half") / "adam.npz")):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-2 * max(float(np.abs(a).max()), 1e-3))


def test_ranks_with_uneven_data_finish_together(trained):
    assert json.load(open(trained("uneven") / "sgd.json"))["steps"] == 13       # rank 0 had 20 batches


@pytest.mark.parametrize("saved_by,restored_by", [(2, 1), (1, 2), (2, 3)])
def test_checkpoints_restore_on_another_number_of_ranks(trained, saved_by, restored_by):
    restored = _arrays(trained(f"restored_{saved_by}_on_{restored_by}") / "adam.npz")
    saved = _arrays(trained(f"out{saved_by}") / "adam.npz")
    assert len(saved) == len(restored)      # weights and Adam's m and v of every table and kernel
    for a, b in zip(saved, restored):
        np.testing.assert_array_equal(a, b)


def test_a_rank_holds_only_its_block_of_each_sharded_table(trained):
    """Row-sharding lowers a rank's memory: after 20 steps of Adam, each rank's shard of
    every table and of each of its slots holds that rank's contiguous block of
    ceil(rows / 2) rows (the last block the rest, a 1-row table's second block none),
    and the original variables hold no rows."""
    held = [json.load(open(trained("out2") / f"adam.rank{r}.rows.json")) for r in range(2)]
    assert held[0].keys() == held[1].keys() and len(held[0]) == 15      # 5 tables, Adam's m and v of each
    for name in held[0]:
        rows = held[0][name]["rows"]
        block = -(-rows // 2)
        assert [h[name]["held"] for h in held] == [min(rows, block), rows - min(rows, block)], name
        assert [h[name]["shard"] for h in held] == [max(h[name]["held"], 1) for h in held], name
        assert [h[name]["original"] for h in held] == [0, 0], name
    assert held[0]["user_emb/embeddings:0"]["shard"] == held[1]["user_emb/embeddings:0"]["shard"] == 500


def test_a_two_rank_checkpoint_restores_into_the_plain_model(trained):
    """The ranks' parts merge into the plain model's checkpoint: Keras restores it whole
    into the model without picasso_tf, Adam's slots too."""
    sys.path.insert(0, WORKERS)
    import hybrid_training as worker
    import tensorflow as tf
    model = worker.build()
    model.compile(worker.OPTIMIZERS["adam"](), "binary_crossentropy")
    checkpoint = str(trained("out2").parent / "ckpt2" / "adam" / "ckpt")
    model.load_weights(checkpoint)
    model.optimizer.build(model.trainable_variables)
    tables = dict(tf.train.list_variables(checkpoint))
    assert tables["layer_with_weights-0/embeddings/.ATTRIBUTES/VARIABLE_VALUE"] == [1000, 8]
    restored = model.get_weights() + [v.numpy() for v in model.optimizer.variables if v.shape.rank == 2]
    saved = _arrays(trained("out2") / "adam.npz")
    assert len(saved) == len(restored)
    for a, b in zip(saved, restored):
        np.testing.assert_array_equal(a, b)


def test_hash_backed_shards_restore_into_one_process(trained):
    """A checkpoint of hash-backed tables sharded over 2 ranks holds whole tables: one
    process restores it into hash storage, and trains on as from tables (up to the
    stitched projection's summation order over the fetched rows)."""
    for a, b in zip(_arrays(trained("hashed_into_tables") / "adagrad.npz"),
                    _arrays(trained("hashed_into_hash") / "adagrad.npz")):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_rank_that_dies_stops_the_others(tmp_path):
    """Rank 1 exits in the middle of training, while rank 0 waits in a collective for
    it: the job ends with an error naming the rank, not a hang."""
    done = horovodrun_worker([tmp_path, "--optimizers", "sgd", "--die-at", 5], 2, timeout=180)
    assert done.returncode != 0
    assert "exited with non-zero status" in done.stderr and "Exit code: 17" in done.stderr, done.stderr[-2000:]
    assert not os.path.exists(tmp_path / "sgd.npz")


def test_micro_batches_auto_is_refused_under_horovod(horovod_jobs):
    """Each rank would pick its own K from its own memory, and the ranks' per-micro-batch
    exchanges must pair up."""
    error = job_error(horovod_jobs, JOBS["micro_auto"])
    assert error is not None and "micro_batches='auto' under Horovod (2 ranks)" in error, error


def test_ranks_with_different_exchange_options_are_refused(horovod_jobs):
    """A rank without the ids check would send its keys unsorted to owners that read them
    as sorted: optimize refuses on every rank before any exchange."""
    error = job_error(horovod_jobs, JOBS["disagree"])
    assert error is not None and "RanksDisagreeError" in error and "exchange options (check_ids" in error, error


def test_interleaving_groups_under_horovod_train_as_one_group(trained):
    """K-interleaving on 2 ranks: the two packed lookups in two chained groups, after the
    step's one exchange; the same collectives, and training bit for bit as one group."""
    run = json.load(open(trained("groups2") / "sgd.json"))
    assert len(run["k_interleave"]["groups"]) == 2 and run["k_interleave"]["changed"]
    assert run["collectives"] == {"HorovodAlltoall": 3, "HorovodGroupedAllreduce": 1}
    for a, b in zip(_arrays(trained("groups1") / "sgd.npz"), _arrays(trained("groups2") / "sgd.npz")):
        np.testing.assert_array_equal(a, b)
