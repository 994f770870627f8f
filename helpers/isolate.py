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

# Imported once by the forkserver, so every child starts with them (about 0.6 s saved per
# child for the two modeling modules). None of them touches CUDA when imported.
_PRELOAD = [
    "torch",
    "transformers",
    "transformers.models.bert.modeling_bert",
    "transformers.models.llama.modeling_llama",
    "helpers.train",
]
_started_with: list[str] | None = None  # what ``start`` asked for, kept if the server restarts


@dataclass
class Outcome:
    """What came back from the child: a value, or the error that stopped it."""

    value: Any = None
    error: str | None = None
    error_type: str | None = None  # "oom" | "error" | "crash"


def preload_list(*extra: str) -> list[str]:
    """The modules the fork server imports: the usual ones, plus ``extra`` where that is safe.

    Some extras ask CUDA about the GPU when imported (bitsandbytes does, and peft imports
    it), and a process that has initialised CUDA cannot hand a working CUDA to children it
    forks. So where a CUDA GPU is present, extras are left out and each child imports them.
    """
    modules = list(_PRELOAD)
    if not extra:
        return modules  # no need to import torch here: the server starts at once
    from helpers.device import cuda_available

    if not cuda_available():
        modules += [m for m in extra if m not in modules]
    return modules


def start(*extra: str) -> bool:
    """Start the fork server now, with ``extra`` modules preloaded too (see ``preload_list``).

    The server imports its modules in the background, so started in a notebook's first cell
    it is ready by the first experiment instead of making that one wait (seconds on a
    laptop). Call it before the first experiment: once the server runs, its preload is fixed.
    Returns False where there is no fork server (Windows: experiments spawn).
    """
    from multiprocessing import forkserver

    global _started_with
    if "forkserver" not in mp.get_all_start_methods():
        return False
    _started_with = preload_list(*extra)
    _context()  # hands the list to the server
    forkserver.ensure_running()
    return True


def _context():
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_started_with or _PRELOAD)
        return ctx
    return mp.get_context("spawn")


def _child(conn, fn, args, kwargs) -> None:
    import torch

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


def call_isolated(
    fn: Callable, *args, timeout: float | None = None, daemon: bool = True, **kwargs
) -> Outcome:
    """Call ``fn(*args, **kwargs)`` in a fresh process; its result or its failure comes back.

    ``fn`` must be importable (defined in a module, not in a notebook cell).
    A child killed from outside (the kernel's OOM killer, a segfault) comes back as "crash".
    The child is a daemon (it dies with the kernel) unless ``daemon=False``, which an
    experiment needs when it starts processes of its own, such as DataLoader workers:
    multiprocessing does not let a daemon process have children.
    """
    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, args, kwargs), daemon=daemon)
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
    import torch

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
    from helpers.device import resolve
    from helpers.hardware import cpu_name

    # Not the GPU's name: asking would initialise CUDA in this (notebook) process, and its
    # context would then show up in every later NVML reading.
    dev = resolve(device)
    return cpu_name() if dev.type == "cpu" else str(dev)
