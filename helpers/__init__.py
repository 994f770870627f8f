"""Measurement helpers for the course *Efficient training of transformers on a single GPU*.

The package is built in floors; each module imports only its own floor and the ones below,
at the top of the file (tests/test_layers.py keeps it so, imports inside functions counted):

1. the small core: ``names`` (the course's names and units, defined once), ``syllabus``
   (the lessons, listed once), ``quiet``, ``progress``, ``compat`` (the tested version range
   and its API differences), ``device``
   (every torch.cuda, torch.accelerator and NVML call), ``hardware`` (with the reference
   cards), ``data``, ``models`` (configs, bundled or not), ``optimizer_state``, ``memory`` (the
   per-category tracker), ``memory_savers``, ``timing``, ``forkserver`` (the process every
   fresh experiment is forked from), ``results``, ``train`` (``RunConfig``, the base training
   step ``train_step`` with its switches, ``measure``), ``profiling``, ``pretrained``,
   ``recipes``;
2. the estimator (``helpers.estimator``): predicts a step's memory, never runs one;
3. ``isolate`` (experiments in fresh processes) and ``scale`` (tiny or full, fitted to the card);
4. ``planner`` (the fastest setting that fits: estimates, then measures), ``timeline``,
   ``plots`` and ``lesson`` (a notebook's opening line: ``L = lesson("05")``);
5. ``helpers.lessons``: one module per notebook, named like it (``helpers.lessons.data_loading``
   for ``notebooks/11_data_loading.ipynb``);
6. ``helpers.course``: the course's tools, the only code that imports a lesson module:
   ``fullscale``, ``preflight``, ``cheatsheet``, ``calculator`` (call ``helpers.calculator()``;
   imported on first use), ``gpu_check`` and ``cli`` (``python -m helpers ...``).

Inside functions, modules import only optional or slow packages (bitsandbytes, deepspeed,
peft, torchao, the Trainer and model classes, matplotlib, pandas: each with its reason), and
four modules defer helpers imports on purpose: ``course.cli`` and ``course.calculator`` import
no torch until a command or a widget needs it, ``isolate`` and ``lesson`` (a notebook's first
import) no transformers.

Import the submodules you need. Importing this package does nothing else: no printing, no
files, no global settings.
"""

import importlib

__version__ = "0.1.0"


def __getattr__(name: str):
    """``helpers.calculator`` (``helpers.course.calculator``), imported on first use: ``import
    helpers`` stays cheap."""
    if name == "calculator":
        return importlib.import_module("helpers.course.calculator")
    raise AttributeError(f"module 'helpers' has no attribute {name!r}")
