"""Lesson 10, sections 1-5 (notebooks/10_sdpa_flash_attention.ipynb).

Attention written by hand, HF's eager version and PyTorch's SDPA backends, measured alike.

Every implementation takes queries, keys and values shaped (batch, heads, seq, head_dim) and
returns the attention output in that shape, so that memory, time and results compare directly.
The measuring functions build their own inputs from sizes, so they can run in a fresh process
(``helpers.isolate.call_isolated``) without shipping tensors across.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from helpers.device import bf16_native, gpu_info, is_cuda
from helpers.memory import CategoryTracker, allocator_baseline, allocator_growth
from helpers.plots import legend_outside, lines
from helpers.progress import progress
from helpers.timing import compare_calls

if TYPE_CHECKING:
    from helpers.timing import Comparison

# The SDPA backends by the names the lesson uses. cuDNN's kernel exists on recent NVIDIA GPUs.
BACKENDS = {
    "sdpa-math": SDPBackend.MATH,
    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
}
IMPLEMENTATIONS = ("manual", "hf-eager", *BACKENDS)
DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp64": torch.float64,
}


def hf_eager_attention(q, k, v, causal: bool = True) -> torch.Tensor:
    """transformers' own eager attention (the Llama one), with the additive mask HF builds."""
    # the modeling code: seconds, for this comparison only
    from transformers.models.llama.modeling_llama import eager_attention_forward

    mask = None
    if causal:  # HF adds a float mask: 0 where allowed, the dtype's minimum where not
        s_q, s_k = q.shape[-2], k.shape[-2]
        mask = torch.full((s_q, s_k), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device)
        mask = mask.triu(1)[None, None]
    module = SimpleNamespace(num_key_value_groups=1, training=True)
    out, _weights = eager_attention_forward(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)
    return out.transpose(1, 2)  # HF returns (b, s, h, d) for the output projection


def sdpa_attention(q, k, v, backend: str = "sdpa-flash", causal: bool = True) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` restricted to one backend (RuntimeError if it cannot)."""
    with sdpa_kernel([BACKENDS[backend]]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def attend(name: str, q, k, v, causal: bool = True, by_hand=None) -> torch.Tensor:
    """The attention output of implementation ``name`` (one of IMPLEMENTATIONS).

    "manual" is the attention written by hand, ``by_hand(q, k, v)`` (causal): lesson 10 writes
    it in a cell and hands it over here or in ``AttentionLayerConfig.by_hand``.
    """
    if name == "manual":
        if by_hand is None:
            raise ValueError(
                '"manual" runs the attention written by hand: pass by_hand=attention_by_hand '
                "(lesson 10, section 1)"
            )
        if not causal:
            raise ValueError("the attention written by hand is causal: use causal=True")
        return by_hand(q, k, v)
    if name == "hf-eager":
        return hf_eager_attention(q, k, v, causal)
    if name in BACKENDS:
        return sdpa_attention(q, k, v, name, causal)
    raise ValueError(f"unknown attention {name!r}: use one of {', '.join(IMPLEMENTATIONS)}")


def make_qkv(
    batch: int,
    heads: int,
    seq: int,
    head_dim: int,
    dtype=torch.float32,
    device="cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Random leaf q, k, v (requires_grad) and an output gradient, all (b, h, s, d)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq, head_dim)
    tensors = [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(4)]
    for t in tensors[:3]:
        t.requires_grad_(True)
    return tuple(tensors)


# SDPA's kernels by the header CUDA's SDPA warns with before listing why it refused them.
_REFUSAL_HEADERS = {
    "sdpa-efficient": "Memory efficient kernel",
    "sdpa-flash": "Flash attention kernel",
    "sdpa-cudnn": "CuDNN attention kernel",
}


def backend_problem(name: str, device="cpu", dtype=torch.float32, head_dim: int = 64):
    """None if ``name`` runs forward+backward here with this dtype, else why not (one line).

    When no allowed kernel can run, CUDA's SDPA warns "<kernel> not used because:" for each
    kernel, each header followed by one warning per reason, and then raises a generic error.
    The reasons under this backend's own header are the useful part, so they are kept.
    """
    q, k, v, grad = make_qkv(1, 2, 128, head_dim, dtype, device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            attend(name, q, k, v).backward(grad)
        except RuntimeError as err:
            first = str(err).strip().splitlines()[0]
            return "; ".join([first, *_refusal_reasons(caught, _REFUSAL_HEADERS.get(name))])
    return None


def _refusal_reasons(caught, header: str | None) -> list[str]:
    """SDPA's warnings grouped under their "... not used because:" headers, one line each.

    With ``header``, only that kernel's group if there is one; otherwise every group.
    """
    groups: dict[str, list[str]] = {}
    current = ""
    for w in caught:
        text = " ".join(str(w.message).split())
        if text.endswith("not used because:"):
            current = text.removesuffix(":")
            groups.setdefault(current, [])
        elif text:
            reasons = groups.setdefault(current, [])
            if text not in reasons:
                reasons.append(text)
    if header:
        mine = {k: v for k, v in groups.items() if k.startswith(header)}
        groups = mine or groups
    return [f"{k}: {', '.join(v)}" if k else ", ".join(v) for k, v in groups.items() if v]


def attention_dtype(device) -> torch.dtype:
    """fp32 on CPU (its flash kernel takes fp32); on GPUs bf16 where native, else fp16.

    The CUDA flash and memory-efficient kernels need 16 bits, and refuse bf16 below sm80.
    """
    if is_cuda(device):
        return torch.bfloat16 if bf16_native(device) else torch.float16
    return torch.float32


@dataclass(frozen=True)
class AttentionLayerConfig:
    """The attention layer the measuring functions build: sizes, number format, device, and the
    attention written by hand that "manual" runs."""

    batch: int
    heads: int
    head_dim: int
    dtype: str = "fp32"  # a key of DTYPES
    device: str = "cpu"  # a device name (a string, so the config travels to a fresh process)
    by_hand: Callable | None = None  # the "manual" attention (a cell's function travels by value)

    def qkv(self, seq: int) -> tuple[torch.Tensor, ...]:
        """``make_qkv`` at sequence length ``seq``: q, k, v and an output gradient."""
        device = torch.device(self.device)
        return make_qkv(self.batch, self.heads, seq, self.head_dim, DTYPES[self.dtype], device)


@dataclass
class LayerMemoryResult:
    """Bytes of one attention forward+backward at one sequence length."""

    peak: int  # everything created inside: saved tensors, scratch, the gradients
    activations: int  # created in forward (saved for backward or scratch)
    temporaries: int  # created in backward, q/k/v gradients included
    inputs: int  # q, k, v and the output gradient, made before tracking
    allocator: int | None  # the allocator's growth: everything, kernels' scratch too (GPU only)

    def categories(self) -> dict[str, int]:
        """The tracker's exact counts by category, for a Record's ``memory``."""
        return {
            "peak": self.peak,
            "activations": self.activations,
            "temporaries": self.temporaries,
            "inputs": self.inputs,
        }


def layer_memory(name: str, layer: AttentionLayerConfig, seq: int) -> LayerMemoryResult:
    """Exact bytes of one attention forward+backward (CategoryTracker); for call_isolated.

    One untracked forward+backward runs first: on a GPU it allocates what stays allocated
    for good (cuBLAS/cuDNN workspaces, the kernels' first-use buffers), which would otherwise
    add a constant to the smallest sizes and bend the fitted slope. The allocator's number is
    then measured from the baseline after it.
    """
    device = torch.device(layer.device)
    q, k, v, grad = layer.qkv(seq)
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v, grad))
    _forward_backward(name, q, k, v, grad, layer.by_hand)  # warm-up, see above
    q.grad = k.grad = v.grad = None
    baseline = allocator_baseline(device)
    tracker = CategoryTracker(device=device)
    with tracker:
        out = attend(name, q, k, v, by_hand=layer.by_hand)
        out.backward(grad)
        del out
    peaks = tracker.peaks()
    return LayerMemoryResult(
        peak=peaks.peak,
        activations=peaks.activations,
        temporaries=peaks.temporaries,
        inputs=inputs,
        allocator=allocator_growth(device, baseline),
    )


def _forward_backward(name: str, q, k, v, grad, by_hand=None) -> None:
    """One forward and backward of the attention, the inputs' gradients reset first."""
    q.grad = k.grad = v.grad = None
    attend(name, q, k, v, by_hand=by_hand).backward(grad)


def layer_memories(
    name: str, layer: AttentionLayerConfig, seqs: list[int]
) -> list[LayerMemoryResult]:
    """``layer_memory`` for each sequence length (one implementation; call it isolated).

    A fresh tracker per length makes each number exact on its own, and no other
    implementation's cached buffers share the process.
    """
    return [layer_memory(name, layer, s) for s in progress(seqs, f"{name} memory", unit="length")]


def layer_time_rounds(
    names: list[str],
    layer: AttentionLayerConfig,
    seqs: list[int],
    warmup: int = 1,
    rounds: int = 5,
    claims=(),
) -> dict[int, Comparison]:
    """Forward+backward of every implementation, timed in turns at each sequence length.

    {sequence length: ``helpers.timing.Comparison``}: at each length the implementations'
    inputs are made once and their calls alternate round by round (``compare_calls``), so a
    slow spell of the machine hits every implementation alike. ``claims`` are decided at the
    longest length (more rounds while undecided).
    """
    device = torch.device(layer.device)
    out = {}
    for seq in progress(seqs, "timing lengths", unit="length"):
        calls = {n: partial(_forward_backward, n, *layer.qkv(seq), layer.by_hand) for n in names}
        out[seq] = compare_calls(calls, device, warmup=warmup, rounds=rounds,
                                 claims=claims if seq == seqs[-1] else ())  # fmt: skip
    return out


@dataclass
class OutputErrorsResult:
    """How far each implementation's output is from the exact (fp64) attention."""

    errors: dict[str, float]  # largest |output - exact| by implementation name
    max_v: float  # max|v|: no output element can exceed it (a softmax average of values)


def output_errors(
    names,
    seq: int,
    head_dim: int,
    dtype: torch.dtype,
    device="cpu",
    heads: int = 4,
    causal: bool = True,
    by_hand=None,
) -> OutputErrorsResult:
    """Largest |output - exact| per implementation, exact = the attention of the same inputs in
    fp64 (SDPA's math backend: the formula one operation at a time).

    The inputs are rounded to ``dtype`` first and the reference is computed from those
    rounded values, so the errors are the implementations' own arithmetic, nothing else.
    ``by_hand`` is the attention written by hand, for "manual".
    """
    q, k, v, _ = make_qkv(1, heads, seq, head_dim, dtype, device, seed=1)
    with torch.no_grad():
        exact = sdpa_attention(*(t.double().cpu() for t in (q, k, v)), "sdpa-math", causal)
        errors = {}
        for name in names:
            out = attend(name, q, k, v, causal, by_hand).double().cpu()
            errors[name] = (out - exact).abs().max().item()
    return OutputErrorsResult(errors, v.abs().max().item())


def flash_attn_2_problem(device) -> str | None:
    """None when transformers can use the flash-attn package here, else why not."""
    from transformers.utils import is_flash_attn_2_available  # no transformers until asked

    device = torch.device(device)
    if not is_cuda(device):
        return f"flash_attention_2 needs an NVIDIA GPU; this is {device.type}"
    if gpu_info(device).capability < (8, 0):
        return "flash_attention_2 needs compute capability 8.0+ (Ampere or newer)"
    if not is_flash_attn_2_available():
        return "the flash-attn package is not installed (pip install flash-attn)"
    return None


def power_law_figure(xs, series: dict, ylabel: str, title: str = "", ranges: dict | None = None):
    """Log-log lines against sequence length, with guides of slope 2 (dashed) and 1 (dotted).

    The guides are offset from the data so no series hides them: at the longest length, where
    a power law shows best, the s² guide ends a factor ``GUIDE_OFFSET`` above the highest
    series and the s guide that factor below the lowest one; each is labelled at its end.
    ``ranges``: per series, (low, high) per point, drawn as error bars (for times: the slowest
    and the fastest of the rounds).
    """
    if not series:
        raise ValueError(
            f"nothing to plot for {ylabel!r}: no implementation ran on this device (each one's "
            "reason is printed above the table)"
        )
    fig = lines(xs, series, "sequence length s", ylabel, title, logy=True, ranges=ranges)
    fig.set_size_inches(7.5, 4)
    ax = fig.axes[0]
    xs = np.asarray(xs, float)
    lasts = [ys[-1] for ys in series.values()]
    guides = (
        (2, max(lasts) * GUIDE_OFFSET, "--", "#444444", "∝ s²"),
        (1, min(lasts) / GUIDE_OFFSET, ":", "#777777", "∝ s"),
    )
    for slope, end, style, color, text in guides:
        guide = end * (xs / xs[-1]) ** slope
        ax.plot(xs, guide, linestyle=style, color=color, linewidth=1.5, label=f"{text} guide")
        ax.annotate(text, (xs[-1], guide[-1]), xytext=(5, 0), textcoords="offset points",
                    va="center", ha="left", color=color, fontsize="small")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlim(xs[0] / 1.15, xs[-1] * 1.4)  # room for the guides' labels on the right
    ax.set_xticks(xs, [str(int(x)) for x in xs])
    ax.minorticks_off()
    handles = [h for h, lab in zip(*ax.get_legend_handles_labels(), strict=True)
               if not lab.endswith(" guide")]  # fmt: skip
    # Implementations of one family lie on top of each other: open markers of decreasing
    # size and different shapes keep every one of them visible.
    for i, handle in enumerate(handles):
        line = handle[0] if isinstance(handle, tuple) else handle  # errorbar: (line, ...)
        line.set_marker("osD^vP"[i % 6])
        line.set_markersize(max(4.0, 10.0 - 1.2 * i))
        line.set_markerfacecolor("none")
    legend_outside(ax, handles=handles)  # the series; the guides carry their own labels
    return fig


# How far the guides sit from the data (a factor on the log axis), so that neither is hidden
# under a series of the same slope.
GUIDE_OFFSET = 2.5
