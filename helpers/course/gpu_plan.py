"""How long each part of ``gpu-check`` will take, predicted before it runs.

After part a, ``gpu-check`` knows the settings of part b, the recipes of part e, the lessons
of part c and, from the preflight, the card's throughput (its minutes per lesson at the full
scale). An earlier report from the same card says how long each setting, recipe and lesson
took there. From these, ``plan_parts`` predicts each part's seconds (settings run side by side
counted as sharing their slots) and says, before any of it runs, which parts the deadline
leaves out. The report keeps the plan next to what each part then took (``part_seconds``).

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
SPEED_START_S = 10.0  # part b's speed phase: its one process starting (imports, CUDA context)
BUILD_S = 3.0  # and each recipe's model and optimizer built on the card before its steps
NOTEBOOK_S = 10.0  # a notebook's kernel and fork server starting (CI's quickest lesson: 8.8 s)


@dataclass
class PlanInputs:
    """What the parts after a will run, and how (``gpu_check`` fills it after part a)."""

    settings: list[str] = field(default_factory=list)  # part b's labels, in order
    alone: list[str] = field(default_factory=list)  # those run one at a time
    slots: int = 1  # part b's settings at once
    speed: list[str] = field(default_factory=list)  # timed in turn in one process (the capstone)
    speed_steps: int = 8  # steps each of those runs: warmup, an untimed one, the timed ones
    recipes: list[str] = field(default_factory=list)  # part e's labels
    recipes_at_once: int = 1
    tiny: list[str] = field(default_factory=list)  # part c's lessons at the tiny scale
    tiny_at_once: int = 1
    full_minutes: dict[str, float] = field(default_factory=dict)  # lesson -> preflight minutes
    full_device_minutes: dict[str, float] = field(default_factory=dict)  # of which the card's
    full_at_once: int = 1
    earlier: dict = field(default_factory=dict)  # an earlier report of this card (its JSON)
    scale: str = "full"  # part b's scale: which DEFAULTS apply


@dataclass
class PartPlan:
    """One part's predicted seconds, and from what."""

    part: str  # "b", "e", "c tiny", "c full"
    seconds: float
    basis: str


@dataclass
class GpuPlan:
    """The predicted parts in their order, against the seconds left when they start."""

    parts: list[PartPlan]
    left_s: float

    def will_not_fit(self) -> list[str]:
        """The parts that end past the deadline, in the order they run."""
        out, spent = [], 0.0
        for p in self.parts:
            spent += p.seconds
            if spent > self.left_s:
                out.append(p.part)
        return out

    def summary(self) -> list[str]:
        """One line per part, then the parts the deadline leaves out (or that all fit)."""
        out = [f"{p.part}: about {p.seconds / 60:.1f} min ({p.basis})" for p in self.parts]
        late = self.will_not_fit()
        total = sum(p.seconds for p in self.parts)
        left = f"{total / 60:.1f} min predicted, {self.left_s / 60:.1f} min left"
        out.append(f"will not fit: {', '.join(late)} ({left})" if late else f"all fit ({left})")
        return out


def plan_parts(inputs: PlanInputs, left_s: float) -> GpuPlan:
    """Predict parts b, e and c (tiny, full) from ``inputs``; ``left_s``: seconds to the deadline.

    Args:
        inputs: the parts' work (``PlanInputs``) and an earlier report of the card, if any.
        left_s: seconds left when part b starts.

    Returns:
        A ``GpuPlan``: each part's seconds and basis; ``will_not_fit`` names the late ones.
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

    together = [s for s in inputs.settings if s not in inputs.alone]
    b = sum(setting_s(s) for s in together) / max(1, inputs.slots)
    b += sum(setting_s(s) for s in inputs.alone)
    b_why = f"{len(together)} settings {inputs.slots} at once, {len(inputs.alone)} alone"
    if inputs.speed:  # one process, the recipes in turn, each built then stepped
        b += SPEED_START_S + sum(BUILD_S + inputs.speed_steps * step_s(s) for s in inputs.speed)
        b_why += f", then {len(inputs.speed)} timed in one process"
    e = sum(recipe_s(r) for r in inputs.recipes) / max(1, inputs.recipes_at_once)
    tiny = sum(tiny_s(n) for n in inputs.tiny) / max(1, inputs.tiny_at_once)
    tiny_why = f"{len(inputs.tiny)} lessons {inputs.tiny_at_once} at once"
    e_why = f"{len(inputs.recipes)} recipes {inputs.recipes_at_once} at once"
    parts = [
        PartPlan("b", b, f"{b_why}; {basis(setting_rows)}"),
        PartPlan("e", e, f"{e_why}; {basis(earlier.get('recipes', []))}"),
        PartPlan("c tiny", tiny, f"{tiny_why}; {basis(tiny_rows)}"),
    ]
    if inputs.full_minutes:
        parts.append(_full_part(inputs))
    return GpuPlan(parts, left_s)


def _full_part(inputs: PlanInputs) -> PartPlan:
    """The full scale, lessons side by side: the card's work (the preflight's FLOPs over its
    throughput) done one lesson at a time, while the rest (processes starting, models built)
    overlaps; never less than the longest lesson. Without NVIDIA's Multi-Process Service the
    card runs one process's kernels at a time, switching between them ("When to Use MPS",
    https://docs.nvidia.com/deploy/mps/when-to-use-mps.html), so processes beside each other
    fill each other's idle gaps but do not share the card's compute."""
    n = max(1, inputs.full_at_once)
    each = {k: 60 * m + NOTEBOOK_S for k, m in inputs.full_minutes.items()}
    card = 60 * sum(inputs.full_device_minutes.get(k, 0.0) for k in each)
    seconds = max(card, sum(each.values()) / n, max(each.values()))
    why = (f"{len(each)} lessons {n} at once; the card's work {card / 60:.1f} min one after "
           f"another, the rest {n} at once (the preflight's minutes "
           f"+ {NOTEBOOK_S:.0f} s each)")  # fmt: skip
    return PartPlan("c full", seconds, why)


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
