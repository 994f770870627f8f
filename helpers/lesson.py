"""A lesson's opening line: ``L = lesson("05")`` gives its device, scale and ``save``.

Every notebook starts the same way: which device, which scale, a printed description so the
learner knows what the numbers mean, and a way to keep records in the results store. This
module is that opening, written once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helpers.device import default_device
from helpers.hardware import HardwareReport, hardware_report
from helpers.results import Record
from helpers.results import save as save_record
from helpers.scale import Scale, get_scale
from helpers.train import RunConfig


@dataclass
class Lesson:
    """Where a lesson runs and at what sizes; ``str()`` is what the learner reads first."""

    number: str  # "05": the notebook's number, and the records' tag in the results store
    device: torch.device
    scale: Scale
    report: HardwareReport

    def __str__(self) -> str:
        return f"Lesson {self.number}. {self.scale.describe(self.device)}"

    def save(self, record: Record) -> Record:
        """Append ``record`` to the results store under this lesson; returns it."""
        return save_record(record, self.number)

    def run_config(self, **overrides) -> RunConfig:
        """A RunConfig at this lesson's scale (``Scale.run_config``)."""
        return self.scale.run_config(**overrides)


def lesson(number: str, scale: str | None = None, device: str | None = None) -> Lesson:
    """The lesson's device (the default one unless named), scale (auto unless named), report."""
    dev = torch.device(device) if device else default_device()
    return Lesson(number, dev, get_scale(scale, device=dev), hardware_report(dev))
