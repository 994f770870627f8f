"""Lesson 12, sections 2-8 (notebooks/12_torch_compile.ipynb).

torch.compile: captured graphs, graph breaks, recompilation, compile cost against step time.

The functions that compile with inductor (``step_profile``, ``fusion_profile``) are meant to
run in a fresh process (``helpers.isolate.call_isolated``): compiled code, dynamo's caches and
the compile counters live in the process, so a fresh one measures a first compilation with
nothing left over from an earlier cell. ``cache_dir`` points inductor's on-disk cache at a
chosen folder, so that "cold" (empty folder) and "warm" (a folder an earlier process filled)
are decided by the caller and not by what ran on the machine before.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters, guard_failures
from torch._inductor.utils import clear_caches, run_and_get_code

from helpers.device import resolve
from helpers.isolate import call_isolated
from helpers.plots import plain_ticks
from helpers.timing import (
    Comparison,
    compare_calls,
    interleave,
    synchronize,
    time_once,
    train_flops,
)
from helpers.train import train_step  # at call time: importing transformers costs ~1.6 s

# -------------------------------------------------------------------------------------------
# Seeing what dynamo captures


@contextlib.contextmanager
def quiet_dynamo():
    """Silence dynamo's and inductor's warnings (the lesson reads the same facts as data)."""
    names = ("torch._dynamo", "torch._inductor", "torch.fx.experimental.symbolic_shapes")
    loggers = [logging.getLogger(n) for n in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels, strict=True):
            log.setLevel(level)


def short_reason(reason: str) -> str:
    """First line of a graph-break or guard-failure reason, without hints or source comment."""
    return reason.strip().splitlines()[0].split("  #")[0].strip()


def reset_dynamo() -> None:
    """Forget every compiled graph, guard failure and counter (disk caches stay)."""
    torch._dynamo.reset()
    counters.clear()


@dataclass
class DynamoSummaryResult:
    """What dynamo did since the last ``reset_dynamo``, in numbers."""

    graphs: int  # distinct graphs compiled
    graph_breaks: int  # graph breaks met while capturing
    recompile_reasons: list[str] = field(default_factory=list)  # one per failed guard


def dynamo_summary() -> DynamoSummaryResult:
    """Graphs compiled, graph breaks and recompile reasons since the last ``reset_dynamo``."""
    return DynamoSummaryResult(
        graphs=counters["stats"]["unique_graphs"],
        graph_breaks=sum(counters["graph_break"].values()),
        recompile_reasons=[short_reason(r) for rs in guard_failures.values() for r in rs],
    )


# -------------------------------------------------------------------------------------------
# The compiler's one-time costs and what it generated


def prepare_compiler(device: torch.device | str = "cpu") -> float:
    """Pay the compiler's once-per-process costs; returns the seconds they took.

    Imports dynamo and inductor and compiles a one-line function with inductor on ``device``,
    which makes inductor probe the CPU's vector instructions (or start Triton on a GPU).
    That work does not depend on the model, so timing it apart keeps it out of a model's
    compile cost. It uses the cache folder set at the time (normally the default one).
    """
    start = time.perf_counter()
    import torch._inductor.compile_fx  # timed on purpose: inductor's import is this cost

    with quiet_dynamo():
        torch.compile(lambda t: 2 * t + 1)(torch.zeros(8, device=device))
    reset_dynamo()
    return time.perf_counter() - start


@dataclass
class KernelsResult:
    """What inductor generated in one output-code module (a forward or a backward graph)."""

    kernels: list[str]  # generated C++ (CPU) or Triton (GPU) kernels, named after what they fuse
    extern: dict[str, int]  # library kernel (matmuls: addmm, mm, ...) -> calls


def generated_kernels(code: str) -> KernelsResult:
    """Kernels inductor generated in one output-code module, and the library calls it makes."""
    kernels = re.findall(r"^(\w+) = async_compile\.\w+\(", code, flags=re.M)
    extern = Counter(re.findall(r"extern_kernels\.(\w+)\(", code))
    return KernelsResult(kernels, dict(extern))


# -------------------------------------------------------------------------------------------
# Fusion: an element-wise chain, eager against compiled


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU as transformers' ``NewGELUActivation`` writes it: 8 element-wise ops."""
    return (
        0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    )


def gelu_tanh_aten(x: torch.Tensor) -> torch.Tensor:
    """The same function as one hand-written ATen kernel: ``F.gelu(approximate="tanh")``."""
    return torch.nn.functional.gelu(x, approximate="tanh")


@dataclass
class FusionProfileResult:
    """What ``fusion_profile`` measured of gelu_new, size by size."""

    sizes: list[int]  # elements of each input, in the order timed
    compile_s: float  # seconds of the compiled version's first call: the compilation
    # "eager" | "compiled" | "aten" -> median seconds per call at each size
    seconds: dict[str, list[float]] = field(default_factory=dict)
    # per size: {"eager" | "compiled" | "aten": seconds of each round}, the three in turns
    rounds: list[dict[str, list[float]]] = field(default_factory=list)
    max_error: float = 0.0  # largest |compiled - eager| over all sizes
    max_abs: float = 0.0  # largest |eager output| over all sizes
    graphs: int = 0  # graphs dynamo compiled over all sizes
    largest: Comparison | None = None  # the three in turns at the largest size (the claims')


def fusion_profile(
    sizes: Sequence[int],
    device: str | None = None,
    warmup: int = 2,
    repeats: int = 10,
    cache_dir: str | None = None,
    prepare: bool = True,
    claims=(),
    max_repeats: int = 30,
    per_round: int = 3,
) -> FusionProfileResult:
    """Seconds per call of gelu_new: eager, compiled once with dynamic shapes, ATen's kernel.

    At each size the three are timed in turns (``helpers.timing.compare_calls``, ``repeats``
    rounds of ``per_round`` calls each; ``rounds`` keeps each size's per-round seconds);
    at the largest size rounds are added, up to ``max_repeats``, while one of ``claims`` is
    undecided (one call there lasts milliseconds, within reach of a scheduler's hiccup). Also
    the first call's seconds (the compilation), the number of graphs compiled over all sizes,
    and the largest deviation of the compiled output from eager. For a fresh process;
    ``prepare=False`` when ``prepare_compiler`` already ran in it.
    """
    dev = resolve(device)
    if prepare:
        prepare_compiler(dev)
    reset_dynamo()
    if cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    compiled = torch.compile(gelu_new, dynamic=True)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=g).to(dev) for n in sizes]
    fns = {"eager": gelu_new, "compiled": compiled, "aten": gelu_tanh_aten}
    with quiet_dynamo():
        out = FusionProfileResult(list(sizes), _first_call_s(compiled, xs[0], dev))
        out.seconds = {name: [] for name in fns}
        for i, x in enumerate(xs):
            last = i == len(xs) - 1
            turns = compare_calls(
                {name: (lambda f=fn, x=x: f(x)) for name, fn in fns.items()},
                dev,
                warmup=warmup,
                per_round=per_round,
                rounds=repeats,
                max_rounds=max_repeats if last else repeats,
                claims=claims if last else (),
            )
            _add_size(out, turns, compiled, x)
    out.largest = turns  # decided, or re-measured when a claim came out the wrong way
    out.graphs = dynamo_summary().graphs
    return out


def _first_call_s(fn: Callable, x: torch.Tensor, device: torch.device) -> float:
    """Seconds of ``fn(x)`` up to the device's having finished it (a first call compiles)."""
    start = time.perf_counter()
    fn(x)
    synchronize(device)
    return time.perf_counter() - start


def _add_size(out: FusionProfileResult, turns, compiled: Callable, x: torch.Tensor) -> None:
    """Add one size's rounds and medians to ``out``, and the compiled output's deviation."""
    out.rounds.append(turns.times)
    for name in out.seconds:
        out.seconds[name].append(turns.median(name))
    ref = gelu_new(x)
    out.max_error = max(out.max_error, (compiled(x) - ref).abs().max().item())
    out.max_abs = max(out.max_abs, ref.abs().max().item())


# -------------------------------------------------------------------------------------------
# The training case: GPT-2 MLP blocks (linear, gelu_new, linear) with residual connections


class MLPBlock(nn.Module):
    """``x + fc2(gelu_new(fc1(x)))``: GPT-2's MLP (transformers' ``GPT2MLP``) and its residual."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(gelu_new(self.fc1(x)))


class MLPStack(nn.Module):
    """``n_blocks`` MLPBlocks; ``forward`` returns a stand-in loss, the mean square output."""

    def __init__(self, hidden: int, intermediate: int, n_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(hidden, intermediate) for _ in range(n_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()  # the step's cost is all in the blocks


def mlp_stack(hidden: int, intermediate: int, n_blocks: int, seed: int = 0, device="cpu"):
    """An MLPStack initialised from ``seed`` as GPT-2 is: weights normal(0, 0.02), zero biases."""
    torch.manual_seed(seed)
    model = MLPStack(hidden, intermediate, n_blocks)
    for p in model.parameters():
        nn.init.normal_(p, std=0.02) if p.dim() > 1 else nn.init.zeros_(p)
    return model.to(device)


@dataclass
class StepProfileConfig:
    """One ``step_profile`` run: the MLPStack's sizes, the compiled copies and the timing."""

    backends: Sequence[str] = ("inductor",)  # one compiled copy per backend, next to eager
    hidden: int = 128  # the blocks' width (input and output features)
    intermediate: int = 512  # the MLP's inner width
    n_blocks: int = 2  # MLPBlocks stacked
    rows: int = 256  # rows of the input (batch x sequence)
    device: str | None = None  # None: helpers.device.default_device()
    warmup: int = 2  # untimed steps of each copy before the timed ones
    repeats: int = 20  # timed steps of each copy, the copies in rotating order
    cache_dir: str | None = None  # inductor's on-disk cache folder; None: as already set
    mode: str | None = None  # torch.compile's mode for inductor, e.g. "reduce-overhead"
    seed: int = 0  # seeds the weights and the input
    output_code: bool = False  # keep what inductor generated for its first step (``code``)
    warm_rerun: bool = False  # then compile a new inductor copy with only the disk cache left


@dataclass
class CacheCountsResult:
    """Lookups in one of the compiler's caches since the last ``reset_dynamo``."""

    hit: int  # graphs found compiled in the cache
    miss: int  # graphs compiled anew (and then stored)


@dataclass
class CompileCountersResult:
    """Dynamo's graphs and breaks and the on-disk caches' lookups since ``reset_dynamo``."""

    graphs: int  # distinct graphs compiled
    graph_breaks: int  # graph breaks met while capturing
    fxgraph_cache: CacheCountsResult  # inductor's cache of compiled graphs
    autograd_cache: CacheCountsResult  # AOTAutograd's cache of forward-backward pairs


@dataclass
class StepProfileResult:
    """What ``step_profile`` measured; copies are "eager", each backend, "inductor, warm"."""

    prepare_s: float  # prepare_compiler's once-per-process seconds, kept out of the rest
    rows: int  # rows of the input of every step
    first_s: dict[str, float]  # copy -> seconds of its first step (compilation included)
    rounds: Comparison  # the copies' steady-state steps, timed in rotating rounds
    counters: CompileCountersResult  # after the first phase (every backend's copy)
    loss: dict[str, float]  # copy -> loss of its first step
    grad_error: dict[str, list[float]]  # compiled copy -> max |grad - eager's| per tensor
    grad_max: list[float]  # max |eager's grad| per tensor
    flops: int  # FLOPs of one training step (FlopCounterMode, on the eager copy)
    code: list[KernelsResult] = field(default_factory=list)  # inductor's forward, backward
    # with warm_rerun: "eager" and "inductor, warm" timed in rotating rounds
    warm_rounds: Comparison | None = None
    warm: CompileCountersResult | None = None  # with warm_rerun: the warm copy's counters
    config: StepProfileConfig | None = None  # what ran: how to measure again

    @property
    def times(self) -> dict[str, list[float]]:
        """Copy -> seconds of each timed steady-state step (undisturbed rounds)."""
        return self.rounds.times

    @property
    def warm_times(self) -> dict[str, list[float]]:
        """With warm_rerun: "eager" and "inductor, warm" -> seconds of each timed step."""
        return self.warm_rounds.times if self.warm_rounds is not None else {}

    def steady(self) -> Comparison:
        """Eager against inductor in the steady state, both phases' rounds pooled (the warm
        rerun's "inductor, warm" as inductor); measured again in a fresh process when a claim
        is decided the wrong way (``again``)."""
        phases = [(self.rounds, "inductor")]
        if self.warm_rounds is not None:
            phases.append((self.warm_rounds, "inductor, warm"))
        names = {"eager": [(r, "eager") for r, _ in phases], "inductor": phases}
        return self._pooled(names, lambda result: result.steady())

    def same_ops(self) -> Comparison:
        """Eager against aot_eager (the very same ATen operations) in the first phase."""
        names = {k: [(self.rounds, k)] for k in ("eager", "aot_eager")}
        return self._pooled(names, lambda result: result.same_ops())

    def _pooled(self, names: dict[str, list[tuple[Comparison, str]]], pick) -> Comparison:
        """One Comparison of ``names``, each the rounds of (phase, copy) pairs end to end."""

        def again() -> Comparison:
            return pick(call_isolated(step_profile, self.config).unwrap())

        phases = list({id(r): r for parts in names.values() for r, _ in parts}.values())
        left_out: dict[str, int] = {}
        for phase in phases:
            for why, n in phase.left_out.items():
                left_out[why] = left_out.get(why, 0) + n

        def rounds(parts, counted: bool) -> list[float]:
            return [t for r, k in parts
                    for t, c in zip(r.times[k], r.kept or [True] * len(r.times[k]), strict=True)
                    if c == counted]  # fmt: skip

        return Comparison.of(
            {n: rounds(parts, True) for n, parts in names.items()},
            {n: rounds(parts, False) for n, parts in names.items()},
            left_out=left_out,
            others=[c for p in phases for c in p.others],
            again=again if self.config is not None else None,
        )


def _own_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The loss of a model that returns its own (MLPStack's stand-in loss)."""
    return model(x)


@dataclass
class _Copies:
    """The copies of an MLPStack that ``step_profile`` trains side by side, on one input."""

    x: torch.Tensor  # the input of every step
    plain: dict[str, nn.Module] = field(default_factory=dict)  # copy -> its (eager) module
    models: dict[str, nn.Module] = field(default_factory=dict)  # copy -> what a step calls
    optimizers: dict[str, torch.optim.Optimizer] = field(default_factory=dict)
    losses: dict[str, float] = field(default_factory=dict)  # copy -> its kept step's loss
    grads: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # kept step's gradients

    def add(self, name: str, plain: nn.Module, model: nn.Module | None = None) -> None:
        """Add copy ``name``: module ``plain``, called through ``model`` (compiled) if given."""
        self.plain[name] = plain
        self.models[name] = plain if model is None else model
        self.optimizers[name] = torch.optim.AdamW(plain.parameters())

    def step(self, name: str, keep: bool = False) -> None:
        """The base training step of copy ``name``; ``keep``: keep its loss and gradients."""
        on_gradients = (lambda: self._keep_gradients(name)) if keep else None
        loss = train_step(
            self.models[name], self.optimizers[name], [self.x],
            loss_of=_own_loss, on_gradients=on_gradients,
        )  # fmt: skip
        if keep:
            self.losses[name] = loss.item()

    def _keep_gradients(self, name: str) -> None:
        """Copy the gradients of copy ``name`` before the optimizer step uses them."""
        self.grads[name] = [p.grad.detach().clone() for p in self.plain[name].parameters()]


def step_profile(config: StepProfileConfig) -> StepProfileResult:
    """First and steady-state training-step seconds of an MLPStack, eager and compiled.

    One copy per entry of ``config.backends`` is compiled (``mode`` applies to inductor),
    next to an eager copy from the same seed. The first step of each is timed alone: for a
    compiled copy it includes compiling forward and backward. Their losses and gradients of
    that step are kept for comparison; then all copies train in rotating order so that drift
    in the machine's speed weighs on each alike. With ``warm_rerun`` a new inductor copy is
    then compiled after clearing every in-memory compiler cache, so that only inductor's disk
    cache carries over (copy ``"inductor, warm"``). For a fresh process.
    """
    dev = resolve(config.device)
    prepare_s = prepare_compiler(dev)
    if config.cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = config.cache_dir
    copies = _build_copies(config, dev)
    warm_rounds, warm = None, None
    with quiet_dynamo():
        first_s, code = _first_steps(copies, list(copies.models), config.output_code, dev)
        rounds = _steady_steps(copies, list(copies.models), config, dev)
        first_counters = _compile_counters()
        if config.warm_rerun:
            warm_first_s, warm_rounds, warm = _warm_rerun(copies, config, dev)
            first_s.update(warm_first_s)
    flops = train_flops(lambda: copies.step("eager"))
    grad_error, grad_max = _gradient_errors(copies.grads)
    return StepProfileResult(
        prepare_s, config.rows, first_s, rounds, first_counters, copies.losses, grad_error,
        grad_max, flops, code, warm_rounds, warm, config,
    )  # fmt: skip


def _build_copies(config: StepProfileConfig, device: torch.device) -> _Copies:
    """The eager copy, one compiled copy per backend from the same weights, and the input."""
    c = config
    eager = mlp_stack(c.hidden, c.intermediate, c.n_blocks, c.seed, device)
    x = torch.randn(c.rows, c.hidden, generator=torch.Generator().manual_seed(c.seed))
    copies = _Copies(x.to(device))
    copies.add("eager", eager)
    plain = {b: copy.deepcopy(eager) for b in c.backends}
    for b in sorted(c.backends, key=lambda b: b != "inductor"):  # run_and_get_code resets dynamo
        mode = c.mode if b == "inductor" else None
        copies.add(b, plain[b], torch.compile(plain[b], backend=b, mode=mode))
    return copies


def _first_steps(
    copies: _Copies, names: Sequence[str], output_code: bool, device: torch.device
) -> tuple[dict[str, float], list[KernelsResult]]:
    """Each copy's first step timed alone, loss and gradients kept; and inductor's kernels."""
    first_s: dict[str, float] = {}
    code: list[KernelsResult] = []
    for name in names:
        if output_code and name == "inductor":
            start = time.perf_counter()
            _, codes = run_and_get_code(copies.step, name, True)
            first_s[name] = time.perf_counter() - start
            code = [generated_kernels(c) for c in codes]
        else:
            first_s[name] = time_once(lambda n=name: copies.step(n, keep=True), device)
    return first_s, code


def _steady_steps(copies: _Copies, names: Sequence[str], config: StepProfileConfig,
                  device: torch.device):  # fmt: skip
    """``warmup`` untimed steps of each copy, then ``repeats`` timed rounds in rotating order
    (``helpers.timing.interleave``: a round other processes disturbed is left out and another
    run, up to twice as many); the rounds as a ``Comparison``."""
    for _ in range(config.warmup):
        for name in names:
            copies.step(name)
    return interleave(lambda name: time_once(lambda: copies.step(name), device), list(names),
                      rounds=config.repeats, max_rounds=2 * config.repeats)  # fmt: skip


def _warm_rerun(copies: _Copies, config: StepProfileConfig, device: torch.device):
    """A new inductor copy with only the disk cache left: first step, steady steps, counters."""
    c = config
    reset_dynamo()
    clear_caches()  # inductor's in-memory caches: only the disk cache is left
    fresh = mlp_stack(c.hidden, c.intermediate, c.n_blocks, c.seed, device)
    copies.add("inductor, warm", fresh, torch.compile(fresh, mode=c.mode))
    first_s, _ = _first_steps(copies, ["inductor, warm"], c.output_code, device)
    rounds = _steady_steps(copies, ["eager", "inductor, warm"], c, device)
    return first_s, rounds, _compile_counters()


def _gradient_errors(grads: dict[str, list[torch.Tensor]]) -> tuple[dict, list[float]]:
    """Per compiled copy, max |grad - eager's| per tensor; and max |eager's grad| per tensor."""
    errors = {
        b: [(g - r).abs().max().item() for g, r in zip(grads[b], grads["eager"], strict=True)]
        for b in grads
        if b != "eager"
    }
    return errors, [r.abs().max().item() for r in grads["eager"]]


def _compile_counters() -> CompileCountersResult:
    """Dynamo's graphs and breaks, and the caches' hits and misses, since ``reset_dynamo``."""
    summary = dynamo_summary()
    return CompileCountersResult(
        graphs=summary.graphs,
        graph_breaks=summary.graph_breaks,
        fxgraph_cache=CacheCountsResult(
            counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        ),
        autograd_cache=CacheCountsResult(
            counters["aot_autograd"]["autograd_cache_hit"],
            counters["aot_autograd"]["autograd_cache_miss"],
        ),
    )


def break_even_steps(extra_first_s: float, eager_step_s: float, compiled_step_s: float):
    """Steps after which compiling has paid for itself; None when the compiled step is slower,
    0 when its first step cost no more than eager's (a warm cache on a busy machine can)."""
    saving = eager_step_s - compiled_step_s
    return max(0.0, extra_first_s / saving) if saving > 0 else None


def seconds_saved(extra_first_s: float, saving_s: float, n: float) -> float:
    """Eager total minus compiled total after ``n`` steps: each copy pays its first step, then
    n - 1 steady steps, so compiling is ``extra_first_s`` behind at first and gains
    ``saving_s`` (eager step minus compiled step) per later step."""
    return (n - 1) * saving_s - extra_first_s


def break_even_figure(costs: dict[str, tuple[float, float]], title: str = ""):
    """Seconds saved by compiling against training steps, on a log axis that shows every
    crossing of zero. ``costs``: label -> (extra first-step seconds, saving per step)."""
    # The x-range comes from the break-even points: from 1 step to 4 times the last crossing,
    # so every crossing, a few steps or tens of thousands, lies inside, with room after it.
    from matplotlib.figure import Figure

    evens = {k: break_even_steps(extra, saving, 0.0) for k, (extra, saving) in costs.items()}
    found = [n for n in evens.values() if n is not None]
    horizon = max(10.0, 4 * max(found, default=250.0))
    # y from a little below the largest extra cost to what the latest crossing's line reaches
    # at the horizon (about 3x its extra cost): a line that climbs faster leaves the top, but
    # every crossing and the start of every line stay in view.
    span = max((extra for extra, _ in costs.values()), default=0.0)
    steps = [float(v) for v in torch.logspace(0, math.log10(horizon), 60).tolist()]
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for label, (extra, saving) in costs.items():
        even = evens[label]
        if even is None:
            where = "never (not faster here)"
        else:
            where = f"after {even:,.0f} steps" if even else "from the first step"
        line = ax.plot(steps, [seconds_saved(extra, saving, n) for n in steps],
                       label=f"{label}: pays off {where}")  # fmt: skip
        if even:  # a crossing after step 1 (a log axis has no 0)
            ax.plot([even], [0.0], marker="o", color=line[0].get_color())
    ax.axhline(0.0, linestyle="--", color="grey", linewidth=1)
    ax.set_xscale("log")
    if span > 0 and found:
        ax.set_ylim(-1.2 * span, 3.4 * span)
    plain_ticks(ax)
    ax.set_xlabel("training steps (log scale)")
    ax.set_ylabel("seconds saved by compiling\n(eager total - compiled total)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.legend(fontsize="small", loc="outside lower center")  # under the axes: covers no line
    return fig
