"""Horovod with Gloo on loopback: the collectives picasso_tf's hybrid parallelism uses."""
import json
import os
import subprocess
import sys

import pytest

hvd = pytest.importorskip("horovod.tensorflow", reason="horovod is built by scripts/setup_env.sh")
WORKERS = os.path.join(os.path.dirname(__file__), "workers")


def horovodrun(script, out_dir, np=2):
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    cmd = [horovodrun, "-np", str(np), "-H", f"localhost:{np}", "--gloo",
           sys.executable, os.path.join(WORKERS, script), str(out_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.load(open(out_dir / f"rank{r}.json")) for r in range(np)]


def test_alltoallv_and_allreduce_on_two_ranks(tmp_path):
    results = horovodrun("collectives_smoke.py", tmp_path)
    for rank, res in enumerate(results):
        assert res["size"] == 2
        # Rank r receives rank+1 values from every sender s: 100*s + 10*r + k.
        expected = [100 * s + 10 * rank + k for s in range(2) for k in range(rank + 1)]
        assert res["received"] == expected
        assert res["received_splits"] == [rank + 1, rank + 1]
        assert res["allreduce"] == [3.0, 2.0]


def test_horovod_is_built_with_tensorflow_and_gloo():
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    out = subprocess.run([horovodrun, "--check-build"], capture_output=True, text=True, timeout=120).stdout
    assert "[X] TensorFlow" in out and "[X] Gloo" in out, out
