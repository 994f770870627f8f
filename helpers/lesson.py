"""A lesson's opening line: ``L = lesson("05")`` in its first cell.

Every notebook starts the same way, and this call is all of it:

- it starts the fork server that experiments are forked from (``helpers.forkserver``; with the
  modules that lesson's row in ``helpers.syllabus`` preloads), first, so the server imports
  torch and transformers in the background while the kernel imports them too;
- it picks the device and the scale, so the learner knows what the numbers mean
  (``print(L)``), and notes any installed library outside the tested versions;
- ``L.save`` keeps records in the results store (with their speed from an interleaved
  comparison, if given), ``L.run_config`` makes settings at the scale.

Importing this module imports torch, not transformers: ``helpers.scale`` (which imports the
training code) is imported inside ``lesson``, after the server has started.

Example::

    >>> L = lesson("05")
    >>> L.scale.name in ("tiny", "full")
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from helpers import forkserver, syllabus
from helpers.compat import untested_versions
from helpers.device import default_device
from helpers.hardware import HardwareReport, hardware_report
from helpers.results import Record, with_speed
from helpers.results import save as save_record

if TYPE_CHECKING:
    from helpers.scale import Scale
    from helpers.train import RunConfig


@dataclass
class Lesson:
    """Where a lesson runs and at what sizes; ``str()`` is what the learner reads first."""

    number: str  # "05": the notebook's number, and the records' tag in the results store
    device: torch.device
    scale: Scale
    report: HardwareReport
    versions_note: str = ""  # the installed libraries outside the tested versions ("": none)

    def __str__(self) -> str:
        text = f"Lesson {self.number}. {self.scale.describe(self.device)}"
        return f"{text}\n{self.versions_note}" if self.versions_note else text

    def save(self, record: Record, speed=None, label: str | None = None) -> Record:
        """Append ``record`` to the results store under this lesson; returns what was saved.

        ``speed``: an interleaved comparison (``compare_runs``) that timed the record's run
        under ``label`` (default: the record's own label); the record is saved with that
        speed (``helpers.results.with_speed``), not the one its own process measured.
        """
        if speed is not None:
            record = with_speed(record, speed, label)
        return save_record(record, self.number)

    def run_config(self, **overrides) -> RunConfig:
        """A RunConfig at this lesson's scale (``Scale.run_config``)."""
        return self.scale.run_config(**overrides)


def lesson(number: str, scale: str | None = None, device: str | None = None) -> Lesson:
    """Open lesson ``number``: start the fork server, then find its device, scale and report.

    Args:
        number: the lesson's number ("05"); its row in ``helpers.syllabus`` says what the fork
            server preloads. A number with no row (a scratch notebook) preloads the usual.
        scale: "tiny" or "full"; None: ``$COURSE_SCALE``, else full on CUDA, tiny elsewhere.
        device: a device name; None: the default one (``$COURSE_DEVICE``, else the accelerator).

    Returns:
        A ``Lesson``; ``print(L)`` names the scale, the device, and any library outside the
        tested versions with the lessons it may change.
    """
    forkserver.start(*syllabus.preload_for(number))  # first: the server imports as we do
    from helpers.scale import get_scale  # imports transformers

    dev = torch.device(device) if device else default_device()
    return Lesson(
        number, dev, get_scale(scale, device=dev), hardware_report(dev), untested_versions()
    )
