"""Measurement helpers for the course *Efficient training of transformers on a single GPU*.

Core machinery, flat: ``lesson`` (a notebook's opening line: ``L = lesson("05")``), ``scale``
(tiny or full), ``device`` (every torch.cuda, torch.accelerator and NVML call), ``hardware``,
``data``, ``models``, ``names`` (the course's names and units, defined once), ``timing``,
``memory`` (the per-category tracker), ``optimizer_state``, ``train`` (``RunConfig``, the base
training step ``train_step`` with its switches, ``measure``), ``isolate``, ``results``,
``plots``; the estimator and planner (the subpackage
``estimator``: model, state, stages, encoder, decoder, simulate, api, plan), what each lesson
runs at the full scale (``fullscale``), the host's ``preflight``, the proof on a GPU
(``gpu_check``), the tested version range and its API differences (``compat``), the command
line (``cli``:
``python -m helpers ...``) and the memory calculator for JupyterLab (``calculator``: call
``helpers.calculator()``; imported on first use). The lessons' own machinery lives in
``helpers.lessons``, one module per notebook, named like it (``helpers.lessons.data_loading``
for ``notebooks/11_data_loading.ipynb``).

Import the submodules you need. Importing this package does nothing else: no printing, no
files, no global settings.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    """``helpers.calculator``, imported on first use: ``import helpers`` stays cheap."""
    if name == "calculator":
        import importlib

        return importlib.import_module("helpers.course.calculator")
    raise AttributeError(f"module 'helpers' has no attribute {name!r}")
