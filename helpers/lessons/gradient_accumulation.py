"""Lesson 03, sections 2, 3, 5 (notebooks/03_gradient_accumulation.ipynb).

Gradient accumulation: padded causal-LM batches, the gradient errors' figure, timing
micro-batches. The technique (splitting a batch, accumulating gradients, counting targets,
the tolerance) is written in the notebook's cells; ``helpers.train.Trainee.step`` accumulates
``grad_accum`` micro-batches per optimizer step and ``helpers.isolate.run`` measures such steps.
"""

from __future__ import annotations

import torch
from matplotlib.figure import Figure

from helpers.plots import category_labels


def padded_causal_batch(
    lengths: list[int], seq_len: int, vocab_size: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random token rows right-padded to ``seq_len``: real tokens per row are ``lengths``.

    Padded positions get attention_mask 0 and label -100, the value the loss ignores. The
    batch is transformers' keyword inputs by name, as ``model(**batch)`` takes them.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (len(lengths), seq_len), generator=g)  # (B, S)
    real = torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]  # (B, S) bool
    return {
        "input_ids": ids.masked_fill(~real, 0),
        "attention_mask": real.long(),
        "labels": ids.masked_fill(~real, -100),
    }


def error_bars(errors: dict[str, float], tolerance: float, title: str = "") -> Figure:
    """Bars of gradient errors (fraction of max |g|) on a log axis, the tolerance as a line."""
    fig = Figure(figsize=(max(5, 1.2 * len(errors) + 2), 3.8), layout="constrained")
    ax = fig.add_subplot()
    floor = tolerance * 1e-3  # an exact match (error 0) still gets a visible stub
    values = [max(v, floor) for v in errors.values()]
    colors = ["#55A868" if v <= tolerance else "#C44E52" for v in errors.values()]
    rects = ax.bar(range(len(errors)), values, color=colors)
    ax.bar_label(rects, labels=[f"{v:.1e}" for v in errors.values()], fontsize="small")
    ax.axhline(tolerance, linestyle="--", color="grey", linewidth=1)
    ax.annotate("tolerance", (0, tolerance), textcoords="offset points", xytext=(0, 3),
                fontsize="small")  # fmt: skip
    ax.set_yscale("log")
    ax.set_ylim(top=10 * max(values))  # room above the tallest bar for its label
    ax.set_ylabel("max |difference| / max |g|")
    ax.set_title(title)
    category_labels(ax, list(errors))  # wrapped and slanted, so long run names do not overlap
    return fig


def throughput_groups_figure(
    groups: dict[str, dict[str, tuple[float, float, float]]],
    ylabel: str = "samples/s",
    title: str = "",
) -> Figure:
    """One panel per effective batch: samples/s of its splits (m×k), side by side.

    ``groups`` maps a panel title (an effective batch) to {split: (median, slowest, fastest)}:
    the median round and the range of the interleaved rounds, drawn as an error bar. Splits
    compare within a panel only, so each panel has its own y axis.
    """
    fig = Figure(figsize=(4.2 * len(groups) + 1, 3.8), layout="constrained")
    axes = fig.subplots(1, len(groups), squeeze=False)[0]
    for ax, (name, rates) in zip(axes, groups.items(), strict=True):
        medians = [r[0] for r in rates.values()]
        errors = [[m - r[1] for m, r in zip(medians, rates.values(), strict=True)],
                  [r[2] - m for m, r in zip(medians, rates.values(), strict=True)]]  # fmt: skip
        rects = ax.bar(range(len(rates)), medians, color="#4C72B0", yerr=errors, capsize=4,
                       ecolor="#333333")  # fmt: skip
        ax.bar_label(rects, labels=[f"{m:.3g}" for m in medians], fontsize="small",
                     label_type="center", color="white")  # fmt: skip
        category_labels(ax, list(rates))
        ax.set_title(name)
        ax.set_xlabel("split: micro-batch × accumulation steps", fontsize="small")
        ax.set_ylabel(ylabel)
    fig.suptitle(title)
    fig.supxlabel("bar: median round; line: slowest to fastest round", fontsize="x-small")
    return fig
