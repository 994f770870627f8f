"""The capstone's recipes, its table arithmetic and the CLI that prints it after `make course`."""

from dataclasses import replace

import pytest
import torch
from matplotlib.figure import Figure

from helpers import results
from helpers.course import cli
from helpers.lessons.putting_it_together import (
    PURE_BF16,
    SEED_RECIPES,
    ablation_table,
    half_precision,
    latest_records,
    pure_bf16_problem,
    recipe_config,
    tradeoff_figure,
)
from helpers.results import Record
from helpers.train import RunConfig


def test_recipes_keep_the_effective_batch_and_change_one_thing_each():
    base = RunConfig(model="bert-tiny", batch_size=4, seq_len=16, precision="fp32")
    for recipe in SEED_RECIPES:
        cfg = recipe_config(recipe, base, "fp16")
        assert cfg.batch_size * cfg.grad_accum == 4, recipe.label
        assert cfg.label == recipe.label
        assert cfg.gradient_checkpointing == recipe.checkpointing
        assert cfg.precision == ("fp16" if recipe.half else "fp32")
        assert cfg.optimizer == recipe.optimizer
        assert (cfg.model, cfg.seq_len) == ("bert-tiny", 16)
    # The guide's own effective batches: 4 x 1 or 1 x 4.
    assert {(r.batch_size, r.grad_accum) for r in SEED_RECIPES} == {(4, 1), (1, 4)}


def test_half_precision_on_cpu_is_a_format_autocast_accepts():
    assert half_precision(torch.device("cpu")) in ("fp16", "bf16")


def _record(label, samples, peak, nvml=None, error=None):
    memory = None if error else {"peak": peak, "optimizer_state": 1}
    return Record(
        {"label": label, "model": "m", "seq_len": 8},
        {"name": "dev"},
        memory=memory,
        nvml_used=nvml,
        samples_per_s=samples,
        error=error,
        error_type="oom" if error else None,
    )


def test_table_divides_each_side_by_its_own_vanilla():
    records = {
        "vanilla": _record("vanilla", 10.0, 100),
        "16-bit": _record("16-bit", 25.0, 80),
        "Adafactor": _record("Adafactor", None, None, error="OutOfMemoryError: x"),
    }
    table = ablation_table(records)
    assert table.loc["vanilla", "speed ratio"] == 1.0
    assert table.loc["16-bit", "speed ratio"] == pytest.approx(2.5)
    assert table.loc["16-bit", "memory ratio"] == pytest.approx(0.8)
    assert table.loc["16-bit", "V100 speed ratio"] == pytest.approx(18.64 / 8.86)
    assert table.loc["16-bit", "V100 memory ratio"] == pytest.approx(13939 / 14949)
    assert table.loc["Adafactor", "status"] == "oom"
    assert table.loc["8-bit AdamW", "status"] == "not run"
    assert table["speed ratio"].isna().sum() == 7  # only measured rows get ratios


def test_nvml_is_preferred_when_measured_as_the_guide_read_nvidia_smi():
    records = {
        "vanilla": _record("vanilla", 10.0, 100, nvml=1000),
        "16-bit": _record("16-bit", 20.0, 10, nvml=900),
    }
    assert ablation_table(records).loc["16-bit", "memory ratio"] == pytest.approx(0.9)


def test_latest_records_keeps_the_newest_run_of_each_recipe_of_lesson_14():
    old, new = _record("vanilla", 1.0, 10), _record("vanilla", 2.0, 10)
    other = _record("vanilla", 3.0, 10)
    old.lesson = new.lesson = "14"
    other.lesson = "02"
    picked = latest_records([old, other, new])
    assert picked == {"vanilla": new}


def test_tradeoff_figure_is_returned_not_shown():
    table = ablation_table({"vanilla": _record("vanilla", 10.0, 100)})
    assert isinstance(tradeoff_figure(table, "t"), Figure)


def test_cli_prints_the_capstone_table(tmp_path, capsys):
    store = tmp_path / "r.jsonl"
    assert cli.main(["capstone", "--results", str(store)]) == 0
    assert "no ablation recorded" in capsys.readouterr().out
    results.save(_record("vanilla", 10.0, 100), lesson="14", path=store)
    results.save(_record("bs1 + accum 4", 8.0, 60), lesson="14", path=store)
    assert cli.main(["capstone", "--results", str(store)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("bs1 + accum 4 "))
    numbers = [float(x) for x in row.removeprefix("bs1 + accum 4").split()[:-1]]
    assert 0.8 in numbers and 0.6 in numbers  # ours: speed 8/10, memory 60/100
    assert 0.87 in numbers and 0.58 in numbers  # the guide's: 7.75/8.86, 8681/14949


def test_speed_ratio_is_the_median_of_the_rounds_when_both_come_from_one_comparison():
    from helpers.lessons.putting_it_together import speed_ratio
    from helpers.results import Record, with_speed
    from helpers.timing import Comparison

    # Per sample: vanilla 1, 1, 4 (a slow spell in round 3); 16-bit 0.5, 0.5, 2 in the same rounds.
    rounds = Comparison({"vanilla": [1.0, 1.0, 4.0], "16-bit": [0.5, 0.5, 2.0]})
    config = {"batch_size": 4, "grad_accum": 1, "seq_len": 8}
    vanilla = with_speed(Record({**config, "label": "vanilla"}), rounds)
    half = with_speed(Record({**config, "label": "16-bit"}), rounds)
    assert vanilla.step_times == [4.0, 4.0, 16.0]  # seconds per step of 4 samples
    assert speed_ratio(half, vanilla) == 2.0  # every round says 2x


# Shaped like the lesson's runs: (samples/s, peak MiB) per recipe, in SEED_RECIPES' order.
# Tiny scale on a CPU: 16-bit several times slower, memory ratios between 0.4 and 1.1.
TINY_RUNS = [(900, 20.0), (520, 15.0), (400, 13.5), (150, 21.0), (90, 11.0), (880, 14.0),
             (85, 8.0), (860, 15.5), (88, 9.0)]  # fmt: skip
# Full scale on a GPU: the guide's own shape (16-bit about 2x faster, the V100 numbers).
FULL_RUNS = [(r.seed_samples_per_s * 3, r.seed_mb - 1000) for r in SEED_RECIPES]


# Two recipes whose points coincide (seen in a run: "GA+GC" and "GA+GC+16b"): names must not.
COINCIDENT = [*TINY_RUNS[:4], TINY_RUNS[2], *TINY_RUNS[5:]]


@pytest.mark.parametrize(
    "runs", [TINY_RUNS, FULL_RUNS, COINCIDENT], ids=["tiny", "full", "coincident"]
)
def test_tradeoff_figure_has_no_overlapping_or_covered_labels(runs):
    from plot_checks import figure_problems

    records = {
        r.label: _record(r.label, speed, int(mib * 2**20))
        for r, (speed, mib) in zip(SEED_RECIPES, runs, strict=True)
    }
    table = ablation_table(records)
    fig = tradeoff_figure(table, "Nine recipes: a long machine name (tiny scale) vs the V100")
    assert figure_problems(fig) == []


def test_search_table_groups_the_planners_search_by_outcome():
    from helpers.lessons.putting_it_together import search_table
    from helpers.planner import Candidate, SearchOutcome

    def cand(micro, peak, fits):
        return Candidate(micro, 8 // micro, False, "fp32", "adamw", "eager", peak, fits, 1.0)

    outcomes = [SearchOutcome(cand(8, 30 * 2**20, False), "does not fit", "too big")] * 5
    outcomes += [SearchOutcome(cand(4, 9 * 2**20, True), "fits, not timed", "rank 4")] * 3
    outcomes += [SearchOutcome(cand(2, 8 * 2**20, True), "timed", "slower", 5.0, 8 * 2**20)] * 2
    outcomes += [SearchOutcome(cand(1, 7 * 2**20, True), "winner", "fastest", 6.0, 7 * 2**20)]
    table = search_table(outcomes, examples=2)
    groups = table.index.get_level_values(0)
    # Every outcome present, in the search's order, with its size; two examples of the big
    # groups, every measured row.
    assert list(dict.fromkeys(groups)) == [
        "does not fit (5 of 11)",
        "fits, not timed (3 of 11)",
        "timed (2 of 11)",
        "winner (1 of 11)",
    ]
    assert list(groups).count("does not fit (5 of 11)") == 2
    assert list(groups).count("timed (2 of 11)") == 2
    assert table.index.get_level_values(1)[0] == "mb8 x ga1, fp32, adamw, eager"
    assert table["estimated peak MiB"].tolist() == [30, 30, 9, 9, 8, 8, 7]
    assert table.loc["winner (1 of 11)", "why"].item() == "fastest"


def test_your_model_plans_in_worker_processes_equal_the_plans_made_here():
    from helpers.lessons.putting_it_together import _plans_on_cards, your_model_plans
    from helpers.planner import plan_for_card
    from tests.cells import cell_function

    # Lesson 14's plan_for_card call, as its cell writes it (with the cell's YOUR_SEQ_LEN and
    # LORA_R); it travels to the workers by value.
    plan_one = cell_function(
        "14_putting_it_together.ipynb", "plan_your_model", plan_for_card=plan_for_card
    )
    seq_len = plan_one.__globals__["YOUR_SEQ_LEN"]  # the knob as the cell sets it
    models, cards, methods = ("llama-tiny", "qwen3-tiny"), ("t4", "l4"), ("full", "lora")
    plans = your_model_plans(plan_one, models, cards, methods, workers=2)
    assert list(plans) == [(m, c, k) for m in models for c in cards for k in methods]
    here = {}
    for model in models:
        for method in methods:
            here.update(_plans_on_cards(plan_one, model, method, cards))
    for key, plan in plans.items():
        assert (plan.best.label, plan.best.estimated_peak, plan.reason) == (
            here[key].best.label, here[key].best.estimated_peak, here[key].reason,
        ), key  # fmt: skip
    # The cell's settings reached the planner.
    assert {(p.method, p.effective_batch, p.seq_len) for p in plans.values()} == {
        (k, 2, seq_len) for k in methods
    }


def test_the_pure_bf16_row_trains_every_tensor_in_bf16_and_has_no_v100_figures():
    base = RunConfig(model="bert-tiny", batch_size=4, seq_len=16, precision="fp32")
    cfg = recipe_config(PURE_BF16, base, "fp16")  # bf16 weights compute in bf16, never fp16
    assert (cfg.precision, cfg.weight_dtype, cfg.bf16_update) == ("bf16", "bf16", "kahan")
    assert (cfg.batch_size, cfg.grad_accum, cfg.gradient_checkpointing) == (4, 1, False)
    assert cfg.problem() is None
    records = {"vanilla": _record("vanilla", 10.0, 100)}
    assert PURE_BF16.label not in ablation_table(records).index  # a row only once it ran
    records[PURE_BF16.label] = _record(PURE_BF16.label, 8.0, 60)
    table = ablation_table(records)
    assert table.loc[PURE_BF16.label, "memory ratio"] == pytest.approx(0.6)
    assert table.loc[PURE_BF16.label, ["V100 MB", "V100 memory ratio"]].isna().all()
    assert isinstance(tradeoff_figure(table, "t"), Figure)
    assert PURE_BF16.label in latest_records([replace(records[PURE_BF16.label], lesson="14")])
    problem = pure_bf16_problem(torch.device("cpu"))
    assert problem is None or problem.startswith("pure bf16 is left out: ")
