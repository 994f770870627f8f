"""The course's one home for ``torch.cuda``, ``torch.accelerator`` and NVML.

Every question the course asks a device goes through here: which device to use, what the
card is (name, memory, compute capability, MIG slice or not), which number formats it runs
natively, what the caching allocator holds, how to cap it, and what NVML (nvidia-smi's
library) sees. Keeping the GPU surface in one module means it can be read in one sitting and
faked in one place: ``tests/fake_gpu.py`` replaces torch's CUDA primitives and NVML beneath
this module with profiles of real cards, so torch's own Python-level checks run in the tests
just as they do on a real GPU.

Devices handed around the course carry an index (``cuda:0``, not ``cuda``): several of
torch's CUDA functions (``set_per_process_memory_fraction`` among them) reject a device
without one.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from helpers.names import GiB, MiB

DEVICE_ENV = "COURSE_DEVICE"  # cpu | cuda | cuda:1 | mps ... (default: the accelerator, else cpu)
ALLOCATION_UNIT = 512  # bytes: the CUDA caching allocator rounds every block up to a multiple
# A CUDA context is typically 300-600 MiB (driver state, kernels loaded lazily). Where this
# process's own share cannot be read from NVML, the budget cap assumes this much.
ASSUMED_CONTEXT = 512 * MiB
# What the caching allocator reserves beyond the live tensors at a step's peak (fragmentation,
# cached blocks, cuBLAS/cuDNN workspaces), as a share of the tensors: kept free when planning.
RESERVE_MARGIN = 0.10


# --------------------------------------------------------------------------------------------
# Which device


def default_device() -> torch.device:
    """$COURSE_DEVICE if set, else the accelerator, else the CPU; accelerators carry an index."""
    name = os.environ.get(DEVICE_ENV, "").strip()
    if name:
        return resolve(name)
    if torch.accelerator.is_available():
        return resolve(torch.accelerator.current_accelerator())
    return torch.device("cpu")


def resolve(device: str | torch.device | None = None) -> torch.device:
    """``device`` as a ``torch.device`` with an index (None: ``default_device()``).

    An index-less accelerator gets the current device's index. For CUDA that is read only if
    CUDA is already initialised here; a process that has not initialised CUDA is on device 0
    (CUDA's default), so asking would create a CUDA context for nothing.
    """
    if device is None:
        return default_device()
    dev = torch.device(device)
    if dev.type in ("cpu", "meta"):  # one host: "cpu:0" (accelerate's name for it) is "cpu"
        return torch.device(dev.type)
    if dev.index is not None:
        return dev
    if dev.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device() if cuda_initialized() else 0)
    return torch.device(dev.type, torch.accelerator.current_device_index())


def is_cuda(device: str | torch.device | None) -> bool:
    """True for an NVIDIA (or ROCm) GPU device."""
    return device is not None and torch.device(device).type == "cuda"


def cuda_available() -> bool:
    """Whether this process can use a CUDA GPU."""
    return torch.cuda.is_available()


def cuda_initialized() -> bool:
    """Whether this process has initialised CUDA (a forked child could not use it then)."""
    return torch.cuda.is_initialized()


def forked_after_cuda() -> bool:
    """Whether this process was forked from one that had initialised CUDA: CUDA fails here then.

    torch marks such a child itself (``torch.cuda._is_in_bad_fork``, private: read here only).
    """
    return bool(torch.cuda._is_in_bad_fork())


FORKED_AFTER_CUDA = (
    "CUDA cannot work in this experiment's process: it was forked from a fork server that had "
    "initialised CUDA, because a module the server imported asked the GPU about itself. "
    "helpers.forkserver.PRELOAD_CUDA lists what the server imports on a GPU; an installed "
    "package that initialises CUDA on import is the usual cause. Restart the kernel, or set "
    "COURSE_NO_FORKSERVER=1 to start every experiment with spawn (slower) and report it."
)


def present(device: torch.device) -> bool:
    """True when ``device`` exists on this machine (the CPU always does)."""
    if device.type == "cpu":
        return True
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is None or acc.type != device.type:
        return False
    return device.index is None or device.index < torch.accelerator.device_count()


def set_current(device: torch.device) -> None:
    """Make ``device`` the current CUDA device (libraries such as DeepSpeed use the current one)."""
    if is_cuda(device):
        torch.cuda.set_device(resolve(device))


# --------------------------------------------------------------------------------------------
# What the card is


@dataclass(frozen=True)
class GpuInfo:
    """A CUDA device as torch reports it."""

    name: str  # e.g. "NVIDIA H100 80GB HBM3"; a MIG slice adds " MIG 1g.10gb"
    total_memory: int  # bytes the driver lets processes use (less than the marketing figure)
    capability: tuple[int, int]
    multiprocessors: int
    uuid: str  # as torch prints it: 8-4-4-4-12 hex digits, without NVML's "GPU-" prefix

    @property
    def mig(self) -> bool:
        """True for a MIG slice (a partition of an A100/H100 with its own memory and SMs)."""
        return " MIG " in f"{self.name} "


def gpu_info(device: torch.device) -> GpuInfo:
    """Name, memory, compute capability, SM count and UUID of a CUDA device."""
    props = torch.cuda.get_device_properties(resolve(device))
    return GpuInfo(
        name=props.name,
        total_memory=int(props.total_memory),
        capability=(props.major, props.minor),
        multiprocessors=int(props.multi_processor_count),
        uuid=str(props.uuid),
    )


def cudnn_version() -> str:
    """cuDNN's version as torch reports it (e.g. "91900"), or "none" without cuDNN."""
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return str(version) if version else "none"


def bf16_native(device: torch.device) -> bool:
    """bf16 arithmetic in hardware: compute capability 8.0 (Ampere) or newer.

    Not ``torch.cuda.is_bf16_supported()``: by default it also answers True where bf16 is
    only emulated (a T4 or V100 can store bf16 tensors, but its tensor cores cannot multiply
    them), which is slower than fp32, not faster. It also asks about the *current* device,
    not the one given.
    """
    return is_cuda(device) and gpu_info(device).capability >= (8, 0)


def tf32_capable(device: torch.device) -> bool:
    """tf32 tensor cores: compute capability 8.0 (Ampere) or newer."""
    return is_cuda(device) and gpu_info(device).capability >= (8, 0)


# --------------------------------------------------------------------------------------------
# TF32, with PyTorch's fp32_precision API (2.9+). The legacy ``allow_tf32`` flags and
# ``set_float32_matmul_precision`` must not be mixed with it: reading a legacy flag after the
# new API was used raises, and an explicit setting from either API on cuda.matmul shadows the
# global ``torch.backends.fp32_precision`` that transformers' ``enable_tf32`` sets.


def set_tf32(enabled: bool | None) -> None:
    """tf32 for CUDA matmuls and cuDNN convolutions: True, False, or None (inherit the global)."""
    mode = {True: "tf32", False: "ieee", None: "none"}[enabled]
    torch.backends.cuda.matmul.fp32_precision = mode
    torch.backends.cudnn.conv.fp32_precision = mode


def tf32_matmul() -> str:
    """The fp32 precision CUDA matmuls run at now: "tf32" or "ieee" (resolving inheritance)."""
    mode = torch.backends.cuda.matmul.fp32_precision
    if mode == "none":
        mode = torch.backends.fp32_precision
    return "tf32" if mode == "tf32" else "ieee"


# --------------------------------------------------------------------------------------------
# The caching allocator (memory view 2)


def synchronize(device: torch.device) -> None:
    """Wait until the device has finished the queued work (a no-op on the CPU)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(resolve(device))


def empty_cache(device: torch.device) -> None:
    """Give the allocator's cached, unused blocks back to the driver (accelerators only)."""
    if device.type != "cpu":
        torch.accelerator.empty_cache()


def release_cached(device: torch.device) -> None:
    """Collect dead tensors and hand the allocator's cached blocks back to the driver.

    A notebook calls it after freeing its own GPU tensors, before experiments that run in
    other processes: memory cached here is not free for them.
    """
    gc.collect()
    empty_cache(device)


def reset_peak_stats(device: torch.device) -> None:
    """Start the allocator's peak counters again from the current usage."""
    if device.type != "cpu":
        torch.accelerator.reset_peak_memory_stats(resolve(device))


@dataclass(frozen=True)
class AllocatorStats:
    """The caching allocator's bytes: now, and the peaks since the last reset."""

    allocated: int  # bytes in live tensors
    reserved: int  # bytes held from the driver, cached free blocks included
    max_allocated: int
    max_reserved: int


def allocator_stats(device: torch.device) -> AllocatorStats | None:
    """The allocator's current and peak bytes; None on the CPU (no caching allocator)."""
    if device.type == "cpu":
        return None
    dev = resolve(device)
    return AllocatorStats(
        allocated=int(torch.accelerator.memory_allocated(dev)),
        reserved=int(torch.accelerator.memory_reserved(dev)),
        max_allocated=int(torch.accelerator.max_memory_allocated(dev)),
        max_reserved=int(torch.accelerator.max_memory_reserved(dev)),
    )


def allocation_bytes(nbytes: int, device_type: str) -> int:
    """Bytes a tensor of ``nbytes`` occupies: on CUDA rounded up to the allocator's 512 B."""
    if device_type != "cuda":
        return nbytes
    return -(-nbytes // ALLOCATION_UNIT) * ALLOCATION_UNIT


@dataclass(frozen=True)
class Cap:
    """What a budget cap on the CUDA allocator set, and what it leaves out."""

    budget: int  # the budget asked for: the whole card's memory, CUDA context included
    context: int  # bytes set aside for this process's CUDA context
    context_source: str  # "NVML" (measured) or "assumed"
    allocator_limit: int  # what the caching allocator may reserve: budget - context
    fraction: float  # the same as a fraction of the card's total memory
    clamped: bool  # the budget was larger than the card: the limit is the whole card
    context_why: str = ""  # why the context was assumed, not measured (empty when measured)

    def describe_context(self) -> str:
        """The context and where its size came from, e.g. "context 512 MiB, assumed: ..."."""
        why = f": {self.context_why}" if self.context_why else ""
        return f"context {self.context / MiB:.0f} MiB, {self.context_source}{why}"


def cap_allocator(device: torch.device, budget: int) -> Cap:
    """Cap the caching allocator so that context + reserved memory stays within ``budget``.

    The cap (``set_per_process_memory_fraction``) limits what the allocator reserves:
    tensors, cached free blocks, fragmentation and cuBLAS/cuDNN workspaces (they are
    allocated through it, as they would be on the smaller card). It cannot see the CUDA
    context, which a real card of ``budget`` bytes would also have to hold, so the context
    is subtracted: "fits 16 GB" on an 80 GB card then means it fits a real 16 GB card.
    """
    dev = resolve(device)
    total = gpu_info(dev).total_memory
    torch.cuda.synchronize(dev)  # creates this process's context if it has none, for NVML to see
    context, source, why = process_context_bytes(dev)
    limit = min(budget, total) - context
    if limit <= 0:
        raise ValueError(
            f"a budget of {budget / GiB:.2f} GiB leaves nothing beside the CUDA context "
            f"({context / MiB:.0f} MiB): raise the budget"
        )
    fraction = float(limit / total)
    torch.cuda.set_per_process_memory_fraction(fraction, dev)
    return Cap(budget, context, source, limit, fraction, budget > total, why)


def uncap_allocator(device: torch.device) -> None:
    """Lift ``cap_allocator``'s limit."""
    torch.cuda.set_per_process_memory_fraction(1.0, resolve(device))


def process_context_bytes(device: torch.device) -> tuple[int, str, str]:
    """This process's CUDA context on ``device`` per NVML, else ``ASSUMED_CONTEXT``.

    Returns ``(bytes, source, why)``: source "NVML" or "assumed", and why it was assumed.
    NVML lists the bytes each process uses on the GPU (context + what its allocator
    reserved); the difference to torch's reserved bytes is the context. It cannot always
    say: inside a container or on a virtual GPU NVML often refuses the per-process list
    (NoPermission, NotSupported), or lists host process ids that do not match ours. Then the
    assumption is used, and ``why`` says which of these happened.
    """
    dev = resolve(device)
    try:
        with nvml_handle(dev) as (nvml, handle):
            try:
                procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except nvml.NVMLError as err:
                return ASSUMED_CONTEXT, "assumed", f"NVML refused the process list ({err})"
            used = next((p.usedGpuMemory for p in procs if p.pid == os.getpid()), None)
    except NvmlUnavailable as err:
        return ASSUMED_CONTEXT, "assumed", str(err)
    if not used:
        why = "NVML does not list this process (a container shows the host's process ids)"
        return ASSUMED_CONTEXT, "assumed", why
    reserved = int(torch.cuda.memory_reserved(dev))
    if used <= reserved:
        return ASSUMED_CONTEXT, "assumed", "NVML lists no more than the allocator reserved"
    return int(used - reserved), "NVML", ""


def cuda_context_bytes() -> int | None:
    """Device memory the CUDA context itself takes, per NVML: used after init minus before.

    Run it in a fresh process (``helpers.isolate.call_isolated``): in a process that has
    already touched CUDA the context exists and the difference is meaningless. Other
    processes on the same GPU change NVML's number too, so run it on an idle GPU.
    """
    if not cuda_available():
        return None
    if cuda_initialized():
        raise RuntimeError("CUDA is already initialised here: call this in a fresh process")
    device = torch.device("cuda", 0)
    before = nvml_used_bytes(device)
    if before is None:
        return None
    torch.zeros(1, device=device)  # creating the first tensor creates the context
    torch.cuda.synchronize(device)
    return nvml_used_bytes(device) - before - torch.cuda.memory_reserved(device)


# --------------------------------------------------------------------------------------------
# The allocator's memory history: a CUDA memory snapshot for https://pytorch.org/memory_viz

MEMORY_VIZ = "https://pytorch.org/memory_viz"  # drag a snapshot .pickle onto this page


class MemorySnapshotUnsupported(RuntimeError):
    """No CUDA memory snapshot here; the message is the lesson's "skipped: ..." line."""


def memory_snapshot_supported(device, path: str | os.PathLike | None = None) -> tuple[bool, str]:
    """``(True, "")`` where the CUDA allocator can record its history, else ``(False, why)``.

    ``why`` is a whole line a lesson can print: what is missing, what the recording would
    write (``path``) and where the file is opened.
    """
    what = f"writes {os.fspath(path)}" if path is not None else "writes a snapshot .pickle"
    dev = torch.device(device)
    if not is_cuda(dev):
        need = f"needs a CUDA GPU (this machine runs on {dev.type})"
    elif not cuda_available():
        build = torch.version.cuda or torch.version.hip
        found = f"has CUDA {build} but finds no GPU" if build else "is built without CUDA"
        need = f"needs a CUDA GPU (torch {torch.__version__} {found})"
    else:
        return True, ""
    return False, f"skipped: {need}; on a GPU this {what}, open it at {MEMORY_VIZ}"


@contextlib.contextmanager
def record_memory_history(
    device, path: str | os.PathLike, max_entries: int = 100_000, stacks: str = "python"
):
    """Record every CUDA allocation and free in the block; on leaving, dump them to ``path``.

    The recipe of PyTorch's "Understanding CUDA Memory Usage" page: turn the allocator's
    history on (``torch.cuda.memory._record_memory_history(enabled="all")``: every alloc and
    free, each with the Python stack that made it), run the code, write the snapshot
    (``_dump_snapshot``: a pickle of ``_snapshot()``'s dict, the segments the allocator holds
    and ``device_traces``, the last ``max_entries`` events of each device), then turn it off.
    The snapshot is written however the block ends, before recording stops (stopping clears
    the history): after an ``OutOfMemoryError`` it holds the allocations that filled the card
    and the failed request (an "oom" entry), the picture needed to debug it; the error is
    raised again afterwards. Recording stops even if writing the file fails.

    The history covers every CUDA device of the process and initialises CUDA if it is not yet
    (the binding does), so run it in the process that trains. ``stacks="all"`` adds C++
    frames, which make the dump slower to symbolise; Python frames are what a learner reads.
    On a device that is not a CUDA GPU it raises ``MemorySnapshotUnsupported``, whose message
    is the "skipped: ..." line of ``memory_snapshot_supported``. Yields ``path`` as a Path.
    """
    ok, why = memory_snapshot_supported(device, path)
    if not ok:
        raise MemorySnapshotUnsupported(why)
    target = Path(path)
    torch.cuda.memory._record_memory_history(
        enabled="all", stacks=stacks, max_entries=max_entries, device=resolve(device)
    )
    try:
        yield target
    finally:
        try:
            torch.cuda.memory._dump_snapshot(str(target))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)


# --------------------------------------------------------------------------------------------
# NVML (memory view 3: the whole device, as nvidia-smi sees it)


class NvmlUnavailable(RuntimeError):
    """NVML cannot answer for this device; the message says why."""


def _nvml_str(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@contextlib.contextmanager
def nvml_handle(device: torch.device):
    """``(pynvml, handle)`` of the NVML device that is CUDA's ``device``; NVML open meanwhile.

    NVML numbers GPUs physically, CUDA numbers the visible ones (``CUDA_VISIBLE_DEVICES``
    may reorder them, name them by UUID, or name a MIG slice), so the two are matched by
    UUID, never by index. Raises ``NvmlUnavailable`` with the reason when there is no match.
    """
    if not is_cuda(device):
        raise NvmlUnavailable(f"{torch.device(device).type} is not an NVIDIA GPU")
    try:
        import pynvml  # optional (NVIDIA only)
    except ImportError as err:
        raise NvmlUnavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from err
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        raise NvmlUnavailable(f"no NVIDIA driver for NVML ({err})") from err
    try:
        try:
            handle = _nvml_find(pynvml, gpu_info(device))
        except pynvml.NVMLError as err:
            raise NvmlUnavailable(f"NVML refused to list the devices ({err})") from err
        yield pynvml, handle
    finally:
        pynvml.nvmlShutdown()


def _nvml_find(pynvml, info: GpuInfo):
    """The NVML handle whose UUID is torch's UUID of this device (full GPUs and MIG slices)."""
    parents = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        if _nvml_str(pynvml.nvmlDeviceGetUUID(handle)).split("-", 1)[-1] == info.uuid:
            if info.mig:
                # An older driver gives a MIG slice its parent's UUID: the parent's memory
                # numbers would be another device's.
                raise NvmlUnavailable(
                    "this MIG slice reports its parent GPU's UUID, so NVML cannot tell it apart"
                )
            return handle
        parents.append(handle)
    for parent in parents:  # MIG slices of GPUs with MIG mode on
        try:
            if pynvml.nvmlDeviceGetMigMode(parent)[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
                continue
            slots = pynvml.nvmlDeviceGetMaxMigDeviceCount(parent)
        except pynvml.NVMLError:
            continue
        for j in range(slots):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, j)
            except pynvml.NVMLError:  # an empty slot
                continue
            if _nvml_str(pynvml.nvmlDeviceGetUUID(mig)).split("-", 1)[-1] == info.uuid:
                return mig
    raise NvmlUnavailable(f"no NVML device has the UUID of {info.name} ({info.uuid})")


def nvml_summary(device: torch.device | None = None) -> str:
    """One line from NVML (what nvidia-smi reads), or why NVML is unavailable."""
    dev = resolve(device)
    if not is_cuda(dev):
        return f"NVML view unavailable: {dev.type} is not an NVIDIA GPU"
    try:
        with nvml_handle(dev) as (nvml, handle):
            name = _nvml_str(nvml.nvmlDeviceGetName(handle))
            driver = _nvml_str(nvml.nvmlSystemGetDriverVersion())
            total = nvml.nvmlDeviceGetMemoryInfo(handle).total
    except NvmlUnavailable as err:
        return f"NVML view unavailable: {err}"
    except Exception as err:  # an NVMLError from one query (e.g. NoPermission)
        return f"NVML view unavailable: {type(err).__name__}: {err}"
    return f"NVML: {name}, driver {driver}, {total / GiB:.1f} GiB"


def nvml_used_bytes(device: torch.device | None) -> int | None:
    """Memory in use on the whole GPU per NVML (CUDA context included); None if unavailable."""
    if device is None or not is_cuda(device):
        return None
    try:
        with nvml_handle(device) as (nvml, handle):
            return int(nvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:  # NvmlUnavailable, or an NVMLError from the query: no view 3 here
        return None


class UtilSampler:
    """Samples NVML's GPU utilisation (% of time a kernel ran) in a thread while active."""

    def __init__(self, device: torch.device, every: float = 0.05):
        self.device, self.every, self.samples = device, every, []
        self.problem: str | None = None  # why nothing was sampled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._nvml = None

    def _run(self) -> None:
        nvml, handle = self._nvml
        while not self._stop.wait(self.every):
            try:
                self.samples.append(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception as err:  # e.g. NotSupported on a MIG slice
                self.problem = f"{type(err).__name__}: {err}"
                return

    def __enter__(self):
        try:
            self._open = nvml_handle(self.device)
            self._nvml = self._open.__enter__()
        except NvmlUnavailable as err:
            self.problem, self._nvml = str(err), None
            return self
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._nvml is not None:
            self._stop.set()
            self._thread.join()
            self._open.__exit__(None, None, None)

    @property
    def mean(self) -> float | None:
        """Mean utilisation in %, None when nothing was sampled."""
        return sum(self.samples) / len(self.samples) if self.samples else None
