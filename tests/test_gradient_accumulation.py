"""Gradient accumulation: the lesson's cells (splitting, accumulating, counting targets, the
tolerance) on padded batches, the measured accumulated step, and the lesson's figures."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.lessons import gradient_accumulation as acc
from helpers.models import build_model, load_config
from helpers.train import RunConfig, measure
from tests.cells import cell_function
from tests.plot_checks import figure_problems

NOTEBOOK = "03_gradient_accumulation.ipynb"
flat_grad = cell_function(NOTEBOOK, "flat_grad")
split = cell_function(NOTEBOOK, "split")
max_error = cell_function(NOTEBOOK, "max_error")
accumulation_step = cell_function(NOTEBOOK, "accumulation_step")
reorder_tolerance = cell_function(NOTEBOOK, "reorder_tolerance")
FP32_EPS = torch.finfo(torch.float32).eps
target_count = cell_function(NOTEBOOK, "target_count", F=F, flat_grad=flat_grad)
token_loss_sum = cell_function(NOTEBOOK, "token_loss_sum", F=F, flat_grad=flat_grad)
accumulated_grad = cell_function(NOTEBOOK, "accumulated_grad", F=F, flat_grad=flat_grad)


def test_padded_batch_and_target_count():
    rows = acc.padded_causal_batch([5, 3, 1], seq_len=6, vocab_size=50, seed=1)
    assert rows["input_ids"].shape == rows["labels"].shape == (3, 6)
    assert rows["attention_mask"].sum(1).tolist() == [5, 3, 1]
    assert (rows["labels"] == -100).sum() == 18 - 9  # every padded position is ignored
    assert target_count(rows["labels"]) == 4 + 2 + 0  # L real tokens give L - 1 targets
    parts = split(rows, 2)
    assert [len(p["input_ids"]) for p in parts] == [2, 1]
    assert torch.equal(parts[1]["labels"], rows["labels"][2:])


def test_tolerance_and_errors():
    ref = torch.tensor([0.5, -2.0, 0.0])
    assert reorder_tolerance(ref, 256) == pytest.approx(256 * 2**-23 * 2.0)
    assert max_error(ref + torch.tensor([0.0, 0.2, 0.0]), ref) == pytest.approx(0.1)


def test_flat_grad_fills_missing_gradients_with_zeros():
    model = torch.nn.Linear(3, 2)
    model.weight.grad = torch.ones(2, 3)
    g = flat_grad(model)
    assert g.shape == (8,) and g.sum() == 6


def test_the_accumulation_step_applies_the_large_batch_gradient():
    config = load_config("bert-tiny")
    one_big = build_model(config, dropout=0.0)
    many_small = build_model(config, dropout=0.0)  # the same seed: the same weights
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, (4, 16)),
        "labels": torch.arange(4) % 2,
    }
    sgd = torch.optim.SGD
    g_big = accumulation_step(one_big, sgd(one_big.parameters(), lr=1e-3), [batch])
    g_acc = accumulation_step(many_small, sgd(many_small.parameters(), lr=1e-3), split(batch, 1))
    assert torch.allclose(g_acc, g_big, rtol=0, atol=reorder_tolerance(g_big, 4 * 16))
    for a, b in zip(one_big.parameters(), many_small.parameters(), strict=True):  # stepped alike
        assert torch.allclose(a, b, rtol=0, atol=1e-6)


def test_token_normalised_accumulation_matches_the_large_batch():
    config = load_config("llama-tiny")
    model = build_model(config, dropout=0.0)
    rows = acc.padded_causal_batch([16, 9, 3], seq_len=16, vocab_size=config.vocab_size)
    n = target_count(rows["labels"])
    big = accumulated_grad(model, [rows], lambda m, p: m(**p).loss)
    tol = reorder_tolerance(big, 3 * 16)
    by_hand = accumulated_grad(model, split(rows, 1), lambda m, p: token_loss_sum(m, p) / n)
    hf = accumulated_grad(model, split(rows, 1), lambda m, p: m(**p, num_items_in_batch=n).loss)
    assert torch.allclose(by_hand, big, rtol=0, atol=tol)
    assert torch.allclose(hf, big, rtol=0, atol=tol)


def test_naive_accumulation_is_wrong_only_for_unequal_lengths():
    config = load_config("llama-tiny")
    model = build_model(config, dropout=0.0)
    seq = 16

    def naive_error(lengths):  # each row's mean loss / k, against the large batch
        rows = acc.padded_causal_batch(lengths, seq, 50)
        big = accumulated_grad(model, [rows], lambda m, p: m(**p).loss)
        naive = accumulated_grad(model, split(rows, 1), lambda m, p: m(**p).loss / len(lengths))
        return max_error(naive, big)

    # Rounding bound for sums over the batch's positions (reorder_tolerance), as a fraction of
    # max |g|: 3 rows x 16 positions x eps. Equal lengths: the naive scheme is the large batch.
    assert naive_error([seq] * 3) <= 3 * seq * FP32_EPS
    # Unequal lengths: the naive scheme weighs the 2-target row's tokens T/(k T_i) = 24/(3 x 2)
    # = 4x too much, a different objective, so its gradient is off by a good fraction of the
    # gradient itself (5 % is far above rounding, far below what a 4x mis-weighting gives).
    assert naive_error([16, 9, 3]) > 0.05


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


def test_figures_have_no_drawing_problems():
    fig = acc.error_bars({"a": 1e-7, "b": 0.0, "c": 2.0}, tolerance=1e-5)
    assert len(fig.axes[0].patches) == 3
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
        fig = acc.error_bars(errors, n_terms * FP32_EPS, title="Accumulated vs large-batch")
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


def test_the_cells_accumulation_step_is_the_step_the_runs_take():
    """Section 1's loop (the cell) and helpers.train.train_step, which every
    ``RunConfig(grad_accum=k)`` run of sections 4 and 5 takes: from the same weights, over the
    same micro-batches, the same weights after two optimizer steps, bit for bit."""
    from helpers.data import random_batch
    from helpers.train import train_step

    config = load_config("bert-tiny")
    batch = random_batch("classify", 8, 16, config.vocab_size, seed=0)
    weights = []
    for step in (accumulation_step, train_step):
        model = build_model(config, dropout=0.0)
        sgd = torch.optim.SGD(model.parameters(), lr=0.5)
        for _ in range(2):
            step(model, sgd, split(batch, 2))  # 4 micro-batches of 2 per optimizer step
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))
    start = build_model(config, dropout=0.0)
    assert not torch.equal(next(start.parameters()), weights[0][0])  # the steps moved it
