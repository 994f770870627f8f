"""The repository's own promises: tested ranges and one lock, clean notebooks, CI runs make test."""

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
# (a) pyproject.toml states tested ranges; requirements/lock.txt pins them exactly, and
# environment.yml and binder/requirements.txt pin the same versions as the lock

# Packages pyproject.toml may pin exactly, each with its cause (its comment says it too).
EXACT_ON_PURPOSE = {"ruff": "another release formats differently, and make test lints"}


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


def _requirement_lines(path: Path) -> list[str]:
    """A requirements file's requirement lines, without comments and pip options."""
    lines = [line.split("#")[0].strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line and not line.startswith("-")]


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def pyproject_requirements() -> dict[str, Requirement]:
    """Every requirement pyproject.toml names, core and extras, by PEP 503 name."""
    project = _pyproject()["project"]
    lines = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        lines.extend(extra)
    found: dict[str, Requirement] = {}
    for line in lines:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name not in found, f"pyproject.toml: {req.name} is listed twice"
        found[name] = req
    return found


def lock_pins() -> dict[str, str]:
    return _pins(_requirement_lines(ROOT / "requirements" / "lock.txt"), "requirements/lock.txt")


def floor_pins() -> dict[str, str]:
    return _pins(_requirement_lines(ROOT / "requirements" / "floor.txt"), "requirements/floor.txt")


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


def test_pyproject_states_ranges_with_a_floor():
    requirements = pyproject_requirements()
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
        assert name in requirements, f"pyproject.toml does not name {name}"
    for name, req in requirements.items():
        operators = [spec.operator for spec in req.specifier]
        if name in EXACT_ON_PURPOSE:
            assert operators == ["=="], f"{name}: exact on purpose ({EXACT_ON_PURPOSE[name]})"
        else:
            assert operators == [">="], (
                f"pyproject.toml: {req} must be a floor only (>=): the exact versions belong in "
                "requirements/lock.txt, and an upper bound needs a stated cause"
            )


def test_the_core_keeps_out_what_a_gpu_image_or_colab_may_lack():
    # Installing the course into Colab or a GPU image must not build DeepSpeed or replace the
    # Jupyter kernel it runs in: those come with the extras (make installs them from the lock).
    project = _pyproject()["project"]
    core = {canonicalize_name(Requirement(line).name) for line in project["dependencies"]}
    extras = project["optional-dependencies"]
    assert {"torch", "transformers", "accelerate", "datasets", "peft"} <= core
    assert not core & {"bitsandbytes", "deepspeed", "ipykernel", "jupyterlab", "nbval", "sphinx"}, (
        core
    )
    assert {canonicalize_name(Requirement(r).name) for r in extras["optional"]} == {
        "bitsandbytes",
        "deepspeed",
        "torch-optimi",
    }
    makefile = (ROOT / "Makefile").read_text()
    assert 'pip install -c requirements/lock.txt -e ".[optional,jupyter,dev,book]"' in makefile
    assert set(extras) == {"optional", "jupyter", "dev", "book"}


def test_the_lock_pins_every_dependency_within_its_range():
    requirements, pins = pyproject_requirements(), lock_pins()
    assert set(pins) == set(requirements), (
        f"requirements/lock.txt and pyproject.toml name different packages: "
        f"only in the lock {sorted(set(pins) - set(requirements))}, "
        f"only in pyproject {sorted(set(requirements) - set(pins))}"
    )
    for name, req in requirements.items():
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"requirements/lock.txt pins {name}=={pins[name]}, outside pyproject's {req}"
        )


def test_pyproject_floors_are_the_oldest_tested_versions():
    # A floor is the oldest version the course ran with: helpers.compat.TESTED's oldest end,
    # or requirements/floor.txt (what GPU images ship) for a package TESTED does not name.
    from helpers.compat import TESTED

    floor = floor_pins()
    named = 0
    for name, req in pyproject_requirements().items():
        oldest = TESTED[name][0] if name in TESTED else floor.get(name)
        if oldest is None or name in EXACT_ON_PURPOSE:
            continue
        named += 1
        (spec,) = req.specifier
        assert Version(spec.version) == Version(oldest), (
            f"pyproject.toml has {req}; the oldest tested {name} is {oldest}"
        )
    assert named >= 10, "TESTED and floor.txt name too few of pyproject's packages"
    for name in ("torch", "transformers", "accelerate"):  # a GPU image's own versions
        assert Version(floor[name]) == Version(TESTED[name][0])


def test_every_floor_version_is_inside_pyprojects_range():
    # What a GPU image ships (requirements/floor.txt) satisfies every range, so pip keeps it
    # (tests/test_install_keeps_torch.py asks pip itself).
    floor, requirements = floor_pins(), pyproject_requirements()
    named = [name for name in floor if name in requirements]
    assert {"torch", "transformers", "accelerate", "peft"} <= set(named), named
    for name in named:
        assert requirements[name].specifier.contains(floor[name], prereleases=True), (
            f"requirements/floor.txt has {name}=={floor[name]}, outside pyproject's "
            f"{requirements[name]}: pip would replace it"
        )


def test_environment_yml_matches_the_lock():
    env = _environment_yml()
    assert env["name"] == "single-gpu-course"
    assert env["channels"] == ["conda-forge"]
    conda_deps = [dep for dep in env["dependencies"] if isinstance(dep, str)]
    assert "pip" in conda_deps
    assert any(re.fullmatch(r"python\s*=\s*3\.11", dep) for dep in conda_deps), conda_deps
    lines = environment_pip_lines()
    assert "-e ." in lines, "environment.yml must install the checkout itself with '-e .'"
    pins = _pins([line for line in lines if not line.startswith("-")], "environment.yml")
    assert pins == lock_pins()


def test_binder_matches_the_lock():
    lines = binder_lines()
    assert lines[0] == "--extra-index-url https://download.pytorch.org/whl/cpu", (
        "binder/requirements.txt must take torch from the CPU index: Binder has no GPU and ~2 GB"
    )
    requirements = [line for line in lines if not line.startswith("-")]
    torch_line = next(
        line for line in requirements if canonicalize_name(Requirement(line).name) == "torch"
    )
    assert torch_line.endswith("+cpu"), torch_line
    assert _pins(requirements, "binder/requirements.txt") == lock_pins()


def test_the_tested_range_spans_the_lock_and_the_floor():
    # helpers.compat.TESTED is what doctor reports against: its two ends are the two
    # environments the suite runs in, the lock (make test) and the floor (make compat).
    from helpers.compat import TESTED, _release

    pins, floor = lock_pins(), floor_pins()
    for name, (low, high) in TESTED.items():
        ends = sorted({pins[name], floor.get(name, pins[name])}, key=_release)
        assert [low, high] == [ends[0], ends[-1]], (name, low, high, ends)


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
    missing = [i for i, cell_id in enumerate(ids) if not cell_id]  # nbformat only warns
    assert not missing, f"cells {missing} have no id: {fix}"
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
    from helpers.course.cheatsheet import markdown

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


def test_the_lessons_stay_inside_their_word_budget():
    """Markdown words (whitespace-separated): every lesson under 3,500, the course under 45,000.
    A section added means words cut elsewhere; history of versions goes to the references."""
    words = {
        path.stem: sum(
            len("".join(c["source"]).split())
            for c in json.loads(path.read_text())["cells"]
            if c["cell_type"] == "markdown"
        )
        for path in NOTEBOOKS
    }
    assert max(words.values()) < 3_500, max(words.items(), key=lambda kv: kv[1])
    assert sum(words.values()) < 45_000, sum(words.values())
