"""Lesson 13 (notebooks/13_peft_lora.ipynb).

LoRA with the peft package: the layers it adapts, models on the meta device, 4-bit weight
bytes, a step's memory, a figure; the notebook counts the adapters by hand.

LoRA (Hu et al., 2021) freezes a Linear layer's weight W (out x in) and learns a low-rank
update beside it: y = W x + (alpha / r) B A x, with A (r x in) and B (out x r). B starts at
zero, so the adapted model starts out equal to the base model. Each adapted layer adds
r·(in + out) trainable numbers; the frozen weights keep no gradients and no optimizer state.
``helpers.models.apply_lora`` adds the adapters; ``helpers.train.RunConfig(lora_r=...)`` trains
this way and ``helpers.estimator`` predicts it.
"""

from __future__ import annotations

import torch

from helpers.estimator.qlora import nf4_bytes
from helpers.memory import CategoryTracker, dora_graphs_collected
from helpers.models import load_config, parse_targets, task_kind
from helpers.train import make_optimizer, train_step


def target_names(model: torch.nn.Module, targets: str = "") -> list[str]:
    """Names of the nn.Linear modules peft adapts for ``targets`` (as RunConfig.lora_targets)."""
    # optional; imports bitsandbytes
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    wanted = parse_targets(targets)
    if wanted is None:
        wanted = DEFAULTS[model.config.model_type]
    output = model.get_output_embeddings()
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if wanted == "all-linear":  # every Linear but the output layer (peft's rule)
            if module is not output:
                out.append(name)
        elif name.split(".")[-1] in wanted:
            out.append(name)
    return out


def four_bit_weight_bytes(
    model: torch.nn.Module, double_quant: bool = True, other_bytes: int = 2
) -> int:
    """Bytes of ``model``'s weights as ``BitsAndBytesConfig(load_in_4bit=True, ...)`` loads them.

    transformers turns every Linear but the output layer into bitsandbytes' 4-bit ``Linear4bit``
    (its ``get_keys_to_not_convert`` keeps the output layer); each such weight takes
    ``helpers.estimator.qlora.nf4_bytes`` (codes and scales; ``double_quant``: 8-bit scales).
    Everything else (embeddings, the output layer, norms, biases) keeps ``other_bytes`` per
    number: 2 as loaded in 16 bits, 4 once ``prepare_model_for_kbit_training`` casts it to fp32.
    """
    four_bit = {id(model.get_submodule(name).weight) for name in target_names(model, "all-linear")}
    return sum(
        nf4_bytes(p.numel(), double_quant) if id(p) in four_bit else other_bytes * p.numel()
        for p in model.parameters()
    )


def meta_model(config):
    """The model for ``config`` (name, path, dict or config) on the meta device: no storage."""
    # the model classes import transformers' modeling code: seconds
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = config if hasattr(config, "model_type") else load_config(config)
    auto = (
        AutoModelForSequenceClassification
        if task_kind(config) == "classify"
        else AutoModelForCausalLM
    )
    with torch.device("meta"):
        return auto.from_config(config, dtype=torch.float32)


def step_memory(model: torch.nn.Module, batch: dict) -> dict:
    """Per-category peaks (``CategoryTracker``, view 1) of one steady-state AdamW step on the
    trainable parameters of ``model`` (a transformers model, or a peft one): an untracked step
    first creates the optimizer state, as ``helpers.train.measure`` does. For variants that
    ``RunConfig`` has no field for (PiSSA, OLoRA, lesson 13). DoRA's dropped graphs are
    collected as the tracker needs (``helpers.memory.dora_graphs_collected``)."""
    optimizer = make_optimizer("adamw", model)  # the trainable parameters only
    train_step(model, optimizer, [batch])
    tracker = CategoryTracker(device=next(model.parameters()).device)
    tracker.track_external(model, optimizer)
    with dora_graphs_collected(model), tracker:
        train_step(model, optimizer, [batch])
    return tracker.peaks().as_dict()


def proportion_figure(x, measured: dict, slopes: dict, xlabel: str, ylabel: str, title: str = ""):
    """Log-log: measured points as markers, y = slope·x as grey reference lines."""
    from matplotlib.figure import Figure  # slow: only figures need it
    from matplotlib.ticker import NullLocator  # slow: only figures need it

    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    for (name, ys), marker in zip(measured.items(), "osD^v", strict=False):
        ax.plot(x, ys, marker, markersize=9, markerfacecolor="none", label=name)
    lo, hi = min(x), max(x)
    for (name, slope), style in zip(slopes.items(), ("--", ":", "-."), strict=False):
        ax.plot([lo, hi], [slope * lo, slope * hi], style, color="grey", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(list(x), [f"{v:,}" for v in x])  # ticks at the measured points, plain
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small", loc="upper left")
    ax.grid(alpha=0.3)
    return fig
