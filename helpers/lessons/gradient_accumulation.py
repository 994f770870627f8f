"""Lesson 03, sections 1, 2, 5 (notebooks/03_gradient_accumulation.ipynb).

Gradient accumulation: comparing gradients, padded causal-LM batches, timing micro-batches.

``helpers.train.Trainee.step`` accumulates ``grad_accum`` micro-batches per optimizer step and
``helpers.isolate.run`` measures such steps; this module adds what lesson 03 needs around them.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from helpers.results import Record

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

    Re-associating a sum of n floating-point numbers changes it by at most about n * eps times
    the magnitudes summed (the classical bound for recursive summation); the largest gradient
    entry stands in for that magnitude.
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


def error_bars(errors: dict[str, float], tolerance: float, title: str = ""):
    """Bars of gradient errors (fraction of max |g|) on a log axis, the tolerance as a line."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(5, 1.2 * len(errors) + 2), 3.8), layout="constrained")
    ax = fig.add_subplot()
    floor = tolerance * 1e-3  # an exact match (error 0) still gets a visible stub
    values = [max(v, floor) for v in errors.values()]
    colors = ["#55A868" if v <= tolerance else "#C44E52" for v in errors.values()]
    rects = ax.bar(list(errors), values, color=colors)
    ax.bar_label(rects, labels=[f"{v:.1e}" for v in errors.values()], fontsize="small")
    ax.axhline(tolerance, linestyle="--", color="grey", linewidth=1)
    ax.annotate("tolerance", (0, tolerance), textcoords="offset points", xytext=(0, 3),
                fontsize="small")  # fmt: skip
    ax.set_yscale("log")
    ax.set_ylabel("max |difference| / max |g|")
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=20)
    return fig


def throughput(cfg) -> Record:
    """Samples/s of ``cfg`` from untracked steps only (no memory view): a quicker ``measure``."""
    from helpers.hardware import hardware_report
    from helpers.timing import time_fn
    from helpers.train import Trainee

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
