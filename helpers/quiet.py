"""Library notices that teach nothing, kept out of the lessons' output (lesson 02 meets them).

- bitsandbytes' CPU backend, on a CPU with avx512_bf16, tries at import to fetch a 4-bit
  matmul kernel from the Hugging Face Hub ("kernels-community") and warns when the ``kernels``
  package is missing or offline. Importing transformers' Trainer imports peft, which imports
  bitsandbytes. 4-bit matmuls are QLoRA's (lesson 13), not a training step's.
- DeepSpeed, imported when a Trainer is created (accelerate unwraps the model) on a machine
  without a GPU, says it falls back to the CPU; the lessons print the device themselves.

Other warnings and errors of both libraries still show. ``quiet_libraries()`` is the context
manager the lessons use; experiments in isolated processes run inside it (helpers.isolate),
and the fork server those processes come from is quiet from its start (helpers._fork_server).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"  # logs the Hub-kernel warning
DEEPSPEED_LOGGER = "DeepSpeed"  # deepspeed.utils.logging's logger


def _cpu_accelerator_notice(record: logging.LogRecord) -> bool:
    """False for DeepSpeed's "Setting accelerator to CPU" notice (a logging filter)."""
    return not record.getMessage().startswith("Setting accelerator to CPU")


def silence_library_notices() -> Callable[[], None]:
    """Drop the two notices from now on; returns the function that brings them back."""
    bnb, deepspeed = logging.getLogger(BNB_CPU_LOGGER), logging.getLogger(DEEPSPEED_LOGGER)
    level = bnb.level
    bnb.setLevel(logging.ERROR)
    deepspeed.addFilter(_cpu_accelerator_notice)  # survives DeepSpeed setting up its logger

    def restore() -> None:
        bnb.setLevel(level)
        deepspeed.removeFilter(_cpu_accelerator_notice)

    return restore


@contextlib.contextmanager
def quiet_libraries():
    """Inside: the two notices this module's docstring names are not shown."""
    restore = silence_library_notices()
    try:
        yield
    finally:
        restore()
