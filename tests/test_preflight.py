"""The preflight's decisions on fake cards, and its table. (``make test`` runs the real thing.)"""

import pytest
import torch

from helpers.course.preflight import CHECKS, Check, PreflightResult, format_result, why_skip
from tests.fake_gpu import PROFILES, FakeGpu

CUDA = torch.device("cuda", 0)


def test_a_cpu_skips_the_gpu_only_checks_and_runs_the_rest():
    cpu = torch.device("cpu")
    skipped = {name for name, *_ in CHECKS if why_skip(name, cpu)}
    gpu_only = {"fp8 (torchao)", "fused cross-entropy (Liger)", "two processes (DDP)"}
    assert (
        skipped
        == {"allocator view", "NVML view", "CUDA context", "tf32", "pinned memory"} | gpu_only
    )


@pytest.mark.parametrize("key", ["t4", "v100"])
def test_pre_ampere_cards_skip_bf16_and_tf32_and_say_why(monkeypatch, key):
    FakeGpu(monkeypatch, [PROFILES[key]])
    assert "only emulates bf16" in why_skip("bf16", CUDA)
    assert "8.0" in why_skip("tf32", CUDA)
    assert why_skip("fp16 + GradScaler", CUDA) is None
    assert why_skip("pinned memory", CUDA) is None and why_skip("CUDA context", CUDA) is None


@pytest.mark.parametrize(("key", "fp8"), [("a100-80", False), ("l4", True), ("h100", True)])
def test_fp8_is_tried_from_compute_capability_8_9(monkeypatch, key, fp8):
    FakeGpu(monkeypatch, [PROFILES[key]])
    assert (why_skip("fp8 (torchao)", CUDA) is None) == fp8
    assert why_skip("fused cross-entropy (Liger)", CUDA) is None
    assert why_skip("two processes (DDP)", CUDA) is None


def test_the_optional_packages_skip_with_how_to_install(monkeypatch):
    # On a GPU that could run them, a missing torchao or liger-kernel is a skip that says
    # what to install, not a failure (both are optional for the course).
    import importlib.util

    from helpers.course import preflight

    FakeGpu(monkeypatch, [PROFILES["h100"]])
    real = importlib.util.find_spec
    hide = lambda name, *a: None if name in ("torchao", "liger_kernel") else real(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", hide)
    assert preflight._fp8("cuda:0").startswith(
        "skipped: "
    ) and "pip install torchao" in preflight._fp8("cuda:0")
    assert (
        preflight._fused_loss("cuda:0")
        == "skipped: liger-kernel is not installed (pip install liger-kernel)"
    )


def test_an_h100_runs_every_check(monkeypatch):
    FakeGpu(monkeypatch, [PROFILES["h100"]])
    assert [name for name, *_ in CHECKS if why_skip(name, CUDA)] == []


def test_every_check_names_the_lessons_that_need_it():
    from helpers.course.fullscale import LESSONS

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
    result.lesson_device_minutes = {"00": 0.5, "06": 100.0}
    text = format_result(result)
    for name in ("budget cap", "bf16", "torch.compile", "00 1.5 min", "06 2.0 h",
                 "all lessons: about 2.0 h, 1.7 h of it the card's work"):  # fmt: skip
        assert name in text
    assert result.failed == [result.checks[2]] and "1 of 3 checks fail" in text


def test_the_snapshot_check_reads_back_what_the_allocator_recorded(monkeypatch):
    # The real check on a fake T4: torch's recording functions run above the fake binding;
    # the workload's tensors cannot exist without a GPU, so the fake allocator moves instead.
    from helpers.course import preflight

    gpu = FakeGpu(monkeypatch, [PROFILES["t4"]])

    def workload(d):
        gpu.allocate(4 * 1024 * 1024)
        gpu.free(4 * 1024 * 1024)

    monkeypatch.setattr(preflight, "_snapshot_workload", workload)
    result = preflight._memory_snapshot("cuda:0")
    assert result.startswith("snapshot with 4 allocator events"), result
    assert gpu.history is None  # recording is off again


def test_the_two_process_check_launches_ddp_and_says_where(monkeypatch):
    # The launch itself is driven by tests/test_beyond_one_gpu.py; here, what the check asks
    # for and what it reports (on a CPU it is skipped, so nothing else runs this function).
    from types import SimpleNamespace

    import helpers.lessons.beyond_one_gpu as lesson17
    from helpers.course import preflight

    asked = []

    def fake_launch(cfg):
        asked.append((cfg.strategy, cfg.launcher, cfg.world_size))
        return SimpleNamespace(ranks=[0, 1], wall_s=12.0)

    monkeypatch.setattr(lesson17, "launch", fake_launch)
    detail = preflight._two_processes("cpu")
    assert asked == [("ddp", "torchrun", 2)]
    assert detail == "2 DDP processes under torchrun, gloo on cpu, 12 s"


def test_checks_run_side_by_side_and_the_alone_ones_after(monkeypatch):
    import time
    from types import SimpleNamespace

    from helpers.course import preflight

    ended = {}

    def check(device, name="", pause=0.3):
        time.sleep(pause)
        ended[name] = time.monotonic()
        return f"{name} fine"

    def isolated(fn, device, timeout, daemon, **kwargs):
        return SimpleNamespace(error=None, value=fn(device, **kwargs))

    fakes = [(n, ("00",), check, {"name": n}) for n in ("a", "b", "NVML view", "c")]
    monkeypatch.setattr(preflight, "CHECKS", fakes)
    monkeypatch.setattr(preflight, "call_isolated", isolated)
    monkeypatch.setattr(preflight, "why_skip", lambda name, device: None)
    monkeypatch.setattr(preflight, "concurrency", lambda device_type, cores=None: 3)
    start = time.monotonic()
    result = preflight.run_preflight("cpu", throughput=False)
    assert [c.name for c in result.checks] == ["a", "b", "NVML view", "c"]  # the table's order
    assert all(c.status == "works" and c.detail == f"{c.name} fine" for c in result.checks)
    assert time.monotonic() - start < 4 * 0.3  # a, b and c at once, then the NVML view
    assert ended["NVML view"] > max(ended[n] for n in "abc")  # alone, after the others
    late = preflight.run_preflight("cpu", throughput=False, stop_at=time.monotonic() - 1)
    assert {c.status for c in late.checks} == {"skipped"}
    assert all("deadline" in c.detail for c in late.checks)
