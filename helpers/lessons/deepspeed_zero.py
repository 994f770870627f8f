"""Lesson 08, sections 1-7 (notebooks/08_deepspeed_zero.ipynb).

DeepSpeed ZeRO on one device, in one process: configs, measured runs, estimates, a plan.

DeepSpeed is usually started by its launcher (``deepspeed train.py``), which starts one process
per GPU and sets the variables ``torch.distributed`` needs to find its peers. A notebook has one
process and no launcher, so ``one_process_env`` sets those variables for a world of one. Every
function here that initialises DeepSpeed is meant to run in a fresh process
(``helpers.isolate.call_isolated``): DeepSpeed creates a process group and global state that
must not leak into the next experiment.

Where the bytes of a ZeRO run live is measured two ways:
- by owner, between steps: what the model (``engine.module``) holds, and what DeepSpeed keeps
  in its offload buffers (fp32 master weights, gradient partitions, optimizer state);
- during a step, with ``CategoryTracker(offload=OffloadView(...))``: every tensor on the
  compute device except DeepSpeed's offload buffers, plus, for ZeRO-3, the weights fetched
  for the layers being computed.
On a GPU the offload buffers are in host RAM and everything else is in GPU memory. On a CPU
both are the same RAM: "offload" copies nothing (ZeRO-3's fetch is then a view of the host copy,
which is why the fetched weights are counted from DeepSpeed's own parameter status).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import tempfile
import time
import types
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from helpers.data import MarkovTask, markov_dataset, random_batch
from helpers.device import (
    ASSUMED_CONTEXT,
    RESERVE_MARGIN,
    gpu_info,
    is_cuda,
    nvml_used_bytes,
    resolve,
    set_current,
)
from helpers.hardware import hardware_report
from helpers.memory import (
    CategoryTracker,
    OffloadView,
    allocator_peaks,
    memory_budget,
    reset_device_peaks,
)
from helpers.models import build_model, count_params, load_config, task_kind
from helpers.names import GiB, MiB
from helpers.plots import CATEGORY_COLORS, STEP_CATEGORIES, category_labels
from helpers.results import Record
from helpers.timing import time_fn
from helpers.train import make_optimizer, quiet_trainer

FP32 = 4
# The course's rule of thumb for fp32 training with AdamW (lesson 01): 4 weights + 4 gradients
# + 8 optimizer state bytes per parameter.
BYTES_PER_PARAM = 16

# DeepSpeed's buffers that it places on the offload device (host RAM), by ZeRO stage. Names are
# those of deepspeed 0.19's ZeRO optimizers; a name missing in another version is skipped, and its
# buffer then counts as device memory (the conservative side for a budget).
HOST_BUFFERS = {
    2: (
        "single_partition_of_fp32_groups",  # fp32 master weights (with their .grad)
        "param_buffer_of_bit16_for_cpu_offload_groups",  # staging copy of the weights
        "temp_grad_buffer_for_cpu_offload",
        "accumulated_grads_in_cpu",
    ),
    3: (
        "fp32_partitioned_groups_flat",  # fp32 master weights (with their .grad)
        "grad_partitions_flat_buffer",  # gradient partitions
    ),
}
HOST_PARAM_BUFFERS = ("fp16_partitioned_groups_flat", "param_groups_fp16_flat_cpu_memory")
# DeepSpeed's buffers on the compute device: gradient buckets.
DEVICE_BUFFERS = ("ipg_buffer", "temp_grad_buffer_for_gpu_offload", "ipg_buckets")
_MUON = "deepspeed.runtime.zero.muon.muon_optimizer"


def one_process_env() -> dict[str, str]:
    """The rendezvous variables of torch.distributed for a world of one process on this host
    (a dict of environment variables, for ``os.environ.update``)."""
    with socket.socket() as s:  # a free port, so that runs never collide
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }


def _start_deepspeed(device: torch.device):
    """Prepare this (fresh) process for DeepSpeed and import it; returns the module."""
    os.environ.update(one_process_env())
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.type == "cuda" else "cpu")
    # The gloo collectives DeepSpeed calls are deprecated names in recent torch: noise here.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\..* is deprecated")
    warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad")
    warnings.filterwarnings("ignore", message="OMP_NUM_THREADS")  # accelerate sets it on a CPU
    # ZeRO's optimizers import DeepSpeed's Muon optimizer only to ask whether the optimizer they
    # wrap is one. That module compiles kernels with torch.compile when imported (seconds, per
    # process). We never train with Muon, so a stand-in class answers "no" at no cost.
    muon = types.ModuleType(_MUON)
    muon.MuonWithAuxAdam = type("MuonWithAuxAdam", (), {"__doc__": "Stand-in: Muon is unused."})
    sys.modules.setdefault(_MUON, muon)
    import deepspeed  # optional; slow, builds ops when imported

    deepspeed.utils.logger.setLevel(logging.WARNING)
    if device.type == "cpu":
        # DeepSpeed's CPU backend builds a shared-memory all-reduce kernel (a C++ build of a
        # minute or more) when it starts. It speeds up several processes on one host; one
        # process has no peer, so we mark it unavailable and DeepSpeed uses plain gloo.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    set_current(device)  # DeepSpeed uses the current CUDA device
    return deepspeed


def _stop_deepspeed() -> None:
    """Destroy the process group DeepSpeed created, if any."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _tensors(obj, depth: int = 3):
    """Tensors (and their .grad) inside ``obj``: a tensor, or lists/dicts/objects holding them."""
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
    elif depth > 0:
        if isinstance(obj, dict):
            obj = list(obj.values())
        elif hasattr(obj, "buffer") and not isinstance(obj, (list, tuple)):
            obj = [obj.buffer]  # DeepSpeed's gradient bucket objects
        if isinstance(obj, (list, tuple)):
            for item in obj:
                yield from _tensors(item, depth - 1)


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and repeats counted once)."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def tensor_bytes(tensors) -> int:
    """Bytes of the elements of ``tensors`` (each distinct tensor once, views at their size)."""
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


@dataclass
class HostTensorsResult:
    """DeepSpeed's tensors on the offload device, by owner."""

    buffers: list[torch.Tensor]  # its offload buffers (master weights, gradient partitions, ...)
    optimizer_state: list[torch.Tensor]  # the wrapped torch optimizer's state (AdamW's moments)

    def all_tensors(self) -> list[torch.Tensor]:
        """Buffers and optimizer state together."""
        return self.buffers + self.optimizer_state


def host_tensors(ds_optimizer, stage: int, offload_params: bool) -> HostTensorsResult:
    """DeepSpeed's host-side tensors: its offload buffers and the wrapped optimizer's state."""
    names = HOST_BUFFERS[stage] + (HOST_PARAM_BUFFERS if offload_params else ())
    buffers = [t for n in names for t in _tensors(getattr(ds_optimizer, n, None))]
    inner = getattr(ds_optimizer, "optimizer", None)
    state = [t for s in getattr(inner, "state", {}).values() for t in _tensors(s)]
    return HostTensorsResult(buffers=buffers, optimizer_state=state)


def device_buffers(ds_optimizer) -> list[torch.Tensor]:
    """DeepSpeed's gradient buckets on the compute device (allocated once, reused every step)."""
    return [t for n in DEVICE_BUFFERS for t in _tensors(getattr(ds_optimizer, n, None))]


@dataclass
class ZeroConfig:
    """One ZeRO-offload experiment: the model, the batch, and DeepSpeed's config for it.

    Its sizes are ``helpers.train.RunConfig``'s (``from_run`` copies them from one), but it is
    not a RunConfig: what DeepSpeed does (stage, offload, pinning, buckets) is ``ds_config``,
    the config dict lesson 08 writes in a cell (``zero_config``) and DeepSpeed reads as is; the
    RunConfig switches a ZeRO run does not honour (precision, optimizer, attention,
    accumulation, checkpointing, data, FLOPs, LoRA) are left out rather than silently ignored.
    """

    model: str | dict = "llama-tiny"
    ds_config: dict = field(default_factory=dict)  # DeepSpeed's own format (its JSON file's keys)
    batch_size: int = 4
    seq_len: int = 64
    warmup: int = 1
    repeats: int = 3
    budget: int | None = None  # bytes of the pretend device; past it: torch.OutOfMemoryError
    device: str | None = None
    seed: int = 0
    label: str = ""

    def __post_init__(self):
        zero = self.ds_config.get("zero_optimization", {})
        if zero.get("stage") not in (2, 3):
            raise ValueError(
                "ZeroConfig needs ds_config, a DeepSpeed config with zero_optimization stage 2 "
                "or 3 (lesson 08 builds one with its zero_config cell)"
            )
        micro = self.ds_config.get("train_micro_batch_size_per_gpu", self.batch_size)
        if micro != self.batch_size:
            raise ValueError(
                f"ds_config's train_micro_batch_size_per_gpu is {micro} but batch_size is "
                f"{self.batch_size}: build the config for this batch size"
            )

    @property
    def stage(self) -> int:
        """The ZeRO stage of ``ds_config``."""
        return self.ds_config["zero_optimization"]["stage"]

    @property
    def offload_params(self) -> bool:
        """Whether ``ds_config`` offloads the weights (ZeRO-3's ``offload_param``)."""
        offload = self.ds_config["zero_optimization"].get("offload_param", {})
        return offload.get("device", "none") != "none"

    def as_dict(self) -> dict:
        """Plain dict for records and JSON, the stage and weight offload spelled out."""
        return {**asdict(self), "stage": self.stage, "offload_params": self.offload_params}

    @classmethod
    def from_run(cls, run, **overrides) -> ZeroConfig:
        """The ZeRO experiment of a plain ``RunConfig``: the fields they share, ``overrides`` on
        top (``ds_config``, ``label``, ...)."""
        shared = {f.name: getattr(run, f.name) for f in fields(cls) if hasattr(run, f.name)}
        return cls(**{**shared, **overrides})


def _fetched_counter(module: torch.nn.Module):
    """Bytes of ZeRO-3 parameters gathered right now (DeepSpeed's status of each parameter)."""
    # optional; slow, builds ops when imported
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    on_device = (ZeroParamStatus.AVAILABLE, ZeroParamStatus.INFLIGHT)
    params = [(p, p.ds_numel * p.element_size()) for p in module.parameters()]

    def fetched() -> int:
        """Bytes of the parameters DeepSpeed has gathered or is gathering."""
        return sum(nbytes for p, nbytes in params if p.ds_status in on_device)

    return fetched


def _cpu_model(run: ZeroConfig):
    """``run``'s model config, its model built on the CPU (DeepSpeed moves or partitions it at
    initialize), the parameter count (before ZeRO-3 partitions them away), its DeepSpeed config."""
    config = load_config(run.model)
    model = build_model(config, device="cpu", seed=run.seed)
    return config, model, count_params(model), run.ds_config


@dataclass
class _ZeroSetup:
    """A run ready to train through DeepSpeed."""

    engine: Any  # DeepSpeed's engine around the model
    ds_optimizer: Any  # its ZeRO optimizer around the torch AdamW
    batch: dict[str, torch.Tensor]  # the run's batch, on the engine's device
    ds_config: dict  # the DeepSpeed config it was initialised with
    n_params: int  # the model's parameters, counted before ZeRO-3 partitioned them


def build_engine(run: ZeroConfig, device: torch.device) -> _ZeroSetup:
    """DeepSpeed's engine and ZeRO optimizer for ``run``, with its batch on the device.

    Call it in a fresh process: DeepSpeed starts a process group and keeps global state.
    """
    deepspeed = _start_deepspeed(device)  # one_process_env(), DS_ACCELERATOR, import deepspeed
    config, model, n_params, ds_config = _cpu_model(run)  # the model on the CPU, run.ds_config
    optimizer = make_optimizer("adamw", model)  # the same torch AdamW as the plain runs
    engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config
    )
    data = random_batch(
        task_kind(config), run.batch_size, run.seq_len, config.vocab_size, seed=run.seed
    )
    batch = {k: v.to(engine.device) for k, v in data.items()}
    return _ZeroSetup(engine, ds_optimizer, batch, ds_config, n_params)


# Lesson 08 writes engine_step in a cell and hands it to measure_zero and zero_step, which run
# that cell's code; this copy is the preflight's (tests/test_deepspeed_zero.py keeps the two
# the same code). DeepSpeedEngine.zero_grad() takes no set_to_none, so the course's
# helpers.train.train_step does not fit the engine.
def engine_step(engine, batch):
    """One training step through DeepSpeed's engine; returns the loss.

    The engine owns the step: engine.backward replaces loss.backward(), and engine.step the
    optimizer's step and zero_grad (its ZeRO optimizer clears the gradients).
    """
    loss = engine(**batch).loss  # ZeRO-3: fetches each layer's weights before it runs
    engine.backward(loss)  # the gradients stream into DeepSpeed's host buffers
    engine.step()  # AdamW on the host's fp32 copies; the updated weights go back
    return loss


def _engine_step(setup: _ZeroSetup, step_fn=engine_step, losses: list[float] | None = None):
    """``step_fn(engine, batch)`` on the run's batch as a callable; each loss to ``losses``."""
    engine, batch = setup.engine, setup.batch

    def step() -> None:
        """Forward, backward and optimizer step, each through the engine."""
        loss = step_fn(engine, batch)
        if losses is not None:
            losses.append(float(loss.detach()))

    return step


def zero_step(run: ZeroConfig, step_fn=engine_step):
    """One DeepSpeed training step of ``run`` (``step_fn``: lesson 08's ``engine_step``) as a
    callable: a contender to time in a process of its own (``helpers.isolate.bench``), next to
    ``helpers.train.trainee_step``."""
    return _engine_step(build_engine(run, resolve(run.device)), step_fn)


def measure_zero(run: ZeroConfig, step_fn=engine_step):
    """Train ``run`` with DeepSpeed ZeRO + CPU offload in this process; one Record of it.

    ``step_fn(engine, batch)`` is the training step (lesson 08 writes ``engine_step`` in a
    cell). Call it in a fresh process. ``memory`` holds the device side by category (on a CPU the
    tracker's ``OffloadView``, on a GPU the allocator's peak). ``extra`` holds the lesson's own
    measurements: ``offloaded``, the bytes DeepSpeed keeps in host buffers (and on which
    devices), ``resident``, what the model itself holds between steps, ``fetched``, the most
    ZeRO-3 weights on the device at once (CPU), and DeepSpeed's estimate for this setup.
    """
    t0 = time.perf_counter()
    device = resolve(run.device)
    cap = contextlib.nullcontext()
    if run.budget and device.type == "cuda":  # caps the allocator for the whole run
        cap = memory_budget(run.budget, device=device)
    try:
        with cap:
            return _measure(run, device, t0, step_fn)
    finally:
        _stop_deepspeed()


def _measure(run: ZeroConfig, device: torch.device, t0: float, step_fn):
    """``measure_zero``'s steps: warm up, one tracked step, the timed steps; their Record."""
    setup = build_engine(run, device)
    losses: list[float] = []
    step = _engine_step(setup, step_fn, losses)
    for _ in range(max(1, run.warmup)):  # creates the optimizer state and the buckets
        step()
    tracker = _tracked_step(step, setup, run, device)
    timing = time_fn(step, device, warmup=0, repeats=run.repeats)
    return _zero_record(run, device, setup, tracker, timing, losses, t0)


def _tracked_step(step, setup: _ZeroSetup, run: ZeroConfig, device: torch.device):
    """One steady-state step, measured: on a GPU by the allocator (peaks reset; returns None),
    elsewhere by a CategoryTracker that leaves DeepSpeed's offload buffers out (returned)."""
    if device.type == "cuda":
        reset_device_peaks(device)
        step()
        return None
    host = host_tensors(setup.ds_optimizer, run.stage, run.offload_params)
    view = OffloadView(
        device,
        {t.untyped_storage().data_ptr() for t in host.all_tensors()},
        fetched=_fetched_counter(setup.engine.module) if run.stage == 3 else None,
    )
    tracker = CategoryTracker(budget=run.budget, offload=view)
    tracker.track_external(setup.engine.module, *device_buffers(setup.ds_optimizer))
    with tracker:
        step()
    return tracker


def _owner_bytes(setup: _ZeroSetup, run: ZeroConfig) -> dict:
    """Where the bytes live between steps, by owner: the model's tensors, DeepSpeed's host side."""
    host = host_tensors(setup.ds_optimizer, run.stage, run.offload_params)  # state exists now
    params = list(setup.engine.module.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    return {
        "resident": tensor_bytes(params + grads),
        "resident_params": tensor_bytes(params),
        "offloaded": storage_bytes(host.all_tensors()),
        "offloaded_optimizer_state": storage_bytes(host.optimizer_state),
        "offloaded_on": sorted({str(t.device) for t in host.buffers}),
    }


def _tracked_categories(tracker: CategoryTracker) -> dict[str, int]:
    """The tracked step's device bytes by category; fetched ZeRO-3 weights count as params."""
    cat = tracker.peaks().as_dict()
    memory = {k: cat[k] for k in ("gradients", "activations", "temporaries")}
    memory["params"] = max(cat["params"], tracker.fetched_max)
    memory["optimizer_state"] = cat["optimizer_state"]
    memory["peak"] = tracker.device_peak
    return memory


def _largest_layer(module: torch.nn.Module) -> int:
    """Parameters of the largest single module, ZeRO-3's partitioned ones at their full size."""
    return max(
        sum(
            p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in m.parameters(recurse=False)
        )
        for m in module.modules()
    )


def _own_estimate(run: ZeroConfig, setup: _ZeroSetup) -> dict:
    """DeepSpeed's own estimate of the model states for this very setup, and the largest layer
    it is based on: ``deepspeed_estimate`` is [device bytes, host bytes], or None."""
    option = "ZeRO-2 + offload optimizer"
    if run.stage == 3:
        option = "ZeRO-3 + offload optimizer" + (" + params" if run.offload_params else "")
    largest = _largest_layer(setup.engine.module)
    estimate = deepspeed_estimates(setup.n_params, largest)
    mine = estimate[option] if estimate else None
    return {
        "largest_layer": largest,
        "deepspeed_estimate": [mine.device, mine.host] if mine else None,
    }


def _zero_record(run: ZeroConfig, device, setup: _ZeroSetup, tracker, timing, losses, t0):
    """The Record of a measured ZeRO run: device categories in ``memory``, the rest in ``extra``."""
    extra = _owner_bytes(setup, run)
    memory = {}
    if tracker is not None:
        memory = _tracked_categories(tracker)
        extra["fetched"] = tracker.fetched_max
    allocator = allocator_peaks(device)
    if allocator is not None:
        memory["peak"] = allocator.allocated
    extra.update(_own_estimate(run, setup))
    report = hardware_report(device)
    return Record(
        config={**run.as_dict(), "zero": setup.ds_config["zero_optimization"]},
        device=report.as_dict(),
        n_params=setup.n_params,
        memory=memory,
        allocator=asdict(allocator) if allocator else None,
        nvml_used=nvml_used_bytes(device),
        step_time=timing.median,
        step_times=timing.times,
        samples_per_s=run.batch_size / timing.median,
        tokens_per_s=run.batch_size * run.seq_len / timing.median,
        losses=losses,
        extra=extra,
        wall_s=time.perf_counter() - t0,
    )


@dataclass
class TrainerResult:
    """What a Trainer run with a DeepSpeed config gave back."""

    losses: list[float] = field(default_factory=list)
    uniform_loss: float = 0.0  # log(n_states) of the learnable task
    engine: str = ""  # the wrapper class the Trainer trained through
    resident_params: int = 0  # bytes the model's parameters held after training
    n_params: int = 0
    train_s: float = 0.0


def train_with_trainer(run: ZeroConfig, steps: int, arguments) -> TrainerResult:
    """Train ``run`` with ``Trainer`` for ``steps`` steps, DeepSpeed configured by ``arguments``.

    ``arguments(run, output_dir, steps)`` gives the ``TrainingArguments`` (lesson 08 writes it
    in a cell: ``deepspeed=run.ds_config``). Call it in a fresh process. The Trainer builds its
    AdamW, hands it and the model to DeepSpeed, and trains on the learnable Markov task.
    """
    from transformers import Trainer  # seconds; quiet: a fresh process runs in helpers.quiet

    _start_deepspeed(resolve(run.device))
    config, model, n_params, _ = _cpu_model(run)
    task = MarkovTask(n_states=min(64, config.vocab_size), seed=run.seed)
    data = markov_dataset(task, task_kind(config), steps * run.batch_size, run.seq_len, run.seed)
    try:
        with tempfile.TemporaryDirectory() as out:
            args = arguments(run, out, steps)
            # quiet: the losses come back in the result
            trainer = quiet_trainer(Trainer(model=model, args=args, train_dataset=data))
            t0 = time.perf_counter()
            trainer.train()
            train_s = time.perf_counter() - t0
        return TrainerResult(
            losses=[h["loss"] for h in trainer.state.log_history if "loss" in h],
            uniform_loss=task.uniform_loss,
            engine=type(trainer.model_wrapped).__name__,
            resident_params=tensor_bytes(list(trainer.model.parameters())),
            n_params=n_params,
            train_s=train_s,
        )
    finally:
        _stop_deepspeed()


# ---- sizes, DeepSpeed's estimators, and the decision tree -----------------------------------


def widen(config: dict, factor: int) -> dict:
    """A decoder config ``factor`` times as wide: hidden, MLP and head counts (head size kept).

    Model configs stay dicts in transformers' ``config.json`` format: that is what
    ``RunConfig.model`` and ``ZeroConfig.model`` accept and what a record stores as JSON.
    """
    out = dict(config)
    out["hidden_size"] = config["hidden_size"] * factor
    out["intermediate_size"] = config["intermediate_size"] * factor
    out["num_attention_heads"] = config["num_attention_heads"] * factor
    if config.get("num_key_value_heads"):
        out["num_key_value_heads"] = config["num_key_value_heads"] * factor
    return out


def layer_counts(config) -> tuple[int, int]:
    """(parameters, parameters of the largest single module), counted on the meta device."""
    from transformers import AutoModelForCausalLM  # the modeling code: seconds

    config = load_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return total, largest


def oversized_config(config, budget: int, over: float = 1.5, layers: int = 4) -> dict:
    """The scale's decoder, ``layers`` deep and widened until 16 B/param exceed ``over x budget``.

    Widening (not deepening) grows the model states (~width²) faster than the activations
    (~width), so the offloaded run still fits the budget while the plain one cannot. The result
    is a ``config.json`` dict, as ``widen``'s.
    """
    base = load_config(config).to_dict()
    base["num_hidden_layers"] = layers
    for factor in range(1, 65):
        candidate = widen(base, factor)
        if BYTES_PER_PARAM * layer_counts(candidate)[0] >= over * budget:
            return candidate
    raise ValueError("no width up to 64x makes the model states exceed the budget")


@dataclass
class EstimateResult:
    """DeepSpeed's estimate of the model states' bytes for one ZeRO option."""

    device: int  # bytes on the GPU
    host: int  # bytes in host RAM


def deepspeed_estimates(n_params: int, largest_layer: int) -> dict[str, EstimateResult] | None:
    """DeepSpeed's own model-state estimates by ZeRO option ("ZeRO-2", "ZeRO-3 + offload
    optimizer", ...); None without DeepSpeed.

    These are the functions behind ``estimate_zero{2,3}_model_states_mem_needs_all_cold``, for
    one GPU on one node, with DeepSpeed's default 1.5x host buffer factor. They assume 16-bit
    weights on the GPU (2 B/param) and fp32 master weights, gradients and Adam state.
    """
    try:
        # optional; slow, builds ops when imported
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    except Exception:  # not installed, or failing to import: the caller says what it skips
        return None
    out = {}
    for offload in (False, True):
        host, gpu = estimate_zero2_model_states_mem_needs(n_params, cpu_offload=offload)
        out[f"ZeRO-2{' + offload optimizer' if offload else ''}"] = EstimateResult(gpu, host)
    for offload, params in ((False, False), (True, False), (True, True)):
        host, gpu, _ = estimate_zero3_model_states_mem_needs(
            n_params, largest_layer, cpu_offload=offload, cpu_offload_params=params
        )
        name = (
            "ZeRO-3" + (" + offload optimizer" if offload else "") + (" + params" if params else "")
        )
        out[name] = EstimateResult(gpu, host)
    return out


@dataclass
class PlanResult:
    """The single-GPU guide's DeepSpeed decision tree applied to one model, and its numbers."""

    choice: str  # "plain" | "ZeRO-2 + offload optimizer" | "ZeRO-3 + offload ..." | "NVMe ..."
    device_need: int  # bytes the chosen setup needs on the device (model states + activations)
    host_need: int  # bytes it needs in host RAM (0 for plain)
    reason: str


def plan(
    n_params: int,
    largest_layer: int,
    activations: int,
    budget: int,
    host_ram: int,
    bytes_per_param: int = BYTES_PER_PARAM,
) -> PlanResult:
    """Fits: no DeepSpeed; else ZeRO-2, then ZeRO-3 with CPU offload; else NVMe (single-GPU guide).

    fp32 arithmetic of this course: weights 4 B/param on the device with ZeRO-2; ZeRO-3 keeps
    only the largest layer's weights and gradients there; the host holds the rest with the same
    1.5x buffer factor DeepSpeed's estimator uses.
    """
    plain = bytes_per_param * n_params + activations
    if plain <= budget:
        return PlanResult(
            "plain",
            plain,
            0,
            f"{plain / MiB:,.0f} MiB fit the {budget / MiB:,.0f} MiB "
            "budget: DeepSpeed would only add copies and slow the step down",
        )
    host = int(1.5 * bytes_per_param * n_params)
    zero2 = FP32 * n_params + activations
    if zero2 <= budget and host <= host_ram:
        return PlanResult(
            "ZeRO-2 + offload optimizer",
            zero2,
            host,
            f"the fp32 weights ({FP32 * n_params / MiB:,.0f} MiB) and activations fit on "
            "the device; gradients and optimizer go to host RAM",
        )
    zero3 = 2 * FP32 * largest_layer + activations
    if zero3 <= budget and host <= host_ram:
        return PlanResult(
            "ZeRO-3 + offload optimizer + params",
            zero3,
            host,
            "only one layer's weights and gradients at a time plus activations fit on "
            "the device; everything else lives in host RAM",
        )
    if zero3 <= budget:
        return PlanResult(
            "ZeRO-3 + NVMe offload",
            zero3,
            host,
            f"host RAM ({host_ram / GiB:,.0f} GiB) is smaller than the "
            f"{host / GiB:,.0f} GiB the offloaded states need: offload to NVMe",
        )
    return PlanResult(
        "more devices", zero3, host, "even one layer plus activations exceed the budget"
    )


def host_ram_bytes() -> int:
    """Physical memory of this machine in bytes."""
    try:
        import psutil  # optional

        return int(psutil.virtual_memory().total)
    except ImportError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_peak(rec) -> int:
    """A run's device-side peak (a Record): the allocator's on a GPU, the tracker's elsewhere."""
    return rec.allocator["allocated"] if rec.allocator else rec.memory["peak"]


def host_bytes(rec) -> int:
    """Bytes a run's DeepSpeed keeps in host buffers (0 for a plain run)."""
    return rec.extra.get("offloaded", 0)


def timing_mode(records: dict, device=None) -> str:
    """``compare_benches`` mode for timing the measured runs ``records`` against each other.

    "workers" (all alive at once) when their measured device peaks fit the GPU together, with
    the allocator's margin and a CUDA context each, and their host buffers and the models
    built on the host fit in half the RAM; else "fresh" (one at a time, rebuilt each round).
    On a CPU the device is the host, so device peaks count against the RAM.
    """
    device = resolve(device)
    on_device = sum(device_peak(r) for r in records.values()) * (1 + RESERVE_MARGIN)
    host = sum(host_bytes(r) + 4 * (r.n_params or 0) for r in records.values())
    if is_cuda(device):
        on_device += (len(records) + 1) * ASSUMED_CONTEXT
        if on_device > gpu_info(device).total_memory:
            return "fresh"
    else:
        host += on_device
    return "workers" if host <= host_ram_bytes() // 2 else "fresh"


def placement_figure(device: dict[str, dict[str, int]], host: dict[str, int], budget: int):
    """Two panels: per-run device bytes stacked by category with the budget line; host bytes."""
    from matplotlib.figure import Figure  # slow: only figures need it

    fig = Figure(figsize=(10, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2, sharey=True)
    labels = list(device)
    bottoms = [0.0] * len(labels)
    for cat in STEP_CATEGORIES:
        values = [device[lab].get(cat, 0) / MiB for lab in labels]
        left.bar(labels, values, bottom=bottoms, label=cat, color=CATEGORY_COLORS.get(cat))
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    left.plot(labels, [device[lab].get("peak", 0) / MiB for lab in labels], "ko", label="peak")
    left.axhline(budget / MiB, color="red", linestyle="--", linewidth=1, label="budget")
    left.set_ylabel("MiB")
    left.set_title("on the compute device")
    right.bar(list(host), [v / MiB for v in host.values()], color="#937860")
    right.set_title("in DeepSpeed's host buffers")
    category_labels(left, labels)
    category_labels(right, list(host))
    # To the right of both panels: inside the left one it would cover bars.
    fig.legend(*left.get_legend_handles_labels(), loc="outside right upper", fontsize="small")
    return fig
