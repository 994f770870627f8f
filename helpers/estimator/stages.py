"""The step as stages: what each piece of the model saves for backward, and frees when."""

from __future__ import annotations

from dataclasses import dataclass, field

from helpers.estimator.model import FP32, ModelInfo


@dataclass
class Moment:
    """One moment of a stage's backward: gradient temporaries alive, and what is already gone."""

    temp: int  # gradient temporaries alive (incoming/outgoing activation grads, weight grad)
    released: int = 0  # bytes of this stage's saved tensors already freed
    grads_done: int = 0  # bytes of this stage's parameter gradients already complete
    copies_released: int = 0  # bytes of this stage's 16-bit weight copies already freed


@dataclass
class Stage:
    """A piece of the step whose saved tensors live and die together."""

    name: str
    saved: dict[str, int] = field(default_factory=dict)  # kept for this stage's backward
    forward_only: dict[str, int] = field(default_factory=dict)  # alive to the end of forward
    transient: dict[str, int] = field(default_factory=dict)  # alive at this stage's forward end
    backward: list[Moment] = field(default_factory=list)
    grads: int = 0  # parameter-gradient bytes this stage leaves when its backward is done
    copies: int = 0  # autocast 16-bit weight copies created here
    region: int | None = None  # checkpointed layer this stage belongs to (None: not checkpointed)
    checkpoint_input: int = 0  # what the checkpoint keeps in forward (first stage of a region)
    input_in_saved: bool = True  # the checkpoint input is also one of ``saved`` (same storage)
    recompute_temp: int = 0  # saved bytes the tracker labels temporaries when recomputed
    recompute_transient: int = 0  # alive at the end of recomputing this (last) stage
    pending_grads: int = 0  # gradient bytes labelled temporaries until the embedding's backward
    largest_grad: int = 0  # its largest parameter gradient (accumulation: a new one is added)


def _mask(elem: int, device_type: str) -> int:
    """Bytes per element of a dropout mask: CPU keeps a float tensor, CUDA a bool one."""
    return 1 if device_type == "cuda" else elem


@dataclass(frozen=True)
class _Shape:
    """The sizes every formula uses."""

    b: int
    s: int
    ea: int  # bytes of matmul outputs: 4 in fp32, 2 under autocast
    amp: bool
    dev: str  # device type
    chunk: int = 0  # causal LM: tokens of logits per chunk of the loss (0: all at once)
    ew: int = FP32  # bytes of the weights and the residual stream: 2 for bf16 weights

    @property
    def cast(self) -> bool:
        """Autocast over fp32 weights: matmuls make 16-bit copies of weights and inputs (with
        16-bit weights the casts are the tensors themselves)."""
        return self.amp and self.ew == FP32

    @property
    def t(self) -> int:
        """Tokens in the micro-batch."""
        return self.b * self.s


def _weight_grad(numel: int, z: _Shape) -> int:
    """A weight gradient as its matmul produces it (16-bit under autocast, cast to fp32 later)."""
    return numel * z.ea


def _cast_moment(
    grad_stream: int, numel: int, z: _Shape, before: Moment, copy: int
) -> list[Moment]:
    """Under autocast, the moment a 16-bit weight gradient is cast to fp32 for the fp32 weight
    (none for 16-bit weights, whose gradient is the matmul's).

    The matmul's backward node has finished, so the weight's 16-bit copy (``copy`` bytes) is
    already freed; its input gradient (part of ``grad_stream``) is alive.
    """
    if not z.cast:
        return []
    return [
        Moment(
            grad_stream + numel * (2 + FP32),
            before.released,
            before.grads_done,
            before.copies_released + copy,
        )
    ]


@dataclass(frozen=True)
class _Sizes:
    """A config's sizes for one step's shape, what every block builder reads."""

    m: ModelInfo
    z: _Shape
    gc: bool  # gradient checkpointing
    h: int  # hidden size
    a: int  # attention heads

    @property
    def th(self) -> int:
        """Values in one hidden-sized activation."""
        return self.z.t * self.h

    @property
    def g(self) -> int:
        """The residual stream's gradient (the weights' dtype), alive through each layer's
        backward."""
        return self.z.ew * self.th

    @property
    def scores(self) -> int:
        """Values in one attention-score tensor (b, a, s, s)."""
        return self.z.b * self.a * self.z.s * self.z.s


def _weighted_stage(m: ModelInfo, z: _Shape, name: str) -> Stage:
    """A stage whose weights leave gradients (their own dtype) and, under autocast over fp32
    weights, 16-bit working copies."""
    copies = 2 * m.stage_numel(name, cast_only=True) if z.amp else 0
    return Stage(name, grads=m.stage_bytes(name), copies=copies)
