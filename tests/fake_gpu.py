"""Fake NVIDIA cards for a machine without one, faithful to torch 2.13 and nvidia-ml-py.

No GPU is available to develop or test the course, so its CUDA paths are exercised against
these fakes. They replace only the lowest layer: the C functions torch's CUDA and
accelerator modules call (``torch._C._cuda_*``, ``torch._C._accelerator_*``), the device
properties, and NVML's library functions. Everything above runs for real: torch's own
argument checks (``_get_device_index`` rejecting a device without an index,
``set_per_process_memory_fraction`` insisting on a float in [0, 1]),
``is_bf16_supported``'s emulation rule, pynvml's error classes. The behaviour modelled, from
torch's sources in site-packages and NVIDIA's documentation:

- ``torch.cuda.get_device_properties``: name, total memory (what the driver leaves for
  processes, a little less than the card's nominal size), capability, SM count, UUID (printed
  without NVML's ``GPU-``/``MIG-`` prefix);
- ``torch.cuda.is_bf16_supported()``: True on every CUDA card by default, since a T4 or V100
  can create bf16 tensors (emulation); with ``including_emulation=False`` only from sm80;
- the caching allocator: allocated and reserved bytes with peaks, blocks rounded to 512 B,
  ``empty_cache`` releasing unused reserve, and an out-of-memory error when reserving would
  pass ``fraction x total``;
- the allocator's memory history (``torch.cuda.memory._record_memory_history``,
  ``_snapshot``, ``_dump_snapshot``): the binding's argument checks, a ring buffer of
  ``max_entries`` trace entries (alloc, free_requested, free_completed, segment_alloc, oom)
  that disabling clears, as the C++ allocator's ``recordHistory`` does, and a snapshot dict
  with ``segments`` and one trace list per device;
- NVML: physical numbering independent of ``CUDA_VISIBLE_DEVICES`` (plain indices, UUIDs,
  MIG UUIDs), MIG slices under a parent in MIG mode, per-query errors such as
  ``NoPermission`` (a MIG parent's memory query as an unprivileged user; every query in the
  "no-permission" mode), utilisation ``NotSupported`` on a MIG slice, the per-process list
  refused (``NoPermission`` or ``NotSupported``, as in containers and on virtual GPUs), and a
  missing driver library.

Usage (pytest): ``gpu = FakeGpu(monkeypatch, [PROFILES["t4"]])``; ``gpu.allocate(nbytes)``
moves the fake allocator, ``gpu.fraction`` shows the cap that was set.
"""

from __future__ import annotations

import collections
import os
import types
from dataclasses import dataclass, field

import pynvml
import torch
import torch._dynamo  # imported as a CPU build first: it asks torch.cuda when imported

from helpers.hardware import REFERENCE_CARDS

GiB = 2**30


@dataclass(frozen=True)
class Profile:
    """A card as torch and NVML describe it (memory in bytes, as reported, not as marketed)."""

    key: str
    name: str
    total_memory: int  # torch.cuda.get_device_properties(i).total_memory
    capability: tuple[int, int]
    multiprocessors: int
    uuid: str
    nvml_total: int  # NVML's memory total (includes what the driver keeps back)
    mig_of: str | None = None  # key of the parent card for a MIG slice


def _uuid(n: int) -> str:
    return f"{n:08x}-1a2b-4c3d-8e9f-{n:012x}"


def _profile(key: str, uuid: int, nvml_gib: int, mig_of: str | None = None) -> Profile:
    card = REFERENCE_CARDS[key]  # the numbers torch reports for these cards
    return Profile(key, card.name, card.total_memory, card.capability, card.multiprocessors,
                   _uuid(uuid), nvml_gib * GiB, mig_of)  # fmt: skip


PROFILES = {
    p.key: p
    for p in (
        _profile("t4", 1, 16),
        _profile("v100", 2, 16),
        _profile("a10g", 3, 24),
        _profile("l4", 4, 24),
        _profile("a100-40", 5, 40),
        _profile("a100-80", 6, 80),
        _profile("h100", 7, 80),
        _profile("a100-mig", 8, 10, mig_of="a100-80"),
    )
}
# The cards the full scale must fit (the MIG slice is a card of its own to the course).
CARDS = ("t4", "v100", "a10g", "l4", "a100-40", "a100-80", "h100", "a100-mig")


class _Uuid:
    """torch prints a CUDA UUID as 8-4-4-4-12 hex digits (the _CUuuid class)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


@dataclass
class _Allocator:
    """The caching allocator's counters for one device."""

    total: int
    fraction: float = 1.0
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0

    def stats(self) -> dict:
        def stat(current: int, peak: int) -> dict:
            return {"all": {"current": current, "peak": peak, "allocated": 0, "freed": 0}}

        return {
            "allocated_bytes": stat(self.allocated, self.peak_allocated),
            "reserved_bytes": stat(self.reserved, self.peak_reserved),
            "num_ooms": 0,
        }


@dataclass
class _NvmlDevice:
    profile: Profile
    is_mig: bool = False
    migs: list = field(default_factory=list)
    used: int = 0


class FakeGpu:
    """Installs fake CUDA devices (and NVML) for one test; monkeypatch undoes it all."""

    def __init__(
        self,
        monkeypatch,
        cards: list[Profile],
        visible: str | None = None,
        nvml: str = "ok",
        mig_reports_parent_uuid: bool = False,
        context: int = 400 * 2**20,
        processes: str = "ok",
    ) -> None:
        """``cards``: the physical GPUs (a MIG profile brings its parent, in MIG mode).

        ``visible``: CUDA_VISIBLE_DEVICES as a user would set it (indices or UUIDs, with the
        ``GPU-``/``MIG-`` prefixes). ``nvml``: "ok", "missing" (no driver library),
        "no-permission" (memory queries refused) or "absent" (the package is not installed).
        ``processes``: the per-process list (``nvmlDeviceGetComputeRunningProcesses``): "ok",
        or refused as containers and virtual GPUs often do: "no-permission", "not-supported".
        """
        self.mp = monkeypatch
        self.context = context
        self.processes = processes
        self.physical: list[_NvmlDevice] = []
        for card in cards:
            if card.mig_of:
                parent = _NvmlDevice(PROFILES[card.mig_of])
                parent.migs.append(_NvmlDevice(card, is_mig=True))
                self.physical.append(parent)
            else:
                self.physical.append(_NvmlDevice(card))
        self.visible = self._visible(visible)
        self.alloc = [_Allocator(p.total_memory) for p in self.visible]
        self.current = 0
        self.mig_reports_parent_uuid = mig_reports_parent_uuid
        self.synced: list[int] = []
        self.events: list[str] = []  # calls in order, for tests that check an order
        self.history: collections.deque | None = None  # trace entries while recording
        self._next_addr = 0x7F0000000000  # where the next block starts (a device pointer)
        self._live: dict[tuple[int, int], list[int]] = {}  # (device, size) -> block addresses
        if visible is not None:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        self._install_torch()
        self._install_nvml(nvml)

    # -- what CUDA sees -------------------------------------------------------------------

    def _visible(self, spec: str | None) -> list[Profile]:
        every = [(d, d.profile) for d in self.physical]
        slices = [(m, m.profile) for d in self.physical for m in d.migs]
        if spec is None:  # CUDA enumerates MIG slices instead of a parent in MIG mode
            return [p for d, p in every if not d.migs] + [p for _, p in slices]
        out = []
        for item in (s.strip() for s in spec.split(",") if s.strip()):
            if item.isdigit():
                out.append(every[int(item)][1])
            else:
                uuid = item.split("-", 1)[1]
                out.append(next(p for _, p in every + slices if p.uuid == uuid))
        return out

    def _props(self, index: int):
        p = self.visible[index]
        uuid = p.uuid
        if p.mig_of and self.mig_reports_parent_uuid:
            uuid = PROFILES[p.mig_of].uuid
        return types.SimpleNamespace(
            name=p.name,
            total_memory=p.total_memory,
            major=p.capability[0],
            minor=p.capability[1],
            multi_processor_count=p.multiprocessors,
            uuid=_Uuid(uuid),
            is_integrated=False,
        )

    def _install_torch(self) -> None:
        mp, c = self.mp, torch._C
        n = len(self.visible)
        mp.setattr(torch.version, "cuda", "12.8")
        mp.setattr(torch.cuda, "_initialized", True)
        mp.setattr(torch.cuda, "_cached_device_count", None)
        mp.setattr(torch.cuda, "_get_device_properties", self._props, raising=False)
        # A T4 or V100 can hold bf16 tensors, so torch's emulation probe succeeds there.
        mp.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)
        # A CUDA build binds these to torch._C's functions when torch.cuda is imported.
        mp.setattr(torch.cuda, "_exchange_device", self._exchange)
        mp.setattr(torch.cuda, "_maybe_exchange_device", self._exchange)
        fakes = {
            "_cuda_getDeviceCount": lambda: n,
            "_cuda_getDevice": lambda: self.current,
            "_cuda_setDevice": self._set_device,
            "_cuda_exchangeDevice": self._exchange,
            "_cuda_maybeExchangeDevice": self._exchange,
            "_cuda_synchronize": lambda: self.synced.append(self.current),
            "_cuda_setMemoryFraction": self._set_fraction,
            "_cuda_getMemoryFraction": lambda i: self.alloc[i].fraction,
            "_cuda_memoryStats": lambda i: self.alloc[i].stats(),
            "_cuda_resetPeakMemoryStats": self._reset_peaks,
            "_cuda_emptyCache": self._empty_cache,
            "_cuda_record_memory_history": self._record_history,
            "_cuda_memorySnapshot": self._memory_snapshot,
            "_accelerator_getAccelerator": lambda: torch.device("cuda"),
            "_accelerator_getDeviceIndex": lambda: self.current,
            "_accelerator_setDeviceIndex": self._set_device,
            "_accelerator_synchronizeDevice": self._sync,
            "_accelerator_isAllocatorInitialized": lambda: True,
            "_accelerator_getDeviceStats": lambda i: self.alloc[i].stats(),
            "_accelerator_resetPeakStats": self._reset_peaks,
            "_accelerator_emptyCache": self._empty_cache,
        }
        for name, fn in fakes.items():
            mp.setattr(c, name, fn, raising=False)

    def _set_device(self, index: int) -> None:
        if index >= 0:
            self.current = index

    def _exchange(self, index: int) -> int:
        previous = self.current
        self._set_device(index)
        return previous

    def _sync(self, index: int) -> None:
        self.synced.append(index)

    def _set_fraction(self, fraction: float, index: int) -> None:
        self.events.append(f"fraction {fraction:.6f}")
        self.alloc[index].fraction = fraction

    def _reset_peaks(self, index: int) -> None:
        self.events.append("reset peaks")
        a = self.alloc[index]
        a.peak_allocated, a.peak_reserved = a.allocated, a.reserved

    def _empty_cache(self) -> None:
        self.events.append("empty cache")
        for a in self.alloc:
            a.reserved = a.allocated

    # -- the allocator, driven by tests ----------------------------------------------------

    def allocate(self, nbytes: int, index: int = 0) -> int:
        """An allocation as the caching allocator makes it: 512 B blocks, reserve grows."""
        a = self.alloc[index]
        size = -(-nbytes // 512) * 512
        if a.allocated + size > a.reserved:
            need = a.allocated + size
            if need > a.fraction * a.total:
                free = int(a.fraction * a.total) - a.reserved
                self._trace("oom", size, index, device_free=free)
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {size / 2**20:.2f} MiB. GPU {index} "
                    f"has a total capacity of {a.total / GiB:.2f} GiB; this process's limit "
                    f"is {a.fraction * a.total / GiB:.2f} GiB (set_per_process_memory_fraction)"
                )
            self._trace("segment_alloc", need - a.reserved, index, addr=self._next_addr)
            a.reserved = need
        a.allocated += size
        a.peak_allocated = max(a.peak_allocated, a.allocated)
        a.peak_reserved = max(a.peak_reserved, a.reserved)
        addr, self._next_addr = self._next_addr, self._next_addr + size
        self._live.setdefault((index, size), []).append(addr)
        self._trace("alloc", size, index, addr=addr)
        return size

    def free(self, nbytes: int, index: int = 0) -> None:
        """Free a block: allocated falls, the reserve stays cached."""
        size = -(-nbytes // 512) * 512
        self.alloc[index].allocated -= size
        addr = self._live[(index, size)].pop()
        self._trace("free_requested", size, index, addr=addr)
        self._trace("free_completed", size, index, addr=addr)

    # -- the allocator's memory history (torch.cuda.memory._record_memory_history) ----------

    def _record_history(
        self,
        enabled,
        context,
        stacks,
        max_entries,
        clear_history,
        compile_context,
        global_record_annotations,
        skip_actions,
    ) -> None:
        """torch/csrc/cuda/memory_snapshot.cpp's binding: its checks, then recordHistory."""
        if enabled not in (None, "state", "all"):
            raise RuntimeError("expected state to be 'state', 'all', or None")
        if context not in (None, "state", "alloc", "all"):
            raise RuntimeError("expected context to be 'state', 'alloc', 'all', or None")
        if stacks not in ("python", "all"):
            raise RuntimeError("expected stacks to be 'python', or 'all'")
        self.events.append(
            f"record history {enabled} context={context} stacks={stacks} max_entries={max_entries}"
        )
        if enabled is None:  # the C++ allocator clears its buffer when recording stops
            self.history = None
        elif self.history is None or clear_history or self.history.maxlen != max_entries:
            kept = [] if self.history is None or clear_history else list(self.history)
            self.history = collections.deque(kept, maxlen=max_entries)

    def _trace(self, action: str, size: int, index: int, addr: int | None = None, **extra):
        """One TraceEntry while recording (an OOM has no address; it says what was free)."""
        if self.history is None:
            return
        entry = {"action": action, "size": size, "stream": 0, "frames": [], "device": index}
        if addr is not None:
            entry["addr"] = addr
        self.history.append({**entry, **extra})

    def _memory_snapshot(self, _mempool=None) -> dict:
        """What ``torch._C._cuda_memorySnapshot`` returns: segments and per-device traces."""
        self.events.append("snapshot")
        traces = [[] for _ in self.visible]
        for entry in self.history or ():
            traces[entry["device"]].append({k: v for k, v in entry.items() if k != "device"})
        segments = [
            {"device": i, "address": 0, "total_size": a.reserved, "allocated_size": a.allocated,
             "active_size": a.allocated, "segment_type": "large", "stream": 0, "blocks": []}
            for i, a in enumerate(self.alloc) if a.reserved
        ]  # fmt: skip
        return {"segments": segments, "device_traces": traces, "allocator_settings": {}}

    @property
    def fraction(self) -> float:
        """The memory fraction last set on device 0."""
        return self.alloc[0].fraction

    # -- NVML -------------------------------------------------------------------------------

    def _install_nvml(self, mode: str) -> None:
        if mode == "absent":
            self.mp.setitem(__import__("sys").modules, "pynvml", None)
            return
        self.nvml_mode = mode
        fakes = {
            "nvmlInit": self._nvml_init,
            "nvmlShutdown": lambda: None,
            "nvmlDeviceGetCount": lambda: len(self.physical),
            "nvmlDeviceGetHandleByIndex": lambda i: self.physical[i],
            "nvmlDeviceGetUUID": _nvml_uuid,
            "nvmlDeviceGetName": lambda h: _check(h).profile.name,
            "nvmlSystemGetDriverVersion": lambda: "580.95.05",
            "nvmlDeviceGetMemoryInfo": self._nvml_memory,
            "nvmlDeviceGetMigMode": lambda h: [int(bool(_check(h).migs))] * 2,
            "nvmlDeviceGetMaxMigDeviceCount": lambda h: 7 if _check(h).migs else 0,
            "nvmlDeviceGetMigDeviceHandleByIndex": _nvml_mig_handle,
            "nvmlDeviceGetUtilizationRates": self._nvml_utilisation,
            "nvmlDeviceGetComputeRunningProcesses": self._nvml_processes,
        }
        for name, fn in fakes.items():
            self.mp.setattr(pynvml, name, fn)

    def _nvml_init(self) -> None:
        if self.nvml_mode == "missing":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    def _held(self, d: _NvmlDevice) -> list[int]:
        """Bytes each of this process's devices on ``d`` holds: its reserve and a context."""
        return [
            a.reserved + self.context
            for a, p in zip(self.alloc, self.visible, strict=True)
            if p is d.profile and a.reserved
        ]

    def _nvml_memory(self, handle):
        d = _check(handle)
        if self.nvml_mode == "no-permission" or (d.migs and not d.is_mig):
            # A MIG parent's memory is not the processes' to read; NVML refuses it.
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        used = d.used + sum(self._held(d))
        return types.SimpleNamespace(total=d.profile.nvml_total, used=used,
                                     free=d.profile.nvml_total - used)  # fmt: skip

    def _nvml_utilisation(self, handle):
        d = _check(handle)
        if self.nvml_mode == "no-permission":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        if d.is_mig:  # NVML has no utilisation counter for a MIG slice
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return types.SimpleNamespace(gpu=97, memory=40)

    def _nvml_processes(self, handle):
        d = _check(handle)
        refused = {"no-permission": pynvml.NVML_ERROR_NO_PERMISSION,
                   "not-supported": pynvml.NVML_ERROR_NOT_SUPPORTED}  # fmt: skip
        if self.processes in refused:
            raise pynvml.NVMLError(refused[self.processes])
        return [
            types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=held) for held in self._held(d)
        ]


def _check(handle) -> _NvmlDevice:
    """``handle`` if it is one of the fake's devices; NVML's invalid-argument error if not."""
    if not isinstance(handle, _NvmlDevice):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    return handle


def _nvml_uuid(handle) -> str:
    d = _check(handle)
    return ("MIG-" if d.is_mig else "GPU-") + d.profile.uuid


def _nvml_mig_handle(parent, j):
    d = _check(parent)
    if j >= len(d.migs):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
    return d.migs[j]
