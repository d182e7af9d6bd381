"""picasso-train end to end on tiny data: every data source, both modes, resume, export,
the errors, and the console entry points (one real run through `picasso-train`)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from picasso_tf import data as pdata
from picasso_tf import models as zoo
from picasso_tf.tools import train

# A tiny synthetic "wide" table: 5 one-hot fields of 40 ids.
TINY = ["--data", "wide", "--preset-option", "num_fields=5", "--vocab-size", "40", "--rows", "400",
        "--batch-size", "64"]
FAST = ["--no-profile"]


def run_cli(tmp_path, *argv, name="run"):
    """run(parse(argv)) in-process with its own logdir; returns run()'s dict."""
    args = train.build_parser().parse_args(["--logdir", str(tmp_path / name), *argv])
    args._argv = list(argv)
    return train.run(args)


def fails(capsys, *argv):
    """main(argv) must exit 2 with one line on stderr; returns that line."""
    code = train.main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("picasso-train: error:"), err
    return err[0]


def small_wide(rows=300, seed=1):
    schema = pdata.wide_schema(num_fields=4, vocab_size=30, name="tiny-wide")
    return pdata.generate(schema, rows, seed=seed)


# -- both modes -----------------------------------------------------------------------------------

def test_both_modes_print_side_by_side_with_op_counts(tmp_path, capsys):
    out = run_cli(tmp_path, "--model", "lr", *TINY, "--steps", "8")
    printed = capsys.readouterr().out
    table = printed[printed.index("samples/s"):]
    for row in ("samples/s (after warm-up)", "train loss (last epoch)", "test AUC", "test log loss",
                "training-step ops"):
        assert row in table
    header = printed.splitlines()[printed.splitlines().index(table.splitlines()[0]) - 1]
    assert "baseline" in header and "picasso" in header
    assert "model.picasso.report():" in printed and "embedding sites" in printed

    summary = json.load(open(tmp_path / "run" / "summary.json"))
    assert set(summary["results"]) == {"baseline", "picasso"}
    base, pic = summary["results"]["baseline"], summary["results"]["picasso"]
    assert base["steps"] == pic["steps"] == 8
    # Same initial weights, same data order: the same training (float tolerance).
    assert pic["train_loss"] == pytest.approx(base["train_loss"], rel=1e-4, abs=1e-5)
    assert pic["test_auc"] == pytest.approx(base["test_auc"], abs=1e-3)
    assert 0 < base["test_log_loss"] < 2 and base["samples_per_second"] > 0
    assert summary["op_counts"]["step_baseline"] > 0 and summary["op_counts"]["step_picasso"] > 0
    assert summary["table"] in printed and summary["picasso_report"] in printed
    assert out["models"]["picasso"].picasso.report() == summary["picasso_report"]
    assert os.listdir(tmp_path / "run" / "picasso" / "train")          # TensorBoard events


# -- data sources ---------------------------------------------------------------------------------

def test_movielens(tmp_path):
    out = run_cli(tmp_path, "--model", "lr", "--data", "movielens", "--rows", "3000", "--steps", "3",
                  "--mode", "picasso", *FAST)
    s = out["summary"]
    assert s["schema"] == "movielens-100k" and "MovieLens" in s["data"]
    assert s["results"]["picasso"]["steps"] == 3 and s["results"]["picasso"]["test_auc"] is not None


def test_criteo_csv_file_without_schema(tmp_path):
    schema = pdata.criteo_schema(49)          # vocab 50, what --vocab-size 50 reads it as
    path = tmp_path / "day.csv"
    pdata.write_criteo(pdata.generate(schema, 300, seed=2), path, delimiter=",", header=True)
    out = run_cli(tmp_path, "--model", "lr", "--data", str(path), "--vocab-size", "50", "--batch-size", "64",
                  "--steps", "3", "--mode", "baseline", *FAST)
    s = out["summary"]
    assert s["data"].startswith("criteo file") and s["train_examples"] + s["test_examples"] == 300
    assert s["results"]["baseline"]["steps"] == 3


WRITERS = {"parquet": pdata.write_parquet, "tfrecord": pdata.write_tfrecord, "csv": pdata.write_csv}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_files_written_by_the_data_layer(tmp_path, fmt):
    data = small_wide()
    path = tmp_path / f"part-0.{fmt}"
    WRITERS[fmt](data, path)
    data.schema.save(tmp_path / "schema.json")
    out = run_cli(tmp_path, "--model", "lr", "--data", str(path), "--schema", str(tmp_path / "schema.json"),
                  "--rows", "250", "--batch-size", "64", "--steps", "2", "--mode", "baseline", *FAST)
    s = out["summary"]
    assert s["data"].startswith(f"{fmt} file") and s["train_examples"] + s["test_examples"] == 250
    np.testing.assert_array_equal(                               # the file's rows, in order
        np.sort(np.concatenate([out["data"].train.features["f0"], out["data"].test.features["f0"]])),
        np.sort(data.features["f0"][:250]))


# -- checkpoints, resume, export --------------------------------------------------------------------

def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def test_resume_restores_weights_and_continues_the_step_count(tmp_path, capsys):
    common = ["--model", "wide_deep", *TINY, "--mode", "picasso", "--checkpoint-every", "3", *FAST]
    first = run_cli(tmp_path, *common, "--steps", "6", name="a")
    assert first["summary"]["results"]["picasso"]["checkpoints"] == [3, 6]
    saved = _weights(first["models"]["picasso"])

    # Resuming with the same total restores the saved weights and trains nothing.
    again = run_cli(tmp_path, *common, "--steps", "6", "--resume", name="a")
    r = again["summary"]["results"]["picasso"]
    assert (r["resumed_from_step"], r["steps"], r["steps_this_run"]) == (6, 6, 0)
    for a, b in zip(saved, _weights(again["models"]["picasso"])):
        np.testing.assert_array_equal(a, b)

    # Continuing to step 10 equals training 10 steps without a break (weights, optimizer
    # state and data order all restored); the export of that run serves the original model.
    more = run_cli(tmp_path, *common, "--steps", "10", "--resume", name="a")
    r = more["summary"]["results"]["picasso"]
    assert (r["resumed_from_step"], r["steps"], r["steps_this_run"]) == (6, 10, 4)
    assert "resumed from" in capsys.readouterr().out
    straight = run_cli(tmp_path, *common, "--steps", "10", "--export", str(tmp_path / "export"), name="b")
    more["models"]["picasso"].picasso.write_back()     # --export wrote straight's back already
    for a, b in zip(_weights(straight["models"]["picasso"]), _weights(more["models"]["picasso"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    # --export: weights loadable into a freshly built zoo model that predicts the same.
    info = json.load(open(tmp_path / "export" / "export.json"))
    schema = pdata.Schema.load(tmp_path / "export" / "schema.json")
    fresh = zoo.get(info["model"])(schema, **info["hparams"])
    fresh.load_weights(info["weights"]).assert_existing_objects_matched()
    features = straight["data"].test.features
    expected = straight["models"]["picasso"].predict(features, verbose=0)
    np.testing.assert_allclose(fresh.predict(features, verbose=0), expected, rtol=1e-5, atol=1e-6)
    # and a SavedModel of the original model that serves the same predictions.
    serve = tf.saved_model.load(info["saved_model"]).signatures["serving_default"]
    (served,) = serve(**{k: tf.constant(v) for k, v in features.items()}).values()
    np.testing.assert_allclose(served.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_fit_segments_continue_mid_epoch():
    # (initial_epoch, epochs, steps_per_epoch, first step): whole epochs in one fit() call.
    assert train._segments(0, 15, 5) == [(0, 3, 5, 0)]
    assert train._segments(0, 12, 5) == [(0, 2, 5, 0), (2, 3, 2, 10)]
    assert train._segments(6, 17, 5) == [(1, 2, 4, 6), (2, 3, 5, 10), (3, 4, 2, 15)]
    assert train._segments(7, 7, 5) == []


# -- errors ---------------------------------------------------------------------------------------

def test_bad_model_and_data_names(capsys):
    line = fails(capsys, "--model", "nope")
    assert "'nope'" in line and "wide_deep" in line and "dlrm" in line
    line = fails(capsys, "--data", "criteoo")
    assert "criteoo" in line and "criteo, alibaba, wide" in line and "movielens" in line
    line = fails(capsys, "--mode", "fast")
    assert "'fast'" in line and "baseline" in line


def test_model_needs_inputs_the_data_lacks(capsys):
    line = fails(capsys, "--model", "din", *TINY)
    assert "din" in line and "behaviour sequence" in line and "Models that fit this data" in line


def test_schema_that_does_not_match_the_file(tmp_path, capsys):
    path = tmp_path / "d.parquet"
    pdata.write_parquet(small_wide(), path)
    other = pdata.wide_schema(num_fields=6, vocab_size=30)       # f4, f5 are not in the file
    other.save(tmp_path / "other.json")
    line = fails(capsys, "--data", str(path), "--schema", str(tmp_path / "other.json"))
    assert "does not match the schema" in line and "'f4'" in line
    line = fails(capsys, "--data", str(path))
    assert "--schema" in line and "parquet" in line
    line = fails(capsys, "--data", str(path), "--schema", str(tmp_path / "missing.json"))
    assert "missing.json" in line and "cannot read" in line


def test_unreadable_paths(tmp_path, capsys):
    line = fails(capsys, "--data", str(tmp_path / "absent.tsv"))
    assert "absent.tsv" in line and "no such file" in line
    (tmp_path / "empty").mkdir()
    assert "holds no data files" in fails(capsys, "--data", str(tmp_path / "empty"))
    junk = tmp_path / "junk.tsv"
    junk.write_text("this is not\tcriteo data\n")
    line = fails(capsys, "--data", str(junk), "--vocab-size", "50")
    assert "junk.tsv" in line and "does not match" in line


def test_refusal_from_picasso_optimize(tmp_path, capsys):
    # valid options that optimize refuses together: one line, not a traceback
    line = fails(capsys, "--model", "lr", *TINY, "--mode", "picasso", *FAST, "--logdir", str(tmp_path),
                 "--picasso-option", "hybrid_hash=true", "--picasso-option", "micro_batches=2")
    assert "picasso_tf.optimize refused --model lr with --picasso-option hybrid_hash=true" in line
    assert "micro_batches=2" in line
    # an optimizer the model's storage cannot apply is refused at compile, in one line
    line = fails(capsys, "--model", "lr", *TINY, "--mode", "picasso", *FAST, "--logdir", str(tmp_path),
                 "--picasso-option", "hybrid_hash=true", "--optimizer", "rmsprop")
    assert "the picasso model refused --optimizer rmsprop: " in line and "hybrid_hash=True" in line
    assert "no_such_option" in fails(capsys, *TINY, "--picasso-option", "no_such_option=1")


def test_resume_needs_a_matching_run(tmp_path, capsys):
    assert "--logdir" in fails(capsys, "--resume")
    assert "not a picasso-train logdir" in fails(capsys, "--resume", "--logdir", str(tmp_path), *TINY)


# -- entry points ---------------------------------------------------------------------------------

def test_console_script_trains(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "picasso-train")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "picasso_tf.tools.train"]
    done = subprocess.run(cmd + ["--model", "lr", *TINY, "--steps", "2", "--mode", "baseline", *FAST,
                                 "--logdir", str(tmp_path / "cli"), "--summary", str(tmp_path / "s.json")],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "samples/s" in done.stdout and json.load(open(tmp_path / "s.json"))["results"]["baseline"]["steps"] == 2


def test_trains_on_two_horovod_ranks(tmp_path):
    """The same command under picasso-run (as the README starts it: MPI, its default
    here): the picasso model sharded over the ranks and the baseline data-parallel train
    the same model on the same samples, so their results agree; rank 0 alone writes the
    summary and the export."""
    if not os.path.exists(os.path.join(os.path.dirname(sys.executable), "horovodrun")):
        pytest.skip("horovodrun is not installed")
    picasso_run = os.path.join(os.path.dirname(sys.executable), "picasso-run")
    done = subprocess.run([picasso_run, "-np", "2", sys.executable, "-m",
                           "picasso_tf.tools.train", *TINY, "--steps", "4", *FAST, "--optimizer", "adagrad",
                           "--picasso-option", "replicate_tables_below=0", "--logdir", str(tmp_path / "run"),
                           "--summary", str(tmp_path / "s.json"), "--export", str(tmp_path / "export")],
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    s = json.load(open(tmp_path / "s.json"))
    assert s["ranks"] == 2 and s["transport"] == "mpi"
    base, pic = s["results"]["baseline"], s["results"]["picasso"]
    assert base["steps"] == pic["steps"] == 4
    assert pic["test_auc"] == pytest.approx(base["test_auc"], abs=1e-4)
    assert pic["test_log_loss"] == pytest.approx(base["test_log_loss"], abs=1e-4)
    assert "'sharded': [" in s["picasso_report"]
    assert os.path.exists(tmp_path / "export" / "saved_model" / "saved_model.pb")
    assert done.stdout.count("summary:") == 1                        # rank 0 prints


def test_launched_world_from_environment():
    assert train.launched_world({}) == (1, 0)
    assert train.launched_world({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2"}) == (4, 2)
    assert train.launched_world({"HOROVOD_SIZE": "1", "HOROVOD_RANK": "0"}) == (1, 0)
