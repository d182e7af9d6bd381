"""The documentation cannot drift from the code: the options page is what its generator
writes from Config's docstring and names every option, the errors page names every
error class, every relative link (README, examples/README.md, docs/) resolves, the README keeps the command CI runs and
quotes docs/benchmarks.md's figures, and its quick start runs."""
import ast
import builtins
import dataclasses
import glob
import os
import re
import subprocess
import sys

import pytest

from picasso_tf.config import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def read(*path):
    with open(os.path.join(ROOT, *path)) as f:
        return f.read()


def test_the_options_page_is_generated_from_config_and_names_every_option():
    from picasso_tf.tools.gen_options_doc import render
    page = read("docs", "options.md")
    assert page == render(), "docs/options.md is stale: run python -m picasso_tf.tools.gen_options_doc"
    for field in dataclasses.fields(Config):
        assert re.search(rf"^\| `{field.name}` \|", page, re.M), f"option {field.name} has no row in docs/options.md"
        assert re.search(rf"^\*\*[^*]*`{field.name}`[^*]*\*\*: \w", page, re.M), f"option {field.name} has no text"


def error_classes():
    """Every exception class defined in the package (picasso_tf/) and in the command-line
    tools (tools/*.py; tools/benchmarking's are the suite's internal signals, caught
    there): a class whose base is a built-in exception or another such class."""
    builtin = {name for name, value in vars(builtins).items()
               if isinstance(value, type) and issubclass(value, BaseException)}
    classes = {}
    files = glob.glob(os.path.join(ROOT, "picasso_tf", "**", "*.py"), recursive=True)
    files += glob.glob(os.path.join(ROOT, "tools", "*.py"))
    found = True
    while found:        # a class deriving from one found in another file
        found = False
        for path in files:
            for node in ast.walk(ast.parse(open(path).read())):
                bases = {getattr(b, "id", getattr(b, "attr", None)) for b in getattr(node, "bases", ())}
                if isinstance(node, ast.ClassDef) and node.name not in classes and bases & (builtin | set(classes)):
                    classes[node.name], found = os.path.relpath(path, ROOT), True
    return classes


def test_the_errors_page_names_every_error_class():
    classes = error_classes()
    assert {"UnsupportedModelError", "HotTierTooLargeError", "DataFormatError"} <= set(classes)
    page = read("docs", "errors.md")
    missing = {name: path for name, path in classes.items() if f"{name}`" not in page}
    assert not missing, f"error classes not in docs/errors.md: {missing}"


def markdown_files():
    return ([os.path.join(ROOT, "README.md"), os.path.join(ROOT, "examples", "README.md")]
            + sorted(glob.glob(os.path.join(DOCS, "*.md"))))


def test_every_relative_link_points_to_a_file():
    broken = []
    for path in markdown_files():
        text = re.sub(r"```.*?```", "", open(path).read(), flags=re.S)      # code blocks hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not os.path.exists(os.path.join(os.path.dirname(path), target.split("#")[0])):
                broken.append(f"{os.path.relpath(path, ROOT)}: {target}")
    assert not broken, broken


def test_the_readme_links_every_guide_and_stays_short():
    readme = read("README.md")
    assert len(readme.splitlines()) <= 150
    guides = {os.path.basename(p) for p in glob.glob(os.path.join(DOCS, "*.md"))}
    assert not [g for g in guides if f"docs/{g}" not in readme], "a guide the README does not link"


def test_the_readme_keeps_the_test_command_ci_runs():
    commands = [line for line in read(".ci", "run").splitlines() if line.startswith("bash scripts/setup_env.sh")]
    assert len(commands) == 1 and f"\n{commands[0]}\n" in read("README.md"), commands


def test_the_readme_headline_quotes_docs_benchmarks():
    """The headline table's command and figures are docs/benchmarks.md's, so a new
    benchmark report makes this fail until the README quotes it. The command is the
    report's run or, where a later run of other sections followed, the earlier run its
    sections name."""
    readme, report = read("README.md"), read("docs", "benchmarks.md")
    headline = readme.split("## Headline results")[1].split("\n## ")[0]
    command = re.search(r"`(picasso-bench [^`]*)`", headline).group(1)
    assert f"**Command:** `{command}`" in report or f"_From an earlier run: `{command}`" in report
    rows = re.findall(r"^\|[^|]+\|[^|]+\| ([\d,]+) \| ([\d,]+) \| ([\d.]+x) \|$", headline, re.M)
    assert len(rows) >= 4
    for keras, picasso, ratio in rows:
        assert re.search(rf"{keras}\b.*\b{picasso}\b.*\b{re.escape(ratio)}", report), (keras, picasso, ratio)


def test_the_readme_quick_start_runs(tmp_path):
    readme = read("README.md")
    code = re.search(r"## Quick start\n+```python\n(.*?)```", readme, re.S).group(1)
    assert len(code.splitlines()) <= 15
    env = {k: v for k, v in os.environ.items() if not k.startswith("PICASSO_")}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**env, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "embedding sites: 26, left as they were: 0" in done.stdout, done.stdout


@pytest.mark.parametrize("flag", ["-np", "--gloo"])
def test_the_launcher_the_docs_name_exists_with_its_flags(flag):
    """docs/multi-rank.md and the README start ranks with picasso-run -np N [--gloo]."""
    from picasso_tf.tools import launch
    assert flag in open(launch.__file__).read()
    assert f"picasso-run -np 2 {'--gloo ' if flag == '--gloo' else ''}python" in read("docs", "multi-rank.md")
