"""How long each part of ``gpu-check`` will take, predicted before it runs.

After part a, ``gpu-check`` knows the settings of part b, the recipes of part e, the lessons
of part c and, from the preflight, the card's throughput (its minutes per lesson at the full
scale). An earlier report from the same card says how long each setting, recipe and lesson
took there. From these, ``plan_parts`` predicts each part's seconds (settings run side by side
counted as sharing their slots) and says, before any of it runs, which parts the deadline
leaves out. The report keeps the plan next to what each part then took (``part_seconds``).

Example::

    plan = plan_parts(PlanInputs(settings=["a", "b"], alone=["b"], slots=2), left_s=600)
    plan.summary()  # one line per part, then what will not fit
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

# Seconds assumed where no earlier report of this card says, by the scale part b runs at: a
# setting in its fresh process (an H200 at the full scale: 14-50 s; this course's 2-core CI
# machine at the tiny scale: 3-10 s), a recipe, a lesson at the tiny scale.
DEFAULTS = {"full": {"setting": 30.0, "recipe": 15.0, "lesson": 60.0},
            "tiny": {"setting": 8.0, "recipe": 12.0, "lesson": 60.0}}  # fmt: skip


@dataclass
class PlanInputs:
    """What the parts after a will run, and how (``gpu_check`` fills it after part a)."""

    settings: list[str] = field(default_factory=list)  # part b's labels, in order
    alone: list[str] = field(default_factory=list)  # those run one at a time (the capstone's)
    slots: int = 1  # part b's settings at once
    recipes: list[str] = field(default_factory=list)  # part e's labels
    recipes_at_once: int = 1
    tiny: list[str] = field(default_factory=list)  # part c's lessons at the tiny scale
    tiny_at_once: int = 1
    full_minutes: dict[str, float] = field(default_factory=dict)  # lesson -> preflight minutes
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
    e = sum(recipe_s(r) for r in inputs.recipes) / max(1, inputs.recipes_at_once)
    tiny = sum(tiny_s(n) for n in inputs.tiny) / max(1, inputs.tiny_at_once)
    tiny_why = f"{len(inputs.tiny)} lessons {inputs.tiny_at_once} at once"
    e_why = f"{len(inputs.recipes)} recipes {inputs.recipes_at_once} at once"
    parts = [
        PartPlan("b", b, f"{b_why}; {basis(setting_rows)}"),
        PartPlan("e", e, f"{e_why}; {basis(earlier.get('recipes', []))}"),
        PartPlan("c tiny", tiny, f"{tiny_why}; {basis(tiny_rows)}"),
    ]
    if inputs.full_minutes:  # as part c paces them: the preflight's minutes with a margin
        full = sum(60 * (1.5 * m + 0.5) for m in inputs.full_minutes.values())
        full_why = f"{len(inputs.full_minutes)} lessons {inputs.full_at_once} at once"
        parts.append(PartPlan("c full", full / max(1, inputs.full_at_once),
                              f"{full_why}; the preflight's minutes x 1.5 + 0.5"))  # fmt: skip
    return GpuPlan(parts, left_s)


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
