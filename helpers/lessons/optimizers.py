"""Lesson 06, sections 4-6 (notebooks/06_optimizers.ipynb).

Optimizers: the timings and runs the lesson adds to the state rules.

Section 4 reads the state the Trainer's optimizers hold and tabulates the state rules of the
others (``STATE_RULES``), section 5 times ``optimizer.step()`` of AdamW's implementations in
turns, section 6 trains the learnable task with each optimizer. The state rules the estimator
uses are core machinery: ``helpers.optimizer_state``.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from helpers.device import resolve
from helpers.models import build_model, load_config
from helpers.optimizer_state import BNB_BLOCK, BNB_QMAP, StateTensor, read_state
from helpers.progress import progress
from helpers.quiet import quiet_libraries
from helpers.timing import Comparison, compare_calls
from helpers.train import (
    RunConfig,
    TrainResult,
    train_markov,
)


def import_bitsandbytes():
    """The bitsandbytes module, imported without its Hub-kernel warning; None if not installed.

    (``helpers.quiet`` says what the warning is about.)
    """
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    with quiet_libraries():
        import bitsandbytes  # optional; asks CUDA when imported

    return bitsandbytes


@dataclass
class AdamWStepResult:
    """``optimizer.step()`` of AdamW built several ways: times in turns, and the updates."""

    comparison: Comparison  # seconds per step of each variant that ran, interleaved rounds
    errors: dict[str, str]  # variant -> why it cannot be built on this device
    max_diff: dict[str, float]  # variant -> largest |weight - first variant's| after one step
    n_tensors: int  # parameter tensors the optimizer steps
    n_params: int


def adamw_step_times(
    cfg: RunConfig, variants: dict[str, dict], repeats: int = 20, claims=()
) -> AdamWStepResult:
    """``optimizer.step()`` alone for torch AdamW built with each kwargs set, timed in turns.

    The model of ``cfg`` gets fixed random gradients once; every variant starts from the same
    weights, so the updated weights can be compared too (``max_diff``: the largest difference
    from the first variant after one step). The variants' optimizers then step in interleaved
    rounds (``helpers.timing.compare_calls``, at least ``repeats`` rounds, more while a claim
    is undecided): ``comparison``. A variant that cannot be built on this device comes back
    in ``errors`` as its error message instead of a time.
    """
    device = resolve(cfg.device)
    model = build_model(load_config(cfg.model), device=device, seed=cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(cfg.seed)
    start = [p.detach().clone() for p in params]
    grads = [1e-3 * torch.randn(p.shape, generator=g).to(device) for p in params]
    steps, errors, max_diff, ref = {}, {}, {}, None
    for label, kwargs in variants.items():
        for p, p0, gr in zip(params, start, grads, strict=True):
            p.data.copy_(p0)
            p.grad = gr
        try:
            opt = torch.optim.AdamW(params, lr=1e-3, **kwargs)
            opt.step()  # creates the state, and is the step whose result is compared
        except (RuntimeError, ValueError) as err:
            errors[label] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            continue
        if ref is None:  # the first variant that runs is the reference
            ref = [p.detach().clone() for p in params]
        max_diff[label] = max(
            float((p.detach() - r).abs().max()) for p, r in zip(params, ref, strict=True)
        )
        steps[label] = opt.step
    ran = [c for c in claims if c.name in steps and c.versus in steps]
    comparison = compare_calls(steps, device, warmup=2, rounds=repeats,
                               max_rounds=max(repeats, 15), claims=ran)  # fmt: skip
    return AdamWStepResult(comparison, errors, max_diff, n_tensors=len(params),
                           n_params=sum(p.numel() for p in params))  # fmt: skip


@dataclass
class MarkovCurvesResult:
    """Loss curves of several runs on the learnable task, and the task's reference losses."""

    runs: dict[str, TrainResult]  # label -> its run, in the order given
    best_loss: float  # the task's entropy rate: no model does better
    uniform_loss: float  # log(n_states): a model that learnt which tokens occur, nothing more


def markov_curves(runs: dict[str, tuple[RunConfig, float]], steps: int) -> MarkovCurvesResult:
    """Loss curves on the learnable task for several ``(RunConfig, lr)`` pairs, in order.

    Each run builds its own model from its seed, so runs do not influence each other; they
    share one process only to pay the imports once. The reference losses are the first run's
    task's (runs with one seed and vocabulary share the task).
    """
    with quiet_libraries():  # an 8-bit run imports bitsandbytes in this (fresh) process
        curves = {
            label: train_markov(cfg, steps, lr)
            for label, (cfg, lr) in progress(runs.items(), "training runs", total=len(runs))
        }
    first = next(iter(curves.values()))
    return MarkovCurvesResult(curves, first.best_loss, first.uniform_loss)


@dataclass
class TrainerStateResult:
    """What the Trainer built for one ``optim=`` name, or why it could not."""

    optimizer_class: str = ""  # module.Class of its optimizer (accelerate's wrapper removed)
    hyper: dict = field(default_factory=dict)  # hyper-parameters (numbers, flags, tuples)
    overrides: list[tuple] = field(default_factory=list)  # (module, attr, config): 32-bit state
    state: list[StateTensor] = field(default_factory=list)  # read_state of the optimizer
    error: str | None = None  # "ImportError: ..." when the name failed (bitsandbytes missing)


def trainer_states(trained_with: Callable, optims: list[str]) -> dict[str, TrainerStateResult]:
    """What the Trainer built for each of its ``optim=`` names, trained by ``trained_with``.

    ``trained_with(optim)`` trains with ``TrainingArguments(optim=optim)`` and returns the model
    and the optimizer (lesson 06 writes it in a cell). Per name: the optimizer's class, its
    hyper-parameters, the modules registered with bitsandbytes' GlobalOptimManager for 32-bit
    state, and ``read_state`` of the optimizer. A name that fails (bitsandbytes missing, an
    unknown name) comes back with its ``error`` set.
    """
    out = {}
    for optim in progress(optims, "Trainer optimizers"):
        # DeepSpeed's CPU notice, bitsandbytes' import warning, the Trainer's own warnings
        with quiet_libraries(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                model, opt = trained_with(optim)
            except (ImportError, ValueError, RuntimeError) as err:
                line = str(err).strip().splitlines()[0]
                out[optim] = TrainerStateResult(error=f"{type(err).__name__}: {line}")
                continue
        out[optim] = TrainerStateResult(
            optimizer_class=f"{type(opt).__module__}.{type(opt).__name__}",
            hyper=_hyper_parameters(opt),
            overrides=_bnb_overrides(model, opt),
            state=read_state(model, opt),
        )
    return out


def _bnb_overrides(model: torch.nn.Module, opt) -> list[tuple]:
    """(module name, attribute, config) of bitsandbytes' 32-bit overrides; [] for torch's."""
    if "bitsandbytes" not in type(opt).__module__:
        return []
    import bitsandbytes as bnb  # optional; asks CUDA when imported

    manager = bnb.optim.GlobalOptimManager.get_instance()
    names = {id(m): n for n, m in model.named_modules()}
    return [
        (names.get(id(m), "?"), attr, cfg) for m, attr, cfg in manager.module_weight_config_triple
    ]


def _hyper_parameters(opt) -> dict:
    """The optimizer's plain hyper-parameters, with bitsandbytes' 8-bit settings."""
    hyper = {k: v for k, v in opt.defaults.items() if isinstance(v, (int, float, bool, tuple))}
    if hasattr(opt, "args"):  # bitsandbytes keeps optim_bits and min_8bit_size here
        hyper.update({k: getattr(opt.args, k) for k in ("optim_bits", "min_8bit_size")})
    return hyper


@dataclass(frozen=True)
class StateRule:
    """One optimizer of section 4's table: its Trainer name and the state it keeps."""

    optimizer: str
    optim: str  # its TrainingArguments(optim=...) name; "" where transformers has none
    rule: str  # state bytes per parameter, in words
    matrix_bytes: Callable[[int, int, int], int]  # (rows, cols, rank) -> state of one matrix
    source: str  # the file(s) the rule is read from
    key: str = ""  # its key among the measurements when it has no optim name


def _bnb_8bit(states: int) -> Callable[[int, int, int], int]:
    """bitsandbytes, ``states`` moments: a uint8 code per value, an fp32 absmax per block of
    256 values, and one shared 256-entry fp32 map per moment (the step is a Python int)."""
    return lambda m, n, r: states * (m * n + 4 * math.ceil(m * n / BNB_BLOCK) + 4 * BNB_QMAP)


def _torchao(bits: int, block: int) -> Callable[[int, int, int], int]:
    """torchao's AdamW: a 0-d fp32 step, and per moment ``bits``-bit codes, an fp32 scale per
    ``block`` values and the tensor's own fp32 map of 2**bits entries."""
    return lambda m, n, r: 4 + 2 * (m * n * bits // 8 + 4 * (m * n // block) + 4 * 2**bits)


def _low_rank(m: int, n: int, r: int) -> int:
    """GaLore / APOLLO on an m x n matrix: an fp32 projection of r x min(m, n) and Adam's two
    moments of the projected gradient, r x max(m, n) each (the step is a Python int)."""
    return 4 * r * min(m, n) + 8 * r * max(m, n)


_BNB = "bitsandbytes/optim/optimizer.py"
STATE_RULES = (
    StateRule("AdamW (torch)", "adamw_torch", "8, + 4 per tensor (step)",
              lambda m, n, r: 8 * m * n + 4, "torch/optim/adamw.py"),
    StateRule("Adafactor (transformers)", "adafactor", "4(m + n)/mn per m x n matrix; 4 per vector",
              lambda m, n, r: 4 * (m + n) + 4, "transformers/optimization.py"),
    StateRule("8-bit AdamW (bitsandbytes)", "adamw_bnb_8bit",
              "2 + 8/256; 8 for embeddings and tensors < 4096", _bnb_8bit(2), _BNB),
    StateRule("paged 8-bit AdamW", "paged_adamw_8bit",
              "as 8-bit AdamW, in CUDA unified memory", _bnb_8bit(2), _BNB),
    StateRule("Lion (bitsandbytes)", "lion_32bit", "4", lambda m, n, r: 4 * m * n, _BNB),
    StateRule("8-bit Lion", "lion_8bit", "1 + 4/256; 4 for embeddings and tensors < 4096",
              _bnb_8bit(1), _BNB),
    StateRule("8-bit AdamW (torchao)", "adamw_torch_8bit", "2 + 8/256; 8 for tensors < 4096",
              _torchao(8, 256), "torchao/optim/adam.py, subclass_8bit.py"),
    StateRule("4-bit AdamW (torchao)", "adamw_torch_4bit", "1 + 8/128; 8 for tensors < 4096",
              _torchao(4, 128), "torchao/optim/adam.py, subclass_4bit.py"),
    StateRule("GaLore AdamW", "galore_adamw",
              "4r(k + 2l)/kl per k x l target matrix (k <= l, rank r = 128); 8 elsewhere",
              _low_rank, "galore_torch/adamw.py, galore_projector.py"),
    StateRule("APOLLO AdamW", "apollo_adamw", "as GaLore (a random projection)",
              _low_rank, "apollo_torch/apollo.py, random_projector.py"),
    StateRule("schedule-free AdamW", "schedule_free_adamw", "8 (z, exp_avg_sq)",
              lambda m, n, r: 8 * m * n, "schedulefree/adamw_schedulefree.py"),
    StateRule("Muon (torch.optim) + AdamW", "", "4 on 2-D hidden matrices; AdamW's 8 elsewhere",
              lambda m, n, r: 4 * m * n, "torch/optim/_muon.py", key="muon"),
)  # fmt: skip


def state_rule_table(
    measured: dict[str, float], shape: tuple[int, int] = (4096, 4096), rank: int = 128
) -> list[dict]:
    """Section 4's table: one row per ``STATE_RULES`` entry, with its bytes per parameter on one
    matrix of ``shape`` (GaLore and APOLLO at ``rank``, transformers' default) and, where
    ``measured`` has it (keyed by optim name, or ``key``), the measured bytes per parameter.
    """
    m, n = shape
    rows = []
    for rule in STATE_RULES:
        got = measured.get(rule.key or rule.optim)
        rows.append(
            {
                "optimizer": rule.optimizer,
                "optim=": rule.optim or "(none)",
                "state B/param": rule.rule,
                f"{m} x {n} matrix": round(rule.matrix_bytes(m, n, rank) / (m * n), 4),
                "tiny encoder (measured)": None if got is None else round(got, 3),
                "obtained": f"from {rule.source}; not measured here" if got is None else "measured",
            }
        )
    return rows
