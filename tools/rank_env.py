"""Runs a command in the environment picasso-run gives every rank.

    python tools/rank_env.py COMMAND [ARGS...]

Thread pools. TensorFlow sizes both of a process's pools (intra-op: the threads one
kernel is cut over; inter-op: the kernels run at once) to every core of the host. N
ranks on one host then run N times as many busy threads as there are cores: a kernel
cut into as many pieces as threads waits for its last piece whenever one of its threads
is descheduled, and the ranks preempt each other's collectives. So each pool gets
cores // (ranks on this host), at least 1, as torchrun does with OMP_NUM_THREADS. The
ranks on this host come from the launcher (Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE,
Horovod's Gloo launcher's HOROVOD_LOCAL_SIZE); the cores are those the process may run
on (its CPU affinity: a container's cpuset, say); picasso-run binds no rank to cores of
its own, so every rank on a host shares them. A script's own tf.config.threading call
wins too. (picasso_tf.distributed.world.oversubscribed_threads warns under other
launchers.)

Memory. glibc's malloc hands freed memory back to the kernel: blocks above a threshold
that it moves with what it has seen freed are mapped and unmapped one by one, and the
free top of the heap is trimmed. A training step frees what the previous one allocated,
so whether the next step finds that memory or faults it in again, page by page and
zeroed by the kernel, depends on where its blocks happened to land. A rank of hybrid
parallelism (whose exchange's buffers change size every step) was seen to fault in
thousands of pages a step, a large share of its CPU time (docs/benchmarks.md, "A rank's
step faulting its memory in afresh").
MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ fix both thresholds: blocks up to
32 MiB come from the heap, and the main heap keeps up to 1 GiB of free memory, so a
step reuses the last one's pages. The cost is that a rank holds on to memory it freed.

A value already in the environment wins, variable by variable.
"""
import os
import sys

POOLS = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")
LOCAL_SIZE = ("OMPI_COMM_WORLD_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE")
# 32 MiB: the highest glibc moves its own mmap threshold to (blocks above stay mapped one by one).
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def ranks_on_host(environ):
    """How many ranks the launcher started on this host (1 when it says nothing)."""
    for name in LOCAL_SIZE:
        if environ.get(name, "").isdigit() and int(environ[name]) > 0:
            return int(environ[name])
    return 1


def rank_environment(environ, cores):
    """`environ` with what it does not set already: each thread pool sized to this
    rank's share of the `cores` that the host's ranks share, and malloc's thresholds."""
    share = str(max(1, cores // ranks_on_host(environ)))
    return {**{name: share for name in POOLS}, **MALLOC, **environ}


def main(argv=None):
    command = sys.argv[1:] if argv is None else argv
    if not command:
        print("rank_env: give the command to run", file=sys.stderr)
        return 2
    env = rank_environment(dict(os.environ), len(os.sched_getaffinity(0)))
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        print(f"rank_env: cannot run {command[0]!r}: {e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
