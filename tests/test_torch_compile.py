"""torch.compile helpers: capture, graph breaks, recompiles, traffic counts, the training case.

Inductor runs once here, on gelu_new's single kernel (a C++ compile takes seconds per kernel
on a small CPU); the other tests use the recording backend and the debugging backends eager
and aot_eager.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from helpers.lessons import torch_compile as compiling
from helpers.lessons.torch_compile import (
    StepProfileConfig,
    break_even_figure,
    break_even_steps,
    dynamo_summary,
    gelu_new,
    gelu_tanh_aten,
    generated_kernels,
    mlp_stack,
    reset_dynamo,
    seconds_saved,
    short_reason,
    step_profile,
)
from helpers.models import build_model, load_config
from tests.cells import cell_function

NOTEBOOK = "12_torch_compile.ipynb"
GraphRecorder = cell_function(NOTEBOOK, "GraphRecorder")  # the lesson's cells: what it runs
explain = cell_function(NOTEBOOK, "explain", quiet_dynamo=compiling.quiet_dynamo)
graph_ops = cell_function(NOTEBOOK, "graph_ops")
input_shapes = cell_function(NOTEBOOK, "input_shapes")
ops_by_layer = cell_function(NOTEBOOK, "ops_by_layer", Counter=Counter, re=re)
eager_traffic = cell_function(
    NOTEBOOK, "eager_traffic", TorchDispatchMode=TorchDispatchMode, tree_leaves=tree_leaves
)
count_compiles = cell_function(
    NOTEBOOK, "count_compiles", GraphRecorder=GraphRecorder,
    contextlib=contextlib, logging=logging, os=os, re=re,
)  # fmt: skip
dynamo_log = cell_function(
    NOTEBOOK, "dynamo_log", contextlib=contextlib, logging=logging, os=os, re=re,
)  # fmt: skip
first_forwards = cell_function(
    NOTEBOOK, "first_forwards", GraphRecorder=GraphRecorder, dynamo_log=dynamo_log,
    load_config=load_config, build_model=build_model, graph_ops=graph_ops,
    ops_by_layer=ops_by_layer, time=time,
)  # fmt: skip


def test_gelu_new_is_transformers_new_gelu_bit_for_bit():
    from transformers.activations import NewGELUActivation

    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 4
    assert torch.equal(gelu_new(x), NewGELUActivation()(x))
    # ATen's fused tanh GELU is the same function, rounded differently.
    assert torch.allclose(gelu_tanh_aten(x), gelu_new(x), atol=1e-6, rtol=1e-6)


def test_eager_traffic_counts_gelu_new_ops_and_bytes():
    x = torch.randn(100)
    ops, moved = eager_traffic(gelu_new, x)
    # 8 ops; each writes one tensor and reads one (two for the two tensor-tensor ops).
    assert (ops, moved) == (8, 18 * x.nbytes)


def test_recorder_sees_one_graph_of_eight_ops():
    recorder = GraphRecorder()
    x = torch.randn(16)
    out = torch.compile(gelu_new, backend=recorder)(x)
    reset_dynamo()
    assert torch.equal(out, gelu_new(x))
    assert len(recorder.graphs) == 1
    assert graph_ops(recorder.graphs[0]) == [
        "mul",
        "pow",
        "mul",
        "add",
        "mul",
        "tanh",
        "add",
        "mul",
    ]


def _breaks_once(x):
    y = x * 2
    n = y.sum().item()  # a graph break
    return y + n


def test_explain_reports_the_item_break():
    ex = explain(_breaks_once, torch.ones(4))
    assert (ex.graph_count, ex.graph_break_count) == (2, 1)
    assert "item" in short_reason(ex.break_reasons[0].reason)


def test_short_reason_drops_hints_and_source_comment():
    reason = "0/0: self.flag is None        # if self.flag is None:  # model.py:3\nHint: ..."
    assert short_reason(reason) == "0/0: self.flag is None"


def test_count_compiles_default_fixed_and_marked_dynamic_shapes():
    block = mlp_stack(8, 16, n_blocks=1)
    calls = [(torch.randn(2, s, 8),) for s in (4, 6, 8)]
    default = count_compiles(block, calls)
    static = count_compiles(block, calls, dynamic=False)
    marked_x = calls[0][0].clone()
    torch._dynamo.mark_dynamic(marked_x, 1)
    marked = count_compiles(block, [(marked_x,), *calls[1:]])
    # The recorder's graphs and the log's graph_code records agree.
    assert [len(g) for g, _ in (default, static, marked)] == [2, 3, 1]
    assert [len(log.graphs) for _, log in (default, static, marked)] == [2, 3, 1]
    failed = default[1].guard_failures() + static[1].guard_failures()
    assert len(failed) == 1 + 3 and all("size mismatch" in r for r in failed), failed
    assert marked[1].recompiles == []
    # Parameters are left out; the second default graph has a symbolic sequence length.
    assert input_shapes(default[0][0]) == [(2, 4, 8)]
    shape = input_shapes(default[0][1])[0]
    assert shape[0] == 2 and shape[2] == 8 and str(shape[1]).startswith("s")
    assert default[1].graph_breaks == []


def test_count_compiles_logs_each_graph_break():
    graphs, log = count_compiles(_breaks_once, [(torch.ones(3),)])
    assert len(graphs) == len(log.graphs) == 2
    assert len(log.graph_breaks) == 1 and "item" in log.graph_breaks[0], log.graph_breaks


def test_count_compiles_finds_a_guard_on_python_state():
    class Flagged(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.kind = None

        def forward(self, x):
            if self.kind is None:
                self.kind = "set"  # the first call changes what the guard checked
            return x + 1

    graphs, log = count_compiles(Flagged(), [(torch.ones(2),), (torch.ones(2),), (torch.ones(2),)])
    assert len(graphs) == 2 and len(log.recompiles) == 1
    assert "kind" in log.guard_failures()[0], log.guard_failures()


def test_ops_by_layer_counts_each_repeated_layers_operations():
    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x.sum()

    recorder = GraphRecorder()
    torch.compile(Stack(), backend=recorder)(torch.ones(2, 4))
    reset_dynamo()
    counts = ops_by_layer(recorder.graphs[0])
    # Each layer's linear; the relus and the sum run in Stack itself, outside any layer.
    assert counts == {0: 1, 1: 1, 2: 1, None: 4}, counts
    assert sum(counts.values()) == len(graph_ops(recorder.graphs[0]))


def test_first_forwards_regional_reuses_one_graph_and_use_cache_recompiles_per_layer():
    threads, runs = torch.get_num_threads(), {}  # first_forwards sets one thread
    try:
        for name, args in (("whole", (False,)), ("regional", (True,)), ("cached", (True, True))):
            reset_dynamo()  # each from scratch, as in the fresh process the lesson gives it
            runs[name] = first_forwards(*args, n_layers=2, calls=2)
    finally:
        torch.set_num_threads(threads)
        reset_dynamo()
    whole, regional, cached = runs.values()
    layer_ops = {k: n for k, n in whole["operations by layer"].items() if k is not None}
    assert whole["graphs"] == 1 and whole["runs per forward"] == [1], whole
    assert layer_ops == dict.fromkeys((0, 1), regional["operations per graph"][0]), layer_ops
    assert regional["graphs"] == 1 and regional["runs per forward"] == [2], regional
    assert regional["recompilations"] == 0, regional
    assert (cached["graphs"], cached["recompilations"]) == (2, 1), cached
    assert "past_key_values" in cached["failed guards"][0], cached["failed guards"]
    assert whole["capture s"] > 0 and regional["forward ms"] > 0


def test_dynamo_log_lets_go_of_the_logger_and_refuses_under_torch_logs(monkeypatch):
    dynamo = logging.getLogger("torch._dynamo")
    count_compiles(_breaks_once, [(torch.ones(3),)])
    assert dynamo.handlers and not [h for h in dynamo.handlers if type(h).__name__ == "DynamoLog"]
    monkeypatch.setenv("TORCH_LOGS", "dynamo")
    with pytest.raises(RuntimeError, match="TORCH_LOGS is set"):
        count_compiles(_breaks_once, [(torch.ones(3),)])


def test_dynamo_summary_counts_since_reset():
    reset_dynamo()
    f = torch.compile(_breaks_once, backend="eager")
    with compiling.quiet_dynamo():
        f(torch.ones(3))
    summary = dynamo_summary()
    reset_dynamo()
    assert summary.graphs == 2 and summary.graph_breaks == 1
    assert dynamo_summary().graphs == 0


def test_generated_kernels_parses_output_code():
    code = (
        "cpp_fused_add_mul_pow_tanh_0 = async_compile.cpp_pybinding(['const float*'], r'''\n"
        "'''\n"
        "triton_poi_fused_add_1 = async_compile.triton('triton_poi_fused_add_1', '''\n"
        "'''\n"
        "    def call(self, args):\n"
        "        extern_kernels.addmm(a, b, c, out=buf0)\n"
        "        cpp_fused_add_mul_pow_tanh_0(buf0, buf1)\n"
        "        extern_kernels.mm(buf1, d, out=buf2)\n"
        "        extern_kernels.addmm(a, buf2, c, out=buf3)\n"
    )
    found = generated_kernels(code)
    assert found.kernels == ["cpp_fused_add_mul_pow_tanh_0", "triton_poi_fused_add_1"]
    assert found.extern == {"addmm": 2, "mm": 1}


def test_break_even_steps():
    assert break_even_steps(10.0, 0.03, 0.02) == pytest.approx(1000)
    assert break_even_steps(10.0, 0.02, 0.02) is None
    assert break_even_steps(10.0, 0.02, 0.03) is None
    assert break_even_steps(-0.1, 0.03, 0.02) == 0.0  # first step no dearer: pays at once


def test_seconds_saved_crosses_zero_at_the_break_even_step():
    assert seconds_saved(10.0, 0.01, 1) == -10.0  # the first step: only the extra cost
    assert seconds_saved(10.0, 0.01, 1001) == pytest.approx(0.0)


@pytest.mark.parametrize(
    "costs",
    [
        # tiny scale on a 2-core CPU: seconds to compile, tens of ms saved (crossings ~10, ~200)
        {"compiled, cold cache": (3.5, 0.0173), "compiled, warm cache": (0.2, 0.0173)},
        # full scale on a GPU: a minute to compile, ms saved (crossings ~1,000, ~30,000)
        {"compiled, cold cache": (60.0, 0.002), "compiled, warm cache": (2.0, 0.002)},
        # not faster here: no crossing, and one that crosses late beside one that never does
        {"compiled, cold cache": (5.0, -0.001), "compiled, warm cache": (0.3, -0.001)},
        {"compiled, cold cache": (5.0, 0.0001), "compiled, warm cache": (0.3, -0.001)},
        # a busy machine: the warm first step beat eager's, and its saving dwarfs the cold one
        {"compiled, cold cache": (16.1, 0.0041), "compiled, warm cache": (-0.1, 0.22)},
    ],
)
def test_break_even_figure_shows_every_crossing(costs):
    from tests.plot_checks import figure_problems

    fig = break_even_figure(costs, title="tiny scale on cpu: compiling pays off where ...")
    assert figure_problems(fig) == []
    ax = fig.axes[0]
    low, high = ax.get_xlim()
    for extra, saving in costs.values():
        even = break_even_steps(extra, saving, 0.0)
        if even is not None:  # the crossing lies inside the axis, with room after it
            assert low <= 1 and even * 2 < high, (even, low, high)


def test_mlp_stack_is_seeded_and_returns_a_scalar_loss():
    a, b = mlp_stack(8, 32, 2, seed=3), mlp_stack(8, 32, 2, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert all(torch.count_nonzero(blk.fc1.bias) == 0 for blk in a.blocks)
    loss = a(torch.randn(5, 8))
    assert loss.dim() == 0 and loss.item() > 0


def test_step_profile_with_aot_eager(monkeypatch):
    # prepare_compiler runs inductor once per process; not needed for aot_eager.
    monkeypatch.setattr(compiling, "prepare_compiler", lambda device="cpu": 0.0)
    config = StepProfileConfig(
        backends=("aot_eager",), hidden=8, intermediate=32, n_blocks=1, rows=16, warmup=1, repeats=3
    )
    out = step_profile(config)
    assert set(out.first_s) == {"eager", "aot_eager"}
    assert {k: len(v) for k, v in out.times.items()} == {"eager": 3, "aot_eager": 3}
    # aot_eager runs the same ATen operations as eager: the same loss and gradients.
    assert out.loss["aot_eager"] == out.loss["eager"]
    assert max(out.grad_error["aot_eager"]) == 0.0
    assert (out.counters.graphs, out.counters.graph_breaks) == (1, 0)
    # Matmuls of 16x8x32 (2*16*8*32 FLOPs each): 2 forward; backward, both weight gradients
    # and the input gradient of the second linear (the input x needs none).
    assert out.flops == 5 * (2 * 16 * 8 * 32)
    reset_dynamo()


def test_fusion_profile_adds_rounds_at_the_largest_size_while_a_claim_is_undecided(monkeypatch):
    from helpers import timing

    # Every claim stays undecided: the largest size runs up to max_repeats, the others stop.
    monkeypatch.setattr(timing.Comparison, "decided", lambda self, claims: not claims)
    claim = timing.Claim("compiled", "faster", "aten", 2.0)
    out = compiling.fusion_profile(
        [2**8, 2**10], repeats=3, max_repeats=7, per_round=1, claims=[claim], prepare=False
    )
    assert [len(r["aten"]) for r in out.rounds] == [3, 7]
    assert out.graphs == 1 and out.max_error <= 1e-5
