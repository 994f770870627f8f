"""Attention implementations agree; eager memory is quadratic in s, the flash kernel's linear."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers.lessons.sdpa_flash_attention import (
    GUIDE_OFFSET,
    IMPLEMENTATIONS,
    AttentionLayerConfig,
    LayerMemoryResult,
    OutputErrorsResult,
    attend,
    backend_problem,
    flash_attn_2_problem,
    layer_memories,
    layer_memory,
    make_qkv,
    output_errors,
    power_law_figure,
)
from tests.cells import cell_function
from tests.plot_checks import figure_problems

# Lesson 10's kernel detector, as its cell writes it (a TorchDispatchMode noting operators).
attention_ops = cell_function("10_sdpa_flash_attention.ipynb", "attention_ops")
# Its attention written by hand (section 1's cell): what the experiments run as "manual".
by_hand = cell_function("10_sdpa_flash_attention.ipynb", "attention_by_hand", math=math)
# The fit the lesson reads its slopes with (section 3's cell).
power_law_exponent = cell_function("10_sdpa_flash_attention.ipynb", "power_law_exponent", np=np)

EAGER = ["manual", "hf-eager", "sdpa-math"]


def test_eager_versions_match_sdpa():
    q, k, v, _ = make_qkv(2, 3, 40, 16)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    for name in EAGER:
        out = attend(name, q, k, v, by_hand=by_hand)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    no_mask = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(attend("hf-eager", q, k, v, causal=False), no_mask)


def test_manual_needs_the_cells_function_and_is_causal_only():
    q, k, v, _ = make_qkv(1, 1, 4, 4)
    with pytest.raises(ValueError, match="pass by_hand=attention_by_hand"):
        attend("manual", q, k, v)
    with pytest.raises(ValueError, match="causal"):
        attend("manual", q, k, v, causal=False, by_hand=by_hand)


def test_output_errors_are_small_in_fp32():
    found = output_errors(EAGER, 64, 16, torch.float32, heads=2, by_hand=by_hand)
    assert isinstance(found, OutputErrorsResult) and set(found.errors) == set(EAGER)
    for err in found.errors.values():
        assert err < 16 * torch.finfo(torch.float32).eps * found.max_v


def test_math_backend_always_runs_and_unknown_names_fail():
    assert backend_problem("sdpa-math", head_dim=16) is None
    with pytest.raises(ValueError, match="unknown attention"):
        attend("nope", *make_qkv(1, 1, 4, 4)[:3])


def test_cpu_flash_kernel_is_what_sdpa_picks():
    if backend_problem("sdpa-flash", head_dim=16) is not None:
        pytest.skip("this torch build has no flash kernel for the CPU")
    q, k, v, _ = make_qkv(1, 2, 32, 16)
    ops = attention_ops(lambda: attend("sdpa-flash", q, k, v))
    assert any("flash" in op for op in ops), ops
    assert "bmm" in attention_ops(lambda: attend("manual", q, k, v, by_hand=by_hand))


def test_memory_quadratic_for_eager_linear_for_flash():
    seqs = [64, 128, 256]
    layer = AttentionLayerConfig(batch=1, heads=2, head_dim=8, by_hand=by_hand)
    manual = [layer_memory("manual", layer, s).peak for s in seqs]
    assert power_law_exponent(seqs, manual) > 1.7
    # The saved probabilities alone are b*h*s^2 fp32 numbers.
    assert manual[-1] > 2 * 256 * 256 * 4
    if backend_problem("sdpa-flash", head_dim=8) is None:
        flash = [m.peak for m in layer_memories("sdpa-flash", layer, seqs)]
        assert power_law_exponent(seqs, flash) < 1.3


def test_layer_memory_result_counts_the_inputs_and_keeps_categories_for_records():
    layer = AttentionLayerConfig(batch=1, heads=2, head_dim=8, by_hand=by_hand)
    mem = layer_memory("manual", layer, 16)
    assert isinstance(mem, LayerMemoryResult)
    assert mem.inputs == 4 * (1 * 2 * 16 * 8) * 4  # q, k, v and the output gradient, fp32
    assert mem.allocator is None  # no caching allocator on the CPU
    assert mem.categories() == {
        "peak": mem.peak,
        "activations": mem.activations,
        "temporaries": mem.temporaries,
        "inputs": mem.inputs,
    }


def test_power_law_exponent_recovers_known_slopes():
    xs = [1, 2, 4, 8]
    assert power_law_exponent(xs, [3 * x**2 for x in xs]) == pytest.approx(2.0)
    assert power_law_exponent(xs, [5 * x for x in xs]) == pytest.approx(1.0)


def test_power_law_figure_draws_the_series_and_two_visible_guides_on_log_axes():
    seqs, spans = [64, 128, 256], [(0.5, 2.0), (3.0, 5.0), (15.0, 17.0)]
    fig = power_law_figure(seqs, {"manual": [1.0, 4.0, 16.0]}, "MiB", ranges={"manual": spans})
    ax = fig.axes[0]
    guides = {line.get_label(): line for line in ax.get_lines() if "guide" in line.get_label()}
    assert set(guides) == {"∝ s² guide", "∝ s guide"}
    assert guides["∝ s² guide"].get_linestyle() != guides["∝ s guide"].get_linestyle()
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["manual"]
    assert {t.get_text() for t in ax.texts} >= {"∝ s²", "∝ s"}  # labels at the guides' ends
    assert figure_problems(fig) == []


def test_power_law_figure_of_nothing_says_why():
    with pytest.raises(ValueError, match="no implementation ran"):
        power_law_figure([64, 128], {}, "MiB")


def test_guides_are_not_hidden_under_series_of_their_slope():
    # A series of slope exactly 1 and one of slope exactly 2: each guide must stay a visible
    # factor (GUIDE_OFFSET) away from the series it parallels, at every point.
    seqs = [256, 512, 1024, 2048]
    series = {"eager": [4.0 * (s / 256) ** 2 for s in seqs], "flash": [1.0 * s / 256 for s in seqs]}
    ax = power_law_figure(seqs, series, "MiB").axes[0]
    guides = {line.get_label(): line.get_ydata() for line in ax.get_lines()}
    for name, guide in (("eager", guides["∝ s² guide"]), ("flash", guides["∝ s guide"])):
        ratios = [max(g / y, y / g) for g, y in zip(guide, series[name], strict=True)]
        assert min(ratios) >= GUIDE_OFFSET * 0.999, (name, ratios)


def test_power_law_figure_is_readable_at_both_scales():
    # Shaped like the lesson: tiny (CPU: 4 implementations, d=32) and full (GPU: 6, d=64),
    # memory without and times with error bars.
    for names, d in (
        (["manual", "hf-eager", "sdpa-math", "sdpa-flash"], 32),
        (IMPLEMENTATIONS, 64),
    ):
        seqs = [8 * d * 2**i for i in range(4)]
        mem = {
            n: [0.01 * (s / 64) ** (1.9 if i < 3 else 1) for s in seqs] for i, n in enumerate(names)
        }
        ms = {n: [0.2 * (s / 64) ** 1.8 / (1 + i) for s in seqs] for i, n in enumerate(names)}
        spans = {n: [(0.8 * y, 1.3 * y) for y in ys] for n, ys in ms.items()}
        assert figure_problems(power_law_figure(seqs, mem, "peak MiB", title="memory")) == []
        fig = power_law_figure(seqs, ms, "ms", title="Attention layer time on cpu", ranges=spans)
        assert figure_problems(fig) == []


def test_implementations_listed():
    assert IMPLEMENTATIONS[:2] == ("manual", "hf-eager")


def test_run_config_accepts_flash_attention_2_and_reports_why_it_cannot_run_here():
    # Lesson 10 trains flash_attention_2 through the usual isolate.run: the course's own check
    # lets the name through, and where the kernel cannot run (no flash-attn package, no
    # Ampere GPU) the record carries transformers' reason instead of a crash.
    from helpers import isolate
    from helpers.train import RunConfig, Trainee

    with pytest.raises(ValueError, match="unknown attention"):
        Trainee(RunConfig(model="llama-tiny", batch_size=1, seq_len=8, attn="nope"))
    if flash_attn_2_problem(torch.device("cpu")) is None:
        pytest.skip("flash_attention_2 can run here")
    cfg = RunConfig(model="llama-tiny", batch_size=1, seq_len=8, attn="flash_attention_2")
    rec = isolate.run(cfg, isolate=False)
    assert not rec.ok and "flash" in rec.error.lower(), rec.error
