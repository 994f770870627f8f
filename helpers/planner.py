"""Find the fastest training configuration that fits a memory budget.

Three steps, each a function returning dataclasses (the CLI ``python -m helpers plan`` only
prints them):

1. ``candidates``: every combination of micro-batch x accumulation (their product is the
   effective batch), what the step keeps for backward (none, full or selective checkpointing,
   offload), precision, optimizer, attention and the weights' dtype, each with the
   estimator's predicted peak (``helpers.estimator``, arithmetic only) and whether it fits.
2. ``shortlist``: the fitting ones ranked by a rough predicted cost; the cheapest few are
   worth measuring.
3. ``measure_candidate``: a short timed run on this machine, in a fresh process, plus one
   tracked step for the measured peak (the budget is enforced there, so a misestimate shows
   up as an out-of-memory result instead of a wrong answer).

``plan`` runs the three and says which configuration won and why.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from helpers import train
from helpers.device import (
    ASSUMED_CONTEXT,
    RESERVE_MARGIN,
    allocation_bytes,
    is_cuda,
    present,
    resolve,
)
from helpers.estimator import Estimate, ModelInfo, describe_model, estimate, model_state_floor
from helpers.hardware import REFERENCE_CARDS, precision_problem
from helpers.isolate import call_isolated, compare_runs
from helpers.memory import CategoryTracker, memory_budget
from helpers.names import (
    ACTIVATION_SETTINGS,
    ATTENTION,
    AUTOCAST,
    BNB_OPTIMIZERS,
    PRECISIONS,
    GiB,
    KiB,
    MiB,
    TiB,
    activation_fields,
    dora_problem,
    human_bytes,
    weights_problem,
)
from helpers.progress import progress
from helpers.scale import get_scale
from helpers.timing import Claim
from helpers.train import RunConfig

DEFAULT_OPTIMIZERS = ("adamw", "adamw8bit", "adafactor")  # SGD is not a drop-in for transformers
GC_COST = 4 / 3  # checkpointing repeats the forward: (1 + 1 + 2) / (1 + 2) of a step's FLOPs
# Rough guesses, only to order candidates for timing (plan measures; plan_for_card says so):
# selective checkpointing keeps the matmuls' outputs and recomputes only element-wise work;
# offload copies each saved tensor to the host and back, partly hidden behind compute.
SELECTIVE_COST = 1.1
OFFLOAD_COST = 1.25
MICRO_BATCH_OVERHEAD_TOKENS = 128  # fixed cost of a micro-batch (launches, Python), in tokens

# SI units are powers of ten (a GB is 10**9 bytes, as a card's box quotes it), binary units
# powers of two (a GiB is 2**30, what allocators count); a bare K, M, G or T is binary.
_UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kb": 10**3,
    "kib": KiB,
    "m": MiB,
    "mb": 10**6,
    "mib": MiB,
    "g": GiB,
    "gb": 10**9,
    "gib": GiB,
    "t": TiB,
    "tb": 10**12,
    "tib": TiB,
}


def parse_bytes(text: str) -> int:
    """``"16GB"``, ``"16 GiB"``, ``"512MiB"``, ``"1e9"`` -> bytes. GB, MB, KB and TB are powers
    of ten (16GB = 16 x 10**9), GiB, MiB, KiB and TiB and a bare G, M, K or T powers of two
    (16GiB = 16 x 2**30); ``bytes_read_as`` says which, for a learner."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: use e.g. 16GB, 512MiB or a byte count")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return int(value)


_POWERS = {"k": (3, 10), "m": (6, 20), "g": (9, 30), "t": (12, 40)}  # SI and binary exponents


def bytes_read_as(text: str) -> str:
    """How ``parse_bytes`` read ``text``, in words: ``16GB = 16,000,000,000 bytes (14.9 GiB);
    GB is 10^9 bytes, write 16GiB for 2^30``."""
    nbytes = parse_bytes(text)
    match = re.fullmatch(r"\s*(\S*?[0-9.])\s*([a-zA-Z]*)\s*", str(text))
    number, unit = match.group(1), match.group(2)
    out = f"{number}{unit} = {nbytes:,} bytes ({human_bytes(nbytes)})"
    if unit.lower() in ("kb", "mb", "gb", "tb"):
        si, binary = _POWERS[unit[0].lower()]
        out += (
            f"; {unit.upper()} is 10^{si} bytes, write {number}{unit[0].upper()}iB for 2^{binary}"
        )
    return out


@dataclass(frozen=True)
class Candidate:
    """One configuration and what the estimator predicts for it."""

    micro_batch: int
    grad_accum: int
    gradient_checkpointing: bool
    precision: str
    optimizer: str
    attn: str
    estimated_peak: int
    fits: bool
    cost: float  # rough relative time per optimizer step (only to choose what to measure)
    estimate: Estimate | None = field(default=None, compare=False, repr=False)
    weight_dtype: str = "fp32"  # RunConfig.weight_dtype: "bf16" keeps no fp32 master copy
    bf16_update: str = "nearest"  # RunConfig.bf16_update (kahan for full bf16 fine-tuning)
    checkpoint_policy: str = "full"  # RunConfig.checkpoint_policy (with gradient_checkpointing)
    offload_activations: bool = False  # RunConfig.offload_activations
    # True: not estimated, as a lower bound of its peak already exceeds the budget: the model
    # state alone (weights, buffers, gradients, optimizer state), or a lighter twin's peak
    # plus the bytes its weights take more (``_more_weight_bytes``); estimated_peak is that.
    peak_is_floor: bool = False

    @property
    def activations(self) -> str:
        """Its entry of ``names.ACTIVATION_SETTINGS``: none, full, selective or offload."""
        if self.offload_activations:
            return "offload"
        return self.checkpoint_policy if self.gradient_checkpointing else "none"

    @property
    def label(self) -> str:
        """A short description, e.g. ``mb4 x ga2, bf16, adamw, sdpa, checkpointing``; bf16
        weights add ``bf16 weights`` (and the update, e.g. ``+kahan``)."""
        weights = []
        if self.weight_dtype != "fp32":
            update = "" if self.bf16_update == "nearest" else f"+{self.bf16_update}"
            weights = [f"{self.weight_dtype} weights{update}"]
        parts = [
            f"mb{self.micro_batch} x ga{self.grad_accum}",
            self.precision,
            *weights,
            self.optimizer,
            self.attn,
        ] + ACTIVATION_LABELS[self.activations]
        return ", ".join(parts)

    def run_config(self, model, seq_len: int, device: str | None = None, **extra) -> RunConfig:
        """The ``helpers.train.RunConfig`` that trains this candidate: its own settings, and
        RunConfig's defaults (not a scale's warm-up and repeats, as ``Scale.run_config``'s)
        for what ``extra`` leaves open."""
        return RunConfig(
            model=model,
            batch_size=self.micro_batch,
            seq_len=seq_len,
            precision=self.precision,
            optimizer=self.optimizer,
            weight_dtype=self.weight_dtype,
            bf16_update=self.bf16_update,
            gradient_checkpointing=self.gradient_checkpointing,
            checkpoint_policy=self.checkpoint_policy,
            offload_activations=self.offload_activations,
            attn=self.attn,
            grad_accum=self.grad_accum,
            device=device,
            label=self.label,
            **extra,
        )


ACTIVATION_LABELS = {"none": [], "full": ["checkpointing"],
                     "selective": ["selective checkpointing"],
                     "offload": ["offloaded activations"]}  # fmt: skip


@dataclass
class CandidateResult:
    """A short measured run of a candidate on this machine."""

    candidate: Candidate
    step_time: float | None = None  # median seconds per optimizer step
    samples_per_s: float | None = None  # median over the interleaved rounds
    samples_per_s_range: tuple[float, float] | None = None  # slowest and fastest round
    measured_peak: int | None = None  # largest tracked total of one step (None: not tracked)
    error: str | None = None  # why it did not run (e.g. out of memory under the budget)

    @property
    def ok(self) -> bool:
        """True when the run finished."""
        return self.error is None


@dataclass
class Plan:
    """The search and its answer."""

    model: str
    budget: int
    effective_batch: int
    seq_len: int
    device: str
    weights: int  # bytes of parameters and buffers alone
    considered: int  # candidates estimated
    fitting: list[Candidate]  # estimated to fit, cheapest predicted first
    measured: list[CandidateResult]  # fastest first; failed runs last
    best: CandidateResult | None
    runner_up: CandidateResult | None
    reason: str
    timing: object = None  # the interleaved Comparison of the candidates that ran


def usable_budget(budget: int, device: torch.device) -> int:
    """How high an estimated peak may go under ``budget`` on ``device``.

    On a CPU the tracker enforces the budget on exactly the tensors the estimator predicts.
    On CUDA the cap (``helpers.device.cap_allocator``) holds the CUDA context too, and limits
    what the allocator *reserves*: live tensors plus fragmentation, cached blocks and library
    workspaces. So the context is taken off, and the peak may use 1 / 1.1 of the rest.
    """
    if not is_cuda(device):
        return budget
    return int((budget - ASSUMED_CONTEXT) / (1 + RESERVE_MARGIN))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def available_precisions(device: torch.device) -> list[str]:
    """Precisions ``device`` can train in (all of them when it is not here to be asked)."""
    if not present(device):
        return list(PRECISIONS)
    return [p for p in PRECISIONS if precision_problem(p, device) is None]


def available_optimizers(names=DEFAULT_OPTIMIZERS) -> list[str]:
    """``names`` minus bitsandbytes' optimizers (8-bit AdamW, Lion) when it is not installed."""
    have_bnb = importlib.util.find_spec("bitsandbytes") is not None
    return [o for o in names if o not in BNB_OPTIMIZERS or have_bnb]


# How the planner updates bf16 weights in full fine-tuning: Kahan summation (torch-optimi,
# pure Python, so it runs on every device; its extra 2 bytes per parameter are counted).
# Plain rounding stalls at small learning rates (lesson 05, section 8); LoRA's adapters stay
# fp32 on a bf16 base and need no remedy.
BF16_FULL_UPDATE = "kahan"


def weight_settings(precisions, optimizers, lora: bool, qlora: bool) -> list[tuple[str, str]]:
    """(weight_dtype, bf16_update) pairs to search: fp32 weights always; for full fine-tuning
    bf16 weights where bf16 is among ``precisions``, with Kahan's AdamW when AdamW is searched
    (only AdamW has the remedy); under LoRA a frozen base in each searched 16-bit precision
    (not for QLoRA, whose base is already 4- and 16-bit)."""
    out = [("fp32", "nearest")]
    if qlora:
        return out
    if lora:  # a 16-bit frozen base: bf16, or fp16 where the card has no bf16 (a T4)
        return out + [(half, "nearest") for half in ("bf16", "fp16") if half in precisions]
    if "bf16" in precisions and "adamw" in optimizers:
        return [*out, ("bf16", BF16_FULL_UPDATE)]
    return out


def predicted_cost(c: Candidate, seq_len: int, device_type: str) -> float:
    """Rough relative time of one optimizer step, used only to pick which candidates to time.

    Tokens processed, plus a fixed overhead per micro-batch; x4/3 with checkpointing (one more
    forward), less for selective checkpointing and offload (``SELECTIVE_COST``, ``OFFLOAD_COST``,
    guesses); 16-bit autocast halves matmul time on a GPU with tensor cores but costs extra
    casts on a CPU without 16-bit arithmetic; SDPA is slightly cheaper than eager attention.
    """
    tokens = c.micro_batch * seq_len + MICRO_BATCH_OVERHEAD_TOKENS
    kept = {"none": 1.0, "full": GC_COST, "selective": SELECTIVE_COST, "offload": OFFLOAD_COST}
    cost = c.grad_accum * tokens * kept[c.activations]
    if c.precision in AUTOCAST:
        cost *= 0.5 if device_type == "cuda" else 1.5
    elif c.precision == "tf32":
        cost *= 0.7
    if c.attn == "sdpa":
        cost *= 0.95
    return cost


def candidates(
    model,
    budget: int,
    effective_batch: int,
    seq_len: int,
    device: str | torch.device | None = None,
    precisions=None,
    optimizers=None,
    attentions=ATTENTION,
    checkpointing=None,
    lora_r: int = 0,
    lora_targets: str = "",
    qlora: bool = False,
    report: Callable[[int, int], None] | None = None,
    weights=None,
    exhaustive: bool = False,
    first_fit: bool = False,
    dora: bool = False,
) -> list[Candidate]:
    """Every configuration of the search space with its estimated peak; cheapest fitting first.

    A candidate fits when its estimated peak is within ``usable_budget(budget, device)``.
    ``checkpointing``: entries of ``names.ACTIVATION_SETTINGS`` (True/False: full/none);
    default all of them, offload only on a device it moves activations off (not the CPU).
    ``lora_r`` > 0 trains LoRA adapters (``qlora``: on 4-bit weights, 16-bit precisions only;
    ``dora``: DoRA's). ``weights``: (weight_dtype, bf16_update) pairs; default
    ``weight_settings``: fp32 weights, and bf16 weights with no master copy where bf16 is
    searched. bf16 weights train in bf16
    only, with AdamW (Kahan's) in full fine-tuning and any optimizer under LoRA.
    Each setting's micro-batches are estimated from the largest down to the first that fits:
    the smaller ones would fit too but cost more, so they cannot be the answer and are left
    out (``exhaustive=True`` estimates them all; tests/test_plan.py checks both agree).
    ``first_fit=True`` (``plan_for_card``, which needs only the answer) estimates the whole
    space cheapest predicted first and stops after the first cost at which one fits, then
    adds the answer's plain alternatives its explanation compares (``_cheapest_first``).
    A traced model takes a second or two per new setting: ``report(done, total)`` is called
    after each estimate (the ones left out counted as done); without it a progress bar
    counts them.
    """
    dev = resolve(device)
    if problem := dora_problem(dora, lora_r, qlora):
        raise ValueError(problem)
    limit = usable_budget(budget, dev)
    precisions = list(precisions or available_precisions(dev))
    if qlora:
        precisions = [p for p in precisions if p in AUTOCAST]
    optimizers = list(optimizers or available_optimizers())
    weights = list(weights or weight_settings(precisions, optimizers, lora_r > 0, qlora))
    infos = _Described(model, lora_r, lora_targets, dora)
    space = _space(effective_batch, activation_settings(checkpointing, dev), precisions,
                   optimizers, attentions, weights, lora_r > 0)  # fmt: skip
    estimate_one = functools.partial(_candidate, infos, effective_batch, seq_len, dev, qlora,
                                     limit, first_fit and not qlora)  # fmt: skip
    cost = functools.partial(_setting_cost, effective_batch, seq_len, dev.type)
    first = _ranking(optimizers)
    out = (_cheapest_first(space, estimate_one, report, cost, seq_len, first) if first_fit
           else _descend(space, estimate_one, report, exhaustive))  # fmt: skip
    out.sort(key=first)
    return out


def _ranking(optimizers) -> Callable[[Candidate], tuple]:
    """``candidates``' order, the answer first: fitting, cheapest predicted, the optimizer
    asked for first, the lightest."""
    rank = {name: i for i, name in enumerate(optimizers)}  # ties: the order asked for
    return lambda c: (not c.fits, c.cost, rank[c.optimizer], c.estimated_peak)


def _descend(space, estimate_one, report, exhaustive: bool) -> list[Candidate]:
    """``candidates``' walk: each setting's micro-batches from the largest down, to the first
    that fits (every one with ``exhaustive``); ``estimate_one(micro, *setting)``."""
    kinds: dict[tuple, list[int]] = {}  # every setting but the micro-batch: its micro-batches
    for micro, *kind in space:
        kinds.setdefault(tuple(kind), []).append(micro)
    bar = None if report else progress(None, "estimating setups", len(space), unit="setup")
    out: list[Candidate] = []
    done = 0
    for kind, micros in kinds.items():
        for micro in sorted(micros, reverse=True):
            c = estimate_one(micro, *kind)
            out.append(c)
            # A smaller micro-batch of a setting that fits costs more (one more micro-batch's
            # overhead per step, the same tokens): it is never the answer, so not estimated.
            skip = sum(m < micro for m in micros) if c.fits and not exhaustive else 0
            done += 1 + skip
            _advance(bar, report, done, len(space))
            if skip:
                break
    if bar is not None:
        bar.close()
    return out


def _cheapest_first(space, estimate_one, report, cost_of, seq_len: int, first) -> list[Candidate]:
    """``candidates``' walk with ``first_fit``: every setting in order of ``cost_of`` (the
    predicted cost, known before estimating), up to the first cost at which one fits and its
    ties; then the answer's plain alternatives not yet estimated (``_plain_changes``), which
    its explanation compares (a heavier twin of the answer as a floor where that is over the
    budget: ``_candidate``'s ``twin``); ``first`` ranks the answer first, as ``candidates``
    does. Nothing cheaper than the answer fits, so it is the answer an
    exhaustive search gives (tests/test_plan.py). A setting whose lighter twin (``_lighter_twins``)
    came before it is left out (so are their twins): it holds more at no lower cost, so it is
    never the answer, and it fits only where its twin fits too."""
    searched = set(space)

    def twins(setting) -> set:
        return {t for t in _lighter_twins(setting, seq_len) if t in searched}

    # Stable: ties keep their order, except that a setting goes after its lighter twins.
    order = sorted(space, key=lambda s: (cost_of(*s), bool(twins(s))))
    settled: set = set()  # estimated, or left out for a twin settled before it
    bar = None if report else progress(None, "estimating setups", len(space), unit="setup")
    out: list[Candidate] = []
    found = None  # the cost at which a candidate first fitted
    walked = 0
    for setting in order:
        if found is not None and cost_of(*setting) > found:
            break
        walked += 1
        left_out = bool(twins(setting) & settled)
        settled.add(setting)
        if left_out:
            continue
        c = estimate_one(*setting)
        out.append(c)
        found = c.cost if c.fits and found is None else found
        _advance(bar, report, walked, len(space))
    fitting = [c for c in out if c.fits]
    if fitting:
        best = min(fitting, key=first)  # the answer, as ``candidates`` ranks them
        done = {_setting(c) for c in out}
        for chosen, _, change in _plain_changes(best):
            other = _setting(replace(best, **change))
            if chosen and other in space and other not in done:
                twin = best if _setting(best) in _lighter_twins(other, seq_len) else None
                out.append(estimate_one(*other, twin=twin))  # a floor, where that decides
                done.add(other)
    _advance(bar, report, len(space), len(space))
    if bar is not None:
        bar.close()
    return out


# From this sequence length eager attention holds more than SDPA: the b x heads x s x s
# probabilities it keeps outgrow the log-sum-exp (b x heads x s, padded to 32 positions, fp32)
# that SDPA's fused kernels keep instead (helpers.estimator.traced).
EAGER_HOLDS_MORE_FROM = 64


def _lighter_twins(setting: tuple, seq_len: int) -> list[tuple]:
    """Settings of the search that hold less than ``setting`` at no higher predicted cost:
    with its fp32 weights held in its 16-bit compute dtype instead (a frozen base in bf16 or
    fp16 under LoRA: half the weights' bytes, no autocast copies of them, the same cost), and
    with SDPA for eager attention (cheaper, and from ``EAGER_HOLDS_MORE_FROM`` positions
    lighter). tests/test_plan.py compares each pair's estimates."""
    micro, act, prec, opt, attn, (weight_dtype, update) = setting
    out = []
    if weight_dtype == "fp32" and prec in AUTOCAST:
        out.append((micro, act, prec, opt, attn, (prec, "nearest")))
    if attn == "eager" and seq_len >= EAGER_HOLDS_MORE_FROM:
        out.append((micro, act, prec, opt, "sdpa", (weight_dtype, update)))
    return out


def _setting(c: Candidate) -> tuple:
    """A candidate's entry of the search space (``_space``): its micro-batch and settings."""
    weights = (c.weight_dtype, c.bf16_update)
    return (c.micro_batch, c.activations, c.precision, c.optimizer, c.attn, weights)


def _unestimated(effective_batch, micro, act, prec, opt, attn, weights) -> Candidate:
    """A setting of the search as a Candidate, before its estimate (peak 0, cost 0)."""
    wd, update = weights
    fields = activation_fields(act)
    return Candidate(micro, effective_batch // micro, fields["gradient_checkpointing"], prec,
                     opt, attn, 0, False, 0.0, None, wd, update, fields["checkpoint_policy"],
                     fields["offload_activations"])  # fmt: skip


def _setting_cost(effective_batch, seq_len, device_type, *setting) -> float:
    """``predicted_cost`` of a setting of the search, which needs no estimate."""
    return predicted_cost(_unestimated(effective_batch, *setting), seq_len, device_type)


class _Described(dict):
    """The ``ModelInfo`` of ``model`` per (attention, weights' dtype), described the first time
    a search asks for it: a LoRA model is wrapped by peft on the meta device for each, and a
    search that stops early asks for few of them."""

    def __init__(self, model, lora_r: int, lora_targets: str, dora: bool = False) -> None:
        super().__init__()
        self.model, self.lora = model, (lora_r, lora_targets)
        self.dora = dora

    def __missing__(self, key: tuple[str, str]) -> ModelInfo:
        attn, weight_dtype = key
        info = describe_model(self.model, attn, *self.lora, weight_dtype, self.dora)
        self[key] = info
        return info


def _candidate(infos, effective_batch, seq_len, dev, qlora, limit, floor, micro, act, prec, opt,
               attn, weights, twin: Candidate | None = None) -> Candidate:  # fmt: skip
    """One candidate of the search, estimated (``infos``: the ModelInfo per attention and
    weights' dtype). ``floor``: when the model state alone (``model_state_floor``) exceeds
    ``limit`` the step cannot fit and is not estimated; the candidate's peak is that floor.
    So too when ``twin``, an estimated setting equal to this one but for lighter weights (its
    ``_lighter_twins``), plus the bytes this one's weights take more, exceeds ``limit``."""
    c = _unestimated(effective_batch, micro, act, prec, opt, attn, weights)
    info = infos[attn, c.weight_dtype]
    state = model_state_floor(info, opt, dev.type, c.bf16_update) if floor else 0
    if floor and twin is not None and twin.estimate is not None and twin.attn == attn:
        light = infos[attn, twin.weight_dtype]
        state = max(state, twin.estimated_peak + _more_weight_bytes(info, light, dev.type))
    if floor and state > limit:
        c = replace(c, estimated_peak=state, peak_is_floor=True)
        return replace(c, cost=predicted_cost(c, seq_len, dev.type))
    est = estimate(info, micro, seq_len, prec, opt, attn=attn,
                   grad_accum=c.grad_accum, device=dev, qlora=qlora, weight_dtype=c.weight_dtype,
                   bf16_update=c.bf16_update, **activation_fields(act))  # fmt: skip
    c = replace(c, estimated_peak=est.peak, fits=est.peak <= limit, estimate=est)
    return replace(c, cost=predicted_cost(c, seq_len, dev.type))


def _more_weight_bytes(heavy, light, device_type: str) -> int:
    """At least how many more bytes ``heavy``'s frozen weights hold than ``light``'s (two
    ModelInfos of one model, an fp32 and a 16-bit base): the first's bytes as they are, the
    second's rounded up as the allocator stores them. With everything else of a step at least
    as large in fp32 (tests/test_plan.py compares the pairs), a lighter twin's peak plus
    these bytes is a lower bound of the heavier one's."""

    def frozen(info, rounded: bool) -> int:
        sizes = (p.numel * p.dtype.itemsize for p in info.params if not p.trainable)
        return sum(allocation_bytes(n, device_type) if rounded else n for n in sizes)

    return frozen(heavy, False) - frozen(light, True)


def _advance(bar, report, done: int, total: int) -> None:
    """Move the progress bar (or call ``report``) to ``done`` of ``total`` setups."""
    if report is not None:
        report(done, total)
    else:
        bar.update(done - bar.n)


def _space(effective_batch, kept, precisions, optimizers, attentions, weights, lora) -> list:
    """The search's combinations that are settings at all (``_searchable``)."""
    every = itertools.product(
        _divisors(effective_batch), kept, precisions, optimizers, attentions, weights
    )
    return [s for s in every if _searchable(s[2], s[3], *s[5], lora)]


def activation_settings(checkpointing, device: torch.device) -> list[str]:
    """The activation settings to search (``candidates``' ``checkpointing``), as names."""
    if checkpointing is None:
        moves = device.type != "cpu"  # on the CPU save_on_cpu keeps every tensor where it is
        return [s for s in ACTIVATION_SETTINGS if s != "offload" or moves]
    names = [{True: "full", False: "none"}.get(s, s) for s in checkpointing]
    for name in names:
        activation_fields(name)  # ValueError for an unknown one
    return list(dict.fromkeys(names))


def _searchable(precision: str, optimizer: str, weight_dtype: str, update: str, lora: bool) -> bool:
    """Whether a combination is a setting at all (``names.weights_problem``)."""
    from_names = weights_problem(weight_dtype, "", update, precision, optimizer, int(lora))
    return from_names is None


def shortlist(cands: list[Candidate], k: int = 6) -> list[Candidate]:
    """``k`` fitting candidates worth timing: cheapest predicted first, varied.

    The cost model cannot tell optimizers or attention kernels apart well, so the first pass
    takes the cheapest candidate of each (precision, optimizer, attention, checkpointing)
    combination, i.e. its largest micro-batch that fits; remaining slots go by cost.
    """
    fitting = [c for c in cands if c.fits]
    picked, seen = [], set()
    for c in fitting:
        key = _kind(c)
        if key not in seen and len(picked) < k:
            picked.append(c)
            seen.add(key)
    picked += [c for c in fitting if c not in picked][: k - len(picked)]
    return sorted(picked, key=fitting.index)


def _run(cfg, budget: int | None) -> int:
    """Warm ``cfg`` up, then track one step's peak under ``budget`` (a fresh process's job).

    On CUDA the whole run is inside the allocator's cap: building the model, the warm-up and
    the tracked step; elsewhere the tracked step enforces the budget.
    """
    device = resolve(cfg.device)
    capped = bool(budget) and is_cuda(device)
    with memory_budget(budget, device=device) if capped else contextlib.nullcontext():
        trainee = train.Trainee(cfg)  # through the module: tests stand a fake in
        for _ in range(max(1, cfg.warmup)):  # the optimizer state exists from the first step
            trainee.step()
        tracker = CategoryTracker(budget=None if capped else budget, device=device)
        tracker.track_external(trainee.model, trainee.optimizer)
        with tracker:
            trainee.step()
    return tracker.peaks().peak


def measure_candidate(
    cand: Candidate,
    model,
    seq_len: int,
    budget: int | None = None,
    device: str | None = None,
    isolate: bool = True,
    **lora,
) -> CandidateResult:
    """Run a candidate, tracking one step's peak under ``budget`` (speed: ``time_candidates``);
    ``lora``: RunConfig's LoRA fields of the search (lora_r, lora_targets, qlora, dora)."""
    cfg = cand.run_config(model, seq_len, device=device, warmup=1, flops=False, **lora)
    if isolate:
        outcome = call_isolated(_run, cfg, budget)
        if outcome.error:
            return CandidateResult(cand, error=outcome.error)
        peak = outcome.value
    else:
        try:
            peak = _run(cfg, budget)
        except torch.OutOfMemoryError as err:
            return CandidateResult(cand, error=f"OutOfMemoryError: {str(err).splitlines()[0]}")
    return CandidateResult(cand, measured_peak=peak)


def time_candidates(measured: list[CandidateResult], model, seq_len: int, device=None, rounds=5,
                    **lora):  # fmt: skip
    """Time the candidates that ran against each other in interleaved rounds; fill in speeds.

    Each candidate trains in a process of its own (``helpers.isolate.compare_benches``), so a
    slow spell of the machine hits them all alike (``lora`` as ``measure_candidate``'s).
    Returns the ``Comparison`` (seconds per sample), or None when no candidate ran.
    """
    ok = [m for m in measured if m.ok]
    if not ok:
        return None
    cfgs = {m.candidate.label: m.candidate.run_config(model, seq_len, device=device, **lora)
            for m in ok}  # fmt: skip
    comparison = compare_runs(cfgs, device, rounds=rounds, max_rounds=rounds)
    for m in ok:
        label = m.candidate.label
        if label in comparison.errors:
            m.error = comparison.errors[label]
            continue
        median, slowest, fastest = comparison.rate(label, 1.0)
        m.samples_per_s, m.samples_per_s_range = median, (slowest, fastest)
        m.step_time = m.candidate.micro_batch * m.candidate.grad_accum / median
    return comparison


def plan(
    model,
    budget: int,
    effective_batch: int,
    seq_len: int | None = None,
    device: str | None = None,
    top_k: int = 6,
    rounds: int = 5,
    isolate: bool = True,
    **space,
) -> Plan:
    """Search, prune with the estimator, time the ``top_k`` cheapest, explain the fastest.

    The shortlisted candidates each run in a fresh process under the budget (the measured
    peak), then train against each other in ``rounds`` interleaved rounds (the speed).

    ``space`` narrows the search (``precisions``, ``optimizers``, ``attentions``,
    ``checkpointing``; see ``candidates``). Raises ValueError when the budget cannot hold the
    weights alone or the effective batch is not positive.
    """
    dev = resolve(device)
    if effective_batch < 1:
        raise ValueError("the effective batch must be positive")
    if not present(dev):
        raise ValueError(f"device {dev} is not on this machine: the plan times candidates here")
    seq_len = seq_len or get_scale(device=dev).seq_len
    info = describe_model(model, "eager")
    bf16 = "bf16" in (space.get("precisions") or available_precisions(dev))
    weights = _weights_within(info, budget, 2 if bf16 or space.get("lora_r") else 4)
    cands = candidates(model, budget, effective_batch, seq_len, dev, **space)
    fitting = [c for c in cands if c.fits]
    lora = {k: space[k] for k in ("lora_r", "lora_targets", "qlora", "dora") if space.get(k)}
    measured = [
        measure_candidate(c, model, seq_len, budget, device, isolate, **lora)
        for c in progress(shortlist(cands, top_k), "candidates (peak, then rounds)")
    ]
    timing = time_candidates(measured, model, seq_len, device, rounds, **lora)
    measured.sort(key=lambda m: (not m.ok, -(m.samples_per_s or 0.0)))
    ok = [m for m in measured if m.ok]
    best = ok[0] if ok else None
    runner = ok[1] if len(ok) > 1 else None
    name = model if isinstance(model, str) else info.model_type
    return Plan(
        str(name),
        budget,
        effective_batch,
        seq_len,
        str(dev),
        weights,
        len(cands),
        fitting,
        measured,
        best,
        runner,
        explain(best, runner, cands, budget, measured, timing),
        timing,
    )


def _weights_within(info, budget: int, per_param: int = 4) -> int:
    """The weights' bytes at ``per_param`` bytes each (4: fp32, 2: bf16, the least the search
    can store them in); ValueError when the budget cannot hold even those."""
    weights = per_param * info.n_params + info.buffer_bytes
    if budget < weights:
        dtype = {4: "fp32", 2: "16-bit"}.get(per_param, f"{per_param}-byte")
        raise ValueError(
            f"a budget of {human_bytes(budget)} is below the weights alone "
            f"({human_bytes(weights)} for "
            f"{info.n_params:,} {dtype} parameters): no configuration can fit"
        )
    return weights


def _variant(cands: list[Candidate], c: Candidate, **changes) -> Candidate | None:
    """The candidate equal to ``c`` except for ``changes`` (None if the search lacks it)."""
    want = {
        "micro_batch": c.micro_batch,
        "grad_accum": c.grad_accum,
        "gradient_checkpointing": c.gradient_checkpointing,
        "checkpoint_policy": c.checkpoint_policy,
        "offload_activations": c.offload_activations,
        "precision": c.precision,
        "optimizer": c.optimizer,
        "attn": c.attn,
        "weight_dtype": c.weight_dtype,
        "bf16_update": c.bf16_update,
        **changes,
    }
    return next((x for x in cands if all(getattr(x, k) == v for k, v in want.items())), None)


def _savings(c: Candidate, cands: list[Candidate]) -> tuple[list[str], list[str], list[str]]:
    """Each memory-saving choice of ``c`` against the same configuration without it: the
    alternatives that would not fit (it needs the saving), those that would, and the plain
    alternatives the search did not contain (not compared)."""
    needed, optional, unsearched = [], [], []
    for chosen, name, change in _plain_changes(c):
        other = _variant(cands, c, **change) if chosen else None
        if other is not None:
            floor = "at least " if other.peak_is_floor else ""
            note = f"{name} ({floor}{human_bytes(other.estimated_peak)})"
            (optional if other.fits else needed).append(note)
        elif chosen:
            unsearched.append(name)
    return needed, optional, unsearched


def _plain_changes(c: Candidate) -> list[tuple[bool, str, dict]]:
    """Each memory-saving choice ``c`` may have made: (whether it made it, the plain
    alternative's name, the change to ``c`` that gives the alternative)."""
    return [
        (c.grad_accum > 1, "one micro-batch of the whole batch",
         {"micro_batch": c.micro_batch * c.grad_accum, "grad_accum": 1}),
        (c.activations != "none", "no checkpointing or offload",
         activation_fields("none")),
        (c.optimizer != "adamw", "AdamW", {"optimizer": "adamw"}),
        (c.weight_dtype != "fp32", "fp32 weights",
         {"weight_dtype": "fp32", "bf16_update": "nearest"}),
        (c.precision not in ("fp32", "tf32"), "fp32", {"precision": "fp32"}),
    ]  # fmt: skip


def _savings_text(c: Candidate, cands: list[Candidate], others: str) -> str:
    """``_savings`` as sentences; ``others`` says why the fitting alternatives lost."""
    needed, optional, unsearched = _savings(c, cands)
    text = ""
    if needed:
        text += "It needs its memory savings: with " + ", or ".join(needed) + " it would not fit. "
    if optional:
        text += f"These would fit too {others}: " + ", ".join(optional) + ". "
    if unsearched:  # e.g. only 16-bit precisions searched: no fp32 variant to compare with
        text += "Not in the search, so not compared: " + ", ".join(unsearched) + ". "
    elif not needed and not optional:
        text += "The plain setup fits, so no memory-saving technique is needed. "
    return text


def explain(best, runner, cands, budget, measured, timing=None) -> str:
    """One paragraph: why the winner won, from the numbers of the search."""
    if best is None:
        smallest = min(cands, key=lambda c: c.estimated_peak)
        if not any(c.fits for c in cands):
            return (
                f"No configuration is estimated to fit {human_bytes(budget)}: the smallest peak is "
                f"{human_bytes(smallest.estimated_peak)} ({smallest.label}). Raise the budget, "
                "shorten the sequence, or use a smaller model."
            )
        errors = "; ".join(f"{m.candidate.label}: {m.error}" for m in measured)
        return f"Every measured candidate failed: {errors}"
    c = best.candidate
    fit = [x for x in cands if x.fits]
    text = (
        f"{c.label} is the fastest of the {len(measured)} configurations timed here "
        f"({best.samples_per_s:.3g} samples/s), out of {len(fit)} of {len(cands)} estimated "
        f"to fit {human_bytes(budget)}. Its estimated peak is {human_bytes(c.estimated_peak)} "
        f"({100 * c.estimated_peak / budget:.0f}% of the budget"
    )
    if best.measured_peak:
        text += f", measured {human_bytes(best.measured_peak)}"
    text += "). "
    text += _savings_text(c, cands, "but were slower or not timed")
    if runner is not None:
        gap = 100 * (best.samples_per_s / runner.samples_per_s - 1)
        text += (
            f"The runner-up, {runner.candidate.label}, reaches "
            f"{runner.samples_per_s:.3g} samples/s ({gap:.0f}% slower"
        )
        if timing is not None:
            claim = Claim(best.candidate.label, "faster", runner.candidate.label)
            if timing.verdict(claim) != "holds":
                text += "; the rounds overlap, so the two are not separated: more rounds would tell"
        text += ")."
    return text


@dataclass(frozen=True)
class SearchOutcome:
    """What the planner did with one candidate of its search, and why (``search_outcomes``)."""

    candidate: Candidate
    outcome: str  # one of OUTCOMES
    why: str  # one line, with the number that decided it
    samples_per_s: float | None = None  # timed candidates only
    measured_peak: int | None = None  # measured candidates only


# The outcomes, in the order the search reaches them (the last one is the answer).
OUTCOMES = (
    "does not fit",  # estimated peak above the usable budget: pruned without running
    "fits, not timed",  # the cost model ranked others first
    "failed",  # ran, but out of memory under the budget (or another error)
    "timed",  # ran and was timed: slower than the winner
    "winner",
)


def search_outcomes(result: Plan, cands: list[Candidate]) -> list[SearchOutcome]:
    """Every candidate of ``result``'s search with what happened to it, in ``cands``'s order.

    ``cands`` is the search itself, ``candidates(...)`` called with the arguments ``plan`` got
    (the plan keeps only the fitting ones); ValueError when it is not the same search.
    Reports only: nothing is estimated, ranked or chosen anew.
    """
    fitting = [c for c in cands if c.fits]
    if len(cands) != result.considered or fitting != result.fitting:
        raise ValueError("cands is not the search this plan made: call candidates() as plan did")
    limit = usable_budget(result.budget, torch.device(result.device))
    rank = {c: i + 1 for i, c in enumerate(fitting)}
    measured = {m.candidate: m for m in result.measured}
    timed_kinds = {_kind(c): c for c in measured}
    out = []
    for c in cands:
        m = measured.get(c)
        if not c.fits:
            peak, usable = human_bytes(c.estimated_peak), human_bytes(limit)
            why = f"estimated peak {peak} > usable budget {usable}"
            out.append(SearchOutcome(c, "does not fit", why))
        elif m is None:
            twin = timed_kinds.get(_kind(c))
            why = f"cost rank {rank[c]} of {len(fitting)}"
            if twin is not None:
                why += f"; {twin.label.split(',')[0]} of the same kind was timed instead"
            else:
                why += f"; the {len(measured)} timing slots went to cheaper kinds"
            out.append(SearchOutcome(c, "fits, not timed", why))
        elif not m.ok:
            out.append(SearchOutcome(c, "failed", str(m.error).splitlines()[0], None, None))
        else:
            best = result.best is not None and m is result.best
            why = f"{m.samples_per_s:.3g} samples/s, cost rank {rank[c]} of {len(fitting)}"
            if m.measured_peak is not None:
                why += f", measured peak {human_bytes(m.measured_peak)}"
            if best:
                why += ": the fastest timed"
            outcome = "winner" if best else "timed"
            out.append(SearchOutcome(c, outcome, why, m.samples_per_s, m.measured_peak))
    return out


def _kind(c: Candidate) -> tuple:
    """What ``shortlist`` keeps varied: precision, optimizer, attention, what the step keeps
    for backward (checkpointing, offload) and the weights' dtype."""
    return (c.precision, c.optimizer, c.attn, c.activations, c.weight_dtype)


# -------------------------------------------------------------------------------------------
# On paper: a card that is not here (lesson 14's "your model").

METHODS = ("full", "lora", "qlora")  # full fine-tuning; LoRA adapters; LoRA on 4-bit weights


@dataclass(frozen=True)
class CardPlan:
    """The planner's answer for a card that is not on this machine: estimates only."""

    model: str
    card: str
    method: str
    budget: int  # the card's memory
    usable: int  # what an estimated peak may use (``usable_budget``)
    effective_batch: int
    seq_len: int
    considered: int  # candidates estimated
    fitting: list[Candidate]  # cheapest predicted first
    best: Candidate | None
    reason: str
    smallest_peak: int = 0  # the lowest estimated peak (or model state) of every candidate
    searched: int = 0  # the search space's size: estimated cheapest first, to the first fit
    smallest_is_floor: bool = False  # smallest_peak is a model state alone (nothing traced)


def card_precisions(card) -> list[str]:
    """The precisions a card trains in: bf16 and tf32 need compute capability 8.0 (Ampere)."""
    ampere = tuple(card.capability) >= (8, 0)
    return [p for p in PRECISIONS if ampere or p not in ("bf16", "tf32")]


def plan_for_card(
    model,
    card,
    effective_batch: int,
    seq_len: int,
    method: str = "full",
    lora_r: int = 16,
    lora_targets: str = "all-linear",
    report: Callable[[int, int], None] | None = None,
    **space,
) -> CardPlan:
    """The configuration predicted fastest among those estimated to fit ``card``, and why.

    ``card``: a ``helpers.device.GpuInfo`` or a name of ``helpers.hardware.REFERENCE_CARDS``
    ("t4", "l4", ...). Nothing runs: the estimator's CUDA branch prices every candidate and
    ``predicted_cost`` ranks them (``plan`` measures and times instead, on a device that is
    here). ``method``: one of ``METHODS``; ``space`` narrows the search as in ``candidates``,
    and ``report`` follows it as there.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
    if isinstance(card, str):
        if card not in REFERENCE_CARDS:
            raise ValueError(f"unknown card {card!r}: use one of {', '.join(REFERENCE_CARDS)}")
        card = REFERENCE_CARDS[card]
    lora = {"lora_r": lora_r, "lora_targets": lora_targets} if method != "full" else {}
    space.setdefault("precisions", card_precisions(card))
    searched: list[int] = []  # the size of the space, as the search reports it
    cands = candidates(model, card.total_memory, effective_batch, seq_len, "cuda",
                       qlora=method == "qlora", report=_counting(report, searched), **lora,
                       first_fit=True, **space)  # fmt: skip
    fitting = [c for c in cands if c.fits]
    best = fitting[0] if fitting else None
    usable = usable_budget(card.total_memory, torch.device("cuda"))
    name = model if isinstance(model, str) else getattr(model, "model_type", "model")
    reason = explain_for_card(best, cands, card, usable, method, searched[-1])
    smallest = min(cands, key=lambda c: c.estimated_peak)
    return CardPlan(str(name), card.name, method, card.total_memory, usable, effective_batch,
                    seq_len, len(cands), fitting, best, reason, smallest.estimated_peak,
                    searched[-1], smallest.peak_is_floor)  # fmt: skip


def _counting(report, total: list[int]):
    """``report`` (or a progress bar, as ``candidates`` draws without one) that also keeps
    the search's size in ``total``."""
    bar: list = []

    def counted(done: int, size: int) -> None:
        total.append(size)
        if report is not None:
            report(done, size)
            return
        if not bar:
            bar.append(progress(None, "estimating setups", size, unit="setup"))
        _advance(bar[0], None, done, size)
        if done == size:
            bar[0].close()

    return counted


def explain_for_card(best, cands, card, usable: int, method: str, searched: int = 0) -> str:
    """One paragraph: what fits ``card`` and what each memory saving of the answer buys
    (``searched``: the size of the search space, default the candidates estimated)."""
    searched = searched or len(cands)
    what = {"full": "full fine-tuning", "lora": "LoRA", "qlora": "QLoRA"}[method]
    if best is None:
        smallest = min(cands, key=lambda c: c.estimated_peak)
        est = smallest.estimate
        usable_text = (f"{what} does not fit the {card.name}: {human_bytes(usable)} of its "
                       f"{human_bytes(card.total_memory)} are usable (after the CUDA context "
                       "and a 10 % margin), and ")  # fmt: skip
        shrink = ("Fewer trainable weights (LoRA), 4-bit frozen weights (QLoRA) or a shorter "
                  "sequence would shrink it.")  # fmt: skip
        if smallest.peak_is_floor:  # no setup's model state fits: nothing was traced
            return usable_text + (
                f"no setup's model state fits: the smallest, {smallest.label}, holds "
                f"{human_bytes(smallest.estimated_peak)} of weights, gradients and optimizer "
                f"state before any activation. {shrink}"
            )
        state = est.params + est.gradients + est.optimizer_state
        return usable_text + (
            f"the smallest estimated peak is {human_bytes(smallest.estimated_peak)} "
            f"({smallest.label}), of which weights, gradients and optimizer state are "
            f"{human_bytes(state)}. {shrink}"
        )
    cheaper = sum(c.cost < best.cost for c in cands)  # estimated first; none of them fits
    text = (
        f"{what} on the {card.name}: {best.label} is predicted the fastest of the {searched} "
        f"configurations searched that fit {human_bytes(usable)} usable ("
        + (f"the {cheaper} predicted faster were estimated and do not fit" if cheaper else
           "none is predicted faster")
        + f"); its estimated peak is {human_bytes(best.estimated_peak)} "
        f"({100 * best.estimated_peak / usable:.0f}% of that). "
    )  # fmt: skip
    return text + _savings_text(best, cands, "but were predicted slower")
