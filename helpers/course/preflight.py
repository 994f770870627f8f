"""``python -m helpers preflight``: every hardware feature the lessons use, tried on this machine.

For a workshop host, before the workshop, on the room's hardware. Each feature is exercised
in a fresh process (a CUDA error or a crash in one cannot take the others down) and a table
says whether it works, was skipped (and why) or fails (with its one-line error), next to the
lessons that need it. It ends with a rough time per lesson at the full scale on this device:
the training FLOPs of each lesson's experiments (``helpers.course.fullscale``) over the training
throughput measured here, plus a few seconds per experiment for starting its process.

The checks are split in two: ``why_skip`` decides from the device's properties alone whether
a check can apply (tested on fake cards), and the check itself runs real work on the device.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import pickle
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from helpers import device as dev
from helpers.course.fullscale import lesson_experiments
from helpers.course.schedule import concurrency, run_at_once
from helpers.hardware import hardware_report
from helpers.isolate import call_isolated
from helpers.lessons import beyond_one_gpu
from helpers.lessons.deepspeed_zero import ZeroConfig, measure_zero
from helpers.lessons.mixed_precision import cpu_16bit_instructions
from helpers.lessons.more_memory import (
    big_vocab_config,
    fp8_problem,
    fp8_run,
    fused_loss_peak,
    fused_loss_skip,
)
from helpers.lessons.sdpa_flash_attention import attention_dtype, backend_problem
from helpers.lessons.torch_compile import reset_dynamo
from helpers.memory import memory_budget
from helpers.models import load_config
from helpers.names import GiB, MiB
from helpers.profiling import profile_step
from helpers.scale import FULL, TINY, fit_scale, get_scale
from helpers.timing import time_fn, train_flops
from helpers.train import RunConfig, Trainee

STARTUP_S = 5.0  # per experiment: a fresh process, the model built, the first steps' extra cost


@dataclass
class Check:
    """One feature tried on this machine."""

    name: str
    lessons: tuple[str, ...]
    status: str = "works"  # "works" | "skipped" | "fails"
    detail: str = ""
    seconds: float = 0.0


@dataclass
class PreflightResult:
    """All checks, and the rough full-scale time per lesson on this device."""

    device: str
    name: str
    scale: str  # what the lessons will run at here (Scale.describe)
    checks: list[Check] = field(default_factory=list)
    flops_per_s: float | None = None  # measured training throughput (fp32)
    lesson_minutes: dict[str, float] = field(default_factory=dict)
    # of each lesson's minutes, the card's work: training FLOPs / the throughput (the rest is
    # STARTUP_S per experiment, which processes side by side overlap and the card's work not)
    lesson_device_minutes: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> list[Check]:
        """Checks that fail (a skip is not a failure: it is what the lessons will also skip)."""
        return [c for c in self.checks if c.status == "fails"]


# --------------------------------------------------------------------------------------------
# When a check cannot apply: decided from the device alone


def why_skip(check: str, device: torch.device) -> str | None:
    """Why ``check`` does not apply on ``device`` (what the lessons skip there too), or None."""
    cuda = dev.is_cuda(device)
    if check in ("allocator view", "NVML view", "CUDA context") and not cuda:
        return f"{device.type}: no CUDA GPU (views 2 and 3 and the context exist on NVIDIA GPUs)"
    if check == "bf16" and cuda and not dev.bf16_native(device):
        cap = dev.gpu_info(device).capability
        return f"compute capability {cap[0]}.{cap[1]} only emulates bf16: the lessons use fp16"
    if check == "tf32" and not dev.tf32_capable(device):
        return "tf32 tensor cores need an NVIDIA GPU of compute capability 8.0 or newer"
    if check == "pinned memory" and not cuda:
        return f"{device.type}: nothing to pin memory for (no accelerator to copy to)"
    if check == "fp8 (torchao)" and (not cuda or dev.gpu_info(device).capability < (8, 9)):
        return "fp8 matmuls need an NVIDIA GPU of compute capability 8.9 or newer"
    if check == "fused cross-entropy (Liger)" and not cuda:
        return "Liger Kernel's fused loss is a Triton kernel for CUDA GPUs"
    if check == "two processes (DDP)" and not cuda:
        return (
            f"{device.type}: lesson 17 runs its processes on the CPU over gloo, as "
            "tests/test_beyond_one_gpu.py does; this check is for GPU hosts (NCCL)"
        )
    return None


# --------------------------------------------------------------------------------------------
# The checks (each runs in a fresh process; returns a one-line detail or raises)


def _budget_cap(device: str) -> str:
    d = dev.resolve(device)
    budget = 2 * GiB if dev.is_cuda(d) else 64 * MiB
    with memory_budget(budget, device=d) as capped:
        torch.empty(budget // 16, device=d)  # a quarter of the budget: fits
        try:
            torch.empty(budget // 2, device=d)  # twice the budget, in fp32 numbers
        except torch.OutOfMemoryError:
            pass
        else:
            raise RuntimeError("an allocation twice the budget did not raise OutOfMemoryError")
    if dev.is_cuda(d):
        return (
            f"allocator capped at {capped.allocator_limit / GiB:.2f} GiB of a 2 GiB budget "
            f"({capped.describe_context()})"
        )
    return "the tracker raised OutOfMemoryError past a 64 MiB budget"


def _allocator_view(device: str) -> str:
    d = dev.resolve(device)
    x = torch.empty(256 * MiB // 4, device=d)
    stats = dev.allocator_stats(d)
    del x
    if stats.allocated < 256 * MiB or stats.reserved < stats.allocated:
        raise RuntimeError(f"allocator stats off: {stats}")
    return f"allocated {stats.allocated / MiB:.0f} MiB, reserved {stats.reserved / MiB:.0f} MiB"


def _nvml_view(device: str) -> str:
    d = dev.resolve(device)
    summary = dev.nvml_summary(d)
    if summary.startswith("NVML view unavailable"):
        return f"skipped: {summary.removeprefix('NVML view unavailable: ')}"
    torch.empty(1, device=d)
    used = dev.nvml_used_bytes(d)
    return f"{summary}; {used / MiB:.0f} MiB in use" if used else summary


def _cuda_context(device: str) -> str:
    context = dev.cuda_context_bytes()
    if context is None:
        return "skipped: NVML cannot read device memory here, so the context cannot be measured"
    return f"{context / MiB:.0f} MiB before the first tensor"


def _snapshot_workload(d: torch.device) -> None:
    """A few allocations and frees for the snapshot check to record."""
    x = torch.ones(1024, 1024, device=d) * 2
    del x


def _memory_snapshot(device: str) -> str:
    d = dev.resolve(device)
    ok, why = dev.memory_snapshot_supported(d)
    if not ok:
        return why  # "skipped: needs a CUDA GPU ..."
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "snapshot.pickle"
        with dev.record_memory_history(d, path):
            _snapshot_workload(d)
        traces = pickle.loads(path.read_bytes()).get("device_traces", [])
        actions = sum(len(t) for t in traces)
        if not actions:
            raise RuntimeError("the snapshot recorded no allocation")
        return f"snapshot with {actions} allocator events, {path.stat().st_size / 1024:.0f} KiB"


def _profiler_trace(device: str) -> str:
    trainee = Trainee(RunConfig(device=device))
    with tempfile.TemporaryDirectory() as folder:
        result = profile_step(trainee.step, trainee.device, Path(folder) / "step.json")
    track = result.memory.get(result.device)
    if track is None or not track.events:
        raise RuntimeError("the trace has no memory events")
    return f"{result.n_events} trace events, {track.events} memory events"


def _train_steps(device: str, precision: str, optimizer: str = "adamw", steps: int = 3) -> float:
    trainee = Trainee(RunConfig(precision=precision, optimizer=optimizer, device=device))
    trainee.step()
    start = time.perf_counter()
    losses = [trainee.step() for _ in range(steps)]
    dev.synchronize(trainee.device)
    if not all(torch.isfinite(torch.tensor(losses))):
        raise RuntimeError(f"non-finite losses {losses}")
    return (time.perf_counter() - start) / steps


def _fp16(device: str) -> str:
    seconds = _train_steps(device, "fp16")
    return f"bert-tiny steps with autocast fp16 and GradScaler, {1e3 * seconds:.1f} ms each"


def _bf16(device: str) -> str:
    d = dev.resolve(device)
    note = ""
    if d.type == "cpu":
        flags = cpu_16bit_instructions()
        if flags and not flags["bf16"]:
            note = " (this CPU has no bf16 instructions: slower than fp32)"
    return (
        f"bert-tiny steps in bf16 autocast, {1e3 * _train_steps(device, 'bf16'):.1f} ms each{note}"
    )


def _tf32(device: str) -> str:
    d = dev.resolve(device)
    a, b = torch.randn(4096, 4096, device=d), torch.randn(4096, 4096, device=d)
    times = {}
    for mode in (False, True):
        dev.set_tf32(mode)
        times[mode] = time_fn(lambda: a @ b, d, warmup=2, repeats=5).median
    dev.set_tf32(None)
    return f"fp32 matmul {times[False] / times[True]:.1f}x faster with tf32"


def _sdpa(device: str, backend: str) -> str:
    d = dev.resolve(device)
    dtype = attention_dtype(d)
    problem = backend_problem(backend, d, dtype)
    if problem:
        return f"skipped: refused for {str(dtype).removeprefix('torch.')}: {problem}"
    return f"forward and backward in {str(dtype).removeprefix('torch.')}"


def _adamw8bit(device: str) -> str:
    if importlib.util.find_spec("bitsandbytes") is None:
        return "skipped: bitsandbytes is not installed (pip install bitsandbytes)"
    # Its CPU backend warns about an optional 4-bit kernel package the course does not use.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    seconds = _train_steps(device, "fp32", "adamw8bit")
    return f"bert-tiny steps with 8-bit AdamW, {1e3 * seconds:.1f} ms each"


def _deepspeed(device: str) -> str:
    if importlib.util.find_spec("deepspeed") is None:
        return "skipped: deepspeed is not installed (pip install deepspeed)"

    # The smallest ZeRO-3 config with both offloads (lesson 08's zero_config writes the full
    # one); a torch AdamW steps the offloaded state, so nothing is compiled.
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    ds_config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero,
                 "zero_force_ds_cpu_optimizer": False}  # fmt: skip
    spec = ZeroConfig("llama-tiny", ds_config, batch_size=4, warmup=1, repeats=1, device=device)
    rec = measure_zero(spec)
    return f"ZeRO-3 with parameter and optimizer offload to the CPU: {rec.step_time:.2f} s per step"


def _compile(device: str) -> str:
    d = dev.resolve(device)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    net = net.to(d)
    x = torch.randn(32, 64, device=d)
    start = time.perf_counter()
    compiled = torch.compile(net, backend="inductor")
    out = compiled(x)
    dev.synchronize(d)
    first = time.perf_counter() - start
    if not torch.allclose(out, net(x), rtol=1e-4, atol=1e-5):
        raise RuntimeError("the compiled module's output differs from eager")
    reset_dynamo()
    return f"inductor compiled an MLP in {first:.1f} s; output allclose to eager"


def _dataloader(device: str, pin: bool = False) -> str:
    d = dev.resolve(device)
    data = TensorDataset(torch.randn(64, 16), torch.randint(0, 2, (64,)))
    loader = DataLoader(data, batch_size=8, num_workers=2, pin_memory=pin)
    batches = [(x.to(d, non_blocking=pin), y) for x, y in loader]
    pinned = pin and all(x.is_pinned() for x, _ in DataLoader(data, batch_size=8, pin_memory=True))
    return f"{len(batches)} batches from 2 worker processes" + (", pinned" if pinned else "")


def _throughput(device: str) -> dict:
    """Training FLOP/s of the full scale's encoder here (fp32, counted FLOPs / measured time)."""
    d = dev.resolve(device)
    model, detail = FULL.encoder, FULL.encoder
    if not dev.is_cuda(d):
        # On a CPU: the encoder's width (its matmul shapes) with 4 of its 24 layers, at b1 s64.
        # All 24 took 27 s of a 48 s preflight to build and step. Timed interleaved against
        # them on a 2-core EPYC, 4 layers ran at 41-50 GFLOP/s and 24 at 31-36 (more of the
        # 5 GB of AdamW state streamed per step), so CPU estimates err ~1.3x on the short side.
        config = load_config(FULL.encoder).to_dict()
        model, detail = {**config, "num_hidden_layers": 4}, f"{FULL.encoder}'s width, 4 layers"
    batch, seq = (FULL.batch_size, FULL.seq_len) if dev.is_cuda(d) else (1, 64)
    trainee = Trainee(RunConfig(model=model, batch_size=batch, seq_len=seq, device=device))
    flops = train_flops(trainee.step)
    timing = time_fn(trainee.step, d, warmup=1, repeats=3)
    return {"flops_per_s": flops / timing.median, "detail": f"{detail} b{batch} s{seq}"}


def _fp8(device: str) -> str:
    d = dev.resolve(device)
    problem = fp8_problem(d)
    if problem:
        return f"skipped: {problem}"
    cfg = RunConfig(model="llama-tiny", attn="sdpa", precision="bf16", device=device, flops=False)
    run = fp8_run(cfg, True, steps=3)
    return f"llama-tiny, float8 Linear layers in bf16 autocast: loss {run.losses[-1]:.3f}"


def _fused_loss(device: str) -> str:
    d = dev.resolve(device)
    skip = fused_loss_skip(d)
    if skip:
        return f"skipped: {skip}"
    peak = fused_loss_peak(RunConfig(model=big_vocab_config(), batch_size=2, device=device))
    return f"a 128k-vocabulary step with the fused loss: {peak / MiB:.0f} MiB allocated at most"


def _two_processes(device: str) -> str:
    cfg, placement = beyond_one_gpu.lesson_config(TINY)
    # beyond_one_gpu.launch, read at the call: tests/test_preflight.py stands a fake in.
    result = beyond_one_gpu.launch(replace(cfg, strategy="ddp", launcher="torchrun"))
    where = f"{placement.backend} on {placement.device.type}"
    return f"{len(result.ranks)} DDP processes under torchrun, {where}, {result.wall_s:.0f} s"


# The checks, the lessons that need them, and the function that tries each.
CHECKS: list[tuple[str, tuple[str, ...], object, dict]] = [
    ("budget cap", ("00", "02", "08", "14"), _budget_cap, {}),
    ("allocator view", ("00", "02", "08", "10", "14"), _allocator_view, {}),
    ("NVML view", ("00", "08", "11", "14"), _nvml_view, {}),
    ("CUDA context", ("00",), _cuda_context, {}),
    ("fp16 + GradScaler", ("01", "05", "07", "14", "15"), _fp16, {}),
    ("bf16", ("01", "05", "07", "10", "14", "15"), _bf16, {}),
    ("tf32", ("05",), _tf32, {}),
    *(
        (f"SDPA {b}", ("10",), _sdpa, {"backend": f"sdpa-{b}"})
        for b in ("math", "efficient", "flash", "cudnn")
    ),
    ("8-bit AdamW", ("06", "07", "14", "15"), _adamw8bit, {}),
    ("profiler trace", ("15",), _profiler_trace, {}),
    ("CUDA memory snapshot", ("15",), _memory_snapshot, {}),
    ("DeepSpeed CPU offload", ("08",), _deepspeed, {}),
    ("torch.compile", ("12",), _compile, {}),
    ("DataLoader workers", ("11",), _dataloader, {}),
    ("pinned memory", ("11",), _dataloader, {"pin": True}),
    ("fp8 (torchao)", ("16",), _fp8, {}),
    ("fused cross-entropy (Liger)", ("16",), _fused_loss, {}),
    ("two processes (DDP)", ("17",), _two_processes, {}),
]
NEEDS_OWN_PROCESSES = {"DataLoader workers", "pinned memory", "DeepSpeed CPU offload",
                       "two processes (DDP)"}  # fmt: skip


# Checks that read the whole device (NVML, the CUDA context) or time one thing against another
# (tf32 against fp32) run alone, after the others have run side by side.
ALONE = {"NVML view", "CUDA context", "tf32"}


def run_preflight(
    device: str | torch.device | None = None,
    timeout: float = 300,
    names: tuple[str, ...] | None = None,
    stop_at: float | None = None,
    throughput: bool = True,
) -> PreflightResult:
    """Every check in a fresh process, side by side (``helpers.course.schedule``; those in
    ``ALONE`` after the others, one at a time), then the rough full-scale time per lesson.

    ``names``: only these checks (None: all). ``stop_at``: a ``time.monotonic()`` moment after
    which no check starts; those left are "skipped" with the reason (``make gpu-check``'s
    deadline). ``throughput=False`` leaves out the throughput and the minutes per lesson.
    """
    d = dev.resolve(device)
    report = hardware_report(d)
    result = PreflightResult(str(d), report.name, get_scale(device=d).describe(d))
    chosen = {name: (lessons, fn, kwargs) for name, lessons, fn, kwargs in CHECKS
              if names is None or name in names}  # fmt: skip
    checks = {name: Check(name, lessons) for name, (lessons, _, _) in chosen.items()}
    run = [name for name in chosen if not _skipped(checks[name], d)]

    def one(name: str) -> Check:
        _, fn, kwargs = chosen[name]
        _run_check(checks[name], fn, kwargs, str(d), timeout)
        return checks[name]

    left = (lambda: stop_at - time.monotonic()) if stop_at is not None else (lambda: math.inf)
    slots = concurrency("cuda" if dev.is_cuda(d) else "cpu")
    first = run_at_once([n for n in run if n not in ALONE], one, slots, left=left)
    then = run_at_once([n for n in run if n in ALONE], one, 1, left=left)
    for name in {**first.not_started, **then.not_started}:
        checks[name].status = "skipped"
        checks[name].detail = "not started: the run's deadline was near"
    result.checks = list(checks.values())  # in CHECKS' order
    if not throughput:
        return result
    out = call_isolated(_throughput, str(d), timeout=timeout)
    if out.error:
        result.checks.append(Check("training throughput", (), "fails", out.error))
        return result
    result.flops_per_s = out.value["flops_per_s"]
    speed = f"{out.value['detail']}: {result.flops_per_s / 1e12:.3g} TFLOP/s fp32"
    result.checks.append(Check("training throughput", ("all",), "works", speed))
    if dev.is_cuda(d):
        scale, card = fit_scale(dev.gpu_info(d)), dev.gpu_info(d)
    else:  # what the full scale would take on this CPU
        scale, card = FULL, dev.GpuInfo(report.name, 0, (0, 0), 0, "")
    if scale.name == "full":
        result.lesson_minutes, result.lesson_device_minutes = lesson_minutes(
            scale, card, result.flops_per_s
        )
    return result


def lesson_minutes(scale, card, flops_per_s: float) -> tuple[dict, dict]:
    """Rough minutes per lesson at ``scale`` on ``card`` (``fullscale.lesson_experiments``),
    and of those the card's work: each experiment's training FLOPs over ``flops_per_s``, plus
    ``STARTUP_S`` for its process, its model and its first steps."""
    minutes: dict[str, float] = {}
    device: dict[str, float] = {}
    for x in lesson_experiments(scale, card):
        device_s = x.flops / flops_per_s
        minutes[x.lesson] = minutes.get(x.lesson, 0.0) + (device_s + STARTUP_S) / 60
        device[x.lesson] = device.get(x.lesson, 0.0) + device_s / 60
    return minutes, device


def _skipped(check: Check, device: torch.device) -> bool:
    """Mark ``check`` skipped when it does not apply on ``device`` (``why_skip``)."""
    skip = why_skip(check.name, device)
    if skip:
        check.status, check.detail = "skipped", skip
    return bool(skip)


def _run_check(check: Check, fn, kwargs: dict, device: str, timeout: float) -> None:
    """Run one check in a fresh process; its status, detail and seconds into ``check``."""
    start = time.perf_counter()
    out = call_isolated(fn, device, timeout=timeout, daemon=check.name not in NEEDS_OWN_PROCESSES,
                        **kwargs)  # fmt: skip
    check.seconds = time.perf_counter() - start
    if out.error:
        check.status, check.detail = "fails", out.error
    elif out.value.startswith("skipped: "):
        check.status, check.detail = "skipped", out.value.removeprefix("skipped: ")
    else:
        check.detail = out.value


def format_result(result: PreflightResult) -> str:
    """The table a host reads: one line per check, then the time per lesson."""
    width = max(len(c.name) for c in result.checks)
    lines = [f"preflight on {result.device} ({result.name})", result.scale, ""]
    lines.append(f"{'feature':<{width}}  {'status':<8} {'lessons':<15} detail")
    for c in result.checks:
        lessons = " ".join(c.lessons)
        lines.append(f"{c.name:<{width}}  {c.status:<8} {lessons:<15} {c.detail}")
    if result.lesson_minutes:
        lines += ["", "rough time per lesson at the full scale here (training FLOPs / the "
                  "throughput above, + 5 s per experiment):"]  # fmt: skip
        lines.append(
            "  " + ", ".join(f"{k} {_minutes(v)}" for k, v in result.lesson_minutes.items())
        )
        total, card = (
            sum(result.lesson_minutes.values()),
            sum(result.lesson_device_minutes.values()),
        )
        lines.append(
            f"  all lessons: about {_minutes(total)}, {_minutes(card)} of it the card's work"
        )
    failed = result.failed
    lines.append("")
    lines.append(
        f"{len(failed)} of {len(result.checks)} checks fail: see above"
        if failed
        else "no check fails (skipped ones are skipped by the lessons too, as said)"
    )
    return "\n".join(lines)


def _minutes(value: float) -> str:
    return f"{value:.1f} min" if value < 90 else f"{value / 60:.1f} h"
