"""``estimate`` and ``estimate_run``: a config and a setting in, an ``Estimate`` out."""

from __future__ import annotations

import torch

from helpers.device import allocation_bytes
from helpers.estimator.decoder import _decoder_stages
from helpers.estimator.encoder import _encoder_stages
from helpers.estimator.model import FP32, ModelInfo, describe_model
from helpers.estimator.simulate import Estimate, _simulate
from helpers.estimator.stages import Moment, Stage, _Shape
from helpers.estimator.state import optimizer_state_bytes, optimizer_step_temporaries
from helpers.names import ATTENTION, AUTOCAST, OPTIMIZERS, PRECISION_BYTES


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
) -> Estimate:
    """Predicted per-category bytes of one steady-state training step (see the module doc).

    ``model`` is a bundled name, a config JSON path, a dict, a transformers config or a
    ``ModelInfo`` from ``describe_model`` (reuse one to estimate many settings quickly).
    ``device`` (default: ``helpers.device.default_device()``) picks CPU or CUDA behaviour.
    ``lora_r`` > 0 trains LoRA adapters of that rank on ``lora_targets`` instead of every
    weight (as ``RunConfig``; ignored when ``model`` is a ModelInfo, which already says it).
    """
    from helpers.device import resolve

    if precision not in PRECISION_BYTES:
        raise ValueError(f"unknown precision {precision!r}: use fp32, tf32, bf16 or fp16")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    if attn not in ATTENTION:
        raise ValueError(f"unknown attention {attn!r}: use eager or sdpa")
    if batch_size < 1 or seq_len < 1 or grad_accum < 1:
        raise ValueError("batch size, sequence length and accumulation must be positive")
    info = describe_model(model, attn, lora_r, lora_targets)
    limit = info.config.get("max_position_embeddings")
    if limit and seq_len > limit:
        raise ValueError(f"sequence length {seq_len} exceeds max_position_embeddings ({limit})")
    dev = resolve(device)
    amp = precision in AUTOCAST
    z = _Shape(b=batch_size, s=seq_len, ea=PRECISION_BYTES[precision], amp=amp, dev=dev.type)
    build = _encoder_stages if info.family == "encoder" else _decoder_stages
    stages = build(info, z, attn, gradient_checkpointing)
    _add_adapters(stages, info, z)
    if dev.type == "cuda":
        _round_to_allocations(stages, info)
    trainable = [p for p in info.params if p.trainable]

    def alloc(nbytes: int) -> int:  # a tensor's bytes as the allocator holds them
        return allocation_bytes(nbytes, dev.type)

    params = sum(alloc(FP32 * p.numel) for p in info.params)
    grads = sum(alloc(FP32 * p.numel) for p in trainable)
    buffers = sum(alloc(b) for b in info.buffer_sizes)
    state = optimizer_state_bytes(optimizer, trainable, dev.type)
    opt_temp = optimizer_step_temporaries(optimizer, trainable, dev.type)
    base = params + buffers + state
    act, temp, copies, peak, where = _simulate(stages, base, grads, grad_accum > 1, opt_temp)
    layer = {}
    for st in stages:
        if st.name.startswith("L0."):
            layer.update({f"{st.name[3:]}: {k}": v for k, v in st.saved.items()})
    c = info.config
    h, a = c["hidden_size"], c["num_attention_heads"]
    paper = 34 * seq_len * batch_size * h + 5 * a * seq_len * seq_len * batch_size
    return Estimate(
        n_params=info.n_params,
        params=params,
        buffers=buffers,
        gradients=grads,
        optimizer_state=state,
        activations=act,
        temporaries=temp,
        weight_copies=copies,
        peak=peak,
        peak_at=where,
        layer_activations=layer,
        paper_layer_bytes=paper,
    )


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
            st.grads = sum(alloc(FP32 * p.numel) for p in mine if p.trainable)
        if st.copies:
            tied = 0  # the tied input embedding, cast for the LM head
            if st.name == "head" and m.tied:
                tied = next(p.numel for p in m.params if p.embedding and p.stage == "embed")
            st.copies = sum(alloc(2 * p.numel) for p in mine if p.cast) + (tied and alloc(2 * tied))
        if st.pending_grads:
            st.pending_grads = alloc(st.pending_grads)


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


def estimate_run(cfg) -> Estimate:
    """``estimate`` for a ``helpers.train.RunConfig`` (the same fields ``measure`` reads)."""
    return estimate(
        cfg.model,
        cfg.batch_size,
        cfg.seq_len,
        precision=cfg.precision,
        optimizer=cfg.optimizer,
        gradient_checkpointing=cfg.gradient_checkpointing,
        attn=cfg.attn,
        grad_accum=cfg.grad_accum,
        device=cfg.device,
        lora_r=getattr(cfg, "lora_r", 0),
        lora_targets=getattr(cfg, "lora_targets", ""),
    )
