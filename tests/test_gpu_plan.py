"""helpers.course.gpu_plan: gpu-check's parts predicted before they run."""

from __future__ import annotations

import json

import pytest

from helpers.course.gpu_plan import DEFAULTS, PlanInputs, earlier_report, plan_parts

SETTING_S, RECIPE_S, TINY_LESSON_S = DEFAULTS["full"].values()


def test_without_an_earlier_report_the_defaults_are_used_and_slots_share_the_work():
    inputs = PlanInputs(settings=["x", "y", "z", "vanilla"], alone=["vanilla"], slots=3,
                        recipes=["base", "lora"], tiny=["00", "09"], tiny_at_once=2)  # fmt: skip
    plan = plan_parts(inputs, left_s=600)
    seconds = {p.part: p.seconds for p in plan.parts}
    assert seconds == pytest.approx({"b": SETTING_S + SETTING_S, "e": 2 * RECIPE_S,
                                     "c tiny": TINY_LESSON_S})  # fmt: skip
    assert plan.will_not_fit() == [] and plan.summary()[-1].startswith("all fit")
    assert "defaults: no earlier report" in plan.summary()[0]


def test_an_earlier_report_of_the_card_sets_each_known_label_and_the_median_for_the_rest():
    earlier = {
        "estimator": [{"label": "x", "seconds": 10.0},  # an older report: seconds only
                      {"label": "vanilla", "seconds": 30.0, "started_s": 5.0, "ended_s": 45.0}],
        "recipes": [{"recipe": "base", "seconds": 5.0}],
        "lessons": [{"lesson": "00", "scale": "tiny", "seconds": 20.0},
                    {"lesson": "05", "scale": "tiny", "seconds": 0.0},  # not started
                    {"lesson": "00", "scale": "full", "seconds": 300.0}],
    }  # fmt: skip
    inputs = PlanInputs(settings=["x", "new", "vanilla"], alone=["vanilla"], slots=2,
                        recipes=["base", "lora"], tiny=["00", "09"], tiny_at_once=1,
                        full_minutes={"00": 2.0, "09": 1.0}, full_at_once=2,
                        earlier=earlier)  # fmt: skip
    plan = plan_parts(inputs, left_s=200)
    seconds = {p.part: p.seconds for p in plan.parts}
    assert seconds["b"] == pytest.approx((10 + 25) / 2 + 40)  # "new": the median, 25 s
    assert seconds["e"] == pytest.approx(5 + 5) and seconds["c tiny"] == pytest.approx(40)
    assert seconds["c full"] == pytest.approx((60 * 3.5 + 60 * 2.0) / 2)
    # 57.5 + 10 + 40 = 107.5 s fit in 200; the full scale's 165 s more do not.
    assert plan.will_not_fit() == ["c full"]
    assert plan.summary()[-1].startswith("will not fit: c full (")


def test_the_latest_report_of_the_same_card_is_the_one_read(tmp_path):
    for name, card, label in (("2026-01-01-h200", "H200", "old"), ("2026-02-01-h200", "H200",
                              "new"), ("2026-03-01-l4", "L4", "other")):  # fmt: skip
        data = {"card": card, "estimator": [{"label": label, "seconds": 1.0}]}
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    (tmp_path / "broken.json").write_text("{")
    assert earlier_report(tmp_path, "H200")["estimator"][0]["label"] == "new"
    assert earlier_report(tmp_path, "T4") == {}
