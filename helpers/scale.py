"""One setting chooses model and data sizes: ``tiny`` for a CPU laptop or CI, ``full`` for a GPU."""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from helpers.device import default_device

SCALE_ENV = "COURSE_SCALE"  # tiny | full | auto (default)

GiB = 1024**3
MiB = 1024**2


@dataclass(frozen=True)
class Scale:
    """Sizes a lesson uses; every lesson reads them from here instead of typing numbers."""

    name: str
    encoder: str  # bundled config name (see ``config_path``)
    decoder: str
    batch_size: int
    seq_len: int
    warmup: int  # untimed steps before measuring (optimizer state gets created here)
    repeats: int  # timed steps; the median is reported
    train_steps: int  # steps for the convergence experiments on the learnable task
    budget: int  # bytes of the pretend device ("this GPU has 16 GB")

    def describe(self, device: torch.device) -> str:
        """One line a learner reads first: what scale and device the numbers come from."""
        return (
            f"scale={self.name} on {device}: encoder={self.encoder}, decoder={self.decoder}, "
            f"batch={self.batch_size}, seq_len={self.seq_len}, budget={self.budget / GiB:.3g} GiB"
        )


# The full scale is the seeds' experiment: bert-large, sequence length 512, batch 4, 16 GB budget.
FULL = Scale("full", "bert-large", "llama-400m", 4, 512, 2, 5, 200, 16 * GiB)
# The tiny scale keeps every notebook near a minute on 2 CPU cores. Its budget is scaled so that
# the same "what fits" stories hold: the tiny models' training states are a few MB.
TINY = Scale("tiny", "bert-tiny", "llama-tiny", 4, 64, 1, 3, 60, 64 * MiB)
SCALES = {"tiny": TINY, "full": FULL}


def get_scale(name: str | None = None, device: torch.device | None = None) -> Scale:
    """Scale from the argument, else $COURSE_SCALE, else auto: full on CUDA, tiny elsewhere."""
    name = (name or os.environ.get(SCALE_ENV) or "auto").strip().lower()
    if name == "auto":
        device = device or default_device()
        name = "full" if device.type == "cuda" else "tiny"
    if name not in SCALES:
        raise ValueError(f"unknown scale {name!r}: use one of {sorted(SCALES)} or 'auto'")
    return SCALES[name]


def config_path(name: str) -> Path:
    """Path of a bundled transformers config JSON (``bert-tiny``, ``llama-7b``, ...)."""
    path = resources.files("helpers") / "configs" / f"{name}.json"
    if not path.is_file():
        known = sorted(p.name.removesuffix(".json") for p in (path.parent).iterdir())
        raise FileNotFoundError(f"no bundled config {name!r}; bundled: {', '.join(known)}")
    return Path(str(path))
