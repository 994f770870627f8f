"""Lesson 04, sections 1, 2, 5, 7 (notebooks/04_gradient_checkpointing.ipynb).

Activation (gradient) checkpointing: a plain-PyTorch block stack, its memory, paired timing.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from helpers.isolate import call_isolated
from helpers.memory import saved_for_backward
from helpers.models import disable_checkpointing, enable_checkpointing
from helpers.plots import legend_outside, plain_ticks
from helpers.timing import Comparison, Disturbance, time_once
from helpers.train import Trainee, autocast_context


class Block(nn.Module):
    """Pre-norm residual MLP block x + drop(fc2(gelu(fc1(norm(x))))), like a transformer's FFN."""

    def __init__(self, width: int, expansion: int = 1, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, expansion * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(expansion * width, width)
        self.drop = nn.Dropout(dropout)
        self.calls = 0  # eager forward calls, to see the recomputation happen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # compiled, the count would force a recompile
            self.calls += 1
        return x + self.drop(self.fc2(self.act(self.fc1(self.norm(x)))))


def block_stack(
    n_blocks: int, width: int, expansion: int = 1, dropout: float = 0.0, seed: int = 0
) -> nn.Sequential:
    """``n_blocks`` Blocks in an nn.Sequential, initialised from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(*(Block(width, expansion, dropout) for _ in range(n_blocks)))


# The loss the lesson's cell writes: (stack, x, budget) -> the stack's loss on x, with the
# stack compiled under that activation memory budget (section 7).
BudgetLoss = Callable[[nn.Sequential, torch.Tensor, float], torch.Tensor]


@dataclass
class BudgetRun:
    """One measured forward and backward of a Block stack (``budget_sweep``)."""

    saved_bytes: int  # saved for backward: each storage once, the weights and the input left out
    backward_flops: int  # the backward pass's FLOPs, recomputed forward operations included
    # The parameters' gradients in ``parameters()`` order, as numpy arrays: a tensor sent from
    # a fresh process would share memory with that process, which ends.
    grads: list[np.ndarray]


def budget_sweep(
    n_blocks: int,
    width: int,
    rows: int,
    budgets: list[float],
    loss_fn: BudgetLoss,
    seed: int = 0,
) -> dict[float | None, BudgetRun]:
    """Section 1's Block stack (no dropout) eager (key None, the lesson's loss
    ``stack(x).square().mean()``) and through ``loss_fn`` at each budget, from the same weights
    and input. Each starts from a fresh dynamo state (``torch._dynamo.reset``: a compiled
    graph is reused, budget and all, until then); its first step compiles, the second is
    measured: the bytes saved for backward and the backward pass's FLOPs."""
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    out = {}
    for budget in (None, *budgets):
        torch._dynamo.reset()
        stack = block_stack(n_blocks, width, seed=seed)

        def loss(stack=stack, budget=budget) -> torch.Tensor:
            return stack(x).square().mean() if budget is None else loss_fn(stack, x, budget)

        loss().backward()  # compiles
        stack.zero_grad(set_to_none=True)
        value, saved = saved_for_backward(loss, [*stack.parameters(), x])
        with FlopCounterMode(display=False) as counter:
            value.backward()
        grads = [p.grad.numpy().copy() for p in stack.parameters()]
        out[budget] = BudgetRun(saved, counter.get_total_flops(), grads)
    return out


def segments_figure(
    counts: list[int],
    predicted: list[float],
    measured: list[float],
    peaks: list[float],
    s_star: float,
    title: str = "",
) -> Figure:
    """Memory against the number of ``checkpoint_sequential`` segments, in units of one block
    input: the arithmetic (dashed), the measured activations and the measured peak; s* dotted."""
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(counts, peaks, marker="o", color="#C44E52", label="measured peak, everything tracked")
    ax.plot(counts, measured, marker="o", color="#8172B2", label="measured activations")
    ax.plot(counts, predicted, linestyle="--", color="black", linewidth=1, zorder=3,
            label="predicted (s-1)c + (N/s)(a+c) + loss input")  # fmt: skip
    ax.axvline(s_star, color="grey", linestyle=":", linewidth=1,
               label=f"s* = sqrt(N(a+c)/c) = {s_star:.1f}")  # fmt: skip
    ax.set_xscale("log", base=2)
    plain_ticks(ax, counts)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("segments (checkpoint_sequential)")
    ax.set_ylabel("memory / size of one block input")
    ax.grid(alpha=0.3)
    legend_outside(ax)
    ax.set_title(title)
    return fig


@dataclass
class PairedTimingResult:
    """Step times of the same training run without and with checkpointing, measured in turns."""

    # Seconds of every pair: a plain optimizer step, a checkpointed one, one plain forward.
    every_plain: list[float] = field(default_factory=list)
    every_checkpointed: list[float] = field(default_factory=list)
    every_forward: list[float] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)  # the pairs no other process disturbed
    left_out: dict[str, int] = field(default_factory=dict)  # pairs others disturbed, by reason
    others: list[float] = field(default_factory=list)  # cores others used, each pair
    args: tuple = ()  # paired_step_times' arguments: how to measure again

    def _pairs(self, times: list[float]) -> list[float]:
        """The undisturbed pairs' times (all of them where fewer than 3 were undisturbed)."""
        return [times[i] for i in self.kept] if len(self.kept) >= 3 else list(times)

    @property
    def plain(self) -> list[float]:
        """Seconds per plain optimizer step, pair by pair."""
        return self._pairs(self.every_plain)

    @property
    def checkpointed(self) -> list[float]:
        """Seconds per checkpointed optimizer step, pair by pair."""
        return self._pairs(self.every_checkpointed)

    @property
    def forward(self) -> list[float]:
        """Seconds of one forward of the plain model, pair by pair."""
        return self._pairs(self.every_forward)

    @property
    def ratios(self) -> list[float]:
        """Checkpointed / plain step time, pair by pair."""
        return [c / p for c, p in zip(self.checkpointed, self.plain, strict=True)]

    @property
    def slowdown(self) -> float:
        """Median of the per-pair ratios minus 1: the fraction of step time checkpointing adds."""
        return statistics.median(self.ratios) - 1.0

    @property
    def extra_over_forward(self) -> float:
        """Median extra step time divided by the median forward time."""
        extra = statistics.median(c - p for c, p in zip(self.checkpointed, self.plain, strict=True))
        return extra / statistics.median(self.forward)

    def comparison(self):
        """The rounds as a ``helpers.timing.Comparison``: plain, checkpointed, forward, and
        "extra" (checkpointed minus plain, round by round), for claims on per-round ratios.
        A claim it decides the wrong way is measured again in a fresh process (``again``)."""

        def pairs(indices) -> dict[str, list[float]]:
            plain = [self.every_plain[i] for i in indices]
            ckpt = [self.every_checkpointed[i] for i in indices]
            extra = [c - p for c, p in zip(ckpt, plain, strict=True)]
            return {"plain": plain, "checkpointed": ckpt, "extra": extra,
                    "forward": [self.every_forward[i] for i in indices]}  # fmt: skip

        def again() -> Comparison:
            return call_isolated(paired_step_times, *self.args).unwrap().comparison()

        aside = [i for i in range(len(self.every_plain)) if i not in self.kept]
        return Comparison.of(pairs(self.kept), pairs(aside), left_out=dict(self.left_out),
                             others=list(self.others),
                             again=again if self.args else None)  # fmt: skip


def paired_step_times(cfg, repeats: int = 20) -> PairedTimingResult:
    """Time ``cfg`` without and with checkpointing in alternating steps, in this process.

    One model and one optimizer take every step; checkpointing is switched on and off
    between steps (transformers' ``activation_checkpointing_enable`` / ``_disable``), so the
    two variants share weights and memory instead of needing two models on the device.
    Steps alternate in ABBA order so that a slow drift of the machine (other processes,
    clock changes) weighs on both alike; the per-pair ratio then cancels most of it.
    """
    trainee = Trainee(replace(cfg, gradient_checkpointing=False))
    model, device = trainee.model, trainee.device

    def timed(fn) -> float:
        return time_once(fn, device)

    def step(checkpointed: bool) -> float:
        (enable_checkpointing if checkpointed else disable_checkpointing)(model)
        return timed(trainee.step)

    def forward() -> None:
        batch = trainee.batch()
        with autocast_context(cfg.precision, device):
            model(**batch).loss.detach()

    for _ in range(max(1, cfg.warmup)):
        step(False)
        step(True)
    out = PairedTimingResult(args=(cfg, repeats))
    watch = Disturbance(into=out)  # a pair other processes disturbed is left out
    for i in range(2 * repeats):  # until ``repeats`` undisturbed pairs, at most twice as many
        if len(out.kept) >= repeats or watch.too_busy(i, len(out.kept), repeats):
            break
        order = (False, True) if i % 2 == 0 else (True, False)
        with watch.round():
            times = {checkpointed: step(checkpointed) for checkpointed in order}
            disable_checkpointing(model)
            forward_s = timed(forward)
        if not watch.set_aside():
            out.kept.append(len(out.every_plain))
        out.every_plain.append(times[False])
        out.every_checkpointed.append(times[True])
        out.every_forward.append(forward_s)
    return out
