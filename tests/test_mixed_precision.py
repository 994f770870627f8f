"""Number formats from bit counts agree with torch; the timed Markov run and figures work."""

from __future__ import annotations

import pytest
import torch
from matplotlib.figure import Figure

from helpers.hardware import precision_problem
from helpers.lessons.mixed_precision import (
    DTYPES,
    FORMAT_BITS,
    cpu_16bit_instructions,
    crossover_figure,
    float_format,
    linear_params,
    loss_figure,
    markov_runs,
    measure_series,
    peak_phase,
    range_figure,
)
from helpers.models import build_model, load_config
from helpers.train import RunConfig, TrainResult, train_markov

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", list(DTYPES))
def test_formats_match_torch_finfo(name):
    fmt, dtype = float_format(name), DTYPES[name]
    info = torch.finfo(dtype)
    assert fmt.bits == info.bits
    assert (fmt.max, fmt.smallest_normal, fmt.eps) == (info.max, info.smallest_normal, info.eps)
    # The smallest subnormal survives the cast; half of it rounds (to even) to zero.
    tiny = torch.tensor(fmt.smallest_subnormal, dtype=torch.float64)
    assert tiny.to(dtype) != 0 and (tiny / 2).to(dtype) == 0
    # One more step past max overflows: max + half a spacing rounds to inf.
    spacing = 2.0 ** (fmt.bias - fmt.mantissa_bits)
    assert torch.isinf(torch.tensor(fmt.max + spacing / 2, dtype=torch.float64).to(dtype))


def test_tf32_has_fp32_range_and_fp16_precision():
    tf32, fp32, fp16 = float_format("tf32"), float_format("fp32"), float_format("fp16")
    assert tf32.bits == 19 and tf32.eps == fp16.eps
    assert tf32.smallest_normal == fp32.smallest_normal and tf32.max == pytest.approx(
        fp32.max, 1e-3
    )
    assert set(FORMAT_BITS) == {"fp32", "tf32", "fp16", "bf16"}
    with pytest.raises(ValueError, match="unknown format"):
        float_format("fp8")


def test_cpu_16bit_instructions_is_a_flag_dict_or_unknown():
    flags = cpu_16bit_instructions()
    assert flags is None or (
        set(flags) == {"bf16", "fp16"} and all(isinstance(v, bool) for v in flags.values())
    )


def test_linear_params_counts_linear_weights_and_biases():
    model = build_model(load_config("bert-tiny"))
    expected = sum(
        p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters()
    )
    assert linear_params("bert-tiny") == expected
    assert linear_params("llama-tiny") > 0


def test_peak_phase():
    params = 100
    assert peak_phase({"params": params, "peak_at": {"gradients": params}}) == "optimizer step"
    assert (
        peak_phase({"params": params, "peak_at": {"activations": 5, "gradients": 1}}) == "fwd/bwd"
    )
    assert peak_phase({"params": params, "peak_at": None}) == "fwd/bwd"


def test_measure_series_returns_records_and_ooms():
    base = dict(model="bert-tiny", batch_size=2, seq_len=8, repeats=1, flops=False, device="cpu")
    ok, oom = measure_series([RunConfig(**base), RunConfig(**base, budget=2**20)])
    assert ok.ok and ok.memory["params"] == 4 * ok.n_params
    assert not oom.ok and oom.oom


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_markov_run_records_every_step(precision):
    if precision_problem(precision, CPU):
        pytest.skip(precision_problem(precision, CPU))
    cfg = RunConfig(model="llama-tiny", batch_size=2, seq_len=8, precision=precision, device="cpu")
    run = train_markov(cfg, 3)
    assert len(run.losses) == len(run.step_times) == 3 and run.step_time > 0
    assert len(run.scales) == (3 if precision == "fp16" else 0)  # GradScaler only for fp16
    assert 0 < run.best_loss < run.uniform_loss < run.losses[0]  # starts near log(vocab)
    assert run.final(2) == pytest.approx(sum(run.losses[-2:]) / 2)


def test_markov_runs_same_seed_same_start():
    cfg = RunConfig(model="llama-tiny", batch_size=2, seq_len=8, device="cpu")
    first, second = markov_runs([cfg, cfg], 2)
    assert first.losses == second.losses  # same seed: same weights and batches, nothing carried


def test_figures_are_figures():
    mem = {"peak": 10, "activations": 4, "weight_copies": 1, "params": 1}
    half = {"peak": 9, "activations": 2, "weight_copies": 1, "params": 1}
    assert isinstance(range_figure(list(FORMAT_BITS), {"x": 1e-8}), Figure)
    assert isinstance(crossover_figure([8, 16], [mem, mem], [half, half]), Figure)
    run = TrainResult("fp32", losses=[3.0, 2.0], step_times=[0.1, 0.1], best_loss=1, uniform_loss=4)
    assert isinstance(loss_figure({"fp32": run, "bf16": TrainResult("bf16", [3.0, 2.1])}), Figure)
