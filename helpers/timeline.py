"""One training step's memory over time, category by category: measured and predicted.

Lesson 15 ("Seeing memory") builds this picture first in its cells; the machinery lives here.
The measured timeline is the course's ``CategoryTracker`` with ``timeline=True``: one point
after every allocation, free or relabelling of a tracked storage, so its maxima are the
tracker's own per-category peaks (the same running totals, read at every change). The
predicted timeline is the estimator's stage model walked moment by moment
(``estimate(..., moments=[])``): a few dozen moments, one or more per stage.

Memory view: the tracker's exact bytes of live tensor storages (view 1 of
``helpers.memory``), not the allocator's reserved bytes and not what nvidia-smi shows.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

import torch

from helpers.estimator import estimate
from helpers.isolate import call_isolated
from helpers.memory import CATEGORIES, CategoryTracker
from helpers.train import RunConfig, Trainee

PHASES = ("forward", "backward", "optimizer step")


@dataclass(frozen=True)
class LiveTensor:
    """A storage alive at some moment: what it is, how big, and where it was created."""

    category: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    created: str


@dataclass
class Timeline:
    """A step's bytes alive per category at each point, with the phase and module running."""

    source: str  # "measured" (the tracker) or "predicted" (the estimator's stage model)
    label: str
    alive: dict[str, list[int]]  # category -> bytes alive at each point
    phase: list[str]  # "forward", "backward", "optimizer step" or "outside" at each point
    micro: list[int]  # the micro-batch running (1, 2, ...) at each point
    where: list[str]  # innermost module (measured) or stage (predicted) at each point
    peak: int  # the largest total
    peak_index: int  # the point where the total first reached it
    maxima: dict[str, int] = field(default_factory=dict)  # the tracker's (or estimate's) peaks
    at_peak: list[LiveTensor] = field(default_factory=list)  # largest storages at the peak
    error: str = ""  # the OutOfMemoryError that stopped the step, if one did
    seconds: float = 0.0  # the tracked step's wall time (measured)

    @property
    def total(self) -> list[int]:
        """Bytes alive in all categories at each point."""
        return [sum(v) for v in zip(*self.alive.values(), strict=True)]

    @property
    def peak_where(self) -> str:
        """Phase and module (or stage) at the peak, e.g. "backward: model.layers.1.mlp"."""
        i = self.peak_index
        return f"{self.phase[i]}: {self.where[i]}" if self.where[i] else self.phase[i]

    def category_maxima(self) -> dict[str, int]:
        """Each category's largest value along the timeline."""
        return {k: max(v, default=0) for k, v in self.alive.items()}

    def spans(self) -> list[tuple[str, int, int, int]]:
        """Runs of one phase: (phase, micro-batch, first point, last point)."""
        out: list[tuple[str, int, int, int]] = []
        for i, (p, m) in enumerate(zip(self.phase, self.micro, strict=True)):
            if out and out[-1][0] == p and out[-1][1] == m:
                out[-1] = (p, m, out[-1][2], i)
            else:
                out.append((p, m, i, i))
        return out


def measure_timeline(cfg: RunConfig, top: int = 8, isolate: bool = True) -> Timeline:
    """The tracker's timeline of one steady-state step of ``cfg`` (in a fresh process)."""
    if isolate:
        return call_isolated(measure_timeline, cfg, top, False).unwrap()
    trainee = Trainee(cfg)
    for _ in range(max(1, cfg.warmup)):  # the first step creates the optimizer state
        trainee.step()
    return tracked_timeline(trainee, top=top)


def tracked_timeline(trainee: Trainee, top: int = 8, timeline: bool = True) -> Timeline:
    """One ``trainee.step()`` under a ``CategoryTracker`` recording every change.

    ``cfg.budget`` applies to the tracker's bytes on every device, CUDA included (no
    allocator cap here): past it the step stops with the tracker's OutOfMemoryError, and the
    timeline ends at the allocation that did not fit.
    """
    cfg = trainee.cfg
    tracker = CategoryTracker(budget=cfg.budget, device=trainee.device, timeline=timeline)
    tracker.track_external(trainee.model, trainee.optimizer)
    error = ""
    with tracker:
        start = len(tracker.events or ())
        t0 = time.perf_counter()
        try:
            trainee.step()
        except torch.OutOfMemoryError as err:  # the timeline up to the allocation that failed
            error = str(err).splitlines()[0]
        seconds = time.perf_counter() - t0
    if not timeline:
        return Timeline("measured", cfg.label, {}, [], [], [], tracker.max_total, 0,
                        seconds=seconds)  # fmt: skip
    return _from_tracker(tracker, max(0, start - 1), top, cfg.label, error, seconds)


def _from_tracker(tracker, start: int, top: int, label: str, error: str, seconds: float):
    """A ``Timeline`` from the tracker's events from ``start`` on (the step's first state)."""
    # A step stopped by the budget ends at the allocation that crossed it (what the unwinding
    # freed afterwards is not part of the step).
    failed = tracker.failed_event if error and tracker.failed_event >= 0 else None
    events = tracker.events[start : None if failed is None else failed + 1]
    alive = {k: [e.alive[i] for e in events] for i, k in enumerate(CATEGORIES)}
    peaks = tracker.peaks()
    stop = tracker.peak_event if failed is None else failed
    return Timeline(
        source="measured",
        label=label,
        alive=alive,
        phase=[e.phase for e in events],
        micro=[e.micro for e in events],
        where=[e.module for e in events],
        peak=peaks.peak,
        peak_index=max(0, tracker.peak_event - start),
        maxima={k: getattr(peaks, k) for k in CATEGORIES},
        at_peak=live_tensors(tracker, stop, top),
        error=error,
        seconds=seconds,
    )


def live_tensors(tracker: CategoryTracker, index: int, top: int = 8) -> list[LiveTensor]:
    """The ``top`` largest storages alive after event ``index``, replayed from the events."""
    live: dict[int, tuple[str, int]] = {}
    for e in tracker.events[: index + 1]:
        if e.kind == "del":
            live.pop(e.tensor, None)
        else:
            live[e.tensor] = (e.category, e.nbytes)
    largest = sorted(live.items(), key=lambda kv: -kv[1][1])[:top]
    out = []
    for t, (category, nbytes) in largest:
        info = tracker.tensors[t]
        out.append(LiveTensor(category, nbytes, info.shape, info.dtype, info.created))
    return out


def predicted_timeline(cfg: RunConfig) -> Timeline:
    """The estimator's moments for ``cfg`` as a timeline (analytical families only)."""
    moments: list = []
    est = estimate(
        cfg.model, cfg.batch_size, cfg.seq_len, cfg.precision, cfg.optimizer,
        cfg.gradient_checkpointing, cfg.attn, cfg.grad_accum, cfg.device, moments=moments,
    )  # fmt: skip
    alive = {k: [0] * len(moments) for k in CATEGORIES}
    fixed = {"params": est.params, "buffers": est.buffers, "optimizer_state": est.optimizer_state}
    for i, m in enumerate(moments):
        for k, v in fixed.items():
            alive[k][i] = v
        alive["gradients"][i] = m.gradients
        alive["activations"][i] = m.activations
        alive["temporaries"][i] = m.temporaries
    labels = [m.label.split(": ", 1) for m in moments]
    totals = [m.total for m in moments]
    return Timeline(
        source="predicted",
        label=cfg.label,
        alive=alive,
        phase=[x[0] for x in labels],
        micro=[cfg.grad_accum] * len(moments),
        where=[x[1] if len(x) > 1 else "" for x in labels],
        peak=est.peak,
        peak_index=totals.index(max(totals)),
        maxima={k: getattr(est, k) for k in CATEGORIES if hasattr(est, k)},
    )


_LAYER = re.compile(r"(?:^|\.)(?:layer|layers|h|blocks)\.(\d+)(?:\.|$)")
_STAGE_LAYER = re.compile(r"^L(\d+)\.")


def _blocks(t: Timeline) -> list[str]:
    """Each point's block: "embed", "layer N", "head" or the phase itself (optimizer, outside)."""
    out, seen_layer, last = [], False, None
    for phase, where in zip(t.phase, t.where, strict=True):
        if phase != last:
            seen_layer, last = False, phase
        m = (_STAGE_LAYER if t.source == "predicted" else _LAYER).search(where)
        if phase not in ("forward", "backward"):
            out.append(phase)
        elif m:
            seen_layer = True
            out.append(f"layer {m.group(1)}")
        elif where in ("embed", "head", "loss") and t.source == "predicted":
            out.append("head" if where == "loss" else where)
        else:  # before the first layer or after the last, in the order the phase runs
            early = "embed" if phase == "forward" else "head"
            late = "head" if phase == "forward" else "embed"
            out.append(late if seen_layer else early)
    return out


def align(predicted: Timeline, measured: Timeline) -> list[float]:
    """An x position on ``measured``'s axis for each predicted moment, block by block.

    A moment of the forward in layer 1 lands inside the points where the measured step ran
    layer 1's forward (the last micro-batch's), spread evenly; a block the measurement never
    named falls back to its phase's span.
    """
    mblocks, pblocks = _blocks(measured), _blocks(predicted)
    last_micro = max(measured.micro, default=0)
    ranges: dict[tuple[str, str], list[int]] = {}
    for i, (p, b, m) in enumerate(zip(measured.phase, mblocks, measured.micro, strict=True)):
        if p != "optimizer step" and m != last_micro:
            continue
        for key in ((p, b), (p, "*")):
            r = ranges.setdefault(key, [i, i])
            r[1] = i
    xs: list[float] = []
    mtotal = measured.total
    groups: list[list[int]] = []
    for j, key in enumerate(zip(predicted.phase, pblocks, strict=True)):
        if groups and (predicted.phase[groups[-1][0]], pblocks[groups[-1][0]]) == key:
            groups[-1].append(j)
        else:
            groups.append([j])
    for g in groups:
        p, b = predicted.phase[g[0]], pblocks[g[0]]
        lo, hi = ranges.get((p, b)) or ranges.get((p, "*")) or (0, len(measured.phase) - 1)
        if len(g) == 1:  # one moment: where the measured block holds the most
            totals = mtotal[lo : hi + 1]
            xs.append(lo + totals.index(max(totals)))
        else:
            xs.extend(lo + (hi - lo) * (k + 1) / len(g) for k in range(len(g)))
    return xs


@dataclass
class OverheadResult:
    """Tracked step time with the timeline recorded, against without: interleaved rounds."""

    with_timeline: list[float]
    without: list[float]

    @property
    def ratios(self) -> list[float]:
        """With / without, round by round (each pair measured back to back)."""
        return [a / b for a, b in zip(self.with_timeline, self.without, strict=True)]

    @property
    def median_ratio(self) -> float:
        """The median of the rounds' ratios."""
        r = sorted(self.ratios)
        return r[len(r) // 2]


def timeline_overhead(cfg: RunConfig, rounds: int = 5) -> OverheadResult:
    """Time tracked steps with and without the timeline, alternating, in this process."""
    trainee = Trainee(cfg)
    for _ in range(max(1, cfg.warmup)):
        trainee.step()
    tracked_timeline(trainee, timeline=True)  # warm both paths once
    result = OverheadResult([], [])
    for i in range(2 * rounds):
        on = i % 2 == 0 if (i // 2) % 2 == 0 else i % 2 == 1  # ABBA order: drift cancels
        t = tracked_timeline(trainee, timeline=on).seconds
        (result.with_timeline if on else result.without).append(t)
    return result
