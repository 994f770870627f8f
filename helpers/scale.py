"""One setting chooses model and data sizes: ``tiny`` for a CPU laptop or CI, ``full`` for a GPU.

The full scale adapts to the card it finds (``helpers.fullscale.fit_scale``): a 16 GB card
cannot hold everything an 80 GB one can, so its sizes and budget come from the estimator's
prediction of every experiment the lessons run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from helpers.device import default_device
from helpers.names import GiB, MiB, human_bytes

SCALE_ENV = "COURSE_SCALE"  # tiny | full | auto (default)


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

    def run_config(self, **overrides):
        """A ``helpers.train.RunConfig`` at this scale: the encoder, its batch, length, warm-up
        and repeats, with ``overrides`` on top (``model="decoder"`` picks the decoder)."""
        from helpers.train import RunConfig

        if overrides.get("model") in ("encoder", "decoder"):
            overrides["model"] = getattr(self, overrides["model"])
        sizes = dict(
            model=self.encoder, batch_size=self.batch_size, seq_len=self.seq_len,
            warmup=self.warmup, repeats=self.repeats,
        )  # fmt: skip
        return RunConfig(**{**sizes, **overrides})


# The full scale is the guides' experiment: bert-large, sequence length 512, batch 4, 16 GB budget;
# on a given card ``get_scale`` fits it (helpers.fullscale).
FULL = Scale("full", "bert-large", "llama-400m", 4, 512, 2, 5, 200, 16 * GiB, 8, 2048)
# The tiny scale keeps every notebook near a minute on 2 CPU cores. Its budget is scaled so that
# the same "what fits" stories hold: the tiny models' training states are a few MB.
TINY = Scale("tiny", "bert-tiny", "llama-tiny", 4, 64, 1, 3, 60, 64 * MiB, 8, 512)
SCALES = {"tiny": TINY, "full": FULL}


def get_scale(name: str | None = None, device: torch.device | None = None) -> Scale:
    """Scale from the argument, else $COURSE_SCALE, else auto: full on CUDA, tiny elsewhere.

    On a CUDA device the full scale is fitted to the card (``helpers.fullscale.fit_scale``);
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
    from helpers.device import gpu_info
    from helpers.fullscale import fit_scale

    return fit_scale(gpu_info(device), forced=asked == "full")
