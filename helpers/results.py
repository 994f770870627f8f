"""One record per experiment, appended to a JSON-lines results store; tables built from it."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from helpers.names import MiB

RESULTS_ENV = "COURSE_RESULTS"  # path of the JSON-lines store


@dataclass
class Record:
    """What one experiment measured. Memory fields are bytes; times are seconds."""

    config: dict
    device: dict = field(default_factory=dict)
    n_params: int | None = None
    n_tensors: int | None = None  # parameter tensors (each one allocation: CUDA rounds each)
    memory: dict | None = None  # view 1: CategoryPeaks as a dict (exact, any device)
    allocator: dict | None = None  # view 2: {"allocated", "reserved"} peaks (accelerators only)
    nvml_used: int | None = None  # view 3: whole-device bytes in use per NVML (NVIDIA only)
    step_time: float | None = None  # median seconds per optimizer step
    step_times: list[float] = field(default_factory=list)
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    flops_per_step: int | None = None
    mfu: float | None = None  # model FLOPs utilisation (None with checkpointing: see hfu)
    hfu: float | None = None  # hardware FLOPs utilisation: recomputed FLOPs counted too
    losses: list[float] = field(default_factory=list)
    error: str | None = None  # set when the run failed, e.g. "OutOfMemoryError: ..."
    error_type: str | None = None  # "oom" | "error" | "crash"
    lesson: str = ""
    extra: dict = field(default_factory=dict)  # a lesson's own measurements (numbers, lists)
    wall_s: float | None = None
    timestamp: float = field(default_factory=time.time)

    @property
    def ok(self) -> bool:
        """True when the experiment ran to the end."""
        return self.error is None

    @property
    def oom(self) -> bool:
        """True when the experiment ran out of (real or budgeted) memory."""
        return self.error_type == "oom"

    @property
    def label(self) -> str:
        """The config's label, or a description built from it."""
        c = self.config
        return c.get("label") or (
            f"{c.get('model')} bs{c.get('batch_size')} {c.get('precision')} {c.get('optimizer')}"
        )

    def to_json(self) -> str:
        """One line of JSON."""
        return json.dumps(asdict(self), default=str)

    @classmethod
    def from_dict(cls, data: dict) -> Record:
        """Inverse of ``asdict``; unknown keys from newer versions are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def default_store() -> Path:
    """$COURSE_RESULTS, else results/results.jsonl in the course checkout (or the cwd)."""
    if os.environ.get(RESULTS_ENV):
        return Path(os.environ[RESULTS_ENV])
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / "notebooks").is_dir() and (folder / "helpers").is_dir():
            return folder / "results" / "results.jsonl"
    return here / "results" / "results.jsonl"


def save(record: Record, lesson: str = "", path: Path | None = None) -> Record:
    """Append ``record`` (tagged with its lesson) to the store; returns it for chaining."""
    path = Path(path or default_store())
    path.parent.mkdir(parents=True, exist_ok=True)
    if lesson:
        record.lesson = lesson
    with path.open("a") as f:
        f.write(record.to_json() + "\n")
    return record


def load(path: Path | None = None) -> list[Record]:
    """All records in the store, oldest first (an absent store is empty)."""
    path = Path(path or default_store())
    if not path.exists():
        return []
    lines = (line for line in path.read_text().splitlines() if line.strip())
    return [Record.from_dict(json.loads(line)) for line in lines]


def summary_table(records: list[Record]):
    """A pandas DataFrame: one row per experiment (the latest run of each lesson+label)."""
    import pandas as pd  # slow: only tables need it

    latest: dict[tuple[str, str], Record] = {}
    for r in records:
        latest[(r.lesson, r.label)] = r
    rows = []
    for r in latest.values():
        mem = r.memory or {}
        alloc = r.allocator or {}
        rows.append(
            {
                "lesson": r.lesson,
                "experiment": r.label,
                "device": r.device.get("name", "?"),
                "params MB": _mb(mem.get("params")),
                "grads MB": _mb(mem.get("gradients")),
                "optim MB": _mb(mem.get("optimizer_state")),
                "activ MB": _mb(mem.get("activations")),
                "peak MB": _mb(mem.get("peak")),
                "alloc peak MB": _mb(alloc.get("allocated")),
                "nvml MB": _mb(r.nvml_used),
                "step ms": None if r.step_time is None else round(1e3 * r.step_time, 1),
                "samples/s": None if r.samples_per_s is None else round(r.samples_per_s, 2),
                "MFU %": None if r.mfu is None else round(100 * r.mfu, 1),
                "status": "ok" if r.ok else (r.error_type or "error"),
            }
        )
    return pd.DataFrame(rows)


def with_speed(record: Record, comparison, label: str | None = None) -> Record:
    """``record`` with its speed from an interleaved comparison of runs (seconds per sample).

    ``step_times`` become the per-round seconds per step, so two records from the same
    comparison can be compared round by round; the medians fill the other speed fields.
    ``label``: the record's name in the comparison (default: the record's own label).
    """
    label = label or record.label
    if not record.ok or label not in comparison.times:
        return record
    samples = record.config["batch_size"] * record.config.get("grad_accum", 1)
    median = comparison.median(label) * samples
    tokens = samples * record.config["seq_len"]

    def rescaled(util: float | None) -> float | None:  # FLOPs utilisation goes as 1 / time
        return None if util is None or not record.step_time else util * record.step_time / median

    return replace(
        record,
        step_time=median,
        step_times=[t * samples for t in comparison.times[label]],
        samples_per_s=samples / median,
        tokens_per_s=tokens / median,
        mfu=rescaled(record.mfu),
        hfu=rescaled(record.hfu),
    )


def _mb(nbytes: int | None) -> float | None:
    return None if nbytes is None else round(nbytes / MiB, 1)
