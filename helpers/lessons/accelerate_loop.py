"""Lesson 07, sections 2-4 (notebooks/07_accelerate_loop.ipynb).

The course's combination as a hand-written training loop on Hugging Face Accelerate.

Micro-batches with gradient accumulation, gradient checkpointing, 16-bit autocast and an
8-bit optimizer, written once with ``Accelerator``. The same function runs in a notebook
(one process), as ``python scripts/train_accelerate.py`` and, unchanged, under
``accelerate launch`` on several processes or GPUs: Accelerate decides the device, wraps the
model for data parallelism and shards the data loader.

``accelerate_train`` is the loop itself, a generator that yields each optimizer step's loss;
the notebook writes out the same function (``tests/test_accelerate_loop.py`` keeps the two
identical). ``train_loop`` is the lesson's measuring wrapper: it builds the parts
(``loop_parts``) and times the steps and tracks one step's memory between the ``yield``s.

``trainer_run`` trains the same configuration with the ``Trainer`` so the two can be
compared: same model, data, micro-batch, accumulation, precision, optimizer and clipping.
Both measure their steps with one ``StepMeter``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch
from torch.utils.data import DataLoader

from helpers.compat import missing_optional
from helpers.data import MarkovTask, markov_dataset
from helpers.memory import CategoryTracker
from helpers.models import (
    WEIGHT_TORCH_DTYPES,
    build_model,
    enable_checkpointing,
    load_config,
    task_kind,
)
from helpers.quiet import quiet_libraries
from helpers.train import make_optimizer, quiet_trainer


@dataclass
class LoopConfig:
    """One training run of the combination (names follow TrainingArguments where they exist)."""

    model: str = "bert-tiny"
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 4
    seq_len: int = 64
    mixed_precision: str = "bf16"  # "no" | "fp16" | "bf16" (Accelerator's names)
    weight_dtype: str = "fp32"  # the weights' storage (and gradients'): "fp32" or "bf16"
    gradient_checkpointing: bool = True
    optimizer: str = "adamw8bit"  # helpers.train.make_optimizer names
    max_steps: int = 3  # optimizer steps
    track_step: int = 1  # which optimizer step's memory to track (0-based; after state exists)
    max_grad_norm: float = 1.0
    learning_rate: float = 1e-3
    seed: int = 0
    cpu: bool = False  # force the CPU even where an accelerator exists


@dataclass
class LoopResult:
    """Loss per optimizer step, the tracked step's exact memory, timing, and who ran it."""

    losses: list[float] = field(default_factory=list)
    memory: dict | None = None  # helpers.memory.CategoryPeaks of the tracked optimizer step
    step_times: list[float] = field(default_factory=list)
    n_params: int = 0
    n_tensors: int = 0  # parameter tensors (CUDA rounds each one's storage)
    device: str = ""
    num_processes: int = 1
    process_index: int = 0
    mixed_precision: str = "no"

    @property
    def step_time(self) -> float:
        """Median seconds per optimizer step, the tracked step excluded."""
        return statistics.median(self.step_times) if self.step_times else float("nan")


def _result_for(model: torch.nn.Module, **who) -> LoopResult:
    """An empty ``LoopResult`` with ``model``'s sizes and ``who`` (device, processes) filled in."""
    params = list(model.parameters())
    return LoopResult(n_params=sum(p.numel() for p in params), n_tensors=len(params), **who)


@dataclass
class StepMeter:
    """Times every optimizer step of a run but one, whose exact memory it tracks instead."""

    track_step: int  # the optimizer step (0-based) to track
    result: LoopResult  # receives ``step_times`` and ``memory``
    tracker: CategoryTracker | None = None
    start: float = 0.0

    def begin(self, step: int, model, optimizer, device: torch.device) -> None:
        """Start optimizer step ``step``: the tracker if it is the tracked one, the clock."""
        if step == self.track_step:
            inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
            self.tracker = CategoryTracker(device=device)
            self.tracker.track_external(model, inner)
            self.tracker.__enter__()
        self.start = time.perf_counter()

    def end(self) -> None:
        """End the step: keep its memory if it was tracked, else its seconds."""
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self.result.memory = self.tracker.peaks().as_dict()
            self.tracker = None
        else:
            self.result.step_times.append(time.perf_counter() - self.start)


def meter_steps(meter: StepMeter):
    """A Trainer callback that hands each optimizer step (all its micro-batches) to ``meter``.

    Built on first use: the Trainer's modules import peft and bitsandbytes (seconds), which the
    Accelerate loop's processes (lessons 07 and 17) never need.
    """
    with quiet_libraries():  # the Trainer's modules import peft, which imports bitsandbytes
        from transformers import TrainerCallback  # the Trainer's modules: seconds

    class MeterSteps(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            """The Trainer starts an optimizer step."""
            meter.begin(state.global_step, model, optimizer, next(model.parameters()).device)

        def on_step_end(self, args, state, control, **kwargs):
            """The Trainer has stepped the optimizer."""
            meter.end()

    return MeterSteps()


def _dataset(cfg: LoopConfig, kind: str, n: int):
    """``n`` samples of the learnable Markov task for a ``kind`` model."""
    return markov_dataset(MarkovTask(seed=cfg.seed), kind, n=n, seq_len=cfg.seq_len, seed=cfg.seed)


def accelerate_train(cfg: LoopConfig, model, optimizer, loader, scheduler):
    """The course's combination as an Accelerate loop; yields each optimizer step's loss."""
    from accelerate import Accelerator  # optional: lessons 07 and 17 only

    accelerator = Accelerator(
        mixed_precision=cfg.mixed_precision,  # autocast (+ a GradScaler for fp16 on a GPU)
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        cpu=cfg.cpu,
    )
    # Move to the device, wrap the model for DDP on several processes, shard the loader, and
    # wrap optimizer and scheduler so that they act only at the end of an accumulation window.
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    model.train()
    batches = iter(loader)
    for _step in range(cfg.max_steps):
        step_loss = 0.0
        for _micro_batch in range(cfg.gradient_accumulation_steps):
            batch = next(batches)
            # accelerator.backward() divides the loss by gradient_accumulation_steps (a plain
            # loss.backward() would not); accumulate() makes step() and zero_grad() do nothing
            # until the window's last micro-batch (nor does the gradient all-reduce between
            # processes).
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
            step_loss += loss.item() / cfg.gradient_accumulation_steps
        yield step_loss  # the caller decides what happens between steps (log, measure)
    accelerator.end_training()


def loop_parts(cfg: LoopConfig, num_processes: int = 1):
    """What lessons 03 to 06 chose, built for ``cfg``: the model (checkpointing on if asked),
    the optimizer, a loader with enough micro-batches for every process, a constant schedule."""
    from accelerate.utils import set_seed  # optional: lessons 07 and 17 only
    from transformers import get_constant_schedule  # imports the modeling code: seconds

    set_seed(cfg.seed)
    config = load_config(cfg.model)
    model = build_model(config, seed=cfg.seed, dtype=WEIGHT_TORCH_DTYPES[cfg.weight_dtype])
    if cfg.gradient_checkpointing:
        enable_checkpointing(model)
    with quiet_libraries():  # an 8-bit optimizer imports bitsandbytes (helpers.quiet)
        optimizer = make_optimizer(cfg.optimizer, model, lr=cfg.learning_rate)
    micro_batches = cfg.max_steps * cfg.gradient_accumulation_steps * num_processes
    data = _dataset(cfg, task_kind(config), micro_batches * cfg.per_device_train_batch_size)
    loader = DataLoader(data, batch_size=cfg.per_device_train_batch_size)
    scheduler = get_constant_schedule(optimizer)  # the Trainer's lr_scheduler_type="constant"
    return model, optimizer, loader, scheduler


def train_loop(cfg: LoopConfig, loop=None) -> LoopResult:
    """Train ``cfg`` with ``loop`` (``accelerate_train`` unless given): time every optimizer step
    but one, whose exact memory is tracked instead. None of this is inside the loop: it runs
    between the loop's ``yield``s (so the first step's time includes ``prepare()``)."""
    from accelerate import PartialState  # optional: lessons 07 and 17 only
    from accelerate.state import AcceleratorState  # optional: lessons 07 and 17 only

    loop = loop or accelerate_train
    state = PartialState(cpu=cfg.cpu)  # the processes and device that the loop's Accelerator gets
    model, optimizer, loader, scheduler = loop_parts(cfg, state.num_processes)
    result = _result_for(
        model, device=str(state.device), num_processes=state.num_processes,
        process_index=state.process_index,
    )  # fmt: skip
    meter = StepMeter(cfg.track_step, result)  # the lesson's measurement, not the loop's
    steps = loop(cfg, model, optimizer, loader, scheduler)
    for step in range(cfg.max_steps):
        # prepare() moves the model in place and wraps (does not copy) the optimizer, so the
        # meter tracks the very tensors that the loop trains.
        meter.begin(step, model, optimizer, state.device)
        loss = next(steps)
        meter.end()
        result.losses.append(loss)
        result.mixed_precision = AcceleratorState().mixed_precision
    for _ in steps:  # runs the loop's end (accelerator.end_training())
        raise RuntimeError(f"the loop trained more than max_steps={cfg.max_steps} steps")
    return result


def trainer_run(cfg: LoopConfig, arguments: Callable) -> LoopResult:
    """Train the same configuration with ``Trainer``; track the same optimizer step.

    ``arguments(cfg, output_dir)`` turns ``cfg`` into ``TrainingArguments`` (lesson 07 writes it
    in a cell, field by field).
    """
    from transformers import Trainer  # seconds to import: only this call needs it

    config = load_config(cfg.model)
    model = build_model(config, seed=cfg.seed)
    if task_kind(config) == "classify":
        # transformers 5.23: BERT's classification head declares **kwargs, so the Trainer
        # assumes it normalises by num_items_in_batch and skips dividing the loss by the
        # accumulation steps, but the head ignores the count: gradients come out k times too
        # large (lesson 03 measures it). Opt out explicitly.
        model.accepts_loss_kwargs = False
    data = _dataset(cfg, task_kind(config), cfg.max_steps * cfg.gradient_accumulation_steps)
    result = _result_for(model)
    callback = meter_steps(StepMeter(cfg.track_step, result))
    with tempfile.TemporaryDirectory() as out:
        args = arguments(cfg, os.path.join(out, "trainer"))
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
        quiet_trainer(trainer).train()
    result.losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    result.device = str(trainer.args.device)
    result.mixed_precision = cfg.mixed_precision
    return result


def main(argv: list[str] | None = None) -> int:
    """Command line: ``accelerate launch scripts/train_accelerate.py [--options]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = LoopConfig()
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    cfg = LoopConfig(**vars(parser.parse_args(argv)))
    missing = missing_optional("bitsandbytes") if cfg.optimizer == "adamw8bit" else None
    if missing:
        asked = any(a.startswith("--optimizer") for a in (sys.argv[1:] if argv is None else argv))
        if asked:  # asked for by name: say what to do rather than train something else
            parser.error(f"--optimizer adamw8bit: {missing}, or pick --optimizer adamw")
        # The default, as lesson 07 does: the loop stays the same with torch's AdamW.
        sys.stderr.write(f"{missing}: 8-bit AdamW replaced by AdamW\n")
        cfg = replace(cfg, optimizer="adamw")
    result = train_loop(cfg)
    line = json.dumps({**asdict(result), "step_time": result.step_time}, default=str)
    # One write per process: unbuffered (PYTHONUNBUFFERED=1), print() sends the text and its
    # newline as two writes, and two processes finishing together glue their lines together.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
    return 0
