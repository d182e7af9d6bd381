"""Starting the workers in tests/workers on several ranks (picasso-run, over MPI or Gloo)
or as one process, for the Horovod tests.

A launch's start-up (Python, TensorFlow and Horovod on every rank) costs 10-15 s, more
than most jobs, so a test module does not launch its worker per test: it declares its
jobs in HOROVOD_JOBS, and the session fixture `horovod_jobs` (tests/conftest.py) runs
the jobs of every collected module in one launch per entry of LAUNCHES, through
tests/workers/jobs.py. Each test then asserts on its own job's files with `ran`."""
import collections
import json
import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(TESTS, "workers")
# The workers import this checkout's picasso_tf, not the one an editable install in a
# shared environment points at (a git worktree's tests would run another tree's code).
# Their thread pools and malloc's thresholds are picasso-run's choice (tools/rank_env.py's
# POOLS and MALLOC, named here: importing it would import TensorFlow into pytest's
# controller), whatever the caller's environment sets.
_RANK_ENV = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
ENV = dict({k: v for k, v in os.environ.items() if k not in _RANK_ENV},
           PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(TESTS), os.environ.get("PYTHONPATH")])))
PICASSO_RUN = os.path.join(os.path.dirname(sys.executable), "picasso-run")

# name: (ranks, transport), in the order they run: a job reads only what jobs of earlier
# launches, or earlier in its own, wrote. One process; 2 ranks over Gloo; one process
# again (restoring what 2 ranks saved); 3 ranks over Gloo; 2 ranks over picasso-run's
# default transport, MPI (Horovod here is built with it).
LAUNCHES = {"one": (1, None), "gloo": (2, "gloo"), "one_after": (1, None), "three": (3, "gloo"), "mpi": (2, None)}

# One job of a worker: tests/workers/`worker`.py's main([out, *args]), in the launch
# `launch` (a key of LAUNCHES), from the session's job directory (relative paths, `out`
# the job's output directory among them, are inside it).
Job = collections.namedtuple("Job", "launch out worker args")


def picasso_run(np_, command, transport, timeout):
    """`command` on np_ ranks, started by picasso-run over `transport` ("mpi", "gloo", or
    None for its default)."""
    assert os.path.exists(PICASSO_RUN), "no picasso-run: install picasso_tf again (scripts/setup_env.sh)"
    flags = [f"--{transport}"] if transport else []
    return subprocess.run([PICASSO_RUN, "-np", str(np_)] + flags + [str(c) for c in command],
                          capture_output=True, text=True, timeout=timeout, env=ENV)


def horovodrun_worker(args, np_, timeout=400, worker="hybrid_training.py", transport="gloo"):
    """Runs tests/workers/`worker` on np_ ranks over `transport` (np_=1: one plain process)."""
    script = [sys.executable, os.path.join(WORKERS, worker)] + [str(a) for a in args]
    if np_ > 1:
        return picasso_run(np_, script, transport, timeout)
    return subprocess.run(script, capture_output=True, text=True, timeout=timeout, env=ENV)


def check_ran(done):
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def launch_jobs(root, launch, jobs, timeout=1800):
    """Runs `jobs` (all of `launch`) in one launch from `root`; its output goes to
    root/LAUNCH.log, which `ran` shows for a job that left no status."""
    listing = root / f"{launch}.jobs.json"
    listing.write_text(json.dumps([dict(job._asdict(), args=[str(a) for a in job.args]) for job in jobs]))
    np_, transport = LAUNCHES[launch]
    try:
        done = horovodrun_worker([listing], np_, timeout, "jobs.py", transport)
        log = f"exit status {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    except subprocess.TimeoutExpired as e:
        log = f"timed out after {timeout} s\n{e.stdout}\n{e.stderr}"
    (root / f"{launch}.log").write_text(log)


def job_error(root, job):
    """What `job` raised (the same on every rank, else the ranks' errors), or None."""
    errors = []
    for rank in range(LAUNCHES[job.launch][0]):
        status = root / "status" / f"{job.out}.rank{rank}.json"
        if not status.exists():
            return f"rank {rank} left no status; the launch's log:\n" + (root / f"{job.launch}.log").read_text()
        errors.append(json.loads(status.read_text())["error"])
    return errors[0] if len(set(errors)) == 1 else "\n".join(f"rank {r}: {e}" for r, e in enumerate(errors))


def ran(root, job):
    """Asserts `job` ran to its end on every rank; returns its output directory."""
    error = job_error(root, job)
    assert error is None, error
    return root / job.out
