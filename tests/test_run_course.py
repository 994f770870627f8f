"""tools/run_course.py, what make course runs: every notebook executed, failures listed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat

TOOL = Path(__file__).resolve().parents[1] / "tools" / "run_course.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("run_course", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def notebook(path: Path, code: str) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, path)
    return path


def test_a_failing_notebook_is_listed_and_the_others_still_run(tmp_path, capsys):
    bad = notebook(tmp_path / "01_bad.ipynb", "raise ValueError('lesson broke')")
    good = notebook(tmp_path / "02_good.ipynb", "print(6 * 7)")
    out = tmp_path / "executed"
    assert load_tool().main([str(bad), str(good), "--out", str(out), "--no-tables"]) == 1
    printed = capsys.readouterr()
    assert "lesson broke" in printed.err and f"{bad} FAILED" in printed.out
    assert f"{good} done" in printed.out and f"  {bad}" in printed.out.split("Failed")[-1]
    ran = nbformat.read(out / "02_good.ipynb", as_version=4)
    assert ran.cells[0].outputs[0]["text"] == "42\n"  # the executed copy keeps its outputs


def test_a_kernel_that_dies_is_a_failure_not_a_crash(tmp_path, capsys):
    dead = notebook(tmp_path / "03_dead.ipynb", "import os\nos._exit(1)")
    assert load_tool().main([str(dead), "--out", str(tmp_path / "out"), "--no-tables"]) == 1
    assert f"{dead} FAILED" in capsys.readouterr().out
