"""The fork server that fresh processes (helpers.isolate, timing.CpuBurner) are forked from.

A server that has imported torch and transformers once but never run anything: each child
forked from it is as clean as a new interpreter, without paying the imports. ``start`` starts
it (a notebook's first cell, through ``lesson()``); ``context`` is the multiprocessing
context to start processes in. ``helpers._fork_server`` is the module the server itself
imports first.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing import forkserver

from helpers.device import cuda_available
from helpers.quiet import silence_library_notices

# Imported once by the fork server, so every child starts with them (about 0.6 s saved per
# child for the two modeling modules). None of them touches CUDA when imported by itself.
PRELOAD = [
    "helpers._fork_server",  # first: the libraries below import quietly (helpers.quiet)
    "torch",
    "transformers",
    "transformers.models.bert.modeling_bert",
    "transformers.models.llama.modeling_llama",
    "helpers.train",
]
# Where a CUDA GPU is present the server imports only these. transformers' modeling_utils (which
# every modeling module and helpers.train import) imports each installed quantization backend,
# and one of them asks the GPU while it is imported: torchao 0.18 calls torch's has_triton(),
# which reads the current device's properties and so initialises CUDA. A server that has
# initialised CUDA forks children that cannot use it ("Cannot re-initialize CUDA in forked
# subprocess"): seen on an H200 with torchao installed, every experiment failed. So on a GPU
# each child imports the modeling code itself, a second or two per experiment.
PRELOAD_CUDA = ["helpers._fork_server", "torch", "transformers"]
NO_FORKSERVER_ENV = "COURSE_NO_FORKSERVER"  # =1: every experiment spawns (slower), no server
_started_with: list[str] | None = None  # what ``start`` asked for, kept if the server restarts


def preload_list(*extra: str) -> list[str]:
    """The modules the fork server imports: the usual ones, plus ``extra`` where that is safe.

    Some modules ask CUDA about the GPU when imported (bitsandbytes does, and peft imports it;
    transformers' modeling code imports torchao where it is installed, and torchao does), and a
    process that has initialised CUDA cannot hand a working CUDA to children it forks. So where
    a CUDA GPU is present the server imports only ``PRELOAD_CUDA`` and each child imports the
    rest itself.
    """
    if cuda_available():
        return list(PRELOAD_CUDA)
    return PRELOAD + [m for m in extra if m not in PRELOAD]


def start(*extra: str) -> bool:
    """Start the fork server now, with ``extra`` modules preloaded too (see ``preload_list``).

    The server imports its modules in the background, so started in a notebook's first cell
    it is ready by the first experiment instead of making that one wait (seconds on a
    laptop). Call it before the first experiment: once the server runs, its preload is fixed.
    Returns False where there is no fork server (Windows, or ``COURSE_NO_FORKSERVER=1``:
    experiments spawn).
    Either way this process, like the server, stays quiet from here on about the library
    notices ``helpers.quiet`` names: a notebook's first cell calls it (``lesson()``), before
    the libraries are imported.
    """
    silence_library_notices()
    global _started_with
    if not _forkserver_usable():
        return False
    _started_with = preload_list(*extra)
    context()  # hands the list to the server
    forkserver.ensure_running()
    return True


def _forkserver_usable() -> bool:
    return "forkserver" in mp.get_all_start_methods() and os.environ.get(NO_FORKSERVER_ENV) != "1"


def context():
    """The multiprocessing context experiments start in: the fork server, else spawn."""
    if _forkserver_usable():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_started_with or preload_list())
        return ctx
    return mp.get_context("spawn")
