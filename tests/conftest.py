import pytest

from launching import LAUNCHES, launch_jobs


@pytest.fixture(scope="session")
def horovod_jobs(request, tmp_path_factory):
    """The HOROVOD_JOBS of every collected test module, run in one launch per entry of
    LAUNCHES (tests/launching.py); the jobs' directory, for `ran` and the jobs' files."""
    pytest.importorskip("horovod.tensorflow", reason="horovod is built by scripts/setup_env.sh")
    modules = sorted({getattr(item, "module", None) for item in request.session.items} - {None},
                     key=lambda m: m.__name__)
    jobs = [job for module in modules for job in getattr(module, "HOROVOD_JOBS", ())]
    assert len({job.out for job in jobs}) == len(jobs), "two jobs write one directory"
    root = tmp_path_factory.mktemp("horovod_jobs")
    for launch in LAUNCHES:
        if any(job.launch == launch for job in jobs):
            launch_jobs(root, launch, [job for job in jobs if job.launch == launch])
    return root
