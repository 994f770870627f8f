"""Number formats from bit counts agree with torch; the timed Markov run and figures work."""

from __future__ import annotations

import pytest
import torch
from matplotlib.figure import Figure

from helpers import isolate
from helpers.hardware import precision_problem
from helpers.lessons.mixed_precision import (
    DTYPES,
    FORMAT_BITS,
    cpu_16bit_instructions,
    cpu_16bit_sentence,
    crossover_figure,
    float_format,
    loss_figure,
    markov_runs,
    moving_average,
    range_figure,
)
from helpers.models import build_model, load_config
from helpers.names import MiB
from helpers.train import RunConfig, TrainResult, train_markov, train_step
from tests.cells import cell_function
from tests.plot_checks import figure_problems

CPU = torch.device("cpu")
NOTEBOOK = "05_mixed_precision.ipynb"
linear_params = cell_function(
    NOTEBOOK, "linear_params", build_model=build_model, load_config=load_config
)
peak_phase = cell_function(NOTEBOOK, "peak_phase")
measure_series = cell_function(NOTEBOOK, "measure_series", isolate=isolate)
skipped_steps = cell_function(NOTEBOOK, "skipped_steps")


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


def test_cpu_16bit_sentence_names_what_the_cpu_has():
    both = cpu_16bit_sentence({"bf16": True, "fp16": False})
    assert "has bf16 arithmetic instructions" in both and "no fp16" in both
    assert "{" not in both  # a sentence, not the dict
    assert "has no bf16 or fp16" in cpu_16bit_sentence({"bf16": False, "fp16": False})
    assert "could not be read" in cpu_16bit_sentence(None)
    assert cpu_16bit_sentence(cpu_16bit_instructions()).endswith(".")


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


def _scaler_trace():
    """Section 3's GradScaler loop, from lesson 05's cell."""
    return cell_function("05_mixed_precision.ipynb", "scaler_trace")


def test_scaler_trace_skips_overflowing_steps():
    if precision_problem("fp16", CPU):
        pytest.skip(precision_problem("fp16", CPU))
    scaler_trace = _scaler_trace()
    # Interval 1: back to 2^16 after every clean step, so every other step overflows.
    rows = scaler_trace(CPU, 6, growth_interval=1)
    assert [r["gradients finite"] for r in rows] == [False, True] * 3
    assert all(r["weights changed"] == r["gradients finite"] for r in rows)
    # Interval 3: one skipped step, then three clean ones at 2^15.
    rows = scaler_trace(CPU, 8, growth_interval=3)
    assert sum(not r["gradients finite"] for r in rows) == 2
    # Started low, nothing overflows until the scale has grown back to 2^16.
    rows = scaler_trace(CPU, 4, growth_interval=1, init_scale=2.0**14)
    assert [r["scale used"] for r in rows] == [2.0**14, 2.0**15, 2.0**16, 2.0**15]


def _train_step_trace(steps: int, growth_interval: int) -> list[dict]:
    """The cell's experiment through helpers.train.train_step, the fp16 step every
    RunConfig(precision="fp16") run of the course takes."""
    torch.manual_seed(0)
    net = torch.nn.Linear(16, 16)
    sgd = torch.optim.SGD(net.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", growth_interval=growth_interval)
    inputs = torch.randn(8, 16)
    rows, finite = [], []
    for _ in range(steps):
        before, used = net.weight.detach().clone(), scaler.get_scale()
        train_step(
            net, sgd, [inputs], precision="fp16", scaler=scaler,
            loss_of=lambda model, batch: model(batch).float().sum() / len(batch),
            on_gradients=lambda: finite.append(
                all(torch.isfinite(p.grad).all().item() for p in net.parameters())
            ),
        )  # fmt: skip
        rows.append(
            {
                "scale used": used,
                "gradients finite": finite[-1],
                "weights changed": not torch.equal(before, net.weight),
                "scale after": scaler.get_scale(),
            }
        )
    return rows


@pytest.mark.parametrize("growth_interval", [1, 3])
def test_the_cells_gradscaler_loop_is_the_step_the_runs_take(growth_interval):
    """Section 3's loop (the cell) and train_step's fp16 branch, which sections 4 and 5
    measure: the same scales, the same skipped steps, the same steps that changed weights."""
    if precision_problem("fp16", CPU):
        pytest.skip(precision_problem("fp16", CPU))
    cell_rows = _scaler_trace()(CPU, 9, growth_interval)
    step_rows = _train_step_trace(9, growth_interval)
    assert cell_rows == step_rows
    assert any(not r["gradients finite"] for r in cell_rows)  # the overflow path is compared


def test_skipped_steps_counts_backoffs():
    assert skipped_steps([]) == 0
    assert skipped_steps([65536.0, 65536.0]) == 0
    assert skipped_steps([32768.0, 32768.0, 65536.0, 32768.0]) == 2
    assert skipped_steps([8.0, 4.0], init_scale=16.0) == 2


def test_moving_average():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([2.0, 4.0], 1) == [2.0, 4.0]
    assert moving_average([], 3) == []


def _mem(peak_mib: float, activations_mib: float, copies_mib: float) -> dict:
    return {
        "peak": int(peak_mib * MiB),
        "activations": int(activations_mib * MiB),
        "weight_copies": int(copies_mib * MiB),
        "params": 1,
    }


def _run(precision: str, steps: int, start: float, end: float, wobble: float) -> TrainResult:
    """A noisy falling loss curve shaped like the lesson's (log vocab -> near the best)."""
    g = torch.Generator().manual_seed(len(precision) + steps)
    noise = (wobble * torch.randn(steps, generator=g)).tolist()
    losses = [end + (start - end) * 0.98**i + n for i, n in enumerate(noise)]
    return TrainResult(precision, losses, [0.01] * steps, best_loss=1.07, uniform_loss=4.16)


@pytest.mark.parametrize("scale", ["tiny", "full"])
def test_figures_have_no_drawing_problems(scale):
    marks = {"a gradient of 1e-8": 1e-8, "the same x 65536": 1e-8 * 2**16}
    assert figure_problems(range_figure(list(FORMAT_BITS), marks)) == []
    assert figure_problems(range_figure(["fp16", "bf16"])) == []
    batches = [8, 16, 32, 64]
    if scale == "tiny":  # bert-tiny at length 8: fractions of a MiB
        fp32 = [_mem(3 + 0.1 * b, 0.08 * b, 0) for b in batches]
        half = [_mem(3.2 + 0.06 * b, 0.05 * b, 0.6) for b in batches]
        precisions, steps = ("fp32", "fp16", "bf16"), 300
    else:  # bert-large at length 64 on a GPU: thousands of MiB
        fp32 = [_mem(5000 + 40 * b, 35 * b, 0) for b in batches]
        half = [_mem(5600 + 22 * b, 20 * b, 600) for b in batches]
        precisions, steps = ("fp32", "tf32", "fp16", "bf16"), 133
    assert figure_problems(crossover_figure(batches, fp32, half, "bf16")) == []
    runs = {p: _run(p, steps, 6.9, 1.3, 0.25) for p in precisions}
    assert figure_problems(loss_figure(runs)) == []


def test_figures_are_figures():
    mem = {"peak": 10, "activations": 4, "weight_copies": 1, "params": 1}
    half = {"peak": 9, "activations": 2, "weight_copies": 1, "params": 1}
    assert isinstance(range_figure(list(FORMAT_BITS), {"x": 1e-8}), Figure)
    assert isinstance(crossover_figure([8, 16], [mem, mem], [half, half]), Figure)
    run = TrainResult("fp32", losses=[3.0, 2.0], step_times=[0.1, 0.1], best_loss=1, uniform_loss=4)
    assert isinstance(loss_figure({"fp32": run, "bf16": TrainResult("bf16", [3.0, 2.1])}), Figure)
