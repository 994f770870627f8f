"""What machine the numbers come from: torch's view and, on NVIDIA GPUs, NVML's view.

The GPU questions themselves are asked in ``helpers.device``; this module turns the answers
into a report and into sentences a learner can act on.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version

import torch

from helpers import device as dev
from helpers.names import AUTOCAST

# Cards the course is checked against, as torch reports them (memory is what the driver leaves
# to processes, a little under the nominal size). tests/fake_gpu.py fakes these cards.
REFERENCE_CARDS = {
    "t4": dev.GpuInfo("Tesla T4", 15_828_320_256, (7, 5), 40, ""),
    "v100": dev.GpuInfo("Tesla V100-SXM2-16GB", 16_935_419_904, (7, 0), 80, ""),
    "a10g": dev.GpuInfo("NVIDIA A10G", 23_609_475_072, (8, 6), 80, ""),
    "l4": dev.GpuInfo("NVIDIA L4", 23_580_639_232, (8, 9), 58, ""),
    "a100-40": dev.GpuInfo("NVIDIA A100-SXM4-40GB", 42_505_273_344, (8, 0), 108, ""),
    "a100-80": dev.GpuInfo("NVIDIA A100-SXM4-80GB", 85_089_058_816, (8, 0), 108, ""),
    "h100": dev.GpuInfo("NVIDIA H100 80GB HBM3", 85_045_870_592, (9, 0), 132, ""),
    "a100-mig": dev.GpuInfo("NVIDIA A100-SXM4-80GB MIG 1g.10gb", 10_468_982_784, (8, 0), 14, ""),
}


@dataclass
class HardwareReport:
    """Device facts that decide which lessons' techniques apply here."""

    device: str
    name: str
    total_memory: int | None  # bytes; None on CPU (the lessons use a budget there instead)
    compute_capability: tuple[int, int] | None
    bf16: bool  # bf16 arithmetic in hardware (an emulated bf16 is slower than fp32: False)
    fp16: bool
    tf32: bool
    cpu_threads: int
    nvml: str  # one line: driver and device as NVML sees them, or why NVML is unavailable
    versions: dict[str, str] = field(default_factory=dict)
    multiprocessors: int | None = None  # SMs of a CUDA device (a MIG slice has a share)
    mig: bool = False  # a MIG slice of an A100/H100 rather than a whole GPU

    def as_dict(self) -> dict:
        """Plain dict for records and JSON."""
        return asdict(self)


def library_versions() -> dict[str, str]:
    """Versions of the libraries whose behaviour the numbers depend on."""
    names = ["torch", "transformers", "accelerate", "datasets", "peft", "bitsandbytes", "deepspeed"]
    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    return out


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_supports(dtype: torch.dtype) -> bool:
    """Whether autocast to ``dtype`` runs a matmul on this CPU (checked, not assumed)."""
    try:
        with torch.autocast("cpu", dtype=dtype):
            out = torch.ones(8, 8) @ torch.ones(8, 8)
        return out.dtype == dtype
    except Exception:  # an old build without CPU autocast for this dtype
        return False


def hardware_report(device: torch.device | None = None) -> HardwareReport:
    """Name, memory, compute capability and 16-bit / tf32 support of ``device``."""
    device = dev.resolve(device)
    threads = torch.get_num_threads()
    if dev.is_cuda(device):
        info = dev.gpu_info(device)
        return HardwareReport(
            device=str(device),
            name=info.name,
            total_memory=info.total_memory,
            compute_capability=info.capability,
            bf16=dev.bf16_native(device),  # native only: emulated bf16 is slower than fp32
            fp16=True,
            tf32=dev.tf32_capable(device),  # tf32 tensor cores arrived with Ampere (sm_80)
            cpu_threads=threads,
            nvml=dev.nvml_summary(device),
            versions=library_versions(),
            multiprocessors=info.multiprocessors,
            mig=info.mig,
        )
    if device.type == "cpu":
        return HardwareReport(
            device="cpu",
            name=cpu_name(),
            total_memory=None,
            compute_capability=None,
            bf16=cpu_supports(torch.bfloat16),
            fp16=cpu_supports(torch.float16),
            tf32=False,  # tf32 is an NVIDIA tensor-core format
            cpu_threads=threads,
            nvml=dev.nvml_summary(device),
            versions=library_versions(),
        )
    # Other accelerators (mps, xpu, ...): report what torch can tell, claim nothing else.
    return HardwareReport(
        device=str(device),
        name=device.type,
        total_memory=None,
        compute_capability=None,
        bf16=False,
        fp16=True,
        tf32=False,
        cpu_threads=threads,
        nvml=dev.nvml_summary(device),
        versions=library_versions(),
    )


def precision_problem(precision: str, device: torch.device) -> str | None:
    """Why ``precision`` cannot run on ``device`` (a sentence a learner can act on), or None."""
    if precision == "fp32":
        return None
    report = hardware_report(device)
    if precision == "tf32":
        if not report.tf32:
            return (
                f"tf32 needs an NVIDIA GPU of compute capability 8.0 or newer; {report.name} "
                f"({report.device}) has none: use --precision fp32 or bf16"
            )
        return None
    if precision == "bf16" and report.compute_capability and not report.bf16:
        return (
            f"bf16 needs compute capability 8.0 (Ampere) or newer; {report.name} has "
            f"{report.compute_capability[0]}.{report.compute_capability[1]} and would only "
            "emulate it, slower than fp32: use --precision fp16 (with loss scaling) instead"
        )
    if precision in AUTOCAST:
        if not getattr(report, precision):
            return (
                f"{precision} autocast is not supported on {report.name} ({report.device}): "
                "use --precision fp32 (or another device)"
            )
        return None
    return f"unknown precision {precision!r}: use fp32, tf32, bf16 or fp16"


# -------------------------------------------------------------------------------------------
# Other processes' CPU use: a claim about overlapping work needs the cores it assumes free.


def _busy_ticks(cpus: set[int]) -> int | None:
    """Busy clock ticks of ``cpus`` so far (user, nice, system, irq, softirq, steal), or None."""
    try:
        lines = open("/proc/stat").read().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
            total += user + nice + system + irq + softirq + steal
    return total


def _tree_ticks(root: int) -> tuple[int, int]:
    """CPU ticks of process ``root`` and its descendants, reaped children's included; and
    how many processes that tree has."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                text = open(f"/proc/{entry}/stat").read()
            except OSError:  # gone meanwhile
                continue
            fields = text[text.rindex(")") + 2 :].split()  # after "pid (name) "
            stats[int(entry)] = (int(fields[1]), sum(map(int, fields[11:15])))  # ppid, times
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, count, todo = 0, 0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0))[1]
        count += 1
        todo += children.get(pid, [])
    return total, count


class OtherLoad:
    """Cores' worth of CPU that processes other than this one and its children used while the
    ``with`` block ran (``cores``; Linux's /proc only, else None). Steal time counts as others'.

    The kernel counts CPU time in clock ticks (10 ms each, typically), for every CPU and every
    process: each count can be a tick short or over. Those ticks are taken off what others
    used, so a block shorter than a few ticks reads as quiet rather than as busy by accident.
    """

    def __init__(self) -> None:
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self.cores: float | None = None

    def __enter__(self) -> OtherLoad:
        self._busy, self._start = _busy_ticks(self.cpus), time.perf_counter()
        self._own = _tree_ticks(os.getpid())[0] if self._busy is not None else 0
        return self

    def __exit__(self, *exc) -> None:
        busy = _busy_ticks(self.cpus)
        if busy is None or self._busy is None:
            return
        wall = time.perf_counter() - self._start
        own, processes = _tree_ticks(os.getpid())
        resolution = len(self.cpus) + processes  # a tick of rounding per counter
        others = max(0, busy - self._busy - (own - self._own) - resolution)
        self.cores = others / os.sysconf("SC_CLK_TCK") / wall if wall > 0 else None
