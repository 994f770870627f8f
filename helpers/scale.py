"""One setting chooses model and data sizes: ``tiny`` for a CPU laptop or CI, ``full`` for a GPU.

The full scale adapts to the card it finds (``fit_scale``): a 16 GB card
cannot hold everything an 80 GB one can, so its sizes and budget come from the estimator's
prediction of every experiment the lessons run.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from functools import cache

import torch

from helpers.device import ASSUMED_CONTEXT, RESERVE_MARGIN, GpuInfo, default_device, gpu_info
from helpers.estimator import describe_model, estimate
from helpers.names import GiB, MiB, human_bytes
from helpers.train import RunConfig

SCALE_ENV = "COURSE_SCALE"  # tiny | full | auto (default)
BUDGET_STEP = 512 * MiB  # a fitted budget is a whole number of half-GiBs
LONG_SEQS = (2048, 1024, 512)  # lesson 10's whole-model sequence lengths, longest first


@dataclass(frozen=True)
class Scale:
    """Sizes a lesson uses; every lesson reads them from here instead of typing numbers."""

    name: str
    encoder: str  # bundled config name (see ``helpers.models.config_path``)
    decoder: str
    batch_size: int
    seq_len: int
    warmup: int  # untimed steps before measuring (optimizer state gets created here)
    repeats: int  # timed steps; the median is reported
    train_steps: int  # steps for the convergence experiments on the learnable task
    budget: int  # bytes of the pretend device ("this GPU has 16 GB")
    max_batch: int  # the largest micro-batch a batch sweep runs at seq_len (lessons 01-03)
    long_seq: int  # lesson 10's sequence length for whole models (attention dominates there)
    card: str = ""  # the GPU the sizes were fitted to (empty: not fitted to a card)
    notes: tuple[str, ...] = ()  # what was adapted for that card, and why

    def describe(self, device: torch.device) -> str:
        """What a learner reads first: what scale and device the numbers come from."""
        line = (
            f"scale={self.name} on {device}: encoder={self.encoder}, decoder={self.decoder}, "
            f"batch={self.batch_size}, seq_len={self.seq_len}, budget={human_bytes(self.budget)}"
        )
        if self.card:
            line += f"\nfitted to {self.card}"
        return "\n".join([line, *(f"  adapted: {note}" for note in self.notes)])

    def run_config(self, **overrides) -> RunConfig:
        """A ``helpers.train.RunConfig`` at this scale: the encoder, its batch, length, warm-up
        and repeats, with ``overrides`` on top (``model="decoder"`` picks the decoder)."""
        if overrides.get("model") in ("encoder", "decoder"):
            overrides["model"] = getattr(self, overrides["model"])
        sizes = dict(
            model=self.encoder, batch_size=self.batch_size, seq_len=self.seq_len,
            warmup=self.warmup, repeats=self.repeats,
        )  # fmt: skip
        return RunConfig(**{**sizes, **overrides})


# The full scale is the guides' experiment: bert-large, sequence length 512, batch 4, 16 GB budget;
# on a given card ``get_scale`` fits it (``fit_scale``).
FULL = Scale("full", "bert-large", "llama-400m", 4, 512, 2, 5, 200, 16 * GiB, 8, 2048)
# The tiny scale keeps every notebook near a minute on 2 CPU cores. Its budget is scaled so that
# the same "what fits" stories hold: the tiny models' training states are a few MB.
TINY = Scale("tiny", "bert-tiny", "llama-tiny", 4, 64, 1, 3, 60, 64 * MiB, 8, 512)
SCALES = {"tiny": TINY, "full": FULL}


def get_scale(name: str | None = None, device: torch.device | None = None) -> Scale:
    """Scale from the argument, else $COURSE_SCALE, else auto: full on CUDA, tiny elsewhere.

    On a CUDA device the full scale is fitted to the card (``fit_scale``);
    automatic selection picks the tiny scale, and says why, on a card too small for the
    guides' experiment.
    """
    asked = (name or os.environ.get(SCALE_ENV) or "auto").strip().lower()
    if asked not in (*SCALES, "auto"):
        raise ValueError(f"unknown scale {asked!r}: use one of {sorted(SCALES)} or 'auto'")
    if asked == "tiny":
        return TINY
    if device is None and name is None:
        device = default_device()
    if device is None or torch.device(device).type != "cuda":
        return FULL if asked == "full" else TINY
    return fit_scale(gpu_info(device), forced=asked == "full")


def model_info(model, attn: str = "eager"):
    """The estimator's model description, built once per model (dict configs by content)."""
    key = json.dumps(model, sort_keys=True) if isinstance(model, dict) else model
    return _described(key, attn)


@cache
def _described(key: str, attn: str):
    return describe_model(json.loads(key) if key.startswith("{") else key, attn)


def cuda_estimate(model, b: int, s: int, precision="fp32", optimizer="adamw", gc=False,
                  attn="eager", ga=1, **savers):  # fmt: skip
    """The estimator's CUDA numbers; ``savers``: lesson 16's (optimizer_in_backward, loss_chunk)."""
    return estimate(model_info(model, attn), b, s, precision, optimizer, gc, attn, ga,
                    device="cuda", **savers)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Fitting the full scale to a card (the estimator's CUDA branch predicts every experiment)


def _floor(nbytes: int, step: int = BUDGET_STEP) -> int:
    return nbytes // step * step


def _child_need(peak: int) -> int:
    """Card bytes for an experiment in a fresh process: two contexts and the allocator margin."""
    return 2 * ASSUMED_CONTEXT + int(peak * (1 + RESERVE_MARGIN))


def fit_scale(card: GpuInfo, forced: bool = False) -> Scale:
    """The full scale fitted to ``card`` (the tiny scale on a card too small for it).

    The budget is 16 GiB where the card has room for it beside the notebook's CUDA context,
    else the card less that room; the batch sweeps go to twice the batch only where batch
    8 of bert-large fits; lesson 10's long sequence is the longest that fits. A card that
    cannot run the guides' experiment itself gets the tiny scale unless ``forced``.
    """
    total, gib = card.total_memory, card.total_memory / GiB
    name = f"{card.name} ({gib:.1f} GiB)"
    budget = min(FULL.budget, _floor(total - 2 * ASSUMED_CONTEXT))
    notes = []
    if budget < FULL.budget:
        notes.append(
            f"budget {budget / GiB:.1f} GiB: the card less room for the notebook's CUDA "
            f"context (the guides' 16 GB does not fit a {gib:.1f} GiB card)"
        )
    base = cuda_estimate(FULL.encoder, FULL.batch_size, FULL.seq_len).peak
    if _child_need(base) > total:
        reason = (
            f"{name} is too small for the guides' experiment (bert-large, batch 4 x 512, fp32 "
            f"AdamW: {_child_need(base) / GiB:.1f} GiB with the CUDA contexts)"
        )
        if not forced:
            return replace(TINY, card=name, notes=(f"tiny scale on the GPU: {reason}",))
        notes.append(f"COURSE_SCALE=full forced: {reason}; expect out-of-memory records")
    double = 2 * FULL.batch_size
    needs = [cuda_estimate(m, double, FULL.seq_len).peak for m in (FULL.encoder, FULL.decoder)]
    max_batch = double if _child_need(max(needs)) <= total else FULL.batch_size
    if max_batch < double:
        notes.append(
            f"batch sweeps stop at {max_batch}: batch {double} of {FULL.encoder} needs "
            f"{_child_need(max(needs)) / GiB:.1f} GiB"
        )
    precision = "bf16" if card.capability >= (8, 0) else "fp32"
    b10 = max(1, FULL.batch_size // 2)
    fitting = [
        q for q in LONG_SEQS
        if _child_need(cuda_estimate(FULL.decoder, b10, q, precision).peak) <= total
    ]  # fmt: skip
    long_seq = fitting[0] if fitting else LONG_SEQS[-1]
    if long_seq < LONG_SEQS[0]:
        need = _child_need(cuda_estimate(FULL.decoder, b10, LONG_SEQS[0], precision).peak)
        notes.append(
            f"lesson 10 compares attention at {long_seq} tokens: {LONG_SEQS[0]} with eager "
            f"attention needs {need / GiB:.1f} GiB"
        )
    return replace(
        FULL, budget=budget, max_batch=max_batch, long_seq=long_seq, card=name, notes=tuple(notes)
    )
