"""The suite runs on 2 pytest-xdist workers (pyproject's addopts: -n 2 --dist loadgroup
--no-loadscope-reorder; -n 0 runs it in this one process, as --pdb needs). Each worker
is a pytest session of its own, and takes one work unit after another: a test alone, or
every test of one xdist_group. So:

- A module whose tests share something that costs time (a module fixture, an
  lru_cache'd training) puts them in one group: pytestmark = pytest.mark.xdist_group(NAME).
- Every test that needs `horovod_jobs`, whatever its module, is put here in the group
  "horovod_jobs": one worker runs the launches while the other goes on with the rest.
- The units are handed out in the order of the collection, reordered here (under xdist
  only): that group first (its launches, about 3 minutes, are the longest unit and must
  not be left to the end), then the other groups, then the tests alone.
- `horovod_jobs` runs the launches once for all workers even if its tests were spread
  over both (a lock and a done marker in the directory the workers share).

pytest 9.2 made --dist loadgroup hand out every test alone (it marks a test's group
on its node id, which pytest 9.2 no longer lets it change: pytest-xdist issue 1386), so
requirements.txt keeps pytest below 9.2, and a worker that finds the groups lost stops."""
import fcntl
import functools
import os
import shutil

import pytest

from launching import LAUNCHES, launch_jobs

HOROVOD_GROUP = "horovod_jobs"


def _needs_horovod_jobs(item):
    return "horovod_jobs" in getattr(item, "fixturenames", ())


@pytest.hookimpl(tryfirst=True)     # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    if not getattr(config.option, "loadgroup", False):      # set on the workers of --dist loadgroup
        return
    for item in items:
        if _needs_horovod_jobs(item):
            item.add_marker(pytest.mark.xdist_group(HOROVOD_GROUP))
    # Stable: the order within each group and among the tests alone is kept. Every
    # worker collects and sorts the same items, as xdist requires.
    items.sort(key=lambda item: 0 if _needs_horovod_jobs(item) else 1 if item.get_closest_marker("xdist_group") else 2)


@pytest.hookimpl(tryfirst=True)     # before xdist sends the controller the node ids
def pytest_collection_finish(session):
    if getattr(session.config.option, "loadgroup", False):
        lost = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
        if lost:
            raise RuntimeError(f"--dist loadgroup lost the xdist_group of {lost[0]} and {len(lost) - 1} more "
                               "tests (pytest 9.2 or later: pytest-xdist issue 1386); install requirements.txt's "
                               "pytest, or run with -n 0")


def _run_launches(request, root):
    modules = sorted({getattr(item, "module", None) for item in request.session.items} - {None},
                     key=lambda m: m.__name__)
    jobs = [job for module in modules for job in getattr(module, "HOROVOD_JOBS", ())]
    assert len({job.out for job in jobs}) == len(jobs), "two jobs write one directory"
    for launch in LAUNCHES:
        if any(job.launch == launch for job in jobs):
            launch_jobs(root, launch, [job for job in jobs if job.launch == launch])


@pytest.fixture(scope="session")
def horovod_jobs(request, tmp_path_factory):
    """The HOROVOD_JOBS of every collected test module, run in one launch per entry of
    LAUNCHES (tests/launching.py); the jobs' directory, for `ran` and the jobs' files.
    Every xdist worker collects every module, so each would run the same jobs: the first
    to get here runs them in the workers' shared temporary directory, holding a lock, and
    marks them done; another waits on the lock and reuses them."""
    pytest.importorskip("horovod.tensorflow", reason="horovod is built by scripts/setup_env.sh")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        root = tmp_path_factory.mktemp("horovod_jobs")
        _run_launches(request, root)
        return root
    shared = tmp_path_factory.getbasetemp().parent       # the run's base directory, above each worker's
    root, done = shared / "horovod_jobs", shared / "horovod_jobs.done"
    with open(shared / "horovod_jobs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)                  # released when the file closes
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)       # what a worker that failed midway left
            root.mkdir()
            _run_launches(request, root)
            done.write_text(worker)
    return root


def pytest_configure(config):
    """A plain Keras model that a test compiles builds its optimizer there
    (picasso_tf.models.training.build_optimizer, as picasso_tf builds its own): Keras
    would create the slots inside the first step's trace, and tf.function then traces
    the step a second time, most of a small test's time. Keras' own compile stays
    reachable as tf.keras.Model.compile.__wrapped__, for a test about Keras' behaviour."""
    import tensorflow as tf

    from picasso_tf.models.training import build_optimizer

    keras_compile = tf.keras.Model.compile

    @functools.wraps(keras_compile)
    def compile_and_build(model, *args, **kwargs):
        keras_compile(model, *args, **kwargs)
        build_optimizer(model)

    tf.keras.Model.compile = compile_and_build
    config.add_cleanup(lambda: setattr(tf.keras.Model, "compile", keras_compile))
