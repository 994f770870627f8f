"""Library notices that teach nothing, kept out of the lessons' output (lesson 02 meets them).

- bitsandbytes' CPU backend, on a CPU with avx512_bf16, tries at import to fetch a 4-bit
  matmul kernel from the Hugging Face Hub ("kernels-community") and warns when the ``kernels``
  package is missing or offline. Importing transformers' Trainer imports peft, which imports
  bitsandbytes. 4-bit matmuls are QLoRA's (lesson 13), not a training step's.
- DeepSpeed, imported when a Trainer is created (accelerate unwraps the model) on a machine
  without a GPU, says it falls back to the CPU; the lessons print the device themselves.
- torchao (fp8 training, lesson 16), which transformers imports whenever it builds a model,
  says "Failed to load ..." for each of its CUDA kernel libraries that a CPU build of torch
  cannot load; and it registers enums with torch's pytree, which logs a deprecation line per
  enum. Neither changes what the course runs: fp8 needs a CUDA GPU of compute capability 8.9+.
- transformers' ``TrainingArguments(torch_compile=True)`` without an Ampere GPU warns that
  the speedups mostly come with one; lesson 12 measures what compiling does on the machine at
  hand instead, and says why a CPU gains less.
- tqdm, imported by transformers and accelerate in a Jupyter kernel without ipywidgets (a GPU
  image's, the floor environment), warns "IProgress not found. Please update jupyter and
  ipywidgets" and draws text bars instead: the course's own bars are text (helpers.progress),
  so there is nothing to update.

Other warnings and errors of both libraries still show. ``quiet_libraries()`` is the context
manager the lessons use; experiments in isolated processes run inside it (helpers.isolate),
and the fork server those processes come from is quiet from its start (helpers._fork_server).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable

BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"  # logs the Hub-kernel warning
DEEPSPEED_LOGGER = "DeepSpeed"  # deepspeed.utils.logging's logger
TORCHAO_LOGGER = "torchao"  # logs each kernel library it cannot load
PYTREE_LOGGER = "torch.utils._pytree"  # logs register_constant() of an Enum as deprecated
TRAINING_ARGS_LOGGER = "transformers.training_args"  # logs the torch_compile-without-Ampere line
TQDM_WIDGET_NOTICE = "IProgress not found"  # tqdm.auto's warning in a kernel without ipywidgets


def _cpu_accelerator_notice(record: logging.LogRecord) -> bool:
    """False for DeepSpeed's "Setting accelerator to CPU" notice (a logging filter)."""
    return not record.getMessage().startswith("Setting accelerator to CPU")


def _torchao_kernel_notice(record: logging.LogRecord) -> bool:
    """False for torchao's "Failed to load <kernel library>" notice (a logging filter)."""
    return not record.getMessage().startswith("Failed to load ")


def _pytree_enum_notice(record: logging.LogRecord) -> bool:
    """False for torch's "<enum> is an Enum subclass ..." deprecation line (a logging filter)."""
    return "is an Enum subclass and is now natively supported" not in record.getMessage()


def _compile_speedup_notice(record: logging.LogRecord) -> bool:
    """False for TrainingArguments' "The speedups for torchdynamo mostly come with GPU Ampere"."""
    return not record.getMessage().startswith("The speedups for torchdynamo")


_FILTERS = (
    (DEEPSPEED_LOGGER, _cpu_accelerator_notice),  # survives DeepSpeed setting up its logger
    (TORCHAO_LOGGER, _torchao_kernel_notice),
    (PYTREE_LOGGER, _pytree_enum_notice),
    (TRAINING_ARGS_LOGGER, _compile_speedup_notice),
)


def silence_library_notices() -> Callable[[], None]:
    """Drop the notices this module's docstring names from now on; returns the undo."""
    bnb = logging.getLogger(BNB_CPU_LOGGER)
    level = bnb.level
    bnb.setLevel(logging.ERROR)
    for name, notice in _FILTERS:
        logging.getLogger(name).addFilter(notice)
    warnings.filterwarnings("ignore", message=TQDM_WIDGET_NOTICE)
    widget_filter = warnings.filters[0]  # the one just added

    def restore() -> None:
        bnb.setLevel(level)
        for name, notice in _FILTERS:
            logging.getLogger(name).removeFilter(notice)
        if widget_filter in warnings.filters:
            warnings.filters.remove(widget_filter)

    return restore


@contextlib.contextmanager
def quiet_libraries():
    """Inside: the notices this module's docstring names are not shown."""
    restore = silence_library_notices()
    try:
        yield
    finally:
        restore()


@contextlib.contextmanager
def quiet_loading():
    """Inside: no transformers progress bars while a model is saved and loaded again (QLoRA's
    4-bit reload of the course's own random weights: nothing there to wait for)."""
    from transformers.utils import logging as hf_logging  # light: transformers' logging only

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
