"""Lesson 03, sections 1, 2, 5 (notebooks/03_gradient_accumulation.ipynb).

Gradient accumulation: comparing gradients, padded causal-LM batches, timing micro-batches.

``helpers.train.Trainee.step`` accumulates ``grad_accum`` micro-batches per optimizer step and
``helpers.isolate.run`` measures such steps; this module adds what lesson 03 needs around them.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from matplotlib.figure import Figure

from helpers.hardware import hardware_report
from helpers.plots import category_labels
from helpers.results import Record
from helpers.timing import time_fn
from helpers.train import Trainee

FP32_EPS = torch.finfo(torch.float32).eps  # 2**-23: the spacing of fp32 numbers near 1


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    """All parameter gradients of ``model`` as one fp32 vector (zeros where a grad is None).

    The vector lives on the CPU: lesson 03 keeps several to compare, which at the full scale
    (1.3 GB each for bert-large) would crowd a 16 GB GPU that its experiments need.
    """
    parts = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).float()
        for p in model.parameters()
        if p.requires_grad
    ]
    return torch.cat(parts).cpu()


def reorder_tolerance(reference: torch.Tensor, n_terms: int) -> float:
    """Absolute tolerance for a sum of ``n_terms`` fp32 numbers computed in another order.

    A heuristic, not a bound: the classical worst-case bound for recursive summation is about
    (n - 1) * u * sum(|x_i|) (Higham, "Accuracy and Stability of Numerical Algorithms", ch. 4),
    which needs every term's magnitude. Here n * eps times the largest gradient entry stands in
    for it; with cancellation that entry can be smaller than sum(|x_i|).
    """
    return n_terms * FP32_EPS * float(reference.abs().max())


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference between two gradient vectors, as a fraction of max |b|."""
    return float((a - b).abs().max() / b.abs().max())


def split(batch: dict[str, torch.Tensor], micro: int) -> list[dict[str, torch.Tensor]]:
    """The rows of ``batch`` cut into consecutive micro-batches of ``micro`` rows.

    A batch is transformers' keyword inputs by name (``model(**batch)``), so it stays a dict.
    """
    rows = len(next(iter(batch.values())))
    return [{k: v[i : i + micro] for k, v in batch.items()} for i in range(0, rows, micro)]


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


def target_count(labels: torch.Tensor) -> int:
    """Tokens a causal LM is scored on: labels shifted by one, -100 excluded."""
    return int((labels[..., 1:] != -100).sum())


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


def throughput(cfg) -> Record:
    """Samples/s of ``cfg`` from untracked steps only (no memory view): a quicker ``measure``."""
    t0 = time.perf_counter()
    trainee = Trainee(replace(cfg, flops=False))
    timing = time_fn(trainee.step, trainee.device, warmup=max(1, cfg.warmup), repeats=cfg.repeats)
    samples = cfg.batch_size * cfg.grad_accum
    return Record(
        config=cfg.as_dict(),
        device=hardware_report(trainee.device).as_dict(),
        n_params=trainee.n_params,
        step_time=timing.median,
        step_times=timing.times,
        samples_per_s=samples / timing.median,
        tokens_per_s=samples * cfg.seq_len / timing.median,
        losses=trainee.losses,
        wall_s=time.perf_counter() - t0,
    )


def naive_and_token_errors(
    model: torch.nn.Module, rows: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Errors of two accumulations of ``rows``, one row per micro-batch, against the whole batch.

    "naive": each micro-batch's mean loss divided by the number of micro-batches; "token-
    weighted": each micro-batch's loss summed and divided by the targets of the whole batch
    (transformers' ``num_items_in_batch``). Errors are ``max_error``: a fraction of max |g|.
    """
    model.zero_grad(set_to_none=True)
    model(**rows).loss.backward()
    big = flat_grad(model)
    parts = split(rows, 1)
    n_total = target_count(rows["labels"])
    out = {}
    schemes = [("naive", {}, 1 / len(parts)),
               ("token-weighted", {"num_items_in_batch": n_total}, 1.0)]  # fmt: skip
    for name, kwargs, scale in schemes:
        model.zero_grad(set_to_none=True)
        for part in parts:
            (model(**part, **kwargs).loss * scale).backward()
        out[name] = max_error(flat_grad(model), big)
    model.zero_grad(set_to_none=True)
    return out


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
