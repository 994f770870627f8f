"""An experiment written in a notebook cell runs in the fresh process as the cell shows it.

``helpers.isolate`` sends a function or class defined in a cell (the kernel's ``__main__``,
which a fresh process does not have) by value with dill; what it cannot send (a model or a
tensor on a device the notebook made, an open file) is refused before the process starts, in
one line naming the variable. Run in a real kernel through nbclient, as a learner runs it.
"""

from __future__ import annotations

import functools
import os
import threading
import types
from pathlib import Path

import pytest
import torch

from helpers import isolate

ROOT = Path(__file__).resolve().parent.parent

SETUP = """\
import os
import torch
from helpers.isolate import CannotTravel, bench, call_isolated, compare_benches
"""
CELLS = {
    # A function using the notebook's constant, another cell's function and a cell's class.
    "runs the cell's code": """\
SCALE = 3
class Doubler:
    def __call__(self, x):
        return 2 * x
def triple(x):
    return SCALE * x
def experiment(x):
    return Doubler()(x) + triple(1), os.getpid()
value, pid = call_isolated(experiment, 20).unwrap()
print(value, pid != os.getpid())
""",
    # Redefined in a later cell: the fresh process runs the new code, not a cached copy.
    "the latest definition": """\
def triple(x):
    return 30 * x
print(call_isolated(experiment, 20).unwrap()[0])
""",
    # A checkpoint policy: a set of operators (which do not pickle) travels by their names.
    "a policy keeping operators": """\
from torch.utils.checkpoint import CheckpointPolicy
keep = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
def policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE
def decisions():
    ops = (torch.ops.aten.mm.default, torch.ops.aten.silu.default)
    return [policy(None, op).name for op in ops]
print(call_isolated(decisions).unwrap())
""",
    "a model is refused": """\
model = torch.nn.Linear(4, 4)
def step():
    return model(torch.ones(4)).sum().item()
try:
    call_isolated(step)
except CannotTravel as err:
    print(type(err).__name__, err)
""",
    "a tensor on a device is refused": """\
weights = torch.ones(4, device="meta")
def total():
    return weights.sum()
try:
    call_isolated(total)
except CannotTravel as err:
    print(type(err).__name__, err)
""",
    "an open file is refused": """\
log = open(os.devnull, "w")
def write():
    log.write("step")
try:
    call_isolated(write)
except CannotTravel as err:
    print(type(err).__name__, err)
""",
    # Contenders built by a cell's function, timed in processes of their own, both ways.
    "contenders from a cell": """\
def make_sum(n):
    x = torch.ones(n)
    return lambda: x.sum()
for mode in ("workers", "fresh"):
    result = compare_benches({"small": bench(make_sum, 10), "large": bench(make_sum, 10_000)},
                             "cpu", mode=mode, rounds=2, max_rounds=2, others_limit=None)
    print(mode, sorted(result.times), result.errors)
""",
}


@pytest.fixture(scope="module")
def printed() -> dict[str, str]:
    """{cell in CELLS: what it printed}, from one notebook run in a real kernel."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), saved]))
    try:
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(c) for c in (SETUP, *CELLS.values())]
        nbclient.NotebookClient(nb, timeout=180, kernel_name="python3").execute()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    return {
        name: "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        for name, cell in zip(CELLS, nb.cells[1:], strict=True)
    }


def test_a_function_from_a_cell_runs_in_a_fresh_process_with_what_it_uses(printed):
    assert printed["runs the cell's code"] == "43 True\n"


def test_the_fresh_process_runs_the_cells_latest_definition(printed):
    assert printed["the latest definition"] == "70\n"


def test_a_policy_over_operators_travels(printed):
    assert printed["a policy keeping operators"] == "['MUST_SAVE', 'PREFER_RECOMPUTE']\n"


@pytest.mark.parametrize(
    ("cell", "says"),
    [
        ("a model is refused", "CannotTravel `step` uses `model`, a model (Linear) made in this "
         "notebook: build it inside the function"),
        ("a tensor on a device is refused", "CannotTravel `total` uses `weights`, a tensor on "
         "meta: create it inside the function, or pass a CPU copy"),
        ("an open file is refused", "CannotTravel `write` uses `log`, an open file: pass its "
         "path as an argument"),
    ],
)  # fmt: skip
def test_what_cannot_travel_is_refused_in_one_line_naming_it(printed, cell, says):
    assert printed[cell].startswith(says), printed[cell]
    assert printed[cell].count("\n") == 1, printed[cell]


def test_contenders_built_in_a_cell_are_timed_in_processes_of_their_own(printed):
    lines = printed["contenders from a cell"].splitlines()
    assert lines == [f"{mode} ['large', 'small'] {{}}" for mode in ("workers", "fresh")]


# Without a kernel: importable code travels as before, and what holds a cell's code is found.


def _importable(x: int) -> int:
    return x


def test_importable_code_travels_as_it_is():
    payload = (_importable, (1,), {})
    assert isolate.portable(payload) is payload
    assert isolate.call_isolated(_importable, 5).unwrap() == 5


def test_cell_code_is_found_inside_benches_partials_and_instances():
    def in_cell():
        return 1

    in_cell.__module__ = "__main__"
    holder = type("Holder", (), {"__module__": "__main__"})
    deep = ((((functools.partial(print, [in_cell]),),),),)  # as deep as a Bench of a study
    held = [isolate.bench(in_cell), deep, {"k": holder()}]
    assert isolate._defined_in_cells(held) == [in_cell, holder]
    # Where something does not pickle (a lock), the walk of its containers finds them.
    assert isolate._defined_in_cells([threading.Lock(), deep, holder()]) == [in_cell, holder]


def test_a_model_held_by_an_instance_of_a_cell_class_is_refused():
    """An instance of a class written in a cell travels with its attributes: a model among
    them is refused by name, as one a cell function uses would be."""
    holder = type("Holder", (), {"__module__": "__main__"})
    spec = holder()
    spec.size, spec.model = 4, torch.nn.Linear(2, 2)
    with pytest.raises(isolate.CannotTravel, match=r"uses `Holder.model`, a model \(Linear\)"):
        isolate.portable((print, (spec,), {}))
    del spec.model  # plain values travel
    assert isinstance(isolate.portable((print, (spec,), {})), isolate._ByValue)


def _even(n: int) -> bool:
    return n == 0 or _odd(n - 1)


def _odd(n: int) -> bool:
    return n != 0 and _even(n - 1)


def test_cell_code_calling_library_functions_that_call_each_other_travels():
    # dill's search for the globals a function uses walks into every function it calls; two
    # importable functions that call each other (as the planner's do) made it recurse without
    # end. They travel by name, so the search stops at them.
    scope = {"__name__": "__main__", "_even": _even}
    exec("def check(n):\n    return _even(n), _odd.__name__", scope)  # a cell's function
    scope["_odd"] = _odd
    assert isolate.call_isolated(scope["check"], 10).unwrap() == (True, "_odd")


def test_only_the_variables_a_cell_function_reads_count_not_attributes_named_alike():
    # co_names holds attribute names too: `box.model` is not the notebook's `model` (lesson 12's
    # `gm.graph` beside a notebook variable `graph` was refused for it).
    scope = {"__name__": "__main__", "model": torch.nn.Linear(2, 2)}
    exec("def inner(box):\n    return box.model", scope)  # a cell's function
    assert isolate.call_isolated(scope["inner"], types.SimpleNamespace(model=3)).unwrap() == 3
    # A variable read inside a lambda in the function is one it uses: refused, by name.
    exec("def step():\n    return (lambda: model.weight.sum())()", scope)
    with pytest.raises(isolate.CannotTravel, match=r"uses `model`, a model \(Linear\)"):
        isolate.call_isolated(scope["step"])
