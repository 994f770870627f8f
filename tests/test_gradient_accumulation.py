"""Gradient accumulation helpers: batches, tolerances, and measuring accumulated steps."""

from __future__ import annotations

import pytest
import torch

from helpers.lessons import gradient_accumulation as acc
from helpers.models import build_model, load_config
from helpers.train import RunConfig, measure
from tests.plot_checks import figure_problems


def test_padded_batch_and_target_count():
    rows = acc.padded_causal_batch([5, 3, 1], seq_len=6, vocab_size=50, seed=1)
    assert rows["input_ids"].shape == rows["labels"].shape == (3, 6)
    assert rows["attention_mask"].sum(1).tolist() == [5, 3, 1]
    assert (rows["labels"] == -100).sum() == 18 - 9  # every padded position is ignored
    assert acc.target_count(rows["labels"]) == 4 + 2 + 0  # L real tokens give L - 1 targets
    parts = acc.split(rows, 2)
    assert [len(p["input_ids"]) for p in parts] == [2, 1]
    assert torch.equal(parts[1]["labels"], rows["labels"][2:])


def test_tolerance_and_errors():
    ref = torch.tensor([0.5, -2.0, 0.0])
    assert acc.reorder_tolerance(ref, 256) == pytest.approx(256 * 2**-23 * 2.0)
    assert acc.max_error(ref + torch.tensor([0.0, 0.2, 0.0]), ref) == pytest.approx(0.1)


def test_flat_grad_fills_missing_gradients_with_zeros():
    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.ones(2, 3)
    g = acc.flat_grad(model)
    assert g.shape == (8,) and g.sum() == 6


def test_token_normalised_accumulation_matches_the_large_batch():
    config = load_config("llama-tiny")
    model = build_model(config, dropout=0.0)
    rows = acc.padded_causal_batch([16, 9, 3], seq_len=16, vocab_size=config.vocab_size)
    model(**rows).loss.backward()
    big = acc.flat_grad(model)
    model.zero_grad(set_to_none=True)
    n = acc.target_count(rows["labels"])
    for part in acc.split(rows, 1):
        model(**part, num_items_in_batch=n).loss.backward()
    tol = acc.reorder_tolerance(big, 3 * 16)
    assert torch.allclose(acc.flat_grad(model), big, rtol=0, atol=tol)


def test_measure_follows_several_micro_batches():
    cfg = RunConfig(model="bert-tiny", batch_size=1, seq_len=16, grad_accum=2, warmup=1,
                    repeats=1, flops=False, device="cpu")  # fmt: skip
    rec = measure(cfg)
    assert rec.ok and rec.samples_per_s > 0
    m = rec.memory
    largest = max(p.numel() for p in build_model(load_config("bert-tiny")).parameters())
    # The accumulated gradient buffer, plus at most one fresh gradient waiting to be added.
    assert m["params"] <= m["gradients"] <= m["params"] + 4 * largest
    assert 0 < m["activations"] < m["peak"]


def test_throughput_and_figure():
    cfg = RunConfig(model="bert-tiny", batch_size=2, seq_len=16, grad_accum=2, warmup=1,
                    repeats=1, device="cpu")  # fmt: skip
    rec = acc.throughput(cfg)
    assert rec.ok and rec.memory is None and rec.samples_per_s > 0
    fig = acc.error_bars({"a": 1e-7, "b": 0.0, "c": 2.0}, tolerance=1e-5)
    assert len(fig.axes[0].patches) == 3


def test_naive_accumulation_is_wrong_only_for_unequal_lengths():
    config = load_config("llama-tiny")
    model = build_model(config, dropout=0.0)
    seq = 16
    # Rounding bound for sums over the batch's positions (reorder_tolerance), as a fraction of
    # max |g|: 3 rows x 16 positions x eps. Equal lengths: both schemes are the large batch.
    rounding = 3 * seq * acc.FP32_EPS
    equal = acc.naive_and_token_errors(model, acc.padded_causal_batch([seq] * 3, seq, 50))
    assert equal["naive"] <= rounding and equal["token-weighted"] <= rounding, equal
    # Unequal lengths: the naive scheme weighs the 2-target row's tokens T/(k T_i) = 24/(3 x 2)
    # = 4x too much, a different objective, so its gradient is off by a good fraction of the
    # gradient itself (5 % is far above rounding, far below what a 4x mis-weighting gives).
    unequal = acc.naive_and_token_errors(model, acc.padded_causal_batch([16, 9, 3], seq, 50))
    assert unequal["naive"] > 0.05, unequal
    assert unequal["token-weighted"] <= rounding, unequal


def test_figures_have_no_drawing_problems():
    # As in the lesson: six gradient errors (one exactly 0) and the tolerance N eps, with
    # N = 256 positions at the tiny scale and 2048 at the full scale.
    for n_terms, b in ((256, 4), (2048, 4)):
        errors = {
            f"encoder {b}×1 vs 1×{b}": 3e-8,
            "decoder naive: mean / k": 1.2,
            "decoder sum / N (by hand)": 4e-8,
            "decoder num_items_in_batch": 0.0,
            "Trainer decoder": 5e-8,
            "Trainer encoder": 3.0,
            "Trainer encoder fixed": 2e-8,
        }
        fig = acc.error_bars(errors, n_terms * acc.FP32_EPS, title="Accumulated vs large-batch")
        assert figure_problems(fig) == []
    # Throughput: effective batch 8 split four ways, and 4×16 against 1×64 (tiny); effective
    # batch 4 split three ways at the full scale, where samples/s are single digits.
    for eff, big, scale in ((8, 64, 100.0), (4, 64, 1.0)):
        splits = [f"{eff // 2**i}×{2**i}" for i in range(4) if eff // 2**i >= 1]
        groups = {
            f"effective batch {eff}": {s: (scale * (9 - i), scale * (8 - i), scale * (10 - i))
                                       for i, s in enumerate(splits)},
            f"effective batch {big}": {"4×16": (scale * 8, scale * 7, scale * 9),
                                       "1×64": (scale * 3, scale * 2.5, scale * 3.5)},
        }  # fmt: skip
        fig = acc.throughput_groups_figure(groups, title="Throughput on cpu, by effective batch")
        assert len(fig.axes) == 2
        assert figure_problems(fig) == []
