"""How long each part of ``gpu-check`` will take, predicted before it runs.

After part a, ``gpu-check`` knows the settings of part b, the recipes of part e, the lessons
of part c and, from the preflight, the card's throughput (its minutes per lesson at the full
scale). An earlier report from the same card says how long each setting, recipe and lesson
took there. The run times the capstone first, on a quiet card (d), then runs b, e and c side by
side, then what must run alone. From these, ``plan_parts`` predicts when each part starts and
how long it takes, and says, before any of it runs, which parts the deadline leaves out. The
report keeps the plan next to what each part then took (``part_seconds``).

Example::

    plan = plan_parts(PlanInputs(settings=["a", "b"], speed=["b"], slots=2), left_s=600)
    plan.summary()  # one line per part, then what will not fit
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

# Seconds assumed where no earlier report of this card says, by the scale part b runs at: a
# setting in its fresh process (an H200 at the full scale: 14-50 s; this course's 2-core CI
# machine at the tiny scale: 3-10 s), a recipe, a lesson at the tiny scale, one training step
# of a capstone recipe (the H200 at the full scale: 0.08-0.67 s).
DEFAULTS = {"full": {"setting": 30.0, "recipe": 15.0, "lesson": 60.0, "step": 0.5},
            "tiny": {"setting": 8.0, "recipe": 12.0, "lesson": 60.0, "step": 0.05}}  # fmt: skip
SPEED_START_S = 10.0  # part d's timing: its one process starting (imports, CUDA context)
BUILD_S = 3.0  # and each recipe's model and optimizer built on the card before its steps
NOTEBOOK_S = 10.0  # a notebook's kernel and fork server starting (CI's quickest lesson: 8.8 s)


@dataclass
class PlanInputs:
    """What the parts after a will run, and how (``gpu_check`` fills it after part a)."""

    speed: list[str] = field(default_factory=list)  # d: timed in turn in one process, first
    speed_steps: int = 9  # steps each of those runs: warmup, untimed, timed, the FLOP count
    settings: list[str] = field(default_factory=list)  # b's labels, in order
    alone: list[str] = field(default_factory=list)  # those run one at a time, after b, e and c
    slots: int = 1  # b's settings at once
    settings_device_s: float = 0.0  # the card's work of b's settings (FLOPs / throughput)
    recipes: list[str] = field(default_factory=list)  # e's labels
    recipes_at_once: int = 1
    tiny: list[str] = field(default_factory=list)  # c's lessons at the tiny scale
    tiny_at_once: int = 1
    full_minutes: dict[str, float] = field(default_factory=dict)  # lesson -> preflight minutes
    full_device_minutes: dict[str, float] = field(default_factory=dict)  # of which the card's
    full_at_once: int = 1
    earlier: dict = field(default_factory=dict)  # an earlier report of this card (its JSON)
    scale: str = "full"  # part b's scale: which DEFAULTS apply


@dataclass
class PartPlan:
    """One part's predicted seconds, when it starts (after part a), and from what."""

    part: str  # "d", "b", "e", "c tiny", "c full", "alone"
    seconds: float
    basis: str
    start: float = 0.0


@dataclass
class GpuPlan:
    """The predicted parts in their order, against the seconds left when they start."""

    parts: list[PartPlan]
    left_s: float

    def will_not_fit(self) -> list[str]:
        """The parts that end past the deadline, in the order they start."""
        return [p.part for p in self.parts if p.start + p.seconds > self.left_s]

    def total(self) -> float:
        """Seconds from the plan's start to the end of the last part."""
        return max((p.start + p.seconds for p in self.parts), default=0.0)

    def summary(self) -> list[str]:
        """One line per part, then the parts the deadline leaves out (or that all fit)."""
        out = [f"{p.part}: about {p.seconds / 60:.1f} min from minute {p.start / 60:.1f} "
               f"({p.basis})" for p in self.parts]  # fmt: skip
        late = self.will_not_fit()
        left = f"{self.total() / 60:.1f} min predicted, {self.left_s / 60:.1f} min left"
        out.append(f"will not fit: {', '.join(late)} ({left})" if late else f"all fit ({left})")
        return out


def plan_parts(inputs: PlanInputs, left_s: float) -> GpuPlan:
    """Predict parts d, b, e and c (tiny, then full) from ``inputs``; ``left_s``: seconds to the
    deadline. d runs first, alone; b, e and c then start together; what runs alone follows.

    Args:
        inputs: the parts' work (``PlanInputs``) and an earlier report of the card, if any.
        left_s: seconds left when part d starts.

    Returns:
        A ``GpuPlan``: each part's start, seconds and basis; ``will_not_fit`` names the late ones.
    """
    earlier, default = inputs.earlier, DEFAULTS[inputs.scale]
    setting_rows = [_span(r) for r in earlier.get("estimator", [])]
    setting_s = _by_label(setting_rows, "label", "seconds", default["setting"])
    step_rows = [{**r, "step": statistics.median(r["step_times"])}
                 for r in earlier.get("estimator", []) if r.get("step_times")]  # fmt: skip
    step_s = _by_label(step_rows, "label", "step", default["step"])
    recipe_s = _by_label(earlier.get("recipes", []), "recipe", "seconds", default["recipe"])
    tiny_rows = [r for r in earlier.get("lessons", []) if r.get("scale") == "tiny"]
    tiny_s = _by_label(tiny_rows, "lesson", "seconds", default["lesson"])

    def basis(rows: list[dict]) -> str:
        if any(r.get("seconds") for r in rows):
            return "an earlier report of this card"
        return "defaults: none in an earlier report" if earlier else "defaults: no earlier report"

    d = SPEED_START_S + sum(BUILD_S + inputs.speed_steps * step_s(s) for s in inputs.speed)
    d = d if inputs.speed else 0.0
    together = [s for s in inputs.settings if s not in inputs.alone]
    b = sum(setting_s(s) for s in together) / max(1, inputs.slots)
    e = sum(recipe_s(r) for r in inputs.recipes) / max(1, inputs.recipes_at_once)
    tiny = sum(tiny_s(n) for n in inputs.tiny) / max(1, inputs.tiny_at_once)
    b_why = f"{len(together)} settings {inputs.slots} at once; {basis(setting_rows)}"
    e_why = f"{len(inputs.recipes)} recipes {inputs.recipes_at_once} at once"
    tiny_why = f"{len(inputs.tiny)} lessons {inputs.tiny_at_once} at once; {basis(tiny_rows)}"
    parts = [
        PartPlan("d", d, f"{len(inputs.speed)} recipes timed in one process on a quiet card"),
        PartPlan("b", b, b_why, d),
        PartPlan("e", e, f"{e_why}; {basis(earlier.get('recipes', []))}", d),
        PartPlan("c tiny", tiny, tiny_why, d),
    ]
    if inputs.full_minutes:
        parts.append(_full_part(inputs, d + tiny))
    after = max(p.start + p.seconds for p in parts)
    if inputs.alone:
        alone = sum(setting_s(s) for s in inputs.alone)
        parts.append(PartPlan("alone", alone, f"{len(inputs.alone)} settings", after))
    return GpuPlan(parts, left_s)


def _full_part(inputs: PlanInputs, start: float) -> PartPlan:
    """The full scale, lessons side by side and beside part b: the card's work (the preflight's
    FLOPs over its throughput, part b's settings' too) done one process at a time, while the
    rest (processes starting, models built) overlaps; never less than the longest lesson.
    Without NVIDIA's Multi-Process Service the card runs one process's kernels at a time,
    switching between them ("When to Use MPS",
    https://docs.nvidia.com/deploy/mps/when-to-use-mps.html), so processes beside each other
    fill each other's idle gaps but do not share the card's compute."""
    n = max(1, inputs.full_at_once)
    each = {k: 60 * m + NOTEBOOK_S for k, m in inputs.full_minutes.items()}
    card = 60 * sum(inputs.full_device_minutes.get(k, 0.0) for k in each)
    card += inputs.settings_device_s
    seconds = max(card, sum(each.values()) / n, max(each.values()))
    why = (f"{len(each)} lessons {n} at once; the card's work {card / 60:.1f} min (part b's "
           f"included) one process at a time, the rest {n} at once (the preflight's minutes "
           f"+ {NOTEBOOK_S:.0f} s each)")  # fmt: skip
    return PartPlan("c full", seconds, why, start)


def _span(row: dict) -> dict:
    """A part b row with its seconds from start to end (the process, the estimate) where the
    report has them; older reports have the measurement's own seconds only."""
    if row.get("ended_s") is not None and row.get("started_s") is not None:
        return {**row, "seconds": row["ended_s"] - row["started_s"]}
    return row


def _by_label(rows: list[dict], key: str, value: str, default: float):
    """A function: a label's seconds in ``rows``, else their median, else ``default`` (rows
    with no seconds, or 0: a setting that failed, a lesson not started, do not count)."""
    seen = {r[key]: float(r[value]) for r in rows if r.get(value) and key in r}
    fallback = statistics.median(seen.values()) if seen else default
    return lambda label: seen.get(label, fallback)


def earlier_report(reports: Path, card: str) -> dict:
    """The latest report in ``reports`` from a card named ``card`` (its JSON), or {}."""
    found = {}
    for path in sorted(reports.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("card") == card:
            found = data  # sorted by date: the last one is the latest
    return found
