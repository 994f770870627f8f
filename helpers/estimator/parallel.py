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
    moment (``estimate(..., moments=...)``, the analytical stage model) with the model state
    replaced by its shares, plus, at each moment, the unit computing (gathered) and its
    all-gather buffer, and the root throughout. Gradients already reduce-scattered count
    whole and the buffer is kept through the unit, so the peak errs high (checked against
    FSDPMemTracker in tests/test_beyond_one_gpu.py and lesson 17).

The shards, gradients, optimizer state and gathered copies are the parameters' dtype: fp32,
or bf16 with ``weight_dtype="bf16"`` (the model built in bf16, as ``fully_shard`` without a
``MixedPrecisionPolicy`` keeps it; tests/test_beyond_one_gpu.py measures both). Over fp32
weights with a ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` (Accelerate's mixed
precision on GPUs), FSDP2 gathers 16-bit copies of fp32 shards instead: not modelled here.

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
from helpers.estimator.api import estimate
from helpers.estimator.model import EXPERTS_KEY, FP32, ModelInfo, ParamInfo, describe_model
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


# Settings the FSDP walk does not model yet, at the value it does (DDP takes them all).
FSDP_PLAIN = {"lora_r": 0, "qlora": False, "bf16_update": "nearest", "checkpoint_policy": "full",
              "offload_activations": False}  # fmt: skip


def estimate_per_rank(
    model, world_size: int, strategy: str, batch_size: int, seq_len: int, **estimate_kwargs
) -> RankEstimate:
    """Predicted bytes of one process of ``world_size``, each with ``batch_size`` samples.

    ``strategy``: "ddp" or "fsdp" (see the module doc). ``estimate_kwargs`` are
    ``helpers.estimator.estimate``'s (precision, optimizer, device, ...). FSDP is walked on the
    analytical stage model (BERT, Llama, Mistral, Qwen2, Mixtral) and needs an optimizer
    whose state is elementwise (adamw, sgd): Adafactor's factored state and bitsandbytes'
    8-bit state are not defined on sharded tensors the same way.
    """
    if strategy not in PARALLEL_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: use one of {PARALLEL_STRATEGIES}")
    if world_size < 1:
        raise ValueError("world_size must be at least 1")
    kw = estimate_kwargs
    info = describe_model(model, kw.get("attn", "eager"), kw.get("lora_r", 0),
                          kw.get("lora_targets", ""), kw.get("weight_dtype", "fp32"))  # fmt: skip
    if strategy == "ddp":
        one = estimate(info, batch_size, seq_len, **estimate_kwargs)
        return _ddp(one, info, world_size, _device_type(estimate_kwargs))
    optimizer = estimate_kwargs.get("optimizer", "adamw")
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"the FSDP estimate models adamw and sgd, not {optimizer!r}")
    unmodelled = [k for k, plain in FSDP_PLAIN.items() if kw.get(k, plain) != plain]
    if unmodelled:
        names = ", ".join(unmodelled)
        raise ValueError(
            f"the FSDP estimate walks the analytical stage model, which has no {names} yet: "
            "leave them at their defaults or estimate DDP"
        )
    moments: list = []
    kwargs = {**estimate_kwargs, "path": "analytical"}
    one = estimate(info, batch_size, seq_len, moments=moments, **kwargs)
    return _fsdp(one, info, world_size, optimizer, moments, _device_type(estimate_kwargs))


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
    """The last normalisation among the base model's direct children (Accelerate's rule)."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    norms = [m for m in base.children() if "Norm" in type(m).__name__]
    return norms[-1] if norms else None


def fsdp_groups(info: ModelInfo) -> dict[str, list[ParamInfo]]:
    """The parameters of each FSDP2 unit (``fsdp_units``), in the order the model lists them;
    "root" holds what no other unit took."""
    owner, _ = _units_of(_config_key(info.config))
    groups: dict[str, list[ParamInfo]] = {}
    for p in info.params:
        groups.setdefault(owner.get(p.name, "root"), []).append(p)
    return groups


def _config_key(config: dict) -> str:
    """A hashable form of a ModelInfo's config (for the cache below)."""
    return json.dumps({k: v for k, v in config.items() if k != EXPERTS_KEY}, sort_keys=True,
                      default=str)  # fmt: skip


@functools.lru_cache(maxsize=16)
def _units_of(config_json: str) -> tuple[dict[str, str], dict[str, bool]]:
    """Parameter name -> FSDP2 unit, and unit -> reshard after forward, from the model built
    on the meta device."""
    with torch.device("meta"):
        net = build_model(load_config(json.loads(config_json)))
    units = fsdp_units(net)
    owner = {id(p): u.name for u in units[:-1] for m in u.modules for p in m.parameters()}
    names = {name: owner[id(p)] for name, p in net.named_parameters() if id(p) in owner}
    return names, {u.name: u.reshard_after_forward for u in units}


def _gathered_bytes(params: list[ParamInfo], world_size: int, device_type: str) -> int:
    """Bytes of a unit gathered whole: N padded shares of each tensor."""
    return sum(allocation_bytes(sharded(p, world_size).nbytes * world_size, device_type)
               for p in params)  # fmt: skip


def _fsdp(one, info, world_size, optimizer, moments, device_type) -> RankEstimate:
    """The one-process walk with the model state sharded and the gathered units added."""
    shards = [sharded(p, world_size) for p in info.params]
    trainable = [p for p in shards if p.trainable]

    def nbytes(params):
        return sum(allocation_bytes(p.nbytes, device_type) for p in params)

    params, grads = nbytes(shards), nbytes(trainable)
    opt = optimizer_state_bytes(optimizer, trainable, device_type)
    opt_temp = optimizer_step_temporaries(optimizer, trainable, device_type)
    gathered = {k: _gathered_bytes(v, world_size, device_type)
                for k, v in fsdp_groups(info).items()}  # fmt: skip
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
            total += 2 * at_stage.get(stage, at_stage.get(stage.split(".")[0], 0))
        if total > peak:
            peak, where = total, m.label
    fields = {k: v for k, v in one.as_dict().items()}
    fields.update(params=params, gradients=grads, optimizer_state=opt, peak=peak, peak_at=where)
    units = [v for k, v in gathered.items() if k != "root"]
    return RankEstimate(**fields, world_size=world_size, strategy="fsdp",
                        gathered_params=root + max(units, default=0),
                        communication_buffers=_all_gather_pairs(info, gathered))  # fmt: skip


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
