"""The versions the course runs on, and the one place where their APIs differ.

The course supports a tested range of library versions, not one set of pins. Its oldest end is
what GPU images ship (``requirements/floor.txt``: the image of the course's GPU host, read in
November 2026), its newest end the pins in ``requirements/lock.txt``; ``pyproject.toml`` states
the range, and ``make compat`` runs the tests and every notebook at the oldest end. Where an
API changed inside that range, the difference is handled here, once, and the rest of the course
calls the function below instead of asking for a version.

What a missing optional package costs is also written here, once: ``python -m helpers doctor``
and ``make gpu-check`` print it, and each lesson says it again where it skips the runs.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

import torch
import torch._functorch.config as functorch_config
from packaging.version import Version

# --------------------------------------------------------------------------------------------
# The tested range: (oldest tested, newest tested) per distribution. Both ends run the whole
# test suite and every notebook: the newest is requirements/lock.txt (make test), the oldest
# requirements/floor.txt (make compat). The oldest ends are pyproject.toml's floors;
# tests/test_repo_consistency.py keeps the four agreeing.

TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.11.0", "2.13.0"),
    "transformers": ("5.17.0", "5.23.0"),
    "accelerate": ("1.15.0", "1.15.0"),
    "peft": ("0.20.0", "0.21.2"),
    "numpy": ("2.4.6", "2.5.2"),
    "pandas": ("3.0.5", "3.1.1"),
    "matplotlib": ("3.10.9", "3.11.2"),
    "tqdm": ("4.69.1", "4.70.1"),
    "datasets": ("5.2.0", "5.2.0"),
    "dill": ("0.4.1", "0.4.1"),
}


@dataclass(frozen=True)
class Package:
    """A library the course uses: its import name, and what the course loses without it."""

    distribution: str  # the name pip installs
    module: str  # the name Python imports
    lessons: str  # the lessons that use it ("all" for the core)
    without: str  # what happens when it is missing ("" for a required package)


REQUIRED = [
    Package("torch", "torch", "all", ""),
    Package("transformers", "transformers", "all", ""),
    Package("accelerate", "accelerate", "all", ""),
    Package("datasets", "datasets", "02-07 12 14", ""),
    Package("dill", "dill", "all", ""),
    Package("peft", "peft", "09 13 14", ""),
    Package("numpy", "numpy", "all", ""),
    Package("pandas", "pandas", "all", ""),
    Package("matplotlib", "matplotlib", "all", ""),
    Package("tqdm", "tqdm", "all", ""),
]
OPTIONAL = [
    Package(
        "bitsandbytes",
        "bitsandbytes",
        "06 07 13 14 15",
        "8-bit AdamW and QLoRA's 4-bit layers are skipped (the estimator still predicts them)",
    ),
    Package(
        "deepspeed",
        "deepspeed",
        "08",
        "the ZeRO runs are skipped; the arithmetic and the plain runs remain",
    ),
    Package(
        "torchao",
        "torchao",
        "05 16",
        "bf16 stochastic rounding and fp8 training are explained and predicted, not run",
    ),
    Package(
        "torch-optimi",
        "optimi",
        "05",
        "Kahan-summed bf16 AdamW is explained and predicted, not run",
    ),
    Package("liger-kernel", "liger_kernel", "16", "the fused cross-entropy is skipped (CUDA only)"),
    Package(
        "nvidia-ml-py",
        "pynvml",
        "00 08 11 14",
        "no NVML view (memory view 3); the budget assumes a 512 MiB CUDA context",
    ),
    Package(
        "ipywidgets",
        "ipywidgets",
        "15",
        "progress bars print as text and the calculator is a static table",
    ),
]
TOOLS = [
    Package("nbclient", "nbclient", "make course, make gpu-check",
            "notebooks cannot be executed from a script (run them in Jupyter)"),
    Package("ipykernel", "ipykernel", "make course, make gpu-check",
            "no Jupyter kernel: notebooks cannot be executed"),
    Package("nbval", "nbval", "make test", "make test cannot execute the notebooks"),
    Package("jupyterlab", "jupyterlab", "make lab", "make lab has nothing to start"),
]  # fmt: skip


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (pip's name), or None."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def importable(module: str) -> bool:
    """Whether ``module`` can be found (without importing it: some imports take seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails, or a broken install
        return False


def _release(text: str) -> tuple[int, ...]:
    """The numeric release of a version: "2.11.0+cu130" -> (2, 11, 0), "0.5.0rc1" -> (0, 5, 0).
    A local label (+cu130, +cpu) names a build of the same release, not a newer one."""
    return Version(text).release


def range_verdict(distribution: str, installed: str | None) -> str:
    """Where ``installed`` lies against the tested range: one phrase a learner can act on."""
    if installed is None:
        return "not installed"
    if distribution not in TESTED:
        return "installed"
    low, high = TESTED[distribution]
    have = _release(installed)
    if have < _release(low):
        return f"OLDER than the oldest tested ({low}): pip install '{distribution}>={low}'"
    if have > _release(high):
        return f"newer than tested (up to {high}): should work; report a lesson that fails"
    return f"in the tested range {low} - {high}"


@dataclass(frozen=True)
class PackageStatus:
    """One package as ``doctor`` reports it."""

    package: Package
    kind: str  # "required" | "optional" | "tool"
    version: str | None  # None: not installed
    verdict: str  # range_verdict's phrase

    @property
    def problem(self) -> bool:
        """A required package missing or older than the oldest tested."""
        return self.kind == "required" and (self.version is None or "OLDER" in self.verdict)

    def line(self) -> str:
        """One line: name, version, where it stands, and what its absence costs."""
        p = self.package
        shown = self.version or "missing"
        text = f"{self.kind:<8} {p.distribution:<13} {shown:<14} {self.verdict}"
        if self.version is None and p.without:
            where = p.lessons if self.kind == "tool" else f"lessons {p.lessons}"
            text += f"; {where}: {p.without}"
        return text


def package_report() -> list[PackageStatus]:
    """Every package the course uses, its version and its place in the tested range."""
    out = []
    for kind, packages in (("required", REQUIRED), ("optional", OPTIONAL), ("tool", TOOLS)):
        for p in packages:
            found = installed_version(p.distribution) if importable(p.module) else None
            out.append(PackageStatus(p, kind, found, range_verdict(p.distribution, found)))
    return out


def untested_versions() -> str:
    """One paragraph naming each installed required package outside the tested range and the
    lessons it may change; "" when every one is inside (a lesson's ``print(L)`` shows it)."""
    outside, older = [], []
    for p in REQUIRED:
        found = installed_version(p.distribution)
        if found is None or p.distribution not in TESTED:
            continue  # doctor reports a missing package; a first cell cannot get this far
        low, high = TESTED[p.distribution]
        if _release(found) < _release(low):
            older.append(f"'{p.distribution}>={low}'")
        elif _release(found) <= _release(high):
            continue
        lessons = "every lesson" if p.lessons == "all" else f"lessons {p.lessons}"
        outside.append(f"{p.distribution} {found} (tested {low} to {high}; {lessons})")
    if not outside:
        return ""
    text = (
        f"Outside the versions this course is tested with: {'; '.join(outside)}. Those lessons "
        "may measure other numbers, and a claim may fail where a library changed."
    )
    if older:
        text += f" To move into the tested range: pip install {' '.join(older)}."
    return text + " python -m helpers doctor lists every package."


def missing_optional(module: str) -> str | None:
    """Why an optional package's runs are skipped here (the package and how to install it),
    or None when it can be imported."""
    if importable(module):
        return None
    p = next((p for p in OPTIONAL + TOOLS if p.module == module), None)
    name = p.distribution if p else module
    return f"{name} is not installed (pip install {name})"


# --------------------------------------------------------------------------------------------
# transformers: activation checkpointing. 5.2x calls it activation checkpointing
# (``activation_checkpointing_enable``, ``is_activation_checkpointing``); 5.17 has only the
# older gradient-checkpointing names, which 5.2x keeps as deprecated aliases.


def checkpointing_enable(model: torch.nn.Module, kwargs: dict | None = None) -> None:
    """transformers' ``activation_checkpointing_enable(kwargs)`` under this version's name
    (``gradient_checkpointing_enable`` before 5.2x)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None:
        enable = model.gradient_checkpointing_enable
    enable(kwargs)


def checkpointing_disable(model: torch.nn.Module) -> None:
    """transformers' ``activation_checkpointing_disable()`` under this version's name."""
    disable = getattr(model, "activation_checkpointing_disable", None)
    if disable is None:
        disable = model.gradient_checkpointing_disable
    disable()


def trainer_checkpointing(on: bool, kwargs: dict | None = None) -> dict:
    """``TrainingArguments``' keywords that switch checkpointing, under this version's names:
    ``activation_checkpointing`` (5.2x; ``gradient_checkpointing`` is its deprecated alias
    there) or ``gradient_checkpointing`` (before), and the matching ``*_kwargs``."""
    from transformers import TrainingArguments  # slow (training_args): only Trainer calls

    names = TrainingArguments.__dataclass_fields__
    name = (
        "activation_checkpointing"
        if "activation_checkpointing" in names
        else "gradient_checkpointing"
    )
    return {name: on} if kwargs is None else {name: on, f"{name}_kwargs": kwargs}


def is_checkpointing(model: torch.nn.Module) -> bool:
    """transformers' ``model.is_activation_checkpointing`` (``is_gradient_checkpointing``
    before 5.2x; the old name warns on the versions that have both)."""
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(model.is_gradient_checkpointing if flag is None else flag)


# --------------------------------------------------------------------------------------------
# transformers: LayerDrop. Before 5.2x some decoders (OPT and others) draw a random number per
# layer in training even when their ``layerdrop`` is 0, and compare it with a Python float.
# On fake tensors (the traced estimator) that comparison has no value and the trace stops
# (DataDependentOutputException: aten._local_scalar_dense); 5.2x skips the draw at 0.


def skip_idle_layerdrop(model: torch.nn.Module) -> int:
    """Put the modules whose ``layerdrop`` is 0 in eval mode, themselves only (their layers,
    dropouts included, stay in training), so no draw is made; returns how many there were.
    With layerdrop 0 a draw never drops a layer: the step computes the same either way."""
    idle = [m for m in model.modules() if getattr(m, "layerdrop", None) == 0 and m.training]
    for module in idle:
        module.training = False  # not module.eval(), which would recurse into the layers
    return len(idle)


# --------------------------------------------------------------------------------------------
# torch: CUDA autocast's fp32 list (ATen/autocast_mode.h, AT_FORALL_FP32). torch 2.12 added
# rms_norm to it (pytorch/pytorch#174824): under bf16/fp16 autocast on a GPU its inputs are
# cast to fp32 from 2.12 on, and run in the input's dtype before.
AUTOCAST_FP32_SINCE = {"rms_norm": (2, 12)}


def cuda_autocast_fp32_ops(always: frozenset[str]) -> frozenset[str]:
    """CUDA autocast's fp32 list for this torch: ``always`` plus the ops added since."""
    have = _release(torch.__version__)
    return always | {op for op, since in AUTOCAST_FP32_SINCE.items() if have >= since}


# --------------------------------------------------------------------------------------------
# torchao: AdamW with bf16 stochastic rounding. torchao 0.18 exports its full-precision-state
# AdamW as ``torchao.optim._AdamW`` (the underscore is torchao's; its README's "stochastic
# rounding for BF16 weight" section teaches ``_AdamW(..., bf16_stochastic_round=True)``), and
# compiles its step with torch.compile, one graph per parameter shape.


def bf16_stochastic_adamw(params, lr: float = 1e-3) -> torch.optim.Optimizer:
    """torchao's AdamW with ``bf16_stochastic_round=True``: the update computed in fp32 and
    rounded to a bf16 neighbour at random, with odds set by the distance to each.

    On a CPU its step runs eagerly (``torch.compiler.set_stance("force_eager")`` around it):
    compiling costs seconds per parameter shape there, and the eager function computes the
    same update. RuntimeError, saying what to install, without torchao.
    """
    try:
        from torchao.optim import _AdamW
    except ImportError as err:
        raise RuntimeError(
            "bf16_update stochastic needs torchao: pip install torchao "
            "(or use bf16_update kahan or nearest)"
        ) from err
    params = list(params)
    optimizer = _AdamW(params, lr=lr, bf16_stochastic_round=True)
    if params and all(p.device.type == "cpu" for p in params):
        compiled_step = optimizer.step

        def eager_step(closure=None):
            with torch.compiler.set_stance("force_eager"):
                return compiled_step(closure)

        optimizer.step = eager_step
    return optimizer


# --------------------------------------------------------------------------------------------
# torch: torch.compile's activation memory budget. The min-cut partitioner that splits a
# compiled graph into forward and backward (torch.compile's default, and the
# ``aot_eager_decomp_partition`` backend's) reads ``torch._functorch.config
# .activation_memory_budget`` when it compiles. torch 2.11 and 2.13 both have that knob;
# torch 2.13 adds a prototype public form, ``torch.autograd.graph.region_activation_memory_budget``,
# which is used inside the compiled function rather than around its first call.


def activation_memory_budget(budget: float):
    """Context manager: graphs that torch.compile compiles inside it save for backward at most
    ``budget`` (0.0 to 1.0) of what its min-cut partitioner saves by default; 0.0 saves only the
    compiled region's inputs, as checkpointing the whole region would.

    Private API: ``torch._functorch.config.patch(activation_memory_budget=budget)`` (torch 2.11
    to 2.13). It acts when a graph compiles, so the first call must run inside it.
    """
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"activation_memory_budget must be in [0, 1], got {budget}")
    return functorch_config.patch(activation_memory_budget=budget)
