"""Lesson 14, sections 1-6 (notebooks/14_putting_it_together.ipynb).

The ablation of "Efficient Training on a Single GPU" (Transformers v4.30 docs, V100 16 GB)
rebuilt as RunConfigs, and its table; plus the row the guide could not have: bf16 weights,
gradients and AdamW state with no fp32 master copy (``PURE_BF16``, lesson 05, section 8).

That guide trains bert-large (sequence length 512, 512 samples, effective batch 4) with the
Trainer nine ways and prints samples/s and the GPU memory nvidia-smi reports. Its figures are
kept here as published; the course compares them with a run on the learner's machine as
ratios to each side's vanilla run, because absolute numbers from a V100 and from (say) a
laptop CPU cannot be compared, while "what does this technique do relative to doing nothing"
can.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace

import torch
from matplotlib.figure import Figure
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

from helpers.forkserver import context
from helpers.hardware import REFERENCE_CARDS, precision_problem
from helpers.isolate import arrived, portable
from helpers.names import MiB
from helpers.planner import BF16_FULL_UPDATE, OUTCOMES, card_precisions
from helpers.plots import legend_outside, separate_labels
from helpers.progress import progress, quiet_here
from helpers.results import Record
from helpers.train import RunConfig


@dataclass(frozen=True)
class Recipe:
    """One row of the guide's ablation: what it changes and what the guide measured."""

    label: str
    batch_size: int
    grad_accum: int
    checkpointing: bool
    half: bool  # 16-bit mixed precision (the guide used fp16)
    optimizer: str
    seed_samples_per_s: float | None  # None: a recipe the guide does not have
    seed_mb: int | None  # nvidia-smi "GPU memory occupied", MB (CUDA context included)
    weight_dtype: str = "fp32"  # RunConfig.weight_dtype ("bf16": no fp32 master copy)
    bf16_update: str = "nearest"  # RunConfig.bf16_update


# "Efficient Training on a Single GPU" (Transformers v4.30 docs): its printed V100 results.
# https://huggingface.co/docs/transformers/v4.30.0/en/perf_train_gpu_one
SEED_RECIPES = (
    Recipe("vanilla", 4, 1, False, False, "adamw", 8.86, 14949),
    Recipe("bs1 + accum 4", 1, 4, False, False, "adamw", 7.75, 8681),
    Recipe("bs1 + accum 4 + ckpt", 1, 4, True, False, "adamw", 5.99, 6775),
    Recipe("16-bit", 4, 1, False, True, "adamw", 18.64, 13939),
    Recipe("accum + ckpt + 16-bit", 1, 4, True, True, "adamw", 10.09, 7275),
    Recipe("Adafactor", 4, 1, False, False, "adafactor", 7.96, 12295),
    Recipe("Adafactor + accum + ckpt + 16-bit", 1, 4, True, True, "adafactor", 9.06, 4847),
    Recipe("8-bit AdamW", 4, 1, False, False, "adamw8bit", 9.15, 13085),
    Recipe("8-bit + accum + ckpt + 16-bit", 1, 4, True, True, "adamw8bit", 10.35, 5363),
)
# How people train in 2026, next to the guide's 2021 rows: every tensor of the model state in
# bf16, AdamW's update Kahan-compensated (torch-optimi) so small updates are not rounded away.
# Its convergence is the caveat the memory table cannot show: lesson 05, section 8 measures it.
PURE_BF16 = Recipe("pure bf16 + Kahan", 4, 1, False, True, "adamw", None, None, "bf16", "kahan")
EXTRA_RECIPES = (PURE_BF16,)


def pure_bf16_problem(device: torch.device) -> str | None:
    """Why ``PURE_BF16`` cannot run on ``device`` (one line), or None: it needs bf16 compute
    and torch-optimi's AdamW."""
    problem = precision_problem("bf16", device)
    if problem:
        return f"pure bf16 is left out: {problem}"
    if importlib.util.find_spec("optimi") is None:
        return (
            "pure bf16 is left out: its Kahan AdamW needs torch-optimi (pip install torch-optimi)"
        )
    return None


SEED_DEVICE = "Tesla V100-SXM2 16 GB (Transformers v4.30 docs, single-GPU guide)"


def half_precision(device: torch.device) -> str:
    """The 16-bit format for the ablation: fp16 as in the guide, bf16 where fp16 is refused."""
    for name in ("fp16", "bf16"):
        if precision_problem(name, device) is None:
            return name
    raise ValueError(f"{device}: neither fp16 nor bf16 autocast works here")


def recipe_config(recipe: Recipe, base: RunConfig, half: str) -> RunConfig:
    """``base`` (model, sequence, batch of the vanilla run) changed the way ``recipe`` says."""
    if recipe.grad_accum > 1:  # keep the effective batch: micro-batch x accumulation steps
        batch = max(1, base.batch_size // recipe.grad_accum)
        accum = base.batch_size // batch
    else:
        batch, accum = base.batch_size, 1
    precision = half if recipe.half else base.precision
    return replace(
        base,
        batch_size=batch,
        grad_accum=accum,
        gradient_checkpointing=recipe.checkpointing,
        precision="bf16" if recipe.weight_dtype == "bf16" else precision,  # bf16 weights: bf16
        optimizer=recipe.optimizer,
        weight_dtype=recipe.weight_dtype,
        bf16_update=recipe.bf16_update,
        label=recipe.label,
    )


def _per_sample(record: Record) -> list[float]:
    samples = record.config.get("batch_size", 1) * record.config.get("grad_accum", 1)
    return [t / samples for t in record.step_times]


def speed_ratio(record: Record, vanilla: Record) -> float | None:
    """samples/s over vanilla's: the median of per-round ratios when both come from the same
    interleaved rounds (``with_speed``), else the ratio of the two medians."""
    if not (record.ok and vanilla.ok and record.samples_per_s and vanilla.samples_per_s):
        return None
    mine, base = _per_sample(record), _per_sample(vanilla)
    if mine and len(mine) == len(base):
        return statistics.median(b / m for m, b in zip(mine, base, strict=True))
    return record.samples_per_s / vanilla.samples_per_s


def device_memory(record: Record) -> tuple[int | None, str]:
    """The memory figure closest to the guide's: NVML (view 3) if measured, else the exact peak."""
    if record.nvml_used:
        return record.nvml_used, "NVML device memory (view 3, as nvidia-smi)"
    if record.memory:
        return record.memory["peak"], "exact tracked peak (view 1)"
    return None, "not measured"


def ablation_table(records: dict[str, Record]):
    """Ours next to the guide's V100 run, each a ratio to its own vanilla run (a DataFrame):
    the guide's nine rows, and ``EXTRA_RECIPES`` that ``records`` holds (no V100 figures)."""
    import pandas as pd

    vanilla = records.get("vanilla")
    base_mem = device_memory(vanilla)[0] if vanilla and vanilla.ok else None
    seed0 = SEED_RECIPES[0]
    rows = []
    for recipe in (*SEED_RECIPES, *(r for r in EXTRA_RECIPES if r.label in records)):
        rec = records.get(recipe.label)
        mem = device_memory(rec)[0] if rec and rec.ok else None
        speed = rec.samples_per_s if rec and rec.ok else None
        rows.append(
            {
                "recipe": recipe.label,
                "samples/s": speed,
                "memory MiB": None if mem is None else mem / MiB,
                "speed ratio": speed_ratio(rec, vanilla) if rec and vanilla else None,
                "memory ratio": mem / base_mem if mem and base_mem else None,
                "V100 samples/s": recipe.seed_samples_per_s,
                "V100 MB": recipe.seed_mb,
                "V100 speed ratio": _ratio(recipe.seed_samples_per_s, seed0.seed_samples_per_s),
                "V100 memory ratio": _ratio(recipe.seed_mb, seed0.seed_mb),
                "status": "not run" if rec is None else ("ok" if rec.ok else rec.error_type),
            }
        )
    return pd.DataFrame(rows).set_index("recipe")


def _ratio(value, base):
    return None if value is None else value / base


def latest_records(records: list[Record], lesson: str = "14") -> dict[str, Record]:
    """The newest record of each of the lesson's recipes from a results store's records."""
    labels = {r.label for r in (*SEED_RECIPES, *EXTRA_RECIPES)}
    out: dict[str, Record] = {}
    for rec in records:
        if rec.lesson == lesson and rec.label in labels:
            out[rec.label] = rec
    return out


def search_table(outcomes, examples: int = 2):
    """The planner's search grouped by what happened to each candidate (a DataFrame).

    ``outcomes``: ``helpers.planner.search_outcomes(plan, candidates)``. One group per
    outcome (``helpers.planner.OUTCOMES``), in the order the search reaches them, its
    size in the index; ``examples`` rows of each of the large groups (the cheapest predicted
    first), every row of the measured ones.
    """
    import pandas as pd

    rows = []
    for outcome in OUTCOMES:
        group = [o for o in outcomes if o.outcome == outcome]
        shown = group if outcome in ("failed", "timed", "winner") else group[:examples]
        for o in shown:
            rows.append(
                {
                    "outcome (candidates)": f"{outcome} ({len(group)} of {len(outcomes)})",
                    "example": o.candidate.label,
                    "estimated peak MiB": o.candidate.estimated_peak / MiB,
                    "why": o.why,
                }
            )
    return pd.DataFrame(rows).set_index(["outcome (candidates)", "example"]).round(2)


def tradeoff_figure(table, title: str = "") -> Figure:
    """Memory ratio against speed ratio, ours and the guide's V100, one point per recipe."""
    import pandas as pd

    fig = Figure(figsize=(8.5, 5), layout="constrained")
    ax = fig.add_subplot()
    ours = table.dropna(subset=["speed ratio", "memory ratio"])
    ax.scatter(ours["memory ratio"], ours["speed ratio"], color="#4C72B0", label="this machine")
    ax.scatter(
        table["V100 memory ratio"],
        table["V100 speed ratio"],
        color="#C44E52",
        marker="s",
        label="v4.30 guide, V100",
    )
    labels = []
    for name, row in table.iterrows():
        short = SHORT.get(name, name)
        if name in ours.index:
            labels.append(ax.annotate(
                short,
                (row["memory ratio"], row["speed ratio"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
                color="#4C72B0",
            ))  # fmt: skip
        if pd.isna(row["V100 memory ratio"]):  # a recipe the guide does not have
            continue
        labels.append(ax.annotate(
            short,
            (row["V100 memory ratio"], row["V100 speed ratio"]),
            fontsize=7,
            xytext=(3, -9),
            textcoords="offset points",
            color="#C44E52",
        ))  # fmt: skip
    ax.axhline(1, color="grey", lw=0.5)
    ax.axvline(1, color="grey", lw=0.5)
    ax.set_xlabel("memory / vanilla's (left is leaner)")
    ax.set_yscale("log")  # ratios: 2x faster and 2x slower lie equally far from 1
    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 0.1 0.2 0.5 1 2: readable
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("samples/s / vanilla's (up is faster, log scale)")
    ax.set_title(title)
    legend_outside(ax)  # outside the axes: it cannot cover a point or a name
    separate_labels(fig, labels)  # recipes whose points nearly coincide: names one under another
    return fig


SHORT = {
    "vanilla": "vanilla",
    "bs1 + accum 4": "GA",
    "bs1 + accum 4 + ckpt": "GA+GC",
    "16-bit": "16b",
    "accum + ckpt + 16-bit": "GA+GC+16b",
    "Adafactor": "Adaf",
    "Adafactor + accum + ckpt + 16-bit": "Adaf+3",
    "8-bit AdamW": "8bit",
    "8-bit + accum + ckpt + 16-bit": "8bit+3",
    "pure bf16 + Kahan": "bf16 all",
}


# -------------------------------------------------------------------------------------------
# Section 7: your model. Real configs on cards that are not here, estimates only.

YOUR_MODELS = ("qwen3-0.6b", "llama-3.2-1b")  # bundled real configs: a traced and an analytical
YOUR_CARDS = ("t4", "l4")  # 16 GB (no bf16) and 24 GB (helpers.hardware.REFERENCE_CARDS)


def your_model_space(card, method: str = "full") -> dict:
    """The search: the card's 16-bit precision, SDPA, what the step keeps for backward (none,
    full or selective checkpointing; offload, which ``plan --card`` also searches, is left
    out until a GPU has checked its CUDA estimate), AdamW or 8-bit AdamW (optimizers are
    free; each other choice costs one trace), and the weights
    as practitioners keep them today: a LoRA base in 16 bits, full fine-tuning in bf16 with
    Kahan's AdamW where the card has bf16 (fp32 weights on one without)."""
    half = "bf16" if "bf16" in card_precisions(card) else "fp16"
    weights = {"lora": [(half, "nearest")], "full": [("bf16", BF16_FULL_UPDATE)]}
    if half != "bf16":
        weights["full"] = [("fp32", "nearest")]
    space = {"precisions": (half,), "attentions": ("sdpa",), "optimizers": ("adamw", "adamw8bit"),
             "checkpointing": ("none", "full", "selective")}  # fmt: skip
    return {**space, "weights": weights[method]} if method in weights else space


def your_model_plans(plan_one, models=YOUR_MODELS, cards=YOUR_CARDS,
                     methods=("full", "lora", "qlora"), workers: int | None = None):  # fmt: skip
    """``plan_one(model, card, method, **your_model_space(card, method))`` (lesson 14 writes it
    in a cell: its ``plan_for_card`` call) for every model, card and method, keyed by those
    three.

    Nothing here needs the others: each model and method is planned in a process of its own
    (``workers`` at once, default one per core; ``plan_one`` travels by value), where its cards
    share the traces (fp16 and bf16 trace the same bytes). A traced estimate costs seconds of
    CPU, so on 2 cores this takes about half the time of planning one after another.
    """
    groups = [(model, method) for model in models for method in methods]
    workers = workers or max(1, min(len(groups), os.cpu_count() or 1))
    sent = portable(plan_one, "plan_one")
    found = {}
    with ProcessPoolExecutor(workers, mp_context=context()) as pool:
        futures = [pool.submit(_plans_on_cards, sent, m, method, cards) for m, method in groups]
        for done in progress(as_completed(futures), "planning models and methods",
                             total=len(futures), unit="plan"):  # fmt: skip
            found.update(done.result())
    order = [(m, c, method) for m in models for c in cards for method in methods]
    return {key: found[key] for key in order}


def _plans_on_cards(plan_one, model, method: str, cards) -> dict:
    """One model and method planned on each card, in a worker process (no bars of its own)."""
    quiet_here()
    plan_one = arrived(plan_one)
    plans = {}
    for name in cards:
        space = your_model_space(REFERENCE_CARDS[name], method)
        plans[model, name, method] = plan_one(model, name, method, **space)
    return plans


def your_model_table(plans):
    """One row per plan: the answer, its estimated peak (where nothing fits, the smallest
    peak of any setup, or the smallest model state where no setup's fits, over the usable
    memory), the path that estimated it."""
    import pandas as pd

    rows = []
    for (model, card, method), p in plans.items():
        rows.append({
            "model": model, "card": card, "method": method,
            "answer": p.best.label if p.best else "does not fit",
            "peak GiB": round((p.best.estimated_peak if p.best else p.smallest_peak) / 2**30, 2),
            "usable GiB": round(p.usable / 2**30, 2),
            "path": p.best.estimate.path if p.best else
                    "(model state alone)" if p.smallest_is_floor else "(smallest peak)",
        })  # fmt: skip
    return pd.DataFrame(rows).set_index(["model", "card", "method"])
