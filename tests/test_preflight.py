"""The preflight's decisions on fake cards, and its table. (``make test`` runs the real thing.)"""

import pytest
import torch

from helpers.preflight import CHECKS, Check, PreflightResult, format_result, why_skip
from tests.fake_gpu import PROFILES, FakeGpu

CUDA = torch.device("cuda", 0)


def test_a_cpu_skips_the_gpu_only_checks_and_runs_the_rest():
    cpu = torch.device("cpu")
    skipped = {name for name, *_ in CHECKS if why_skip(name, cpu)}
    assert skipped == {"allocator view", "NVML view", "CUDA context", "tf32", "pinned memory"}


@pytest.mark.parametrize("key", ["t4", "v100"])
def test_pre_ampere_cards_skip_bf16_and_tf32_and_say_why(monkeypatch, key):
    FakeGpu(monkeypatch, [PROFILES[key]])
    assert "only emulates bf16" in why_skip("bf16", CUDA)
    assert "8.0" in why_skip("tf32", CUDA)
    assert why_skip("fp16 + GradScaler", CUDA) is None
    assert why_skip("pinned memory", CUDA) is None and why_skip("CUDA context", CUDA) is None


def test_an_h100_runs_every_check(monkeypatch):
    FakeGpu(monkeypatch, [PROFILES["h100"]])
    assert [name for name, *_ in CHECKS if why_skip(name, CUDA)] == []


def test_every_check_names_the_lessons_that_need_it():
    from helpers.fullscale import LESSONS

    lessons = set(LESSONS)
    for name, needed_by, fn, _ in CHECKS:
        assert needed_by and set(needed_by) <= lessons, name
        assert callable(fn)


def test_the_table_shows_every_check_and_counts_failures():
    result = PreflightResult("cuda:0", "Tesla T4", "scale=full ...")
    result.checks = [
        Check("budget cap", ("00",), "works", "capped"),
        Check("bf16", ("05",), "skipped", "only emulated"),
        Check("torch.compile", ("12",), "fails", "RuntimeError: no compiler"),
    ]
    result.lesson_minutes = {"00": 1.5, "06": 120.0}
    text = format_result(result)
    for name in ("budget cap", "bf16", "torch.compile", "00 1.5 min", "06 2.0 h"):
        assert name in text
    assert result.failed == [result.checks[2]] and "1 of 3 checks fail" in text


def test_the_snapshot_check_reads_back_what_the_allocator_recorded(monkeypatch):
    # The real check on a fake T4: torch's recording functions run above the fake binding;
    # the workload's tensors cannot exist without a GPU, so the fake allocator moves instead.
    from helpers import preflight

    gpu = FakeGpu(monkeypatch, [PROFILES["t4"]])

    def workload(d):
        gpu.allocate(4 * 1024 * 1024)
        gpu.free(4 * 1024 * 1024)

    monkeypatch.setattr(preflight, "_snapshot_workload", workload)
    result = preflight._memory_snapshot("cuda:0")
    assert result.startswith("snapshot with 4 allocator events"), result
    assert gpu.history is None  # recording is off again
