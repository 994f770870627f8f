"""The floors of ``helpers``: each module imports only its own floor and the ones below.

The import graph counts imports inside functions too (tools/import_graph.py), so a lazy
import that runs back up a floor fails here just as a top-level one would.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from import_graph import build, cycles, internal, module_names  # noqa: E402

# Floor of every module, lowest first; a package's modules share its floor unless named.
CORE, ESTIMATOR, RUNNERS, USES, LESSONS, COURSE = range(6)
FLOORS = {
    # The small core: names and units, devices and hardware, models and data, the tracker,
    # timing and the training step; train imports memory, timing, models and data, so they
    # share its floor (the graph inside a floor must stay free of cycles). forkserver is the
    # process pool timing.CpuBurner and isolate both start from; recipes, profiling and
    # pretrained are leaves used by the floors above; quiet and progress are used by all.
    "helpers": CORE,
    "helpers._fork_server": CORE,
    "helpers.compat": CORE,
    "helpers.data": CORE,
    "helpers.device": CORE,
    "helpers.forkserver": CORE,
    "helpers.hardware": CORE,
    "helpers.memory": CORE,
    "helpers.memory_savers": CORE,
    "helpers.models": CORE,
    "helpers.names": CORE,
    "helpers.optimizer_state": CORE,
    "helpers.pretrained": CORE,
    "helpers.profiling": CORE,
    "helpers.progress": CORE,
    "helpers.quiet": CORE,
    "helpers.recipes": CORE,
    "helpers.results": CORE,
    "helpers.syllabus": CORE,
    "helpers.timing": CORE,
    "helpers.train": CORE,
    # The estimator predicts only: it never runs an experiment.
    "helpers.estimator": ESTIMATOR,
    # What runs experiments in fresh processes, and what chooses (and fits) the scale.
    "helpers.isolate": RUNNERS,
    "helpers.scale": RUNNERS,
    # What uses them: the planner (estimates, then measures and times), timelines, plots, and
    # a notebook's opening line.
    "helpers.planner": USES,
    "helpers.timeline": USES,
    "helpers.plots": USES,
    "helpers.lesson": USES,
    # One module per notebook.
    "helpers.lessons": LESSONS,
    # The course's tools: the only code that imports a lesson module.
    "helpers.course": COURSE,
    "helpers.__main__": COURSE,
}

# Third-party packages a module may import inside a function: optional extras, and slow
# imports that only some calls need. Everything else (the standard library, torch, helpers)
# is imported at the top of the module.
DEFERRED_ALLOWED = {
    "accelerate",  # lesson 07 and 17 only
    "bitsandbytes",  # optional; asks CUDA when imported
    "datasets",  # optional (real data, COURSE_PRETRAINED)
    "deepspeed",  # optional; slow, and builds ops when imported
    "IPython",  # inside a notebook only
    "ipywidgets",  # the calculator's widgets; import helpers stays cheap
    "liger_kernel",  # optional
    "optimi",  # optional (torch-optimi: lesson 05's Kahan-summed AdamW)
    "matplotlib",  # slow; only figures need it
    "pandas",  # slow; only tables need it
    "peft",  # optional; imports bitsandbytes
    "psutil",  # optional
    "pynvml",  # optional (NVIDIA only)
    "torchao",  # optional (lesson 05's stochastic rounding, lesson 16's fp8)
    "transformers",  # the Trainer and model classes: seconds to import, only some calls need them
}

# Modules that import helpers modules inside functions on purpose, so that importing them stays
# light; their standard-library imports are at the top all the same.
DEFERS_ON_PURPOSE = {
    "helpers.course.cli": "python -m helpers (--help, a typo) imports no torch: each command "
    "imports the helpers it runs",
    "helpers.course.calculator": "import helpers (helpers.calculator is imported on first use) "
    "imports no torch until an estimate or a widget needs it",
    "helpers.lesson": "a notebook's first import: no transformers (helpers.scale) until the "
    "fork server has started",
    "helpers.isolate": "a notebook's first import: no transformers (helpers.train, "
    "helpers.estimator) until an experiment runs",
}
# Of those, the ones that may also import torch inside a function (isolate imports it at the top).
DEFERS_TORCH = {"helpers.course.cli", "helpers.course.calculator"}

# Single imports kept inside a function for a reason of their own: (module, imported module).
DEFERRED_FOR_A_REASON = {
    # prepare_compiler times inductor's import (0.8 s) as part of the compiler's warm-up
    ("helpers.lessons.torch_compile", "torch._inductor.compile_fx"),
}

# Every other module: no helpers import and no other package inside a function (a new module
# is held to it from the start).
TOP_IMPORTS_ONLY = set(module_names(ROOT)) - set(DEFERS_ON_PURPOSE)

IMPORTS = build(ROOT)


def floor(module: str) -> int:
    """The floor of ``module``: its own entry, else its package's."""
    name = module
    while name not in FLOORS:
        if "." not in name:
            raise KeyError(f"{module} has no floor: add it to FLOORS")
        name = name.rpartition(".")[0]
    return FLOORS[name]


def test_every_module_has_a_floor():
    missing = []
    for name in module_names(ROOT):
        try:
            floor(name)
        except KeyError:
            missing.append(name)
    assert not missing, f"add to FLOORS in tests/test_layers.py: {missing}"


def test_the_import_graph_has_no_cycle():
    assert cycles(IMPORTS) == []


def test_no_import_runs_up_a_floor():
    upward = [
        f"{i.source}:{i.line} imports {i.target} ({'in a function' if i.deferred else 'top'})"
        for i in internal(IMPORTS)
        if floor(i.target) > floor(i.source)
    ]
    assert not upward, "\n".join(upward)


def test_only_the_course_imports_a_lesson_module():
    offenders = [
        f"{i.source}:{i.line}"
        for i in internal(IMPORTS)
        if floor(i.target) == LESSONS and floor(i.source) < LESSONS
    ]
    assert not offenders


def _deferred(module: str) -> list:
    """The imports inside functions of ``module``, less those in DEFERRED_FOR_A_REASON."""
    lines = module_names(ROOT)[module].read_text().splitlines()

    def excused(i) -> bool:
        text = lines[i.line - 1]
        return any(
            source == module and (f"import {name}" in text or f"from {name} import" in text)
            for source, name in DEFERRED_FOR_A_REASON
        )

    return [i for i in IMPORTS if i.source == module and i.deferred and not excused(i)]


@pytest.mark.parametrize("module", sorted(TOP_IMPORTS_ONLY))
def test_imports_inside_functions_are_only_optional_or_slow_packages(module):
    inner = set(internal(IMPORTS))
    bad = [
        f"{i.source}:{i.line} {i.target}"
        for i in _deferred(module)
        if i in inner or i.target not in DEFERRED_ALLOWED
    ]
    assert not bad, "move these to the top of the module: " + ", ".join(bad)


@pytest.mark.parametrize("module", sorted(DEFERS_ON_PURPOSE))
def test_modules_that_defer_on_purpose_defer_only_helpers_and_slow_packages(module):
    # Their helpers imports may sit in functions (the floors still hold: see above), and torch
    # where the module promises not to import it; the standard library goes to the top.
    inner = set(internal(IMPORTS))
    allowed = DEFERRED_ALLOWED | ({"torch"} if module in DEFERS_TORCH else set())
    bad = [
        f"{i.source}:{i.line} {i.target}"
        for i in _deferred(module)
        if i not in inner and i.target not in allowed
    ]
    assert not bad, "move these to the top of the module: " + ", ".join(bad)


def test_the_modules_that_defer_on_purpose_import_light():
    # What DEFERS_ON_PURPOSE's reasons promise (a fresh interpreter: this one has torch).
    code = (
        "import sys\n"
        "import helpers, helpers.course.cli, helpers.course.calculator\n"
        "assert 'torch' not in sys.modules, 'cli or calculator imports torch'\n"
        "import helpers.isolate\n"
        "assert 'transformers' not in sys.modules, 'isolate imports transformers'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_reason_to_defer_still_applies():
    # An entry whose import moved to the top, or whose module is gone, is taken out.
    for module, name in DEFERRED_FOR_A_REASON:
        lines = module_names(ROOT)[module].read_text().splitlines()
        assert any(
            i.source == module and i.deferred and f"import {name}" in lines[i.line - 1]
            for i in IMPORTS
        ), f"{module} no longer imports {name} inside a function: remove it from the set"
    assert set(DEFERS_ON_PURPOSE) <= set(module_names(ROOT))
    assert DEFERS_TORCH <= set(DEFERS_ON_PURPOSE)


def _memtracker_private_names() -> set[str]:
    """The private names of torch's MemTracker: its module's, its class's, an instance's."""
    from torch.distributed._tools import mem_tracker

    def private(names) -> set[str]:
        return {n for n in names if n.startswith("_") and not n.startswith("__")}

    return (
        private(dir(mem_tracker))
        | private(dir(mem_tracker.MemTracker))
        | private(vars(mem_tracker.MemTracker()))
    )


def _private_memtracker_uses(tree: ast.AST, names: set[str]) -> list[str]:
    """Where ``tree`` reaches into torch's trackers: an import from torch.distributed._tools,
    an attribute or an overriding method with one of MemTracker's private ``names``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "torch.distributed._tools"
        ):
            found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [
                f"{node.lineno}: import {a.name}"
                for a in node.names
                if a.name.startswith("torch.distributed._tools")
            ]
        elif isinstance(node, ast.Attribute) and node.attr in names:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
            found.append(f"{node.lineno}: def {node.name}")
    return found


def test_only_helpers_memory_touches_memtrackers_private_names():
    # helpers.memory is the course's one contact with MemTracker's private API (pinned in
    # tests/test_memory.py); the others use CategoryTracker's public hooks (on_forward,
    # on_count, in_backward, current_modules...), so a torch upgrade is fixed in one place.
    names = _memtracker_private_names()
    assert {"_pre_fw_hook", "_mod_tracker", "_in_opt", "_MemRefType"} <= names
    offenders = [
        f"{path.relative_to(ROOT)}:{where}"
        for module, path in module_names(ROOT).items()
        if module != "helpers.memory"
        for where in _private_memtracker_uses(ast.parse(path.read_text()), names)
    ]
    assert not offenders, "use helpers.memory's public hooks instead: " + ", ".join(offenders)


def test_the_private_name_check_sees_an_override():
    names = {"_pre_fw_hook", "_mod_tracker"}
    source = (
        "class T(CategoryTracker):\n"
        "    def _pre_fw_hook(self, module, inputs):\n"
        "        return self._mod_tracker.is_bw\n"
    )
    assert _private_memtracker_uses(ast.parse(source), names) == [
        "2: def _pre_fw_hook",
        "3: ._mod_tracker",
    ]


def test_the_graph_sees_a_climb_inside_a_function(tmp_path):
    # The checker itself: a lazy import up a floor, in a throwaway package, is found.
    pkg = tmp_path / "helpers"
    (pkg / "course").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "course" / "__init__.py").write_text("")
    (pkg / "course" / "cli.py").write_text("import helpers.models\n")
    (pkg / "models.py").write_text("def f():\n    from helpers.course import cli\n")
    found = build(tmp_path)
    climbs = [i for i in internal(found) if floor(i.target) > floor(i.source)]
    assert [(i.source, i.target, i.deferred) for i in climbs] == [
        ("helpers.models", "helpers.course.cli", True)
    ]
    assert cycles(found) == [["helpers.course.cli", "helpers.models"]]
