"""The fork server that fresh processes (helpers.isolate, timing.CpuBurner) are forked from.

A server that has imported torch and transformers once but never run anything: each child
forked from it is as clean as a new interpreter, without paying the imports. ``start`` starts
it (a notebook's first cell, through ``isolate.start``); ``context`` is the multiprocessing
context to start processes in. ``helpers._fork_server`` is the module the server itself
imports first.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing import forkserver

from helpers.device import cuda_available
from helpers.quiet import silence_library_notices

# Imported once by the forkserver, so every child starts with them (about 0.6 s saved per
# child for the two modeling modules). None of them touches CUDA when imported.
PRELOAD = [
    "helpers._fork_server",  # first: the libraries below import quietly (helpers.quiet)
    "torch",
    "transformers",
    "transformers.models.bert.modeling_bert",
    "transformers.models.llama.modeling_llama",
    "helpers.train",
]
_started_with: list[str] | None = None  # what ``start`` asked for, kept if the server restarts


def preload_list(*extra: str) -> list[str]:
    """The modules the fork server imports: the usual ones, plus ``extra`` where that is safe.

    Some extras ask CUDA about the GPU when imported (bitsandbytes does, and peft imports
    it), and a process that has initialised CUDA cannot hand a working CUDA to children it
    forks. So where a CUDA GPU is present, extras are left out and each child imports them.
    """
    modules = list(PRELOAD)
    if not extra:
        return modules  # no need to import torch here: the server starts at once
    if not cuda_available():
        modules += [m for m in extra if m not in modules]
    return modules


def start(*extra: str) -> bool:
    """Start the fork server now, with ``extra`` modules preloaded too (see ``preload_list``).

    The server imports its modules in the background, so started in a notebook's first cell
    it is ready by the first experiment instead of making that one wait (seconds on a
    laptop). Call it before the first experiment: once the server runs, its preload is fixed.
    Returns False where there is no fork server (Windows: experiments spawn).
    Either way this process, like the server, stays quiet from here on about the library
    notices ``helpers.quiet`` names: a notebook's first cell calls it, before any import.
    """
    silence_library_notices()
    global _started_with
    if "forkserver" not in mp.get_all_start_methods():
        return False
    _started_with = preload_list(*extra)
    context()  # hands the list to the server
    forkserver.ensure_running()
    return True


def context():
    """The multiprocessing context experiments start in: the fork server, else spawn."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_started_with or PRELOAD)
        return ctx
    return mp.get_context("spawn")
