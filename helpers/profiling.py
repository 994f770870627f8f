"""One training step under ``torch.profiler``: a trace file to look at, and who allocates.

``profile_step`` runs a step once under ``torch.profiler.profile(profile_memory=True)`` and
writes its Chrome trace, a JSON file. Open it at https://ui.perfetto.dev (drag the file onto
the page) or in Chrome at chrome://tracing ("Load"). Each operator is a bar on its thread's
row, nested under its caller; each allocation and free is a ``[memory]`` instant event (a
small mark on the row; select it to read ``Bytes``, ``Total Allocated``, ``Total Reserved``,
``Device Type``, ``Addr``). ``profile_step`` adds a counter track per device,
``[memory] Total Allocated (cpu)`` (or ``cuda``), drawn from the same events: the step's memory
as a curve, beside the operators that move it.

What the profiler's memory numbers count (read from torch 2.13 and checked by running it):

- On a CUDA device the events of device type CUDA carry the caching allocator's own counters:
  ``Total Allocated`` is every byte in live tensors on the card (parameters, gradients,
  optimizer state, activations: ``torch.cuda.memory_allocated``), ``Total Reserved`` what the
  allocator holds from the driver. Their largest values are the allocator's peaks in the step.
- On the CPU there is no caching allocator. The CPU allocator reports only the blocks it hands
  out while memory profiling is on, and ``Total Allocated`` is the running total of those still
  alive (counting from zero in a fresh process; blocks left alive by an earlier profiled region
  stay in it). Tensors made before the profiler started, such as the parameters and the AdamW
  state the warm-up step created, are not in it; ``Total Reserved`` is 0. So for a steady-state
  step on the CPU: largest ``Total Allocated`` + ``resident_bytes`` (parameters, buffers,
  optimizer state) = the course tracker's peak (``helpers.memory.CategoryTracker``), to a few
  bytes, and it is at least the gradients (zero_grad(set_to_none=True) frees them every step).
- An operator's memory in ``key_averages()`` is net: bytes allocated minus bytes freed between
  its start and its end, its callees included; "self" leaves the callees out. A free counts
  against the operator running when it happens. One between operators (Python dropping the
  last reference: 60% of the bytes freed in a llama-tiny step on the CPU) goes to a row of its
  own, ``[memory]``, which ``top_memory`` leaves out; so a leaf operator's self bytes are
  mostly what it allocated: its outputs. A row adds up every call: it is what the operator
  allocated over the step, not what was alive at one moment (on the CPU, AdamW's ``sqrt`` row
  comes to 4 bytes per parameter, a short-lived temporary per tensor).
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from helpers.device import is_cuda, resolve, synchronize

MEMORY_EVENT = "[memory]"  # the name torch gives an allocation's or a free's trace event
# c10::DeviceType numbers in a [memory] event's "Device Type" (torch._C._autograd.DeviceType).
DEVICE_TYPES = {0: "cpu", 1: "cuda", 12: "xpu", 13: "mps", 20: "privateuseone"}


@dataclass(frozen=True)
class OpMemory:
    """One operator's row of ``key_averages()``: net bytes (see the module), calls, time."""

    name: str
    self_cpu_bytes: int
    self_device_bytes: int
    cpu_bytes: int  # callees included
    device_bytes: int
    calls: int
    cpu_time_s: float  # all calls, callees included
    device_time_s: float


@dataclass(frozen=True)
class MemoryTrack:
    """The ``[memory]`` events of one device type in a trace, in time order."""

    device_type: str  # "cpu", "cuda", ...
    events: int
    allocations: int
    frees: int
    allocated_bytes: int  # the sum of every allocation's size
    baseline: int  # "Total Allocated" just before the first event
    peak_allocated: int  # the largest "Total Allocated"
    peak_reserved: int  # the largest "Total Reserved" (0 on the CPU: no caching allocator)
    final_allocated: int  # "Total Allocated" after the last event


@dataclass(frozen=True)
class ProfileResult:
    """What ``profile_step`` found: the trace file, its memory tracks and the top allocators."""

    path: Path
    device: str  # the step's device type
    n_events: int  # trace events in the file
    memory: dict[str, MemoryTrack] = field(default_factory=dict)  # by device type
    top_memory: list[OpMemory] = field(default_factory=list)  # most self bytes on the device
    table: str = ""  # key_averages().table(...) sorted by self memory on the device

    @property
    def peak_allocated(self) -> int:
        """The largest "Total Allocated" of the step's device in the trace (0 if none)."""
        track = self.memory.get(self.device)
        return track.peak_allocated if track else 0


def profile_step(
    step: Callable[[], object],
    device,
    path: str | Path,
    *,
    warmup: int = 1,
    rows: int = 10,
    counters: bool = True,
) -> ProfileResult:
    """Run ``step`` ``warmup`` times, then once profiled; write the trace to ``path``."""
    dev = resolve(device)
    for _ in range(warmup):
        step()
    synchronize(dev)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda(dev) else [])
    with (
        _quiet_kineto(),
        profile(
            activities=activities, profile_memory=True, record_shapes=True, with_stack=False
        ) as prof,
    ):
        step()
        synchronize(dev)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    trace = read_trace(path)
    events = trace["traceEvents"]
    tracks = _tracks(events)
    if counters:
        events.extend(_counter_events(events))
        _write_trace(path, trace)
    averages = prof.key_averages()
    key = "self_cuda_memory_usage" if is_cuda(dev) else "self_cpu_memory_usage"
    return ProfileResult(
        path=path,
        device=dev.type,
        n_events=len(events),
        memory=tracks,
        top_memory=_top_memory(averages, on_device=is_cuda(dev), rows=rows),
        table=averages.table(sort_by=key, row_limit=rows),
    )


@contextmanager
def _quiet_kineto():
    """No "USDT: profiler_start/stop" lines on stderr (kineto reads its level at its first
    use in a process); a KINETO_LOG_LEVEL the user set is left as it is."""
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = "6"  # above USDT: nothing but fatal errors
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


def read_trace(path: str | Path) -> dict:
    """A Chrome trace file (``.json``, or ``.json.gz`` as torch writes for that suffix)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        trace = json.load(f)
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path} is not a Chrome trace: no traceEvents list")
    return trace


def _write_trace(path: Path, trace: dict) -> None:
    """Write ``trace`` back where it was read from, compressed if the name says so."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        json.dump(trace, f)


def memory_events(path: str | Path) -> dict[str, MemoryTrack]:
    """The ``[memory]`` events of a trace file, summed up per device type."""
    return _tracks(read_trace(path)["traceEvents"])


def _memory(events: list[dict]) -> list[dict]:
    """The trace's ``[memory]`` events in time order."""
    found = [e for e in events if e.get("name") == MEMORY_EVENT and "args" in e]
    return sorted(found, key=lambda e: e.get("ts", 0))


def _device_name(code: int) -> str:
    return DEVICE_TYPES.get(code, f"device type {code}")


def _tracks(events: list[dict]) -> dict[str, MemoryTrack]:
    """One ``MemoryTrack`` per device type that has ``[memory]`` events."""
    by_type: dict[str, list[dict]] = {}
    for event in _memory(events):
        by_type.setdefault(_device_name(event["args"]["Device Type"]), []).append(event["args"])
    tracks = {}
    for name, args in by_type.items():
        sizes = [a["Bytes"] for a in args]
        tracks[name] = MemoryTrack(
            device_type=name,
            events=len(args),
            allocations=sum(1 for b in sizes if b > 0),
            frees=sum(1 for b in sizes if b < 0),
            allocated_bytes=sum(b for b in sizes if b > 0),
            baseline=args[0]["Total Allocated"] - args[0]["Bytes"],
            peak_allocated=max(a["Total Allocated"] for a in args),
            peak_reserved=max(a.get("Total Reserved", 0) for a in args),
            final_allocated=args[-1]["Total Allocated"],
        )
    return tracks


def _counter_events(events: list[dict]) -> list[dict]:
    """Counter events ("ph": "C") that draw each device's Total Allocated (and Reserved)."""
    out = []
    for event in _memory(events):
        args = event["args"]
        device = _device_name(args["Device Type"])
        series = {"Total Allocated": args["Total Allocated"]}
        if args.get("Total Reserved"):
            series["Total Reserved"] = args["Total Reserved"]
        for label, value in series.items():
            out.append(
                {"ph": "C", "name": f"[memory] {label} ({device})", "pid": event["pid"],
                 "ts": event["ts"], "args": {"MiB": round(value / 2**20, 4)}}
            )  # fmt: skip
    return out


def _top_memory(averages, *, on_device: bool, rows: int) -> list[OpMemory]:
    """The operators with the most self bytes on the step's device, largest first."""
    found = [
        OpMemory(
            name=a.key,
            self_cpu_bytes=int(a.self_cpu_memory_usage),
            self_device_bytes=int(a.self_device_memory_usage),
            cpu_bytes=int(a.cpu_memory_usage),
            device_bytes=int(a.device_memory_usage),
            calls=int(a.count),
            cpu_time_s=a.cpu_time_total / 1e6,
            device_time_s=a.device_time_total / 1e6,
        )
        for a in averages
        if a.key != MEMORY_EVENT
    ]

    def own(op: OpMemory) -> int:
        return op.self_device_bytes if on_device else op.self_cpu_bytes

    return sorted((op for op in found if own(op) > 0), key=own, reverse=True)[:rows]


def resident_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, device=None
) -> int:
    """Bytes of the parameters, buffers and optimizer state (each storage once), on ``device``."""
    tensors = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    dev = None if device is None else resolve(device)
    storages = {}
    for t in tensors:
        if dev is None or t.device == dev:
            storage = t.untyped_storage()
            storages[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())
