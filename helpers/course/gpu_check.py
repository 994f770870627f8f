"""``python -m helpers gpu-check``: the course proven on the machine at hand, within a deadline.

A host with a GPU runs it once (``make gpu-check``). It installs nothing, and it writes its
report as it goes (Markdown and JSON, ``reports/gpu/<date>-<card>.md``), so a run killed
half-way still leaves what it found. The parts, in order of value:

a. the environment (card, driver, CUDA, versions against the tested range) and the preflight;
   then a plan of the parts left (``helpers.course.gpu_plan``);
d. the capstone's nine recipes timed first, on a quiet card, in turn in one process
   (``helpers.train.measure_speeds``: no process or tracked step each), then shown with their
   bytes from b: samples/s, device memory and MFU next to the guide's V100 table;
b. the estimator against the real allocator: settings run each in a fresh process, predicted
   bytes per category next to the tracker's, and the peak next to the allocator's
   ``max_memory_allocated`` and ``max_memory_reserved`` and NVML, the gaps named; several at
   once, each capped to its predicted peak with a margin;
e. the recipes (``recipes/*.py``, the plain scripts learners copy) on this device, each in
   its own process, with the settings that drive their GPU-only paths (fp16 with GradScaler,
   8-bit AdamW, the flash SDPA backend, QLoRA, fp8, the CUDA memory snapshot, DDP and FSDP2
   under torchrun with NCCL);
c. the lessons, each notebook in a fresh kernel: on a GPU at the full scale, several at once,
   in an order that puts first the lessons no earlier report covered, as long as time is left.
   The tiny scale runs where the full scale cannot (a lesson that does not fit the card; every
   lesson on a CPU). Speed claims are reported, not failing (``COURSE_SPEED_CLAIMS=report``);
   each row names the lessons that ran beside it.

Parts b, e and c run side by side, each in a thread of its own (``helpers.course.schedule``),
sharing the card's bytes: each lesson's need from ``helpers.course.fullscale``, each setting's
cap. A setting out of its cap, or a lesson that fails beside others, runs again alone at the end.
On a CPU the same command is the rehearsal: every part at the tiny scale and a short subset of
notebooks. ``--quick`` is the version ``make test`` runs, so the command cannot rot.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from unittest import mock

import torch

from helpers import compat
from helpers.course.fullscale import fit_table, rough_training_flops
from helpers.course.gpu_plan import PlanInputs, earlier_report, plan_parts
from helpers.course.preflight import CHECKS, STARTUP_S, format_result, run_preflight
from helpers.course.schedule import Ledger, Ran, concurrency, run_at_once
from helpers.device import cudnn_version, gpu_info, is_cuda, nvml_summary, resolve, tf32_capable
from helpers.estimator import estimate_run
from helpers.hardware import cpu_name, precision_problem
from helpers.isolate import call_isolated
from helpers.lessons.putting_it_together import (
    SEED_RECIPES,
    ablation_table,
    half_precision,
    recipe_config,
)
from helpers.names import GiB, MiB, human_bytes
from helpers.recipes import recipe_names
from helpers.results import Record
from helpers.scale import fit_scale, get_scale
from helpers.syllabus import by_gpu_rank
from helpers.train import RunConfig, measure, measure_speeds

ROOT = Path(__file__).resolve().parents[2]  # the checkout: notebooks/, tools/, reports/
REPORTS = ROOT / "reports" / "gpu"  # committed reports: where a GPU run writes by default
CATEGORIES = ("params", "gradients", "optimizer_state", "activations", "temporaries")
FULL_ORDER = by_gpu_rank()  # full-scale lessons in order of value (helpers/syllabus.py)
REHEARSAL_LESSONS = ("00", "09")  # on a CPU: a short subset (about half a minute)
CAPSTONE = {r.label for r in SEED_RECIPES}  # part b times these on a quiet card (part d)
# Lessons that read NVML's whole-device view (the preflight's table): beside others, it mixes them.
NVML_LESSONS = next(lessons for name, lessons, _, _ in CHECKS if name == "NVML view")


@dataclass
class GpuCheckConfig:
    """What ``gpu-check`` runs: its deadline, where the report goes, how much."""

    deadline_min: float = 9.0
    out: Path | None = None  # default: reports/gpu on a GPU, build/gpu-check elsewhere
    quick: bool = False  # make test's version: a few settings, one notebook, two checks
    lessons: tuple[str, ...] | None = None  # notebooks by number or path (None: the default)
    device: str | None = None


@dataclass
class GpuCheckResult:
    """The report: what each part found, written after every step."""

    started: str
    device: str
    card: str
    deadline_min: float
    environment: dict = field(default_factory=dict)
    packages: list[str] = field(default_factory=list)
    preflight: str = ""
    estimator: list[dict] = field(default_factory=list)
    capstone: list[dict] = field(default_factory=list)
    recipes: list[dict] = field(default_factory=list)
    lessons: list[dict] = field(default_factory=list)
    order: str = ""  # the full-scale order and why
    not_reached: list[str] = field(default_factory=list)
    card_bytes: int = 0  # the card's memory (0: not a GPU, or not known)
    estimator_phases: str = ""  # how part b ran: settings at once, then alone
    estimator_most_at_once: int = 0  # the most settings that ran together
    speed_phase: dict = field(default_factory=dict)  # the capstone timed alone: labels, when
    part_seconds: dict = field(default_factory=dict)  # "a", "b", "e", "c": seconds each took
    plan: list[str] = field(default_factory=list)  # parts b, e, c predicted after part a
    recipes_at_once: int = 1  # part e's recipes side by side
    side_by_side: str = ""  # how parts b, e and c ran at once
    seconds: float = 0.0
    finished: bool = False

    @property
    def problems(self) -> list[str]:
        """What failed: a preflight check, an estimator run, a notebook."""
        out = [f"estimator: {r['label']}: {r['error']}" for r in self.estimator if r.get("error")]
        out += [f"recipe {r['recipe']}: {r['note']}" for r in self.recipes
                if r["outcome"] == "failed"]  # fmt: skip
        out += [f"lesson {r['lesson']} ({r['scale']}): {r['outcome']}" for r in self.lessons
                if r["outcome"] == "failed"]  # fmt: skip
        if "checks fail" in self.preflight:  # format_result's last line when one fails
            out.append("preflight: " + self.preflight.strip().splitlines()[-1])
        return out


class Clock:
    """Seconds left until the deadline."""

    def __init__(self, minutes: float) -> None:
        self.start = time.monotonic()
        self.end = self.start + 60 * minutes

    def left(self) -> float:
        """Seconds left (negative once past)."""
        return self.end - time.monotonic()

    def spent(self) -> float:
        """Seconds since the start."""
        return time.monotonic() - self.start


@dataclass
class _Run:
    """One run's state, handed to each part: its settings, report, clock and outlets."""

    cfg: GpuCheckConfig
    result: GpuCheckResult
    clock: Clock
    write: Callable[[], None]  # the report to disk, as it stands
    say: Callable[[str], None]  # one line of progress (the command prints it)
    flops_per_s: float | None = None  # the preflight's training throughput (part a)
    shares: dict[str, int] = field(default_factory=dict)  # slots of parts b, e, c (at once)
    lock: threading.RLock = field(default_factory=threading.RLock)  # b, e and c write at once
    split: tuple | None = None  # part c's notebooks: tiny, full, fits (``_split``)


# --------------------------------------------------------------------------------------------
# a. The environment


TOTAL_KEY = "total memory bytes"  # environment()'s number for part b (not shown in the report)


def environment(device: str | None) -> dict:
    """The card, driver, CUDA and library versions (run in a fresh process: asking the card
    creates a CUDA context, which would stay in every later NVML reading of this process)."""
    d = resolve(device)
    env = {
        "device": str(d),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda (torch build)": torch.version.cuda or "none",
        "cpu": f"{cpu_name()}, {os.cpu_count()} logical cores",
        "scale": get_scale(device=d).describe(d),
    }
    if is_cuda(d):
        info = gpu_info(d)
        env.update({
            "card": info.name,
            "memory": f"{info.total_memory / GiB:.1f} GiB ({info.total_memory:,} B)",
            TOTAL_KEY: info.total_memory,
            "compute capability": f"{info.capability[0]}.{info.capability[1]}",
            "multiprocessors": info.multiprocessors,
            "cudnn": cudnn_version(),
            "nvml": nvml_summary(d),
        })  # fmt: skip
    else:
        env["card"] = cpu_name()
    return env


def _part_a(run: _Run):
    """The environment and the preflight; returns the PreflightResult (its minutes per lesson
    pace part c's full scale)."""
    cfg, result, clock = run.cfg, run.result, run.clock
    out = call_isolated(environment, cfg.device, timeout=120)
    result.environment = out.value if out.error is None else {"error": out.error}
    result.card_bytes = int(result.environment.pop(TOTAL_KEY, 0))
    result.card = result.environment.get("card", result.card)
    result.packages = [s.line() for s in compat.package_report()]
    run.write()
    run.say("[a] " + "; ".join(f"{k}: {v}" for k, v in result.environment.items() if k != "scale"))
    names = ("budget cap", "allocator view") if cfg.quick else None
    pre = run_preflight(cfg.device, timeout=min(300.0, max(30.0, clock.left() / 3)), names=names,
                        stop_at=clock.end - _reserve(cfg), throughput=not cfg.quick)  # fmt: skip
    result.preflight = format_result(pre)
    run.write()
    run.say(result.preflight)
    return pre


def _reserve(cfg: GpuCheckConfig) -> float:
    """Seconds kept for parts b to d when the preflight runs long."""
    return 0.0 if cfg.quick else 60 * min(6.0, 0.6 * cfg.deadline_min)


# --------------------------------------------------------------------------------------------
# b. The estimator against the real allocator (and d, the capstone, from the same runs)


def estimator_settings(device: str | None, quick: bool = False) -> dict[str, RunConfig]:
    """The settings part b runs: the capstone's nine recipes on the encoder, then the decoder
    with SDPA in 16-bit, a family only the traced estimator knows, LoRA, bf16 weights with no
    fp32 copy (and their AdamW remedies, LoRA on a bf16 base), selective checkpointing,
    offloaded activations, Muon, 8-bit Lion, DoRA and tf32."""
    d = resolve(device)
    scale = get_scale(device=d)
    base = scale.run_config(device=str(d), repeats=max(3, scale.repeats), label="vanilla")
    half = half_precision(d)  # the capstone's: fp16 as in the guide, bf16 where it is refused
    bf16 = "bf16" if precision_problem("bf16", d) is None else half  # the decoder's
    recipes = SEED_RECIPES[:4:3] if quick else SEED_RECIPES  # quick: vanilla and 16-bit
    if compat.missing_optional("bitsandbytes"):  # 8-bit AdamW where bitsandbytes is there
        recipes = [r for r in recipes if r.optimizer != "adamw8bit"]
    out = {r.label: recipe_config(r, base, half) for r in recipes}
    decoder = replace(base, model=scale.decoder, attn="sdpa", flops=False, repeats=2)
    traced = "qwen3-0.6b" if scale.name == "full" else "qwen3-tiny"
    out[f"{scale.decoder} sdpa {bf16}"] = replace(decoder, precision=bf16)
    out[f"{scale.decoder} LoRA r16 {bf16}"] = replace(decoder, precision=bf16, lora_r=16,
                                                      lora_targets="all-linear")  # fmt: skip
    if quick:  # two recipes and two decoder settings: every phase of part b
        return {label: replace(c, label=label) for label, c in out.items()}
    small = max(1, base.batch_size // 4)
    out[f"{traced} sdpa {bf16} (traced)"] = replace(decoder, model=traced, precision=bf16,
                                                    batch_size=small)  # fmt: skip
    out.update(_bf16_weight_settings(decoder, scale.decoder, d))
    # What the step keeps for backward (lesson 16): on a GPU, offload's estimate is checked here.
    kept = replace(decoder, precision=bf16)
    out[f"{scale.decoder} selective checkpointing {bf16}"] = replace(
        kept, gradient_checkpointing=True, checkpoint_policy="selective")  # fmt: skip
    out[f"{scale.decoder} offloaded activations {bf16}"] = replace(kept, offload_activations=True)
    # Lesson 06's and 13's settings: Muon (its Newton-Schulz scratch), 8-bit Lion, DoRA.
    out[f"{scale.decoder} Muon {bf16}"] = replace(kept, optimizer="muon")
    if not compat.missing_optional("bitsandbytes"):
        out[f"{scale.decoder} 8-bit Lion {bf16}"] = replace(kept, optimizer="lion8bit")
    out[f"{scale.decoder} DoRA r16 {bf16}"] = replace(kept, lora_r=16, lora_targets="all-linear",
                                                      dora=True)  # fmt: skip
    if tf32_capable(d):
        out[f"{scale.encoder} tf32"] = replace(base, precision="tf32", flops=False)
    return {label: replace(c, label=label) for label, c in out.items()}


def _bf16_weight_settings(decoder: RunConfig, name: str, device) -> dict[str, RunConfig]:
    """Part b's settings with bf16 weights and no fp32 copy (where the device has bf16): torch's
    AdamW, each remedy whose package is installed, and LoRA on a bf16 base."""
    if precision_problem("bf16", device) is not None:
        return {}
    pure = replace(decoder, precision="bf16", weight_dtype="bf16")
    out = {f"{name} sdpa bf16 weights": pure}
    for update, module in (("kahan", "optimi"), ("stochastic", "torchao")):
        if not compat.missing_optional(module):
            out[f"{name} sdpa bf16 weights, {update}"] = replace(pure, bf16_update=update)
    out[f"{name} LoRA r16 on a bf16 base"] = replace(pure, lora_r=16, lora_targets="all-linear")
    return out


def _gap(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


def estimator_row(label: str, cfg: RunConfig, record) -> dict:
    """Predicted and measured bytes of one setting, and the gaps between the memory views."""
    row = {"label": label, "config": cfg.as_dict()}
    if not record.ok:
        row["error"] = record.error
        return row
    try:
        est = estimate_run(cfg)
    except Exception as err:  # one setting's estimate never stops the run: reported in its row
        row["error"] = f"measured, but the estimate failed: {type(err).__name__}: {err}"
        return row
    mem, alloc = record.memory, record.allocator or {}
    allocated, reserved = alloc.get("allocated"), alloc.get("reserved")
    row.update(
        path=est.path,
        predicted={k: getattr(est, k) for k in (*CATEGORIES, "peak")},
        tracked={k: int(mem[k]) for k in (*CATEGORIES, "peak")},
        max_allocated=allocated,
        max_reserved=reserved,
        nvml_used=record.nvml_used,
        allocated_minus_tracked=_gap(allocated, int(mem["peak"])),
        reserved_minus_allocated=_gap(reserved, allocated),
        nvml_minus_reserved=_gap(record.nvml_used, reserved),
        samples_per_s=record.samples_per_s,
        mfu=record.mfu,
        hfu=record.hfu,
        step_times=record.step_times,
        seconds=record.wall_s,
    )
    return row


def worst_category(row: dict) -> tuple[str, float] | None:
    """The category (or the peak) whose predicted/tracked ratio is farthest from 1."""
    if "predicted" not in row:
        return None
    ratios = {k: row["predicted"][k] / row["tracked"][k] for k in row["tracked"]
              if row["tracked"][k]}  # fmt: skip
    if not ratios:
        return None
    key = max(ratios, key=lambda k: abs(ratios[k] - 1))
    return key, ratios[key]


# Part b runs in phases. A setting's bytes are its own process's (the tracker, the allocator's
# statistics), whatever else runs on the card, so every setting runs several at once, beside
# parts e and c, each process capped to its predicted peak with a margin; any that ran out of its
# cap or whose peak could not be predicted runs again alone once they are done. The capstone's
# recipes, whose speed part d reports, were timed before on a quiet card (``_speed_phase``).
CAP_MARGIN = 1.5  # a concurrent setting's cap: its predicted peak times this, plus CAP_EXTRA
CAP_EXTRA = 2 * GiB  # the CUDA context, cuBLAS's workspace, the allocator's rounding
CARD_SHARE = 0.9  # of the card's memory, what the concurrent settings' caps may add up to
TIMEOUT_MARGIN = 4.0  # a setting's timeout: its predicted seconds times this,
# Within these: the H200 started one setting's process and ran it in 22-30 s alone (its
# 2026-11-27 report), and part b runs up to 8 at once.
TIMEOUT_S = (90.0, 300.0)


def setting_timeout(run_cfg: RunConfig, flops_per_s: float | None, left: float) -> float:
    """Seconds part b gives one setting: its predicted seconds (a process's start, then its
    steps' training FLOPs over the preflight's fp32 throughput) times ``TIMEOUT_MARGIN``,
    within ``TIMEOUT_S`` and the ``left`` seconds of the deadline (10 kept for the report).
    A setting that hangs gives back its slot in a minute and a half, not five.

    Example:
        >>> setting_timeout(RunConfig(model="bert-tiny"), 1e12, left=500.0)
        90.0
    """
    low, high = TIMEOUT_S
    if flops_per_s:
        high = min(
            high, max(low, TIMEOUT_MARGIN * (STARTUP_S + setting_flops(run_cfg) / flops_per_s))
        )
    return max(30.0, min(high, left - 10))  # run_at_once starts none with under 30 s left


def setting_flops(c: RunConfig) -> float:
    """Rough training FLOPs of one setting in part b: its steps (warmup, timed, + the tracked
    step, an untimed one and the FLOP count)."""
    tokens = c.batch_size * c.seq_len * c.grad_accum
    steps = c.warmup + c.repeats + 3
    return rough_training_flops(c.model, tokens, steps, c.gradient_checkpointing)


@dataclass
class _PartB:
    """Part b as it runs: its settings, each one's cap and timeout, the records as they end."""

    run: _Run
    settings: dict[str, RunConfig]
    records: dict = field(default_factory=dict)
    caps: dict[str, int] = field(default_factory=dict)
    timeouts: dict[str, float] = field(default_factory=dict)
    alone: list[str] = field(default_factory=list)  # to run again alone, uncapped

    def need(self, label: str) -> int | None:
        """A setting's cap: its predicted peak with a margin (None: measured alone instead)."""
        try:
            peak = estimate_run(self.settings[label]).peak
        except Exception:
            return None
        self.caps[label] = int(CAP_MARGIN * peak + CAP_EXTRA)
        return self.caps[label]

    def work(self, label: str, capped: bool):
        """One setting measured in a fresh process (``measure``), under its cap if ``capped``."""
        run_cfg = self.settings[label]
        if capped and label in self.caps:
            run_cfg = replace(run_cfg, budget=self.caps[label])
        timeout = setting_timeout(run_cfg, self.run.flops_per_s, self.run.clock.left())
        self.timeouts[label] = timeout
        out = call_isolated(measure, run_cfg, timeout=timeout)
        return out.value if out.error is None else _failed_record(run_cfg, out.error)

    def done(self, ran: Ran, phase: str) -> None:
        """A setting's record, its row in the report (or, out of its cap, a second run alone)."""
        run, result = self.run, self.run.result
        record = ran.value if not ran.error else _failed_record(self.settings[ran.name], ran.error)
        if phase == "at once" and record.oom and ran.need is not None:
            self.alone.append(ran.name)  # ran out of its cap among others: measured alone
            run.say(f"[b] {ran.name}: out of its {human_bytes(ran.need)} cap; again alone")
            return
        self.records[ran.name] = record
        row = estimator_row(ran.name, self.settings[ran.name], record)
        row.update(phase=phase, started_s=round(ran.started, 1), ended_s=round(ran.ended, 1),
                   timeout_s=round(self.timeouts.get(ran.name, 0.0)))  # fmt: skip
        if phase == "at once" and result.device.startswith("cuda"):  # NVML: every process
            row.update(nvml_used=None, nvml_minus_reserved=None)
        result.estimator.append(row)
        run.write()
        run.say(f"[b] {len(result.estimator)}/{len(self.settings)} {phase} "
                f"{_estimator_line(row)} ({ran.started:.0f}-{ran.ended:.0f} s)")  # fmt: skip


def _part_b(run: _Run, settings: dict[str, RunConfig], ledger: Ledger | None = None) -> _PartB:
    """Every setting in a fresh process, several at once (``run.shares["b"]``), each capped on a
    GPU and holding its cap in ``ledger`` (the card, shared with parts e and c). The capstone's
    skip their FLOP count: ``_speed_phase`` counted them. ``_part_b_alone`` runs what is left."""
    result, clock = run.result, run.clock
    missing = compat.missing_optional("bitsandbytes")
    if missing and not run.cfg.quick:
        result.not_reached.append(f"estimator: the two 8-bit AdamW recipes ({missing})")
    b = _PartB(run, {k: replace(c, flops=False) if k in CAPSTONE else c
                     for k, c in settings.items()})  # fmt: skip
    slots = run.shares.get("b", _slots(result))
    result.estimator_phases = _phases(slots, ledger.capacity if ledger else None)
    first = run_at_once(list(settings), lambda label: b.work(label, True), slots,
                        need=b.need, left=clock.left, min_left=30.0,
                        on_done=lambda ran: b.done(ran, "at once"), origin=clock.start,
                        ledger=ledger)  # fmt: skip
    result.estimator_most_at_once = first.most_at_once
    b.alone += list(first.not_started)  # no predicted peak, or over the card's share
    return b


def _part_b_alone(b: _PartB) -> dict:
    """Part b's settings that need the card to themselves, one at a time, uncapped; returns
    every record by label (part d reads them)."""
    clock, result = b.run.clock, b.run.result
    run_at_once(b.alone, lambda label: b.work(label, False), 1, left=clock.left, min_left=30.0,
                on_done=lambda ran: b.done(ran, "alone"), origin=clock.start)  # fmt: skip
    not_run = [label for label in b.settings if label not in b.records]
    if not_run:
        result.not_reached.append(f"estimator: {', '.join(not_run)} (not measured in time)")
    return b.records


def _speed_phase(run: _Run, settings: dict[str, RunConfig]) -> dict[str, dict]:
    """The capstone's speed on a quiet card, before anything else shares it: the recipes timed
    in turn in one fresh process (``measure_speeds``: their FLOPs counted too); per label the
    ``Record`` fields it measured, or ``{"error": ...}``."""
    clock = run.clock
    if not settings:
        return {}
    if clock.left() < 30:
        run.result.not_reached.append("capstone speed: no time left to time the recipes")
        return {}
    start = clock.spent()
    out = call_isolated(measure_speeds, list(settings.values()),
                        timeout=min(300.0, clock.left() - 10))  # fmt: skip
    speeds = out.value if out.error is None else {k: {"error": out.error} for k in settings}
    run.result.speed_phase = {"labels": list(settings), "started_s": round(start, 1),
                              "ended_s": round(clock.spent(), 1), "error": out.error}  # fmt: skip
    run.say(f"[d] the capstone timed on a quiet card: {len(settings)} recipes in one process, "
            f"{clock.spent() - start:.0f} s {out.error or ''}".rstrip())  # fmt: skip
    return speeds


def _with_speeds(records: dict, speeds: dict[str, dict], settings: dict[str, RunConfig]) -> dict:
    """Part b's records with the capstone's quiet-card timings in place of their shared-card
    ones (part d); a recipe whose timing failed becomes a failed record there."""
    out = dict(records)
    for label, got in speeds.items():
        if label not in out or not out[label].ok:
            continue
        if "error" in got:
            out[label] = _failed_record(settings[label], f"timing alone: {got['error']}")
        else:
            out[label] = replace(out[label], **got)
    return out


def _phases(slots: int, capacity: int | None) -> str:
    """How part b runs, for the report."""
    shared = f", caps within {human_bytes(capacity)} of the card" if capacity else ""
    return f"{slots} settings at once{shared}, beside parts e and c"


def _failed_record(run_cfg: RunConfig, error: str):
    return Record(run_cfg.as_dict(), error=error, error_type="oom" if "OutOfMemory" in error
                  else "error")  # fmt: skip


def _estimator_line(row: dict) -> str:
    if "error" in row:
        return f"{row['label']}: {row['error']}"
    pred, tracked = row["predicted"]["peak"], row["tracked"]["peak"]
    line = f"{row['label']}: peak predicted {human_bytes(pred)}, tracked {human_bytes(tracked)}"
    if row["max_allocated"] is not None:
        line += f", allocator {human_bytes(row['max_allocated'])}"
    return line


def _part_d(records: dict, result: GpuCheckResult) -> None:
    mine = {r.label: records[r.label] for r in SEED_RECIPES if r.label in records}
    if not mine:
        result.not_reached.append("capstone: no recipe ran")
        return
    table = ablation_table(mine)
    for label, row in table.iterrows():
        rec = mine.get(label)
        entry = {"recipe": label, **{k: _plain(v) for k, v in row.items()}}
        entry["mfu"] = rec.mfu if rec is not None and rec.ok else None
        entry["hfu"] = rec.hfu if rec is not None and rec.ok else None
        result.capstone.append(entry)


# --------------------------------------------------------------------------------------------
# e. The recipes on this device


def recipe_runs(device: str, quick: bool = False) -> list[tuple[str, list[str]]]:
    """(label, command) for each recipe run: every recipe with its defaults, then the variants
    whose paths only a GPU takes. ``quick``: the base recipe alone (make test's version)."""
    py = [sys.executable]
    names = ["base"] if quick else recipe_names()
    runs = []
    for name in names:
        script = str(ROOT / "recipes" / f"{name}.py")
        if name in ("ddp", "fsdp2"):  # one process per GPU; one here
            cmd = [*py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                   script]  # fmt: skip
        else:
            cmd = [*py, script]
        extra = ["--optimizer", "torch"] if name == "deepspeed_offload" else []  # no C++ build
        runs.append((name, [*cmd, "--steps", "3", "--device", device, *extra]))
    if quick or not device.startswith("cuda"):
        return runs
    variants = {
        "mixed_precision": [["--precision", "fp16"], ["--precision", "tf32"]],
        "optimizers": [["--optim", "adamw8bit"], ["--optim", "lion8bit"], ["--optim", "muon"]],
        "attention": [["--backend", "flash", "--precision", "bf16"],
                      ["--backend", "efficient", "--precision", "bf16"]],
        "lora": [["--qlora"], ["--dora"]],
        "compile": [["--backend", "inductor"]],
        "deepspeed_offload": [["--stage", "3"]],
    }  # fmt: skip
    for name, extras in variants.items():
        base = next((cmd for label, cmd in runs if label == name), None)
        if base is not None:
            runs += [(f"{name} {' '.join(extra)}", [*base, *extra]) for extra in extras]
    return runs


def run_recipe(label: str, cmd: list[str], timeout: float, cwd: Path) -> dict:
    """One recipe in its own process: passed, skipped (it said what it needs), or failed."""
    start = time.monotonic()
    env = {**os.environ, "PYTHONPATH": ""}  # a recipe needs nothing of the course
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                              env=env)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"recipe": label, "outcome": "failed", "seconds": round(timeout),
                "note": f"still running after {timeout:.0f} s"}  # fmt: skip
    seconds = round(time.monotonic() - start, 1)
    lines = [x for x in (done.stdout + "\n" + done.stderr).splitlines() if x.strip()]
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    if done.returncode == 0:
        rate = next((x for x in reversed(lines) if "tokens/s" in x), "")
        return {"recipe": label, "outcome": "passed", "seconds": seconds, "note": rate}
    if "pip install" in last or last.startswith("needs ") or "needs " in last.split(":")[0]:
        return {"recipe": label, "outcome": "skipped", "seconds": seconds, "note": last}
    return {"recipe": label, "outcome": "failed", "seconds": seconds,
            "note": " / ".join(lines[-3:])[-400:]}  # fmt: skip


# What a recipe or a tiny-scale lesson holds on a card: a CUDA context (616 MiB on the H200),
# cuBLAS's workspace, a tiny model (the recipes' default size) and its steps.
SMALL_JOB_BYTES = 2 * GiB


def _part_e(run: _Run, ledger: Ledger | None = None) -> None:
    """Every recipe on this device, several at once (``run.shares["e"]``, beside parts b and c),
    each in a folder of its own, holding ``SMALL_JOB_BYTES`` of the card in ``ledger``."""
    cfg, result, clock = run.cfg, run.result, run.clock
    work = ROOT / "build" / "gpu-check" / "recipes"
    runs = dict(recipe_runs(cfg.device or "cpu", cfg.quick))
    slots = result.recipes_at_once = run.shares.get("e", _slots(result))

    def one(label: str) -> dict:
        folder = work / _slug(label)  # what a recipe writes (a snapshot, a trace) stays apart
        folder.mkdir(parents=True, exist_ok=True)
        return run_recipe(label, runs[label], min(180.0, max(10.0, clock.left() - 10)), folder)

    def done(ran: Ran) -> None:
        row = ran.value or {"recipe": ran.name, "outcome": "failed", "note": ran.error,
                            "seconds": round(ran.ended - ran.started, 1)}  # fmt: skip
        row.update(started_s=round(ran.started, 1), ended_s=round(ran.ended, 1))
        result.recipes.append(row)
        run.write()
        run.say(f"[e] {row['recipe']}: {row['outcome']} in {row['seconds']:.0f} s "
                f"({ran.started:.0f}-{ran.ended:.0f} s) {row['note']}")  # fmt: skip

    out = run_at_once(list(runs), one, slots, need=lambda label: SMALL_JOB_BYTES, left=clock.left,
                      min_left=30.0, on_done=done, origin=clock.start, ledger=ledger)  # fmt: skip
    result.not_reached += [f"recipe {label}: no time left" for label in out.not_started]


def _recipes_markdown(result: GpuCheckResult) -> list[str]:
    if not result.recipes:
        return []
    rows = [[r["recipe"], r["outcome"], f"{r['seconds']:.0f}", r["note"].replace("|", "/")]
            for r in result.recipes]  # fmt: skip
    how = []
    if result.recipes_at_once > 1:
        how = [f"{result.recipes_at_once} recipes ran at once: their tokens/s are not a quiet "
               "card's (part d's capstone is).", ""]  # fmt: skip
    table = _table(["recipe", "outcome", "seconds", "note"], rows)
    return ["## e. The recipes", "", *how, *table, ""]


def _plain(value):
    """A pandas cell as JSON: NaN and missing as None, numpy numbers as Python's."""
    try:
        if value != value:  # NaN
            return None
    except (TypeError, ValueError):
        return None
    return value.item() if hasattr(value, "item") else value


# --------------------------------------------------------------------------------------------
# c. The lessons in fresh kernels


def notebook_paths(lessons: tuple[str, ...] | None) -> list[Path]:
    """The notebooks named by number ("05") or path; None: every lesson in notebooks/."""
    every = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if lessons is None:
        return every
    out = []
    for item in lessons:
        path = Path(item)
        if path.suffix == ".ipynb":
            out.append(path.resolve())
            continue
        match = [p for p in every if p.name.startswith(f"{int(item):02d}_")]
        if not match:
            raise ValueError(f"no notebook for lesson {item!r} in {ROOT / 'notebooks'}")
        out.append(match[0])
    return out


def lesson_number(path: Path) -> str:
    """ "05" for notebooks/05_mixed_precision.ipynb; the file's stem for any other notebook."""
    match = re.match(r"(\d\d)_", path.name)
    return match.group(1) if match else path.stem


@dataclass
class _Running:
    path: Path
    scale: str
    proc: subprocess.Popen
    started: float
    claims: Path
    out_dir: Path
    need: int = 0  # the card's bytes it was admitted with
    beside: set[str] = field(default_factory=set)  # the lessons that ran beside it
    origin: float = 0.0  # the run's start (time.monotonic()): the row's times count from it


def _launch(path: Path, scale: str, work: Path, device: str | None) -> _Running:
    """Execute one notebook in a fresh kernel, in a process of its own (tools/run_course.py)."""
    out_dir = work / scale
    out_dir.mkdir(parents=True, exist_ok=True)
    claims = out_dir / f"{path.stem}.claims.jsonl"
    claims.unlink(missing_ok=True)
    env = {**os.environ, "COURSE_SCALE": scale, "COURSE_CLAIMS": str(claims),
           "COURSE_RESULTS": str(out_dir / "results.jsonl"), "COURSE_PROGRESS": "0",
           "COURSE_SPEED_CLAIMS": "report",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           }  # fmt: skip
    if device:
        env["COURSE_DEVICE"] = device
    cmd = [sys.executable, str(ROOT / "tools" / "run_course.py"), "--no-tables", "--out",
           str(out_dir), str(path)]  # fmt: skip
    with open(out_dir / f"{path.stem}.log", "w") as log:  # the child keeps its own handle
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)  # fmt: skip
    return _Running(path, scale, proc, time.monotonic(), claims, out_dir)


def notebook_error(executed: Path) -> str:
    """The first error output of an executed notebook: cell number, exception and message."""
    if not executed.is_file():
        return "no executed copy was written"
    nb = json.loads(executed.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    for n, cell in enumerate(code, 1):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                value = str(out.get("evalue", "")).strip().splitlines()
                return f"code cell {n}: {out.get('ename')}: {value[0] if value else ''}"[:500]
    return ""


def claims_summary(path: Path) -> dict:
    """The speed claims a notebook checked: counts by verdict, and the lines not holding."""
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["verdict"]] = counts.get(r["verdict"], 0) + 1
    odd = [f"{r['claim']}: {r['verdict']}" for r in rows if r["verdict"] != "holds"]
    return {"counts": counts, "not_holding": odd}


def _finish(run: _Running, killed: bool) -> dict:
    seconds = time.monotonic() - run.started
    executed = run.out_dir / run.path.name
    if killed:
        outcome, error = "stopped at the deadline", notebook_error(executed)
    elif run.proc.returncode == 0:
        outcome, error = "passed", ""
    else:
        outcome = "failed"
        error = notebook_error(executed) or _log_tail(run.out_dir / f"{run.path.stem}.log")
    return {"lesson": lesson_number(run.path), "notebook": run.path.name, "scale": run.scale,
            "outcome": outcome, "seconds": round(seconds, 1), "error": error,
            "claims": claims_summary(run.claims), "beside": sorted(run.beside),
            "started_s": round(run.started - run.origin, 1),
            "ended_s": round(run.started - run.origin + seconds, 1)}  # fmt: skip


def _log_tail(path: Path, lines: int = 3) -> str:
    text = path.read_text().strip().splitlines() if path.is_file() else []
    return " | ".join(text[-lines:])[:500]


def _stop(run: _Running) -> None:
    try:
        os.killpg(run.proc.pid, signal.SIGKILL)  # the runner and its kernel
    except ProcessLookupError:
        pass
    run.proc.wait()


def run_notebooks(
    paths: list[Path], scale: str, work: Path, clock: Clock, parallel: int, on_done,
    device: str | None = None, estimate_s=None, need_bytes=None, ledger: Ledger | None = None,
) -> None:  # fmt: skip
    """Execute ``paths`` at ``scale``, ``parallel`` at a time, until the deadline.

    ``on_done(row)`` receives each notebook's outcome as it ends; the row names the lessons
    that ran beside it. ``estimate_s(path)``, if given, is a notebook's expected seconds: one
    is not started when fewer are left. With ``ledger``, a notebook also holds its
    ``need_bytes(path)`` of the card while it runs (shared with other parts): one waits for
    bytes while a later, smaller one may go ahead.
    """
    queue, running = list(paths), []
    while queue or running:
        for path in list(queue):
            if len(running) >= parallel:
                break
            need = estimate_s(path) if estimate_s else 30.0
            if clock.left() < need:
                queue.remove(path)
                on_done(_not_started(path, scale, need, clock.left()))
                continue
            nbytes = need_bytes(path) if need_bytes else 0
            if ledger is not None and not ledger.take(nbytes):
                continue  # waits for bytes
            queue.remove(path)
            new = _launch(path, scale, work, device)
            new.need, new.origin = nbytes, clock.start
            for other in running:
                other.beside.add(lesson_number(path))
                new.beside.add(lesson_number(other.path))
            running.append(new)
        time.sleep(0.5)
        for run in list(running):
            over = clock.left() <= 0
            if run.proc.poll() is None and not over:
                continue
            killed = over and run.proc.poll() is None
            if killed:
                _stop(run)
            if ledger is not None:
                ledger.give(run.need)
            on_done(_finish(run, killed=killed))
            running.remove(run)


def _not_started(path: Path, scale: str, need: float, left: float) -> dict:
    why = f"not started: about {need / 60:.1f} min needed, {max(0.0, left) / 60:.1f} min left"
    return {"lesson": lesson_number(path), "notebook": path.name, "scale": scale,
            "outcome": "not started", "seconds": 0.0, "error": why,
            "claims": {"counts": {}, "not_holding": []}}  # fmt: skip


def covered_earlier(reports: Path) -> set[str]:
    """Lessons an earlier report (in ``reports``) ran to the end at the full scale on a GPU."""
    done = set()
    for path in sorted(reports.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not str(data.get("device", "")).startswith("cuda"):
            continue
        done |= {r["lesson"] for r in data.get("lessons", [])
                 if r.get("scale") == "full" and r.get("outcome") == "passed"}  # fmt: skip
    return done


def full_order(paths: list[Path], covered: set[str]) -> tuple[list[Path], str]:
    """The full-scale order: FULL_ORDER, lessons no earlier report covered first."""
    rank = {lesson: i for i, lesson in enumerate(FULL_ORDER)}
    ordered = sorted(paths, key=lambda p: rank.get(lesson_number(p), len(rank)))
    fresh = [p for p in ordered if lesson_number(p) not in covered]
    again = [p for p in ordered if lesson_number(p) in covered]
    why = ("full scale, in order of value (the capstone, the memory lessons, then speed), "
           f"lessons not yet covered by an earlier report first: "
           f"{' '.join(lesson_number(p) for p in fresh + again)}")  # fmt: skip
    if again:
        why += f" (already covered: {' '.join(sorted(lesson_number(p) for p in again))})"
    return fresh + again, why


def _part_c(run: _Run, work: Path, minutes: dict[str, float], ledger: Ledger | None = None):
    """The lessons, several at once (``run.shares["c"]``, beside parts b and e), each holding
    its need of the card in ``ledger``: on a GPU at the full scale, the tiny scale where the
    full scale cannot run (a lesson that does not fit the card; on a CPU, every lesson asked
    for). Returns the notebooks that failed beside others, for ``_part_c_alone``."""
    cfg, result, clock = run.cfg, run.result, run.clock
    missing = [m for m in ("nbclient", "ipykernel") if not compat.importable(m)]
    if missing:
        result.not_reached.append(
            f"lessons: {' and '.join(missing)} not installed here, so no notebook can run "
            "(for a GPU host: make gpu-wheels, then carry .whl; see README)"
        )
        run.write()
        return []
    tiny, full, fits = _split(run)
    slots, again = run.shares.get("c", _slots(result)), []

    def done(row: dict) -> None:
        if row["outcome"] == "failed" and row["beside"]:
            row["outcome"] = "failed beside others"
            row["error"] += "; runs again alone"
            again.extend(p for p in tiny + full if p.name == row["notebook"])
        _lesson_done(run, row)

    run_notebooks(tiny, "tiny", work, clock, slots, done, cfg.device,
                  need_bytes=lambda path: SMALL_JOB_BYTES, ledger=ledger)  # fmt: skip
    if not full:
        on_gpu = result.device.startswith("cuda")
        why = "the scale here is tiny ($COURSE_SCALE, or a card too small for the full scale)"
        result.order = (
            f"tiny scale only: {'the full scale runs on a CUDA GPU' if not on_gpu else why}"
        )
        run.write()
        return again
    ordered, result.order = full_order(full, covered_earlier(REPORTS))
    result.order += f"; up to {slots} at once" + (
        f" within {human_bytes(ledger.capacity)} of the card, shared" if ledger else ""
    )
    run.write()

    def need_bytes(path: Path) -> int:  # what the lesson has on the card at its peak
        fit = fits.get(lesson_number(path))
        return fit.need if fit is not None else SMALL_JOB_BYTES

    run_notebooks(ordered, "full", work, clock, slots, done, cfg.device, _full_pace(minutes),
                  need_bytes, ledger)  # fmt: skip
    return again


def _part_c_alone(run: _Run, work: Path, minutes: dict[str, float], again: list[Path]) -> None:
    """The notebooks that failed beside others, again one at a time with the card to themselves
    (each at the scale it failed at)."""
    full = {p.name for p in _split(run)[1]}
    for path in again:
        at_full = path.name in full
        run_notebooks([path], "full" if at_full else "tiny", work, run.clock, 1,
                      lambda row: _lesson_done(run, row), run.cfg.device,
                      _full_pace(minutes) if at_full else None)  # fmt: skip


def _full_pace(minutes: dict[str, float]):
    """A full-scale notebook's expected seconds, as part c paces them (one is not started with
    fewer left): the preflight's FLOP-based minutes for its lesson, with a margin."""
    return lambda path: 60 * (1.5 * minutes.get(lesson_number(path), 1.0) + 0.5)


def _lesson_done(run: _Run, row: dict) -> None:
    run.result.lessons.append(row)
    run.write()
    beside = f" beside {' '.join(row['beside'])}" if row.get("beside") else ""
    span = f" ({row['started_s']:.0f}-{row['ended_s']:.0f} s)" if "started_s" in row else ""
    run.say(f"[c] lesson {row['lesson']} ({row['scale']}): {row['outcome']} in "
            f"{row['seconds']:.0f} s{span}{beside} {row['error']}".rstrip())  # fmt: skip


def _split(run: _Run):
    """Part c's notebooks (``_lesson_split``), worked out once, when the plan is made: the fit
    table runs the estimator, which part b's thread runs too once the parts are side by side."""
    with run.lock:
        if run.split is None:
            run.split = _lesson_split(run.cfg, run.result)
        return run.split


def _lesson_split(cfg: GpuCheckConfig, result: GpuCheckResult):
    """Part c's notebooks: (at the tiny scale, at the full scale, each lesson's fit on the card
    by number). On a GPU that runs the full scale, the tiny scale is for the lessons that do
    not fit it (``fullscale.fit_table``); elsewhere every notebook is at the tiny scale."""
    on_gpu = result.device.startswith("cuda")
    paths = _lesson_paths(cfg, on_gpu)
    if not (on_gpu and "scale=full" in result.environment.get("scale", "")):
        return paths, [], {}
    card = gpu_info(resolve(cfg.device))
    fits = {row.lesson: row for row in fit_table(fit_scale(card), card)}
    small = [
        p for p in paths if getattr(fits.get(lesson_number(p)), "status", "") == "does not fit"
    ]
    return small, [p for p in paths if p not in small], fits


# --------------------------------------------------------------------------------------------
# The run and its report


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60]


def report_paths(out: Path, card: str, when: datetime) -> tuple[Path, Path]:
    """``<out>/<date>-<card>.md`` and ``.json``; a second run the same day gets ``-2``..."""
    stem = f"{when:%Y-%m-%d}-{_slug(card)}"
    n, name = 1, stem
    while (out / f"{name}.json").exists():
        n += 1
        name = f"{stem}-{n}"
    return out / f"{name}.md", out / f"{name}.json"


def run_gpu_check(
    cfg: GpuCheckConfig, say: Callable[[str], None] = lambda text: None
) -> tuple[GpuCheckResult, Path]:
    """Run parts a, b, d, e and c within the deadline; the result and the Markdown report's path.

    The report is rewritten after every step; ``say`` receives one line per step.
    """
    clock = Clock(cfg.deadline_min)
    d = resolve(cfg.device)
    cfg = replace(cfg, device=str(d))
    now = datetime.now(timezone.utc)
    result = GpuCheckResult(now.strftime("%Y-%m-%d %H:%M UTC"), str(d), d.type, cfg.deadline_min)
    out = cfg.out or (REPORTS if is_cuda(d) else ROOT / "build" / "gpu-check")
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []

    def write() -> None:
        with run.lock:  # parts b, e and c write from threads of their own
            if not paths:  # named once the card is known (part a)
                paths.extend(report_paths(out, result.card, now))
            result.seconds = round(clock.spent(), 1)
            _atomic(paths[1], json.dumps(asdict(result), indent=1, default=str))
            _atomic(paths[0], render_markdown(result, cfg))

    run = _Run(cfg, result, clock, write, say)
    with _timed_part(run, "a"):
        preflight = _part_a(run)
    run.flops_per_s = preflight.flops_per_s
    run.shares = shares(_slots(result))
    settings = estimator_settings(cfg.device, cfg.quick)
    plan = plan_parts(_plan_inputs(run, preflight, settings), clock.left())
    result.plan = plan.summary()
    write()
    say("[plan] " + "; ".join(result.plan))
    with _timed_part(run, "d"):
        speeds = _speed_phase(run, {k: c for k, c in settings.items() if k in CAPSTONE})
    work = ROOT / "build" / "gpu-check" / "executed"
    part_b, again = _side_by_side(run, settings, preflight.lesson_minutes, work)
    with _timed_part(run, "alone"):
        records = _part_b_alone(part_b)
        _part_c_alone(run, work, preflight.lesson_minutes, again)
    _part_d(_with_speeds(records, speeds, settings), result)
    result.finished = True
    write()
    return result, paths[0]


def shares(slots: int) -> dict[str, int]:
    """Slots of parts b, e and c side by side: a quarter each for b and e, the rest for c (at
    least one each)."""
    b = e = max(1, slots // 4)
    return {"b": b, "e": e, "c": max(1, slots - b - e)}


def _side_by_side(run: _Run, settings: dict[str, RunConfig], minutes: dict, work: Path):
    """Parts b, e and c at once, each in a thread of its own, sharing the card's bytes (a
    ``Ledger`` within ``CARD_SHARE`` of it): what they measure is each process's own bytes, or
    ratios of contenders timed in the same rounds, so none needs a quiet card. Returns part b
    and the notebooks to run again alone."""
    result, s = run.result, run.shares
    cuda = result.device.startswith("cuda") and result.card_bytes
    ledger = Ledger(int(CARD_SHARE * result.card_bytes)) if cuda else None
    threads = os.environ.get("OMP_NUM_THREADS") or str(
        max(1, (os.cpu_count() or 1) // sum(s.values()))
    )
    result.side_by_side = (
        f"b, e and c at once with {s['b']}, {s['e']} and {s['c']} slots"
        + (f", within {human_bytes(ledger.capacity)} of the card" if ledger else "")
        + f"; the notebooks and recipes with OMP_NUM_THREADS={threads}"
    )
    with _environment(OMP_NUM_THREADS=threads), ThreadPoolExecutor(3) as pool:
        b = pool.submit(_in_part, run, "b", _part_b, run, settings, ledger)
        e = pool.submit(_in_part, run, "e", _part_e, run, ledger)
        c = pool.submit(_in_part, run, "c", _part_c, run, work, minutes, ledger)
        return b.result(), (e.result(), c.result())[1]


@contextlib.contextmanager
def _environment(**values: str):
    """Variables set for the processes started inside (each thread's children), then restored.

    Side by side, the processes' CPU threads share the host's cores: each alone would start as
    many as there are cores, and several would oversubscribe them (``torch.distributed.run``
    sets OMP_NUM_THREADS=1 for several processes per node, unless it is set, for this reason)."""
    with mock.patch.dict(os.environ, values):  # restores what was there, or its absence
        yield


def _in_part(run: _Run, part: str, fn, *args):
    with _timed_part(run, part):
        return fn(*args)


def _plan_inputs(run: _Run, preflight, settings: dict[str, RunConfig]) -> PlanInputs:
    """What parts d, b, e and c will run here, for ``helpers.course.gpu_plan``."""
    cfg, result, s = run.cfg, run.result, run.shares
    on_gpu = result.device.startswith("cuda")
    timed = [label for label, c in settings.items() if label in CAPSTONE]
    steps = max((max(1, c.warmup) + 2 + c.repeats for c in settings.values()), default=9)
    tiny, full, _ = _split(run)
    full = [lesson_number(p) for p in full]
    card_s = sum(setting_flops(c) for c in settings.values()) / (preflight.flops_per_s or math.inf)
    return PlanInputs(
        speed=timed, speed_steps=steps, settings=list(settings), slots=s["b"],
        settings_device_s=card_s,
        recipes=[label for label, _ in recipe_runs(cfg.device or "cpu", cfg.quick)],
        recipes_at_once=s["e"], tiny=[lesson_number(p) for p in tiny], tiny_at_once=s["c"],
        full_minutes={n: preflight.lesson_minutes.get(n, 1.0) for n in full},
        full_device_minutes={n: preflight.lesson_device_minutes.get(n, 0.0) for n in full},
        full_at_once=s["c"], earlier=earlier_report(REPORTS, result.card) if on_gpu else {},
        scale="full" if full else "tiny",
    )  # fmt: skip


def _slots(result: GpuCheckResult) -> int:
    """Experiments at once on this run's device (``schedule.concurrency``)."""
    return concurrency("cuda" if result.device.startswith("cuda") else "cpu")


def _lesson_paths(cfg: GpuCheckConfig, on_gpu: bool) -> list[Path]:
    """The notebooks part c runs: those asked for, else every lesson on a GPU and the
    rehearsal's short subset elsewhere."""
    return notebook_paths(cfg.lessons if cfg.lessons is not None else
                          None if on_gpu else REHEARSAL_LESSONS)  # fmt: skip


@contextlib.contextmanager
def _timed_part(run: _Run, part: str):
    """Note the seconds a part took in ``result.part_seconds`` (the next run's plan reads it)."""
    start = run.clock.spent()
    try:
        yield
    finally:
        with run.lock:
            run.result.part_seconds[part] = round(run.clock.spent() - start, 1)


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


# --------------------------------------------------------------------------------------------
# Markdown


def _mib(nbytes) -> str:
    """MiB, whole above 100 (a GPU's sizes), with two decimals below (the tiny scale's)."""
    if nbytes is None:
        return ""
    return f"{nbytes / MiB:,.0f}" if abs(nbytes) >= 100 * MiB else f"{nbytes / MiB:.2f}"


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows]
    return lines


def render_markdown(result: GpuCheckResult, cfg: GpuCheckConfig) -> str:
    """The report a maintainer reads: one section per part, tables, what was not reached."""
    status = "finished" if result.finished else "in progress (or stopped before the end)"
    lines = [
        f"# gpu-check: {result.card}, {result.started}",
        "",
        f"`python -m helpers gpu-check --deadline {cfg.deadline_min:g}"
        f"{' --quick' if cfg.quick else ''}` on `{result.device}`: {status}, "
        f"{result.seconds / 60:.1f} of {result.deadline_min:g} min"
        + _parts_line(result.part_seconds)
        + ".",
        "",
        "## a. Environment",
        "",
        *_table(["", ""], [[k, v] for k, v in result.environment.items() if k != "scale"]),
        "",
        "```text",
        result.environment.get("scale", ""),
        "```",
        "",
        "Packages against the tested range (`python -m helpers doctor`):",
        "",
        "```text",
        *result.packages,
        "```",
        "",
        "### Preflight",
        "",
        "```text",
        result.preflight or "(not run yet)",
        "```",
        "",
        "### Plan (made after part a; what each part then took is on the first line)",
        "",
        *(f"- {line}" for line in result.plan or ["(not made yet)"]),
        "",
        *([f"Side by side: {result.side_by_side}.", ""] if result.side_by_side else []),
    ]
    lines += _estimator_markdown(result) + _capstone_markdown(result)
    lines += _recipes_markdown(result) + _lessons_markdown(result)
    if result.not_reached:
        lines += ["## Not reached", "", *(f"- {item}" for item in result.not_reached), ""]
    return "\n".join(lines)


def _parts_line(part_seconds: dict) -> str:
    """ " (a 1.1, b 3.0, e 0.5, c 4.2 min)": the minutes each part took, "" before any ended."""
    if not part_seconds:
        return ""
    return " (" + ", ".join(f"{p} {s / 60:.1f}" for p, s in part_seconds.items()) + " min)"


def _estimator_markdown(result: GpuCheckResult) -> list[str]:
    lines = [
        "## b. The estimator against the real allocator",
        "",
        "Each setting trained in a fresh process (`helpers.train.measure`). MiB throughout. "
        "*Predicted* is the estimator (`estimate_run`), *tracked* the course's per-category "
        "tracker over one steady-state step (view 1), *allocated* and *reserved* the caching "
        "allocator's `max_memory_allocated` / `max_memory_reserved` over the timed steps "
        "(view 2), *NVML* the whole device as nvidia-smi sees it (view 3). The gaps: "
        "allocated - tracked is what the allocator hands out beyond the tensors the tracker "
        "sees (cuBLAS/cuDNN workspaces, kernels' scratch); reserved - allocated is the cache "
        "and fragmentation; NVML - reserved is the CUDA context (and anything else on the card).",
        "",
    ]
    if result.estimator_phases:
        lines += [
            f"How they ran: {result.estimator_phases}; at most {result.estimator_most_at_once} "
            "ran together (*ran*: the phase and the seconds since the start). A setting run "
            "*at once* with others was capped to its predicted peak x "
            f"{CAP_MARGIN:g} + {CAP_EXTRA / GiB:g} GiB on a GPU, and has no NVML reading: "
            "NVML sees the whole card, every process on it.",
            "",
        ]
    if result.speed_phase:
        sp = result.speed_phase
        lines += [f"The capstone's {len(sp['labels'])} recipes were timed before them, in one "
                  f"process on a quiet card, {sp['started_s']:.0f}-{sp['ended_s']:.0f} s"
                  f"{': ' + sp['error'] if sp.get('error') else ''} (part d).", ""]  # fmt: skip
    header = ["setting", "ran", "path", "predicted", "tracked", "pred/tracked", "worst category",
              "allocated", "alloc-tracked", "reserved", "reserved-alloc", "NVML",
              "NVML-reserved"]  # fmt: skip
    rows = []
    for r in result.estimator:
        if "error" in r:
            rows.append([r["label"], _ran(r), "", "", "", "", f"**{r['error'][:160]}**",
                         *[""] * 6])  # fmt: skip
            continue
        pred, tracked = r["predicted"]["peak"], r["tracked"]["peak"]
        worst = worst_category(r)
        rows.append([
            r["label"], _ran(r), r["path"], _mib(pred), _mib(tracked), f"{pred / tracked:.3f}",
            f"{worst[0]} {worst[1]:.3f}" if worst else "", _mib(r["max_allocated"]),
            _mib(r["allocated_minus_tracked"]), _mib(r["max_reserved"]),
            _mib(r["reserved_minus_allocated"]), _mib(r["nvml_used"]),
            _mib(r["nvml_minus_reserved"]),
        ])  # fmt: skip
    return lines + _table(header, rows) + [""]


def _ran(row: dict) -> str:
    """A part b row's phase, seconds and timeout, "at once 3-15 s of 90" (older reports have
    neither, or no timeout)."""
    if "phase" not in row:
        return ""
    given = f" of {row['timeout_s']:.0f}" if row.get("timeout_s") else ""
    return f"{row['phase']} {row['started_s']:.0f}-{row['ended_s']:.0f} s{given}"


def _num(row: dict, key: str, fmt: str = "{:.2f}") -> str:
    return "" if row.get(key) is None else fmt.format(row[key])


def _capstone_markdown(result: GpuCheckResult) -> list[str]:
    if not result.capstone:
        return []
    lines = [
        "## d. The capstone's recipes next to the guide's V100 table",
        "",
        "The nine recipes of the v4.30 single-GPU guide (bert-large, sequence 512, batch 4 at "
        "the full scale): samples/s and MFU timed on a quiet card, the recipes in turn in one "
        "process before parts b, e and c started. Memory is NVML's device memory after those "
        "timed steps where there is one (as the guide's nvidia-smi), else part b's tracked "
        "peak; ratios are to each side's vanilla run. Source: "
        "https://huggingface.co/docs/transformers/v4.30.0/en/perf_train_gpu_one",
        "",
    ]
    header = ["recipe", "samples/s", "memory MiB", "speed ratio", "memory ratio", "MFU",
              "V100 samples/s", "V100 MB", "V100 speed ratio", "V100 memory ratio",
              "status"]  # fmt: skip
    rows = []
    for r in result.capstone:
        rows.append([r["recipe"], _num(r, "samples/s"), _num(r, "memory MiB", "{:,.0f}"),
                     _num(r, "speed ratio"), _num(r, "memory ratio"), _num(r, "mfu", "{:.1%}"),
                     _num(r, "V100 samples/s"), _num(r, "V100 MB", "{:,.0f}"),
                     _num(r, "V100 speed ratio"), _num(r, "V100 memory ratio"),
                     r.get("status", "")])  # fmt: skip
    return lines + _table(header, rows) + [""]


def _lessons_markdown(result: GpuCheckResult) -> list[str]:
    lines = ["## c. The lessons", ""]
    if result.order:
        lines += [f"Order: {result.order}.", ""]
    if any(r.get("beside") for r in result.lessons):
        lines += ["*Beside*: the lessons that ran on the card at the same time. Their bytes are "
                  "each process's own; NVML's whole-device figures (lessons "
                  f"{', '.join(NVML_LESSONS)}) and the speed claims are a shared card's (the "
                  "claims compare contenders timed in the same rounds).", ""]  # fmt: skip
    header = ["lesson", "scale", "outcome", "seconds", "beside", "speed claims", "error or note"]
    rows = []
    for r in result.lessons:
        counts = r["claims"]["counts"]
        claims = ", ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items()))
        rows.append([r["lesson"], r["scale"], r["outcome"], f"{r['seconds']:.0f}",
                     " ".join(r.get("beside", [])), claims,
                     r["error"].replace("|", "/")])  # fmt: skip
    lines += [*_table(header, rows), ""]
    odd = [(r["lesson"], r["scale"], c) for r in result.lessons for c in r["claims"]["not_holding"]]
    if odd:
        lines += ["Speed claims that did not hold (reported, not failing):", ""]
        lines += [f"- {lesson} ({scale}): {claim}" for lesson, scale, claim in odd] + [""]
    return lines


# --------------------------------------------------------------------------------------------
# README's summary of the committed reports


def reports_markdown(reports: Path = REPORTS) -> str:
    """Markdown for README: each GPU report, newest first, with what ran and how close the
    estimator came; a line saying there is none yet when the folder has no GPU report."""
    rows = []
    for path in sorted(reports.glob("*.json"), reverse=True):
        data = json.loads(path.read_text())
        if str(data.get("device", "")).startswith("cuda"):
            rows.append(_report_row(path, data))
    if not rows:
        return ("No GPU report yet: `make gpu-check` has not run on a GPU. Until one runs, the "
                "course's CUDA paths are checked against fake cards (tests/fake_gpu.py) and its "
                "CUDA memory figures come from the estimator on paper.\n")  # fmt: skip
    header = ["report", "card", "lessons passed (tiny / full)", "lessons failed",
              "estimator: predicted / tracked peak", "predicted / allocator peak"]  # fmt: skip
    return "\n".join(_table(header, rows)) + "\n"


def _report_row(path: Path, data: dict) -> list[str]:
    def lessons(scale: str, outcome: str) -> str:
        found = [r["lesson"] for r in data.get("lessons", [])
                 if r["scale"] == scale and r["outcome"] == outcome]  # fmt: skip
        return " ".join(sorted(found)) or "none"

    ran = [r for r in data.get("estimator", []) if "predicted" in r]
    tracked = [r["predicted"]["peak"] / r["tracked"]["peak"] for r in ran]
    allocated = [r["predicted"]["peak"] / r["max_allocated"] for r in ran if r["max_allocated"]]

    def spread(ratios: list[float]) -> str:
        return f"{min(ratios):.3f} to {max(ratios):.3f} ({len(ratios)} settings)" if ratios else ""

    failed = " ".join(f"{r['lesson']} ({r['scale']})" for r in data.get("lessons", [])
                      if r["outcome"] == "failed")  # fmt: skip
    return [f"[{path.stem}](reports/gpu/{path.with_suffix('.md').name})", data.get("card", ""),
            f"{lessons('tiny', 'passed')} / {lessons('full', 'passed')}", failed or "none",
            spread(tracked), spread(allocated)]  # fmt: skip
