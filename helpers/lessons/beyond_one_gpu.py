"""Lesson 17, sections 1-4 (notebooks/17_beyond_one_gpu.ipynb): beyond one GPU.

Lesson 07's loop (``helpers.lessons.accelerate_loop.accelerate_train``) run by several
processes at once, data parallel (DDP: every process holds the whole training state) and fully
sharded (FSDP2, ``torch.distributed.fsdp.fully_shard``: each process holds 1/N of it, ZeRO-3 of
lesson 08 by another name). ``launch`` starts the processes with ``torchrun`` or
``accelerate launch``; each runs this module (``python -m helpers.lessons.beyond_one_gpu``),
trains, tracks one steady-state step's memory by category, counts the bytes its collectives
move, and prints one JSON line that ``launch`` collects into a ``ParallelResult``.

Where the processes run: one GPU each with NCCL where there are enough CUDA GPUs, else the
CPU with gloo (``place_rank`` says why), which is how the course's CI runs it.

Who shards: on GPUs, Accelerate (``accelerate launch --use_fsdp --fsdp_version 2``, or the
same settings as environment variables under ``torchrun``) applies ``fully_shard`` inside
``accelerator.prepare``. Accelerate 1.15 runs FSDP only for GPU-like devices: on CPU processes
it sets up multi-CPU data parallelism and refuses an already sharded model. So on the CPU
this module applies ``fully_shard`` itself, the calls Accelerate makes (each transformer layer,
the input embedding, the final norm with the head, then the root), then makes the optimizer
on the sharded parameters (the order the FSDP2 docs ask for), gives each process its share of
the batches, and lets the loop's ``Accelerator`` see one process (``_one_process_view``). The
loop itself is unchanged.

How memory is seen: DDP and one process, by the course's ``CategoryTracker`` (DDP's gradient
buckets, allocated in C++ when the model is wrapped, are registered with it as their own line);
FSDP2, by PyTorch's ``FSDPMemTracker``, which knows sharded and gathered parameters and
gradients and the collectives' buffers (``fsdp_category_tracker``: its categories mapped to
the course's). Communication: ``CollectiveCounter`` counts the payload of every collective
one step issues; ``helpers.estimator.parallel.traffic`` counts the same from the model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, Subset

from helpers import device as dev
from helpers.estimator.parallel import fsdp_units
from helpers.lessons.accelerate_loop import (
    LoopConfig,
    LoopResult,
    StepMeter,
    accelerate_train,
    loop_parts,
)
from helpers.memory import fsdp_category_tracker
from helpers.memory_savers import selective_context_fn
from helpers.models import apply_lora, enable_checkpointing
from helpers.names import MiB
from helpers.plots import CATEGORY_COLORS, category_labels, legend_outside
from helpers.quiet import quiet_libraries
from helpers.results import Record
from helpers.scale import TINY
from helpers.train import make_optimizer

if TYPE_CHECKING:  # the processes import this module too: matplotlib only where it draws
    from matplotlib.figure import Figure

STRATEGIES = ("single", "ddp", "fsdp")  # one process; data parallel; fully sharded (FSDP2)
LAUNCHERS = ("torchrun", "accelerate")
RESULT_PREFIX = "rank-result "  # each process prints its RankResult as this prefix + JSON
RESULTS_ENV = "BEYOND_ONE_GPU_RESULTS"  # a folder where each process also writes rank<i>.json
# The course's categories, then what spreading the step over processes adds:
STEP_KEYS = ("params", "gradients", "optimizer_state", "activations", "temporaries")
EXTRA_KEYS = ("gathered_params", "gathered_gradients", "communication_buffers")
MEMORY_KEYS = (*STEP_KEYS, "buffers", "inputs", *EXTRA_KEYS)
# Environment variables through which a launcher tells a process who it is.
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclass
class ParallelConfig:
    """One multi-process run of lesson 07's loop (names as LoopConfig where they exist)."""

    model: str = "llama-tiny"  # no dropout: every process's loss is a function of its data only
    strategy: str = "ddp"  # "single" | "ddp" | "fsdp"
    world_size: int = 2  # processes
    launcher: str = "torchrun"  # "torchrun" | "accelerate"
    per_device_train_batch_size: int = 2
    seq_len: int = 64
    mixed_precision: str = "no"  # Accelerator's names; "no" keeps every category 4 B/number
    weight_dtype: str = "fp32"  # "bf16": weights, gradients and AdamW's state in 2 B/number
    # FSDP2's MixedPrecisionPolicy: "bf16" gathers and computes each unit in bf16 over fp32
    # shards (reduce_dtype fp32); "" none (on GPUs Accelerate sets its own from
    # mixed_precision)
    param_dtype: str = ""
    optimizer: str = "adamw"
    bf16_update: str = "nearest"  # bf16 weights' AdamW (RunConfig's): nearest | stochastic | kahan
    # RunConfig's savers, applied before sharding: LoRA adapters (rank; peft's targets) on the
    # frozen model, activation checkpointing of every layer with RunConfig's policy.
    lora_r: int = 0
    lora_targets: str = ""
    gradient_checkpointing: bool = False
    checkpoint_policy: str = "full"  # "full" | "selective" (lesson 16's save_matmuls)
    max_steps: int = 4  # optimizer steps
    # DDP rebuilds its buckets in step 1 (in the order backward produced the gradients), so
    # step 2 is the first steady one: its collectives are counted (and DDP's buckets kept),
    # step 3's memory is tracked (the optimizer state exists since step 0).
    count_step: int = 2
    track_step: int = 3
    learning_rate: float = 1e-3
    seed: int = 0
    threads: int = 1  # OMP_NUM_THREADS per process: 2 processes on 2 cores
    cpu: bool = False  # force the CPU (gloo) even where GPUs exist
    timeout: float = 300.0  # seconds for the whole launch

    def loop_config(self, cpu: bool) -> LoopConfig:
        """Lesson 07's LoopConfig for one process: no accumulation, so a step is one forward
        and one backward and its categories compare to the estimator's (checkpointing, with
        its policy, and LoRA are applied by ``_prepare_rank``)."""
        return LoopConfig(
            model=self.model, per_device_train_batch_size=self.per_device_train_batch_size,
            gradient_accumulation_steps=1, seq_len=self.seq_len,
            mixed_precision=self.mixed_precision, weight_dtype=self.weight_dtype,
            gradient_checkpointing=False,
            optimizer=self.optimizer, max_steps=self.max_steps, track_step=self.track_step,
            learning_rate=self.learning_rate, seed=self.seed, cpu=cpu,
        )  # fmt: skip


@dataclass
class RankResult:
    """What one process measured: its losses, one step's memory, its collectives."""

    rank: int = 0
    world_size: int = 1
    strategy: str = "single"
    backend: str = ""  # "nccl" | "gloo" | "" (one process)
    device: str = "cpu"
    losses: list[float] = field(default_factory=list)  # this process's loss per step
    memory: dict = field(default_factory=dict)  # MEMORY_KEYS + peak: each one's largest bytes
    step_times: list[float] = field(default_factory=list)  # seconds, untracked steps
    n_params: int = 0  # the model's parameters
    local_params: int = 0  # parameters this process stores (its shards under FSDP)
    collectives: dict = field(default_factory=dict)  # op -> {"calls", "bytes"} in one step
    sharded_by: str = ""  # FSDP: "accelerate" or "this module" (on the CPU)
    note: str = ""  # why the processes run where they run


@dataclass
class ParallelResult:
    """Every process's RankResult of one launch, and how it was launched."""

    config: ParallelConfig
    ranks: list[RankResult]
    command: list[str]
    wall_s: float

    def rank(self, i: int = 0) -> RankResult:
        """Process ``i``'s result."""
        return next(r for r in self.ranks if r.rank == i)

    @property
    def losses(self) -> list[float]:
        """Per step, the mean of the processes' losses: the loss of the global batch."""
        return [
            statistics.fmean(step) for step in zip(*(r.losses for r in self.ranks), strict=True)
        ]

    def collective_bytes(self, rank: int = 0) -> int:
        """Payload bytes of every collective one step issued on process ``rank``."""
        return sum(c["bytes"] for c in self.rank(rank).collectives.values())


# --------------------------------------------------------------------------------------------
# Where each process runs


@dataclass(frozen=True)
class Placement:
    """A process's backend and device, and why (empty when nothing needs saying)."""

    backend: str
    device: torch.device
    note: str = ""


def place_rank(local_rank: int, local_world_size: int, cpu: bool = False) -> Placement:
    """NCCL and GPU ``local_rank`` where every local process has a CUDA GPU, else gloo on the
    CPU, saying why when GPUs exist (NCCL refuses two processes on one GPU)."""
    if cpu or not dev.cuda_available():
        return Placement("gloo", torch.device("cpu"))
    if dev.present(torch.device("cuda", local_world_size - 1)):
        return Placement("nccl", torch.device("cuda", local_rank))
    found = sum(dev.present(torch.device("cuda", i)) for i in range(local_world_size))
    note = (
        f"{local_world_size} processes but {found} CUDA GPU{'s' * (found != 1)}: NCCL needs one "
        "GPU per process, so the processes run on the CPU with gloo"
    )
    return Placement("gloo", torch.device("cpu"), note)


def _init_process_group(placement: Placement) -> None:
    """Join the processes (torchrun's environment names the others), on the process's GPU."""
    if placement.device.type == "cuda":
        dev.set_current(placement.device)
    if not dist.is_initialized():
        kwargs = {"device_id": placement.device} if placement.device.type == "cuda" else {}
        dist.init_process_group(placement.backend, **kwargs)


# --------------------------------------------------------------------------------------------
# FSDP2 by hand (what Accelerate does on GPUs), for processes on the CPU


def shard_by_hand(model: torch.nn.Module, param_dtype: str = "") -> list[str]:
    """``fully_shard`` the units Accelerate 1.15 makes on GPUs (``fsdp_units``: each
    transformer layer, the input embedding, the final norm with the head, then the root).
    Each parameter becomes a DTensor holding this process's share, so the optimizer is made
    afterwards, on ``model.parameters()`` (PyTorch's ``fully_shard`` docs and FSDP2 tutorial).
    ``param_dtype="bf16"``: every unit with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32)``. Returns the units' names."""
    policy = MixedPrecisionPolicy()
    if param_dtype:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    units = fsdp_units(model)
    for unit in units[:-1]:
        modules = list(unit.modules) if len(unit.modules) > 1 else unit.modules[0]
        fully_shard(modules, reshard_after_forward=unit.reshard_after_forward, mp_policy=policy)
    fully_shard(model, mp_policy=policy)  # the root: kept gathered from forward to backward
    return [u.name for u in units]


def rank_loader(loader, rank: int, world_size: int):
    """This process's batches, as Accelerate hands them out: batch i goes to process i % N."""
    b = loader.batch_size
    mine = [i for i in range(len(loader.dataset)) if (i // b) % world_size == rank]
    return DataLoader(Subset(loader.dataset, mine), batch_size=b)


@contextlib.contextmanager
def _one_process_view():
    """Hide the launcher's environment while the loop creates its Accelerator, which then
    sees one process: it neither wraps the (sharded) model in DDP nor shards the data again."""
    hidden = {k: os.environ.pop(k) for k in (*DIST_ENV, "ACCELERATE_USE_FSDP") if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(hidden)


def _accelerate_fsdp_env() -> dict[str, str]:
    """What ``accelerate launch --use_fsdp --fsdp_version 2`` sets for the processes."""
    return {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
            "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
            "FSDP_RESHARD_AFTER_FORWARD": "true"}  # fmt: skip


def strategy_from_env(strategy: str) -> str:
    """``strategy``, unless ``accelerate launch --use_fsdp`` says FSDP (2; FSDP1 is refused)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return strategy
    if os.environ.get("FSDP_VERSION", "1") != "2":
        raise ValueError("this lesson shows FSDP2: launch with --use_fsdp --fsdp_version 2")
    return "fsdp"


# --------------------------------------------------------------------------------------------
# Counting what the collectives move


class CollectiveCounter(TorchDispatchMode):
    """Counts every collective (all-reduce, all-gather, reduce-scatter, broadcast) dispatched
    while active: calls and payload bytes per op (the full-size side: an all-gather's output,
    a reduce-scatter's input), and keeps the tensors each all-reduce reduced (DDP's buckets).

    DDP's reducer and FSDP2 issue their collectives through PyTorch's dispatcher (the c10d
    ops), so a dispatch mode sees them. DTensor operations are let through to DTensor
    (``NotImplemented``), whose own local operations and collectives then come back here.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, dict[str, int]] = {}
        self.reduced: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        # "c10d::allreduce_", "_c10d_functional::all_gather_into_tensor", ...
        space, _, name = func.name().partition("::")
        if space in ("c10d", "_c10d_functional") and name not in _NOT_COLLECTIVES:
            entry = self.ops.setdefault(name, {"calls": 0, "bytes": 0})
            entry["calls"] += 1
            entry["bytes"] += max(_tensor_bytes(a) for a in args[:2])
            if name == "allreduce_":
                self.reduced += list(_tensors(args[0]))
        return out


# Ops of the c10d namespaces that move no data between processes.
_NOT_COLLECTIVES = ("wait_tensor", "barrier", "monitored_barrier", "_wrap_tensor_autograd")


def _tensors(obj):
    """Tensors in ``obj``: a tensor or (nested) lists and tuples of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def _tensor_bytes(obj) -> int:
    """Bytes of the tensors in ``obj``."""
    return sum(t.numel() * t.element_size() for t in _tensors(obj))


# --------------------------------------------------------------------------------------------
# One process: lesson 07's loop, measured between its steps


@dataclass
class RankMeter(StepMeter):
    """Lesson 07's StepMeter with the tracker this strategy needs: FSDPMemTracker's view for
    FSDP2; for DDP, the course's tracker with DDP's gradient buckets registered as their own
    line (``buckets``, the tensors the counted step all-reduced)."""

    strategy: str = "single"
    root: torch.nn.Module | None = None  # FSDP: the sharded model
    buckets: list = field(default_factory=list)

    def begin(self, step: int, model, optimizer, device: torch.device) -> None:
        """Start step ``step``, with the strategy's tracker if it is the tracked one."""
        if step != self.track_step or self.strategy != "fsdp":
            super().begin(step, model, optimizer, device)
            if self.tracker is not None and self.buckets:
                self.tracker.track_external(*self.buckets)  # tracked as "inputs"
            return
        inner = getattr(optimizer, "optimizer", optimizer)
        self.tracker = fsdp_category_tracker(self.root, inner, device)
        self.tracker.__enter__()
        self.start = time.perf_counter()

    def end(self) -> None:
        """End the step: its memory in the course's keys if tracked, else its seconds."""
        tracker = self.tracker
        if tracker is not None and self.strategy == "fsdp":
            tracker.__exit__(None, None, None)
            self.result.memory, self.tracker = tracker.peaks(), None
            return
        super().end()
        if tracker is not None:  # only DDP's buckets were registered as "inputs": name them
            self.result.memory = _buckets_named(self.result.memory)
            self.result.memory["peak_at"] = _buckets_named(self.result.memory["peak_at"])


def _buckets_named(memory: dict) -> dict:
    """A CategoryTracker's memory dict in MEMORY_KEYS, its "inputs" (DDP's buckets, the only
    tensors registered as such) named communication buffers."""
    out = {**dict.fromkeys(MEMORY_KEYS, 0), **memory}
    out["communication_buffers"], out["inputs"] = out["inputs"], 0
    return out


def _local_params(model: torch.nn.Module) -> int:
    """Parameters stored by this process: its shards' numbers under FSDP2."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def _prepare_rank(cfg: ParallelConfig):
    """Join the processes, build lesson 07's parts, shard them if this process has to; returns
    (loop config, parts, result, meter, whether the loop must see one process)."""
    from transformers import get_constant_schedule  # imports the modeling code: seconds

    world = int(os.environ.get("WORLD_SIZE", "1"))
    strategy = strategy_from_env(cfg.strategy) if world > 1 else "single"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    placement = place_rank(int(os.environ.get("LOCAL_RANK", "0")), local_world, cfg.cpu)
    if world > 1:
        _init_process_group(placement)
    by_hand = strategy == "fsdp" and placement.device.type != "cuda"
    if strategy == "fsdp" and not by_hand:
        for key, value in _accelerate_fsdp_env().items():
            os.environ.setdefault(key, value)  # accelerate launch may have set them already
    loop_cfg = cfg.loop_config(cpu=placement.device.type == "cpu")
    model, optimizer, loader, scheduler = loop_parts(loop_cfg, world)
    model = _with_savers(model, cfg)
    rank = int(os.environ.get("RANK", "0"))
    if by_hand:
        shard_by_hand(model, cfg.param_dtype)
        loader = rank_loader(loader, rank, world)
    if by_hand or cfg.lora_r or cfg.bf16_update != "nearest":
        # Make the optimizer (and its schedule) on the parameters it will update: the shards
        # (after sharding, as the FSDP2 docs ask), the adapters, bf16_update's AdamW. The ones
        # loop_parts made, never stepped and holding no state, are dropped.
        optimizer = make_optimizer(loop_cfg.optimizer, model, lr=loop_cfg.learning_rate,
                                   bf16_update=cfg.bf16_update)  # fmt: skip
        scheduler = get_constant_schedule(optimizer)
    result = RankResult(
        rank=rank, world_size=world, strategy=strategy, backend=placement.backend * (world > 1),
        device=str(placement.device), n_params=sum(p.numel() for p in model.parameters()),
        sharded_by=("this module" if by_hand else "accelerate") * (strategy == "fsdp"),
        note=placement.note,
    )  # fmt: skip
    meter = RankMeter(cfg.track_step, LoopResult(), strategy=strategy, root=model)
    return loop_cfg, (model, optimizer, loader, scheduler), result, meter, by_hand


def _with_savers(model: torch.nn.Module, cfg: ParallelConfig) -> torch.nn.Module:
    """``model`` with ``cfg``'s activation checkpointing (and policy) and LoRA adapters, as
    ``RunConfig`` applies them (``helpers.train``)."""
    if cfg.gradient_checkpointing:
        selective = cfg.checkpoint_policy == "selective"
        enable_checkpointing(model, selective_context_fn() if selective else None)
    if cfg.lora_r:
        model = apply_lora(model, cfg.lora_r, cfg.lora_targets)
    return model


def rank_train(cfg: ParallelConfig) -> RankResult:
    """One process's part: lesson 07's loop, unchanged, with one step counted (collectives)
    and one tracked (memory) between its ``yield``s, as lesson 07's ``train_loop`` does."""
    if not cfg.count_step < cfg.track_step < cfg.max_steps:
        raise ValueError("need count_step < track_step < max_steps")
    loop_cfg, parts, result, meter, by_hand = _prepare_rank(cfg)
    model, optimizer = parts[:2]
    steps = accelerate_train(loop_cfg, *parts)
    device = torch.device(result.device)
    for step in range(cfg.max_steps):
        view = _one_process_view() if by_hand and step == 0 else contextlib.nullcontext()
        counter = CollectiveCounter() if step == cfg.count_step else contextlib.nullcontext()
        meter.begin(step, model, optimizer, device)
        with view, counter:
            loss = next(steps)  # step 0 creates the Accelerator and prepares the parts
        meter.end()
        result.losses.append(loss)
        if step == cfg.count_step:
            result.collectives = counter.ops
            meter.buckets = counter.reduced if result.strategy == "ddp" else []
    for _ in steps:  # runs the loop's end (accelerator.end_training())
        raise RuntimeError(f"the loop trained more than max_steps={cfg.max_steps} steps")
    result.memory, result.step_times = meter.result.memory, meter.result.step_times
    result.local_params = _local_params(model)
    return result


def parse_args(argv: list[str] | None = None) -> ParallelConfig:
    """A ParallelConfig from this module's command line (``_script_args`` writes one)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in fields(ParallelConfig):
        flag, value = "--" + f.name.replace("_", "-"), getattr(ParallelConfig(), f.name)
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    return ParallelConfig(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    """Command line of one process: ``torchrun ... -m helpers.lessons.beyond_one_gpu [options]``."""
    cfg = parse_args(argv)
    with quiet_libraries():
        result = rank_train(cfg)
    line = json.dumps(asdict(result))
    folder = os.environ.get(RESULTS_ENV)
    if folder:  # the launcher reads the files: lines of several processes on one pipe can mix
        with open(os.path.join(folder, f"rank{result.rank}.json"), "w") as f:
            f.write(line)
    sys.stdout.write(f"{RESULT_PREFIX}{line}\n")
    return 0


# --------------------------------------------------------------------------------------------
# Launching the processes


def _free_port() -> int:
    """A TCP port nobody listens on now, for the processes' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script_args(cfg: ParallelConfig) -> list[str]:
    """``cfg`` as this module's command-line options."""
    out = []
    for f in fields(ParallelConfig):
        value, flag = getattr(cfg, f.name), "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out


def launch_command(cfg: ParallelConfig, port: int | None = None) -> list[str]:
    """The command that starts ``cfg.world_size`` processes of this module with its launcher.

    ``torchrun`` (``python -m torch.distributed.run``) starts the processes and sets RANK,
    WORLD_SIZE and the rendezvous address; the module chooses its strategy. ``accelerate
    launch`` does the same through torchrun, with its own flags: ``--multi_gpu`` for DDP, and
    ``--use_fsdp --fsdp_version 2`` for FSDP2 (which the module reads from the environment).
    Its ``--cpu`` flag would start one process only: the module's own ``--cpu`` picks the CPU.
    """
    port = port or _free_port()
    module = ["-m", "helpers.lessons.beyond_one_gpu", *_script_args(cfg)]
    if cfg.launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                "--nproc-per-node", str(cfg.world_size), "--master-addr", "127.0.0.1",
                "--master-port", str(port), *module]  # fmt: skip
    if cfg.launcher != "accelerate":
        raise ValueError(f"unknown launcher {cfg.launcher!r}: use one of {LAUNCHERS}")
    how = ["--multi_gpu"]
    if cfg.strategy == "fsdp":
        how = ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy",
               "TRANSFORMER_BASED_WRAP", "--fsdp_reshard_after_forward", "true"]  # fmt: skip
    return [sys.executable, "-m", "accelerate.commands.launch", *how,
            "--num_processes", str(cfg.world_size), "--num_machines", "1",
            "--mixed_precision", cfg.mixed_precision, "--dynamo_backend", "no",
            "--main_process_port", str(port), *module]  # fmt: skip


def launch_env(cfg: ParallelConfig) -> dict[str, str]:
    """The processes' environment: this checkout importable, ``cfg.threads`` threads each, no
    GPU when ``cfg.cpu``."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": str(cfg.threads)}
    if cfg.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


class LaunchFailed(RuntimeError):
    """The processes did not all report; the message has the command and their last words."""


def launch(cfg: ParallelConfig) -> ParallelResult:
    """Start ``cfg.world_size`` processes with ``cfg.launcher`` and collect their results."""
    if cfg.strategy not in STRATEGIES[1:]:
        raise ValueError(f"launch runs {STRATEGIES[1:]}; strategy 'single' is rank_train(cfg)")
    cmd = launch_command(cfg)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        code, stderr = _run(cmd, {**launch_env(cfg), RESULTS_ENV: folder}, cfg.timeout)
        ranks = [RankResult(**json.loads(p.read_text())) for p in Path(folder).glob("rank*.json")]
    if code or len(ranks) != cfg.world_size:
        raise LaunchFailed(
            f"{' '.join(cmd)}\nexited with {code}, {len(ranks)} of {cfg.world_size} processes "
            f"reported; the end of their output:\n{_last_words(stderr)}"
        )
    return ParallelResult(cfg, sorted(ranks, key=lambda r: r.rank), cmd,
                          time.perf_counter() - t0)  # fmt: skip


LAUNCH_MARK = "COURSE_LAUNCH"  # set in a launch's environment: every process it starts has it


def _run(cmd: list[str], env: dict, timeout: float) -> tuple[int, str]:
    """Run the launcher in a session of its own; on timeout, stop it and every process it
    started. Returns the exit code (-9 when stopped) and the error output.

    torchrun starts its workers in sessions of their own, so stopping the launcher's session
    can leave them running, holding the output pipes open (and waiting for a rendezvous that
    will never come). Every process of the launch carries a mark in its environment; on
    timeout each one that has it is stopped too (Linux's /proc; elsewhere the session only).
    """
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env, LAUNCH_MARK: mark}, start_new_session=True)  # fmt: skip
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _kill_marked(mark)
        _, stderr = proc.communicate()
        stderr += f"\n(stopped after {timeout:.0f} s)"
    return proc.returncode, stderr


def _kill_marked(mark: str) -> None:
    """SIGKILL every process whose environment carries ``LAUNCH_MARK=mark`` (Linux)."""
    wanted = f"{LAUNCH_MARK}={mark}".encode()
    for _ in range(3):  # a process may start another while the first ones are stopped
        found = False
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                if wanted in (entry / "environ").read_bytes().split(b"\0"):
                    os.kill(int(entry.name), signal.SIGKILL)
                    found = True
            except (OSError, ValueError):  # gone meanwhile, or not ours to read
                continue
        if not found:
            return


def _last_words(stderr: str, lines: int = 25) -> str:
    """The last lines of the processes' error output, library notices left out."""
    noise = ("Warning", "warn(", "_pytree", "torchao", "Failed to load")
    kept = [line for line in stderr.splitlines() if not any(n in line for n in noise)]
    return "\n".join(kept[-lines:])


def single_run(cfg: ParallelConfig) -> RankResult:
    """The same loop in one process (call it in a fresh one: Accelerate's state is global)."""
    for key in (*DIST_ENV, "ACCELERATE_USE_FSDP"):
        os.environ.pop(key, None)
    return rank_train(replace(cfg, strategy="single"))


def memory_mib(memory: dict, keys=MEMORY_KEYS) -> dict[str, float]:
    """A memory dict's ``keys`` (and peak) in MiB, for tables."""
    return {k: memory.get(k, 0) / MiB for k in (*keys, "peak")}


def rank_record(result: RankResult, cfg: ParallelConfig, label: str, device: dict):
    """One process's run as a results-store Record: its memory, losses and step times."""
    config = {
        "model": cfg.model, "batch_size": cfg.per_device_train_batch_size,
        "seq_len": cfg.seq_len, "optimizer": cfg.optimizer, "label": label,
        "precision": "fp32" if cfg.mixed_precision == "no" else cfg.mixed_precision,
        "strategy": result.strategy, "world_size": result.world_size,
    }  # fmt: skip
    times = result.step_times
    return Record(
        config=config, device=device, n_params=result.n_params, memory=result.memory,
        step_time=statistics.median(times) if times else None, step_times=times,
        losses=result.losses,
        extra={"rank": result.rank, "backend": result.backend, "local_params": result.local_params,
               "collectives": result.collectives},
    )  # fmt: skip


def lesson_config(scale, world_size: int = 2) -> tuple[ParallelConfig, Placement]:
    """The lesson's run and where its processes go: the scale's decoder on GPUs where each
    process has one, else the tiny scale's on CPU processes (a full-scale model on CPU
    processes would take minutes); the global batch is the scale's, split over the processes."""
    placement = place_rank(0, world_size)
    on_gpus = placement.device.type == "cuda"
    sizes = scale if on_gpus else TINY
    cfg = ParallelConfig(
        model=sizes.decoder, world_size=world_size, seq_len=sizes.seq_len, cpu=not on_gpus,
        per_device_train_batch_size=max(1, sizes.batch_size // world_size),
    )  # fmt: skip
    return cfg, placement


# What spreading the step adds, drawn over the course's categories (plots.CATEGORY_COLORS).
EXTRA_COLORS = {"gathered (FSDP)": "#DD8452", "communication_buffers": "#937860"}


def rank_memory_bars(memories: dict[str, dict], title: str = "") -> Figure:
    """One process's bytes per category (MiB, stacked) for each labelled run, the peak a dot.

    The course's categories first, then what the strategy adds: parameters and gradients
    gathered whole (FSDP) and communication buffers (DDP's buckets, FSDP's all-gather and
    reduce-scatter buffers). Each category's own maximum is stacked, so a stack can exceed the
    peak (the categories peak at different moments); the dot is the real largest total.
    """
    from matplotlib.figure import Figure  # slow: only figures need it

    fig = Figure(figsize=(max(5.5, 1.3 * len(memories) + 3.5), 4), layout="constrained")
    ax = fig.add_subplot()
    labels = list(memories)
    stacks = {k: [memories[lab].get(k, 0) / MiB for lab in labels] for k in STEP_KEYS}
    stacks["gathered (FSDP)"] = [
        (memories[lab].get("gathered_params", 0) + memories[lab].get("gathered_gradients", 0)) / MiB
        for lab in labels
    ]
    stacks["communication_buffers"] = [
        memories[lab].get("communication_buffers", 0) / MiB for lab in labels
    ]
    colors = {**CATEGORY_COLORS, **EXTRA_COLORS}
    bottoms = [0.0] * len(labels)
    for key, values in stacks.items():
        ax.bar(labels, values, bottom=bottoms, label=key, color=colors[key])
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    peaks = [memories[lab].get("peak", 0) / MiB for lab in labels]
    ax.plot(labels, peaks, "ko", label="peak")
    ax.set_ylim(0, 1.05 * max([*bottoms, *peaks, 1e-9]))
    ax.set_ylabel("MiB per process (exact, per category)")
    ax.set_title(title)
    legend_outside(ax)
    category_labels(ax, labels, width=18)
    return fig


if __name__ == "__main__":
    sys.exit(main())
