"""Models built from transformers configs, locally: random weights cost the same memory and time."""

from __future__ import annotations

import json
import os
import socket
import warnings
from importlib import resources
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import AutoConfig, PretrainedConfig

from helpers import compat

# Encoder families train sequence classification; everything else trains a causal LM.
ENCODER_TYPES = {"bert", "roberta", "distilbert", "electra", "albert", "deberta", "deberta-v2",
                 "xlm-roberta", "modernbert"}  # fmt: skip


def config_path(name: str) -> Path:
    """Path of a bundled transformers config JSON (``bert-tiny``, ``llama-7b``, ...)."""
    folder = resources.files("helpers") / "configs"
    path = folder / f"{name}.json"
    if not path.is_file():
        known = sorted(p.name.removesuffix(".json") for p in folder.iterdir())
        raise FileNotFoundError(f"no bundled config {name!r}; bundled: {', '.join(known)}")
    return Path(str(path))


def load_config(spec: str | Path | dict) -> PretrainedConfig:
    """A transformers config from a bundled name, JSON path, dict, or (with a hub) a model id."""
    if isinstance(spec, dict):
        data = dict(spec)
    else:
        path = Path(spec)
        if not path.is_file():
            try:
                path = config_path(str(spec))
            except FileNotFoundError as missing:
                if path.suffix == ".json":
                    raise FileNotFoundError(f"no config file {spec}") from None
                return _from_hub(str(spec), missing)
        data = json.loads(path.read_text())
    if "model_type" not in data:
        raise ValueError(f"config {spec} has no 'model_type': is it a transformers config.json?")
    return AutoConfig.for_model(data.pop("model_type"), **data)


def _from_hub(model_id: str, missing: FileNotFoundError) -> PretrainedConfig:
    """A model id's config: from the local Hugging Face cache (instant, offline), else from the
    hub where it answers. Offline, one line at once instead of the hub client's retries (about
    30 s of them where no name resolves)."""
    try:
        return AutoConfig.from_pretrained(model_id, local_files_only=True)
    except (OSError, ValueError):
        pass
    host = hub_host()
    if host is None:
        raise FileNotFoundError(
            f"{model_id!r} is not a file nor in the Hugging Face cache, and the hub is not "
            f"reachable from here. {missing}. Or pass a config.json path."
        ) from None
    try:
        return AutoConfig.from_pretrained(model_id)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(
            f"{model_id!r} is not a file, and the hub ({host}) could not give its config "
            f"({type(err).__name__}). {missing}. Or pass a config.json path."
        ) from None


def hub_host(timeout: float = 3.0) -> str | None:
    """The Hugging Face hub's host (``HF_ENDPOINT``'s, or huggingface.co) if a connection to it
    opens within ``timeout`` seconds; None offline or with ``HF_HUB_OFFLINE`` set."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = url.hostname or "huggingface.co"
    try:
        socket.create_connection((host, url.port or 443), timeout=timeout).close()
    except OSError:
        return None
    return host


def task_kind(config: PretrainedConfig) -> str:
    """``classify`` for encoder configs, ``causal-lm`` for decoders (MoE included)."""
    return "classify" if config.model_type in ENCODER_TYPES else "causal-lm"


# RunConfig.weight_dtype -> the dtype the model is built in (names.WEIGHT_DTYPES).
WEIGHT_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_model(
    config: PretrainedConfig,
    attn: str = "eager",
    device: torch.device | str = "cpu",
    seed: int = 0,
    dropout: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """A randomly initialised model for the config's task, in ``dtype`` (fp32), on ``device``.

    ``attn`` is the attention implementation (``eager`` or ``sdpa``); ``dropout`` overrides
    the config's dropout rates (0.0 makes runs deterministic for gradient comparisons).
    """
    # the model classes import transformers' modeling code (and torchao where installed)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = config.__class__.from_dict(config.to_dict())  # never mutate the caller's config
    if dropout is not None:
        for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout"):
            if hasattr(config, key):
                setattr(config, key, dropout)
    torch.manual_seed(seed)
    auto = (
        AutoModelForSequenceClassification
        if task_kind(config) == "classify"
        else AutoModelForCausalLM
    )
    if torch.device(device) == torch.device("cpu"):
        # fake tensors (helpers.estimator.traced) are made in the current mode, on the CPU
        return auto.from_config(config, attn_implementation=attn, dtype=dtype)
    with torch.device(device):  # initialised where it trains: no CPU copy to build and move
        return auto.from_config(config, attn_implementation=attn, dtype=dtype)


def count_params(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def enable_checkpointing(model: torch.nn.Module, context_fn=None) -> None:
    """Turn on transformers' activation (gradient) checkpointing, non-reentrant.

    ``context_fn``: ``torch.utils.checkpoint``'s (the contexts for the forward and for the
    recomputation). The method's name depends on the transformers version (helpers.compat).
    """
    model.config.use_cache = False  # training never uses the KV cache; checkpointing forbids it
    kwargs = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    compat.checkpointing_enable(model, kwargs)


def disable_checkpointing(model: torch.nn.Module) -> None:
    """Turn transformers' activation checkpointing off again (``enable_checkpointing``'s undo)."""
    compat.checkpointing_disable(model)


# LoRA (lesson 13): what RunConfig(lora_r=...) and the estimator apply to a model.


def parse_targets(targets: str) -> list[str] | str | None:
    """RunConfig.lora_targets as peft takes it: a list of names, "all-linear", or None (default)."""
    targets = targets.strip()
    if not targets:
        return None
    if targets == "all-linear":
        return targets
    return [t.strip() for t in targets.split(",") if t.strip()]


def lora_config(
    kind: str, r: int, targets: str = "", alpha: float | None = None, dora: bool = False
):
    """A peft LoraConfig: rank r, alpha 2r unless given, no dropout, the task from ``kind``;
    ``dora``: DoRA's trained magnitude per output row (``use_dora``, lesson 13)."""
    from peft import LoraConfig, TaskType  # optional; imports bitsandbytes

    if r < 1:
        raise ValueError(f"LoRA rank must be at least 1, got {r}")
    task = TaskType.SEQ_CLS if kind == "classify" else TaskType.CAUSAL_LM
    return LoraConfig(
        r=r,
        lora_alpha=2 * r if alpha is None else alpha,
        target_modules=parse_targets(targets),
        lora_dropout=0.0,
        task_type=task,
        use_dora=dora,
    )


def apply_lora(
    model: torch.nn.Module, r: int, targets: str = "", alpha: float | None = None,
    dora: bool = False,
):  # fmt: skip
    """``peft.get_peft_model`` on a transformers model: weights frozen, adapters added."""
    from peft import get_peft_model  # optional; imports bitsandbytes

    config = lora_config(task_kind(model.config), r, targets, alpha, dora)
    with warnings.catch_warnings():  # peft calls a transformers method renamed in v5
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        return get_peft_model(model, config)
