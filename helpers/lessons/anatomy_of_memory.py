"""Lesson 01, section 3 (notebooks/01_anatomy_of_memory.ipynb): one layer's activations.

Korthikanti et al. (2022) count s·b·h·(34 + 5·a·s/h) bytes saved for backward per transformer
layer, in 16 bits with 1-byte dropout masks. ``layer_account`` writes the same terms for the
course's BERT layer as it runs here (fp32, eager attention, the config's dropout): every
16-bit element becomes e = 4 bytes, a dropout mask m bytes (a float tensor of the input's
dtype on the CPU, a 1-byte bool on CUDA), the MLP's 4h becomes the config's intermediate size
I, and LayerNorm's per-token mean and 1/std, which the paper leaves out, are added. It then
measures what autograd really saves inside the first layer with the saved-tensor hook the
lesson's cell writes (``saved_inside(model, layer, batch)``: each storage once, with the
module that saved it, parameters left out; ``saved_in_first_layer`` runs it on a one-layer
model) and sorts each storage into its term (``term_of``), so predicted and measured bytes sit
side by side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch

from helpers.data import random_batch
from helpers.estimator import estimate
from helpers.models import build_model
from helpers.names import PRECISION_BYTES, KiB, MiB

FP32 = PRECISION_BYTES["fp32"]  # bytes per element

# The terms of Korthikanti et al.'s account, in the order the layer's forward saves them.
QKV_IN = "Q/K/V projections' input"
QKV = "Q, K, V (the two attention matmuls)"
SOFTMAX = "softmax output"
ATTN_MASK = "attention dropout mask"
DROPPED = "dropout output (probabilities x V)"
PROJ_IN = "output projection input"
HIDDEN_MASKS = "2 hidden dropout masks"
LN_IN = "2 LayerNorm inputs"
MLP_IN = "MLP input"
GELU_IN = "GELU input"
GELU_OUT = "GELU output (MLP output's input)"
LN_STATS = "2 LayerNorms' mean, 1/std"
OTHER = "not in the account"


@dataclass(frozen=True)
class Saved:
    """One storage autograd saves for backward: the module it was saved in, and what it is."""

    module: str  # innermost module of the layer running when it was saved ("attention.self")
    shape: tuple[int, ...]
    dtype: str
    numel: int
    nbytes: int  # the storage's bytes (numel x element size; no allocator rounding)
    requires_grad: bool
    made_by: str  # the autograd node that made it ("SoftmaxBackward0"; "" for a mask)


@dataclass(frozen=True)
class Term:
    """One row of the account: the paper's 16-bit formula and this model's, as coefficients."""

    name: str
    paper: int  # Korthikanti et al.'s bytes per element of ``unit`` (16-bit, 1-byte masks)
    ours: int  # this model's bytes per element of ``unit``
    unit: str  # "sbh", "as²b", "sb" or "sbI": the tensor size the coefficients multiply

    def formula(self, coef: int) -> str:
        """``coef`` times the unit, as the table prints it."""
        return f"{coef}·{self.unit}" if coef else "0"


def with_dropout(config, dropout: float | None):
    """A copy of a BERT ``config`` with both dropout rates set to ``dropout`` (None: as is)."""
    config = config.__class__.from_dict(config.to_dict())
    if dropout is not None:
        config.hidden_dropout_prob = dropout
        config.attention_probs_dropout_prob = dropout
    return config


def _first_layer_model(config, device: torch.device):
    """The config's BERT with one encoder layer (every layer saves the same), in train mode."""
    if config.model_type != "bert":
        raise ValueError(f"the layer account is written for BERT, not {config.model_type!r}")
    one = config.__class__.from_dict({**config.to_dict(), "num_hidden_layers": 1})
    model = build_model(one, attn="eager", device=device)
    return model.train()


# The hook the lesson's cell writes: (model, layer, batch) -> [(module name, tensor)], every
# storage autograd saves inside ``layer`` during ``model(**batch)``, once, weights left out.
SavedInside = Callable[[torch.nn.Module, torch.nn.Module, dict], list[tuple[str, torch.Tensor]]]


def saved_in_first_layer(
    config, batch_size: int, seq_len: int, device: torch.device, saved_inside: SavedInside
) -> list[Saved]:
    """What ``saved_inside`` finds autograd saving in the first encoder layer's forward."""
    model = _first_layer_model(config, device)
    batch = random_batch("classify", batch_size, seq_len, config.vocab_size)
    batch = {k: v.to(device) for k, v in batch.items()}
    out = []
    for module, t in saved_inside(model, model.bert.encoder.layer[0], batch):
        made_by = type(t.grad_fn).__name__ if t.grad_fn is not None else ""
        dtype = str(t.dtype).removeprefix("torch.")
        nbytes = t.untyped_storage().nbytes()
        out.append(Saved(module, tuple(t.shape), dtype, t.numel(), nbytes, t.requires_grad,
                         made_by))  # fmt: skip
    return out


def term_of(saved: Saved, scores_numel: int) -> str:
    """The term a saved storage belongs to, from the module that saved it and what it is."""
    module, leaf = saved.module, saved.module.rsplit(".", 1)[-1]
    if leaf in ("query", "key", "value"):
        return QKV_IN
    if module == "attention.self":  # eager attention: scores, softmax, dropout, context
        if "Softmax" in saved.made_by:
            return SOFTMAX
        if not saved.requires_grad:
            return ATTN_MASK
        return DROPPED if saved.numel == scores_numel else QKV
    if leaf == "LayerNorm":
        return LN_IN if saved.requires_grad else LN_STATS
    if leaf == "dropout" and not saved.requires_grad:
        return HIDDEN_MASKS
    known = {"attention.output.dense": PROJ_IN, "intermediate.dense": MLP_IN,
             "intermediate.intermediate_act_fn": GELU_IN, "output.dense": GELU_OUT}  # fmt: skip
    return known.get(module, OTHER)


def korthikanti_terms(config, device_type: str) -> list[Term]:
    """Each term of Korthikanti et al.'s layer account, 16-bit, and for this BERT in fp32."""
    h, inter = config.hidden_size, config.intermediate_size
    e, m = FP32, 1 if device_type == "cuda" else FP32  # element and dropout-mask bytes
    attn_drop = int(config.attention_probs_dropout_prob > 0)  # 0: no mask, nothing dropped
    hidden_drop = int(config.hidden_dropout_prob > 0)
    # The paper's MLP is 4h wide; with I a multiple of h, the GELU terms stay in sbh units.
    gelu = (8, e * inter // h, "sbh") if inter % h == 0 else (2, e, "sbI")
    rows = [
        (QKV_IN, 2, e, "sbh"),
        (QKV, 6, 3 * e, "sbh"),
        (SOFTMAX, 2, e, "as²b"),
        (ATTN_MASK, 1, m * attn_drop, "as²b"),
        (DROPPED, 2, e * attn_drop, "as²b"),
        (PROJ_IN, 2, e, "sbh"),
        (HIDDEN_MASKS, 2, 2 * m * hidden_drop, "sbh"),
        (LN_IN, 4, 2 * e, "sbh"),
        (MLP_IN, 2, e, "sbh"),
        (GELU_IN, *gelu),
        (GELU_OUT, *gelu),
        (LN_STATS, 0, 2 * 2 * FP32, "sb"),  # mean and 1/std, fp32 per token, per LayerNorm
    ]
    return [Term(*row) for row in rows]


def _sizes(config, batch_size: int, seq_len: int) -> dict[str, int]:
    """Elements in one tensor of each unit: sbh, as²b (attention scores), sb, sbI."""
    b, s, a = batch_size, seq_len, config.num_attention_heads
    return {"sbh": s * b * config.hidden_size, "as²b": a * s * s * b, "sb": s * b,
            "sbI": s * b * config.intermediate_size}  # fmt: skip


def _total_formula(terms: list[Term], which: str) -> str:
    """The terms' sum as one formula ("72·sbh + 12·as²b + 16·sb")."""
    coefs: dict[str, int] = {}
    for t in terms:
        coefs[t.unit] = coefs.get(t.unit, 0) + getattr(t, which)
    return " + ".join(f"{c}·{u}" for u, c in coefs.items() if c)


@dataclass
class LayerAccount:
    """One layer's saved activations: the terms predicted and measured, the estimator's sum."""

    table: pd.DataFrame  # one row per term plus "total": formulas and bytes
    saved: list[Saved]  # every storage measured, each counted once
    estimator_bytes: int  # helpers.estimator's per-layer account (Estimate.layer_activations)
    paper_bytes: int  # Korthikanti et al.'s s·b·h·(34 + 5·a·s/h), 16-bit

    @property
    def predicted(self) -> int:
        """This model's bytes per layer, from the terms."""
        return int(self.table.loc["total", "predicted B"])

    @property
    def measured(self) -> int:
        """What autograd saved in the layer, in bytes."""
        return int(self.table.loc["total", "measured B"])


def layer_account(
    config,
    batch_size: int,
    seq_len: int,
    device: torch.device,
    saved_inside: SavedInside,
    dropout: float | None = None,
) -> LayerAccount:
    """Measure the first layer's saved tensors with the lesson's hook (``saved_inside``) and
    set them against Korthikanti's terms."""
    config = with_dropout(config, dropout)
    device = torch.device(device)
    saved = saved_in_first_layer(config, batch_size, seq_len, device, saved_inside)
    scores = config.num_attention_heads * seq_len * seq_len * batch_size
    measured: dict[str, int] = {}
    for t in saved:
        name = term_of(t, scores)
        measured[name] = measured.get(name, 0) + t.nbytes
    terms = korthikanti_terms(config, device.type)
    if OTHER in measured:
        terms.append(Term(OTHER, 0, 0, "sb"))
    size = _sizes(config, batch_size, seq_len)
    rows = {
        t.name: {"paper (16-bit)": t.formula(t.paper) if t.paper else "not counted",
                 "paper B": t.paper * size[t.unit],
                 "this model": t.formula(t.ours), "predicted B": t.ours * size[t.unit],
                 "measured B": measured.get(t.name, 0)}
        for t in terms
    }  # fmt: skip
    if OTHER in measured:
        rows[OTHER]["this model"] = "?"
    table = pd.DataFrame(rows).T
    total = {c: int(table[c].sum()) for c in ("paper B", "predicted B", "measured B")}
    table.loc["total"] = {"paper (16-bit)": _total_formula(terms, "paper"),
                          "this model": _total_formula(terms, "ours"), **total}  # fmt: skip
    est = estimate(config, batch_size, seq_len, device=device)
    return LayerAccount(table, saved, sum(est.layer_activations.values()), est.paper_layer_bytes)


def account_table(account: LayerAccount) -> pd.DataFrame:
    """The account for reading: formulas, and bytes in KiB (MiB when the layer is large)."""
    unit, name = (MiB, "MiB") if account.measured > 16 * MiB else (KiB, "KiB")
    table = account.table.copy()
    for col in ("paper B", "predicted B", "measured B"):
        table[col.replace(" B", f" {name}")] = table.pop(col).astype(float) / unit
    order = ["paper (16-bit)", f"paper {name}", "this model", f"predicted {name}",
             f"measured {name}"]  # fmt: skip
    return table[order].round(1 if name == "KiB" else 2)
