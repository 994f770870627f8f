"""Run an experiment in a fresh process, so its numbers never depend on what ran before.

A fresh process per experiment means no cached allocator blocks, no optimizer state, no
compiled kernels and no CUDA context left over from earlier cells. We fork each experiment
from a *forkserver* that has imported torch and transformers once but never run anything:
every child is as clean as a new interpreter, without paying the imports (seconds on a
laptop) every time. Where forkserver does not exist (Windows) we fall back to spawn.

The experiment may be written in a notebook cell: a function or class defined there (in the
kernel's ``__main__``, which the fresh process does not have) travels by value, serialised with
``dill``, so the code the cell shows is the code that runs. What cannot travel with it (a model
or a CUDA tensor the notebook made, an open file) is refused before the process starts
(``CannotTravel``), naming the variable and what to pass instead.
"""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import dis
import functools
import inspect
import io
import os
import pickle
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import dill
import torch

from helpers.device import (
    ASSUMED_CONTEXT,
    FORKED_AFTER_CUDA,
    RESERVE_MARGIN,
    forked_after_cuda,
    gpu_info,
    is_cuda,
    resolve,
)
from helpers.forkserver import context
from helpers.forkserver import start as start  # what lesson() calls in a first cell
from helpers.hardware import cpu_name
from helpers.progress import quiet_here, waiting
from helpers.quiet import quiet_libraries
from helpers.results import Record
from helpers.timing import confirmed, interleave, time_fn

# helpers.train and helpers.estimator import transformers (seconds): the calls that need them
# import them, so a notebook's first import stays quick.


@dataclass
class Outcome:
    """What came back from the child: a value, or the error that stopped it."""

    value: Any = None
    error: str | None = None
    error_type: str | None = None  # "oom" | "error" | "crash"
    traceback: str | None = None  # the child's traceback, where it raised

    def unwrap(self) -> Any:
        """The value; if the call failed, a RuntimeError with the child's error and traceback."""
        if self.error is None:
            return self.value
        raise RuntimeError(self.error + (f"\n\n{self.traceback}" if self.traceback else ""))


def capture(fn: Callable, args=(), kwargs=None, catch: type = Exception) -> Outcome:
    """``fn(*args, **kwargs)`` as an Outcome: its value, or the error that stopped it."""
    try:
        return Outcome(value=fn(*args, **(kwargs or {})))
    except torch.OutOfMemoryError as err:
        return Outcome(error=f"OutOfMemoryError: {_first_line(err)}", error_type="oom")
    except catch as err:  # everything else comes back too, with the place it failed
        where = traceback.extract_tb(err.__traceback__)[-1]
        message = f"{type(err).__name__}: {_first_line(err)} ({where.filename}:{where.lineno})"
        return Outcome(error=message, error_type="error", traceback=traceback.format_exc())


# --------------------------------------------------------------------------------------------
# Code from a notebook cell, sent by value


class CannotTravel(ValueError):
    """Something a cell's experiment uses cannot be sent to a fresh process (one line: which
    variable, and what to pass instead)."""


@dataclass(frozen=True)
class _ByValue:
    """Objects that hold code defined in a notebook cell, serialised by value (``dill``)."""

    data: bytes

    def load(self) -> Any:
        return dill.loads(self.data)


def portable(obj: Any, what: str = "the experiment") -> Any:
    """``obj`` as it can travel to a fresh process: itself when all its code is importable,
    else serialised by value (``_ByValue``) after ``CannotTravel`` checks what the cell's code uses.

    Args:
        obj: a function, a class, or a tuple/dict/dataclass holding them (a ``Bench``).
        what: how an error names it ("step", "the contender 'fused'").

    Returns:
        ``obj`` unchanged, or a ``_ByValue`` that ``arrived`` turns back into it.

    Example::

        def step(): ...  # in a notebook cell
        call_isolated(step)  # sends portable((step, (), {})): step's own code, by value
    """
    cells, instances = _cell_objects(obj)
    if not cells:
        return obj
    for name, value in _captured(cells) + _attributes(instances):
        problem = _cannot_travel(value)
        if problem:
            raise CannotTravel(f"{what} uses `{name}`, {problem}")
    try:
        return _ByValue(_dumps(obj))
    except Exception as err:  # dill names the object it could not serialise
        raise CannotTravel(
            f"{what} cannot be sent to a fresh process: {_first_line(err)}"
        ) from None


# Operators (``torch.ops.aten.mm.default``) do not pickle; a cell's checkpoint policy keeps a
# set of them, so they travel by name ("aten.mm.default") and are looked up again on arrival.
_OPERATORS = (type(torch.ops.aten.mm.default), type(torch.ops.aten.mm))


def _operator(name: str) -> Any:
    return functools.reduce(getattr, name.split("."), torch.ops)


def _by_name(op: Any) -> tuple:
    return _operator, (str(op),)


_BY_NAME = dict.fromkeys(_OPERATORS, _by_name)


def _dumps(obj: Any) -> bytes:
    """``obj`` pickled by ``dill``, code from cells by value, operators by name."""
    buf = io.BytesIO()
    pickler = dill.Pickler(buf, recurse=True)
    pickler.dispatch_table = {**copyreg.dispatch_table, **_BY_NAME}
    with _walk_cells_only():
        pickler.dump(obj)
    return buf.getvalue()


@contextlib.contextmanager
def _walk_cells_only():
    """dill's search for the globals a cell's function uses (``dill.detect.globalvars``, with
    ``recurse=True``), stopped at importable functions: those travel by name, so their modules'
    globals are never sent, and dill 0.4's walk through them never ends on two functions that
    call each other (the planner's, say: a RecursionError). Functions sent by value (a cell's,
    one made inside another) are walked as dill walks them."""
    walk = dill.detect.globalvars

    def cells_only(func, recurse=True, builtin=False):
        code = getattr(func, "__func__", func)
        if inspect.isfunction(code) and _importable(code):
            return {}
        return walk(func, recurse, builtin)

    dill.detect.globalvars = cells_only
    try:
        yield
    finally:
        dill.detect.globalvars = walk


def arrived(obj: Any) -> Any:
    """What ``portable`` sent, as it was (in the fresh process)."""
    return obj.load() if isinstance(obj, _ByValue) else obj


def _importable(fn: Any) -> bool:
    """Whether ``fn`` is found again by its module and qualified name (so pickle sends its name):
    not a cell's function, nor one made inside another function."""
    if _in_cell(fn):
        return False
    found = sys.modules.get(fn.__module__)
    for part in fn.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is fn


def _in_cell(obj: Any) -> bool:
    return getattr(obj, "__module__", None) == "__main__"


def _defined_in_cells(obj: Any) -> list:
    """The functions and classes defined in a notebook cell (``__main__``) that ``obj`` holds."""
    return _cell_objects(obj)[0]


def _cell_objects(obj: Any) -> tuple[list, list]:
    """The functions and classes defined in a notebook cell (``__main__``) that ``obj`` holds,
    and the instances of such classes, found as pickle walks it (everything the fresh process
    would be sent); where something in it does not pickle, the code by a walk of its
    containers (multiprocessing would refuse the rest itself)."""
    finder = _CellFinder()
    try:
        finder.dump(obj)
    except Exception:  # something pickle cannot send; multiprocessing would say so itself
        return _walk_for_cells(obj), []
    return finder.found, finder.instances


def _attributes(instances: list) -> list[tuple[str, Any]]:
    """(``Class.attribute``, value) of each instance's own attributes."""
    return [
        (f"{type(i).__name__}.{name}", value)
        for i in instances
        for name, value in getattr(i, "__dict__", {}).items()
    ]


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


class _CellFinder(pickle.Pickler):
    """A pickler that writes nothing and notes each function or class of a cell it meets."""

    def __init__(self) -> None:
        super().__init__(_Discard())
        self.found: list = []
        self.instances: list = []  # of classes defined in a cell: their attributes are checked
        self.dispatch_table = {**copyreg.dispatch_table, **_BY_NAME}

    def persistent_id(self, obj: Any) -> str | None:
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and _in_cell(obj):
            if all(obj is not f for f in self.found):
                self.found.append(obj)
            return "a cell's"  # not walked further: dill sends it by value
        if _in_cell(type(obj)) and all(obj is not i for i in self.instances):
            self.instances.append(obj)  # walked on: its class and attributes follow
        return None


def _walk_for_cells(obj: Any, depth: int = 8) -> list:
    """``_defined_in_cells`` by a walk of containers, partials and dataclasses."""
    if depth < 0:
        return []
    if inspect.isfunction(obj) or inspect.isclass(obj):
        return [obj] if _in_cell(obj) else []
    if _in_cell(type(obj)):  # an instance of a class defined in a cell
        return [type(obj)]
    if isinstance(obj, functools.partial):
        items = [obj.func, *obj.args, *obj.keywords.values()]
    elif isinstance(obj, (tuple, list, set, frozenset)):
        items = list(obj)
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    else:
        return []
    return [found for item in items for found in _walk_for_cells(item, depth - 1)]


def _captured(code: list) -> list[tuple[str, Any]]:
    """(name, value) of every variable the cells' functions use from outside themselves (the
    notebook's globals, enclosing functions), following other cell functions and classes."""
    seen, out, todo = set(), [], list(code)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if inspect.isclass(obj):
            todo += [f for f in vars(obj).values() if inspect.isfunction(f)]
            continue
        used = {n: obj.__globals__[n] for n in _global_loads(obj.__code__) if n in obj.__globals__}
        for name, value in {**used, **inspect.getclosurevars(obj).nonlocals}.items():
            if (inspect.isfunction(value) or inspect.isclass(value)) and _in_cell(value):
                todo.append(value)
            else:
                out.append((name, value))
    return out


def _global_loads(code: types.CodeType) -> set[str]:
    """The global names ``code`` and the code nested in it (lambdas, comprehensions) read.
    Not ``co_names``, which ``inspect.getclosurevars`` reads: it holds attribute names too, so
    ``gm.graph`` in a cell's function would count a notebook's global ``graph`` as used."""
    names = {
        i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")
    }
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_loads(const)
    return names


def _cannot_travel(value: Any) -> str:
    """Why ``value`` cannot go with a cell's code to a fresh process ("" if it can)."""
    if isinstance(value, torch.nn.Module):
        kind = type(value).__name__
        return (f"a model ({kind}) made in this notebook: build it inside the function (from "
                "its config), so the fresh process makes and measures its own")  # fmt: skip
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return (f"a tensor on {value.device}: create it inside the function, or pass a CPU "
                "copy (.cpu()) as an argument")  # fmt: skip
    if isinstance(value, io.IOBase):
        return "an open file: pass its path as an argument and open it inside the function"
    return ""


def _child(conn, fn, args, kwargs) -> None:
    quiet_here()  # a bar in this process would reach the kernel's log, not the notebook
    try:  # in the child even KeyboardInterrupt or SystemExit comes back as an Outcome
        with quiet_libraries():  # import-time notices of bitsandbytes and DeepSpeed
            outcome = capture(_call_sent, (fn, args, kwargs), catch=BaseException)
        if outcome.error is not None and forked_after_cuda():
            outcome.error = f"{FORKED_AFTER_CUDA} ({outcome.error})"
        conn.send(outcome)
    finally:
        conn.close()


def _call_sent(fn, args, kwargs) -> Any:
    """``fn(*args, **kwargs)``, after unpacking code a notebook cell sent (``portable``)."""
    if isinstance(fn, _ByValue):
        fn, args, kwargs = fn.load()
    return fn(*args, **kwargs)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _poll(conn, timeout: float | None, what: str) -> bool:
    """``conn.poll(timeout)``, counting the seconds in a notebook meanwhile (a child shows no
    bar of its own, so a long experiment would leave its cell silent)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with waiting(what) as tick:
        while True:
            left = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            if conn.poll(left):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            tick()


def call_isolated(
    fn: Callable, *args, timeout: float | None = None, daemon: bool = True, **kwargs
) -> Outcome:
    """Call ``fn(*args, **kwargs)`` in a fresh process; its result or its failure comes back.

    ``fn`` may be defined in a notebook cell: it travels by value (``portable``), and
    ``CannotTravel`` says, before the process starts, which variable it uses cannot go with it.
    A child killed from outside (the kernel's OOM killer, a segfault) comes back as "crash".
    The child is a daemon (it dies with the kernel) unless ``daemon=False``, which an
    experiment needs when it starts processes of its own, such as DataLoader workers:
    multiprocessing does not let a daemon process have children.
    """
    sent = portable((fn, args, kwargs), f"`{getattr(fn, '__name__', fn)}`")
    if isinstance(sent, _ByValue):
        fn, args, kwargs = sent, (), {}
    ctx = context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, args, kwargs), daemon=daemon)
    proc.start()
    child.close()
    try:
        if _poll(parent, timeout, "an experiment in a fresh process"):
            outcome = parent.recv()
        else:
            proc.kill()
            outcome = Outcome(error=f"timed out after {timeout} s", error_type="error")
    except EOFError:  # the child died before it could answer
        outcome = None
    proc.join()
    if outcome is None:
        outcome = Outcome(
            error=f"the experiment's process died (exit code {proc.exitcode}); "
            "a negative code is the signal that killed it, -9 usually means out of RAM",
            error_type="crash",
        )
    return outcome


def run(cfg, isolate: bool = True):
    """``helpers.train.measure(cfg)`` in a fresh process (or in this one); always a Record."""

    from helpers.train import measure  # imports transformers: not at a notebook's first import

    outcome = call_isolated(measure, cfg) if isolate else capture(measure, (cfg,))
    if outcome.error:
        # The run died before it could describe its device: name it here, so tables show it.
        device = {"name": _device_name(cfg.device)}
        return Record(cfg.as_dict(), device, error=outcome.error, error_type=outcome.error_type)
    return outcome.value


def _device_name(device: str | None) -> str:
    # Not the GPU's name: asking would initialise CUDA in this (notebook) process, and its
    # context would then show up in every later NVML reading.
    dev = resolve(device)
    return cpu_name() if dev.type == "cpu" else str(dev)


# --------------------------------------------------------------------------------------------
# Contenders in processes of their own, timed in interleaved rounds (helpers.timing.interleave)


@dataclass(frozen=True)
class Bench:
    """How to build one contender in a fresh process: ``fn(*args, **kwargs)`` returns the
    callable to time (a training step, say). ``fn`` may be defined in a notebook cell, as
    for call_isolated."""

    fn: Callable
    args: tuple = ()
    kwargs: dict | None = None

    def build(self) -> Callable:
        """The callable to time (run in the contender's own process)."""
        return self.fn(*self.args, **(self.kwargs or {}))


def bench(fn: Callable, *args, **kwargs) -> Bench:
    """``Bench(fn, args, kwargs)``, the way a lesson writes it."""
    return Bench(fn, args, kwargs)


def _bench_worker(conn, spec: Bench, device: str, warmup: int) -> None:
    """A contender's process: build it, warm it up, then time calls until told to stop."""
    quiet_here()
    try:
        spec = arrived(spec)  # a contender written in a notebook cell comes by value
        with quiet_libraries():
            call = spec.build()
        time_fn(call, torch.device(device), warmup=warmup, repeats=1)
        conn.send(("ready", None))
        while (n := conn.recv()) is not None:
            conn.send(("times", time_fn(call, torch.device(device), warmup=0, repeats=n).times))
    except BaseException as err:  # the coordinator reports it as this contender's error
        conn.send(("error", f"{type(err).__name__}: {_first_line(err)}"))
    finally:
        conn.close()


class Workers:
    """One long-lived process per contender, built and warmed up one after the other.

    Built once, each then times ``n`` calls whenever asked, so rounds can alternate between
    contenders that live in separate processes (nothing one allocates or compiles touches
    another) without rebuilding them. All contenders are alive at once: where they do not
    fit in memory together, use fresh processes per round (``compare_benches(mode="fresh")``).
    """

    def __init__(self, benches: dict[str, Bench], device: str, warmup: int = 1,
                 daemon: bool = True) -> None:  # fmt: skip
        self.conns, self.procs, self.errors = {}, {}, {}
        ctx = context()
        sent = {name: portable(spec, f"the contender {name!r}") for name, spec in benches.items()}
        for name, spec in sent.items():
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_bench_worker, args=(child, spec, device, warmup),
                               daemon=daemon)  # fmt: skip
            proc.start()
            child.close()
            _poll(parent, None, f"building and warming up {name} in a process of its own")
            kind, detail = self._receive(parent, proc)
            if kind == "ready":
                self.conns[name], self.procs[name] = parent, proc
            else:
                self.errors[name] = detail
                proc.join()

    @staticmethod
    def _receive(conn, proc):
        try:
            return conn.recv()
        except EOFError:
            proc.join()
            return "error", f"the contender's process died (exit code {proc.exitcode})"

    def run(self, name: str, n: int = 1) -> list[float]:
        """Seconds of each of ``n`` calls of contender ``name``; RuntimeError if it failed."""
        self.conns[name].send(n)
        kind, detail = self._receive(self.conns[name], self.procs[name])
        if kind != "times":
            raise RuntimeError(f"{name}: {detail}")
        return detail

    def close(self) -> None:
        """Stop every contender's process."""
        for name, conn in self.conns.items():
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.procs[name].join(timeout=30)
            if self.procs[name].is_alive():
                self.procs[name].kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _bench_once(spec: Bench, device: str, warmup: int, n: int) -> list[float]:
    """Build, warm up and time ``n`` calls of a contender (one round in a fresh process)."""
    return time_fn(spec.build(), torch.device(device), warmup=warmup, repeats=n).times


def compare_benches(
    benches: dict[str, Bench],
    device=None,
    mode: str = "workers",
    warmup: int = 1,
    per_round: int = 1,
    daemon: bool = True,
    units: dict[str, float] | None = None,
    **rounds,
):
    """Contenders built in processes of their own, timed in interleaved rounds.

    ``mode="workers"``: one long-lived process per contender (``Workers``), all alive at
    once. ``mode="fresh"``: every round of every contender in a fresh process, which builds
    and warms it up again (slower, but only one contender is in memory at a time: a GPU that
    holds one full-scale model, not nine). A contender that fails (out of memory, say) is left
    out of the rounds and named in the result's ``errors``. With ``units`` (samples per call,
    say) the times are per unit, so contenders doing different amounts of work compare by
    throughput. ``rounds`` as for ``helpers.timing.interleave``; a claim decided the wrong
    way is measured again in new processes before it can fail (``timing.confirmed``).
    """
    device = str(resolve(device))
    per_unit = {name: (units or {}).get(name, 1.0) for name in benches}
    if mode not in ("workers", "fresh"):
        raise ValueError(f"unknown mode {mode!r}: workers or fresh")
    # A claim decided the wrong way is measured again, in new processes: new workers (or a
    # fresh process per round again), so nothing of the first measurement's processes stays.
    run = _measure_fresh if mode == "fresh" else _measure_workers
    rounds = {**rounds, "confirm": False}
    return confirmed(
        lambda: run(benches, device, warmup, per_round, daemon, per_unit, rounds),
        rounds.get("claims", ()),
    )


def _measure_fresh(benches, device, warmup, per_round, daemon, per_unit, rounds):
    """One measurement: every round of every contender in a fresh process."""

    def run_fresh(name: str) -> float:
        out = call_isolated(_bench_once, benches[name], device, warmup, per_round,
                            daemon=daemon)  # fmt: skip
        if out.error:
            raise _ContenderFailed(name, out.error)
        return statistics.median(out.value) / per_unit[name]

    return _interleave_guarded(run_fresh, list(benches), {}, rounds)


def _measure_workers(benches, device, warmup, per_round, daemon, per_unit, rounds):
    """One measurement: a long-lived process per contender, built for it and stopped after."""
    with Workers(benches, device, warmup, daemon) as workers:
        names = [n for n in benches if n not in workers.errors]

        def run_worker(name: str) -> float:
            try:
                return statistics.median(workers.run(name, per_round)) / per_unit[name]
            except RuntimeError as err:
                raise _ContenderFailed(name, str(err)) from None

        return _interleave_guarded(run_worker, names, dict(workers.errors), rounds)


class _ContenderFailed(Exception):
    def __init__(self, name: str, error: str) -> None:
        super().__init__(error)
        self.name, self.error = name, error


def _interleave_guarded(run, names, errors, rounds):
    """``interleave`` that drops a contender failing mid-way (its error kept) and starts over."""
    while True:
        left = [n for n in names if n not in errors]
        if not left:  # nothing to time: say why each one failed instead of timing nothing
            raise RuntimeError(
                "no contender ran, so nothing could be timed:\n"
                + "\n".join(f"  {name}: {error}" for name, error in errors.items())
            )
        try:
            result = interleave(run, left, **rounds)
            result.errors = errors
            return result
        except _ContenderFailed as failed:
            errors[failed.name] = failed.error


def mode_for(cfgs, device=None) -> str:
    """ "workers" when the training runs ``cfgs`` fit in memory all at once, else "fresh".

    Their peaks come from the estimator; on CUDA each worker also holds a CUDA context and
    the allocator's margin (helpers.course.fullscale's model), on a CPU half the RAM is the limit.
    """
    from helpers.estimator import estimate_run  # imports transformers (as helpers.train)

    device = resolve(device)
    need = sum(int(estimate_run(cfg).peak * (1 + RESERVE_MARGIN)) for cfg in cfgs)
    if is_cuda(device):
        need += (len(cfgs) + 1) * ASSUMED_CONTEXT  # the workers' contexts and the notebook's
        return "workers" if need <= gpu_info(device).total_memory else "fresh"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return "workers" if need <= ram // 2 else "fresh"


def compare_runs(cfgs: dict, device=None, claims=(), **options):
    """Training runs (``helpers.train.RunConfig``) timed against each other, interleaved.

    Each run trains in a process of its own (long-lived workers where they fit in memory
    together, else a fresh process per round: ``mode_for``); times are seconds per sample, so
    runs with different batches or accumulation compare by throughput (``rates()`` gives
    samples/s). ``options`` as for ``compare_benches`` and ``helpers.timing.interleave``.
    """
    from helpers.train import trainee_step  # imports transformers (see run)

    plain = {label: replace(cfg, budget=None) for label, cfg in cfgs.items()}
    options.setdefault("mode", mode_for(list(plain.values()), device))
    return compare_benches(
        {label: bench(trainee_step, cfg) for label, cfg in plain.items()},
        device,
        units={label: cfg.batch_size * cfg.grad_accum for label, cfg in plain.items()},
        claims=claims,
        **options,
    )
