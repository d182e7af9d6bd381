"""picasso-bench end to end at toy sizes: every section runs, the results JSON records the
machine, versions, commit and command, and the report (markdown + charts) is well-formed.
Speed is never asserted here (ARCHITECTURE.md §6): the figures of a tiny run mean nothing."""
import json
import os

import pytest

from picasso_tf.tools.benchmarking import report as bench_report
from picasso_tf.tools.benchmarking import sections as bench_sections
from picasso_tf.tools import bench

# Its tests run on one pytest-xdist worker: they share the tiny_run module fixture (picasso-bench --tiny, about 40 s).
pytestmark = pytest.mark.xdist_group("test_bench")

SECTION_HEADINGS = {
    "packing": "## 1. Packing benchmark (issue 4)",
    "zoo": "## 2. Zoo throughput",
    "auc": "## 3. AUC parity",
    "ablation": "## 4. Ablation",
    "ops": "## 5. Operation counts",
    "scaling": "## 6. Feature-field scaling",
    "hotstorage": "## 7. Hot-storage size sweep",
    "deepctr": "## 8. DeepCTR models",
}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    out, docs = root / "tiny.json", root / "docs"
    code = bench.main(["--tiny", "--out", str(out), "--docs", str(docs)])
    assert code == 0
    return json.loads(out.read_text()), docs


def _tables(markdown):
    """Markdown tables as lists of rows (lists of cells)."""
    tables, current = [], []
    for line in markdown.splitlines():
        if line.startswith("|"):
            current.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif current:
            tables.append(current)
            current = []
    if current:
        tables.append(current)
    return tables


def test_results_json_records_provenance(tiny_run):
    results, _ = tiny_run
    assert results["suite"] == "picasso-bench" and results["mode"] == "tiny"
    assert results["command"].startswith("picasso-bench --tiny")
    machine = results["machine"]
    assert machine["cores"] >= 1 and machine["cpu_model"] and machine["memory_gib"] > 0
    assert {"tensorflow", "keras", "picasso_tf", "python", "numpy"} <= set(results["versions"])
    assert "commit" in results["git"]
    assert len(results["load_average"]["start"]) == 3 and len(results["load_average"]["end"]) == 3
    assert set(results["sections"]) == set(bench_sections.SECTIONS)


def test_timed_rows_are_interleaved_medians_with_spread(tiny_run):
    results, _ = tiny_run
    packing = results["sections"]["packing"]
    row = next(r for r in packing["rows"] if r["name"] == "wide_lr")
    assert "error" not in row, row.get("error")
    assert set(row["variants"]) == {"baseline", "picasso", "bound"}
    for v in row["variants"].values():
        assert len(v["step_ms_per_round"]) == row["rounds"]
        assert v["samples_per_s_min"] <= v["samples_per_s"] <= v["samples_per_s_max"]
    for pair in ("picasso/baseline", "picasso/bound", "baseline/bound"):
        r = row["ratios"][pair]
        assert len(r["per_round"]) == row["rounds"] and r["min"] <= r["median"] <= r["max"]
    assert row["packed_groups"] >= 1 and row["bound_input_width"] > 0
    assert row["load_average"][0] and row["load_average"][1]
    # the per-op breakdown and the isolated stages of the wide step
    assert set(packing["breakdowns"]) == {r["name"] for r in packing["rows"] if r["name"].startswith("wide")}
    for breakdown in packing["breakdowns"].values():
        assert {"baseline", "picasso", "bound"} <= set(breakdown)
        assert any(e["op"].startswith("Picasso") for e in breakdown["picasso"]["by_type"])
    assert packing["stages"]["unique_rows"] > 0 and packing["stages"]["stages"]
    # DLRM also runs without the interactions pass: the embedding layer's cost alone
    dlrm = next(r for r in packing["rows"] if r["name"] == "dlrm_adagrad")
    assert "error" not in dlrm, dlrm.get("error")
    assert set(dlrm["variants"]) == {"baseline", "picasso", "no_interactions", "bound"}
    assert {"no_interactions/baseline", "no_interactions/bound"} <= set(dlrm["ratios"])


def test_every_section_has_rows_or_says_why(tiny_run):
    results, _ = tiny_run
    s = results["sections"]
    assert s["zoo"]["rows"] and all("variants" in r or "error" in r for r in s["zoo"]["rows"])
    auc = s["auc"]["rows"][0]
    assert "error" not in auc, auc.get("error")
    assert 0.0 <= auc["baseline_auc"] <= 1.0 and 0.0 <= auc["picasso_auc"] <= 1.0
    ablation = s["ablation"]["rows"][0]
    interleaved = "micro_batches=2,interleave_groups=2"
    assert {"baseline", "picasso", "packing=False", interleaved} <= set(ablation["variants"]), \
        ablation.get(interleaved + "_error")
    assert "hybrid_hash=True" in ablation["variants"], ablation.get("hybrid_hash=True_error")
    ops = s["ops"]["rows"][0]
    assert ops["step_ops_baseline"] > 0 and ops["step_ops_picasso"] > 0 and ops["packed_groups"] >= 1
    scaling = s["scaling"]["rows"]
    assert [r["multiplier"] for r in scaling] == [1, 2]
    assert scaling[0]["picasso"]["increment"] == pytest.approx(0.0)
    hot = s["hotstorage"]["rows"]
    assert all("error" not in r for r in hot), [r.get("error") for r in hot]
    assert [r["variant"] for r in hot] == ["hybrid_hash=False", "no hot tier", "hot tier 5%"]
    assert all(r["samples_per_s"] > 0 for r in hot) and "vs_hybrid_hash_false" in hot[1]
    tier = hot[2]
    assert tier["hot_rows"] == round(0.05 * tier["distinct_ids"])
    # The storage's counters are Algorithm 1 exactly; LRU is one of the caches Belady's MIN is the optimum of.
    assert tier["algorithm1"] == pytest.approx(tier["algorithm1_numpy"], abs=1e-12)
    assert 0.0 < tier["lru"] <= tier["belady"] <= 1.0 and 0.0 < tier["algorithm1"] <= 1.0
    deepctr = s["deepctr"]["rows"][0]
    assert set(deepctr.get("variants", ())) == {"baseline", "picasso", "bound"}, deepctr.get("error")
    assert set(s["deepctr"]["summary"]) == {str(deepctr["batch_size"])}


def test_report_has_every_table_well_formed(tiny_run):
    results, docs = tiny_run
    text = (docs / "benchmarks.md").read_text()
    assert text.startswith("# Benchmarks")
    assert results["command"] in text and results["machine"]["cpu_model"] in text
    for heading in SECTION_HEADINGS.values():
        assert heading in text
    tables = _tables(text)
    assert len(tables) >= len(SECTION_HEADINGS)
    for table in tables:
        assert len(table) >= 3, table                       # header, rule, at least one row
        assert all(set(c) <= set("-") for c in table[1])    # the rule row
        assert {len(r) for r in table} == {len(table[0])}, table   # same width everywhere
    for png in ("bench_packing.png", "bench_zoo.png", "bench_scaling.png", "bench_breakdown.png"):
        path = docs / png
        assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({png})" in text


def test_report_regenerates_from_json(tiny_run, tmp_path):
    results, _ = tiny_run
    source = tmp_path / "r.json"
    source.write_text(json.dumps(results))
    assert bench.main(["--report", str(source), "--docs", str(tmp_path / "d")]) == 0
    regenerated = (tmp_path / "d" / "benchmarks.md").read_text()
    assert regenerated == bench_report.markdown(results, str(source), charts=[
        p for p in bench_report.CHARTS if os.path.exists(tmp_path / "d" / p)])


def test_a_partial_run_keeps_the_other_sections_and_says_where_they_come_from(tiny_run, tmp_path):
    results, _ = tiny_run
    earlier = {**results, "git": {"commit": "0" * 40, "dirty": False}, "command": "picasso-bench --tiny (earlier)",
               "sections": {k: {f: v for f, v in section.items() if f != "run"}
                            for k, section in results["sections"].items()}}
    out, docs = tmp_path / "r.json", tmp_path / "d"
    out.write_text(json.dumps(earlier))
    assert bench.main(["--tiny", "--tables", "ops", "--out", str(out), "--docs", str(docs)]) == 0
    merged = json.loads(out.read_text())
    assert set(merged["sections"]) == set(results["sections"])
    assert merged["sections"]["ops"]["run"]["command"].startswith("picasso-bench --tiny --tables ops")
    assert merged["sections"]["zoo"]["run"] == {"command": "picasso-bench --tiny (earlier)", "commit": "0" * 40,
                                                "started": results["started"]}
    assert merged["sections"]["zoo"]["rows"] == results["sections"]["zoo"]["rows"]
    text = (docs / "benchmarks.md").read_text()
    zoo = text[text.index(SECTION_HEADINGS["zoo"]):]
    assert zoo.splitlines()[2].startswith("_From an earlier run: `picasso-bench --tiny (earlier)` at 0000000")
    ops = text[text.index(SECTION_HEADINGS["ops"]):]
    assert "From an earlier run" not in ops.splitlines()[2]


def test_the_report_keeps_what_is_written_by_hand_below_its_marker(tiny_run, tmp_path):
    results, _ = tiny_run
    bench_report.write_report(results, str(tmp_path))
    path = tmp_path / "benchmarks.md"
    hand = f"{bench_report.HAND_WRITTEN}\n\n## A study\n\nWritten by hand.\n"
    path.write_text(path.read_text() + "\n" + hand)
    bench_report.write_report(results, str(tmp_path))
    assert path.read_text() == bench_report.markdown(results, charts=[
        p for p in bench_report.CHARTS if os.path.exists(tmp_path / p)]) + "\n" + hand


def test_bad_arguments_exit_2(capsys):
    assert bench.main(["--tiny", "--tables", "nonsense"]) == 2
    assert "unknown section" in capsys.readouterr().err
    assert bench.main(["--report", "/nonexistent/results.json"]) == 2
    assert bench.main(["--tiny", "--tables", "zoo", "--models", "nonsense"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert bench.main(["--tiny", "--tables", "zoo", "--datasets", "criteo,avazu"]) == 2
    assert "unknown data set(s) ['avazu']; choose from criteo, alibaba" in capsys.readouterr().err


def test_models_option_names_zoo_and_deepctr_models():
    assert bench.selected_models("lr,WDL,dlrm") == {"zoo_models": ("lr", "dlrm"), "deepctr_models": ("WDL",)}
    assert bench.selected_models("DeepFM") == {"deepctr_models": ("DeepFM",)}
    assert bench.selected_models(None) == {}


def test_models_option_runs_only_the_named_zoo_models(tmp_path):
    out = tmp_path / "r.json"
    assert bench.main(["--tiny", "--tables", "zoo", "--models", "dlrm", "--out", str(out), "--no-report"]) == 0
    results = json.loads(out.read_text())
    assert [row["model"] for row in results["sections"]["zoo"]["rows"]] == ["dlrm"]
    assert results["command"] == "picasso-bench --tiny --tables zoo --models dlrm --out " + str(out) + " --no-report"


def test_a_run_on_one_data_set_keeps_the_other_data_sets_rows(tmp_path):
    out = tmp_path / "r.json"
    earlier_run = {"command": "picasso-bench --tiny (earlier)", "commit": "0" * 40, "started": "2026-01-01T00:00:00"}
    earlier_row = {"name": "criteo/lr", "model": "lr", "dataset": "criteo", "error": "kept"}
    out.write_text(json.dumps({"mode": "tiny", "sections": {"zoo": {"rows": [earlier_row], "run": earlier_run}}}))
    assert bench.main(["--tiny", "--tables", "zoo", "--datasets", "alibaba", "--out", str(out), "--no-report"]) == 0
    rows = json.loads(out.read_text())["sections"]["zoo"]["rows"]
    assert [(row["name"], row.get("run")) for row in rows] == [("criteo/lr", earlier_run), ("alibaba/lr", None)]


def test_a_run_of_some_models_keeps_the_other_models_rows_and_names_their_run(tiny_run, tmp_path):
    results, _ = tiny_run
    earlier_run = {"command": "picasso-bench --tiny (earlier)", "commit": "0" * 40, "started": results["started"]}
    pnn = results["sections"]["deepctr"]["rows"][0]
    other = {**pnn, "name": "DeepFM@64", "model": "DeepFM", "run": None}   # a model this run does not redo
    earlier = {**results, "sections": {"deepctr": {**results["sections"]["deepctr"], "run": earlier_run,
                                                   "rows": [other, {**pnn, "run": None}]}}}
    out, docs = tmp_path / "r.json", tmp_path / "d"
    out.write_text(json.dumps(earlier))
    assert bench.main(["--tiny", "--tables", "deepctr", "--models", "PNN", "--out", str(out), "--docs", str(docs)]) == 0
    section = json.loads(out.read_text())["sections"]["deepctr"]
    assert [row["model"] for row in section["rows"]] == ["DeepFM", "PNN"]
    assert section["rows"][0]["run"] == earlier_run
    assert "run" not in section["rows"][1] and section["run"]["command"].startswith("picasso-bench --tiny --tables deepctr")
    assert section["summary"]["64"]["cells"] == 2
    text = (docs / "benchmarks.md").read_text()
    note = text[text.index(SECTION_HEADINGS["deepctr"]):].splitlines()[2]
    assert note.startswith("_Rows from several runs: DeepFM from `picasso-bench --tiny (earlier)` at 0000000")
    assert "; PNN from `picasso-bench --tiny --tables deepctr --models PNN" in note
