"""Run an experiment in a fresh process, so its numbers never depend on what ran before.

A fresh process per experiment means no cached allocator blocks, no optimizer state, no
compiled kernels and no CUDA context left over from earlier cells. We fork each experiment
from a *forkserver* that has imported torch and transformers once but never run anything:
every child is as clean as a new interpreter, without paying the imports (seconds on a
laptop) every time. Where forkserver does not exist (Windows) we fall back to spawn.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# Imported once by the forkserver, so every child starts with them (about 0.6 s saved per
# child for the two modeling modules). Extend with ``preload`` before the first experiment.
_PRELOAD = [
    "torch",
    "transformers",
    "transformers.models.bert.modeling_bert",
    "transformers.models.llama.modeling_llama",
    "helpers.train",
]


@dataclass
class Outcome:
    """What came back from the child: a value, or the error that stopped it."""

    value: Any = None
    error: str | None = None
    error_type: str | None = None  # "oom" | "error" | "crash"


def preload(*modules: str) -> None:
    """Have fresh processes start with ``modules`` imported (call before the first experiment).

    Worth it for a module that is slow to import and used by many experiments, such as
    bitsandbytes (about 3 s per child on a laptop CPU). Once the forkserver runs, it is too late.
    """
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _context():
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        return ctx
    return mp.get_context("spawn")


def _child(conn, fn, args, kwargs) -> None:
    try:
        conn.send(Outcome(value=fn(*args, **kwargs)))
    except torch.OutOfMemoryError as err:
        conn.send(Outcome(error=f"OutOfMemoryError: {_first_line(err)}", error_type="oom"))
    except BaseException as err:  # everything else comes back too, with the place it failed
        where = traceback.extract_tb(err.__traceback__)[-1]
        message = f"{type(err).__name__}: {_first_line(err)} ({where.filename}:{where.lineno})"
        conn.send(Outcome(error=message, error_type="error"))
    finally:
        conn.close()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def call_isolated(fn: Callable, *args, timeout: float | None = None, **kwargs) -> Outcome:
    """Call ``fn(*args, **kwargs)`` in a fresh process; its result or its failure comes back.

    ``fn`` must be importable (defined in a module, not in a notebook cell).
    A child killed from outside (the kernel's OOM killer, a segfault) comes back as "crash".
    """
    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, args, kwargs), daemon=True)
    proc.start()
    child.close()
    try:
        if parent.poll(timeout):
            outcome = parent.recv()
        else:
            proc.kill()
            outcome = Outcome(error=f"timed out after {timeout} s", error_type="error")
    except EOFError:  # the child died before it could answer
        outcome = None
    proc.join()
    if outcome is None:
        outcome = Outcome(
            error=f"the experiment's process died (exit code {proc.exitcode}); "
            "a negative code is the signal that killed it, -9 usually means out of RAM",
            error_type="crash",
        )
    return outcome


def run(cfg, isolate: bool = True):
    """``helpers.train.measure(cfg)`` in a fresh process (or in this one); always a Record."""
    from helpers.results import Record
    from helpers.train import measure

    if not isolate:
        try:
            return measure(cfg)
        except torch.OutOfMemoryError as err:
            outcome = Outcome(error=f"OutOfMemoryError: {err}", error_type="oom")
    else:
        outcome = call_isolated(measure, cfg)
    if outcome.error:
        # The run died before it could describe its device: name it here, so tables show it.
        device = {"name": _device_name(cfg.device)}
        return Record(cfg.as_dict(), device, error=outcome.error, error_type=outcome.error_type)
    return outcome.value


def _device_name(device: str | None) -> str:
    from helpers.hardware import cpu_name
    from helpers.scale import default_device

    # Not torch.cuda.get_device_name: that would create a CUDA context in this (notebook)
    # process, and its memory would then show up in every later NVML reading.
    dev = torch.device(device) if device else default_device()
    return cpu_name() if dev.type == "cpu" else str(dev)
