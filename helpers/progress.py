"""Progress bars for cells that run many experiments (every lesson; see lesson 00, section 1).

``progress(items, "what")`` wraps ``tqdm.auto``: in JupyterLab a widget bar, in a terminal a
text bar. They are off where nobody watches: under CI (the ``CI`` variable, which CI services
set), when ``COURSE_PROGRESS=0`` (``make test`` sets it, so nbval logs stay clean), and in the
processes the lessons start for isolated experiments (their bars would only reach the
kernel's log, not the notebook). ``COURSE_PROGRESS=1`` turns them on even under CI.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

# The variable that turns progress bars on ("1") or off ("0"); unset: on, except under CI.
PROGRESS_VARIABLE = "COURSE_PROGRESS"


def enabled() -> bool:
    """Whether progress bars are shown here (see the module docstring for the rules)."""
    setting = os.environ.get(PROGRESS_VARIABLE, "").strip()
    if setting:
        return setting not in ("0", "false", "no", "off")
    return os.environ.get("CI", "").strip().lower() in ("", "0", "false")


def progress(items: Iterable, desc: str, total: int | None = None, unit: str = "run"):
    """``items`` with a progress bar labelled ``desc`` (no bar when ``enabled()`` is False)."""
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, total=total, unit=unit, disable=not enabled(), leave=False)


def quiet_here() -> None:
    """Turn progress bars off in this process (an isolated experiment's child process)."""
    os.environ[PROGRESS_VARIABLE] = "0"
