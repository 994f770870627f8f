"""A technique a lesson writes in a cell and a recipe marks (``# >>> ... # <<<``) is one code.

The notebook cell is what the lesson measures (its fresh processes run the cell's own function:
``helpers.isolate.portable``), the recipe is what a learner takes home, and the course's own
setting (``RunConfig``, which the estimator and the planner read) names the same technique.
The first test keeps the cell's lines and the recipe's marked lines equal; the others run the
recipe's lines and compare what they decide with the course's setting.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from helpers.recipes import body_lines, marked
from tests.cells import NOTEBOOKS

# (recipe, notebook): the first and last line of the code both show.
SHARED = {
    ("selective_checkpointing", "16_more_memory.ipynb"): (
        "aten = torch.ops.aten",
        "return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE",
    ),
    ("chunked_loss", "16_more_memory.ipynb"): (
        "def chunk_loss(head, hidden, targets):",
        "return total / (targets != -100).sum()",
    ),
    ("optimizer_in_backward", "16_more_memory.ipynb"): (
        "class OptimizerInBackward:",
        'self.schedules[n].load_state_dict(saved["schedule"])',
    ),
    ("optimizers", "06_optimizers.ipynb"): (
        "def muon_split(model):",
        "return muon, [p for p in model.parameters() if all(p is not q for q in muon)]",
    ),
    ("fp8", "16_more_memory.ipynb"): (
        "def to_float8(module, name):",
        'return name != "lm_head" and module.in_features % 16 == 0 and '
        "module.out_features % 16 == 0",
    ),
}


def _code(lines: list[str]) -> list[str]:
    """Lines as code: dedented, without blank lines and comment-only lines."""
    text = textwrap.dedent("\n".join(lines))
    return [s.rstrip() for s in text.splitlines() if s.strip() and not s.strip().startswith("#")]


def _span(lines: list[str], first: str, last: str) -> list[str] | None:
    """The lines from ``first`` to ``last`` (compared stripped), as code; None if absent."""
    stripped = [s.strip() for s in lines]
    if first not in stripped:
        return None
    start = stripped.index(first)
    if last not in stripped[start:]:
        return None
    return _code(lines[start : start + stripped[start:].index(last) + 1])


def recipe_span(recipe: str, first: str, last: str) -> list[str]:
    """The shared code as the recipe's marked blocks write it."""
    lines = body_lines(recipe)
    inside = [line for line, m in zip(lines, marked(lines), strict=True) if m]
    found = _span(inside, first, last)
    assert found, f"recipes/{recipe}.py marks no block from {first!r} to {last!r}"
    return found


def cell_span(notebook: str, first: str, last: str) -> list[str]:
    """The shared code as a code cell of the notebook writes it."""
    cells = json.loads((NOTEBOOKS / notebook).read_text())["cells"]
    for cell in cells:
        if cell["cell_type"] == "code":
            found = _span("".join(cell["source"]).splitlines(), first, last)
            if found:
                return found
    raise AssertionError(f"no code cell of {notebook} writes {first!r} ... {last!r}")


@pytest.mark.parametrize(("recipe", "notebook"), list(SHARED), ids=[r for r, _ in SHARED])
def test_the_cell_and_the_recipe_write_the_same_code(recipe, notebook):
    first, last = SHARED[recipe, notebook]
    assert cell_span(notebook, first, last) == recipe_span(recipe, first, last)


def _run(recipe: str, notebook: str) -> dict:
    """The recipe's shared lines, executed: the names they define."""
    from torch.utils.checkpoint import CheckpointPolicy

    scope = {"torch": torch, "CheckpointPolicy": CheckpointPolicy}
    exec("\n".join(recipe_span(recipe, *SHARED[recipe, notebook])), scope)
    return scope


def test_the_selective_policy_is_the_one_runconfig_names():
    """``RunConfig(checkpoint_policy="selective")`` (the estimator's and the planner's setting)
    keeps the operators the lesson's and the recipe's policy keep."""
    from helpers.memory_savers import SAVED_OPS, save_matmuls

    scope = _run("selective_checkpointing", "16_more_memory.ipynb")
    assert scope["keep"] == SAVED_OPS
    for op in [*SAVED_OPS, torch.ops.aten.silu.default, torch.ops.aten.mul.Tensor]:
        assert scope["policy"](None, op) == save_matmuls(None, op), op


def test_the_fp8_filter_is_the_one_the_course_converts_with():
    """``more_memory.fp8_filter`` (the preflight's fp8 run) chooses the layers the lesson's
    and the recipe's filter choose, on every Linear layer torchao asks about."""
    from helpers.lessons.more_memory import fp8_filter

    to_float8 = _run("fp8", "16_more_memory.ipynb")["to_float8"]
    layers = {
        "model.layers.0.mlp.up_proj": torch.nn.Linear(128, 352),
        "model.layers.0.self_attn.q_proj": torch.nn.Linear(100, 128),
        "model.layers.0.mlp.down_proj": torch.nn.Linear(352, 120),
        "lm_head": torch.nn.Linear(128, 1024),
    }
    decided = {n: (to_float8(m, n), fp8_filter(m, n)) for n, m in layers.items()}
    assert all(a == b for a, b in decided.values()), decided
    assert [n for n, (a, _) in decided.items() if a] == ["model.layers.0.mlp.up_proj"]


@pytest.mark.parametrize("name", ["llama-tiny", "bert-tiny"])
def test_the_muon_split_is_the_one_runconfig_names(name):
    """``RunConfig(optimizer="muon")`` (``helpers.optimizer_state.hidden_matrices``, which the
    estimator and the planner read) gives Muon the matrices the lesson's and the recipe's
    ``muon_split`` give it, and AdamW every other parameter once."""
    from helpers.models import build_model, load_config
    from helpers.optimizer_state import hidden_matrices

    model = build_model(load_config(name))
    muon, rest = _run("optimizers", "06_optimizers.ipynb")["muon_split"](model)
    assert {id(p) for p in muon} == hidden_matrices(model)
    assert len(muon) + len(rest) == len(list(model.parameters())) and muon and rest


def _llama_and_batch():
    """llama-tiny in fp32 without dropout, and a batch of 2 x 24 tokens with labels."""
    from helpers.models import build_model, load_config

    model = build_model(load_config("llama-tiny"), dropout=0.0)
    ids = torch.randint(
        0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)
    )
    return model, {"input_ids": ids, "labels": ids}


def test_the_chunked_loss_is_the_one_runconfig_names():
    """``RunConfig(loss_chunk=...)`` (``helpers.memory_savers.ChunkedCausalLMLoss``, which the
    estimator reads) gives the loss and gradients of the lesson's and the recipe's
    ``chunked_loss``: the same chunks, summed in the same order, so bit for bit."""
    from helpers.memory_savers import ChunkedCausalLMLoss

    chunked_loss = _run("chunked_loss", "16_more_memory.ipynb")["chunked_loss"]
    model, batch = _llama_and_batch()
    results = []
    for loss_of in (
        lambda: chunked_loss(model, batch, 16),
        lambda: ChunkedCausalLMLoss(model, 16)(batch),
    ):
        loss = loss_of()
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    (cell_loss, cell_grads), (course_loss, course_grads) = results
    assert torch.equal(cell_loss, course_loss)
    assert all(torch.equal(a, b) for a, b in zip(cell_grads, course_grads, strict=True))
    assert torch.allclose(cell_loss, model(**batch).loss)  # and it is the model's own loss


def test_the_optimizer_in_backward_steps_as_the_one_runconfig_names():
    """``RunConfig(optimizer_in_backward=True)`` (``helpers.memory_savers.OptimizerInBackward``)
    and the lesson's and the recipe's class step each parameter from its hook alike: with the
    same optimizer, the same weights after three steps, bit for bit, and no gradient left."""
    from torch.optim.lr_scheduler import LambdaLR

    from helpers.memory_savers import OptimizerInBackward

    cell_class = _run("optimizer_in_backward", "16_more_memory.ipynb")["OptimizerInBackward"]
    models = []
    for build in (
        lambda m: cell_class(m, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                             lambda opt: LambdaLR(opt, lambda step: 1.0)),
        lambda m: OptimizerInBackward(list(m.parameters()),
                                      lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
    ):  # fmt: skip
        model, batch = _llama_and_batch()
        build(model)
        for _ in range(3):
            model(**batch).loss.backward()  # each parameter steps inside backward
        assert all(p.grad is None for p in model.parameters())
        models.append(model)
    pairs = zip(models[0].parameters(), models[1].parameters(), strict=True)
    assert all(torch.equal(p, q) for p, q in pairs)
    start, _ = _llama_and_batch()
    assert not torch.equal(start.lm_head.weight, models[0].lm_head.weight)  # they trained
