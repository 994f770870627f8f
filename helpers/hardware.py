"""What machine the numbers come from: torch's view and, on NVIDIA GPUs, NVML's view."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class HardwareReport:
    """Device facts that decide which lessons' techniques apply here."""

    device: str
    name: str
    total_memory: int | None  # bytes; None on CPU (the lessons use a budget there instead)
    compute_capability: tuple[int, int] | None
    bf16: bool
    fp16: bool
    tf32: bool
    cpu_threads: int
    nvml: str  # one line: driver and device as NVML sees them, or why NVML is unavailable
    versions: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        """Plain dict for records and JSON."""
        return asdict(self)


def library_versions() -> dict[str, str]:
    """Versions of the libraries whose behaviour the numbers depend on."""
    from importlib.metadata import PackageNotFoundError, version

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


def nvml_summary(index: int = 0) -> str:
    """One line from NVML (what nvidia-smi reads); says why when there is no NVIDIA driver."""
    try:
        import pynvml
    except ImportError:
        return "NVML: nvidia-ml-py is not installed (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return f"NVML: no NVIDIA driver on this machine ({err})"
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        driver = pynvml.nvmlSystemGetDriverVersion()
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return f"NVML: {name}, driver {driver}, {mem.total / 1024**3:.1f} GiB"
    finally:
        pynvml.nvmlShutdown()


def nvml_used_bytes(device: torch.device | None = None) -> int | None:
    """Memory in use on the whole GPU as NVML sees it (CUDA context included); None without NVML."""
    if device is None or device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no package or no driver: the third memory view does not exist here
        return None
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        # NVML numbers devices physically; honour CUDA_VISIBLE_DEVICES when it is a plain list.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        ids = [v for v in visible.split(",") if v.strip().isdigit()]
        if ids and index < len(ids):
            index = int(ids[index])
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    finally:
        pynvml.nvmlShutdown()


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
    from helpers.scale import default_device

    device = device or default_device()
    threads = torch.get_num_threads()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        cc = (props.major, props.minor)
        return HardwareReport(
            device=str(device),
            name=props.name,
            total_memory=int(props.total_memory),
            compute_capability=cc,
            bf16=torch.cuda.is_bf16_supported(),
            fp16=True,
            tf32=cc >= (8, 0),  # tensor-float-32 tensor cores arrived with Ampere (sm_80)
            cpu_threads=threads,
            nvml=nvml_summary(device.index or 0),
            versions=library_versions(),
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
            nvml=nvml_summary(),
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
        nvml=nvml_summary(),
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
    if precision in ("bf16", "fp16"):
        if not getattr(report, precision):
            return (
                f"{precision} autocast is not supported on {report.name} ({report.device}): "
                "use --precision fp32 (or another device)"
            )
        return None
    return f"unknown precision {precision!r}: use fp32, tf32, bf16 or fp16"


def cuda_context_bytes() -> int | None:
    """Device memory the CUDA context itself takes, per NVML: used after init minus before.

    Run it in a fresh process (``helpers.isolate.call_isolated``): in a process that has
    already touched CUDA the context exists and the difference is meaningless. Other
    processes on the same GPU change NVML's number too, so run it on an idle GPU.
    """
    if not torch.cuda.is_available():
        return None
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA is already initialised here: call this in a fresh process")
    device = torch.device("cuda", 0)
    before = nvml_used_bytes(device)
    if before is None:
        return None
    torch.zeros(1, device=device)  # creating the first tensor creates the context
    torch.cuda.synchronize(device)
    return nvml_used_bytes(device) - before - torch.cuda.memory_reserved(device)
