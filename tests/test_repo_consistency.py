"""The repository's own promises: one set of pins, clean notebooks, CI runs make test."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
ALLOWED_TAGS = {"nbval-check-output", "nbval-skip", "nbval-ignore-output", "raises-exception"}
ALLOWED_NOTEBOOK_METADATA = {"kernelspec", "language_info"}


# --------------------------------------------------------------------------------------------
# (a) pyproject.toml, environment.yml and binder/requirements.txt pin the same packages


def _pins(lines: list[str], source: str) -> dict[str, str]:
    """Map PEP 503 name -> public version for ``name==version`` lines; reject anything looser."""
    pins: dict[str, str] = {}
    for line in lines:
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"{source}: {line!r} is not an == pin"
        name = canonicalize_name(req.name)
        assert name not in pins, f"{source}: {req.name} is listed twice"
        pins[name] = Version(specs[0].version).public  # strips a local label such as +cpu
    return pins


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def pyproject_pins() -> dict[str, str]:
    project = _pyproject()["project"]
    lines = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        lines.extend(extra)
    return _pins(lines, "pyproject.toml")


def _environment_yml() -> dict:
    yaml = pytest.importorskip("yaml")  # PyYAML comes with transformers, datasets, accelerate
    with open(ROOT / "environment.yml", encoding="utf-8") as f:
        return yaml.safe_load(f)


def environment_pip_lines() -> list[str]:
    for dep in _environment_yml()["dependencies"]:
        if isinstance(dep, dict) and "pip" in dep:
            return [str(item) for item in dep["pip"]]
    raise AssertionError("environment.yml has no pip: section")


def binder_lines() -> list[str]:
    text = (ROOT / "binder" / "requirements.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def test_pyproject_pins_everything_exactly():
    pins = pyproject_pins()
    for name in (
        "torch",
        "transformers",
        "accelerate",
        "datasets",
        "bitsandbytes",
        "deepspeed",
        "peft",
        "matplotlib",
        "nvidia-ml-py",
        "jupyterlab",
        "nbval",
        "pytest",
        "ruff",
    ):
        assert name in pins, f"pyproject.toml does not pin {name}"


def test_environment_yml_matches_pyproject():
    env = _environment_yml()
    assert env["name"] == "single-gpu-course"
    assert env["channels"] == ["conda-forge"]
    conda_deps = [dep for dep in env["dependencies"] if isinstance(dep, str)]
    assert "pip" in conda_deps
    assert any(re.fullmatch(r"python\s*=\s*3\.11", dep) for dep in conda_deps), conda_deps
    lines = environment_pip_lines()
    assert "-e ." in lines, "environment.yml must install the checkout itself with '-e .'"
    pins = _pins([line for line in lines if not line.startswith("-")], "environment.yml")
    assert pins == pyproject_pins()


def test_binder_matches_pyproject():
    lines = binder_lines()
    assert lines[0] == "--extra-index-url https://download.pytorch.org/whl/cpu", (
        "binder/requirements.txt must take torch from the CPU index: Binder has no GPU and ~2 GB"
    )
    requirements = [line for line in lines if not line.startswith("-")]
    torch_line = next(
        line for line in requirements if canonicalize_name(Requirement(line).name) == "torch"
    )
    assert torch_line.endswith("+cpu"), torch_line
    assert _pins(requirements, "binder/requirements.txt") == pyproject_pins()


def test_the_tested_range_spans_the_pins_and_the_floor():
    # helpers.compat.TESTED is what doctor reports against: its two ends are the two
    # environments the suite runs in, pyproject's pins (make test) and the floor (make compat).
    from helpers.compat import TESTED, _release

    pins = pyproject_pins()
    floor = _pins(
        [line.split("#")[0].strip() for line in (ROOT / "requirements" / "floor.txt").read_text()
         .splitlines() if line.split("#")[0].strip()],
        "requirements/floor.txt",
    )  # fmt: skip
    for name, (low, high) in TESTED.items():
        ends = sorted({pins[name], floor.get(name, pins[name])}, key=_release)
        assert [low, high] == [ends[0], ends[-1]], (name, low, high, ends)
    for name in ("torch", "transformers", "accelerate"):  # the image's own versions
        assert floor[name] == TESTED[name][0]


def test_binder_runtime_and_postbuild():
    assert (ROOT / "binder" / "runtime.txt").read_text().strip() == "python-3.11"
    post_build = ROOT / "binder" / "postBuild"
    assert "pip install --no-deps -e ." in post_build.read_text()
    assert os.access(post_build, os.X_OK), "binder/postBuild must be executable"


# --------------------------------------------------------------------------------------------
# (b) notebooks are committed clean


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_clean(path: Path):
    nbformat = pytest.importorskip("nbformat")
    raw = json.loads(path.read_text(encoding="utf-8"))
    assert raw.get("nbformat") == 4, "not an nbformat 4 notebook"
    nb = nbformat.reads(path.read_text(encoding="utf-8"), as_version=nbformat.NO_CONVERT)
    nbformat.validate(nb)

    fix = "run `make format` (tools/clean_notebooks.py)"
    extra = set(raw.get("metadata", {})) - ALLOWED_NOTEBOOK_METADATA
    assert not extra, f"notebook metadata has {sorted(extra)}: {fix}"
    ids = [cell.get("id") for cell in raw["cells"]]
    duplicates = sorted({i for i in ids if i is not None and ids.count(i) > 1})
    assert not duplicates, f"duplicate cell ids {duplicates}: {fix}"
    for index, cell in enumerate(raw["cells"]):
        where = f"cell {index} ({cell['cell_type']})"
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [], f"{where} has outputs: {fix}"
            assert cell.get("execution_count") is None, f"{where} has an execution count: {fix}"
        metadata = cell.get("metadata", {})
        assert set(metadata) <= {"tags"}, f"{where} has metadata {sorted(metadata)}: {fix}"
        bad_tags = set(metadata.get("tags", [])) - ALLOWED_TAGS
        assert not bad_tags, f"{where} has tags {sorted(bad_tags)}; allowed: {sorted(ALLOWED_TAGS)}"


def test_notebooks_are_numbered_lessons():
    for path in NOTEBOOKS:
        assert re.fullmatch(r"\d\d_[A-Za-z0-9_-]+\.ipynb", path.name), (
            f"{path.name}: lessons are named NN_name.ipynb"
        )
    numbers = [path.name[:2] for path in NOTEBOOKS]
    assert len(numbers) == len(set(numbers)), f"two lessons share a number: {numbers}"


def test_readme_lesson_table_links_every_notebook():
    """Each lesson has a row in README's table, linking its notebook, with a tiny-scale time."""
    readme = (ROOT / "README.md").read_text()
    for path in NOTEBOOKS:
        row = next(
            (line for line in readme.splitlines() if f"(notebooks/{path.name})" in line), None
        )
        assert row is not None, f"README's lesson table has no row linking notebooks/{path.name}"
        assert row.startswith(f"| {path.name[:2]} |"), row
        assert re.search(r"~\d+ s \|$", row), f"{path.name}: the row's last cell is its time"


def test_clean_notebooks_tool_agrees(tmp_path: Path):
    """tools/clean_notebooks.py turns a dirty notebook into one this file accepts."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import clean_notebooks
    finally:
        sys.path.pop(0)
    dirty = {
        "nbformat": 4,
        "nbformat_minor": 4,
        "metadata": {
            "widgets": {},
            "kernelspec": {"name": "python3", "display_name": "P", "language": "python"},
        },
        "cells": [
            {
                "cell_type": "markdown",
                "id": "a",
                "metadata": {"collapsed": True},
                "source": "# Title\ntext",
            },
            {
                "cell_type": "code",
                "id": "a",
                "execution_count": 3,
                "metadata": {"tags": ["nbval-skip", "mine"], "scrolled": True},
                "outputs": [{"output_type": "stream", "name": "stdout", "text": "hi\n"}],
                "source": ["print('hi')"],
            },
        ],
    }
    path = tmp_path / "00_dirty.ipynb"
    path.write_text(json.dumps(dirty))
    assert clean_notebooks.main(["--check", str(path)]) == 1
    assert clean_notebooks.main([str(path)]) == 0
    assert clean_notebooks.main(["--check", str(path)]) == 0
    test_notebook_is_committed_clean(path)
    cleaned = json.loads(path.read_text())
    assert cleaned["cells"][1]["metadata"] == {"tags": ["nbval-skip"]}
    assert cleaned["cells"][0]["source"] == ["# Title\n", "text"]


# --------------------------------------------------------------------------------------------
# (c) CI runs exactly what a contributor runs


def test_ci_runs_make_test():
    ci = ROOT / ".ci" / "run"
    commands = [
        line.strip()
        for line in ci.read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    assert "make test" in commands, commands


def test_makefile_has_the_documented_targets():
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z-]*)\s*:(?!=)", text, flags=re.M))
    for target in ("test", "course", "lab", "lint", "format", "clean", "install"):
        assert target in targets, f"Makefile has no {target!r} target"


def test_every_lesson_with_speed_claims_runs_under_the_load_test():
    # make load-test is the evidence that a lesson's speed claims survive a busy machine: a
    # lesson that checks speed claims and is missing from its list would never be tried.
    makefile = (ROOT / "Makefile").read_text()
    listed = makefile.split("TIMING_NOTEBOOKS :=", 1)[1].split(")", 1)[0]
    with_claims = {nb.name for nb in NOTEBOOKS if "check_claims(" in nb.read_text()}
    assert with_claims, "no notebook checks speed claims: the test looks for the wrong call"
    missing = {name for name in with_claims if name not in listed}
    assert not missing, f"add to TIMING_NOTEBOOKS in the Makefile: {sorted(missing)}"


# --------------------------------------------------------------------------------------------
# (e) The package's shape: short functions, one opening line per lesson

MAX_FUNCTION_LINES = 60  # a function a reader takes in at once (README, "Conventions")


def test_no_function_in_helpers_is_longer_than_a_screen():
    import ast

    long = []
    for path in sorted((ROOT / "helpers").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert not long, "cut these into named steps: " + ", ".join(long)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_opens_with_its_own_lesson(path: Path):
    # The one-line opener (helpers.lesson) names the lesson the file is: a copied notebook
    # that kept another lesson's number would file its records under the wrong lesson.
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    number = path.name[:2]
    assert re.search(rf'^L = lesson\("{number}"\)$', code, re.M), f"{path.name}: no L = lesson"
    assert "LESSON = " not in code and "results.save(" not in code, f"{path.name}: old opener"


# --------------------------------------------------------------------------------------------
# (f) Sources a learner can follow: named and linked, never an internal "seed" name

INTERNAL_SOURCE_NAME = re.compile(r"\bseed\s+00\d|\bseed's\b|\bseeds'", re.I)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_ends_with_linked_resources(path: Path):
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    last = "".join(cells[-1]["source"])
    assert cells[-1]["cell_type"] == "markdown" and last.startswith("## Resources and references")
    assert re.search(r"\]\(https?://", last), f"{path.name}: its references carry no link"


@pytest.mark.parametrize(
    "path", [*NOTEBOOKS, ROOT / "README.md", ROOT / "Makefile"], ids=lambda p: p.name
)
def test_no_internal_source_names_for_learners(path: Path):
    # "seed 002" was the course's own name for a guide: a learner cannot look it up.
    hits = INTERNAL_SOURCE_NAME.findall(path.read_text(encoding="utf-8"))
    assert not hits, f"{path.name}: name the guide and link it instead of {hits}"


def test_cheat_sheet_rows_are_the_generators_rows():
    """CHEATSHEET.md's table has the generator's methods, links and lessons, in its order."""
    from helpers.cheatsheet import markdown

    def rows(text: str) -> list[tuple[str, str]]:
        cells = [line.split(" | ") for line in text.splitlines() if line.startswith("| [")]
        return [(c[0], c[-1]) for c in cells]

    page = (ROOT / "CHEATSHEET.md").read_text()
    assert rows(page) == rows(markdown([])), "regenerate: python -m helpers cheatsheet"
    for _, lesson in rows(page):
        assert (ROOT / lesson.split("(")[1].rstrip(") |")).exists(), lesson


def test_make_lab_turns_the_news_prompt_off():
    """JupyterLab asks about news while fetchNews is "none"; make lab and Binder set "false"."""
    settings = json.loads((ROOT / "tools" / "lab-settings" / "overrides.json").read_text())
    assert settings["@jupyterlab/apputils-extension:notification"]["fetchNews"] == "false"
    makefile = (ROOT / "Makefile").read_text()
    assert "--LabApp.app_settings_dir=$(CURDIR)/tools/lab-settings" in makefile
    assert "tools/lab-settings/overrides.json" in (ROOT / "binder" / "postBuild").read_text()


def _plotting_functions() -> list[str]:
    """Public helpers functions that build a matplotlib figure (names as module.function)."""
    import ast

    builders = {"Figure", "memory_bars", "lines", "bars", "timeline"}
    found = []
    for path in sorted((ROOT / "helpers").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            calls = {
                getattr(n.func, "id", getattr(n.func, "attr", ""))
                for n in ast.walk(node)
                if isinstance(n, ast.Call)
            }
            returns = ast.unparse(node.returns) if node.returns else ""
            if calls & builders or returns == "Figure" or node.name.endswith("_figure"):
                found.append(f"{path.stem}.{node.name}")
    return found


def test_every_plotting_helper_is_drawn_and_checked_by_a_test():
    """Each figure-building helper is called in a test file that runs figure_problems on it."""
    checked = "\n".join(
        p.read_text()
        for p in (ROOT / "tests").glob("test_*.py")
        if "figure_problems" in p.read_text()
    )
    functions = _plotting_functions()
    assert len(functions) >= 10, functions  # plots.py's four and the lessons' own
    missing = [f for f in functions if f"{f.split('.')[1]}(" not in checked]
    assert not missing, f"plotting helpers no test checks with figure_problems: {missing}"


def test_every_lesson_ends_with_try_it_then_summary():
    """A "## Try it" section before "## Summary": a knob in a code cell and what to expect."""
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        heads = ["".join(c["source"]).lstrip().split("\n", 1)[0] for c in cells]
        assert "## Try it" in heads and "## Summary" in heads, path.name
        start, end = heads.index("## Try it"), heads.index("## Summary")
        section = cells[start:end]
        assert start < end and any(c["cell_type"] == "code" for c in section), path.name
        text = "".join("".join(c["source"]) for c in section if c["cell_type"] == "markdown")
        assert re.search(r"\bexpect|look for", text, re.IGNORECASE), f"{path.name}: no expectation"
