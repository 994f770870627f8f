"""make browser-check (tools/browser_check.py) catches what a reader would see go wrong.

Tiny scratch notebooks, one JupyterLab for all of them: a progress bar stopped early (red), an
error, a bar whose widget is gone when the notebook is reopened, figure text too small, a
silent cell, a bar short of its end, stderr and a text meter left at 40 %, and a clean notebook
that passes. It needs Chromium, a Python with Playwright
(PLAYWRIGHT_PYTHON, or .venv-playwright in the checkout) and JupyterLab in the Python running
the tests (the lab starts from it); without them it is skipped, saying which is missing (CI
has no Chromium). About a minute and a half on two cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")


def playwright_python() -> str | None:
    """A Python that imports Playwright: PLAYWRIGHT_PYTHON, .venv-playwright, or this one."""
    for python in (os.environ.get("PLAYWRIGHT_PYTHON"), ROOT / ".venv-playwright/bin/python"):
        if python and Path(python).exists():
            return str(python)
    return sys.executable if importlib.util.find_spec("playwright") else None


def notebook(*cells: str) -> dict:
    """A notebook with these code cells, no outputs."""
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {"kernelspec": kernel},
        "cells": [
            {
                "cell_type": "code",
                "execution_count": None,
                "id": f"c{i}",
                "metadata": {},
                "outputs": [],
                "source": source,
            }
            for i, source in enumerate(cells)
        ],
    }


NOTEBOOKS = {
    "clean": notebook(
        "print('hello')",
        "import matplotlib.pyplot as plt\nfig, ax = plt.subplots(figsize=(4, 3))\n"
        "ax.plot([1, 2, 3])\nax.set_title('readable')\nplt.show()",
    ),
    "red_bar": notebook(
        "from tqdm.notebook import tqdm\nfor i in tqdm(range(10)):\n    if i == 3:\n        break"
    ),
    "error": notebook("print('before')", "raise ValueError('broken on purpose')", "print(1)"),
    "gone_on_reopen": notebook(
        "from tqdm.notebook import tqdm\nfor i in tqdm(range(5), leave=False):\n    pass"
    ),
    "small_text": notebook(
        "import matplotlib.pyplot as plt\nfig, ax = plt.subplots(figsize=(30, 3))\n"
        "ax.plot([1, 2, 3])\nplt.show()"
    ),
    "silent": notebook("import time\nprint('start', flush=True)\ntime.sleep(7)"),
    "stopped_bar": notebook(
        "from tqdm.notebook import tqdm\nbar = tqdm(total=10)\nbar.update(3)\nbar.refresh()"
    ),  # never closed: not red, short of its end (refresh: update alone may not redraw)
    "text_meter": notebook(
        "import sys\nprint('careful', file=sys.stderr)",
        "from IPython.display import display\n"
        "meter = {'text/plain': 'x:  10%|█         | 2/20'}\n"
        "handle = display(meter, raw=True, display_id=True)\n"
        "handle.update({'text/plain': 'x:  40%|████      | 8/20 [00:01<00:02]'}, raw=True)",
    ),
}


@pytest.fixture(scope="module")
def summary(tmp_path_factory) -> dict:
    """Run browser_check once over every scratch notebook; its summary.json, by notebook."""
    python = playwright_python()
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set CHROMIUM)")
    if python is None:
        pytest.skip("no Python with Playwright (PLAYWRIGHT_PYTHON or .venv-playwright)")
    if importlib.util.find_spec("jupyterlab") is None:  # the lab runs from this interpreter
        pytest.skip(f"no JupyterLab in {sys.executable} (make install, or pip install jupyterlab)")
    folder = tmp_path_factory.mktemp("browser_check")
    paths = []
    for name, content in NOTEBOOKS.items():
        paths.append(folder / f"{name}.ipynb")
        paths[-1].write_text(json.dumps(content))
    shots = folder / "shots"
    command = [python, str(ROOT / "tools" / "browser_check.py"), "--no-calculator",
               "--lab-python", sys.executable, "--chromium", CHROMIUM, "--silence", "4",
               "--shots", str(shots), *map(str, paths)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads((shots / "summary.json").read_text())
    return {Path(n["notebook"]).stem: n for n in record["notebooks"]}


def kinds(entry: dict) -> set[tuple[int | None, str]]:
    """A notebook's failures as (cell, kind)."""
    return {(f["cell"], f["kind"]) for f in entry["failures"]}


def test_a_clean_notebook_passes(summary):
    """Output, a figure with readable text: no failure, and screenshots were saved."""
    assert summary["clean"]["failures"] == []
    assert summary["clean"]["cells"] == 2
    assert all(Path(s).exists() for s in summary["clean"]["shots"]) and summary["clean"]["shots"]


def test_a_bar_stopped_early_is_caught_red(summary):
    """Breaking out of a tqdm.notebook loop leaves the bar red: failed in cell 1."""
    assert (1, "red bar after the run") in kinds(summary["red_bar"])


def test_an_error_output_is_caught_in_its_cell(summary):
    """The traceback of cell 2 fails it, with the exception's name and message."""
    errors = [f for f in summary["error"]["failures"] if f["kind"] == "error"]
    assert [(f["cell"], f["message"]) for f in errors] == [(2, "ValueError: broken on purpose")]
    assert Path(errors[0]["shot"]).exists()


def test_a_widget_gone_on_reopen_is_caught(summary):
    """A bar with leave=False closes its widget: after save and reopen, no model to show."""
    assert (1, "widget after reopening") in kinds(summary["gone_on_reopen"])


def test_figure_text_shrunk_below_8_px_is_caught(summary):
    """A 30-inch-wide figure is scaled to the notebook's width: its tick labels go under 8 px."""
    assert (1, "small figure text") in kinds(summary["small_text"])
    assert (1, "small figure text") not in kinds(summary["clean"])


def test_a_bar_short_of_its_end_is_caught(summary):
    """A widget bar left at 3 of 10, never closed (so not red), fails as stopped at 30 %."""
    failures = summary["stopped_bar"]["failures"]
    assert [(f["cell"], f["kind"], f["message"]) for f in failures[:1]] == [
        (1, "bar after the run", "a progress bar stopped at 30%")
    ]


def test_stderr_and_an_unfinished_text_meter_are_caught(summary):
    """A line on stderr fails its cell; a text meter updated through its display handle and
    left at 40 % fails the other, with the meter's last text."""
    failures = {(f["cell"], f["kind"]): f["message"] for f in summary["text_meter"]["failures"]}
    assert failures == {
        (1, "stderr"): "careful",
        (2, "unfinished meter"): "x:  40%|████      | 8/20 [00:01<00:02]",
    }


def test_a_silent_cell_is_caught(summary):
    """Seven seconds without output with --silence 4 fail the cell."""
    assert kinds(summary["silent"]) == {(1, "silent")}


# ---------------------------------------------------------------------------------------------
# The parts that need no browser (these run on CI too)


def load_tool(name: str):
    """A module of tools/ by file name (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_a_text_meter_below_100_percent_is_found_in_its_last_state():
    """tqdm's text meter: below 100 % found, 100 % or a meter redrawn to 100 % with \\r not."""
    meter_left = load_tool("browser_check").meter_left
    unfinished = "x:  40%|████      | 8/20 [00:01<00:02]"
    assert meter_left(f"before\n{unfinished}\n") == unfinished
    assert meter_left("x: 100%|██████████| 20/20 [00:03<00:00]") == ""
    assert meter_left("x:  40%|████      | 8/20\rx: 100%|██████████| 20/20") == ""
    assert meter_left("done: 20 runs in 3 s\nsaved 40% of the memory") == ""


def test_a_figure_png_carries_its_smallest_text_in_pixels():
    """The wrapped PNG function returns the same image, with the smallest text's size at its dpi."""
    from functools import partial

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from IPython.core.pylabtools import print_figure, retina_figure

    figure_text = load_tool("browser_check_figure_text")
    fig, ax = plt.subplots(figsize=(3, 2), dpi=100)
    ax.set_title("title", fontsize=12)
    ax.set_xlabel("tiny", fontsize=6)
    plain = partial(print_figure, fmt="png", bbox_inches="tight")
    data, metadata = figure_text.measured(plain)(fig)
    assert data == plain(fig)
    assert metadata == {"course_min_text_px": round(6 * 100 / 72, 2), "course_min_text": "tiny"}
    data, metadata = figure_text.measured(retina_figure)(fig)  # twice the pixels, same width
    assert metadata["course_min_text_px"] == round(2 * 6 * 100 / 72, 2)
    assert metadata["width"] == retina_figure(fig)[1]["width"]
    plt.close(fig)
