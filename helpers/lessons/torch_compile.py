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
from torch import nn

# -------------------------------------------------------------------------------------------
# Seeing what dynamo captures


class GraphRecorder:
    """A torch.compile backend that keeps every FX graph dynamo hands it and runs it as is."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> Callable:
        self.graphs.append(gm)
        return gm.forward


def graph_ops(gm: torch.fx.GraphModule) -> list[str]:
    """Names of the operations in a captured graph, in order (inputs and outputs left out)."""
    ops = []
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            ops.append(getattr(node.target, "__name__", str(node.target)))
        elif node.op == "call_module":
            ops.append(type(gm.get_submodule(node.target)).__name__)
    return ops


def input_shapes(gm: torch.fx.GraphModule) -> list[tuple]:
    """Shapes of a captured graph's tensor inputs other than parameters; a symbolic (dynamic)
    size shows as s and a number."""
    shapes = []
    for node in gm.graph.nodes:
        value = node.meta.get("example_value") if node.op == "placeholder" else None
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            shapes.append(tuple(str(s) if isinstance(s, torch.SymInt) else s for s in value.shape))
    return shapes


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


def explain(fn: Callable, *args, **kwargs):
    """``torch._dynamo.explain(fn)(*args, **kwargs)`` from a clean dynamo state, quietly."""
    torch._dynamo.reset()
    with quiet_dynamo():
        return torch._dynamo.explain(fn)(*args, **kwargs)


def is_compiled(module) -> bool:
    """Whether ``module`` is torch.compile's wrapper around a model (an ``OptimizedModule``)."""
    import torch._dynamo

    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def short_reason(reason: str) -> str:
    """First line of a graph-break or guard-failure reason, without hints or source comment."""
    return reason.strip().splitlines()[0].split("  #")[0].strip()


def reset_dynamo() -> None:
    """Forget every compiled graph, guard failure and counter (disk caches stay)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def dynamo_summary() -> dict:
    """Graphs compiled, graph breaks and recompile reasons since the last ``reset_dynamo``."""
    from torch._dynamo.utils import counters, guard_failures

    return {
        "graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": sum(counters["graph_break"].values()),
        "recompile_reasons": [short_reason(r) for rs in guard_failures.values() for r in rs],
    }


@dataclass
class Compiles:
    """What dynamo did over a sequence of calls: the graphs, breaks and recompile reasons."""

    graphs: list[torch.fx.GraphModule] = field(default_factory=list)
    graph_breaks: int = 0
    recompile_reasons: list[str] = field(default_factory=list)


def count_compiles(fn: Callable, calls: Sequence[tuple | dict], **compile_kwargs) -> Compiles:
    """Compile ``fn`` with a GraphRecorder and call it once per entry of ``calls``.

    An entry is a tuple of positional arguments or a dict of keyword arguments.
    """
    reset_dynamo()
    recorder = GraphRecorder()
    compiled = torch.compile(fn, backend=recorder, **compile_kwargs)
    with quiet_dynamo():
        for args in calls:
            compiled(**args) if isinstance(args, dict) else compiled(*args)
    summary = dynamo_summary()
    reset_dynamo()
    return Compiles(recorder.graphs, summary["graph_breaks"], summary["recompile_reasons"])


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
    import torch._dynamo
    import torch._inductor.compile_fx

    with quiet_dynamo():
        torch.compile(lambda t: 2 * t + 1)(torch.zeros(8, device=device))
    reset_dynamo()
    return time.perf_counter() - start


def generated_kernels(code: str) -> dict:
    """Kernels inductor generated in one output-code module, and the library calls it makes.

    ``kernels``: names of the generated C++ (CPU) or Triton (GPU) kernels, named after the
    operations fused into them; ``extern``: how often each library kernel (matmuls) is called.
    """
    kernels = re.findall(r"^(\w+) = async_compile\.\w+\(", code, flags=re.M)
    extern = Counter(re.findall(r"extern_kernels\.(\w+)\(", code))
    return {"kernels": kernels, "extern": dict(extern)}


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


def eager_traffic(fn: Callable, *args) -> tuple[int, int]:
    """(operators run, bytes of their tensor inputs and outputs) when ``fn(*args)`` runs eagerly."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    tally = {"ops": 0, "bytes": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            leaves = tree_leaves((args, kwargs, out))
            tally["ops"] += 1
            tally["bytes"] += sum(
                t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor)
            )
            return out

    with Count():
        fn(*args)
    return tally["ops"], tally["bytes"]


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
) -> dict:
    """Seconds per call of gelu_new: eager, compiled once with dynamic shapes, ATen's kernel.

    At each size the three are timed in turns (``helpers.timing.compare_calls``, ``repeats``
    rounds of ``per_round`` calls each; key ``"rounds"`` keeps each size's per-round seconds);
    at the largest size rounds are added, up to ``max_repeats``, while one of ``claims`` is
    undecided (one call there lasts milliseconds, within reach of a scheduler's hiccup). Also
    the first call's
    seconds (the compilation), the number of graphs compiled over all sizes, and the largest
    deviation of the compiled output from eager. For a fresh process; ``prepare=False`` when
    ``prepare_compiler`` already ran in it.
    """
    from torch._dynamo.utils import counters

    from helpers.device import resolve
    from helpers.timing import compare_calls, synchronize

    dev = resolve(device)
    if prepare:
        prepare_compiler(dev)
    reset_dynamo()
    if cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    compiled = torch.compile(gelu_new, dynamic=True)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=g).to(dev) for n in sizes]
    with quiet_dynamo():
        start = time.perf_counter()
        compiled(xs[0])
        synchronize(dev)
        out: dict = {"sizes": list(sizes), "compile_s": time.perf_counter() - start}
        fns = {"eager": gelu_new, "compiled": compiled, "aten": gelu_tanh_aten}
        for name in fns:
            out[name] = []
        out["max_error"], out["max_abs"] = 0.0, 0.0
        out["rounds"] = []  # per size: {name: seconds per round}, the three in turns
        for i, x in enumerate(xs):
            calls = {name: (lambda f=fn, x=x: f(x)) for name, fn in fns.items()}
            last = i == len(xs) - 1
            turns = compare_calls(
                calls,
                dev,
                warmup=warmup,
                per_round=per_round,
                rounds=repeats,
                max_rounds=max_repeats if last else repeats,
                claims=claims if last else (),
            )
            out["rounds"].append(turns.times)
            for name in fns:
                out[name].append(turns.median(name))
            ref = gelu_new(x)
            out["max_error"] = max(out["max_error"], (compiled(x) - ref).abs().max().item())
            out["max_abs"] = max(out["max_abs"], ref.abs().max().item())
    out["graphs"] = counters["stats"]["unique_graphs"]
    return out


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


def step_profile(
    backends: Sequence[str] = ("inductor",),
    hidden: int = 128,
    intermediate: int = 512,
    n_blocks: int = 2,
    rows: int = 256,
    device: str | None = None,
    warmup: int = 2,
    repeats: int = 20,
    cache_dir: str | None = None,
    mode: str | None = None,
    seed: int = 0,
    output_code: bool = False,
    warm_rerun: bool = False,
) -> dict:
    """First and steady-state training-step seconds of an MLPStack, eager and compiled.

    One copy per entry of ``backends`` is compiled (``mode`` applies to inductor), next to an
    eager copy from the same seed. The first step of each is timed alone: for a compiled copy
    it includes compiling forward and backward. Their losses and gradients of that step are
    kept for comparison; then all copies train in rotating order so that drift in the
    machine's speed weighs on each alike. With ``warm_rerun`` a new inductor copy is then
    compiled after clearing every in-memory compiler cache, so that only inductor's disk
    cache carries over (key ``"inductor, warm"``). For a fresh process.
    """
    from helpers.device import resolve
    from helpers.timing import time_once, train_flops

    dev = resolve(device)
    out: dict = {"prepare_s": prepare_compiler(dev), "rows": rows, "first_s": {}, "code": []}
    if cache_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    eager = mlp_stack(hidden, intermediate, n_blocks, seed, dev)
    plain = {"eager": eager, **{b: copy.deepcopy(eager) for b in backends}}
    models = {"eager": eager}
    for b in sorted(backends, key=lambda b: b != "inductor"):  # run_and_get_code resets dynamo
        models[b] = torch.compile(plain[b], backend=b, mode=mode if b == "inductor" else None)
    optims = {name: torch.optim.AdamW(m.parameters()) for name, m in plain.items()}
    x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed)).to(dev)
    out["loss"], grads = {}, {}

    def step(name: str, keep: bool = False) -> None:
        loss = models[name](x)
        loss.backward()
        if keep:
            out["loss"][name] = loss.item()
            grads[name] = [p.grad.detach().clone() for p in plain[name].parameters()]
        optims[name].step()
        optims[name].zero_grad(set_to_none=True)

    def first_steps(names: Sequence[str]) -> None:
        for name in names:
            if output_code and name == "inductor":
                from torch._inductor.utils import run_and_get_code

                start = time.perf_counter()
                _, codes = run_and_get_code(step, name, True)
                out["first_s"][name] = time.perf_counter() - start
                out["code"] = [generated_kernels(c) for c in codes]
            else:
                out["first_s"][name] = time_once(lambda n=name: step(n, keep=True), dev)

    def steady(names: Sequence[str], times: dict) -> None:
        for _ in range(warmup):
            for name in names:
                step(name)
        for i in range(repeats):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                times.setdefault(name, []).append(time_once(lambda n=name: step(n), dev))

    with quiet_dynamo():
        first_steps(list(models))
        out["times"] = {}
        steady(list(models), out["times"])
        out.update(_compile_counters())
        if warm_rerun:
            from torch._inductor.utils import clear_caches

            reset_dynamo()
            clear_caches()  # inductor's in-memory caches: only the disk cache is left
            plain["inductor, warm"] = mlp_stack(hidden, intermediate, n_blocks, seed, dev)
            models["inductor, warm"] = torch.compile(plain["inductor, warm"], mode=mode)
            optims["inductor, warm"] = torch.optim.AdamW(plain["inductor, warm"].parameters())
            first_steps(["inductor, warm"])
            steady(["eager", "inductor, warm"], out.setdefault("warm_times", {}))
            out["warm"] = _compile_counters()
    out["flops"] = train_flops(lambda: step("eager"))
    out["grad_error"] = {
        b: [(g - r).abs().max().item() for g, r in zip(grads[b], grads["eager"], strict=True)]
        for b in grads
        if b != "eager"
    }
    out["grad_max"] = [r.abs().max().item() for r in grads["eager"]]
    return out


def _compile_counters() -> dict:
    from torch._dynamo.utils import counters

    summary = dynamo_summary()
    return {
        "graphs": summary["graphs"],
        "graph_breaks": summary["graph_breaks"],
        "fxgraph_cache": {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss")},
        "autograd_cache": {
            k: counters["aot_autograd"][f"autograd_cache_{k}"] for k in ("hit", "miss")
        },
    }


def profiles(calls: Sequence[tuple[Callable, dict]]) -> list:
    """Run several profile functions one after another in this process; their results."""
    return [fn(**kwargs) for fn, kwargs in calls]


def break_even_steps(extra_first_s: float, eager_step_s: float, compiled_step_s: float):
    """Steps after which compiling has paid for itself; None when the compiled step is slower."""
    saving = eager_step_s - compiled_step_s
    return extra_first_s / saving if saving > 0 else None
