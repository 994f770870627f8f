"""``estimate`` and ``estimate_run``: a config and a setting in, an ``Estimate`` out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from helpers.device import allocation_bytes, resolve
from helpers.estimator.decoder import _decoder_stages
from helpers.estimator.encoder import _encoder_stages
from helpers.estimator.model import (
    DECODERS,
    EXPERTS_KEY,
    FP32,
    SUPPORTED,
    TRACED,
    ModelInfo,
    describe_model,
    is_dora,
)
from helpers.estimator.qlora import qlora_estimate
from helpers.estimator.simulate import Estimate, _simulate
from helpers.estimator.stages import Moment, Stage, _Shape
from helpers.estimator.state import optimizer_state_bytes, optimizer_step_temporaries
from helpers.estimator.traced import Traced, step_name, trace_step
from helpers.models import WEIGHT_TORCH_DTYPES, load_config
from helpers.names import (
    ATTENTION,
    AUTOCAST,
    PRECISION_BYTES,
    activations_problem,
    dora_problem,
    seq_len_problem,
    setting_problem,
    weights_problem,
)

if TYPE_CHECKING:
    from helpers.train import RunConfig


def estimate(
    model,
    batch_size: int,
    seq_len: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
    gradient_checkpointing: bool = False,
    attn: str = "eager",
    grad_accum: int = 1,
    device: str | torch.device | None = None,
    lora_r: int = 0,
    lora_targets: str = "",
    path: str = "auto",
    qlora: bool = False,
    moments: list | None = None,
    optimizer_in_backward: bool = False,
    loss_chunk: int = 0,
    weight_dtype: str = "fp32",
    state_dtype: str = "",
    bf16_update: str = "nearest",
    checkpoint_policy: str = "full",
    offload_activations: bool = False,
    dora: bool = False,
) -> Estimate:
    """Predicted per-category bytes of one steady-state training step (see the module doc).

    ``model`` is a bundled name, a config JSON path, a dict, a transformers config or a
    ``ModelInfo`` from ``describe_model`` (reuse one to estimate many settings quickly).
    ``device`` (default: ``helpers.device.default_device()``) picks CPU or CUDA behaviour.
    ``lora_r`` > 0 trains LoRA adapters of that rank on ``lora_targets`` (``dora``: DoRA's;
    as ``RunConfig``; ignored when ``model`` is a ModelInfo, which already says it).
    ``path``: "analytical" (the stage model: bert, llama, mistral, qwen2, mixtral), "traced"
    (any architecture: ``helpers.estimator.traced``) or "auto": analytical where it exists
    and no LoRA is trained (the stage model's LoRA account is approximate, the traced one
    exact). ``Estimate.path`` says which one answered. ``qlora``: the LoRA step with the
    layers' frozen Linear weights in 4 bits (``helpers.estimator.qlora``; 16-bit precision).
    ``moments``: a list that receives the stage model's walk, moment by moment (lesson 15).
    ``weight_dtype``, ``state_dtype``, ``bf16_update``, ``checkpoint_policy`` and
    ``offload_activations`` are ``RunConfig``'s (the module doc says which path knows which).
    """
    _check_setting(precision, optimizer, attn, batch_size, seq_len, grad_accum,
                   gradient_checkpointing, checkpoint_policy)  # fmt: skip
    kept = (checkpoint_policy, offload_activations)
    info = _described(model, attn, lora_r, lora_targets, precision, optimizer, weight_dtype,
                      state_dtype, bf16_update, seq_len, dora, qlora)  # fmt: skip
    dev = resolve(device)
    staged = _staged(info, optimizer_in_backward, loss_chunk, precision, grad_accum, moments)
    trace_only = kept != ("full", False) or _step_traced(bf16_update, dev.type, path, staged)
    if _choose_path(info, path, precision, qlora, staged, trace_only) == "analytical":
        z = _Shape(b=batch_size, s=seq_len, ea=PRECISION_BYTES[precision],
                   amp=precision in AUTOCAST, dev=dev.type, chunk=loss_chunk,
                   ew=WEIGHT_TORCH_DTYPES[info.weight_dtype].itemsize)  # fmt: skip
        return _analytical(info, z, optimizer, gradient_checkpointing, attn, grad_accum, moments,
                           optimizer_in_backward, bf16_update)  # fmt: skip
    step = _traced(info, batch_size, seq_len, precision, optimizer, gradient_checkpointing,
                   attn, grad_accum, dev.type, frozen_16bit=qlora or weight_dtype != "fp32",
                   bf16_update=bf16_update, kept=kept)  # fmt: skip
    if qlora:
        return qlora_estimate(step, info)
    return step


def _step_traced(bf16_update: str, device_type: str, path: str, staged: bool) -> bool:
    """Whether ``auto`` needs the trace for the optimizer's step: torchao's stochastic rounding
    on a CPU, whose eager step's scratch only its trace knows (asked for explicitly, the stage
    model says so in one line)."""
    return bf16_update == "stochastic" and device_type == "cpu" and path == "auto" and not staged


def _described(model, attn, lora_r, lora_targets, precision, optimizer, weight_dtype,
               state_dtype, bf16_update, seq_len, dora=False,
               qlora=False) -> ModelInfo:  # fmt: skip
    """``describe_model`` after the weights' and DoRA's checks (``names.weights_problem``,
    ``dora_problem``), and the sequence length against the model's positions: ValueError."""
    rank = _lora_rank(model, lora_r)
    problem = weights_problem(weight_dtype, state_dtype, bf16_update, precision, optimizer,
                              rank) or dora_problem(dora, rank, qlora)  # fmt: skip
    if problem:
        raise ValueError(problem)
    info = describe_model(model, attn, lora_r, lora_targets, weight_dtype, dora)
    if info.weight_dtype != weight_dtype:
        raise ValueError(
            f"this ModelInfo was described with {info.weight_dtype} weights, not "
            f"{weight_dtype}: describe_model(..., weight_dtype={weight_dtype!r})"
        )
    problem = seq_len_problem(seq_len, info.config.get("max_position_embeddings"))
    if problem:
        raise ValueError(problem)
    return info


def _lora_rank(model, lora_r: int) -> int:
    """The LoRA rank a run trains: ``lora_r``, or the adapters a ModelInfo already has."""
    if isinstance(model, ModelInfo):
        return 1 if model.n_trainable < model.n_params else 0
    return lora_r


def _choose_path(info: ModelInfo, path: str, precision: str, qlora: bool, staged: bool,
                 kept: bool = False) -> str:  # fmt: skip
    """ "analytical" or "traced" for ``estimate``'s ``path``; ValueError, saying why, if neither.

    ``staged``: the estimate needs the stage model (moments, lesson 16's optimizer step in
    backward and chunked loss); ``kept``: selective checkpointing or offloaded activations,
    which only the traced path knows."""
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}: use one of {', '.join(PATHS)}")
    if staged and path == "traced":
        raise ValueError(
            "moments, optimizer_in_backward and loss_chunk come from the analytical stage "
            "model: use path='analytical'"
        )
    if info.weight_dtype != "fp32" and info.family not in SIXTEEN_BIT_FAMILIES:
        if staged or path == "analytical":
            raise ValueError(
                f"the analytical stage model knows {info.weight_dtype} weights for "
                f"{', '.join(DECODERS)}, not model_type {info.model_type!r}: use path='traced' "
                "or 'auto' (the traced path has no moments, optimizer_in_backward or loss_chunk "
                "yet)"
            )
        return "traced"
    if kept and (staged or path == "analytical"):
        raise ValueError(
            "selective checkpointing and offloaded activations are estimated on the traced "
            "path (path='traced' or 'auto'), which has no moments, optimizer_in_backward or "
            "loss_chunk yet"
        )
    if staged:
        path = "analytical"
    if path == "analytical" and info.family == TRACED:
        raise ValueError(
            f"no analytical model for model_type {info.model_type!r} (it knows "
            f"{', '.join(SUPPORTED)}): use path='traced' or 'auto'"
        )
    lora = info.n_trainable < info.n_params
    if is_dora(info) and (staged or path == "analytical"):
        raise ValueError(
            "DoRA is estimated on the traced path (path='traced' or 'auto'), which has no "
            "moments, optimizer_in_backward or loss_chunk yet"
        )
    if qlora and (not lora or precision not in AUTOCAST or path == "analytical"):
        raise ValueError(
            "QLoRA trains LoRA adapters (lora_r > 0) in 16-bit compute (precision bf16 or "
            "fp16) and is estimated on the traced path"
        )
    if path == "traced" or info.family == TRACED or (path == "auto" and lora) or qlora:
        return "traced"
    if kept:  # selective checkpointing, offload
        return "traced"
    return "analytical"


def _staged(info, in_backward: bool, loss_chunk: int, precision: str, grad_accum: int,
            moments: list | None) -> bool:  # fmt: skip
    """Whether the estimate needs the stage model: lesson 16's savers on, or ``moments`` asked
    for; ValueError, saying why, for a setting the savers refuse."""
    if loss_chunk < 0:
        raise ValueError("loss_chunk must be a number of tokens (0: the whole loss at once)")
    if loss_chunk and info.family == "encoder":
        raise ValueError("loss_chunk applies to causal language models (decoders) only")
    if (in_backward or loss_chunk) and info.family == TRACED:
        raise ValueError(
            f"optimizer_in_backward and loss_chunk are estimated by the stage model, which "
            f"knows {', '.join(SUPPORTED)}, not model_type {info.model_type!r}"
        )
    if in_backward and (grad_accum > 1 or precision == "fp16"):
        raise ValueError(
            "optimizer_in_backward steps each parameter as soon as its gradient exists: it "
            "cannot accumulate micro-batches or unscale fp16 gradients (use grad_accum=1 and "
            "fp32/bf16)"
        )
    return bool(in_backward or loss_chunk) or moments is not None


def _analytical(info, z: _Shape, optimizer, gc, attn, grad_accum, moments=None,
                in_backward=False, bf16_update="nearest"):  # fmt: skip
    """The stage model's estimate (the module doc); ``moments`` receives the walk's moments."""
    device_type = z.dev
    batch_size, seq_len = z.b, z.s
    build = _encoder_stages if info.family == "encoder" else _decoder_stages
    stages = build(info, z, attn, gc)
    _add_adapters(stages, info, z)
    if device_type == "cuda":
        _round_to_allocations(stages, info)
    else:
        _largest_grads(stages, info, device_type)
    state = _training_state(info, optimizer, device_type, bf16_update)
    base = state.params + state.buffers + state.optimizer_state
    steps = _steps_in_backward(info, optimizer, device_type, bf16_update) if in_backward else None
    act, temp, copies, peak, where = _simulate(
        stages, base, state.gradients, grad_accum > 1, state.step_temporaries, moments, steps
    )
    return Estimate(
        n_params=info.n_params,
        params=state.params,
        buffers=state.buffers,
        gradients=max(g for g, _ in steps.values())
        if steps
        else state.gradients + (max(st.largest_grad for st in stages) if grad_accum > 1 else 0),
        optimizer_state=state.optimizer_state,
        activations=act,
        temporaries=temp,
        weight_copies=copies,
        peak=peak,
        peak_at=where,
        layer_activations=_first_layer(stages),
        paper_layer_bytes=_paper_layer_bytes(info.config, batch_size, seq_len),
    )


PATHS = ("auto", "analytical", "traced")
# Families whose stage model knows 16-bit weights (BERT's LayerNorms and Mixtral's grouped
# experts change dtype in ways only the trace follows so far).
SIXTEEN_BIT_FAMILIES = ("decoder",)


def trace_of(info, batch_size, seq_len, precision, optimizer, gc, attn, grad_accum, device_type,
             frozen_16bit=False, bf16_update="nearest", kept=("full", False),
             ) -> Traced:  # fmt: skip
    """``trace_step`` for a ModelInfo and ``estimate``'s setting: its adapters (rank and
    targets) read from the ModelInfo's parameters. Cached with the trace, so the per-rank
    estimator (``helpers.estimator.parallel``) reads the moments of the trace ``_traced`` used."""
    config = load_config({k: v for k, v in info.config.items() if k != EXPERTS_KEY})
    lora = [p for p in info.params if ".lora_A." in p.name]
    lora_r = lora[0].shape[0] if lora else 0
    targets = ",".join(sorted({p.name.split(".lora_A.")[0].rsplit(".", 1)[-1] for p in lora}))
    return trace_step(config, batch_size, seq_len, precision, gc, attn, grad_accum, device_type,
                      lora_r, targets, frozen_16bit, optimizer, bf16_update, *kept,
                      dora=is_dora(info))  # fmt: skip


def _traced(info, batch_size, seq_len, precision, optimizer, gc, attn, grad_accum, device_type,
            frozen_16bit=False, bf16_update="nearest", kept=("full", False)):  # fmt: skip
    """A traced forward and backward plus the optimizer's exact state and step (traced.py);
    ``kept``: the checkpoint policy and whether activations are offloaded."""
    t = trace_of(info, batch_size, seq_len, precision, optimizer, gc, attn, grad_accum,
                 device_type, frozen_16bit, bf16_update, kept)  # fmt: skip
    config = load_config({k: v for k, v in info.config.items() if k != EXPERTS_KEY})
    traced_step = t.steps.get(step_name(optimizer, bf16_update))
    if traced_step is not None:  # the CPU: the optimizer's step was traced too
        opt_state, opt_temp = traced_step.optimizer_state, traced_step.temporaries
        step = traced_step.peak
    else:  # from helpers.estimator.state (CUDA's foreach kernels; Adafactor, 8-bit AdamW)
        state = _training_state(info, optimizer, device_type, bf16_update)
        opt_state, opt_temp = state.optimizer_state, state.step_temporaries
        # Every gradient is there when the optimizer steps (the traced category's maximum
        # may also hold an accumulated micro-batch's new gradient, gone by then).
        step = t.params + t.buffers + opt_state + state.gradients + opt_temp + t.leftovers
    # The state is there through forward and backward; the step is one more moment.
    forward_backward = t.peak + opt_state
    peak, where = max((forward_backward, t.peak_at), (step, "optimizer step"), key=lambda x: x[0])
    return Estimate(
        n_params=info.n_params,
        params=t.params,
        buffers=t.buffers,
        gradients=t.gradients,
        optimizer_state=opt_state,
        activations=t.activations,
        temporaries=max(t.temporaries, opt_temp),
        weight_copies=t.weight_copies,
        peak=peak,
        peak_at=where,
        paper_layer_bytes=_paper_layer_bytes(config, batch_size, seq_len),
        path="traced",
    )


def _check_setting(precision, optimizer, attn, batch_size, seq_len, grad_accum, gc=False,
                   policy="full") -> None:  # fmt: skip
    """Raise ValueError, saying what to use, for a setting the estimator does not know."""
    problem = setting_problem(precision, optimizer, attn, batch_size, seq_len, grad_accum,
                              attentions=ATTENTION) or activations_problem(gc, policy)  # fmt: skip
    if problem:
        raise ValueError(problem)


@dataclass
class _State:
    """The training state's bytes as the device holds them (allocator rounding applied)."""

    params: int
    buffers: int
    gradients: int
    optimizer_state: int
    step_temporaries: int  # the optimizer step's own scratch


def _training_state(
    info: ModelInfo, optimizer: str, device_type: str, bf16_update: str = "nearest"
) -> _State:
    """Parameters, buffers, gradients (trainable only) and optimizer state, in bytes."""

    def alloc(nbytes: int) -> int:  # a tensor's bytes as the allocator holds them
        return allocation_bytes(nbytes, device_type)

    trainable = [p for p in info.params if p.trainable]
    return _State(
        params=sum(alloc(p.nbytes) for p in info.params),
        buffers=sum(alloc(b) for b in info.buffer_sizes),
        gradients=sum(alloc(p.nbytes) for p in trainable),
        optimizer_state=optimizer_state_bytes(optimizer, trainable, device_type, bf16_update),
        step_temporaries=optimizer_step_temporaries(optimizer, trainable, device_type, bf16_update),
    )


def model_state_floor(info: ModelInfo, optimizer: str = "adamw", device_type: str = "cpu",
                      bf16_update: str = "nearest") -> int:  # fmt: skip
    """Bytes a step of ``info`` holds at once whatever its batch: weights, buffers, every
    trained gradient and the optimizer's state (as the device allocates them), all alive when
    the optimizer steps; a lower bound of ``estimate(...).peak`` (not for QLoRA, whose frozen
    weights are 4-bit: ``info`` describes them unquantised). Arithmetic only: the planner
    skips a setting's trace when this alone exceeds the budget.

    Example:
        >>> info = describe_model("llama-3.1-8b", "sdpa", weight_dtype="bf16")
        >>> model_state_floor(info, "adamw", "cuda", "kahan") > 24 * 2**30  # not on an L4
        True
    """
    state = _training_state(info, optimizer, device_type, bf16_update)
    return state.params + state.buffers + state.gradients + state.optimizer_state


def _steps_in_backward(
    info: ModelInfo, optimizer: str, device_type: str, bf16_update: str = "nearest"
) -> dict:
    """Stage name -> (its largest gradient's bytes, that parameter's step scratch), for the
    optimizer steps inside backward: one parameter's gradient and step at a time."""
    out: dict[str, tuple[int, int]] = {}
    for p in info.params:
        if not p.trainable:
            continue
        one = (allocation_bytes(p.nbytes, device_type),
               optimizer_step_temporaries(optimizer, [p], device_type, bf16_update))  # fmt: skip
        out[p.stage] = max(out.get(p.stage, (0, 0)), one, key=sum)
    return out


def _first_layer(stages: list[Stage]) -> dict[str, int]:
    """What the first layer saves for backward, labelled "<stage>: <tensor>"."""
    layer = {}
    for st in stages:
        if st.name.startswith("L0."):
            layer.update({f"{st.name[3:]}: {k}": v for k, v in st.saved.items()})
    return layer


def _paper_layer_bytes(config, batch_size: int, seq_len: int) -> int:
    """Korthikanti et al.'s activation bytes of one layer: s·b·h·(34 + 5as/h) (0 when a
    config names no hidden size or heads; a transformers config's attribute map gives
    GPT-2's n_embd as hidden_size)."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    h, a = get("hidden_size"), get("num_attention_heads")
    if not h or not a:
        return 0
    return 34 * seq_len * batch_size * h + 5 * a * seq_len * seq_len * batch_size


def _round_to_allocations(stages: list[Stage], m: ModelInfo) -> None:
    """CUDA's view of the stages: every storage rounded up to the allocator's 512 B blocks.

    Gradients and autocast copies are rounded tensor by tensor (one per parameter). Each
    saved or transient entry is rounded as one storage: exact where an entry is one tensor,
    and short by under 512 B per extra tensor where it groups several (q, k, v...).
    """

    def alloc(nbytes: int) -> int:
        return allocation_bytes(nbytes, "cuda")

    for st in stages:
        for part in (st.saved, st.forward_only, st.transient):
            for key, nbytes in part.items():
                part[key] = alloc(nbytes)
        mine = [p for p in m.params if p.stage == st.name]
        if st.grads:
            st.grads = sum(alloc(p.nbytes) for p in mine if p.trainable)
        if st.copies:
            tied = 0  # the tied input embedding, cast for the LM head
            if st.name == "head" and m.tied:
                emb = next(p for p in m.params if p.embedding and p.stage == "embed")
                tied = emb.numel if emb.dtype == torch.float32 else 0
            copied = sum(alloc(2 * p.numel) for p in mine if p.copied)
            st.copies = copied + (tied and alloc(2 * tied))
        if st.pending_grads:
            st.pending_grads = alloc(st.pending_grads)
    _largest_grads(stages, m, "cuda")


def _largest_grads(stages: list[Stage], m: ModelInfo, device_type: str) -> None:
    """Each stage's largest trainable parameter gradient, as the device allocates it."""
    for st in stages:
        mine = [allocation_bytes(p.nbytes, device_type) for p in m.params
                if p.stage == st.name and p.trainable]  # fmt: skip
        st.largest_grad = max(mine, default=0)


def _add_adapters(stages: list[Stage], m: ModelInfo, z: _Shape) -> None:
    """LoRA adapters' own tensors: A's outputs, and peft's fp32 input casts under autocast."""
    kept: dict[str, int] = {}
    widest: dict[str, int] = {}
    for p in m.params:
        if p.trainable and ".lora_A." in p.name:  # A is (r, in)
            kept[p.stage] = kept.get(p.stage, 0) + z.t * p.shape[0] * z.ea
            widest[p.stage] = max(widest.get(p.stage, 0), p.shape[1])
    for st in stages:
        if not kept.get(st.name):
            continue
        # B keeps A's output (T x r) for its weight gradient until this stage's backward.
        st.saved["LoRA A outputs (B's input)"] = kept[st.name]
        if z.amp:
            # peft casts a 16-bit input to the adapter's fp32 dtype before A (which autocast
            # casts back): one fp32 T x in copy alive at a time, and its gradient in backward.
            st.transient["peft's fp32 copy of an adapter input"] = FP32 * z.t * widest[st.name]
            st.backward.append(Moment(temp=(FP32 + 2 * 2) * z.t * widest[st.name]))


# RunConfig's fields that change what a run measures but not its bytes: estimate_run reads
# every other field (tests/test_estimate.py keeps the two lists covering the dataclass).
NOT_ESTIMATED = ("data", "warmup", "repeats", "budget", "seed", "flops", "label")


def estimate_run(cfg: RunConfig, path: str = "auto") -> Estimate:
    """``estimate`` for a ``helpers.train.RunConfig``: the run ``measure(cfg)`` would measure
    (``path`` as ``estimate``'s)."""
    return estimate(
        cfg.model,
        batch_size=cfg.batch_size,
        seq_len=cfg.seq_len,
        precision=cfg.precision,
        optimizer=cfg.optimizer,
        gradient_checkpointing=cfg.gradient_checkpointing,
        checkpoint_policy=cfg.checkpoint_policy,
        offload_activations=cfg.offload_activations,
        attn=cfg.attn,
        grad_accum=cfg.grad_accum,
        device=cfg.device,
        lora_r=cfg.lora_r,
        lora_targets=cfg.lora_targets,
        optimizer_in_backward=cfg.optimizer_in_backward,
        loss_chunk=cfg.loss_chunk,
        weight_dtype=cfg.weight_dtype,
        state_dtype=cfg.state_dtype,
        bf16_update=cfg.bf16_update,
        qlora=cfg.qlora,
        dora=cfg.dora,
        path=path,
    )
