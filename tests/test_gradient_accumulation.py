"""Gradient accumulation helpers: batches, tolerances, and measuring accumulated steps."""

from __future__ import annotations

import pytest
import torch

from helpers.lessons import gradient_accumulation as acc
from helpers.models import build_model, load_config
from helpers.train import RunConfig, measure


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
