"""The model's tensors, from a meta-device build: what the estimator knows of a config."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PretrainedConfig,
)

from helpers.models import WEIGHT_TORCH_DTYPES, apply_lora, load_config, task_kind
from helpers.optimizer_state import hidden_matrices

FP32 = 4


INT64 = 8


DECODERS = ("llama", "mistral", "qwen2")


MOE = ("mixtral",)


ENCODERS = ("bert",)


SUPPORTED = ENCODERS + DECODERS + MOE  # families with an analytical stage model

TRACED = "traced"  # every other family: estimated on fake tensors (helpers.estimator.traced)


@dataclass(frozen=True)
class ParamInfo:
    """One parameter tensor: where it lives in the step and how optimizers and autocast see it."""

    name: str
    shape: tuple[int, ...]
    stage: str  # "embed" | "L{i}.attn" | "L{i}.mlp" | "head"
    embedding: bool = False  # an nn.Embedding weight (8-bit AdamW keeps it 32-bit)
    cast: bool = False  # enters an autocast matmul as a Parameter: gets a cached 16-bit copy
    trainable: bool = True
    dtype: torch.dtype = torch.float32  # as stored: fp32, or bf16 (RunConfig.weight_dtype)
    hidden: bool = False  # a hidden layer's 2-D matrix: Muon's (optimizer_state.hidden_matrices)

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def copied(self) -> bool:
        """Whether autocast makes a 16-bit copy of it: an fp32 weight entering a matmul (a
        16-bit weight is used as it is)."""
        return self.cast and self.dtype == torch.float32

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor (and of its gradient, which has its dtype)."""
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class ModelInfo:
    """What the estimator needs to know about a model: its config and its parameter tensors."""

    model_type: str
    family: str  # "encoder" | "decoder" | "moe" (analytical) | "traced" (any other)
    config: dict
    params: tuple[ParamInfo, ...]  # in model.parameters() order (the optimizer's order)
    buffer_sizes: tuple[int, ...]  # bytes of each buffer (position ids, rotary frequencies...)
    tied: bool  # the LM head shares the input embedding's weight
    weight_dtype: str = "fp32"  # how the weights are stored (LoRA adapters stay fp32)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of all buffers."""
        return sum(self.buffer_sizes)

    @property
    def n_params(self) -> int:
        """Distinct parameters (tied weights once), as ``helpers.models.count_params``."""
        return sum(p.numel for p in self.params)

    @property
    def n_trainable(self) -> int:
        """Parameters that get gradients and optimizer state."""
        return sum(p.numel for p in self.params if p.trainable)

    def _trained(self, stage: str, parts: tuple[str, ...]):
        """The trainable tensors in ``stage`` (those named with one of ``parts``, if given)."""
        return (p for p in self.params if p.stage == stage and p.trainable
                and (not parts or any(x in p.name for x in parts)))  # fmt: skip

    def numel_named(self, stage: str, *parts: str) -> int:
        """Trainable numbers in ``stage`` whose names contain one of ``parts``."""
        return sum(p.numel for p in self._trained(stage, parts))

    def stage_bytes(self, stage: str, *parts: str) -> int:
        """Bytes of the trainable tensors in ``stage`` (of those named with one of ``parts``,
        if given): of their gradients too, which have their dtype."""
        return sum(p.nbytes for p in self._trained(stage, parts))

    def stage_numel(self, stage: str, cast_only: bool = False) -> int:
        """Trainable numbers in ``stage``; with ``cast_only``, the autocast-cast ones, frozen too.

        Autocast makes a 16-bit copy of every fp32 weight that enters a matmul, trainable or
        not (a 16-bit weight is used as it is).
        """
        return sum(
            p.numel
            for p in self.params
            if p.stage == stage and (p.copied if cast_only else p.trainable)
        )


_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h)\.(\d+)\.(.*)$")


_ATTN_PARTS = ("self_attn", "attention", "input_layernorm", "attn", "ln_1")


def _family(model_type: str) -> str:
    if model_type in ENCODERS:
        return "encoder"
    if model_type in DECODERS:
        return "decoder"
    if model_type in MOE:
        return "moe"
    return TRACED


def describe_model(
    model,
    attn: str = "eager",
    lora_r: int = 0,
    lora_targets: str = "",
    weight_dtype: str = "fp32",
    dora: bool = False,
) -> ModelInfo:
    """Build ``model`` (name, path, dict or config) on the meta device and list its tensors.

    With ``lora_r`` > 0 peft adds LoRA adapters of that rank to ``lora_targets`` (as
    ``RunConfig.lora_targets``) and freezes everything else, as ``helpers.train.Trainee`` does.
    ``weight_dtype`` "bf16" builds the weights in bf16 (peft's adapters stay fp32). ``dora``:
    DoRA's adapters (a magnitude vector per adapted layer besides A and B).
    """
    if isinstance(model, ModelInfo):
        return model
    config = model if isinstance(model, PretrainedConfig) else load_config(model)
    family = _family(config.model_type)
    auto = (
        AutoModelForSequenceClassification
        if task_kind(config) == "classify"
        else AutoModelForCausalLM
    )
    with torch.device("meta"):
        dtype = WEIGHT_TORCH_DTYPES[weight_dtype]
        net = auto.from_config(config, attn_implementation=attn, dtype=dtype)
        if lora_r:
            net = apply_lora(net, lora_r, lora_targets, dora=dora)
    params = _param_infos(net)
    out_emb, in_emb = net.get_output_embeddings(), net.get_input_embeddings()
    tied = out_emb is not None and out_emb.weight is in_emb.weight
    buffers = tuple(b.numel() * b.element_size() for b in net.buffers())
    return ModelInfo(
        model_type=config.model_type,
        family=family,
        config={**config.to_dict(), EXPERTS_KEY: _experts_impl(net)},
        params=tuple(params),
        buffer_sizes=buffers,
        tied=tied,
        weight_dtype=weight_dtype,
    )


def _param_infos(net: torch.nn.Module) -> list[ParamInfo]:
    """Each parameter of a built (meta) model as the estimator sees it: its stage and role."""
    owner = {}  # the first module that holds each parameter (for a tied weight: the embedding)
    for mod in net.modules():
        for p in mod.parameters(recurse=False):
            owner.setdefault(id(p), mod)
    params, seen_layer, hidden = [], False, hidden_matrices(net)
    for name, p in net.named_parameters():
        mod = owner[id(p)]
        match = _LAYER.search(name)
        if match:
            seen_layer = True
            part = "attn" if match.group(2).startswith(_ATTN_PARTS) else "mlp"
            stage = f"L{match.group(1)}.{part}"
        else:
            stage = "head" if seen_layer else "embed"
        is_embedding = isinstance(mod, torch.nn.Embedding)
        linear = isinstance(mod, torch.nn.Linear) or type(mod).__name__ == "Conv1D"
        cast = linear or (not is_embedding and p.dim() == 2)
        params.append(
            ParamInfo(name, tuple(p.shape), stage, is_embedding, cast, p.requires_grad, p.dtype,
                      id(p) in hidden)
        )  # fmt: skip
    return params


def is_dora(info: ModelInfo) -> bool:
    """Whether the model's adapters are DoRA's (peft names its magnitudes so)."""
    return any(".lora_magnitude_vector." in p.name for p in info.params)


EXPERTS_KEY = "_experts_implementation"  # added to ModelInfo.config: not a config field


def _experts_impl(net) -> str | None:
    return getattr(net.config, "_experts_implementation", None)
