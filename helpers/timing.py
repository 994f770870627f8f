"""Timing done right: warm up, synchronise the device, take the median; throughput and MFU."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from helpers import device as dev
from helpers import hardware
from helpers.forkserver import context
from helpers.progress import progress


def synchronize(device: torch.device) -> None:
    """Wait until the device has finished the queued work (a no-op on the CPU)."""
    dev.synchronize(device)


@dataclass
class Timing:
    """Seconds per call: the median of ``times`` (warm-up calls excluded)."""

    median: float
    times: list[float] = field(default_factory=list)

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the repeats were."""
        return (max(self.times) - min(self.times)) / self.median if self.median else 0.0


def time_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of ``fn()`` between two synchronisations of ``device``."""
    synchronize(device)  # nothing queued earlier is counted
    start = time.perf_counter()
    fn()
    synchronize(device)  # the work, not its launch
    return time.perf_counter() - start


def time_fn(
    fn: Callable[[], object], device: torch.device, warmup: int = 1, repeats: int = 5
) -> Timing:
    """Median wall time of ``fn()`` after ``warmup`` calls, synchronising before and after each."""
    for _ in range(warmup):
        fn()
    times = [time_once(fn, device) for _ in range(repeats)]
    return Timing(statistics.median(times), times)


def train_flops(step: Callable[[], object]) -> int:
    """FLOPs of one call of ``step`` as torch's FlopCounterMode counts them (matmuls, attention)."""
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return int(counter.get_total_flops())


# Dense peak throughput per GPU, TFLOP/s, from NVIDIA's data sheets (no sparsity), keyed by the
# exact name torch reports. bf16/fp16: tensor cores with fp32 accumulation; "tf32": the
# tensor-float-32 rate; "fp32": the plain FMA rate. "sms": the streaming multiprocessors of the
# whole GPU, to scale the peak of a MIG slice, which has a share of them.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0, "sms": 132},
    "NVIDIA H100 80GB HBM3": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.5, "fp32": 67.0,
                              "sms": 132},
    "NVIDIA H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0, "sms": 114},
    "NVIDIA H100 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0, "sms": 132},
    "NVIDIA A100-SXM4-40GB": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5,
                              "sms": 108},
    "NVIDIA A100-SXM4-80GB": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5,
                              "sms": 108},
    "NVIDIA A100-PCIE-40GB": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5,
                              "sms": 108},
    "NVIDIA A100 80GB PCIe": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5,
                              "sms": 108},
    "NVIDIA A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2, "sms": 72},
    "NVIDIA L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3, "sms": 58},
    "NVIDIA L40": {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5, "sms": 142},
    "NVIDIA L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6, "sms": 142},
    "Tesla V100-SXM2-16GB": {"fp16": 125.0, "fp32": 15.7, "sms": 80},
    "Tesla V100-SXM2-32GB": {"fp16": 125.0, "fp32": 15.7, "sms": 80},
    "Tesla V100-PCIE-16GB": {"fp16": 112.0, "fp32": 14.0, "sms": 80},
    "Tesla V100-PCIE-32GB": {"fp16": 112.0, "fp32": 14.0, "sms": 80},
    "Tesla T4": {"fp16": 65.0, "fp32": 8.1, "sms": 40},
}  # fmt: skip


def peak_tflops(device_name: str, precision: str, multiprocessors: int | None = None):
    """Data-sheet peak TFLOP/s for this GPU and precision; None when either is not listed.

    The name must match exactly ("NVIDIA L40" is not "NVIDIA L4"). A MIG slice
    ("... MIG 1g.10gb") gets its GPU's peak scaled by its share of the SMs, which needs
    ``multiprocessors``; without it a slice gets None rather than the whole GPU's peak.
    """
    base, mig, _ = device_name.partition(" MIG ")
    table = PEAK_TFLOPS.get(base.strip())
    if table is None or precision not in table:
        return None
    if not mig:
        return table[precision]
    if not multiprocessors:
        return None
    return table[precision] * multiprocessors / table["sms"]


def mfu(
    flops_per_step: int,
    seconds_per_step: float,
    device_name: str,
    precision: str,
    multiprocessors: int | None = None,
):
    """FLOPs utilisation: achieved FLOP/s over the data-sheet peak; None if the peak is unknown.

    Model FLOPs utilisation (MFU) when ``flops_per_step`` counts the model's own work; with
    activation checkpointing a counter also sees the recomputed forward, and the same ratio
    is hardware FLOPs utilisation (HFU): the caller names which it is.
    """
    peak = peak_tflops(device_name, precision, multiprocessors)
    if peak is None or seconds_per_step <= 0:
        return None
    return flops_per_step / seconds_per_step / (peak * 1e12)


def flops_utilisation(
    counted_flops: int | None,
    seconds_per_step: float,
    device_name: str,
    precision: str,
    multiprocessors: int | None = None,
    recomputes: bool = False,
) -> tuple[float | None, float | None]:
    """(MFU, HFU) of a step whose FLOPs a counter saw; None where the peak is not known.

    The counter sees every FLOP the hardware did. Without recomputation that is the model's
    work, and the ratio is both MFU and HFU; with activation checkpointing it includes the
    recomputed forward, so it is HFU only and MFU is left out rather than overstated.
    """
    if not counted_flops:
        return None, None
    util = mfu(counted_flops, seconds_per_step, device_name, precision, multiprocessors)
    return (None if recomputes else util), util


# The three groups of operations in a transformer ("Model training anatomy", Transformers docs,
# after Ivanov et al. 2020, "Data Movement Is All You Need"): contractions, statistical
# normalisations, element-wise.
_CONTRACTIONS = re.compile(
    r"^(mm|bmm|addmm|addbmm|baddbmm|matmul|linear|einsum|conv\w*|\w*scaled_dot_product\w*"
    r"|\w*flash\w*|\w*efficient_attention\w*)$"
)
_NORMALISATIONS = re.compile(r"\w*(layer_norm|rms_norm|batch_norm|group_norm|softmax|nll_loss)\w*")
OP_CLASSES = ("contractions", "normalisations", "element-wise")


def op_class(name: str) -> str:
    """Which of the three groups an aten operator belongs to (``aten::addmm`` -> contractions)."""
    base = name.removeprefix("aten::").strip("_")
    if _CONTRACTIONS.fullmatch(base):
        return "contractions"
    if _NORMALISATIONS.fullmatch(base):
        return "normalisations"
    return "element-wise"


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (C++ code writes there directly), restoring it afterwards.

    The profiler's tracing library prints start/stop lines there; in a notebook they would
    appear under every profiled cell and read like errors.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def op_self_times(fn: Callable[[], object], device: torch.device) -> dict[str, float]:
    """Seconds of self-time per aten operator for one call of ``fn``, from torch.profiler.

    Self-time (time in the operator minus its children) so nested calls are not counted
    twice; on an accelerator the device time of the kernels is used.
    """
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with _quiet_stderr(), profile(activities=activities) as prof:
        fn()
        synchronize(device)
    out = {}
    for evt in prof.key_averages():
        if evt.key.startswith("aten::"):
            us = evt.self_device_time_total if device.type == "cuda" else evt.self_cpu_time_total
            out[evt.key] = us / 1e6
    return out


def by_op_class(op_seconds: dict[str, float]) -> dict[str, float]:
    """Sum per-operator numbers into the three classes."""
    out = dict.fromkeys(OP_CLASSES, 0.0)
    for name, value in op_seconds.items():
        out[op_class(name)] += value
    return out


# --------------------------------------------------------------------------------------------
# Comparing contenders on a machine that is doing other things
#
# A laptop's or a shared server's speed drifts: a browser tab, a compile, another user. Two
# contenders timed one after the other see different machines, so their ratio mixes the
# contenders with the drift. Timed in interleaved rounds (A B C, B C A, C A B, ...), each
# round sees one machine state, and the per-round ratios cancel most of the drift. Their
# median is the estimate; how far the rounds scatter says whether the claim is decided.

# A claim decided the wrong way is measured again in fresh rounds before anything fails: only
# a wrong-way result that holds twice is a failure. A claim the rounds cannot decide is
# reported, with its interval and the likely reason, and never fails.
CLAIMS_ENV = "COURSE_CLAIMS"  # JSON-lines file every checked claim is appended to
# "report": not even a confirmed wrong-way claim fails; each is logged and printed. make
# gpu-check sets it: notebooks run side by side there, so their timings disturb each other.
SPEED_CLAIMS_ENV = "COURSE_SPEED_CLAIMS"
# A round in which other processes used more than this share of a core (helpers.hardware.
# OtherLoad, Linux) is set aside: its contenders did not have the machine the claims assume.
OTHERS_LIMIT = 0.25
# $COURSE_OTHERS_LIMIT overrides it for every timed loop, children included: a share of a core,
# or "off" (keep every round). The helpers' own tests set "off" (tests/conftest.py): they check
# how rounds are counted, not how busy the machine is.
OTHERS_LIMIT_ENV = "COURSE_OTHERS_LIMIT"
_FROM_ENV = -1.0  # a limit's default: default_others_limit()
# One measurement's verdict as its line prints it. "fails" is kept for the decision at the end
# of the line: a single measurement the wrong way is not yet a failure (see check_claims).
RAW_VERDICT = {"holds": "holds", "fails": "the other way", "undecided": "undecided"}


def default_others_limit() -> float | None:
    """The share of a core other processes may use in a round before it is set aside."""
    value = os.environ.get(OTHERS_LIMIT_ENV, "").strip().lower()
    if not value:
        return OTHERS_LIMIT
    return None if value == "off" else float(value)


@dataclass(frozen=True)
class Claim:
    """A speed claim: how the time of ``name`` compares with the time of ``versus``.

    ``kind`` "faster": time(name) / time(versus) < ``factor``; "slower": > ``factor``;
    "similar": between 1 / ``factor`` and ``factor``. ``why`` is the one-line reason.
    """

    name: str
    kind: str
    versus: str
    factor: float = 1.0
    why: str = ""

    def __str__(self) -> str:
        if self.kind == "similar":
            return f"{self.name} within {self.factor:.3g}x of {self.versus}"
        rel = "<" if self.kind == "faster" else ">"
        return f"time {self.name} / {self.versus} {rel} {self.factor:.3g}"


def median_interval(values: list[float], confidence: float = 0.9) -> tuple[float, float] | None:
    """A distribution-free interval for the median: [k-th smallest, k-th largest] value.

    The median of n independent rounds lies below the k-th smallest value only if at most
    k - 1 rounds fell below it, a Binomial(n, 1/2) event; k is the largest with both tails
    together under 1 - ``confidence``. None when there are too few rounds (5 give 93.75 %).
    """
    n, ranked = len(values), sorted(values)
    best = None
    for k in range(1, n // 2 + 1):
        tail = sum(math.comb(n, i) for i in range(k)) / 2**n  # P(Bin(n, 1/2) <= k - 1)
        if 1 - 2 * tail < confidence:
            break
        best = (ranked[k - 1], ranked[n - k])
    return best


@dataclass
class Comparison:
    """Contenders timed in interleaved rounds: seconds per call, one number per round each."""

    times: dict[str, list[float]]
    confidence: float = 0.9
    errors: dict[str, str] = field(default_factory=dict)  # contenders that could not run
    left_out: dict[str, int] = field(default_factory=dict)  # rounds left out, by reason
    others: list[float] = field(default_factory=list)  # cores others used, every round run
    # Which rounds of ``times`` count (None: all): a round other processes disturbed is kept in
    # ``times`` (tables and plots show it) but never decides a claim; medians and rates come
    # from the counted rounds, or from all where fewer than 3 count (``reported``).
    kept: list[bool] | None = None
    # The first measurement, when a claim it decided the wrong way made this one measure again.
    first: Comparison | None = None
    # How to measure again, in a fresh process, for a producer that cannot do it itself (its
    # Comparison is built from a result after the measurement): check_claims calls it when a
    # claim is decided the wrong way. Not pickled (a closure of the process that set it).
    again: Callable[[], Comparison] | None = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "again": None}

    @classmethod
    def of(cls, kept: dict[str, list[float]], aside: dict[str, list[float]], **fields):
        """A Comparison of rounds kept and rounds set aside, given apart."""
        names = list(dict.fromkeys([*kept, *aside]))  # every round may have been set aside
        n_kept = min((len(kept.get(n, [])) for n in names), default=0)
        n_aside = min((len(aside.get(n, [])) for n in names), default=0)
        times = {n: kept.get(n, [])[:n_kept] + aside.get(n, [])[:n_aside] for n in names}
        return cls(times, kept=[True] * n_kept + [False] * n_aside, **fields)

    def _counted(self, values: list[float]) -> list[float]:
        if self.kept is None:
            return list(values)
        return [v for v, k in zip(values, self.kept, strict=False) if k]

    @property
    def rounds(self) -> int:
        """Rounds that count (every contender once per round; rounds set aside excluded)."""
        return min((len(self._counted(t)) for t in self.times.values()), default=0)

    def ratios(self, name: str, versus: str) -> list[float]:
        """time(name) / time(versus), round by round, over ``reported``'s rounds: the counted
        ones, or all of them where fewer than 3 count (for tables and plots)."""
        counted = self._counted_ratios(name, versus)
        if len(counted) >= 3:
            return counted
        return [a / b for a, b in zip(self.times[name], self.times[versus], strict=False)]

    def _counted_ratios(self, name: str, versus: str) -> list[float]:
        """The per-round ratios of the counted rounds only: what decides a claim."""
        pairs = zip(self._counted(self.times[name]), self._counted(self.times[versus]),
                    strict=False)  # fmt: skip
        return [a / b for a, b in pairs]

    def ratio(self, name: str, versus: str) -> float:
        """Median of the per-round time ratios (``ratios``)."""
        return statistics.median(self.ratios(name, versus))

    def interval(self, name: str, versus: str) -> tuple[float, float] | None:
        """Where the median ratio lies at ``confidence`` (see ``median_interval``), from the
        counted rounds only; None where they are too few (fewer than 5 at 90 %)."""
        return median_interval(self._counted_ratios(name, versus), self.confidence)

    def reported(self, name: str) -> list[float]:
        """The rounds a number is reported from: those that count, or every round where fewer
        than 3 count (a busy machine; its claims stay undecided then)."""
        counted = self._counted(self.times[name])
        return counted if len(counted) >= 3 else list(self.times[name])

    def median(self, name: str) -> float:
        """Median seconds per call of ``name`` over the rounds (``reported``)."""
        return statistics.median(self.reported(name))

    def rate(self, name: str, units: float) -> tuple[float, float, float]:
        """``units`` per second of ``name``: median, and the lowest and highest round."""
        rates = [units / t for t in self.reported(name)]
        return statistics.median(rates), min(rates), max(rates)

    def rates(self, units: float | dict[str, float] = 1.0) -> dict[str, tuple[float, float, float]]:
        """``rate`` of every contender: {name: (median, slowest round, fastest round)}."""
        per = units if isinstance(units, dict) else dict.fromkeys(self.times, units)
        return {name: self.rate(name, per[name]) for name in self.times if self.times[name]}

    def verdict(self, claim: Claim) -> str:
        """holds, fails (decided the wrong way) or undecided (the rounds scatter too much)."""
        if claim.name in self.errors or claim.versus in self.errors:
            return "undecided"
        bounds = self.interval(claim.name, claim.versus)
        if bounds is None:
            return "undecided"
        lo, hi = bounds
        f = claim.factor
        if claim.kind == "faster":
            return "holds" if hi < f else "fails" if lo >= f else "undecided"
        if claim.kind == "slower":
            return "holds" if lo > f else "fails" if hi <= f else "undecided"
        if claim.kind == "similar":
            if 1 / f < lo and hi < f:
                return "holds"
            return "fails" if hi <= 1 / f or lo >= f else "undecided"
        raise ValueError(f"unknown claim kind {claim.kind!r}: faster, slower or similar")

    def decided(self, claims) -> bool:
        """Every claim holds or fails: more rounds would not change a verdict's side."""
        return all(self.verdict(c) != "undecided" for c in claims)

    def decision(self, claim: Claim) -> str:
        """The claim over this measurement and the first one, if a re-measurement: "holds",
        "undecided", "fails" (the wrong way in both: confirmed) or "unconfirmed" (the wrong way
        in one measurement only, or in one never measured again)."""
        now = self.verdict(claim)
        if self.first is None:
            return "unconfirmed" if now == "fails" else now
        before = self.first.verdict(claim)
        if now == "fails":
            return "fails" if before == "fails" else "unconfirmed"
        if before == "fails":
            return "unconfirmed"
        return "holds" if "holds" in (before, now) else "undecided"

    def set_aside(self) -> int:
        """Rounds left out, every reason and both measurements together."""
        first = self.first.set_aside() if self.first is not None else 0
        return sum(self.left_out.values()) + first

    def busy(self) -> tuple[float, float] | None:
        """Cores other processes used per round, median and most, both measurements; None
        where it could not be read (not Linux)."""
        cores = self.others + (self.first.others if self.first is not None else [])
        return (statistics.median(cores), max(cores)) if cores else None

    def describe(self, claim: Claim) -> str:
        """One line: the claim, the median ratio and its interval, the decision and, when it
        is not "holds", what the first measurement said and the likely reason."""
        decision = self.decision(claim)
        text = f"{claim}{f' ({claim.why})' if claim.why else ''}: {self._measured(claim)}"
        if self.first is not None:
            text += f"; first measurement {self.first._measured(claim)}"
        text += f": {decision}"
        if decision in ("undecided", "unconfirmed"):
            text += f" ({self.likely_reason(claim)})"
        return text

    def _measured(self, claim: Claim) -> str:
        """The median ratio, its interval, the rounds and those set aside, the raw verdict."""
        if claim.name in self.errors or claim.versus in self.errors:
            bad = claim.name if claim.name in self.errors else claim.versus
            return f"{bad} did not run ({self.errors[bad]})"
        bounds = self.interval(claim.name, claim.versus)
        where = "too few rounds" if bounds is None else f"{bounds[0]:.3g}-{bounds[1]:.3g}"
        skipped = "".join(f", {n} left out: {reason}" for reason, n in self.left_out.items())
        try:
            ratio = f"{self.ratio(claim.name, claim.versus):.3g}"
        except statistics.StatisticsError:  # no round at all
            ratio = "n/a"
        return (f"median ratio {ratio} ({where} at {self.confidence:.0%}, {self.rounds} rounds"
                f"{skipped}) {RAW_VERDICT[self.verdict(claim)]}")  # fmt: skip

    def likely_reason(self, claim: Claim) -> str:
        """Why a claim came out undecided or unconfirmed, as far as the rounds can tell."""
        if self.first is None and self.verdict(claim) == "fails":
            return "the other way in one measurement that its producer could not repeat"
        why = self._scatter_reason(claim)
        if self.decision(claim) == "unconfirmed":
            return f"the two measurements disagree; {why}"
        return why

    def _scatter_reason(self, claim: Claim) -> str:
        busy, aside = self.busy(), self.set_aside()
        if aside or (busy and busy[1] > OTHERS_LIMIT):
            most = f", others used up to {busy[1]:.2f} cores" if busy else ""
            return f"a busy machine: {aside} rounds set aside{most}"
        if self.rounds < 5:
            return "too few rounds to decide"
        lo, hi = self.interval(claim.name, claim.versus) or (0.0, 0.0)
        if lo <= claim.factor <= hi and hi - lo < 0.2 * claim.factor:
            return "the difference is close to the line: too small to decide at this size"
        return "the rounds scatter widely: a noisy machine or a small effect at this size"


def interleave(
    run: Callable[[str], float],
    names: list[str],
    rounds: int = 5,
    max_rounds: int = 15,
    claims=(),
    confidence: float = 0.9,
    reject: Callable[[], str | None] | None = None,
    others_limit: float | None = _FROM_ENV,
    confirm: bool = True,
) -> Comparison:
    """Rounds of ``run(name)`` (seconds of one timed unit) over ``names``, in rotating order.

    After ``rounds`` rounds, more are added while a claim is undecided, up to ``max_rounds``:
    a noisy machine takes longer to decide instead of deciding wrongly. A round is left out
    when other processes used more than ``others_limit`` cores while it ran (default:
    ``default_others_limit()``; None: keep every round), or when ``reject``, asked after each
    round, names a reason (a condition the claims assume did not hold while it ran). Left-out
    rounds count towards ``max_rounds`` and are reported in ``Comparison.left_out``. With
    ``confirm``, a claim decided the wrong way is measured again in fresh rounds
    (``confirmed``); the second measurement comes back, the first as its ``first``.
    """

    def measure() -> Comparison:
        return _rounds(run, names, rounds, max_rounds, claims, confidence, reject, others_limit)

    return confirmed(measure, claims) if confirm else measure()


def confirmed(measure: Callable[[], Comparison], claims) -> Comparison:
    """``measure()``, and ``measure()`` again if the first decided one of ``claims`` the wrong
    way: then the second comes back with the first as its ``first``, and a claim fails only
    if both decide it so (``Comparison.decision``). Pass a ``measure`` that starts afresh
    (new rounds, new processes where the first used fresh ones)."""
    return _again_if_wrong(measure(), measure, claims)


def _again_if_wrong(first: Comparison, measure: Callable[[], Comparison], claims) -> Comparison:
    """``first``, or ``measure()`` with ``first`` as its first when a claim went the wrong way."""
    if not any(first.verdict(c) == "fails" for c in claims):
        return first
    second = measure()
    second.first = first
    return second


def _rounds(run, names, rounds, max_rounds, claims, confidence, reject, others_limit):
    """One measurement of ``interleave``: its rounds, disturbed ones left out."""
    times: dict[str, list[float]] = {n: [] for n in names}
    out = Comparison(times, confidence, kept=[])
    watch = Disturbance(others_limit, out)
    for i in progress(range(max_rounds), "timing rounds (stops when decided)", unit="round"):
        if out.rounds >= rounds and out.decided(claims):
            break
        if watch.too_busy(i, out.rounds, rounds) or (
            claims and out.rounds + max_rounds - i < min(rounds, 5)
        ):
            break  # so many rounds set aside that no claim can be decided: a busy machine
        with watch.round():
            row = {name: run(name) for name in names[i % len(names) :] + names[: i % len(names)]}
        out.kept.append(not watch.set_aside(reject() if reject else None))
        for name, seconds in row.items():
            times[name].append(seconds)
    return out


class Disturbance:
    """Other processes' CPU use, round by round, into a Comparison's ``others``; a round in
    which they used more than ``limit`` cores (None: never) is to be set aside.

    For any loop of timed rounds: ``with watch.round(): ...`` around the round, then
    ``if watch.set_aside(): continue`` (it counts the reason in ``left_out``).
    """

    def __init__(self, limit: float | None = _FROM_ENV, into: Comparison | None = None):
        self.limit = default_others_limit() if limit == _FROM_ENV else limit
        self.into = into if into is not None else Comparison({})
        self._busy: str | None = None

    @contextlib.contextmanager
    def round(self):
        """Watch one round (helpers.hardware.OtherLoad: Linux's /proc, else nothing known)."""
        self._busy = None
        with hardware.OtherLoad() as load:
            yield
        if load.cores is not None:
            self.into.others.append(load.cores)
            if self.limit is not None and load.cores > self.limit:
                self._busy = f"other processes used over {self.limit:g} of a core"

    @staticmethod
    def too_busy(attempts: int, kept: int, wanted: int) -> bool:
        """Whether to stop: ``wanted`` rounds tried, and fewer than a third of the rounds so
        far were kept (more would decide nothing; what was measured is still reported)."""
        return attempts >= wanted and kept < attempts / 3

    def set_aside(self, reason: str | None = None) -> bool:
        """Whether the last round is left out (for ``reason``, or for a busy machine): True
        counts it in ``left_out``."""
        why = reason or self._busy
        if why:
            self.into.left_out[why] = self.into.left_out.get(why, 0) + 1
        return bool(why)


def compare_calls(
    calls: dict[str, Callable[[], object]],
    device: torch.device,
    warmup: int = 1,
    per_round: int = 1,
    units: dict[str, float] | None = None,
    **rounds,
) -> Comparison:
    """Interleaved timing of callables in this process (see ``interleave`` for ``rounds``).

    Each contender is warmed up first; a round times ``per_round`` calls of each (their median
    is the round's number), synchronising the device before and after each call. With
    ``units`` (work per call) the times are per unit.
    """
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    synchronize(device)
    per_unit = {name: (units or {}).get(name, 1.0) for name in calls}

    def run(name: str) -> float:
        return time_fn(calls[name], device, warmup=0, repeats=per_round).median / per_unit[name]

    return interleave(run, list(calls), **rounds)


def check_claims(comparison: Comparison, claims, lesson: str = "") -> list[str]:
    """The decision on each claim, one line each; AssertionError on a confirmed wrong one.

    A claim fails only when two measurements both decided it the wrong way (the producer
    measured again: ``confirmed``); one that is undecided, or wrong once and not the second
    time, is reported with its likely reason and never fails. Every decision is appended to
    $COURSE_CLAIMS when that is set (``python -m helpers claims`` sums them up).
    """
    comparison = _measured_again(comparison, claims)
    lines, wrong = [], []
    for claim in claims:
        decision = comparison.decision(claim)
        lines.append(comparison.describe(claim))
        if decision == "fails":
            wrong.append(lines[-1])
        if os.environ.get(CLAIMS_ENV):
            _log_claim(comparison, claim, decision, lesson)
    if wrong and os.environ.get(SPEED_CLAIMS_ENV) != "report":
        raise AssertionError(
            "speed claim decided the other way, twice (measured again to confirm):\n"
            + "\n".join(wrong)
        )
    return lines


def _measured_again(comparison: Comparison, claims) -> Comparison:
    """The comparison re-measured by its ``again`` when it decided a claim the wrong way and
    its producer did not measure again itself; else the comparison as it is."""
    if comparison.first is not None or comparison.again is None:
        return comparison
    return _again_if_wrong(comparison, comparison.again, claims)


def _log_claim(comparison: Comparison, claim: Claim, decision: str, lesson: str) -> None:
    """One JSON line for ``python -m helpers claims``: the decision and how it was reached."""
    ran = claim.name not in comparison.errors and claim.versus not in comparison.errors
    ran = ran and bool(comparison.times.get(claim.name))  # rounds set aside are reported too
    pair = (claim.name, claim.versus)
    busy = comparison.busy()
    row = {"lesson": lesson, "claim": str(claim), "verdict": decision,
           "rounds": comparison.rounds,
           "ratio": comparison.ratio(*pair) if ran else None,
           "interval": comparison.interval(*pair) if ran else None,
           "remeasured": comparison.first is not None,
           "set_aside": comparison.set_aside(),
           "others_median": busy[0] if busy else None,
           "others_max": busy[1] if busy else None,
           "reason": comparison.likely_reason(claim) if decision in ("undecided", "unconfirmed")
           else ""}  # fmt: skip
    with open(os.environ[CLAIMS_ENV], "a") as f:
        f.write(json.dumps(row) + "\n")


def read_claims(path) -> list[dict]:
    """The rows ``check_claims`` logged to ``path`` ($COURSE_CLAIMS)."""
    with open(path) as f:
        return [row for line in f if line.strip() and "verdict" in (row := json.loads(line))]


def claims_summary(rows: list[dict]) -> str:
    """The claims of a run summed up: held, undecided, confirmed wrong, rounds set aside and
    how busy the machine was; then every claim that did not hold, by name, with its reason."""
    counts = Counter(r["verdict"] for r in rows)
    lessons = {r["lesson"] for r in rows}
    aside = sum(r.get("set_aside", 0) for r in rows)
    busiest = [r["others_max"] for r in rows if r.get("others_max") is not None]
    typical = [r["others_median"] for r in rows if r.get("others_median") is not None]
    lines = [
        f"speed claims: {len(rows)} checked in {len(lessons)} lessons: {counts['holds']} held, "
        f"{counts['undecided']} undecided, {counts['unconfirmed']} wrong once but not confirmed, "
        f"{counts['fails']} confirmed wrong",
        f"rounds set aside (other processes busy): {aside}; other processes used "
        + (f"{statistics.median(typical):.2f} cores in a typical round, {max(busiest):.2f} at "
           "most" if busiest else "an unknown share of the CPU (not Linux)"),
    ]  # fmt: skip
    for r in rows:
        if r["verdict"] != "holds":
            ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.3g}"
            why = f"; {r['reason']}" if r.get("reason") else ""
            lines.append(f"  {r['lesson']}: {r['claim']}: {r['verdict']} (median ratio {ratio}, "
                         f"{r['rounds']} rounds{why})")  # fmt: skip
    return "\n".join(lines)


def pause(seconds: float) -> Callable[[], None]:
    """A contender that only waits ``seconds``: a known answer for checking a comparison."""

    def wait() -> None:
        time.sleep(seconds)

    return wait


def _noop() -> None:
    """Nothing: a process that only shows the fork server is ready."""


def _burn(stop, running) -> None:
    """Keep one core busy until ``stop`` is set (a CPU load for demonstrations)."""
    running.release()  # tell start() the load is on
    while not stop.is_set():
        sum(range(10_000))


class CpuBurner:
    """A background CPU load that can be switched on and off: ``processes`` busy loops.

    By default on half the cores: enough to slow anything that uses every core (PyTorch's
    CPU kernels do) by about half, without starving the machine.

    For showing what a busy machine does to timings (lesson 00); ``tools/bursty_load.py`` is
    the irregular load the course's timing lessons are tested under.
    """

    def __init__(self, processes: int | None = None) -> None:
        self.processes = processes or max(1, (os.cpu_count() or 2) // 2)
        self._ctx = context()  # the fork server: no imports to wait for
        self._stop = self._ctx.Event()
        self._running = self._ctx.Semaphore(0)
        self._procs: list = []
        # The fork server imports torch once when it starts: a busy spell of its own. One
        # process started and joined here waits for that, so the machine is quiet afterwards.
        ready = self._ctx.Process(target=_noop, daemon=True)
        ready.start()
        ready.join()

    def start(self) -> None:
        """Switch the load on and return once every busy loop runs (no-op if it is on)."""
        if self._procs:
            return
        self._stop.clear()
        self._procs = [self._ctx.Process(target=_burn, args=(self._stop, self._running),
                                         daemon=True) for _ in range(self.processes)]  # fmt: skip
        for proc in self._procs:
            proc.start()
        # Starting a process takes from milliseconds to seconds (the fork server may still be
        # importing torch): a load that arrives late would miss what it is meant to slow down.
        for _ in self._procs:
            if not self._running.acquire(timeout=60):
                self.stop()
                raise RuntimeError("the CPU load's processes did not start within 60 s")

    def stop(self) -> None:
        """Switch the load off and wait for the busy loops to end."""
        self._stop.set()
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self._procs = []

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
