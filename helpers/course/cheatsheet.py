"""The one-page cheat sheet (CHEATSHEET.md; lesson 14's summary links it).

One row per method of the single-GPU guide's overview table: what the guide says it does to
speed and memory, the ratios this course measured for it (from the results store the lessons
write), the V100 ratios of the v4.30 guide where its ablation has the method, and the lesson.
``python -m helpers cheatsheet`` prints it for the learner's own results.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from helpers.lessons.putting_it_together import SEED_RECIPES
from helpers.results import Record
from helpers.syllabus import lesson_entry

GUIDE = "https://huggingface.co/docs/transformers/perf_train_gpu_one"
BEYOND = "not in the guide"  # lessons 16-17: techniques the single-GPU guide does not cover
TUTORIAL = (
    "https://docs.pytorch.org/tutorials/intermediate/optimizer_step_in_backward_tutorial.html"
)


@dataclass(frozen=True)
class Method:
    """A row: the guide's method, its claim, and the two experiments whose ratio measures it."""

    name: str
    link: str  # the guide's section (today's page), else the library's docs
    speed: str  # the guide's "improves training speed"
    memory: str  # the guide's "optimizes memory utilization"
    lesson: str
    variant: str  # a regular expression for the variant's label
    baseline: str  # and for the baseline's; with several matches the largest number wins
    v100: tuple[str, str] | None = None  # (variant, baseline) recipes of the v4.30 ablation


METHODS = (
    Method("Batch size choice", f"{GUIDE}#batch-size", "Yes", "Yes", "02", r"search b(\d+)",
           r"encoder b1"),
    Method("Gradient accumulation", f"{GUIDE}#gradient-accumulation", "No", "Yes", "14",
           r"bs1 \+ accum 4", r"vanilla", ("bs1 + accum 4", "vanilla")),
    Method("Gradient checkpointing", f"{GUIDE}#gradient-checkpointing", "No", "Yes", "04",
           r"encoder checkpointing", r"encoder plain", ("bs1 + accum 4 + ckpt", "bs1 + accum 4")),
    Method("Mixed precision training", f"{GUIDE}#mixed-precision", "Yes", "(No)", "14",
           r"16-bit", r"vanilla", ("16-bit", "vanilla")),
    Method("Optimizer choice: Adafactor", f"{GUIDE}#optimizers", "Yes", "Yes", "14",
           r"Adafactor", r"vanilla", ("Adafactor", "vanilla")),
    Method("Optimizer choice: 8-bit AdamW", f"{GUIDE}#optimizers", "Yes", "Yes", "14",
           r"8-bit AdamW", r"vanilla", ("8-bit AdamW", "vanilla")),
    Method("Data preloading", f"{GUIDE}#data-preloading", "Yes", "No", "11",
           r"slow, (\d+) workers", r"slow, 0 workers"),
    Method("DeepSpeed ZeRO", "https://huggingface.co/docs/transformers/deepspeed", "No", "Yes",
           "08", r"ZeRO-3 .*", r"oversized plain, no budget"),
    Method("torch.compile", f"{GUIDE}#torchcompile", "Yes", "No", "12",
           r".* inductor, warm cache", r".* eager"),
    Method("PEFT (LoRA)", "https://huggingface.co/docs/peft", "No", "Yes", "13",
           r"decoder LoRA r=4 .*", r"decoder full"),
    Method("Scaled dot product attention", f"{GUIDE}#scaled-dot-production-attention", "Yes",
           "Yes", "10", r"decoder sdpa s(\d+)", r"decoder eager s(\d+)"),
    Method("Optimizer step inside backward", TUTORIAL, BEYOND, BEYOND, "16",
           r"step inside backward", r"step after backward"),
    Method("Chunked cross-entropy (128k vocabulary)", "https://github.com/linkedin/Liger-Kernel",
           BEYOND, BEYOND, "16", r"chunked loss", r"whole loss"),
    Method("DDP, per process of N", "https://docs.pytorch.org/docs/stable/notes/ddp.html",
           BEYOND, BEYOND, "17", r"DDP process 0 of (\d+)", r"one process, batch (\d+)"),
    Method("FSDP2, per process of N",
           "https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html", BEYOND,
           BEYOND, "17", r"FSDP2 process 0 of (\d+)", r"one process, batch (\d+)"),
)  # fmt: skip


@dataclass
class CheatRow:
    """One row of the sheet, numbers as measured (None: the lesson has not been run)."""

    method: Method
    ran: bool  # both experiments are in the store
    speed_ratio: float | None  # samples/s of the variant / of the baseline
    memory_ratio: float | None  # peak bytes (the lesson's memory view) variant / baseline
    v100_speed: float | None = None
    v100_memory: float | None = None


def find(records: list[Record], lesson: str, pattern: str) -> Record | None:
    """The lesson's latest successful record whose label matches; the largest number wins."""
    best, best_key = None, None
    for r in records:
        match = re.fullmatch(pattern, r.label)
        if r.lesson != lesson or not r.ok or not match:
            continue
        key = int(match.group(1)) if match.groups() else 0
        if best_key is None or key >= best_key:
            best, best_key = r, key
    return best


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def rows(records: list[Record]) -> list[CheatRow]:
    """The sheet's rows from a results store's records."""
    v100 = {r.label: r for r in SEED_RECIPES}
    out = []
    for m in METHODS:
        var, base = find(records, m.lesson, m.variant), find(records, m.lesson, m.baseline)
        row = CheatRow(m, bool(var and base), None, None)
        if row.ran:
            row.speed_ratio = _ratio(var.samples_per_s, base.samples_per_s)
            row.memory_ratio = _ratio(
                (var.memory or {}).get("peak"), (base.memory or {}).get("peak")
            )
        if m.v100:
            a, b = v100[m.v100[0]], v100[m.v100[1]]
            row.v100_speed = a.seed_samples_per_s / b.seed_samples_per_s
            row.v100_memory = a.seed_mb / b.seed_mb
        out.append(row)
    return out


def _x(value: float | None, ran: bool) -> str:
    if value is None:
        return "not measured" if ran else "not run yet"
    return f"{value:.2f}x"


def markdown(records: list[Record], notebooks: str = "notebooks") -> str:
    """The sheet's table in markdown (lesson links relative to ``notebooks``)."""
    lines = [
        "| Method (guide section) | Guide: faster? | Guide: less memory? | Measured: speed "
        "| Measured: peak memory | V100, v4.30 guide: speed, memory | Lesson |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows(records):
        m = r.method
        v100 = "" if r.v100_speed is None else f"{r.v100_speed:.2f}x, {r.v100_memory:.2f}x"
        lines.append(
            f"| [{m.name}]({m.link}) | {m.speed} | {m.memory} | {_x(r.speed_ratio, r.ran)} "
            f"| {_x(r.memory_ratio, r.ran)} | {v100} "
            f"| [{m.lesson}]({notebooks}/{lesson_entry(m.lesson).notebook}) |"
        )
    return "\n".join(lines)


def measured_on(records: list[Record]) -> str:
    """Which device and scale the records come from, in words."""
    devices = sorted({r.device.get("name", "?") for r in records if r.device})
    return ", ".join(devices) or "no device recorded"
