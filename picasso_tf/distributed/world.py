"""The Horovod process group picasso_tf runs in, and what its ranks must agree on.

Every rank must build the same graphs (their collectives are matched by name) and run
the same number of steps (a rank that stops early leaves the others waiting in an
AllToAllv). One process, or Horovod not initialised, is a world of one: nothing here
then calls Horovod.
"""
import dataclasses
import os
import platform

import numpy as np
import tensorflow as tf


class RanksDisagreeError(RuntimeError):
    """The ranks built different plans: their collectives would never match."""


@dataclasses.dataclass(frozen=True)
class World:
    size: int = 1
    rank: int = 0

    @property
    def distributed(self):
        return self.size > 1


def current_world():
    """The Horovod world when horovod.tensorflow is initialised, else a world of one."""
    try:
        import horovod.tensorflow as hvd
    except ImportError:
        return World()
    try:
        return World(hvd.size(), hvd.rank()) if hvd.is_initialized() else World()
    except ValueError:          # built without TensorFlow support
        return World()


# What each launcher tells its processes: horovodrun --gloo sets HOROVOD_*, mpirun
# (horovodrun --mpi, picasso-run) sets OMPI_COMM_WORLD_* and PMIX_RANK, other MPIs PMI_*/MV2_*.
_SIZE_VARS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")
_RANK_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE")       # ranks on this host
_THREAD_POOL_VARS = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")
# What picasso-run sets for malloc (tools/rank_env.py's MALLOC).
MALLOC_THRESHOLDS = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "1073741824"}


def launched_world(environ=None):
    """(size, rank) of the process group that horovodrun/mpirun started this process in;
    (1, 0) when started alone. Read from the launcher's environment, before (and without)
    initialising Horovod, which is asked only when a launcher set a rank but no size."""
    environ = os.environ if environ is None else environ

    def first_int(names):
        for name in names:
            value = environ.get(name, "")
            if value.strip().isdigit():
                return int(value)
        return None

    size, rank = first_int(_SIZE_VARS), first_int(_RANK_VARS)
    if size is None and rank is not None:
        try:
            import horovod.tensorflow as horovod
            horovod.init()
            size, rank = horovod.size(), horovod.rank()
        except Exception:   # noqa: BLE001  (no horovod: the rank variable alone says "more than one")
            size = rank + 1 if rank > 0 else 1
    return (size or 1), (rank or 0)


def oversubscribed_threads(environ=None, cores=None, host_cores=None, configured=None):
    """The warning for a rank that shares its host with other ranks while running
    TensorFlow's default thread pools (a thread per core in each), else None: the rule
    picasso-run applies (tools/rank_env.py, which must not import this package). By
    default this process's environment, `cores` (its CPU affinity), `host_cores` (the
    host's) and `configured`, the pools' sizes given to tf.config.threading (0: not
    given). A size in the environment or given in the script is the user's choice, and
    a rank bound to fewer cores than the host has was placed by its launcher (TensorFlow
    sizes its pools to that affinity): no warning."""
    environ = os.environ if environ is None else environ
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    host_cores = (os.cpu_count() or cores) if host_cores is None else host_cores
    if configured is None:
        configured = (tf.config.threading.get_intra_op_parallelism_threads(),
                      tf.config.threading.get_inter_op_parallelism_threads())
    ranks = next((int(environ[n]) for n in _LOCAL_SIZE_VARS if environ.get(n, "").strip().isdigit()), 1)
    chosen = any(configured) or any(environ.get(p, "").strip() not in ("", "0") for p in _THREAD_POOL_VARS)
    if ranks < 2 or chosen or cores < host_cores:
        return None
    share = max(1, cores // ranks)
    return (f"picasso_tf: {ranks} ranks share this host's {cores} cores, each running TensorFlow's default thread "
            f"pools (a thread per core in each), so they preempt each other. Start them with picasso-run, which "
            f"gives each its share, or set TF_NUM_INTRAOP_THREADS={share} and TF_NUM_INTEROP_THREADS={share} in "
            "their environment")


def default_malloc_thresholds(environ=None, libc=None):
    """The warning for a rank whose glibc malloc runs on its default thresholds, else
    None: under them a step may fault in afresh, page by page, the memory the previous
    one freed, which picasso-run's settings prevent (tools/rank_env.py). A threshold in
    the environment (or in GLIBC_TUNABLES) is the user's choice: no warning."""
    environ = os.environ if environ is None else environ
    libc = platform.libc_ver()[0] if libc is None else libc
    if libc != "glibc" or any(environ.get(n) for n in MALLOC_THRESHOLDS) or "glibc.malloc." in environ.get(
            "GLIBC_TUNABLES", ""):
        return None
    settings = " and ".join(f"{name}={value}" for name, value in MALLOC_THRESHOLDS.items())
    return ("picasso_tf: this rank runs glibc's malloc on its default thresholds, under which a training step may "
            "fault in afresh, page by page, the memory the previous step freed. Start the ranks with picasso-run, "
            f"which sets them, or set {settings} in their environment")


def horovod_transport():
    """"mpi" or "gloo": what the initialised Horovod runs its collectives over (None
    when it is not initialised or not installed), to check that a launcher gave the
    transport asked for."""
    try:
        horovod = hvd()
    except ImportError:
        return None
    if not horovod.is_initialized():
        return None
    return "mpi" if horovod.mpi_enabled() else "gloo" if horovod.gloo_enabled() else None


def hvd():
    import horovod.tensorflow as horovod
    return horovod


def mean_over_ranks(values):
    """The element-wise mean of a float vector over the ranks (eagerly)."""
    values = np.asarray(values, np.float64)
    if values.size == 0:
        return values
    return hvd().allreduce(tf.constant(values), op=hvd().Average, name="picasso_agree_mean").numpy()


def min_over_ranks(value, name):
    """The smallest of an integer over the ranks (eagerly)."""
    return int(hvd().allreduce(tf.constant([int(value)], tf.int64), op=hvd().Min, name=name).numpy()[0])


def check_same_on_every_rank(fingerprint, what):
    """Raises RanksDisagreeError unless the integer `fingerprint` is equal on every rank."""
    lo = min_over_ranks(fingerprint, "picasso_agree_min")
    hi = -min_over_ranks(-fingerprint, "picasso_agree_max")
    if lo != hi:
        raise RanksDisagreeError(
            f"picasso_tf: the ranks built different {what} (fingerprints {lo} to {hi}); run the same "
            "model and options on every rank, with warm-up data of the same structure")


def broadcast_from_rank_zero(variables):
    """Every rank starts from rank 0's values (the dense part is replicated, and the
    tables are cut into shards from them)."""
    if variables:
        hvd().broadcast_variables(list(variables), root_rank=0)


def take_same_number_of_batches(dataset, world):
    """`dataset` cut to the number of batches of the rank with the fewest (counted by
    reading it once where its cardinality is unknown), so that all ranks stop together."""
    count = int(dataset.cardinality())
    if count == tf.data.UNKNOWN_CARDINALITY:
        count = int(dataset.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))
    if count == tf.data.INFINITE_CARDINALITY:
        count = _UNBOUNDED
    fewest = min_over_ranks(count, "picasso_agree_batches")
    if fewest == _UNBOUNDED:
        return dataset          # endless on every rank: steps_per_epoch ends each epoch
    if fewest < count:
        tf.get_logger().warning(f"picasso_tf: rank {world.rank} has {count} batches and another rank {fewest}: "
                                f"every rank runs {fewest}, so the last {count - fewest} of this rank's are skipped")
    return dataset.take(fewest)


_UNBOUNDED = 1 << 62
