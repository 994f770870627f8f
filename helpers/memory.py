"""Memory, three views.

1. Exact bytes per category (parameters, gradients, optimizer state, activations,
   temporaries), on any device, CPU included: PyTorch's own ``MemTracker``
   (torch.distributed._tools.mem_tracker) sees every tensor storage created or freed and
   labels it. We extend it in ``CategoryTracker`` where it falls short for this course.
2. The CUDA caching allocator's peaks: ``allocated`` (bytes in live tensors) and
   ``reserved`` (bytes the allocator holds from the driver, cached blocks included).
3. The whole device as NVML / nvidia-smi sees it, the CUDA context included
   (``helpers.device.nvml_used_bytes``).

On CUDA, MemTracker counts each storage as the caching allocator holds it: rounded up to a
multiple of 512 bytes (``helpers.device.allocation_bytes``), so a 4-byte bias takes 512.
"""

from __future__ import annotations

import functools
import gc
import re
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed._tools.mod_tracker import ModTracker

from helpers import device as dev
from helpers.names import MiB

# Our category names for MemTracker's reference types.
CATEGORY = {
    _MemRefType.PARAM: "params",
    _MemRefType.BUFFER: "buffers",
    _MemRefType.GRAD: "gradients",
    _MemRefType.OPT: "optimizer_state",
    _MemRefType.ACT: "activations",
    _MemRefType.TEMP: "temporaries",
    _MemRefType.OTH: "inputs",  # tensors registered with track_external: the batch
}
CATEGORIES = tuple(CATEGORY.values())
_CASTS = (torch.ops.aten._to_copy.default,)
# A tensor's device asked of a fake tensor (most of a trace's dispatched calls): nothing is
# allocated or freed, so the tracker passes it on untouched.
_DEVICE_QUERY = torch.ops.prim.device.default


@dataclass
class CategoryPeaks:
    """Each category's own largest size during the tracked region, and the largest total."""

    params: int = 0
    buffers: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    temporaries: int = 0
    inputs: int = 0
    weight_copies: int = 0  # part of temporaries: the largest total of live autocast weight casts
    peak: int = 0  # largest sum of everything tracked at one moment (<= sum of the above)
    peak_at: dict | None = None  # the categories at the moment of that largest sum

    def as_dict(self) -> dict:
        """Plain dict for records and JSON."""
        return asdict(self)


class _NoHook:
    """A stand-in hook handle for a frozen parameter: removing it does nothing."""

    def remove(self) -> None:
        """Nothing to remove."""


class _NoModuleHooks(ModTracker):
    """A ``ModTracker`` that installs no hooks: ``is_bw`` still works, ``parents`` stays global."""

    def __enter__(self):
        return self

    def __exit__(self, *args) -> None:
        return None


@dataclass
class OffloadView:
    """What an offloading engine (DeepSpeed ZeRO, lesson 08) keeps off the compute device.

    With ``CategoryTracker(offload=...)`` only tensors on ``device``'s type count, except
    storages in ``host`` (data pointers of the engine's host buffers) and whatever is created
    inside ``optimizer.step()``, which then runs on the host; the optimizer's state joins
    ``host`` after each step. ``fetched()`` gives the bytes of weights the engine has gathered
    onto the device (ZeRO-3), which PyTorch's dispatch does not show as new tensors; they are
    added to the device's total, and the budget applies to that sum.
    """

    device: torch.device
    host: set[int]
    fetched: Callable[[], int] | None = None


@dataclass(frozen=True)
class TimelineEvent:
    """One change of the tracked device's bytes: what changed, when, and the totals after it."""

    kind: str  # "add" (allocated), "del" (freed), "ref" (relabelled), "size" (resized)
    tensor: int  # index in ``CategoryTracker.tensors`` of the storage concerned
    nbytes: int  # that storage's bytes
    category: str  # its category after the change
    phase: str  # "forward", "backward", "optimizer step" or "outside" (between them)
    micro: int  # micro-batch (1, 2, ...; 0 before the first forward)
    module: str  # innermost module running ("" outside the model)
    alive: tuple[int, ...]  # bytes alive per category after the change (``CATEGORIES`` order)


@dataclass(frozen=True)
class TensorInfo:
    """A storage the timeline saw created: its shape, dtype and where it was made."""

    shape: tuple[int, ...]
    dtype: str
    created: str  # "forward: model.layers.0.mlp", "optimizer step", ... or a parameter's name


_LAYER_MODULE = re.compile(r"\.(?:layer|layers|h|blocks)\.\d+$")  # a transformer layer
_IN_LAYER = re.compile(r"\.(?:layer|layers|h|blocks)\.\d+\.")  # a module inside one


def innermost(parents) -> str:
    """The module running now, from ModTracker's ``parents`` ("Global" outside the model).

    In backward, torch's ModTracker can leave a finished layer's submodules (``self_attn``)
    among the parents, never the finished layer itself: so when a layer is running, only its
    own submodules count, and otherwise none inside any layer does.
    """
    layers = [p for p in parents if _LAYER_MODULE.search(p)]
    if layers:
        layer = max(layers, key=len)
        inside = [p for p in parents if p == layer or p.startswith(layer + ".")]
    else:
        inside = [p for p in parents if p != "Global" and not _IN_LAYER.search(p)]
    return max(inside, key=len, default="Global")


def _walk_tensors(obj, depth: int = 3):
    """Tensors inside ``obj``: a tensor, or dicts, lists and tuples holding them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0 and isinstance(obj, (dict, list, tuple)):
        for item in obj.values() if isinstance(obj, dict) else obj:
            yield from _walk_tensors(item, depth - 1)


class CategoryTracker(MemTracker):
    """``MemTracker`` plus what this course needs from it.

    MemTracker stops short for us in these ways, so we extend it here:
    - it keeps only the breakdown at the moment of the total peak; the course reports each
      category's own maximum (gradients peak after backward, activations inside it);
    - it labels the 16-bit weight copies that autocast makes as activations (they are created
      during forward); they are transient working copies, so we count them as temporaries;
    - it labels every tensor created inside ``optimizer.step()`` as optimizer state, including
      the step's scratch buffers (foreach AdamW allocates several parameter-sized lists); we
      count those as temporaries, and MemTracker's post-step hook still relabels the real state
      (exp_avg, exp_avg_sq, ...) as optimizer state, so that category is the state alone;
    - it has no budget: with ``budget`` set, growing past it raises ``torch.OutOfMemoryError``
      like a full GPU would, so "does it fit in 16 GB?" behaves the same on a laptop;
    - it tallies each device separately and the course wants one: with ``device`` set, only
      that device's storages count (on CUDA torch's AdamW keeps its step counters on the CPU);
    - it puts a gradient hook on every parameter, and ``register_hook`` refuses a frozen one
      (LoRA, lesson 13): frozen weights are marked as hooked already, so MemTracker skips the
      hook and still counts them as parameters.

    Options, instead of subclasses (this module is the course's only contact with
    MemTracker's private methods; ``tests/test_memory.py`` pins the ones it relies on):
    ``module_hooks=False`` counts bytes without module hooks (a batch search: the hooks keep
    the graph of a forward that raised alive); ``oom_prefix`` goes in front of the budget's
    OutOfMemoryError message; ``offload`` (an ``OffloadView``) counts only what an offloading
    engine keeps on the compute device, fetched weights included (``device_peak``,
    ``fetched_max``); ``timeline=True`` keeps a ``TimelineEvent`` per allocation, free or
    relabelling of the tracked device (``events``; ``helpers.timeline`` turns them into the
    step's per-category timeline, lesson 15). Recording reads the tracker's own running totals,
    so it cannot change a peak; it slows a tracked step down a little (measured in lesson 15).

    A subclass elsewhere extends it through public hooks only (``on_forward``, ``on_count``,
    ``in_backward``, ``in_optimizer_step``, ``current_modules``, ``weight_copies_alive``):
    ``tests/test_layers.py`` keeps MemTracker's private names inside this module.
    """

    def __init__(
        self,
        budget: int | None = None,
        device: torch.device | None = None,
        *,
        module_hooks: bool = True,
        oom_prefix: str = "",
        offload: OffloadView | None = None,
        module_peaks: bool = True,
        cuda_storages: bool = False,
        timeline: bool = False,
    ) -> None:
        super().__init__()
        self.budget = budget
        # Count only this device's storages (None: each storage's own device). On CUDA,
        # torch's AdamW keeps its step counters on the CPU: they are not GPU memory.
        self.device = None if device is None else dev.resolve(device)
        self.maxima = dict.fromkeys(CATEGORIES, 0)
        self.max_total = 0
        self.max_snapshot: dict[str, int] = {}
        self._force_temp = False
        self._copies_live = 0
        self.copies_max = 0
        self.oom_prefix = oom_prefix
        self.offload = offload
        self.fetched_max = 0  # offload: the most gathered weights at one moment
        self.module_peaks = module_peaks
        self.cuda_storages = cuda_storages
        self.peak_where = ""  # "forward: <module>", "backward: <module>" or "optimizer step"
        self.device_peak = 0  # offload: the largest device total, gathered weights included
        if not module_hooks:
            self._mod_tracker = _NoModuleHooks()
        # timeline=True: one event per change of the tracked device's bytes (helpers.timeline).
        self.events: list[TimelineEvent] | None = [] if timeline else None
        self.peak_event = -1  # index in ``events`` of the moment of the largest total
        self.failed_event = -1  # index in ``events`` of the allocation past the budget
        self.micro = 0  # top-level forwards so far: the micro-batch running now
        self.tensors: list[TensorInfo] = []  # timeline: every storage seen, by first sight
        self._tensor_now: torch.Tensor | None = None  # the tensor being registered
        self._names: dict[int, str] = {}  # id(parameter) -> its name, for ``tensors``

    # -- the offload view (lesson 08) ----------------------------------------------------------

    def _skip(self, t: torch.Tensor) -> bool:
        o = self.offload
        if o is None:
            return False
        if t.device.type != o.device.type or self._in_opt:
            return True
        return t.untyped_storage().data_ptr() in o.host

    def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
        # None: a gradient already stepped and freed inside backward (OptimizerInBackward).
        if t is None or self._skip(t):
            return set()
        self._tensor_now = t
        try:
            return super()._update_and_maybe_create_winfos(t, reftype, update_existing)
        finally:
            self._tensor_now = None

    def track_external(self, *external) -> None:
        """MemTracker's, also taking an optimizer made of per-parameter optimizers (lesson 16)."""
        expanded = []
        for obj in external:
            expanded.extend(getattr(obj, "optimizers", {obj: obj}).values())
        super().track_external(*expanded)

    def _track_optimizer_states(self, reftype, optimizer) -> None:
        if self.events is not None:  # the timeline names each state tensor by its parameter
            for p, state in optimizer.state.items():
                owner = self._names.get(id(p), "a parameter")
                self._names.update((id(v), f"{k} of {owner}") for k, v in state.items()
                                   if isinstance(v, torch.Tensor))  # fmt: skip
        if self.offload is None:
            return super()._track_optimizer_states(reftype, optimizer)
        # After each optimizer step: its state was created on the host, remember it.
        for state in optimizer.state.values():
            self.offload.host.update(t.untyped_storage().data_ptr() for t in _walk_tensors(state))
        return None

    def _update_peak_stats(self, peak_state) -> None:
        # Per-module peaks cost a scan of every module per operator (most of a tracked 7B
        # step's time); the estimator and the offload view read only the category totals.
        if self.offload is None and self.module_peaks:
            super()._update_peak_stats(peak_state)

    def _account(self, growing: bool) -> None:
        o = self.offload
        fetched = o.fetched() if o.fetched else 0
        self.fetched_max = max(self.fetched_max, fetched)
        snap = self._curr_mem_snap.get(o.device) or next(iter(self._curr_mem_snap.values()), {})
        total = snap.get("Total", 0) + fetched
        self.device_peak = max(self.device_peak, total)
        if growing and self.budget is not None and total > self.budget:
            fetched_text = f" ({fetched / MiB:.1f} MiB of fetched weights)" if fetched else ""
            raise torch.OutOfMemoryError(
                f"{self.oom_prefix}memory budget exceeded: the compute device would hold "
                f"{total / MiB:.1f} MiB{fetched_text}, more than the {self.budget / MiB:.1f} "
                "MiB budget."
            )

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        if self.events is not None:
            self._names.update((id(p), n) for n, p in module.named_parameters())
        if install_grad_hooks:
            for p in module.parameters():
                if not p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                    self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        if self.cuda_storages and u_type.name == "ADD":
            # The CUDA caching allocator's view of a storage traced on the CPU: 512-byte blocks.
            winfo.mem_consumed = dev.allocation_bytes(winfo.mem_consumed, "cuda")
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        if u_type.name == "ADD" and self._force_temp:
            winfo.course_weight_copy = True  # remembered so its release is subtracted below
            self._copies_live += winfo.mem_consumed
            self.copies_max = max(self.copies_max, self._copies_live)
        elif u_type.name == "DEL" and getattr(winfo, "course_weight_copy", False):
            self._copies_live -= winfo.mem_consumed
        if self.offload is not None:  # maxima as usual; the budget applies to the device sum
            self._update_maxima(winfo.device)
            self._account(u_type.name in ("ADD", "SIZE"))
            return
        if self.device is not None and winfo.device != self.device:
            return
        before = self.max_total
        snap = self._update_maxima(winfo.device)
        if self.events is not None:
            self._record(u_type.name.lower(), winfo, snap, self.max_total > before)
        if snap is None:
            return
        total = snap["Total"]
        if self.budget is not None and total > self.budget and u_type.name in ("ADD", "SIZE"):
            if self.events is not None:  # the timeline ends here, not after the unwinding
                self.failed_event = len(self.events) - 1
            held = ", ".join(f"{n} {v / MiB:.1f} MiB" for n, v in self._named(snap).items() if v)
            raise torch.OutOfMemoryError(
                f"{self.oom_prefix}memory budget exceeded: this step needs more than the "
                f"{self.budget / MiB:.1f} "
                f"MiB budget ({winfo.mem_consumed / MiB:.2f} MiB requested with {held} held). "
                "Use a smaller batch, gradient accumulation, checkpointing or 16-bit, or raise "
                "the budget."
            )

    def _record(self, kind: str, winfo, snap: dict | None, new_peak: bool) -> None:
        """Append a ``TimelineEvent`` for this change (``timeline=True``)."""
        if kind == "add":
            winfo.course_id = len(self.tensors)
            self.tensors.append(self._describe(self._tensor_now))
        mt = self._mod_tracker
        module = innermost(mt.parents)
        phase = "optimizer step" if self._in_opt else "backward" if mt.is_bw else "forward"
        if phase == "forward" and module == "Global":
            phase, module = "outside", ""
        alive = tuple(snap.get(k, 0) for k in CATEGORY) if snap else (0,) * len(CATEGORY)
        self.events.append(TimelineEvent(
            kind, getattr(winfo, "course_id", -1), winfo.mem_consumed, CATEGORY[winfo.reftype],
            phase, self.micro, module, alive,
        ))  # fmt: skip
        if new_peak:
            self.peak_event = len(self.events) - 1

    def _describe(self, t: torch.Tensor | None) -> TensorInfo:
        """Shape, dtype and origin of a storage being added (a parameter by its name)."""
        if t is None:
            return TensorInfo((), "", self._where())
        name = self._names.get(id(t))
        return TensorInfo(tuple(t.shape), str(t.dtype).removeprefix("torch."),
                          name or self._where())  # fmt: skip

    def _update_maxima(self, device: torch.device) -> dict | None:
        """Raise each category's maximum and the total's to ``device``'s current snapshot."""
        snap = self._curr_mem_snap.get(device)
        if snap is None:
            return None
        for reftype, name in CATEGORY.items():
            self.maxima[name] = max(self.maxima[name], snap[reftype])
        if snap["Total"] > self.max_total:
            self.max_total = snap["Total"]
            self.max_snapshot = self._named(snap)
            self.peak_where = self._where()
        self.on_count(snap)
        return snap

    def _where(self) -> str:
        """The phase and innermost module running now: where a new peak was reached."""
        if self._in_opt:
            return "optimizer step"
        mt = self._mod_tracker
        return f"{'backward' if mt.is_bw else 'forward'}: {innermost(mt.parents)}"

    @staticmethod
    def _named(snap: dict) -> dict[str, int]:
        return {CATEGORY[k]: v for k, v in snap.items() if k in CATEGORY}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A cast of a parameter inside forward is autocast's working copy: count it as temporary.
        if self.offload is not None:
            self._account(True)  # ZeRO-3 may have gathered weights since the last allocation
        if func is _DEVICE_QUERY:
            return func(*args, **(kwargs or {}))
        if func in _CASTS and args and isinstance(args[0], torch.nn.Parameter):
            self._force_temp = True
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._force_temp = False

    def _pre_fw_hook(self, module, inputs) -> None:
        # MemTracker refuses a second top-level forward of a module in one tracked region
        # (gradient accumulation runs several). We read only the category totals, never its
        # per-module statistics, so we drop that module's (and its submodules') statistics at
        # its new top-level forward instead. Only theirs: other modules called at the top
        # level (a decoder body, then its head chunk by chunk, as a chunked loss does) still
        # need theirs for their backward.
        if not self._mod_tracker.is_bw:
            self.on_forward(module)
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                self.micro += 1
                if module in self.memory_tracking:
                    for inner in module.modules():
                        self.memory_tracking.pop(inner, None)
        super()._pre_fw_hook(module, inputs)

    # -- the public view of MemTracker's state, for subclasses outside this module -------------

    def on_forward(self, module: torch.nn.Module) -> None:
        """Called as each module's forward starts (never a recomputation inside backward),
        before anything it allocates is counted; does nothing here, for subclasses to extend
        (the estimator's trace counts micro-batches with it)."""

    def on_count(self, snap: dict) -> None:
        """Called after each change of the tracked device's bytes, the maxima raised already,
        with the bytes alive now: ``snap[reftype]`` for each of ``CATEGORY``'s keys, and
        ``snap["Total"]``; does nothing here, for subclasses to extend."""

    @property
    def weight_copies_alive(self) -> int:
        """The bytes of autocast's weight copies alive now (counted as temporaries)."""
        return self._copies_live

    @property
    def in_backward(self) -> bool:
        """Whether the tracked step is inside backward now."""
        return self._mod_tracker.is_bw

    @property
    def in_optimizer_step(self) -> bool:
        """Whether the tracked step is inside ``optimizer.step()`` now."""
        return self._in_opt

    def current_modules(self) -> set[str]:
        """The qualified names of the modules running now ("Global" for the top level)."""
        return set(self._mod_tracker.parents)

    def _track(self, reftype, t: torch.Tensor) -> None:
        if self._skip(t):
            return
        # Only __torch_dispatch__ calls _track, so OPT here means "allocated during step()".
        if self._force_temp or reftype == _MemRefType.OPT:
            reftype = _MemRefType.TEMP
        self._tensor_now = t
        try:
            super()._track(reftype, t)
        finally:
            self._tensor_now = None

    def __enter__(self):
        # MemTracker's module hooks warn on every backward through a module that was freed;
        # they are harmless and would bury a learner's output.
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("ignore", message="Module is None")
        return super().__enter__()

    def __exit__(self, *args):
        try:
            return super().__exit__(*args)
        finally:
            self._warnings.__exit__(None, None, None)

    def current(self) -> dict[str, int]:
        """Bytes alive now, per category, and their ``total`` (the tracked device only)."""
        snaps = self._curr_mem_snap
        snap = snaps.get(self.device) if self.device is not None else None
        snap = snap or next(iter(snaps.values()), {})
        return {**dict.fromkeys(CATEGORIES, 0), **self._named(snap), "total": snap.get("Total", 0)}

    def peaks(self) -> CategoryPeaks:
        """The per-category maxima and the largest total seen so far."""
        return CategoryPeaks(
            **self.maxima,
            weight_copies=self.copies_max,
            peak=self.max_total,
            peak_at=dict(self.max_snapshot),
        )


def reset_device_peaks(device: torch.device) -> None:
    """Free cached blocks and reset the allocator's peak counters (accelerate's recipe)."""
    gc.collect()
    if device.type != "cpu":
        dev.synchronize(device)
        dev.empty_cache(device)
        dev.reset_peak_stats(device)


@dataclass
class AllocatorPeaks:
    """View 2: the caching allocator's peaks since the last reset, in bytes."""

    allocated: int
    reserved: int


def allocator_peaks(device: torch.device) -> AllocatorPeaks | None:
    """Allocated and reserved peaks on an accelerator; None on the CPU (no caching allocator)."""
    if device.type == "cpu":
        return None
    dev.synchronize(device)
    stats = dev.allocator_stats(device)
    return AllocatorPeaks(allocated=stats.max_allocated, reserved=stats.max_reserved)


def allocator_baseline(device: torch.device) -> int | None:
    """Reset the allocator's peaks and return the bytes allocated now (None on the CPU).

    With ``allocator_growth`` after the code to measure, the allocator's view counts only
    what that code added: not the inputs made before, and not what a warm-up call left
    behind for good (cuBLAS/cuDNN workspaces, 32 MiB per stream on Hopper).
    """
    if device.type == "cpu":
        return None
    reset_device_peaks(device)
    return dev.allocator_stats(device).allocated


def allocator_growth(device: torch.device, baseline: int | None) -> int | None:
    """Peak bytes allocated since ``allocator_baseline``, above its baseline."""
    if baseline is None:
        return None
    return allocator_peaks(device).allocated - baseline


def rounding_slack(n_tensors: int, device: torch.device) -> int:
    """The most the allocator's rounding can add to ``n_tensors`` tensors: 511 B each on CUDA.

    A claim such as "fp32 weights take 4 bytes per parameter" is exact on the CPU; on CUDA
    each tensor is rounded up to a multiple of 512 bytes (a 4-byte bias takes 512).
    """
    return (dev.ALLOCATION_UNIT - 1) * n_tensors if dev.is_cuda(device) else 0


@contextmanager
def dora_graphs_collected(model: torch.nn.Module):
    """While tracking ``model``: Python's garbage collector run after each DoRA layer.

    The tracker's hooks on module outputs form reference cycles, so a graph that the model
    drops at once stays alive until the collector runs. DoRA drops one in every forward (its
    weight norm: an in x in identity matrix through A and B, used detached), so without a
    collection after each DoRA layer the tracked activations vary from run to run with the
    collector's timing (3.7 to 5.0 MB for one llama-tiny step). ``gc.freeze()`` keeps the
    collections short: they scan only the objects the step creates. Nothing without DoRA.
    """
    dora = [m for m in model.modules() if getattr(m, "lora_magnitude_vector", None)]
    if not dora:
        yield
        return

    def collect(*_) -> None:  # a hook that returns nothing leaves the output as it is
        gc.collect()

    hooks = [m.register_forward_hook(collect) for m in dora]
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        for hook in hooks:
            hook.remove()


@contextmanager
def memory_budget(nbytes: int, *tracked, device: torch.device | None = None):
    """Pretend the device has ``nbytes``: past it, allocations raise ``torch.OutOfMemoryError``.

    On CUDA the caching allocator is capped so that this process's CUDA context plus what the
    allocator reserves stays within ``nbytes`` (``helpers.device.cap_allocator`` says what
    the cap counts); the ``Cap`` is yielded. Elsewhere a ``CategoryTracker`` counts the
    tensors of ``tracked`` (modules, optimizers, tensors) plus everything created inside the
    block, and is yielded so its peaks can be read.
    """
    device = dev.resolve(device)
    if dev.is_cuda(device):
        cap = dev.cap_allocator(device, nbytes)
        try:
            yield cap
        finally:
            dev.uncap_allocator(device)
            reset_device_peaks(device)
        return
    tracker = CategoryTracker(budget=nbytes, device=device)
    tracker.track_external(*tracked)
    with tracker:
        yield tracker


# -- FSDP2 (lesson 17): PyTorch's FSDPMemTracker, with the course's categories ---------------

# FSDPMemTracker's categories (``_FSDPRefType`` values) as the course's.
FSDP_CATEGORY = {
    "Sharded Param": "params", "Buffer": "buffers", "Sharded Grad": "gradients",
    "OptState": "optimizer_state", "Activation": "activations", "Temp": "temporaries",
    "Inputs": "inputs", "Unsharded Param": "gathered_params",
    "Unsharded Grad": "gathered_gradients", "All Gather": "communication_buffers",
    "Reduce Scatter": "communication_buffers",
}  # fmt: skip
FSDP_KEYS = tuple(dict.fromkeys(FSDP_CATEGORY.values()))  # the course's names, each once


@functools.cache
def _fsdp_tracker_class():
    """``FSDPMemTracker`` with the course's per-category maxima (see fsdp_category_tracker)."""

    class FsdpCategoryTracker(FSDPMemTracker):
        def __init__(self, mod, optm=None, device: torch.device | None = None) -> None:
            super().__init__(mod, optm)
            self.device = device  # only this device's storages count (None: any)
            self.maxima = dict.fromkeys(FSDP_KEYS, 0)
            self.max_total = 0
            self.max_snapshot: dict[str, int] = {}

        def _track(self, reftype, t) -> None:
            # As CategoryTracker: what step() allocates is scratch until the post-step hook
            # relabels the real state (exp_avg, exp_avg_sq, step) as optimizer state.
            if reftype == _FSDPRefType.OPT:
                reftype = _FSDPRefType.TEMP
            super()._track(reftype, t)

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            snap = self._curr_mem_snap.get(winfo.device)
            if snap is None or self.device not in (None, winfo.device):
                return  # on CUDA, AdamW's step counters live on the CPU: not GPU memory
            now = dict.fromkeys(FSDP_KEYS, 0)
            for reftype, nbytes in snap.items():
                if reftype != "Total":
                    now[FSDP_CATEGORY[reftype.value]] += nbytes
            for key, nbytes in now.items():
                self.maxima[key] = max(self.maxima[key], nbytes)
            if snap["Total"] > self.max_total:
                self.max_total, self.max_snapshot = snap["Total"], now

        def peaks(self) -> dict:
            """Each course category's largest bytes, the largest total and what made it."""
            return {**self.maxima, "peak": self.max_total, "peak_at": dict(self.max_snapshot)}

    return FsdpCategoryTracker


def fsdp_category_tracker(root: torch.nn.Module, optimizer, device: torch.device | None = None):
    """PyTorch's ``FSDPMemTracker`` over an FSDP2 model, reporting the course's categories.

    FSDPMemTracker tells sharded parameters and gradients (what each process keeps) from the
    gathered ones (whole layers, alive while a layer computes) and the all-gather and
    reduce-scatter buffers; it keeps only the breakdown at the total's peak, so, as
    CategoryTracker does, this one keeps each category's own maximum, and counts the optimizer
    step's scratch as temporaries. ``peaks()`` maps the categories (``FSDP_CATEGORY``): sharded
    ones are the course's parameters and gradients; the rest is what FSDP adds. With
    ``device``, only that device's storages count (as ``CategoryTracker(device=...)``).
    """
    return _fsdp_tracker_class()(root, optimizer, dev.resolve(device) if device else None)


def saved_for_backward(
    run: Callable[[], torch.Tensor], leave_out: list[torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """``run()``'s result, and the bytes of the tensors autograd saved for backward while it
    ran (``torch.autograd.graph.saved_tensors_hooks``): each storage once, those of
    ``leave_out`` not counted. A compiled graph saves its tensors with ``save_for_backward``
    like any ``autograd.Function``, so the hooks see them too."""
    left_out = {t.untyped_storage().data_ptr() for t in leave_out}
    kept: dict[int, int] = {}  # storage address -> bytes; a saved tensor stays alive

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in left_out:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(kept.values())
