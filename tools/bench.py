"""picasso-bench: the benchmark suite, baseline Keras vs picasso_tf, timed interleaved.

    picasso-bench --quick                   # every section at small sizes (about 3 minutes)
    picasso-bench --full                    # the sizes of the issue and the paper's tables (over an hour)
    picasso-bench --full --tables packing,ops
    picasso-bench --full --tables zoo --models dien,dsin   # only these zoo (or DeepCTR) models
    picasso-bench --report                  # docs/benchmarks.md (+ PNGs) from the latest results JSON
    picasso-bench --full --wait-load 2.5    # first wait (up to --wait-max minutes) for a quiet machine

Sections (--tables): packing (issue 4: wide LR / W&D on 200 fields, DLRM with Adagrad
and exact Adam, each against stock Keras and the dense-only bound, plus the per-op
time of one step), zoo (every zoo model, criteo-like and alibaba-like data), auc
(AUC parity), ablation, ops (op counts), scaling (duplicated feature fields),
hotstorage, deepctr (DeepCTR's models at their defaults, stock Keras vs picasso_tf vs
the bound). See tools/benchmarking/sections.py for what each one runs and
docs/benchmarks.md for the method.

Results go to benchmarks/results/<mode>.json (--out to change): the machine (CPU
model, cores, memory), versions (Python, TensorFlow, Keras, NumPy, picasso_tf), git
commit, the exact command, the load average at start and end and every figure. A run
of some sections (--tables) into an existing results file of the same mode keeps its
other sections, each marked with the run it came from (the report says so under its
title). The report is regenerated after each run unless --no-report. Progress goes to stderr.
--tiny runs every section at toy sizes (for the tests; no speed meaning).

Exit codes: 0 done (cells that failed are recorded in the JSON, not fatal); 2 bad
arguments.
"""
import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time

EXIT_USAGE = 2
MODES = ("tiny", "quick", "full")
DEFAULT_RESULTS_DIR = os.path.join("benchmarks", "results")
DEFAULT_DOCS_DIR = "docs"

# The guide --help points to.
GUIDE = "docs/benchmarks-howto.md"


def build_parser():
    from picasso_tf.tools.benchmarking.sections import SECTIONS
    p = argparse.ArgumentParser(prog="picasso-bench", description=__doc__.split("\n\n")[0] + f" Guide: {GUIDE}.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="every section at small sizes (about 3 minutes)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="full sizes (over an hour on 2 cores)")
    mode.add_argument("--tiny", dest="mode", action="store_const", const="tiny",
                      help="toy sizes, for tests (figures mean nothing)")
    p.add_argument("--tables", default="all",
                   help=f"comma-separated sections to run: {','.join(SECTIONS)} (default: all)")
    p.add_argument("--models", help="comma-separated models of the zoo and deepctr sections (default: the mode's)")
    p.add_argument("--datasets", help="comma-separated data sets of the zoo section: criteo,alibaba "
                                      "(default: the mode's)")
    p.add_argument("--out", help="results JSON (default benchmarks/results/<mode>.json)")
    p.add_argument("--docs", default=DEFAULT_DOCS_DIR, help="where --report writes benchmarks.md and PNGs")
    p.add_argument("--report", nargs="?", const="", metavar="JSON",
                   help="only regenerate the report from JSON (default: benchmarks/results/full.json, "
                        "else quick.json)")
    p.add_argument("--no-report", action="store_true", help="do not regenerate the report after a run")
    p.add_argument("--wait-load", type=float, metavar="LOAD",
                   help="before starting, wait until the 1-minute load average is below LOAD")
    p.add_argument("--wait-max", type=float, default=20.0, metavar="MIN",
                   help="give up waiting after this many minutes and run anyway (default 20)")
    return p


# -- machine and provenance --------------------------------------------------------------------

def machine_info():
    info = {"cores": os.cpu_count(), "platform": platform.platform(), "hostname": platform.node()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        info["cpu_model"] = platform.processor() or "unknown"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    info["memory_gib"] = int(line.split()[1]) / 2 ** 20
                    break
    except OSError:
        pass
    return info


def versions():
    import keras
    import numpy
    import tensorflow as tf

    import picasso_tf
    return {"python": platform.python_version(), "tensorflow": tf.__version__, "keras": keras.__version__,
            "numpy": numpy.__version__, "picasso_tf": picasso_tf.__version__}


def git_info():
    """The commit and whether the tree has changes (read-only git commands)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = {}
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                       timeout=10).stdout.strip() or None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=10).stdout
        out["dirty"] = bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        out["commit"] = None
    return out


def load_average():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


# -- progress ----------------------------------------------------------------------------------

class Progress:
    """One line per event on stderr: elapsed time, section counter, what runs now."""

    def __init__(self, sections, stream=None):
        self.sections, self.stream = sections, stream or sys.stderr
        self.start = time.perf_counter()
        self.index, self.name = 0, ""
        self.tty = self.stream.isatty()

    def section(self, index, name):
        self.index, self.name = index, name
        self("start")

    def __call__(self, message):
        elapsed = time.perf_counter() - self.start
        load = load_average()
        text = (f"[{int(elapsed // 60):02d}:{int(elapsed % 60):02d}] [{self.index}/{len(self.sections)} "
                f"{self.name}] {message}" + (f"  (load {load[0]:.1f})" if load else ""))
        if self.tty:
            self.stream.write("\r\033[K" + text[:200])
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self):
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def wait_for_load(limit, max_minutes, stream=sys.stderr):
    deadline = time.time() + 60 * max_minutes
    while True:
        load = load_average()
        if load is None or load[0] < limit:
            return load
        if time.time() > deadline:
            stream.write(f"picasso-bench: load average {load[0]:.2f} still above {limit} after "
                         f"{max_minutes:g} min; running anyway\n")
            return load
        stream.write(f"picasso-bench: load average {load[0]:.2f} >= {limit}; waiting\n")
        stream.flush()
        time.sleep(30)


# -- run ---------------------------------------------------------------------------------------

def selected_sections(text):
    from picasso_tf.tools.benchmarking.sections import SECTIONS
    if text in ("all", ""):
        return list(SECTIONS)
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    return names


def selected_models(text):
    """The Sizes fields --models sets: the zoo models and the DeepCTR models it names
    (a section none of whose models are named runs the mode's own); {} where it is not given."""
    if not text:
        return {}
    from picasso_tf import models as zoo
    from picasso_tf.tools.benchmarking.deepctr_models import MODELS as DEEPCTR
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [n for n in names if n not in zoo.list() and n not in DEEPCTR]
    if unknown:
        raise ValueError(f"unknown model(s) {unknown}; choose from the zoo's {', '.join(zoo.list())} "
                         f"and DeepCTR's {', '.join(DEEPCTR)}")
    fields = {"zoo_models": tuple(n for n in names if n in zoo.list()),
              "deepctr_models": tuple(n for n in names if n in DEEPCTR)}
    return {field: chosen for field, chosen in fields.items() if chosen}


def selected_datasets(text):
    """The Sizes field --datasets sets (the zoo's data sets); {} where it is not given."""
    if not text:
        return {}
    from picasso_tf.tools.benchmarking.sections import ZOO_DATASETS
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [n for n in names if n not in ZOO_DATASETS]
    if unknown or not names:
        raise ValueError(f"unknown data set(s) {unknown or [text]}; choose from {', '.join(ZOO_DATASETS)}")
    return {"zoo_datasets": names}


MODEL_SECTIONS = ("zoo", "deepctr")    # the sections --models and --datasets select rows of


def run(args, argv):
    from picasso_tf.tools.benchmarking.sections import MODES as SIZES
    from picasso_tf.tools.benchmarking.sections import RUNNERS
    mode = args.mode or "quick"
    sections = selected_sections(args.tables)
    models = {**selected_models(args.models), **selected_datasets(args.datasets)}
    if args.wait_load:
        wait_for_load(args.wait_load, args.wait_max)
    sizes = dataclasses.replace(SIZES[mode], **models)
    out_path = args.out or os.path.join(DEFAULT_RESULTS_DIR, f"{mode}.json")
    results = {
        "suite": "picasso-bench",
        "mode": mode,
        "command": " ".join(["picasso-bench"] + [shlex.quote(a) for a in argv]),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_info(),
        "versions": versions(),
        "git": git_info(),
        "load_average": {"start": load_average()},
        "sizes": _jsonable(sizes.__dict__),
        "sections": {},
    }
    carry_over(results, _previous_results(out_path, mode))
    progress = Progress(sections)
    start = time.perf_counter()
    for i, name in enumerate(sections, 1):
        progress.section(i, name)
        section_start = time.perf_counter()
        section = RUNNERS[name](sizes, progress)
        section["seconds"] = time.perf_counter() - section_start
        section["run"] = run_of(results)
        if models and name in MODEL_SECTIONS:
            section = with_other_models(section, results["sections"].get(name))
        results["sections"][name] = section
        results["duration_s"] = time.perf_counter() - start
        _write_json(results, out_path)              # partial results survive an interruption
    progress.done()
    results["duration_s"] = time.perf_counter() - start
    results["load_average"]["end"] = load_average()
    results["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    _write_json(results, out_path)
    print(summary(results))
    print(f"results: {out_path}")
    if not args.no_report:
        from picasso_tf.tools.benchmarking.report import write_report
        for path in write_report(results, args.docs, source=out_path):
            print(f"report: {path}")
    return results


def summary(results):
    """The headline figures as printed text (the report has everything)."""
    from picasso_tf.tools.benchmarking.report import _headline
    la = results["load_average"]
    lines = [f"picasso-bench {results['mode']}: {results['duration_s'] / 60:.1f} min on "
             f"{results['machine'].get('cpu_model')} ({results['machine'].get('cores')} cores); load average "
             f"start {_fmt(la.get('start'))}, end {_fmt(la.get('end'))}"]
    lines += [line for line in _headline(results) if line.startswith("- ")]
    pack = results["sections"].get("packing", {})
    for row in pack.get("rows", []):
        if "variants" in row:
            v = row["variants"]
            cells = ", ".join(f"{k} {v[k]['samples_per_s']:,.0f}/s" for k in ("baseline", "picasso", "bound") if k in v)
            lines.append(f"  {row['name']}: {cells} (load {row['load_average'][0][0]:.1f})")
    return "\n".join(lines)


def _fmt(load):
    return "/".join(f"{x:.2f}" for x in load) if load else "?"


def _jsonable(value):
    return json.loads(json.dumps(value, default=lambda o: list(o) if isinstance(o, tuple) else str(o)))


def run_of(results):
    return {"command": results["command"], "commit": results.get("git", {}).get("commit"),
            "started": results["started"]}


def _previous_results(path, mode):
    """The results already at `path` from a run of the same mode, else None."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        previous = json.load(f)
    return previous if previous.get("mode") == mode else None


def carry_over(results, previous):
    """Starts `results` with the sections of `previous`, each marked with the run it comes
    from, for this run to replace those it redoes: a partial run (--tables) updates a
    results file section by section, and an interrupted one loses nothing."""
    for name, section in (previous or {}).get("sections", {}).items():
        results["sections"][name] = {**section, "run": section.get("run") or run_of(previous)}


def with_other_models(section, previous):
    """A section run for some models (--models, --datasets), with the rows of the previous
    run's other models kept, each marked with the run it comes from, so that a results file can gain
    models run by run; the summary is recomputed over all of them."""
    if not previous or not previous.get("rows"):
        return section
    redone = {row["name"]: row for row in section["rows"]}
    if not any(row["name"] not in redone for row in previous["rows"]):
        return section
    # A redone row takes its previous one's place, new ones go last; then stably by batch
    # size (deepctr's rows go batch by batch).
    rows = [redone.pop(row["name"]) if row["name"] in redone else {**row, "run": row.get("run") or previous["run"]}
            for row in previous["rows"]] + list(redone.values())
    merged = {**section, "rows": sorted(rows, key=lambda row: row.get("batch_size", 0))}
    if "summary" in section:
        from picasso_tf.tools.benchmarking.deepctr_models import geometric_means
        merged["summary"] = geometric_means(merged["rows"])
    return merged


def _write_json(results, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(tmp, path)


def report_only(args):
    from picasso_tf.tools.benchmarking.report import write_report
    source = args.report
    if not source:
        candidates = [os.path.join(DEFAULT_RESULTS_DIR, f"{m}.json") for m in ("full", "quick")]
        source = next((c for c in candidates if os.path.exists(c)), None)
        if source is None:
            raise FileNotFoundError(f"no results JSON found ({', '.join(candidates)}); run the suite first")
    with open(source) as f:
        results = json.load(f)
    for path in write_report(results, args.docs, source=source):
        print(f"report: {path}")
    return results


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        if args.report is not None:
            report_only(args)
            return 0
        selected_sections(args.tables)
        selected_models(args.models)
        selected_datasets(args.datasets)
    except (ValueError, FileNotFoundError) as e:
        sys.stderr.write(f"picasso-bench: error: {e}\n")
        return EXIT_USAGE
    run(args, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
