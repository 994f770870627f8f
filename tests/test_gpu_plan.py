"""helpers.course.gpu_plan: gpu-check's parts predicted before they run."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from helpers.course.gpu_plan import (
    BUILD_S,
    DEFAULTS,
    NOTEBOOK_S,
    SPEED_START_S,
    PlanInputs,
    earlier_report,
    plan_parts,
)

SETTING_S, RECIPE_S, TINY_LESSON_S, STEP_S = DEFAULTS["full"].values()


def test_without_an_earlier_report_the_defaults_are_used_and_slots_share_the_work():
    inputs = PlanInputs(speed=["vanilla"], speed_steps=8, settings=["x", "y", "vanilla"],
                        alone=["y"], slots=2, recipes=["base", "lora"], tiny=["00", "09"],
                        tiny_at_once=2)  # fmt: skip
    plan = plan_parts(inputs, left_s=600)
    d = SPEED_START_S + BUILD_S + 8 * STEP_S  # vanilla timed first, in one process
    # Then b (x and vanilla two at once), e and c side by side from d's end; y alone after.
    got = {p.part: (p.start, p.seconds) for p in plan.parts}
    expected = {"d": (0, d), "b": (d, SETTING_S), "e": (d, 2 * RECIPE_S),
                "c tiny": (d, TINY_LESSON_S), "alone": (d + TINY_LESSON_S, SETTING_S)}  # fmt: skip
    assert got == {part: pytest.approx(v) for part, v in expected.items()}
    assert plan.total() == pytest.approx(d + TINY_LESSON_S + SETTING_S)
    assert plan.will_not_fit() == [] and plan.summary()[-1].startswith("all fit")
    assert "defaults: no earlier report" in plan.summary()[1]


def test_an_earlier_report_of_the_card_sets_each_known_label_and_the_median_for_the_rest():
    earlier = {
        "estimator": [{"label": "x", "seconds": 10.0},  # an older report: seconds only
                      {"label": "vanilla", "seconds": 30.0, "started_s": 5.0, "ended_s": 45.0,
                       "step_times": [0.2, 0.1, 0.3]}],
        "recipes": [{"recipe": "base", "seconds": 5.0}],
        "lessons": [{"lesson": "00", "scale": "tiny", "seconds": 20.0},
                    {"lesson": "05", "scale": "tiny", "seconds": 0.0},  # not started
                    {"lesson": "00", "scale": "full", "seconds": 300.0}],
    }  # fmt: skip
    inputs = PlanInputs(speed=["vanilla", "16-bit"], speed_steps=10,
                        settings=["x", "new", "vanilla"], slots=2, recipes=["base", "lora"],
                        tiny=["00", "09"], tiny_at_once=1, full_minutes={"00": 2.0, "09": 1.0},
                        full_device_minutes={"00": 0.5, "09": 0.5}, full_at_once=2,
                        earlier=earlier)  # fmt: skip
    plan = plan_parts(inputs, left_s=150)
    got = {p.part: (p.start, p.seconds) for p in plan.parts}
    # vanilla's steps 0.2 s (its median), 16-bit's the median of those known, 0.2 s.
    d = SPEED_START_S + 2 * (BUILD_S + 10 * 0.2)
    assert got["d"] == pytest.approx((0, d))
    assert got["b"] == pytest.approx((d, (10 + 25 + 40) / 2))  # "new": the median, 25 s
    assert got["e"] == pytest.approx((d, 5 + 5)) and got["c tiny"] == pytest.approx((d, 40))
    # After the tiny lessons, two at once: the longest lesson (00, 120 s + a kernel's start).
    assert got["c full"] == pytest.approx((d + 40, 120 + NOTEBOOK_S))
    # d (20 s), then b, e and c tiny end within 150 s; the full scale, at 190 s, does not.
    assert plan.will_not_fit() == ["c full"]
    assert plan.summary()[-1].startswith("will not fit: c full (")


@pytest.mark.parametrize(
    ("device_minutes", "at_once", "expected"),
    [
        ({"00": 0.2, "01": 0.2, "02": 0.2}, 3, 60 + NOTEBOOK_S),  # the longest lesson
        ({"00": 0.2, "01": 0.2, "02": 0.2}, 1, 3 * (60 + NOTEBOOK_S)),  # one at a time
        ({"00": 0.9, "01": 0.9, "02": 0.9}, 3, 3 * 0.9 * 60),  # the card's work, not shared
    ],
)
def test_the_full_scale_is_bound_by_the_card_the_overlap_or_the_longest_lesson(
    device_minutes, at_once, expected
):
    inputs = PlanInputs(full_minutes=dict.fromkeys(device_minutes, 1.0),
                        full_device_minutes=device_minutes, full_at_once=at_once)  # fmt: skip
    (full,) = [p for p in plan_parts(inputs, left_s=600).parts if p.part == "c full"]
    assert full.seconds == pytest.approx(expected)
    assert f"3 lessons {at_once} at once" in full.basis
    # Part b's settings run beside the lessons: their card work adds to the lessons'.
    beside = replace(inputs, settings_device_s=600.0)
    (full,) = [p for p in plan_parts(beside, left_s=600).parts if p.part == "c full"]
    assert full.seconds == pytest.approx(max(expected, 600 + 60 * sum(device_minutes.values())))


def test_the_latest_report_of_the_same_card_is_the_one_read(tmp_path):
    for name, card, label in (("2026-01-01-h200", "H200", "old"), ("2026-02-01-h200", "H200",
                              "new"), ("2026-03-01-l4", "L4", "other")):  # fmt: skip
        data = {"card": card, "estimator": [{"label": label, "seconds": 1.0}]}
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    (tmp_path / "broken.json").write_text("{")
    assert earlier_report(tmp_path, "H200")["estimator"][0]["label"] == "new"
    assert earlier_report(tmp_path, "T4") == {}


def test_the_offline_plan_reads_a_committed_report_of_the_h200():
    """tools/gpu_plan_offline.py: the plan gpu-check would make on the report's card (a fake
    H200 here), from the report's throughput and seconds."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tools"))
    from gpu_plan_offline import plan_from_report

    report = json.loads((root / "reports/gpu/2026-11-28-nvidia-h200.json").read_text())
    lines = plan_from_report(report, deadline_min=9.0, part_a_min=1.5)
    parts = {line.split(":")[0]: line for line in lines}
    assert lines[0] == "a: 1.5 min" and lines[-1].startswith("total with part a: ")
    assert "2 at once" in parts["b"] and "an earlier report of this card" in parts["b"]
    assert parts["c tiny"].startswith("c tiny: about 0.0 min from minute")  # the H200 holds all
    assert "18 lessons 4 at once" in parts["c full"] and parts["d"].startswith("d: about")
