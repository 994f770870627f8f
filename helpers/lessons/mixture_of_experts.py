"""Lesson 09, sections 1-6 (notebooks/09_mixture_of_experts.ipynb): counts, FLOPs, figures,
and where a peft LoRA config puts its adapters.

The block by hand, the FFN parameter count, the router's load (with transformers' auxiliary
loss and the router z-loss) and the LoRA configs are the notebook's own cells.

Mixture of experts: a sparse Mixtral-style model next to the dense model of equal active width.

The bundled pairs (``mixtral-tiny`` / ``mixtral-tiny-dense``, ``mixtral-500m`` /
``mixtral-500m-dense``) share everything but the feed-forward block: the sparse one has E
experts of width I and routes each token to k of them; the dense one has one FFN of width
k*I. Per token both do the same FFN arithmetic, but the sparse one stores E/k times the FFN
weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers.models import load_config

PAIRS = {
    "tiny": ("mixtral-tiny", "mixtral-tiny-dense"),
    "full": ("mixtral-500m", "mixtral-500m-dense"),
}


def pair_for(scale_name: str) -> tuple[str, str]:
    """(sparse, dense) bundled config names for a scale."""
    return PAIRS[scale_name]


@dataclass
class FlopCountResult:
    """FLOPs of one forward+backward per token, and their split."""

    per_token: float  # the whole model's FLOPs per token
    ffn_per_token: float  # the experts' or the dense MLP's share
    router_per_token: float  # the routers' share (part of ffn_per_token)


def _config(name: str, top_k: int | None = None):
    """The bundled config ``name``, routing each token to ``top_k`` experts if given."""
    config = load_config(name)
    if top_k is not None:
        config.num_experts_per_tok = top_k
    return config


def train_flops_per_token(
    name: str, batch: int, seq_len: int, top_k: int | None = None
) -> FlopCountResult:
    """Count forward+backward FLOPs per token with torch's FlopCounterMode.

    ``top_k`` overrides the experts each token is routed to (a sparse config only).

    Experts run with transformers' "eager" implementation (a loop over experts, each a plain
    matmul on its own tokens), which the counter sees op by op; the faster default
    ("grouped_mm") is a single fused call that the counter does not attribute.
    """
    from transformers import AutoModelForCausalLM  # the modeling code: seconds

    config = _config(name, top_k)
    extra = {"experts_implementation": "eager"} if hasattr(config, "num_local_experts") else {}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, **extra)
    ids = torch.randint(0, config.vocab_size, (batch, seq_len))  # (B, S)
    counter = FlopCounterMode(display=False)
    with counter:
        model(input_ids=ids, labels=ids).loss.backward()
    by_module = {mod: sum(ops.values()) for mod, ops in counter.get_flop_counts().items()}
    ffn = sum(n for mod, n in by_module.items() if re.fullmatch(r".*\.layers\.\d+\.mlp", mod))
    router = sum(
        n for mod, n in by_module.items() if re.fullmatch(r".*\.layers\.\d+\.mlp\.gate", mod)
    )
    tokens = batch * seq_len
    return FlopCountResult(counter.get_total_flops() / tokens, ffn / tokens, router / tokens)


def block_io(model: torch.nn.Module, layer: int, input_ids: torch.Tensor):
    """(input, output) of decoder layer ``layer``'s feed-forward block in a forward pass.

    A forward hook on ``model.model.layers[layer].mlp`` (the sparse MoE block in a Mixtral)
    records the hidden states the block receives (after attention and the norm) and what it
    returns, so the block can be recomputed by hand on real inputs.
    """
    captured = {}
    block = model.model.layers[layer].mlp
    hook = block.register_forward_hook(lambda m, args, out: captured.update(x=args[0], y=out))
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        hook.remove()
    return captured["x"], captured["y"]


def router_heatmap(shares: list[list[float]], top_k: int, title: str = ""):
    """Layers x experts: each expert's share of the top-k assignments, fair share 1/E white.

    Red cells got more than their fair share, blue ones less; the value is written in the
    cell. The size grows with the number of layers and experts, so a 12-layer model stays
    as readable as a 2-layer one.
    """
    from matplotlib.colors import TwoSlopeNorm  # slow: only figures need it
    from matplotlib.figure import Figure  # slow: only figures need it

    n_layers, n_exp = len(shares), len(shares[0])
    fair = 1 / n_exp
    fig = Figure(figsize=(max(5.0, 0.6 * n_exp + 2.2), 0.38 * n_layers + 1.9),
                 layout="constrained")  # fmt: skip
    ax = fig.add_subplot()
    top = max(2 * fair, max(max(row) for row in shares))
    norm = TwoSlopeNorm(vcenter=fair, vmin=0.0, vmax=top)
    image = ax.imshow(shares, cmap="RdBu_r", norm=norm, aspect="auto")
    if n_layers * n_exp <= 200:  # a number per cell while they fit
        for i, row in enumerate(shares):
            for e, share in enumerate(row):
                ax.text(e, i, f"{share:.2f}", ha="center", va="center", fontsize="small")
    ax.set_xticks(range(n_exp), [f"e{e}" for e in range(n_exp)])
    step = max(1, n_layers // 12)
    ax.set_yticks(range(0, n_layers, step), [str(i) for i in range(0, n_layers, step)])
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(title or f"Router load, top-{top_k}: share of assignments", fontsize="medium")
    bar = fig.colorbar(image, ax=ax, shrink=0.9)
    bar.set_label(f"share (fair: 1/E = {fair:.3f})", fontsize="small")
    return fig


def lora_sites(peft_model: torch.nn.Module) -> dict[str, dict]:
    """Where a peft LoRA model's adapters sit, summed over the layers: one entry per site.

    A site is a targeted module (an ``nn.Linear`` such as ``self_attn.q_proj``, adapted by
    ``target_modules``) or a targeted parameter (``mlp.experts.gate_up_proj``, a 3-D
    ``(E, out, in)`` tensor, adapted by ``target_parameters`` through peft's ``ParamWrapper``),
    named without its layer index. Each entry: ``rank`` (peft's, per site), ``shape`` (the
    base weight's), ``layers`` (how many layers hold the site) and ``params`` (the adapters'
    A and B entries, all layers together).
    """
    from peft.tuners.lora import LoraLayer, ParamWrapper  # peft imports bitsandbytes: seconds

    sites: dict[str, dict] = {}
    for name, module in peft_model.named_modules():
        if not isinstance(module, LoraLayer) or not module.lora_A:
            continue
        if isinstance(module, ParamWrapper):  # a parameter: name the site after it
            site, weight = f"{name}.{module.parameter_name}", module.get_param()
        else:
            site, weight = name, module.get_base_layer().weight
        site = re.sub(r"^.*\.layers\.\d+\.", "", site.replace(".base_layer", ""))
        n = sum(p.numel() for ab in (module.lora_A, module.lora_B) for p in ab.parameters())
        entry = sites.setdefault(
            site,
            {"rank": module.r["default"], "shape": tuple(weight.shape), "layers": 0, "params": 0},
        )
        entry["layers"] += 1
        entry["params"] += n
    return sites
