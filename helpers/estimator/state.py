"""Parameters, gradients and optimizer state: the bytes that live through the whole step."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from helpers.device import allocation_bytes
from helpers.estimator.model import FP32
from helpers.names import OPTIMIZERS
from helpers.optimizer_state import BNB_BLOCK, state_tensors, tracked_bytes


@dataclass
class TrainingState:
    """Bytes of the model state: weights, gradients, optimizer state (no activations)."""

    params: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        """Sum of the three."""
        return self.params + self.gradients + self.optimizer_state


def training_state(
    n_params: int,
    n_trainable: int | None = None,
    optimizer: str = "adamw",
    weight_bytes: int = FP32,
    master_copy: bool = False,
    n_tensors: int = 0,
) -> TrainingState:
    """Model-state bytes from parameter counts alone (frozen weights get no grads or state).

    Per trainable parameter: AdamW 8 B, SGD-momentum 4 B, 8-bit AdamW 2 B + 8 B per 256 (its
    absmax blocks, ignoring its fp32 small tensors), Lion 4 B, 8-bit Lion 1 B + 4 B per 256;
    Adafactor and Muon depend on tensor shapes, use ``optimizer_state_bytes``. ``master_copy``
    adds the 4 B fp32 master weight that mixed precision keeps when the weights themselves
    are 16-bit (``weight_bytes=2``): with it, AdamW is the single-GPU guide's 12 B per
    trainable parameter (84 GB for 7B, 2.4 GB for 0.2B of LoRA).
    ``n_tensors`` adds AdamW's 4-byte step per trainable tensor.
    """
    n_trainable = n_params if n_trainable is None else n_trainable
    bnb8 = 1.0 + FP32 / BNB_BLOCK  # one uint8 moment and its absmax per 256 values
    per = {"adamw": 8.0, "sgd": 4.0, "adamw8bit": 2 * bnb8, "lion": 4.0, "lion8bit": bnb8}
    if optimizer in ("adafactor", "muon"):
        raise ValueError(f"{optimizer}'s state depends on tensor shapes: use optimizer_state_bytes")
    if optimizer not in per:
        raise ValueError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    state = per[optimizer] * n_trainable + (FP32 * n_tensors if optimizer == "adamw" else 0)
    if master_copy:
        state += FP32 * n_trainable
    return TrainingState(
        params=int(weight_bytes * n_params),
        gradients=int(weight_bytes * n_trainable),
        optimizer_state=round(state),
    )


def optimizer_state_bytes(
    optimizer: str, params, device_type: str = "cpu", bf16_update: str = "nearest"
) -> int:
    """Exact optimizer-state bytes for ``params`` (ParamInfo, or anything with shape/numel).

    The per-optimizer rules are ``helpers.optimizer_state.state_tensors`` (lesson 06 checks them
    tensor by tensor against real optimizers). On CUDA the bytes are the tracker's: each
    tensor rounded up to 512 B, and torch's step counters left out (they live on the CPU).
    """
    rows = state_tensors(params, optimizer, device_type, bf16_update=bf16_update)
    return tracked_bytes(rows, torch.device(device_type))


def optimizer_step_temporaries(
    optimizer: str, params, device_type: str = "cpu", bf16_update: str = "nearest"
) -> int:
    """Largest scratch memory the optimizer's step allocates, as the tracker sees it.

    Scratch tensors have their parameter's dtype (fp32 or bf16). ``bf16_update``: torch-optimi's
    Kahan loop holds one ``exp_avg_sq.sqrt()`` at a time on every device; torchao's stochastic
    rounding is compiled into fused kernels on a GPU (no scratch counted: not yet measured on
    one) and on a CPU runs eagerly, where only its trace knows the scratch (traced path).
    """

    def alloc(nbytes: int) -> int:  # each scratch tensor is its own allocation
        return allocation_bytes(nbytes, device_type)

    trainable = [p for p in params if getattr(p, "trainable", True)]
    sizes = [alloc(_elem(p) * math.prod(p.shape)) for p in trainable]
    if not sizes or optimizer in ("sgd", "adamw8bit", "lion", "lion8bit"):
        # SGD updates in place. bitsandbytes' optimizers: fused CUDA kernels; on the CPU each
        # update is a custom op whose scratch tensors the tracker cannot see.
        return 0
    if optimizer == "muon":  # Muon's matrices, then AdamW's step over the rest
        rest = [p for p in trainable if not getattr(p, "hidden", False)]
        adamw = optimizer_step_temporaries("adamw", rest, device_type) if rest else 0
        return max(_muon_temporaries(trainable, alloc), adamw)
    if optimizer == "adamw" and bf16_update == "kahan":
        return max(sizes)
    if optimizer == "adamw" and bf16_update == "stochastic":
        if device_type == "cpu":
            raise ValueError(
                "the scratch of torchao's eager step on a CPU is known from its trace only: "
                "install torchao to estimate bf16_update stochastic on a CPU"
            )
        return 0
    if device_type != "cpu" and optimizer == "adamw":
        # foreach, AdamW's default on CUDA: exp_avg_sq.sqrt() for every tensor at once.
        return sum(sizes)
    # One tensor at a time. Adafactor too on CUDA: torch.optim.Adafactor's step passes its
    # foreach=None on, and the functional adafactor() takes the multi-tensor path only when
    # foreach is true (torch/optim/_adafactor.py), whatever its docstring says of CUDA; an H200
    # run measured the single-tensor scratch (reports/gpu/2026-11-28-nvidia-h200.md).
    worst, previous = 0, 0
    for p, size in zip(trainable, sizes, strict=True):
        if optimizer == "adamw":
            # denom = (exp_avg_sq.sqrt() / c).add_(eps): sqrt and quotient coexist, and the
            # previous tensor's denom is still referenced by the loop variable.
            worst = max(worst, 2 * size + previous)
        else:  # adafactor
            if len(p.shape) >= 2:
                *lead, rows, cols = p.shape
                e, n = _elem(p), math.prod(lead)
                means = alloc(e * n * rows) + alloc(e * n * cols)
                # row_var @ col_var, the previous one, and row_var.mean()'s one number
                worst = max(worst, size + previous + means + alloc(e * n))
            else:
                worst = max(worst, 2 * size + previous)  # grad*grad and variance.clone()
        previous = size
    return worst


def _muon_temporaries(params, alloc) -> int:
    """The largest scratch of torch's Muon step (torch/optim/_muon.py, one matrix at a time).

    Per m x n matrix: ``grad.lerp(buf)``, the Nesterov update, like the gradient (u); its bf16
    copy, the Newton-Schulz iterate (x, m x n; none when the gradient is bf16 already); each of
    the 5 iterations makes a Gram matrix and its polynomial (g, k x k bf16, k = min(m, n)) while
    the last iteration's pair is still bound, and a new iterate beside the old. The returned
    iterate stays bound to the loop variable until the next matrix's update replaces it.
    """
    worst, previous = 0, 0
    for p in (p for p in params if getattr(p, "hidden", False)):
        m, n = p.shape
        u, x, g = alloc(_elem(p) * m * n), alloc(2 * m * n), alloc(2 * min(m, n) ** 2)
        worst = max(worst, previous + u, u + x + 3 * g, u + 2 * x + 2 * g)
        previous = x
    return worst


def _elem(p) -> int:
    """Bytes per element of a parameter (ParamInfo, ParamShape or tensor): fp32 by default."""
    return getattr(p, "dtype", torch.float32).itemsize
