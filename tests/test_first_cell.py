"""Every notebook opens anywhere: its first code cell installs the course in Colab, says how to
install it in any other kernel that lacks it, and otherwise starts the lesson showing nothing.

The cell is executed in real kernels (nbclient), about 5 s each. A kernel that cannot import
``helpers`` is made with an IPython startup file (a temporary IPYTHONDIR) that blocks the
package; Colab is imitated the same way, with a ``%pip`` that records what it was asked.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.test_repo_consistency import NOTEBOOKS, _pyproject

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ADDRESS = _pyproject()["project"]["urls"]["Repository"]
INSTALL = f'"single-gpu-course @ git+{ADDRESS}"'

BLOCK_HELPERS = """
import sys


class _NoCourse:
    # This kernel cannot import the course: as if it were not installed.
    blocked = True

    def find_spec(self, name, path=None, target=None):
        if self.blocked and (name == "helpers" or name.startswith("helpers.")):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoCourse())
"""

FAKE_COLAB = """
import importlib.machinery
import types

from IPython import get_ipython

sys.modules["google.colab"] = types.ModuleType("google.colab")
# Colab's module is a real package: libraries ask importlib for its spec (accelerate does).
sys.modules["google.colab"].__spec__ = importlib.machinery.ModuleSpec("google.colab", None)


def _pip(line):
    # Colab's %pip, imitated: record the command, then the course imports.
    with open("pip-args.txt", "w") as f:
        f.write(line)
    sys.meta_path[0].blocked = False


get_ipython().register_magic_function(_pip, "line", "pip")
"""


def _first_code_cell(path: Path) -> dict:
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return next(cell for cell in cells if cell["cell_type"] == "code")


def _run_first_cell(tmp_path: Path, startup: str = "", then: str = "") -> list[dict]:
    """Outputs of notebook 00's first code cell, run alone in a fresh kernel in ``tmp_path``
    (and of ``then``, a second cell run after it)."""
    ipython_dir = tmp_path / "ipython"
    if startup:
        (ipython_dir / "profile_default" / "startup").mkdir(parents=True)
        (ipython_dir / "profile_default" / "startup" / "00-course.py").write_text(startup)
    cell = nbformat.v4.new_code_cell("".join(_first_code_cell(NOTEBOOKS[0])["source"]))
    nb = nbformat.v4.new_notebook(
        cells=[cell] + ([nbformat.v4.new_code_cell(then)] if then else [])
    )
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=300,
        allow_errors=True,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    env = {**os.environ, "IPYTHONDIR": str(ipython_dir), "COURSE_PROGRESS": "0"}
    client.execute(env=env)
    return [out for c in nb.cells for out in c.outputs]


def _text(outputs: list[dict]) -> str:
    parts = []
    for out in outputs:
        parts += [out.get("text", ""), out.get("evalue", ""), *out.get("traceback", [])]
        parts += [str(v) for v in out.get("data", {}).values()]
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(parts))  # without terminal colours


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_the_first_cell_installs_from_pyprojects_address(path: Path):
    # The address is defined once (pyproject's [project.urls]); every first cell is the same
    # code around its own lesson number, so running one of them tests them all.
    source = "".join(_first_code_cell(path)["source"])
    assert f'COURSE = "single-gpu-course @ git+{ADDRESS}"' in source, path.name
    assert re.findall(r"https?://[^\s\"]+", source) == [f"{ADDRESS}"], path.name
    assert '%pip install --quiet "{COURSE}"' in source
    code = [line for line in source.splitlines() if not line.startswith("#")]
    reference = "".join(_first_code_cell(NOTEBOOKS[0])["source"])
    expected = [line for line in reference.splitlines() if not line.startswith("#")]
    assert code[-1] == f'L = lesson("{path.name[:2]}")', (
        f"{path.name}: the last line opens another lesson"
    )
    opening = re.compile(r'^L = lesson\("\d\d"\)$')
    assert [opening.sub("open", line) for line in code] == [
        opening.sub("open", line) for line in expected
    ], f"{path.name}: its first cell differs from notebook 00's beyond the lesson's number"


def test_without_the_course_the_cell_says_how_to_install_it(tmp_path: Path):
    # One output, the message: it stops "Run all" like an error, without a traceback (a
    # SystemExit would add IPython's "use %tb" hint and a warning about exiting).
    outputs = _run_first_cell(tmp_path, BLOCK_HELPERS)
    assert [out["output_type"] for out in outputs] == ["error"], _text(outputs)
    assert outputs[0]["ename"] == "CourseNotInstalled", _text(outputs)
    shown = _text(outputs)
    assert f"%pip install {INSTALL}" in shown and "pip install -e ." in shown, shown
    assert "Traceback" not in shown and "File " not in shown, f"a traceback is shown:\n{shown}"
    assert not (tmp_path / "pip-args.txt").exists()


def test_with_the_course_the_cell_shows_nothing(tmp_path: Path):
    outputs = _run_first_cell(tmp_path)
    assert outputs == [], _text(outputs)


def test_in_colab_the_cell_installs_the_course_itself(tmp_path: Path):
    outputs = _run_first_cell(tmp_path, BLOCK_HELPERS + FAKE_COLAB)
    assert outputs == [], _text(outputs)
    assert (tmp_path / "pip-args.txt").read_text() == f"install --quiet {INSTALL}"


def test_a_library_outside_the_tested_range_is_named(tmp_path: Path):
    # As if this torch were older than every tested one: print(L), the lesson's first output
    # (the next cell), says so after the scale.
    startup = 'from helpers import compat\n\ncompat.TESTED["torch"] = ("99.0.0", "99.1.0")\n'
    outputs = _run_first_cell(tmp_path, startup, then="print(L)")
    assert [out.get("name") for out in outputs] == ["stdout"], _text(outputs)
    assert outputs[0]["text"].startswith("Lesson 00. "), _text(outputs)
    assert "torch" in outputs[0]["text"] and "tested 99.0.0 to 99.1.0; every lesson" in _text(
        outputs
    )
