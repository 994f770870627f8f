"""The planner: pruning by the estimator, a measured winner that fits, clear errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from helpers.course.cli import main
from helpers.planner import candidates, card_precisions, parse_bytes, plan, shortlist

MiB, GiB = 2**20, 2**30
# bert-tiny at sequence length 64: 2.4 MB of fp32 weights, 14.8 MB peak at batch 4 with AdamW.
# A 12 MiB budget leaves some configurations in and pushes others out.
MODEL, SEQ, BATCH, BUDGET = "bert-tiny", 64, 8, 12 * MiB


@pytest.mark.parametrize(
    "text, expected",
    [
        ("16GB", 16 * 10**9),  # as a card's box quotes it
        ("16 GiB", 16 * GiB),
        ("512MiB", 512 * MiB),
        ("1e9", 10**9),
        ("64mb", 64 * 10**6),
        ("1.5G", int(1.5 * GiB)),
        ("4096", 4096),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_says_how_it_read_a_size():
    from helpers.planner import bytes_read_as

    assert bytes_read_as("16GB").startswith("16GB = 16,000,000,000 bytes (14.9 GiB)")
    assert "write 16GiB for 2^30" in bytes_read_as("16GB")
    assert bytes_read_as("16GiB") == "16GiB = 17,179,869,184 bytes (16 GiB)"


@pytest.mark.parametrize("text", ["", "abc", "16XB", "-5GB", "0", "GB16"])
def test_parse_bytes_refuses_nonsense(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


@pytest.fixture(scope="module")
def cands():
    return candidates(MODEL, BUDGET, BATCH, SEQ, device="cpu")


def test_candidates_cover_the_space_and_prune_by_the_estimate(cands):
    assert all(c.micro_batch * c.grad_accum == BATCH for c in cands)
    assert all(c.fits == (c.estimated_peak <= BUDGET) for c in cands)
    assert {c.micro_batch for c in cands} == {1, 2, 4, 8}
    assert {c.gradient_checkpointing for c in cands} == {False, True}
    # on the CPU offload moves nothing, so it is not searched; selective checkpointing is
    assert {c.activations for c in cands} == {"none", "full", "selective"}
    assert {c.attn for c in cands} == {"eager", "sdpa"}
    fitting = [c for c in cands if c.fits]
    assert 0 < len(fitting) < len(cands)  # the budget matters here: some in, some out
    assert cands[: len(fitting)] == fitting  # fitting first, cheapest predicted first
    costs = [c.cost for c in fitting]
    assert costs == sorted(costs)
    # The whole batch at once in fp32 with AdamW does not fit; accumulation gets it in.
    vanilla = next(
        c
        for c in cands
        if c.micro_batch == BATCH
        and c.precision == "fp32"
        and c.optimizer == "adamw"
        and not c.gradient_checkpointing
    )
    assert not vanilla.fits
    assert any(c.fits and c.optimizer == "adamw" and c.precision == "fp32" for c in cands)


def test_shortlist_is_varied_and_fits(cands):
    picked = shortlist(cands, 4)
    assert len(picked) == 4 and all(c.fits for c in picked)
    kinds = {(c.precision, c.optimizer, c.attn, c.activations) for c in picked}
    assert len(kinds) == 4


def test_plan_measures_and_the_winner_fits():
    result = plan(
        MODEL,
        BUDGET,
        BATCH,
        SEQ,
        device="cpu",
        top_k=2,
        rounds=5,
        isolate=False,
        precisions=["fp32"],
        optimizers=["adamw", "sgd"],
    )
    assert result.best is not None and result.best.ok
    best = result.best.candidate
    assert best.fits and best.micro_batch * best.grad_accum == BATCH
    # Measured with the budget enforced by the tracker: it would have raised past it.
    assert result.best.measured_peak <= BUDGET
    # The estimator's 10 % target, on the configuration the plan picked.
    assert abs(best.estimated_peak - result.best.measured_peak) < 0.10 * result.best.measured_peak
    assert result.runner_up is not None
    assert result.best.samples_per_s >= result.runner_up.samples_per_s
    # Their speeds come from the same interleaved rounds.
    assert result.timing.rounds == 5 and best.label in result.timing.times
    assert best.label in result.reason and result.runner_up.candidate.label in result.reason


def test_plan_measures_and_times_the_lora_setting_it_searched(monkeypatch):
    # The candidates carry the search's settings, not its LoRA: plan hands that to the runs.
    from helpers import planner

    seen = []

    def measured(cand, model, seq_len, budget=None, device=None, isolate=True, **lora):
        seen.append(cand.run_config(model, seq_len, **lora))
        return planner.CandidateResult(cand, error="not run")

    monkeypatch.setattr(planner, "measure_candidate", measured)
    plan(MODEL, 64 * MiB, BATCH, SEQ, device="cpu", top_k=1, precisions=["fp32"],
         optimizers=["adamw"], attentions=["sdpa"], checkpointing=["none"], lora_r=4,
         lora_targets="query,value", dora=True)  # fmt: skip
    assert [(c.lora_r, c.lora_targets, c.dora) for c in seen] == [(4, "query,value", True)]


def test_plan_refuses_a_budget_below_the_weights():
    with pytest.raises(ValueError, match="below the weights alone"):
        plan(MODEL, 1 * MiB, BATCH, SEQ, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_plan_refuses_a_device_that_is_not_here():
    # The plan times its candidates: it needs the device (the estimate alone does not).
    with pytest.raises(ValueError, match="not on this machine"):
        plan(MODEL, BUDGET, BATCH, SEQ, device="cuda")
    space = dict(precisions=["bf16"], optimizers=["adamw"], attentions=["sdpa"],
                 checkpointing=["none", "full"], weights=[("fp32", "nearest")])  # fmt: skip
    # estimating is fine (the stage model's settings: arithmetic only)
    assert candidates(MODEL, BUDGET, BATCH, SEQ, device="cuda", **space)


@pytest.mark.parametrize(
    "args",
    [
        ["--budget", "lots"],  # unreadable budget
        ["--budget", "1MiB"],  # below bert-tiny's 2.4 MB of weights
        ["--effective-batch", "0"],
        ["--model", "/nonexistent/config.json"],
        ["--frobnicate", "3"],  # unknown option
    ],
)
def test_cli_plan_bad_input_is_one_line_and_exit_2(args, cli_refuses):
    base = {"--model": MODEL, "--budget": "12MiB", "--effective-batch": "8", "--seq-len": "64"}
    extra = []
    for flag, value in zip(args[::2], args[1::2], strict=True):
        if flag in base:
            base[flag] = value
        else:
            extra += [flag, value]
    argv = ["plan", "--device", "cpu"] + [x for kv in base.items() for x in kv] + extra
    cli_refuses(argv)


def test_cli_plan_json(capsys):
    # The real command: candidates timed in fresh processes, one line of JSON at the end.
    argv = f"plan --model {MODEL} --budget 12MiB --effective-batch 4 --seq-len 32".split()
    argv += "--device cpu --top-k 1 --rounds 5 --json".split()
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["best"] and data["best_estimated_peak"] <= 12 * MiB
    assert data["best_measured_peak"] <= 12 * MiB and data["measured"] == 1


def _fake_plan(cands, k=3):
    """A plan of ``cands`` with made-up measurements: the first of the shortlist fails (out of
    memory), the others run, the last one timed fastest."""
    from helpers.planner import CandidateResult, Plan

    picked = shortlist(cands, k)
    failed = CandidateResult(picked[0], error="OutOfMemoryError: budget\nmore")
    ok = [
        CandidateResult(c, samples_per_s=10.0 + i, measured_peak=c.estimated_peak)
        for i, c in enumerate(picked[1:])
    ][::-1]  # fastest first, failed runs last, as plan() sorts them
    fitting = [c for c in cands if c.fits]
    return Plan(MODEL, BUDGET, BATCH, SEQ, "cpu", 0, len(cands), fitting, [*ok, failed],
                ok[0], ok[1], "")  # fmt: skip


def test_search_outcomes_account_for_every_candidate(cands):
    from helpers.planner import OUTCOMES, search_outcomes

    result = _fake_plan(cands)
    outcomes = search_outcomes(result, cands)
    assert [o.candidate for o in outcomes] == cands  # each once, in the search's order
    counts = {name: sum(o.outcome == name for o in outcomes) for name in OUTCOMES}
    fitting = sum(c.fits for c in cands)
    assert counts == {
        "does not fit": len(cands) - fitting,
        "fits, not timed": fitting - 3,
        "failed": 1,
        "timed": 1,
        "winner": 1,
    }
    by = {o.candidate: o for o in outcomes}
    assert by[result.best.candidate].outcome == "winner"
    assert by[result.best.candidate].samples_per_s == result.best.samples_per_s
    assert by[result.measured[-1].candidate].why == "OutOfMemoryError: budget"  # first line
    for o in outcomes:  # the number that decided it is in the reason
        if o.outcome == "does not fit":
            assert f"{o.candidate.estimated_peak / MiB:.3g} MiB" in o.why
        if o.outcome == "fits, not timed":
            assert o.why.startswith("cost rank ")


def test_search_outcomes_refuse_another_search(cands):
    from helpers.planner import search_outcomes

    other = candidates(MODEL, BUDGET, BATCH // 2, SEQ, device="cpu")
    with pytest.raises(ValueError, match="not the search"):
        search_outcomes(_fake_plan(cands), other)


def test_search_outcomes_change_no_estimate_cost_or_choice(cands):
    # The report only reads: the plan and the candidates are the same objects, unchanged.
    from helpers.planner import search_outcomes

    result = _fake_plan(cands)
    before = (list(cands), [(c.estimated_peak, c.cost, c.fits) for c in cands], result.best)
    search_outcomes(result, cands)
    assert (list(cands), [(c.estimated_peak, c.cost, c.fits) for c in cands], result.best) == before
    assert candidates(MODEL, BUDGET, BATCH, SEQ, device="cpu") == cands


def test_cli_plan_for_a_card_on_paper(capsys):
    """plan --card: no such card here, nothing runs; a T4 has no bf16, so LoRA's frozen base
    is fp16 (and the answer says so), its peak within the card's usable memory."""
    argv = ("plan --model llama-tiny --card t4 --effective-batch 1 --seq-len 64 --lora-r 4 "
            "--precision fp16 --optimizer adamw --json").split()  # fmt: skip
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["card"] == "Tesla T4" and data["method"] == "lora"
    assert "fp16 weights" in data["best"] and data["attentions"] == ["sdpa"]
    assert data["best_estimated_peak"] <= data["usable"] < data["budget"]


def test_cli_plan_for_a_card_of_a_size_says_how_it_read_it(capsys):
    argv = ("plan --model llama-tiny --card 16GB --effective-batch 2 --seq-len 64 "
            "--precision bf16 --optimizer adamw").split()  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "16GB = 16,000,000,000 bytes (14.9 GiB); GB is 10^9 bytes, write 16GiB" in out
    assert "bf16 weights+kahan" in out  # full fine-tuning in bf16, with Kahan's AdamW
    assert "optimizer_state" in out and "attention assumed: sdpa" in out


@pytest.mark.parametrize(
    "extra",
    [
        ["--card", "l4", "--budget", "16GB"],  # both
        ["--effective-batch", "2"],  # neither (no --card, no --budget)
        ["--card", "k80"],  # not a card it knows, nor a size
        ["--card", "l4", "--seq-len"],  # on paper the length must be given (dropped here)
        ["--card", "l4", "--qlora"],  # QLoRA without a LoRA rank
        ["--card", "l4", "--weight-dtype", "fp16"],  # fp16 weights trained, not frozen
        ["--card", "l4", "--precision", "fp8"],
        ["--card", "l4", "--attn", "flash"],
    ],
)
def test_cli_plan_for_a_card_refuses_in_one_line(extra, cli_refuses):
    base = {"--model": "llama-tiny", "--effective-batch": "2", "--seq-len": "64"}
    if extra[-1] == "--seq-len":
        base.pop(extra.pop())
    for flag in [f for f in extra if f in base]:  # given again: the case's value wins
        base.pop(flag)
    cli_refuses(["plan", *[x for kv in base.items() for x in kv], *extra])


def test_cli_help_explains_every_category_it_prints(capsys):
    from helpers.course.cli import ESTIMATE_FIELDS

    for command in ("estimate", "plan"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert all(f"  {field}" in text for field in ESTIMATE_FIELDS), command
        assert "16GB = 16 x 10^9 bytes" in text


def test_the_search_holds_every_activation_setting_each_estimated_as_its_run():
    """Selective checkpointing and offload are candidates with their own estimates: each
    candidate's peak is ``estimate_run`` of the RunConfig it would train (on a card: CUDA)."""
    from helpers.estimator import estimate_run

    space = dict(precisions=["bf16"], optimizers=["adamw"], attentions=["sdpa"],
                 weights=[("fp32", "nearest")])  # fmt: skip
    cands = candidates("llama-tiny", 64 * MiB, 2, 64, device="cuda", **space)
    assert {c.activations for c in cands} == {"none", "full", "selective", "offload"}
    for c in cands:
        cfg = c.run_config("llama-tiny", 64, device="cuda")
        assert estimate_run(cfg).peak == c.estimated_peak, c.label
    offload = next(c for c in cands if c.activations == "offload" and c.micro_batch == 2)
    none = next(c for c in cands if c.activations == "none" and c.micro_batch == 2)
    assert offload.estimate.activations < none.estimate.activations
    assert "offloaded activations" in offload.label


def test_cli_plan_takes_the_activation_settings(capsys):
    code = main(["plan", "--model", "llama-tiny", "--card", "t4", "--effective-batch", "2",
                 "--seq-len", "64", "--precision", "fp16", "--optimizer", "adamw",
                 "--activations", "selective,offload", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and out["best"].endswith(("selective checkpointing",
                                                        "offloaded activations"))  # fmt: skip
    code = main(["plan", "--model", "llama-tiny", "--card", "t4", "--effective-batch", "2",
                 "--seq-len", "64", "--activations", "some"])  # fmt: skip
    assert code == 2 and "unknown activation setting 'some'" in capsys.readouterr().err


# On a card: 512 MiB of CUDA context assumed, then a 10 % margin: about 12.7 MiB usable.
@pytest.mark.parametrize("device, budget", [("cuda", 526 * MiB)])  # every activation setting
def test_leaving_out_smaller_micro_batches_of_a_fitting_setting_changes_no_answer(device, budget):
    """The search stops descending a setting's micro-batches at the first that fits: the same
    cheapest candidates, in the same order, as estimating every one, with fewer estimates."""
    space = {"optimizers": ["adamw"], "attentions": ["sdpa"]}
    every = candidates(MODEL, budget, BATCH, SEQ, device=device, exhaustive=True, **space)
    pruned = candidates(MODEL, budget, BATCH, SEQ, device=device, **space)
    assert len(pruned) < len(every)
    assert {c.label for c in pruned} <= {c.label for c in every}
    fitting = [c for c in every if c.fits]
    best_per_kind = {}
    for c in fitting:  # cheapest first: the first of each setting is its answer
        best_per_kind.setdefault(c.label.split(", ", 1)[1], c)
    kept = [c for c in pruned if c.fits]
    assert 0 < len(kept) and [c.label for c in kept] == [c.label for c in best_per_kind.values()]
    assert any(not c.fits for c in pruned)
    assert all(c.micro_batch * c.grad_accum == BATCH for c in pruned)


def test_plan_for_a_card_stops_at_the_first_fit_with_the_exhaustive_answer():
    """plan_for_card estimates cheapest predicted first and stops at the first cost that
    fits: the exhaustive search's cheapest fitting candidate, with fewer estimates, every
    cheaper candidate estimated, and the answer's plain alternatives for its explanation."""
    from helpers.hardware import REFERENCE_CARDS
    from helpers.planner import _plain_changes, _variant, plan_for_card

    card = replace(REFERENCE_CARDS["t4"], total_memory=526 * MiB)  # about 12.7 MiB usable
    space = {"optimizers": ("adamw", "adafactor"), "attentions": ("sdpa",),
             "precisions": card_precisions(card), "report": lambda done, total: None}  # fmt: skip
    every = candidates("llama-tiny", card.total_memory, 8, 64, "cuda", exhaustive=True, **space)
    first = candidates("llama-tiny", card.total_memory, 8, 64, "cuda", first_fit=True, **space)
    best = every[0]
    assert best.fits and first[0] == best and len(first) < len(every)
    cheaper = {c.label for c in every if c.cost < best.cost}
    assert cheaper <= {c.label for c in first if not c.fits}  # estimated, and none fits
    compared = 0
    for chosen, _, change in _plain_changes(best):
        other = _variant(every, best, **change) if chosen else None
        if other is not None:
            assert _variant(first, best, **change) == other
            compared += 1
    assert compared  # the tight card needs savings: there is something to compare
    space.pop("precisions")
    answer = plan_for_card("llama-tiny", card, 8, 64, "full", **space)
    assert answer.best == best and answer.considered == len(first)
    assert answer.searched == len(every) and f"of the {len(every)} configurations" in answer.reason


def test_a_card_plan_leaves_out_settings_whose_lighter_twin_it_estimated():
    """An fp32 frozen base holds more than the same LoRA setting's 16-bit base at the same
    predicted cost, eager attention more than SDPA at a higher one: the first-fit search
    leaves the heavier twin out (one trace set less each) and finds the exhaustive answer,
    with the fp32 base estimated once, as the plain alternative its explanation compares; or
    not even once, where the twin's peak plus the fp32 weights' extra bytes is over the card."""
    from helpers.estimator import describe_model
    from helpers.hardware import REFERENCE_CARDS
    from helpers.planner import _lighter_twins, _more_weight_bytes, _setting, _variant

    card = replace(REFERENCE_CARDS["l4"], total_memory=520 * MiB)  # mb4 (of 4) does not fit
    space = {"optimizers": ("adamw",), "lora_r": 4, "lora_targets": "all-linear",
             "precisions": ("bf16",), "checkpointing": ("none",),
             "report": lambda done, total: None}  # fmt: skip
    every = candidates("llama-tiny", card.total_memory, 4, 64, "cuda", exhaustive=True, **space)
    first = candidates("llama-tiny", card.total_memory, 4, 64, "cuda", first_fit=True, **space)
    best = every[0]
    assert best.fits and first[0] == best and best.micro_batch == 2
    assert (best.weight_dtype, best.attn) == ("bf16", "sdpa")
    by_setting = {_setting(c): c for c in every}
    pairs = [(c, by_setting[t]) for c in every for t in _lighter_twins(_setting(c), 64)]
    assert len(pairs) == 12 and all(t.estimated_peak < c.estimated_peak for c, t in pairs)
    assert all(c.attn == "sdpa" for c in first)
    base32 = [c for c in first if c.weight_dtype == "fp32"]
    assert base32 == [_variant(every, best, weight_dtype="fp32")] and len(first) == 3
    # A lighter twin's peak plus the bytes the fp32 base takes more bounds the fp32 peak:
    infos = {
        wd: describe_model("llama-tiny", "sdpa", 4, "all-linear", wd) for wd in ("fp32", "bf16")
    }
    more = _more_weight_bytes(infos["fp32"], infos["bf16"], "cuda")
    weight_pairs = [(c, t) for c, t in pairs if c.attn == t.attn]
    assert len(weight_pairs) == 6 and more > 0
    assert all(t.estimated_peak + more <= c.estimated_peak for c, t in weight_pairs)
    # so where that bound is over the card, the answer's fp32 alternative is not traced.
    card = replace(card, total_memory=518 * MiB)  # mb2 of a 16-bit base fits, of fp32 not
    floor = candidates("llama-tiny", card.total_memory, 4, 64, "cuda", first_fit=True, **space)
    alternative = _variant(floor, best, weight_dtype="fp32")
    assert floor[0] == best and alternative.peak_is_floor and not alternative.fits
    assert alternative.estimated_peak == best.estimated_peak + more
    assert alternative.estimated_peak < _variant(every, best, weight_dtype="fp32").estimated_peak


def test_a_card_plan_compares_the_alternatives_of_the_answer_it_gives():
    """The first-fit search estimates the plain alternatives of the answer ``candidates``
    ranks first (AdamW, the optimizer asked for first), not of the lightest candidate at the
    same cost (Adafactor's): its explanation compares the answer's own fp32 weights."""
    from helpers.hardware import REFERENCE_CARDS
    from helpers.planner import plan_for_card

    card = replace(REFERENCE_CARDS["l4"], total_memory=520 * MiB)
    space = {"optimizers": ("adamw", "adafactor"), "attentions": ("sdpa",),
             "checkpointing": ("none",), "report": lambda done, total: None}  # fmt: skip
    answer = plan_for_card("llama-tiny", card, 4, 64, "lora", 4, "all-linear", **space)
    best = answer.best
    assert best.optimizer == "adamw" and best.weight_dtype == "bf16"
    lighter = [c for c in answer.fitting if c.cost == best.cost and c.optimizer == "adafactor"]
    assert lighter and lighter[0].estimated_peak < best.estimated_peak
    assert "fp32 weights (" in answer.reason and "not compared: fp32 weights" not in answer.reason


def test_plan_for_a_card_traces_nothing_when_no_model_state_fits(monkeypatch):
    """Where weights, gradients and optimizer state alone exceed the card, no step is
    estimated: the answer says so, with the smallest model state, a lower bound."""
    from helpers import planner
    from helpers.hardware import REFERENCE_CARDS

    def traced(*args, **kwargs):
        raise AssertionError("estimated a setting whose model state cannot fit")

    monkeypatch.setattr(planner, "estimate", traced)
    card = REFERENCE_CARDS["l4"]
    answer = planner.plan_for_card("llama-3.1-8b", card, 8, 2048, "full",
                                   report=lambda done, total: None)  # fmt: skip
    assert answer.best is None and answer.smallest_is_floor
    # Every setting is priced by its model state, except eager attention's (SDPA's twins).
    assert answer.considered == answer.searched // 2 and answer.smallest_peak > answer.usable
    assert "no setup's model state fits" in answer.reason


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize(
    "setting",
    [
        {"optimizer": "adamw"},
        {"optimizer": "adafactor", "precision": "bf16"},
        {"optimizer": "adamw8bit", "gradient_checkpointing": True},
        {"optimizer": "adamw", "precision": "bf16", "weight_dtype": "bf16", "bf16_update": "kahan"},
        {"optimizer": "adamw", "precision": "bf16", "lora_r": 4, "lora_targets": "all-linear",
         "weight_dtype": "bf16"},
    ],
)  # fmt: skip
def test_model_state_floor_is_below_every_peak(setting, device):
    """The planner's shortcut is a lower bound: a step holds at least its model state."""
    from helpers.estimator import describe_model, estimate, model_state_floor

    lora = {k: setting[k] for k in ("lora_r", "lora_targets") if k in setting}
    wd = setting.get("weight_dtype", "fp32")
    info = describe_model("llama-tiny", "sdpa", weight_dtype=wd, **lora)
    est = estimate(info, 2, 32, attn="sdpa", device=device,
                   **{k: v for k, v in setting.items() if k not in lora})  # fmt: skip
    floor = model_state_floor(info, setting["optimizer"], device,
                              setting.get("bf16_update", "nearest"))  # fmt: skip
    assert floor == est.params + est.buffers + est.gradients + est.optimizer_state
    assert floor <= est.peak
