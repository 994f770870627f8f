"""Lesson 15 (Seeing memory): timelines side by side, the peak read, an OOM debugged.

The timelines themselves are core machinery (``helpers.timeline``); here is what the lesson
does with them: how a prediction's peak is matched to the measured one, and where a point is
(the module's path without the model class), the largest tensors at the peak as table rows.
The settings compared, the growth read and the remedies are the notebook's cells.
"""

from __future__ import annotations

from dataclasses import dataclass

from helpers.names import MiB
from helpers.plots import short_module
from helpers.timeline import Timeline, _blocks, align


@dataclass
class PeakMatch:
    """The predicted peak against the measured one: size and moment."""

    measured: int
    predicted: int
    measured_where: str
    predicted_where: str
    same_phase: bool
    same_block: bool  # the same layer (or embeddings / head) of the same phase
    measured_near_predicted: int  # the measured total's maximum inside the predicted block

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted - self.measured) / self.measured


def peak_match(measured: Timeline, predicted: Timeline) -> PeakMatch:
    """Where each timeline peaks, and whether the moments agree."""
    mblock = _blocks(measured)[measured.peak_index]
    pblock = _blocks(predicted)[predicted.peak_index]
    mphase, pphase = measured.phase[measured.peak_index], predicted.phase[predicted.peak_index]
    x = round(align(predicted, measured)[predicted.peak_index])
    blocks = _blocks(measured)
    same = [i for i, (p, b) in enumerate(zip(measured.phase, blocks, strict=True))
            if p == pphase and b == pblock] or [x]  # fmt: skip
    total = measured.total
    return PeakMatch(
        measured=measured.peak,
        predicted=predicted.peak,
        measured_where=measured.peak_where,
        predicted_where=predicted.peak_where,
        same_phase=mphase == pphase,
        same_block=mphase == pphase and mblock == pblock,
        measured_near_predicted=max(total[i] for i in same),
    )


def short_where(where: str) -> str:
    """ "backward: LlamaForCausalLM.model.layers.0.mlp" -> "backward: model.layers.0.mlp"."""
    phase, _, module = where.partition(": ")
    return f"{phase}: {short_module(module)}" if module else phase


def largest_rows(t: Timeline, n: int = 6) -> list[dict]:
    """The largest tensors alive at ``t``'s peak (or at its failure) as table rows."""
    return [
        {
            "category": x.category,
            "MiB": round(x.nbytes / MiB, 3),
            "shape": "x".join(map(str, x.shape)) or "?",
            "dtype": x.dtype,
            "created in": short_where(x.created),
        }
        for x in t.at_peak[:n]
    ]
