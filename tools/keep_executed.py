"""A pytest plugin: keep each notebook nbval executes, with its outputs (for ``make book``).

    python -m pytest --nbval-lax -p tools.keep_executed --keep-executed DIR notebooks/

nbval runs every code cell in a kernel and compares, but writes nothing back. With this plugin
each notebook is written to the folder as soon as its last cell has run: every code cell with
the outputs nbval collected from the kernel and its execution count, and the notebook's
metadata gains ``course_executed`` (who ran it, when, at which commit, how many seconds its
run took with its kernel's start, and which cells failed). ``make test`` loads it, so the one
execution CI already pays for is the one the book shows (tools/book.py); nothing runs twice.

The kernels also get the figure-text startup file of ``make browser-check``
(tools/browser_check_figure_text.py, through a scratch ``IPYTHONDIR``): each figure's output
metadata then carries the pixel size of its smallest text, which the book's check scales by the
width a browser shows the image at (the course's 8 px rule).
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
_KEY = pytest.StashKey[dict]()


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--keep-executed",
        default=None,
        metavar="DIR",
        help="write every notebook nbval executes, with its outputs, to DIR",
    )


def pytest_configure(config) -> None:
    folder = config.getoption("--keep-executed")
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    config.stash[_KEY] = {"folder": Path(folder), "commit": _commit()}
    startup = Path(folder) / ".ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True, exist_ok=True)
    shutil.copy(
        ROOT / "tools" / "browser_check_figure_text.py", startup / "00-course-figure-text.py"
    )
    # The kernels nbval starts inherit this process's environment.
    os.environ["IPYTHONDIR"] = str((Path(folder) / ".ipython").resolve())


def _commit() -> str:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item) -> None:
    kept = item.config.stash.get(_KEY, None)
    if kept is not None and hasattr(item, "cell_num"):  # before pytest sets up the notebook,
        # so a notebook's clock includes its kernel's start (its first cell's setup)
        kept.setdefault("started", {}).setdefault(item.parent.nodeid, time.monotonic())


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem) -> None:
    kept = item.config.stash.get(_KEY, None)
    if kept is None or not hasattr(item, "test_outputs"):
        return  # not asked for, or not a notebook cell
    cells = kept.setdefault(item.parent.nodeid, {})
    cells[item.cell_num] = item.test_outputs
    if nextitem is None or nextitem.parent is not item.parent:
        started = kept.get("started", {}).pop(item.parent.nodeid, None)
        seconds = round(time.monotonic() - started, 1) if started is not None else None
        outputs = kept.pop(item.parent.nodeid)
        write_executed(item.parent.nb, outputs, kept, Path(item.parent.path), seconds)


def write_executed(
    nb, outputs: dict[int, list | None], kept: dict, path: Path, seconds: float | None = None
) -> Path:
    """``nb`` with each code cell's ``outputs`` (by code-cell number; None: not run), written to
    the kept folder under ``path``'s name; ``seconds``: its run, kernel start included."""
    nb = copy.deepcopy(nb)
    failed, number = [], 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outs = outputs.get(number)
        cell.outputs = [_output(o, number + 1) for o in outs] if outs is not None else []
        cell.execution_count = number + 1 if outs is not None else None
        if any(o.get("output_type") == "error" for o in cell.outputs):
            failed.append(number)
        number += 1
    nb.metadata["course_executed"] = {
        "by": "make test (nbval)",
        "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": kept["commit"],
        "failed_cells": failed,
        "seconds": seconds,
    }
    out = kept["folder"] / path.name
    nbformat.write(nb, out)
    return out


def _output(out, count: int) -> dict:
    """nbval's record of one output, as nbformat stores it."""
    kind = out["output_type"]
    if kind == "stream":
        return nbformat.v4.new_output("stream", name=out["name"], text=out["text"])
    if kind == "error":
        return nbformat.v4.new_output("error", ename=out["ename"], evalue=out["evalue"],
                                      traceback=out["traceback"])  # fmt: skip
    made = nbformat.v4.new_output(kind, data=out.get("data", {}),
                                  metadata=out.get("metadata", {}))  # fmt: skip
    if kind == "execute_result":
        made.execution_count = count
    return made
