"""Progress bars for cells that run many experiments (every lesson; see lesson 00, section 1).

``progress(items, "what")`` is a tqdm bar. In a terminal it is tqdm's own text bar. In a
notebook it is the same text meter shown as a plain-text output that one display handle keeps
updating (``display(..., display_id=True)`` then ``handle.update``), not tqdm's ipywidgets bar:

- tqdm's widget bar turns red whenever a loop ends before ``total``, which the course's timing
  loops do on purpose (they stop once a claim is decided): red reads as a crash;
- a widget's output only renders while its kernel-side model lives, so a saved notebook
  reopened later shows "Error displaying widget: model not found" where each bar was.

A text output has neither problem. When the loop ends, however it ends (done, stopped early,
an exception), the output is emptied, so a finished cell shows only what the lesson printed.

Bars are off where nobody watches: under CI (the ``CI`` variable, which CI services set), when
``COURSE_PROGRESS=0`` (``make test`` sets it, so nbval logs stay clean), and in the processes
the lessons start for isolated experiments (their bars would only reach the kernel's log, not
the notebook). ``COURSE_PROGRESS=1`` turns them on even under CI.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable
from typing import ClassVar

from tqdm.std import tqdm as std_tqdm

# The variable that turns progress bars on ("1") or off ("0"); unset: on, except under CI.
PROGRESS_VARIABLE = "COURSE_PROGRESS"
# Seconds between two updates of a notebook bar (each one is a message to the browser).
NOTEBOOK_INTERVAL = 0.5


def enabled() -> bool:
    """Whether progress bars are shown here (see the module docstring for the rules)."""
    setting = os.environ.get(PROGRESS_VARIABLE, "").strip()
    if setting:
        return setting not in ("0", "false", "no", "off")
    return os.environ.get("CI", "").strip().lower() in ("", "0", "false")


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (its outputs go to a notebook, not a terminal)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def _cell() -> str | None:
    """The id of the request the kernel is answering now (a cell's run, a widget's click)."""
    from IPython import get_ipython

    header = getattr(get_ipython(), "parent_header", None) or {}
    return header.get("header", {}).get("msg_id")


class NotebookBar(std_tqdm):
    """tqdm's text meter in one notebook output, updated in place and emptied at the end.

    Bars one after another in the same cell share one output (a planner estimating twelve
    plans shows one line, not twelve), so a cell keeps at most one empty line per nesting
    level once its loops are done.
    """

    _free: ClassVar[dict[str, list]] = {}  # per cell: the handles of its closed bars, to reuse

    def __init__(self, *args, **kwargs):
        kwargs = {"mininterval": NOTEBOOK_INTERVAL, **kwargs, "gui": True}
        self._handle = None
        self._cell = _cell()
        super().__init__(*args, **kwargs)  # gui=True: tqdm calls display() instead of writing
        if not self.disable and self.delay <= 0:
            self.display()

    def display(self, msg=None, pos=None):
        """Show the meter (tqdm calls this on each refresh)."""
        from IPython.display import display

        text = self.format_meter(**self.format_dict) if msg is None else msg
        bundle = {"text/plain": text}
        if self._handle is None:
            free = NotebookBar._free
            if self._cell not in free:  # a new cell: the handles of earlier ones are done
                free.clear()
            if free.get(self._cell):
                self._handle = free[self._cell].pop()
        if self._handle is None:
            self._handle = display(bundle, raw=True, display_id=True)
        else:
            self._handle.update(bundle, raw=True)
        return True

    def close(self):
        """Empty the output: a finished bar leaves nothing behind, whatever ended the loop."""
        if self.disable:
            return
        super().close()
        if self._handle is not None:
            self._handle.update({"text/plain": ""}, raw=True)
            NotebookBar._free.setdefault(self._cell, []).append(self._handle)
            self._handle = None

    def clear(self, *_, **__):
        pass


def progress(items: Iterable, desc: str, total: int | None = None, unit: str = "run"):
    """``items`` with a progress bar labelled ``desc`` (no bar when ``enabled()`` is False)."""
    bar = NotebookBar if in_notebook() else std_tqdm
    return bar(items, desc=desc, total=total, unit=unit, disable=not enabled(), leave=False)


@contextlib.contextmanager
def waiting(desc: str, delay: float = 2.0):
    """A meter of the time spent waiting on work that shows no bar of its own (an experiment
    in a fresh process): call the ``tick`` it yields while waiting. In a notebook a long wait
    then reads ``desc: 00:12``, counting, instead of a silent cell; a wait shorter than
    ``delay`` seconds shows nothing, and the output is emptied at the end as a bar's is.
    Elsewhere (a terminal, bars off) ``tick`` does nothing."""
    if not (enabled() and in_notebook()):
        yield lambda: None
        return
    bar = NotebookBar(total=None, desc=desc, bar_format="{desc}: {elapsed}", delay=delay,
                      leave=False)  # fmt: skip

    def tick() -> None:
        if bar.format_dict["elapsed"] >= delay:  # tqdm's own clock, as its meter shows it
            bar.refresh()

    try:
        yield tick
    finally:
        bar.close()


def quiet_here() -> None:
    """Turn progress bars off in this process (an isolated experiment's child process)."""
    os.environ[PROGRESS_VARIABLE] = "0"
