"""Lesson 15 (Seeing memory): timelines side by side, the peak read, an OOM debugged.

The timelines themselves are core machinery (``helpers.timeline``); here is what the lesson
does with them: the settings it compares, how a prediction's peak is matched to the
measured one, and the remedy each category at an out-of-memory error points to.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from helpers.names import MiB
from helpers.plots import short_module
from helpers.timeline import Timeline, _blocks, align, measure_timeline, predicted_timeline
from helpers.train import RunConfig

# Section 2's grid: each model in four settings (the 16-bit format is the device's).
GRID = {
    "fp32": {},
    "16-bit": {"precision": "half"},
    "fp32 + checkpointing": {"gradient_checkpointing": True},
    "16-bit + checkpointing": {"precision": "half", "gradient_checkpointing": True},
}

# What removes a category's bytes, and the lesson that shows it.
REMEDIES = {
    "activations": "gradient checkpointing (04), a smaller micro-batch with gradient "
    "accumulation (03), 16-bit autocast (05), SDPA attention (10)",
    "temporaries": "a smaller micro-batch (02/03); under autocast, fewer 16-bit weight copies "
    "alive at once (checkpointing, 04)",
    "gradients": "LoRA: gradients for the adapters only (13); optimizer steps inside backward "
    "free each gradient as it is used",
    "optimizer_state": "8-bit AdamW or Adafactor (06), LoRA (13), DeepSpeed offload (08)",
    "params": "LoRA/QLoRA with 16-bit or 4-bit frozen weights (13), DeepSpeed ZeRO-3 offload (08)",
    "buffers": "a shorter maximum sequence (position buffers), rarely the problem",
    "inputs": "a smaller batch (02)",
}


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


def grid_config(base: RunConfig, setting: dict, half: str) -> RunConfig:
    """``base`` with a GRID setting applied ("half" is the device's 16-bit format)."""
    changes = {k: (half if v == "half" else v) for k, v in setting.items()}
    return replace(base, **changes)


def measured_and_predicted(cfg: RunConfig) -> tuple[Timeline, Timeline]:
    """The tracker's timeline of ``cfg`` (fresh process) and the estimator's."""
    return measure_timeline(cfg), predicted_timeline(cfg)


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


def phase_values(t: Timeline, category: str, phase: str, micro: int | None = None) -> list[int]:
    """A category's bytes at every point of one phase (of one micro-batch, if given)."""
    return [
        v
        for v, p, m in zip(t.alive[category], t.phase, t.micro, strict=True)
        if p == phase and (micro is None or m == micro)
    ]


def short_where(where: str) -> str:
    """ "backward: LlamaForCausalLM.model.layers.0.mlp" -> "backward: model.layers.0.mlp"."""
    phase, _, module = where.partition(": ")
    return f"{phase}: {short_module(module)}" if module else phase


def remedy(category: str) -> str:
    """The techniques that shrink ``category``, with their lessons."""
    return REMEDIES.get(category, "see lesson 14's planner")


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


def growth(t: Timeline, index: int | None = None) -> dict[str, int]:
    """Bytes each category added between the step's start and point ``index`` (the peak)."""
    i = t.peak_index if index is None else index
    return {k: v[i] - v[0] for k, v in t.alive.items()}
