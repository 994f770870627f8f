"""Progress bars: on in a notebook, off under CI, in ``make test`` and in isolated children."""

import os

import pytest

from helpers import isolate
from helpers.progress import PROGRESS_VARIABLE, enabled, progress


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
