"""Checkpointing helpers: recomputation, exact memory arithmetic, the transformers switch."""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from helpers.compat import activation_memory_budget, is_checkpointing
from helpers.lessons.gradient_checkpointing import (
    PairedTimingResult,
    block_stack,
    budget_sweep,
    enable_checkpointing,
    paired_step_times,
    saved_for_backward,
    segments_figure,
)
from helpers.memory import CategoryTracker
from helpers.models import build_model, load_config
from helpers.train import RunConfig, measure
from tests.cells import cell_function
from tests.plot_checks import figure_problems

NOTEBOOK = "04_gradient_checkpointing.ipynb"
# Lesson 04's segmented step, its measurement and its arithmetic, as its cells write them.
SEGMENTED_STEP = cell_function(NOTEBOOK, "segmented_step")
stack_step_memory = cell_function(
    NOTEBOOK, "stack_step_memory", block_stack=block_stack, CategoryTracker=CategoryTracker
)
# One cell writes the three (predicted_activation_bytes and optimal_segments call the first).
saved_bytes_per_block = cell_function(NOTEBOOK, "saved_bytes_per_block")
predicted_activation_bytes = cell_function(NOTEBOOK, "predicted_activation_bytes")
optimal_segments = cell_function(NOTEBOOK, "optimal_segments")
# The "Try it" section's blocks checkpointed one by one, and their arithmetic.
partial_checkpoint_memory = cell_function(
    NOTEBOOK,
    "partial_checkpoint_memory",
    block_stack=block_stack,
    CategoryTracker=CategoryTracker,
    checkpoint=checkpoint,
)
predicted_partial_activation_bytes = cell_function(
    NOTEBOOK, "predicted_partial_activation_bytes", saved_bytes_per_block=saved_bytes_per_block
)
# The loss compiled under an activation memory budget (section 7), as its cell writes it.
BUDGET_LOSS = cell_function(NOTEBOOK, "budget_loss")


def _grads(segments: int, dropout: float):
    stack = block_stack(4, 16, dropout=dropout, seed=0)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    y = (
        stack(x)
        if segments == 1
        else checkpoint_sequential(stack, segments, x, use_reentrant=False)
    )
    y.sum().backward()
    return [p.grad for p in stack.parameters()], [block.calls for block in stack]


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_checkpointed_stack_recomputes_and_gives_the_same_gradients(dropout):
    plain, plain_calls = _grads(1, dropout)
    ckpt, ckpt_calls = _grads(2, dropout)
    assert all(torch.equal(a, b) for a, b in zip(plain, ckpt, strict=True))
    assert plain_calls == [1, 1, 1, 1]
    # checkpoint_sequential checkpoints all segments but the last: those blocks run twice.
    assert ckpt_calls == [2, 2, 1, 1]


@pytest.mark.parametrize("segments", [1, 2, 4])
def test_stack_memory_matches_the_arithmetic(segments):
    n, width, rows = 4, 32, 64
    measured = stack_step_memory(n, width, rows, segments, SEGMENTED_STEP).activations
    assert measured == pytest.approx(predicted_activation_bytes(n, segments, rows, width), rel=0.02)


def test_optimal_segments_is_the_square_root_rule():
    c, inside = saved_bytes_per_block(64, 32)
    assert optimal_segments(16, 64, 32) == pytest.approx((16 * (c + inside) / c) ** 0.5)
    # Memory model (s - 1) c + (n / s)(c + inside) is smallest near the optimum.
    s_star = optimal_segments(16, 64, 32)
    cost = {s: (s - 1) * c + 16 / s * (c + inside) for s in (1, 2, 4, 8, 16)}
    assert abs(min(cost, key=cost.get) - s_star) <= s_star / 2


def test_enable_checkpointing_is_quiet_and_switches_layers_on():
    model = build_model(load_config("bert-tiny"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the deprecated name must not be used
        enable_checkpointing(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # nor by the check below
        assert is_checkpointing(model) and model.config.use_cache is False


def test_paired_timing_and_measure():
    cfg = RunConfig(model="bert-tiny", batch_size=2, seq_len=16, warmup=1, repeats=1, flops=False)
    paired = paired_step_times(cfg, repeats=2)
    assert isinstance(paired, PairedTimingResult)
    assert len(paired.plain) == len(paired.checkpointed) == len(paired.forward) == 2
    assert all(r > 0 for r in paired.ratios) and math.isfinite(paired.extra_over_forward)
    plain = measure(cfg)
    ckpt = measure(RunConfig(**{**cfg.as_dict(), "gradient_checkpointing": True}))
    assert ckpt.memory["params"] == plain.memory["params"]
    assert ckpt.memory["activations"] < plain.memory["activations"]


def test_checkpointing_can_be_switched_off_and_on_between_steps():
    """paired_step_times toggles one model: each switch must change what the step runs."""
    from helpers.data import random_batch
    from helpers.models import build_model, disable_checkpointing, enable_checkpointing, load_config

    config = load_config("bert-tiny")
    model = build_model(config)
    model.train()
    attention = model.bert.encoder.layer[0].attention  # inside the checkpointed layer
    calls = []
    attention.register_forward_pre_hook(lambda *_: calls.append(1))
    batch = random_batch("classify", 2, 16, config.vocab_size)

    def forward_calls() -> int:
        calls.clear()
        model(**batch).loss.backward()
        return len(calls)

    assert forward_calls() == 1
    enable_checkpointing(model)
    assert forward_calls() == 2  # the layer runs again in the backward pass
    disable_checkpointing(model)
    assert forward_calls() == 1
    enable_checkpointing(model)
    assert forward_calls() == 2


@pytest.mark.parametrize("checkpointed", [0, 1, 4, 7, 8])
def test_partial_checkpointing_memory_matches_the_arithmetic(checkpointed):
    # 2 %, as for the segments: room for a kernel's small extra tensor (the loss scalar here).
    n, width, rows = 8, 32, 64
    measured = partial_checkpoint_memory(n, width, rows, checkpointed).activations
    predicted = predicted_partial_activation_bytes(n, checkpointed, rows, width)
    assert measured == pytest.approx(predicted, rel=0.02)


def test_partial_checkpointing_falls_linearly_until_the_last_block():
    n, width, rows = 8, 32, 64
    _, inside = saved_bytes_per_block(rows, width)
    pred = [predicted_partial_activation_bytes(n, k, rows, width) for k in range(n + 1)]
    assert all(a - b == inside for a, b in itertools.pairwise(pred[:-1]))
    assert 0 < pred[-2] - pred[-1] < inside  # one block's inside comes back to be recomputed


def test_segments_figure_has_no_drawing_problems():
    # As in the lesson: 16 blocks, a = 3.03 c, counts 1 to 16; memory in units of c.
    counts, n, ratio = [1, 2, 4, 8, 16], 16, 4.03
    predicted = [(s - 1) + n / s * ratio + 1 for s in counts]
    measured = [p + 1e-5 for p in predicted]
    peaks = [m + 0.8 + 0.1 * i for i, m in enumerate(measured)]
    fig = segments_figure(counts, predicted, measured, peaks, optimal_segments(n, 1024, 64),
                          title="16 blocks: memory against the number of segments")  # fmt: skip
    assert figure_problems(fig) == []


def test_saved_for_backward_counts_each_storage_once_without_weights_or_input():
    linear = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def run():
        y = linear(x).relu()  # addmm saves x and the weight (left out), relu its output
        return y * y  # mul saves y twice: the same storage, counted once

    out, saved = saved_for_backward(run, [*linear.parameters(), x])
    assert saved == 4 * 8 * 4  # relu's output, 4 x 8 fp32
    out.sum().backward()
    assert linear.weight.grad is not None


def test_activation_memory_budget_patches_the_compiler_config_and_checks_its_range():
    import torch._functorch.config as functorch_config

    default = functorch_config.activation_memory_budget
    with activation_memory_budget(0.25):
        assert functorch_config.activation_memory_budget == 0.25
    assert functorch_config.activation_memory_budget == default
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        activation_memory_budget(1.5)


def test_lower_budgets_save_less_and_recompute_more():
    # Section 7 at a small size: 2 blocks of width 16, 32 rows.
    n, width, rows = 2, 16, 32
    runs = budget_sweep(n, width, rows, [1.0, 0.0], BUDGET_LOSS)
    c, inside = saved_bytes_per_block(rows, width)
    assert runs[None].saved_bytes == n * (c + inside)  # every block's input and inside
    assert runs[0.0].saved_bytes < runs[1.0].saved_bytes <= runs[None].saved_bytes
    assert runs[0.0].backward_flops > runs[1.0].backward_flops  # the matmuls run again
    for budget in (1.0, 0.0):
        for g, e in zip(runs[budget].grads, runs[None].grads, strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-7)
