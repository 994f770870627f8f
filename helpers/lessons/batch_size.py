"""Lesson 02, sections 1-4 (notebooks/02_batch_size.ipynb).

Batch size: searching for the largest batch that fits, and how matrix shapes set the speed.

accelerate's ``find_executable_batch_size`` (and the Trainer's ``auto_find_batch_size``, built
on it) retries with a smaller batch only when ``should_reduce_batch_size`` recognises the
exception, and it recognises an out-of-memory error by its *message* (" out of memory." for
CUDA), not by its type. The course's CPU budget raises ``torch.OutOfMemoryError`` with a message
of its own: the functions here make it an exception accelerate recognises, and nothing else
(for a fresh-process run's failure record, the notebook's ``raise_if_oom`` does the same).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from matplotlib.figure import Figure

from helpers.isolate import call_isolated
from helpers.memory import CategoryTracker, memory_budget
from helpers.names import MiB, human_bytes
from helpers.plots import legend_outside, plain_ticks
from helpers.timing import Comparison, Disturbance, time_fn

# The phrase accelerate.utils.should_reduce_batch_size looks for in a CUDA/XPU OOM message.
OOM_PHRASE = " out of memory."


def recognised_tracker(budget: int | None = None, device: torch.device | None = None):
    """A budgeted ``CategoryTracker`` whose OOM message accelerate's search recognises.

    Without module hooks: they keep the autograd graph of a forward that raised alive (its
    backward hooks and the graph reference each other), so every retry after an OOM would
    start with the failed attempt's activations still counted; and they refuse a second
    forward of the root module (the next step). A search needs only byte totals.
    """
    return CategoryTracker(budget, device, module_hooks=False, oom_prefix=f"budget{OOM_PHRASE} ")


@contextlib.contextmanager
def recognised_budget(nbytes: int, *tracked, device: torch.device):
    """``memory_budget`` whose OOM, on every device, makes accelerate retry with a smaller batch.

    On CUDA the allocator cap raises CUDA's own OOM, which accelerate already recognises.
    Elsewhere everything created inside the block, plus ``tracked``, counts against ``nbytes``.
    """
    if device.type == "cuda":
        with memory_budget(nbytes, device=device):
            yield None
        return
    tracker = recognised_tracker(budget=nbytes, device=device)
    tracker.track_external(*tracked)
    with tracker:
        yield tracker


@dataclass
class MatmulTimingResult:
    """Median seconds and achieved TFLOP/s of an n x n by n x n matmul, per size n."""

    dtype: str
    seconds: dict[int, float] = field(default_factory=dict)
    tflops: dict[int, float] = field(default_factory=dict)
    spread: dict[int, float] = field(default_factory=dict)  # (max - min) / median of the repeats
    rounds: dict[int, list[float]] = field(default_factory=dict)  # seconds per matmul, per round
    aside_rounds: dict[int, list[float]] = field(default_factory=dict)  # rounds set aside
    left_out: dict[str, int] = field(default_factory=dict)  # rounds others disturbed, by reason
    others: list[float] = field(default_factory=list)  # cores others used, each round
    args: tuple = ()  # matmul_timing's arguments: how to measure again

    def groups(self, groups: dict[str, Sequence[int]], best: bool = False):
        """A ``helpers.timing.Comparison`` of groups of sizes: per round, the median (``best``:
        the lowest) seconds per FLOP over the group's sizes, so that groups compare by speed.
        A claim it decides the wrong way is measured again in a fresh process (``again``)."""
        pick = min if best else statistics.median

        def per_round(rounds: dict[int, list[float]]) -> dict[str, list[float]]:
            n_rounds = min((len(t) for t in rounds.values()), default=0)
            return {name: [pick(rounds[n][r] / (2 * n**3) for n in sizes) for r in range(n_rounds)]
                    for name, sizes in groups.items()}  # fmt: skip

        def again() -> Comparison:
            return call_isolated(matmul_timing, *self.args).unwrap().groups(groups, best)

        return Comparison.of(per_round(self.rounds), per_round(self.aside_rounds),
                             left_out=dict(self.left_out), others=list(self.others),
                             again=again if self.args else None)  # fmt: skip


def _matmul_rounds(call, sizes, dev, repeats: int, out: MatmulTimingResult):
    """Rounds that time every size once, until ``repeats`` rounds no other process disturbed
    are kept (at most twice as many tried); every round's seconds, the kept ones', which."""
    every: dict[int, list[float]] = {n: [] for n in sizes}
    kept: dict[int, list[float]] = {n: [] for n in sizes}
    mask: list[bool] = []  # each round: kept (True) or set aside
    watch = Disturbance(into=out)
    for attempt in range(2 * repeats):
        if len(kept[sizes[0]]) >= repeats or watch.too_busy(attempt, sum(mask), repeats):
            break
        with watch.round():
            row = {n: time_fn(call(n), dev, warmup=0, repeats=1).times for n in sizes}
        mask.append(not watch.set_aside())
        for n, t in row.items():
            every[n] += t
            if mask[-1]:
                kept[n] += t
    return every, kept, mask


def matmul_timing(
    sizes: Sequence[int],
    dtype: str,
    device: str,
    warmup: int = 3,
    repeats: int = 15,
    inner: int = 1,
) -> MatmulTimingResult:
    """Time n x n matmuls per size (``inner`` back to back per timed call), sizes interleaved.

    Each round times every size once, so a slow spell of the machine hits all sizes alike; a
    round in which other processes took more than a share of a core is left out.
    """
    dev = torch.device(device)
    torch_dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    pairs = {
        n: (torch.randn(n, n, generator=g).to(dev, torch_dtype),
            torch.randn(n, n, generator=g).to(dev, torch_dtype))
        for n in sizes
    }  # fmt: skip

    def call(n: int) -> Callable[[], None]:
        """The timed call for size ``n``."""
        a, b = pairs[n]

        def run() -> None:
            """``inner`` matmuls of the size's pair, back to back."""
            for _ in range(inner):
                torch.mm(a, b)

        return run

    for n in sizes:  # warm-up, untimed: kernel selection, caches, clocks
        time_fn(call(n), dev, warmup=warmup, repeats=1)
    out = MatmulTimingResult(dtype, args=(list(sizes), dtype, device, warmup, repeats, inner))
    every, kept, kept_mask = _matmul_rounds(call, sizes, dev, repeats, out)
    for n in sizes:
        ts = kept[n] if len(kept[n]) >= 3 else every[n]  # the medians: undisturbed rounds
        median = statistics.median(ts) / inner
        out.seconds[n] = median
        out.tflops[n] = 2 * n**3 / median / 1e12
        out.spread[n] = (max(ts) - min(ts)) / (median * inner)
        out.rounds[n] = [t / inner for t in kept[n]]  # the claims: undisturbed rounds only
        out.aside_rounds[n] = [t / inner for t, k in zip(every[n], kept_mask, strict=True) if not k]
    return out


def throughput_memory_figure(
    batches: Sequence[int],
    samples_per_s: Sequence[float],
    peak_bytes: Sequence[int],
    budget: int | None = None,
    found: int | None = None,
    title: str = "",
    ranges: Sequence[tuple[float, float]] | None = None,
) -> Figure:
    """Two panels against batch size: samples/s, and the exact peak (MiB) with the budget line.

    ``ranges``: samples/s of the slowest and the fastest interleaved round per batch size.
    """
    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    if ranges:
        low = [v - lo for v, (lo, _) in zip(samples_per_s, ranges, strict=True)]
        high = [hi - v for v, (_, hi) in zip(samples_per_s, ranges, strict=True)]
        left.errorbar(batches, samples_per_s, yerr=[low, high], marker="o", capsize=3,
                      color="#4C72B0")  # fmt: skip
    else:
        left.plot(batches, samples_per_s, marker="o", color="#4C72B0")
    left.set_ylabel("samples / s (median round)")
    right.plot(batches, [p / MiB for p in peak_bytes], marker="o", color="#C44E52", label="peak")
    if budget is not None:
        right.axhline(budget / MiB, linestyle="--", color="grey", label="budget")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(batches), [str(b) for b in batches])
        ax.set_xlabel("batch size")
        ax.grid(alpha=0.3)
        if found is not None:
            ax.axvline(found, color="#55A868", linewidth=1, label=f"found: {found}")
    right.set_yscale("log")
    plain_ticks(right)
    right.set_ylabel("peak MiB (exact, tracked)")
    legend_outside(right)
    if budget is not None:
        right.set_title(f"budget {human_bytes(budget)}", fontsize="small")
    fig.suptitle(title)
    return fig


def matmul_figure(timing: MatmulTimingResult, title: str = "") -> Figure:
    """Achieved TFLOP/s per matmul size, coloured by alignment: multiple of 64, of 8, or neither.

    Square sizes change M, N and K at once: the rule for layer widths, not for the batch size
    (which changes M, the rows, alone).
    """
    from matplotlib.patches import Patch  # slow: only figures need it

    fig = Figure(figsize=(7, 3.5), layout="constrained")
    ax = fig.add_subplot()
    sizes = list(timing.tflops)
    palette = {64: ("#4C72B0", "multiple of 64"), 8: ("#8FB3E0", "multiple of 8"),
               1: ("#BBBBBB", "neither")}  # fmt: skip
    groups = [64 if n % 64 == 0 else 8 if n % 8 == 0 else 1 for n in sizes]
    ax.bar([str(n) for n in sizes], list(timing.tflops.values()),
           color=[palette[g][0] for g in groups])  # fmt: skip
    ax.legend(handles=[Patch(color=c, label=lab) for c, lab in palette.values()],
              fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))  # fmt: skip
    ax.set_xlabel("n (an n x n times n x n matmul: M, N and K all change)")
    ax.set_ylabel(f"TFLOP/s achieved ({timing.dtype})")
    ax.tick_params(axis="x", labelrotation=90)
    ax.set_title(title)
    return fig
