"""Progress bars: on in a notebook, off under CI, in ``make test`` and in isolated children."""

import os
from pathlib import Path

import pytest

from helpers import isolate
from helpers.progress import PROGRESS_VARIABLE, enabled, progress

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("ci", "setting", "expected"),
    [
        (None, None, True),  # a learner's notebook
        ("true", None, False),  # a CI service
        ("false", None, True),
        ("true", "1", True),  # asked for under CI
        (None, "0", False),  # make test
        (None, "off", False),
    ],
)
def test_when_bars_show(monkeypatch, ci, setting, expected):
    for name, value in (("CI", ci), (PROGRESS_VARIABLE, setting)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert enabled() is expected
    assert progress(range(3), "runs").disable is not expected
    assert list(progress(range(3), "runs")) == [0, 1, 2]


def test_trainer_bar_follows_the_setting(monkeypatch):
    from helpers.train import trainer_arguments

    monkeypatch.delenv("CI", raising=False)
    for setting, disabled in (("1", False), ("0", True)):
        monkeypatch.setenv(PROGRESS_VARIABLE, setting)
        assert trainer_arguments("build/tmp-trainer", "cpu").disable_tqdm is disabled


def _setting() -> str | None:
    return os.environ.get(PROGRESS_VARIABLE)


def test_an_isolated_experiment_shows_no_bar(monkeypatch):
    monkeypatch.setenv(PROGRESS_VARIABLE, "1")
    assert isolate.call_isolated(_setting).value == "0"


def test_timing_rounds_run_with_bars_on(monkeypatch):
    from helpers.timing import interleave

    monkeypatch.setenv(PROGRESS_VARIABLE, "1")
    out = interleave(lambda name: 1.0 if name == "a" else 2.0, ["a", "b"], rounds=3, max_rounds=3)
    assert out.times == {"a": [1.0] * 3, "b": [2.0] * 3}


# Each cell below runs in one real kernel (one start for all: a few seconds), with bars on.
LOOPS = {
    "done": "for i in progress(range(3), 'runs'):\n    time.sleep(0.3)",
    "break": "for i in progress(range(9), 'rounds'):\n    time.sleep(0.3)\n    if i == 2:\n"
    "        break",
    "raise": "try:\n    for i in progress(range(9), 'runs'):\n        time.sleep(0.3)\n"
    "        if i == 2:\n            raise KeyError(i)\nexcept KeyError:\n    pass",
    "one after another": "for plan in range(3):\n    for i in progress(range(2), 'setups'):\n"
    "        pass",
    "the next cell": "for plan in range(3):\n    for i in progress(range(2), 'setups'):\n"
    "        pass",
    "long wait": "assert call_isolated(time.sleep, 3.5).error is None",
    "short wait": "assert call_isolated(time.sleep, 0.1).error is None",
}


@pytest.fixture(scope="module")
def kernel_outputs():
    """{name in LOOPS: the outputs its cell left} from one notebook run in a real kernel."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    env = {
        PROGRESS_VARIABLE: "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        nb = nbformat.v4.new_notebook()
        setup = (
            "import time\nfrom helpers.isolate import call_isolated\n"
            "from helpers.progress import progress"
        )
        nb.cells = [nbformat.v4.new_code_cell(setup)]
        nb.cells += [nbformat.v4.new_code_cell(code) for code in LOOPS.values()]
        nbclient.NotebookClient(nb, timeout=90, kernel_name="python3").execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {name: cell.outputs for name, cell in zip(LOOPS, nb.cells[1:], strict=True)}


EMPTIED = [{"text/plain": ""}]  # one display output, emptied at the end


@pytest.mark.parametrize("how", ["done", "break", "raise"])
def test_in_a_notebook_a_bar_is_text_that_is_emptied_however_the_loop_ends(kernel_outputs, how):
    """No ipywidgets bar (red when a loop stops early, "model not found" once reopened): one
    text output, updated in place, empty after a finished loop, a break and an exception."""
    outputs = kernel_outputs[how]
    assert [o.output_type for o in outputs] == ["display_data"], outputs
    assert [o.get("data") for o in outputs] == EMPTIED, outputs


def test_bars_one_after_another_in_a_cell_share_one_output(kernel_outputs):
    for name in ("one after another", "the next cell"):  # the next cell: a line of its own
        assert [o.get("data") for o in kernel_outputs[name]] == EMPTIED, kernel_outputs[name]


def test_a_long_wait_on_a_fresh_process_counts_seconds_then_empties(kernel_outputs):
    """An experiment in a child shows no bar of its own: its cell counts the seconds (after
    2 s), so it is never silent, and a short one shows nothing at all."""
    assert [o.get("data") for o in kernel_outputs["long wait"]] == EMPTIED
    assert kernel_outputs["short wait"] == []
