"""One process's memory, and what the processes exchange, when training is spread over N.

``estimate_per_rank(model, world_size, strategy, batch_size, seq_len, ...)`` is ``estimate``
for one of ``world_size`` processes, each training on its own ``batch_size`` samples:

DDP (``torch.nn.parallel.DistributedDataParallel``) replicates the model state: parameters,
    gradients and optimizer state are one process's whole account, activations those of the
    per-process batch. DDP adds its gradient buckets: flat buffers, as large as all the
    trainable parameters' gradients together (their dtype: 4 B each, 2 in bf16), allocated
    when the model is wrapped; the gradients are copied in, all-reduced, and copied back (with
    ``gradient_as_bucket_view=True`` the gradients are views of the buckets instead, and the
    bytes per parameter are saved; lesson 07's loop keeps DDP's default). They are alive through
    the whole step, so the peak is the one-process peak plus the buckets.
FSDP2 (``torch.distributed.fsdp.fully_shard``) shards every parameter on its first dimension:
    each process keeps ceil(d0/N) rows of each tensor (the last process's share is padded to
    that size, so every share has the same bytes), and the gradients and the optimizer state
    follow the shards (AdamW's 0-dim step counters are not sharded: 4 B per tensor on every
    process). The model is cut into units, one ``fully_shard`` call each, as Accelerate 1.15
    cuts it (``fsdp_units``): each transformer layer, the input embedding, the final norm with
    the head, and the root (the rest). To compute, a unit's parameters are gathered whole (an
    all-gather into a buffer of N shares, then copied out) and freed after its forward;
    backward gathers it again and reduce-scatters its gradients into shares. The head unit
    and the root stay gathered from forward to backward. FSDP2 keeps each all-gather's buffer
    until the next all-gather is issued. The step is the one-process step walked moment by
    moment with the model state replaced by its shares, plus, at each moment, the unit
    computing (gathered) and its all-gather buffer, and the root throughout. Gradients
    already reduce-scattered count whole and the buffer is kept through the unit, so the
    peak errs high (checked against FSDPMemTracker in tests/test_beyond_one_gpu.py and
    lesson 17). The walk is the analytical stage model's (``estimate(..., moments=...)``;
    lesson 16's optimizer step in backward and chunked loss need it) or, for what only the
    trace knows (LoRA adapters, selective checkpointing, offloaded activations, families
    without a stage model), the trace's moments (``Traced.moments``), where the unit of a
    moment between layers is the larger it could be.

Every setting of ``estimate`` is taken but QLoRA (FSDP2 shards 4-bit weights packed into
``bnb_4bit_quant_storage`` tensors, never measured here) and, on a CPU, torchao's
stochastic-rounding AdamW (its eager step's scratch is known from an unsharded trace only):
both refused with the reason. The shards, gradients, optimizer state and gathered copies are
the parameters' dtype: fp32, or bf16 with ``weight_dtype="bf16"`` (the model built in bf16,
as ``fully_shard`` without a ``MixedPrecisionPolicy`` keeps it); LoRA's adapters stay fp32
on a bf16 base, as peft keeps them. tests/test_beyond_one_gpu.py measures fp32, bf16, bf16
with Kahan summation, and LoRA on a bf16 base with selective checkpointing, on 2 processes.
Over fp32 weights with a ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` (Accelerate's
mixed precision on GPUs), FSDP2 gathers 16-bit copies of fp32 shards instead: not modelled.

``traffic(model, world_size, batch_size, seq_len)`` counts, from the model, the bytes each
scheme moves between devices in one optimizer step: ``torch.nn.DataParallel`` (one process,
GPU 0 the hub), DDP and FSDP2. Lesson 17 checks the DDP and FSDP2 rows against the collectives
its processes issued.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from dataclasses import dataclass, replace

import torch

from helpers.device import allocation_bytes, resolve
from helpers.estimator.api import SIXTEEN_BIT_FAMILIES, estimate, trace_of
from helpers.estimator.model import (
    EXPERTS_KEY,
    FP32,
    TRACED,
    ModelInfo,
    ParamInfo,
    describe_model,
)
from helpers.estimator.simulate import Estimate
from helpers.estimator.state import optimizer_state_bytes, optimizer_step_temporaries
from helpers.models import ENCODER_TYPES, build_model, load_config

PARALLEL_STRATEGIES = ("ddp", "fsdp")
INT64 = 8  # token ids and labels


@dataclass
class RankEstimate(Estimate):
    """``Estimate`` for one of ``world_size`` processes, with what the strategy adds."""

    world_size: int = 1
    strategy: str = "ddp"
    gathered_params: int = 0  # FSDP: parameters gathered whole at one moment (root + a unit)
    communication_buffers: int = 0  # DDP: gradient buckets; FSDP: all-gather outputs at once


# Settings whose FSDP walk follows the trace's moments (the stage model's otherwise): at
# these values the stage model walks the step.
FSDP_ANALYTICAL = {"lora_r": 0, "checkpoint_policy": "full", "offload_activations": False}


def estimate_per_rank(
    model, world_size: int, strategy: str, batch_size: int, seq_len: int,
    param_dtype: str = "", **estimate_kwargs,
) -> RankEstimate:  # fmt: skip
    """Predicted bytes of one process of ``world_size``, each with ``batch_size`` samples.

    ``strategy``: "ddp" or "fsdp" (see the module doc). ``estimate_kwargs`` are
    ``helpers.estimator.estimate``'s (precision, optimizer, device, lora_r, weight_dtype,
    checkpoint_policy, ...). FSDP needs an optimizer whose state is elementwise (adamw, sgd):
    Adafactor's factored state and bitsandbytes' 8-bit state are not defined on sharded
    tensors the same way; it refuses QLoRA, and torchao's stochastic rounding on a CPU.
    ``param_dtype="bf16"``: FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32)`` over fp32 weights: the shards, their gradients and the
    optimizer state stay fp32, each unit is gathered (and computes) in bf16, as a bf16 model
    would (the walk is the bf16 one-process step's).

    Example::

        estimate_per_rank("llama-3.1-8b", 8, "fsdp", 1, 4096, precision="bf16",
                          weight_dtype="bf16", lora_r=16, lora_targets="all-linear",
                          gradient_checkpointing=True, device="cuda").peak
    """
    if strategy not in PARALLEL_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: use one of {PARALLEL_STRATEGIES}")
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    kw = estimate_kwargs
    state_info = None  # the shards' dtype, when the units compute in another (param_dtype)
    if param_dtype:
        kw = estimate_kwargs = _mixed_precision(param_dtype, strategy, estimate_kwargs)
        state_info = describe_model(model, kw.get("attn", "eager"), kw.get("lora_r", 0),
                                    kw.get("lora_targets", ""), "fp32")  # fmt: skip
    info = describe_model(model, kw.get("attn", "eager"), kw.get("lora_r", 0),
                          kw.get("lora_targets", ""), kw.get("weight_dtype", "fp32"),
                          kw.get("dora", False))  # fmt: skip
    if strategy == "ddp":
        one = estimate(info, batch_size, seq_len, **estimate_kwargs)
        return _ddp(one, info, world_size, _device_type(estimate_kwargs))
    optimizer = estimate_kwargs.get("optimizer", "adamw")
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"the FSDP estimate models adamw and sgd, not {optimizer!r}")
    device_type = _device_type(estimate_kwargs)
    _refuse_for_fsdp(kw, device_type)
    if _fsdp_walk(info, kw) == "analytical":
        moments: list = []
        kwargs = {**estimate_kwargs, "path": "analytical"}
        one = estimate(info, batch_size, seq_len, moments=moments, **kwargs)
        bf16_update = kw.get("bf16_update", "nearest")
        sh = _shards(info, world_size, optimizer, device_type, bf16_update, state_info)
        return _fsdp(one, info, world_size, moments, sh)
    one = estimate(info, batch_size, seq_len, **{**estimate_kwargs, "path": "traced"})
    return _fsdp_traced(one, info, world_size, batch_size, seq_len, device_type, kw, state_info)


def _mixed_precision(param_dtype: str, strategy: str, kw: dict) -> dict:
    """``estimate``'s keyword arguments for the step a ``MixedPrecisionPolicy`` computes: bf16
    weights (the gathered units) and bf16 compute; ValueError, saying why, where it does not
    apply."""
    if strategy != "fsdp":
        raise ValueError("param_dtype is FSDP2's MixedPrecisionPolicy: use strategy 'fsdp'")
    if param_dtype != "bf16":
        raise ValueError(f"param_dtype {param_dtype!r}: the estimate models 'bf16'")
    if kw.get("weight_dtype", "fp32") != "fp32" or kw.get("precision", "fp32") not in (
        "fp32", "bf16"):  # fmt: skip
        raise ValueError(
            "MixedPrecisionPolicy gathers bf16 copies of fp32 shards: leave weight_dtype fp32 "
            "and precision fp32 (or bf16 autocast)"
        )
    if kw.get("lora_r") or kw.get("qlora"):
        raise ValueError("param_dtype with LoRA is not modelled: load the base in bf16 instead")
    return {**kw, "weight_dtype": "bf16", "precision": "bf16"}


def _refuse_for_fsdp(kw: dict, device_type: str) -> None:
    """ValueError, saying what to do, for a setting the FSDP walk does not model."""
    if kw.get("qlora"):
        raise ValueError(
            "the FSDP estimate does not model QLoRA: FSDP2 shards 4-bit weights packed into "
            "bnb_4bit_quant_storage tensors, which this course has not measured; estimate DDP "
            "(strategy='ddp') or one process"
        )
    if kw.get("dora"):
        raise ValueError(
            "the FSDP estimate does not model DoRA (its magnitudes under FSDP2 are not "
            "measured here): estimate DDP (strategy='ddp') or one process"
        )
    if kw.get("bf16_update") == "stochastic" and device_type == "cpu":
        raise ValueError(
            "torchao's stochastic-rounding step on a CPU allocates scratch that only its "
            "unsharded trace knows: estimate FSDP with bf16_update 'stochastic' for "
            "device='cuda', or 'kahan' / 'nearest' on the CPU"
        )


def _fsdp_walk(info: ModelInfo, kw: dict) -> str:
    """Which one-process walk the FSDP estimate shards: "analytical" (the stage model's
    moments, lesson 16's savers included) or "traced" (the trace's moments: LoRA, selective
    checkpointing, offloaded activations, and families without a stage model)."""
    path = kw.get("path", "auto")
    if path != "auto":
        return path
    if kw.get("optimizer_in_backward") or kw.get("loss_chunk") or kw.get("moments") is not None:
        return "analytical"
    plain = all(kw.get(k, v) == v for k, v in FSDP_ANALYTICAL.items())
    sixteen = info.weight_dtype == "fp32" or info.family in SIXTEEN_BIT_FAMILIES
    return "analytical" if plain and info.family != TRACED and sixteen else "traced"


def _device_type(kwargs: dict) -> str:
    """The device type ``estimate`` will model for these keyword arguments."""
    return resolve(kwargs.get("device")).type


def _ddp(one: Estimate, info: ModelInfo, world_size: int, device_type: str) -> RankEstimate:
    """One process's account plus the gradient buckets, alive through the whole step."""
    # DDP's buckets hold the gradients in their own dtype (bf16 weights: 2 B each).
    trained = sum(p.nbytes for p in info.params if p.trainable)
    buckets = allocation_bytes(trained, device_type)  # one storage per bucket
    fields = {k: v for k, v in one.as_dict().items()}
    fields.update(peak=one.peak + buckets, communication_buffers=buckets)
    return RankEstimate(**fields, world_size=world_size, strategy="ddp")


def shard_rows(p: ParamInfo, world_size: int) -> int:
    """Rows of ``p`` each process keeps: FSDP2 shards dimension 0 into ceil(d0/N) rows each."""
    return -(-p.shape[0] // world_size) if p.shape else 1


def sharded(p: ParamInfo, world_size: int) -> ParamInfo:
    """``p`` as one process's shard (the padded share: every process's has this size)."""
    return replace(p, shape=(shard_rows(p, world_size), *p.shape[1:]))


@dataclass(frozen=True)
class FsdpUnit:
    """One ``fully_shard`` call: its modules, and whether forward's end reshards them."""

    name: str  # "L0", "L1", ... (transformer layers), else the module's name; "root" last
    modules: tuple  # the modules sharded together (the root: the model itself)
    reshard_after_forward: bool


_LAYER_NAME = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)$")


def fsdp_units(model) -> list[FsdpUnit]:
    """The FSDP2 units Accelerate 1.15 makes of a transformers model (``fsdp2_prepare_model``
    with TRANSFORMER_BASED_WRAP): each module of a class the model names in
    ``_no_split_modules`` (its layers), the input embedding unless tied to the head, the
    final norm with the head (kept gathered from the end of forward to the start of
    backward), then the root (whatever is left; PyTorch keeps the root gathered between
    forward and backward). A module whose parameters a unit already holds is skipped."""
    units, claimed = [], set()

    def add(name: str, modules: list, reshard: bool) -> None:
        params = {id(p) for m in modules for p in m.parameters()}
        if params and not params & claimed:
            claimed.update(params)
            units.append(FsdpUnit(name, tuple(modules), reshard))

    classes = set(getattr(model, "_no_split_modules", None) or ())
    for name, module in model.named_modules():
        if type(module).__name__ in classes:
            match = _LAYER_NAME.search(name)
            add(f"L{match.group(1)}" if match else name, [module], True)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and embed is not None and head.weight is embed.weight
    if embed is not None and not tied:
        add("embed", [embed], True)
    tail = [m for m in (_final_norm(model), *((embed,) if tied else ()), head) if m is not None]
    if tail:
        add("tail", tail, False)
    return [*units, FsdpUnit("root", (model,), False)]


def _final_norm(model):
    """The last normalisation among the base model's direct children (Accelerate's rule);
    a LoRA model's (peft's ``PeftModel``) is its base model's."""
    unwrap = getattr(model, "get_base_model", None)
    model = unwrap() if callable(unwrap) else model
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    norms = [m for m in base.children() if "Norm" in type(m).__name__]
    return norms[-1] if norms else None


def fsdp_groups(info: ModelInfo) -> dict[str, list[ParamInfo]]:
    """The parameters of each FSDP2 unit (``fsdp_units``), in the order the model lists them;
    "root" holds what no other unit took."""
    owner, _ = _units_of(_config_key(info.config))
    groups: dict[str, list[ParamInfo]] = {}
    for p in info.params:
        groups.setdefault(_unit_of(p.name, owner), []).append(p)
    return groups


_PEFT_PREFIX = "base_model.model."  # peft's PeftModel and LoraModel around the model


def _unit_of(name: str, owner: dict[str, str]) -> str:
    """The unit of the parameter ``name``: that of the innermost module a unit holds among
    its parents (a LoRA model's names too: peft's prefix dropped, its adapters and
    ``base_layer`` inside the module they adapt); "root" if none."""
    parts = name.removeprefix(_PEFT_PREFIX).split(".")
    for i in range(len(parts) - 1, 0, -1):
        unit = owner.get(".".join(parts[:i]))
        if unit is not None:
            return unit
    return "root"


def _config_key(config: dict) -> str:
    """A hashable form of a ModelInfo's config (for the cache below)."""
    return json.dumps({k: v for k, v in config.items() if k != EXPERTS_KEY}, sort_keys=True,
                      default=str)  # fmt: skip


@functools.lru_cache(maxsize=16)
def _units_of(config_json: str) -> tuple[dict[str, str], dict[str, bool]]:
    """Module name -> FSDP2 unit (the modules each unit shards, the root aside), and unit ->
    reshard after forward, from the model built on the meta device."""
    with torch.device("meta"):
        net = build_model(load_config(json.loads(config_json)))
    units = fsdp_units(net)
    owner = {id(m): u.name for u in units[:-1] for m in u.modules}
    names = {name: owner[id(m)] for name, m in net.named_modules() if id(m) in owner}
    return names, {u.name: u.reshard_after_forward for u in units}


def _gathered_bytes(params: list[ParamInfo], world_size: int, device_type: str) -> int:
    """Bytes of a unit gathered whole: N padded shares of each tensor."""
    return sum(allocation_bytes(sharded(p, world_size).nbytes * world_size, device_type)
               for p in params)  # fmt: skip


@dataclass(frozen=True)
class _Shards:
    """One process's share of the model state, and the units gathered whole, in bytes."""

    params: int
    gradients: int
    optimizer_state: int
    step_temporaries: int  # the optimizer step's scratch over the shards
    gathered: dict  # unit name -> bytes gathered whole ("root" included)
    # A MixedPrecisionPolicy's backward: each unit's gradients copied into the reduce-scatter
    # input in reduce_dtype (fp32: 2 bytes per gathered bf16 byte), beside the bf16 ones.
    reduce_input: int = 0


def _shards(info, world_size, optimizer, device_type, bf16_update="nearest",
            state_info=None) -> _Shards:  # fmt: skip
    """The sharded parameters, gradients, optimizer state and step scratch of ``info`` (of
    ``state_info``, the fp32 shards, where a MixedPrecisionPolicy gathers ``info`` in bf16),
    and the units as ``info`` gathers them."""
    shards = [sharded(p, world_size) for p in (state_info or info).params]
    trainable = [p for p in shards if p.trainable]

    def nbytes(params):
        return sum(allocation_bytes(p.nbytes, device_type) for p in params)

    temporaries = optimizer_step_temporaries(optimizer, trainable, device_type, bf16_update)
    groups = fsdp_groups(info)
    return _Shards(
        params=nbytes(shards),
        gradients=nbytes(trainable),
        optimizer_state=optimizer_state_bytes(optimizer, trainable, device_type, bf16_update),
        step_temporaries=temporaries,
        gathered={k: _gathered_bytes(v, world_size, device_type) for k, v in groups.items()},
        reduce_input=0 if state_info is None else 2,
    )


def _rank_estimate(one, info, world_size, sh: _Shards, peak: int, where: str) -> RankEstimate:
    """``one`` (the one-process estimate) with the sharded state, the peak of the sharded walk
    and what FSDP adds: the root and the largest unit gathered, two all-gather outputs."""
    fields = {k: v for k, v in one.as_dict().items()}
    fields.update(params=sh.params, gradients=sh.gradients, optimizer_state=sh.optimizer_state,
                  peak=peak, peak_at=where)  # fmt: skip
    root = sh.gathered.get("root", 0)
    units = [v for k, v in sh.gathered.items() if k != "root"]
    return RankEstimate(**fields, world_size=world_size, strategy="fsdp",
                        gathered_params=root + max(units, default=0),
                        communication_buffers=_all_gather_pairs(info, sh.gathered))  # fmt: skip


def _fsdp(one, info, world_size, moments, sh: _Shards) -> RankEstimate:
    """The one-process walk with the model state sharded (``sh``) and the gathered units added."""
    params, grads, opt, opt_temp = sh.params, sh.gradients, sh.optimizer_state, sh.step_temporaries
    gathered = sh.gathered
    root = gathered.get("root", 0)
    state = params + info.buffer_bytes + opt
    at_stage = _stage_units(info, gathered)
    peak, where = 0, ""
    for m in moments:
        if m.label == "optimizer step":
            total = state + grads + opt_temp
        else:  # the units computing now, gathered, and their all-gather buffers; the root always
            stage = m.label.split(": ", 1)[1]
            total = state + m.gradients + m.activations + m.temporaries + root
            unit = at_stage.get(stage, at_stage.get(stage.split(".")[0], 0))
            total += (2 + sh.reduce_input * m.label.startswith("backward")) * unit
        if total > peak:
            peak, where = total, m.label
    return _rank_estimate(one, info, world_size, sh, peak, where)


def _fsdp_traced(one, info, world_size, batch_size, seq_len, device_type, kw,
                 state_info=None) -> RankEstimate:  # fmt: skip
    """The trace's walk (``Traced.moments``) with the model state sharded and, at each
    moment, the root and the unit computing gathered with its all-gather buffer: a layer's
    within a layer; the head's (final norm, head, loss) after the last layer; before the
    first layer and between layers, the larger of the input embedding's and a layer's (the
    trace's moments do not tell the two apart). As in the stage model's walk, gradients
    already reduce-scattered count whole, so the peak errs high."""
    optimizer = kw.get("optimizer", "adamw")
    bf16_update = kw.get("bf16_update", "nearest")
    sh = _shards(info, world_size, optimizer, device_type, bf16_update, state_info)
    t = trace_of(info, batch_size, seq_len, kw.get("precision", "fp32"), optimizer,
                 kw.get("gradient_checkpointing", False), kw.get("attn", "eager"),
                 kw.get("grad_accum", 1), device_type, info.weight_dtype != "fp32", bf16_update,
                 (kw.get("checkpoint_policy", "full"), kw.get("offload_activations", False)),
                 )  # fmt: skip
    root = sh.gathered.get("root", 0)
    layers = max((v for k, v in sh.gathered.items() if k not in _NOT_LAYERS), default=0)
    front = sh.gathered.get("embed", sh.gathered.get("tail", 0))  # tied: the head's unit
    units = {"": max(front, layers), "first": max(front, layers), "middle": layers,
             "last": sh.gathered.get("tail", 0)}  # fmt: skip
    n = info.config.get("num_hidden_layers", 0)
    state = sh.params + sh.optimizer_state
    peak, where = sh.params + t.buffers + sh.optimizer_state + sh.gradients, "optimizer step"
    peak += sh.step_temporaries + t.leftovers
    for (phase, _, role, last), row in t.moments:
        if phase == "optimizer step":
            continue
        unit = layers if role else units[last]
        unit *= 2 + sh.reduce_input * (phase == "backward")
        total = row["total"] - row["params"] + state + root + unit
        if total > peak:
            peak, where = total, f"{phase}: {_where(role, last, n)}"
    return _rank_estimate(one, info, world_size, sh, peak, where)


_NOT_LAYERS = ("embed", "tail", "root")


def _where(role: str, last: str, n: int) -> str:
    """A traced moment in words: the layer running, or the last one seen."""
    layer = {"first": "layer 0", "middle": "a middle layer", "last": f"layer {n - 1}"}
    return layer[role] if role else f"after {layer[last]}" if last else "model"


def _stage_units(info: ModelInfo, gathered: dict[str, int]) -> dict[str, int]:
    """Bytes of the units (root aside) whose parameters each stage of the stage model uses;
    the loss uses the head's (it computes after the head, which stays gathered)."""
    owner = {p.name: unit for unit, params in fsdp_groups(info).items() for p in params}
    units: dict[str, set] = {}
    for p in info.params:
        if owner[p.name] != "root":
            units.setdefault(p.stage, set()).add(owner[p.name])
    out = {stage: sum(gathered[u] for u in names) for stage, names in units.items()}
    out["loss"] = out.get("head", 0)
    return out


def _gather_order(info: ModelInfo, gathered: dict[str, int]) -> list[int]:
    """Bytes of each all-gather of a step, in order: every unit in forward (the root first),
    then, in backward, the units forward resharded, in reverse."""
    _, reshard = _units_of(_config_key(info.config))
    forward = ["root", *(k for k in gathered if k != "root")]
    again = [k for k in reversed(forward) if reshard.get(k)]
    return [gathered[k] for k in (*forward, *again) if gathered.get(k)]


def fsdp_all_gathers(model, world_size: int, device_type: str = "cpu") -> list[int]:
    """Bytes of every all-gather FSDP2 issues in one step, in order (forward, then backward)."""
    info = describe_model(model)
    gathered = {k: _gathered_bytes(v, world_size, device_type)
                for k, v in fsdp_groups(info).items()}  # fmt: skip
    return _gather_order(info, gathered)


def _all_gather_pairs(info: ModelInfo, gathered: dict[str, int]) -> int:
    """The most all-gather output alive at once: FSDP2 keeps a unit's buffer until the next
    unit's all-gather is issued, so two consecutive all-gathers' outputs."""
    order = _gather_order(info, gathered)
    return max((a + b for a, b in itertools.pairwise(order)), default=sum(order))


# --------------------------------------------------------------------------------------------
# Bytes between devices in one optimizer step


@dataclass(frozen=True)
class Exchange:
    """One transfer of a step: who moves what, and how many bytes."""

    scheme: str  # "DP", "DDP", "FSDP"
    what: str  # "weights replicated from GPU 0", "gradients all-reduced", ...
    collective: str  # "scatter", "broadcast", "gather", "reduce", "all-reduce", ...
    payload: int  # bytes of the full tensors involved
    moved: int  # bytes GPU 0 sends plus receives (ring algorithms for the collectives)


def traffic(model, world_size: int, batch_size: int, seq_len: int) -> list[Exchange]:
    """The exchanges of one optimizer step (no accumulation) of DP, DDP and FSDP2, fp32.

    ``batch_size`` is per GPU. DataParallel, per step: GPU 0 scatters the batch, copies the
    weights to every other GPU, gathers every output the model returns (the logits at least;
    any cache it returns too) and the losses, scatters the loss gradient, and receives every
    GPU's gradients to sum them. DDP all-reduces the gradients (and broadcasts the buffers
    before each forward). FSDP2 all-gathers every unit's parameters in forward, the layers' and
    the input embedding's again in backward (the head and the root stay gathered), and
    reduce-scatters the gradients. A ring all-reduce moves 2(N-1)/N of its payload through each
    GPU in each direction; all-gather and reduce-scatter (N-1)/N. Token ids and labels are
    int64.
    """
    info = describe_model(model)
    n, w = info.n_trainable, world_size
    grads = FP32 * n
    ring = (w - 1) / w
    inputs = 2 * INT64 * batch_size * seq_len * w  # input_ids and labels, all GPUs' samples
    causal = info.model_type not in ENCODER_TYPES  # a causal LM (helpers.models.task_kind)
    per_sample = seq_len * info.config["vocab_size"] if causal else _labels(info)
    outputs = FP32 * (batch_size * per_sample + 1) * w  # logits and the loss, every GPU's
    gathered = {k: _gathered_bytes(v, w, "cpu") for k, v in fsdp_groups(info).items()}
    _, reshard = _units_of(_config_key(info.config))
    again = sum(v for k, v in gathered.items() if reshard.get(k))  # layers, input embedding
    weights, buffers = FP32 * info.n_params + info.buffer_bytes, info.buffer_bytes
    whole = sum(gathered.values())  # every unit, each tensor padded to N equal shares
    rows = [
        ("DP", "batch scattered from GPU 0", "scatter", inputs, ring * inputs),
        ("DP", "weights (and buffers) copied from GPU 0", "broadcast", weights, (w - 1) * weights),
        ("DP", "outputs (logits, loss) gathered on GPU 0", "gather", outputs, ring * outputs),
        ("DP", "loss gradient scattered", "scatter", FP32 * w, FP32 * (w - 1)),
        ("DP", "gradients summed on GPU 0", "reduce", grads, (w - 1) * grads),
        ("DDP", "buffers broadcast before forward", "broadcast", buffers, (w - 1) * buffers),
        ("DDP", "gradients all-reduced", "all-reduce", grads, 4 * ring * grads),
        ("FSDP", "parameters gathered for forward", "all-gather", whole, 2 * ring * whole),
        ("FSDP", "units gathered again for backward", "all-gather", again, 2 * ring * again),
        ("FSDP", "gradients reduce-scattered", "reduce-scatter", whole, 2 * ring * whole),
    ]
    return [Exchange(*row[:4], round(row[4])) for row in rows]


def _labels(info: ModelInfo) -> int:
    """A classifier's outputs per sample: its number of labels (transformers' default 2)."""
    return len(info.config.get("id2label") or {}) or 2
