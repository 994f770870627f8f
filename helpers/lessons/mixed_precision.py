"""Lesson 05, sections 1, 5, 6 (notebooks/05_mixed_precision.ipynb).

Mixed precision: what each number format holds, a timed run on the learnable task, figures.

The formats are described by their bit counts alone, so tf32 (an NVIDIA tensor-core mode that
is not a torch dtype) gets the same row as fp32, fp16 and bf16.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from matplotlib.figure import Figure

from helpers.names import MiB
from helpers.progress import progress
from helpers.train import TrainResult, train_markov

# name: (exponent bits, explicit mantissa bits); one sign bit on top.
FORMAT_BITS = {"fp32": (8, 23), "tf32": (8, 10), "fp16": (5, 10), "bf16": (8, 7)}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FORMAT_COLORS = {"fp32": "#4C72B0", "tf32": "#64B5CD", "fp16": "#C44E52", "bf16": "#55A868"}


@dataclass(frozen=True)
class FloatFormat:
    """Range and precision of a binary floating-point format, from its bit counts."""

    name: str
    exponent_bits: int
    mantissa_bits: int

    @property
    def bits(self) -> int:
        """Sign + exponent + mantissa bits (tf32: 19, stored in 32-bit registers)."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        """Exponent bias: the stored exponent minus the bias is the power of two."""
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def max(self) -> float:
        """Largest finite value: all-ones mantissa at the largest exponent."""
        return (2 - 2.0**-self.mantissa_bits) * 2.0**self.bias

    @property
    def smallest_normal(self) -> float:
        """Smallest value with full precision."""
        return 2.0 ** (1 - self.bias)

    @property
    def smallest_subnormal(self) -> float:
        """Smallest non-zero value (fewer significant bits); half of it rounds to zero."""
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Gap between 1 and the next value: relative rounding error is at most eps / 2."""
        return 2.0**-self.mantissa_bits

    def as_row(self) -> dict:
        """The format as one table row, by column title (a serialiser, like ``as_dict``)."""
        return {
            "bits": self.bits,
            "exponent bits": self.exponent_bits,
            "mantissa bits": self.mantissa_bits,
            "max": self.max,
            "smallest normal": self.smallest_normal,
            "smallest subnormal": self.smallest_subnormal,
            "eps": self.eps,
        }


def float_format(name: str) -> FloatFormat:
    """The format by course name: fp32, tf32, fp16 or bf16."""
    if name not in FORMAT_BITS:
        raise ValueError(f"unknown format {name!r}: use one of {', '.join(FORMAT_BITS)}")
    return FloatFormat(name, *FORMAT_BITS[name])


def cpu_16bit_instructions() -> dict[str, bool] | None:
    """Whether this CPU has bf16 / fp16 arithmetic instructions (Linux flags); None if unknown.

    A mapping by precision name ({"bf16": ..., "fp16": ...}), looked up with the name of the
    precision at hand (``flags[precision]``).
    """
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return None
    return {
        "bf16": bool({"avx512_bf16", "amx_bf16"} & set(flags)),
        "fp16": bool({"avx512_fp16", "amx_fp16"} & set(flags)),
    }


def cpu_16bit_sentence(flags: Mapping[str, bool] | None) -> str:
    """``cpu_16bit_instructions()`` as a sentence a learner reads (which formats, which flags)."""
    if flags is None:
        return "This CPU's instruction flags could not be read (no /proc/cpuinfo here)."
    have = [p for p in ("bf16", "fp16") if flags[p]]
    lack = [p for p in ("bf16", "fp16") if not flags[p]]
    parts = []
    if have:
        parts.append(f"has {' and '.join(have)} arithmetic instructions")
    if lack:
        parts.append(f"has no {' or '.join(lack)} arithmetic instructions")
    return (
        f"This CPU {' but '.join(parts)} (Linux flags avx512_bf16/amx_bf16 and "
        "avx512_fp16/amx_fp16): a format without them runs its matmuls in slower emulation."
    )


def markov_runs(cfgs: Sequence, steps: int, lr: float | None = None) -> list[TrainResult]:
    """``helpers.train.train_markov`` of each RunConfig in turn, in this process (isolate it);
    ``lr`` replaces the optimizers' learning rate."""
    return [train_markov(cfg, steps, lr) for cfg in progress(cfgs, "training runs")]


def range_figure(names: Sequence[str], marks: Mapping[str, float] | None = None) -> Figure:
    """Each format's range on a log2 axis (subnormals light, normals dark), values marked."""
    fig = Figure(figsize=(8, 0.6 * len(names) + 1.8), layout="constrained")
    ax = fig.add_subplot()
    for row, name in enumerate(names):
        fmt = float_format(name)
        color = FORMAT_COLORS.get(name, "grey")
        lo, mid, hi = torch.tensor([fmt.smallest_subnormal, fmt.smallest_normal, fmt.max]).log2()
        ax.barh(row, float(mid - lo), left=float(lo), color=color, alpha=0.35, height=0.6)
        ax.barh(row, float(hi - mid), left=float(mid), color=color, height=0.6)
        ax.annotate(
            f"max {fmt.max:.3g}",
            (float(hi), row),
            xytext=(3, -4),
            textcoords="offset points",
            fontsize="small",
        )
    styles = ["--", ":", "-.", (0, (5, 1, 1, 1))]
    for i, (label, value) in enumerate((marks or {}).items()):
        x = float(torch.tensor(value, dtype=torch.float64).log2())
        ax.axvline(
            x,
            color="black",
            linestyle=styles[i % len(styles)],
            linewidth=1.2,
            label=f"{label} (2^{x:.1f})",
        )
    ax.set_yticks(range(len(names)), list(names))
    ax.invert_yaxis()
    ax.set_xlabel("log2 of the magnitude (light: subnormal, fewer significant bits)")
    ax.set_title("What each format can hold")
    ax.set_xlim(right=ax.get_xlim()[1] + 25)
    if marks:
        fig.legend(fontsize="small", loc="outside lower center", ncols=len(marks))
    return fig


def crossover_figure(
    batches: Sequence[int],
    fp32: Sequence[Mapping[str, int]],
    half: Sequence[Mapping[str, int]],
    half_name: str = "fp16",
) -> Figure:
    """Left: peaks vs batch size for fp32 and 16-bit; right: what 16-bit adds and saves."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.plot(batches, [m["peak"] / MiB for m in fp32], "o-", label="fp32 peak")
    left.plot(batches, [m["peak"] / MiB for m in half], "o-", label=f"{half_name} autocast peak")
    left.set_xlabel("batch size")
    left.set_ylabel("MiB (exact)")
    left.set_title("Peak memory of a training step")
    copies = [m["weight_copies"] / MiB for m in half]
    saved = [(a["activations"] - b["activations"]) / MiB for a, b in zip(fp32, half, strict=True)]
    peak_diff = [(b["peak"] - a["peak"]) / MiB for a, b in zip(fp32, half, strict=True)]
    right.plot(batches, copies, "s--", label="added: 16-bit weight copies")
    right.plot(batches, saved, "o--", label="saved: activations fp32 - 16-bit")
    right.plot(batches, peak_diff, "ko-", label=f"peak {half_name} - peak fp32")
    right.axhline(0, color="grey", linewidth=1)
    right.set_xlabel("batch size")
    right.set_ylabel("MiB")
    right.set_title("What 16-bit adds and saves")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(batches), [str(b) for b in batches])
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return fig


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def loss_figure(
    runs: Mapping[str, TrainResult],
    reference: str = "fp32",
    title: str = "The learnable task in each precision",
) -> Figure:
    """Left: loss curves and the task's best and uniform losses; right: minus ``reference``.

    Per-step losses of small batches are noisy, so both panels show a moving average over
    a thirtieth of the run (at least 1 step), named in the axis labels. Each precision has its
    colour; runs of one precision (section 8's optimizers) get a colour each.
    """
    precisions = [run.precision for run in runs.values()]
    by_run = len(set(precisions)) < len(precisions)
    fig = Figure(figsize=(11, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    styles = ["-", "--", ":", "-."]
    window = max(1, len(runs[reference].losses) // 30)
    base = moving_average(runs[reference].losses, window)
    for i, (name, run) in enumerate(runs.items()):
        steps = range(1, len(run.losses) + 1)
        smooth = moving_average(run.losses, window)
        style = {
            "label": name,
            "color": f"C{i}" if by_run else FORMAT_COLORS.get(run.precision),
            "linestyle": styles[i % len(styles)],
            "linewidth": 2.5 if i == 0 else 1.5,
        }
        left.plot(steps, smooth, **style)
        right.plot(steps, [a - b for a, b in zip(smooth, base, strict=True)], **style)
    first = runs[reference]
    for label, y in (
        ("best possible (entropy rate)", first.best_loss),
        ("uniform over the chain's states", first.uniform_loss),
    ):
        left.axhline(y, color="grey", linestyle="--", linewidth=1)
        left.annotate(label, (1, y), xytext=(0, 3), textcoords="offset points", fontsize="small")
    mean_of = f" (mean of {window} steps)" if window > 1 else ""
    left.set_ylabel(f"training loss, nats/token{mean_of}")
    left.set_title(title)
    right.set_ylabel(f"loss minus {reference}'s{mean_of}")
    right.set_title(f"Difference from {reference}, step by step")
    for ax in (left, right):
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    return fig
