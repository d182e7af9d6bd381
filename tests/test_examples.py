"""Every script in examples/ runs as a user runs it (a fresh process, from a scratch
directory) and prints what its docstring promises, so that none can rot. The
multi-rank one runs on one process and on 2 Gloo ranks under picasso-run, which must
agree."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
BIN = os.path.dirname(sys.executable)


def run(argv, cwd, timeout=300):
    """Runs argv; returns its stdout, failing with its output's tail unless it exits 0."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PICASSO_")}    # the defaults, as documented
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, argv))} exited {done.returncode}:\n" \
                                 f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def example(name, tmp_path, *args):
    return run([sys.executable, os.path.join(EXAMPLES, name), *args], tmp_path)


def test_every_example_is_tested():
    text = open(__file__).read()
    assert [f for f in os.listdir(EXAMPLES) if f.endswith(".py") and f not in text] == []


def test_keras_fit(tmp_path):
    out = example("keras_fit.py", tmp_path)
    assert "test: {'loss'" in out and "embedding sites: 52, left as they were: 0" in out, out
    assert "optimizer: packed tables: fused Adagrad" in out, out


def test_deepctr_deepfm_trains_like_the_plain_model(tmp_path):
    pytest.importorskip("deepctr")
    out = example("deepctr_deepfm.py", tmp_path)
    losses = {name: np.array(values.split(), float)
              for name, values in re.findall(r"(\w+) loss per epoch: \[([^\]]*)\]", out)}
    np.testing.assert_allclose(losses["picasso_tf"], losses["plain"], atol=2e-5)
    assert "embedding sites recognised: 52, left alone: 0" in out, out


def test_custom_loop(tmp_path):
    out = example("custom_loop.py", tmp_path)
    assert re.search(r"epoch 2: mean loss 0\.\d+ over 16 steps", out), out
    assert "optimizer: packed tables: fused Adagrad" in out, out


def test_tfrs_ranking(tmp_path):
    pytest.importorskip("tensorflow_recommenders")
    out = example("tfrs_ranking.py", tmp_path)
    assert "test: {'auc'" in out and "optimizer: Ranking.train_step, the model's own" in out, out


def test_two_ranks_train_like_one_process(tmp_path):
    if not os.path.exists(os.path.join(BIN, "horovodrun")):
        pytest.skip("horovodrun is built by scripts/setup_env.sh")
    script = os.path.join(EXAMPLES, "two_ranks.py")
    one = run([sys.executable, script, "--out", "one"], tmp_path)
    two = run([os.path.join(BIN, "picasso-run"), "-np", "2", "--gloo", sys.executable, script, "--out", "two"],
              tmp_path, timeout=400)
    loss = r"ranks: {}, loss on all the data after training: (\d\.\d+)"
    assert "'changed': True, 'sharded': [" in two, two
    assert os.path.exists(tmp_path / "two" / "ckpt.index")
    np.testing.assert_allclose(float(re.search(loss.format(2), two).group(1)),
                               float(re.search(loss.format(1), one).group(1)), atol=2e-5)


def test_hybrid_hash_and_vocabulary(tmp_path):
    out = example("hybrid_hash_and_vocabulary.py", tmp_path)
    assert re.search(r"hybrid_hash: loss 0\.\d+, hot_hit_ratio 0\.\d+, hot_tier_rows [1-9]", out), out
    held, exported = re.search(r"keys held (\d+), distinct ids seen \d+, rows exported \((\d+), 8\)", out).groups()
    assert 0 < int(held) == int(exported) <= 300, out


def test_save_restore_serve(tmp_path):
    """save_restore_serve.py runs serve_export.py in a process of its own."""
    out = example("save_restore_serve.py", tmp_path, "--out", "serving")
    assert "plain model restored from the checkpoint, same predictions: True" in out, out
    assert "loaded PicassoModel from model.keras, same predictions: True" in out, out
    assert "picasso_tf imported: False | Picasso ops: [] | same predictions: True" in out, out
