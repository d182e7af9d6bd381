"""Runs a command with TensorFlow's thread pools sized to this rank's share of its
host's cores; picasso-run starts every rank through it.

    python tools/rank_threads.py COMMAND [ARGS...]

TensorFlow sizes both of a process's pools (intra-op: the threads one kernel is cut
over; inter-op: the kernels run at once) to every core of the host. N ranks on one
host then run N times as many busy threads as there are cores: a kernel cut into as
many pieces as threads waits for its last piece whenever one of its threads is
descheduled, and the ranks preempt each other's collectives. So each pool gets
cores // (ranks on this host), at least 1, as torchrun does with OMP_NUM_THREADS.

The ranks on this host come from the launcher (Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE,
Horovod's Gloo launcher's HOROVOD_LOCAL_SIZE). A value already in the environment wins
(TF_NUM_INTRAOP_THREADS, TF_NUM_INTEROP_THREADS), and so does a script's own
tf.config.threading call. The cores are those the process may run on (its CPU affinity:
a container's cpuset, say); picasso-run binds no rank to cores of its own, so every rank
on a host shares them. (picasso_tf.distributed.world.oversubscribed_threads warns under
other launchers.)
"""
import os
import sys

POOLS = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")
LOCAL_SIZE = ("OMPI_COMM_WORLD_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE")


def ranks_on_host(environ):
    """How many ranks the launcher started on this host (1 when it says nothing)."""
    for name in LOCAL_SIZE:
        if environ.get(name, "").isdigit() and int(environ[name]) > 0:
            return int(environ[name])
    return 1


def thread_environment(environ, cores):
    """`environ` with each pool not already set sized to this rank's share of the
    `cores` that the host's ranks share."""
    share = str(max(1, cores // ranks_on_host(environ)))
    return {**{name: share for name in POOLS}, **environ}


def main(argv=None):
    command = sys.argv[1:] if argv is None else argv
    if not command:
        print("rank_threads: give the command to run", file=sys.stderr)
        return 2
    env = thread_environment(dict(os.environ), len(os.sched_getaffinity(0)))
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        print(f"rank_threads: cannot run {command[0]!r}: {e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
