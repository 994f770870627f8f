"""The batch-size search helpers: accelerate recognises our OOMs, retries leave nothing behind."""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import find_executable_batch_size
from accelerate.utils.memory import should_reduce_batch_size
from matplotlib.figure import Figure

from helpers.lessons.batch_size import (
    MatmulTimingResult,
    matmul_figure,
    matmul_timing,
    recognised_budget,
    recognised_tracker,
    throughput_memory_figure,
)
from helpers.memory import CategoryTracker
from helpers.names import GiB, MiB
from helpers.results import Record
from tests.cells import cell_function
from tests.plot_checks import figure_problems

CPU = torch.device("cpu")
NOTEBOOK = "02_batch_size.ipynb"
# The search's technique, as the notebook's cells write it.
halving = cell_function(NOTEBOOK, "halving")
raise_if_oom = cell_function(NOTEBOOK, "raise_if_oom")
largest_fitting = cell_function(NOTEBOOK, "largest_fitting")


def test_halving_reduces_by_half_each_call():
    reduce = halving(64)
    assert [reduce() for _ in range(6)] == [32, 16, 8, 4, 2, 1]


def test_raise_if_oom_only_for_oom_records():
    raise_if_oom(Record({"batch_size": 2}))  # a run that worked: nothing happens
    raise_if_oom(Record({}, error="ValueError: bad", error_type="error"))  # not an OOM
    with pytest.raises(torch.OutOfMemoryError) as info:
        raise_if_oom(Record({}, error="OutOfMemoryError: memory budget exceeded", error_type="oom"))
    assert should_reduce_batch_size(info.value)


def test_budget_error_is_recognised_only_when_wrapped():
    with pytest.raises(torch.OutOfMemoryError) as plain, CategoryTracker(budget=MiB):
        torch.empty(2 * MiB)
    with pytest.raises(torch.OutOfMemoryError) as wrapped, recognised_tracker(budget=MiB):
        torch.empty(2 * MiB)
    assert not should_reduce_batch_size(plain.value)  # why the course wraps it
    assert should_reduce_batch_size(wrapped.value)


def _step(model: torch.nn.Module, batch_size: int) -> None:
    x = torch.randn(batch_size, 256, requires_grad=True)
    model(x).square().mean().backward()


def test_retry_after_oom_starts_clean():
    # After an OOM in the middle of a forward, the failed attempt's tensors must be freed and
    # uncounted, and the model must run again under the same tracker (a second root forward).
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8)
    )
    with recognised_budget(4 * MiB, model, device=CPU) as tracker:
        baseline = tracker.get_tracker_snapshot()[CPU]["Total"]
        with pytest.raises(torch.OutOfMemoryError):
            _step(model, 4096)  # activations alone: 4096 x 1024 x 4 B = 16 MiB
        assert tracker.get_tracker_snapshot()[CPU]["Total"] == baseline
        _step(model, 16)
        _step(model, 16)


def test_accelerate_search_finds_the_largest_power_of_two():
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 8)
    )
    tried = []

    def attempt(batch_size: int) -> int:
        tried.append(batch_size)
        model.zero_grad(set_to_none=True)
        _step(model, batch_size)
        return batch_size

    with recognised_budget(4 * MiB, model, device=CPU):
        found = find_executable_batch_size(attempt, 1024, reduce_batch_size_fn=halving(1024))()
    # Weights and gradients take 2.1 MiB; each sample adds about 12 KiB (its input, hidden
    # activations and their gradients): the peak is 2.8 MiB at 128 samples and 4.3 at 256.
    assert tried == [1024, 512, 256, 128]
    assert found == 128


def test_matmul_timing_and_figures():
    timing = matmul_timing([8, 15, 16], "float32", "cpu", warmup=1, repeats=3)
    assert set(timing.tflops) == {8, 15, 16}
    assert all(t > 0 for t in timing.tflops.values())
    assert isinstance(matmul_figure(timing), Figure)
    fig = throughput_memory_figure([1, 2, 4], [1.0, 1.8, 3.0], [MiB, 2 * MiB, 4 * MiB], 3 * MiB, 2)
    assert isinstance(fig, Figure)


def test_figures_have_no_drawing_problems():
    # Shaped like the lesson's: the tiny scale sweeps batches 1 to 64 (peaks of a few MiB to
    # over 64), the full scale 1 to 8 (GiB); the matmul sizes are the anchor +- 8.
    tiny = [2**i for i in range(7)]
    fig = throughput_memory_figure(
        tiny, [40.0 * b / (b + 2) for b in tiny], [(6 + 1.5 * b) * MiB for b in tiny],
        budget=64 * MiB, found=32, title="bert-tiny, seq 64, fp32 AdamW, a 2-core CPU",
        ranges=[(30.0 * b / (b + 2), 45.0 * b / (b + 2)) for b in tiny],
    )  # fmt: skip
    assert figure_problems(fig) == []
    full = [1, 2, 4, 8]
    fig = throughput_memory_figure(
        full, [9.0, 15.0, 20.0, 22.0], [b * 3 * GiB + 5 * GiB for b in full],
        budget=16 * GiB, found=2, title="bert-large, seq 512, fp32 AdamW, NVIDIA H100 80GB HBM3",
    )  # fmt: skip
    assert figure_problems(fig) == []
    for anchor in (512, 4096):
        sizes = list(range(anchor - 8, anchor + 9))
        timing = MatmulTimingResult("bfloat16")
        timing.tflops = {n: 100.0 if n % 8 == 0 else 60.0 for n in sizes}
        assert figure_problems(matmul_figure(timing, title=f"bfloat16 matmuls, n={anchor}")) == []


def test_largest_fitting_reads_the_measured_peaks():
    peaks = {1: 5 * MiB, 2: 6 * MiB, 4: 8 * MiB, 8: 12 * MiB}
    assert largest_fitting(peaks, 8 * MiB) == 4  # a peak equal to the budget fits
    assert largest_fitting(peaks, 12 * MiB - 1) == 4
    assert largest_fitting(peaks, 64 * MiB) == 8
    assert largest_fitting(peaks, 4 * MiB) is None
