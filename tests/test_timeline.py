"""The step's memory timeline (helpers.timeline, lesson 15): the tracker read at every change."""

from __future__ import annotations

from dataclasses import replace

import pytest

from helpers.estimator import estimate
from helpers.memory import innermost
from helpers.plots import memory_timeline, memory_timelines
from helpers.timeline import (
    align,
    measure_timeline,
    predicted_timeline,
    timeline_overhead,
    tracked_timeline,
)
from helpers.train import RunConfig, Trainee, measure
from tests.plot_checks import figure_problems

SETTINGS = {
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "checkpointing": {"gradient_checkpointing": True},
    "accumulation": {"grad_accum": 2, "batch_size": 2},
}
MODELS = ("bert-tiny", "llama-tiny")


def config(model: str, setting: str) -> RunConfig:
    base = RunConfig(model=model, batch_size=4, seq_len=32, repeats=1, flops=False)
    return replace(base, **SETTINGS[setting])


@pytest.fixture(scope="module")
def timelines():
    return {(m, s): measure_timeline(config(m, s), isolate=False) for m in MODELS for s in SETTINGS}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("model", MODELS)
def test_timeline_maxima_are_the_trackers_peaks(timelines, model, setting):
    # The same running totals as measure's tracker, read after every change: each category's
    # maximum along the timeline and the largest total are its peaks, to the byte.
    t = timelines[model, setting]
    rec = measure(config(model, setting))
    for category, value in t.category_maxima().items():
        assert value == rec.memory[category] == t.maxima[category], category
    assert max(t.total) == t.peak == rec.memory["peak"]
    assert t.total[t.peak_index] == t.peak


@pytest.mark.parametrize("setting", ["fp32", "checkpointing"])
def test_recording_does_not_change_the_peaks(setting):
    trainee = Trainee(config("llama-tiny", setting))
    trainee.step()  # the optimizer state
    on = tracked_timeline(trainee, timeline=True)
    off = tracked_timeline(trainee, timeline=False)
    assert on.peak == off.peak and on.peak > 0


def test_the_tensors_alive_at_the_peak_add_up_to_it(timelines):
    # Replaying the events to the peak gives the live storages; all of them together are the
    # peak, so the "largest tensors at the peak" table lists real tensors of that moment.
    cfg = config("llama-tiny", "fp32")
    t = measure_timeline(cfg, top=10**6, isolate=False)
    assert sum(x.nbytes for x in t.at_peak) == t.peak
    sizes = [x.nbytes for x in t.at_peak]
    assert sizes == sorted(sizes, reverse=True)
    named = {x.created for x in t.at_peak if x.category == "params"}
    assert "model.embed_tokens.weight" in named  # parameters are listed by their names
    states = [x.created for x in t.at_peak if x.category == "optimizer_state"]
    assert any(s.startswith("exp_avg of ") for s in states), states[:3]


def test_phases_and_micro_batches(timelines):
    t = timelines["llama-tiny", "accumulation"]
    order = [(p, m) for p, m, *_ in t.spans() if p != "outside"]
    assert order == [("forward", 1), ("backward", 1), ("forward", 2), ("backward", 2),
                     ("optimizer step", 2)]  # fmt: skip
    grads_fwd2 = [g for g, p, m in zip(t.alive["gradients"], t.phase, t.micro, strict=True)
                  if p == "forward" and m == 2]  # fmt: skip
    # Every gradient is held through it: as many bytes as the optimizer step finds. (The
    # maximum is higher: in backward 2 a new gradient exists beside the one it adds into.)
    complete = next(g for g, p in zip(t.alive["gradients"], t.phase, strict=True)
                    if p == "optimizer step")  # fmt: skip
    assert min(grads_fwd2) == max(grads_fwd2) == complete > 0


@pytest.mark.parametrize("setting", ["fp32", "bf16", "checkpointing"])
@pytest.mark.parametrize("model", MODELS)
def test_the_predicted_timeline_is_the_estimate(timelines, model, setting):
    cfg = config(model, setting)
    p = predicted_timeline(cfg)
    est = estimate(cfg.model, cfg.batch_size, cfg.seq_len, cfg.precision, cfg.optimizer,
                   cfg.gradient_checkpointing, device="cpu")  # fmt: skip
    assert max(p.total) == p.peak == est.peak
    # Activations: the estimate's maximum, except that with checkpointing it also counts a
    # recomputed layer's transients at the end of its recomputation, which is not a moment.
    acts = max(p.alive["activations"])
    assert acts <= est.activations and (acts == est.activations or cfg.gradient_checkpointing)
    assert p.phase[p.peak_index] == est.peak_at.split(":")[0]
    # Drawn over the measurement: every moment inside it, in the order the step runs.
    xs = align(p, timelines[model, setting])
    assert all(0 <= x < len(timelines[model, setting].phase) for x in xs)
    assert xs == sorted(xs)


def test_moments_need_a_stage_model():
    with pytest.raises(ValueError, match="no analytical model"):
        estimate("gpt2-tiny", 2, 16, moments=[])
    with pytest.raises(ValueError, match=r"moments, .* come from the analytical"):
        estimate("llama-tiny", 2, 16, path="traced", moments=[])


def test_the_budget_stops_the_timeline_at_the_failing_allocation(timelines):
    plain = timelines["llama-tiny", "fp32"]
    budget = int(0.9 * plain.peak)
    failed = measure_timeline(replace(config("llama-tiny", "fp32"), budget=budget), isolate=False)
    assert "memory budget exceeded" in failed.error
    assert failed.total[-1] > budget >= max(failed.total[:-1])
    assert len(failed.phase) < len(plain.phase)


def test_innermost_skips_the_stale_submodules_of_a_finished_layer():
    # ModTracker can leave layer 1's self_attn among the parents while layer 0 runs backward.
    parents = {"Global", "M", "M.model.layers.1.self_attn", "M.model.layers.0",
               "M.model.layers.0.mlp"}  # fmt: skip
    assert innermost(parents) == "M.model.layers.0.mlp"
    assert innermost({"Global", "M", "M.model.layers.1.self_attn"}) == "M"
    assert innermost({"Global"}) == "Global"


def test_overhead_rounds_alternate():
    result = timeline_overhead(config("llama-tiny", "fp32"), rounds=2)
    assert len(result.with_timeline) == len(result.without) == 2
    assert all(r > 0 for r in result.ratios)


def test_timeline_figures_are_readable(timelines):
    accum = config("llama-tiny", "accumulation")
    one = memory_timeline(timelines["llama-tiny", "accumulation"], predicted_timeline(accum))
    grid = memory_timelines(
        {f"{m} {s}": (timelines[m, s], predicted_timeline(config(m, s))) for m in MODELS
         for s in ("fp32", "checkpointing")}, ncols=2)  # fmt: skip
    for fig in (one, grid):
        assert figure_problems(fig) == []
