"""CUDA's memory accounting, checked on a CPU: the rounding rule, the estimator's CUDA branch,
and the lessons' per-category equalities evaluated on CUDA numbers.

On CUDA the course's tracker (PyTorch's MemTracker) counts every storage as the caching
allocator holds it, rounded up to a multiple of 512 bytes, and torch's AdamW keeps its step
counters on the CPU. A lesson check written as ``params == 4 * n_params`` therefore fails on
every GPU (bert-large's 8-byte classifier bias alone makes it 4 n + 504). The estimator's
CUDA branch models both effects tensor by tensor; here its numbers stand in for a GPU's.
"""

import math

import pytest
import torch
from torch.distributed._tools.mem_tracker import _MemRefType, _WeakRefInfo

from helpers.device import ALLOCATION_UNIT, allocation_bytes
from helpers.estimator import describe_model, estimate
from helpers.memory import CategoryTracker, rounding_slack
from helpers.models import build_model, load_config
from helpers.optimizer_state import expected_state, tracked_bytes

CUDA = torch.device("cuda", 0)
MODELS = ["bert-tiny", "bert-large", "llama-tiny", "llama-400m", "mixtral-tiny"]


@pytest.mark.parametrize("nbytes", [1, 4, 8, 511, 512, 513, 4096, 10**6 + 3])
def test_allocation_bytes_is_memtrackers_own_cuda_rule(nbytes):
    """The rule is pinned to torch's: MemTracker's storage record computes it itself."""
    on_cuda = _WeakRefInfo(nbytes, 1, CUDA, _MemRefType.PARAM).mem_consumed
    on_cpu = _WeakRefInfo(nbytes, 1, torch.device("cpu"), _MemRefType.PARAM).mem_consumed
    assert allocation_bytes(nbytes, "cuda") == on_cuda
    assert allocation_bytes(nbytes, "cpu") == on_cpu == nbytes
    assert on_cuda % ALLOCATION_UNIT == 0 and on_cuda - nbytes < ALLOCATION_UNIT


def _meta_model(name):
    with torch.device("meta"):
        return build_model(load_config(name), device="meta")


@pytest.mark.parametrize("name", MODELS)
def test_estimator_counts_each_cuda_tensor_as_the_allocator_holds_it(name):
    model = _meta_model(name)
    params = list(model.parameters())
    est = estimate(name, 2, 32, device=CUDA)
    assert est.params == sum(allocation_bytes(4 * p.numel(), "cuda") for p in params)
    assert est.buffers == sum(
        allocation_bytes(b.numel() * b.element_size(), "cuda") for b in model.buffers()
    )
    assert est.gradients == est.params
    # AdamW: exp_avg and exp_avg_sq shaped like each weight, the step counters on the CPU.
    assert est.optimizer_state == 2 * est.params
    for opt in ("sgd", "adafactor", "adamw8bit", "lion", "lion8bit", "muon"):
        got = estimate(describe_model(name), 2, 32, optimizer=opt, device=CUDA).optimizer_state
        rows = expected_state(model, opt)  # the rules lesson 06 checks against real state
        assert got == tracked_bytes(rows, CUDA), opt


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("shape", [(4, 64), (4, 512)])
def test_lesson_equalities_hold_on_cuda_numbers(name, shape):
    """Lessons 00, 01, 03, 07 and 09's model-state checks, on the estimator's CUDA numbers."""
    config = load_config(name)
    b, s = shape
    s = min(s, config.max_position_embeddings)
    info = describe_model(name)
    n, n_tensors = info.n_params, len(info.params)
    est = estimate(info, b, s, device=CUDA)
    slack = rounding_slack(n_tensors, CUDA)
    # 00, 01, 03, 07: fp32 weights are 4 B/param, up to the allocator's rounding.
    assert 4 * n <= est.params <= 4 * n + slack
    # 01, 03: gradients = weights, byte for byte (same shapes, same rounding).
    assert est.gradients == est.params
    # 01: AdamW 8 B/param (two moments; the steps are on the CPU here) within 0.1 %.
    assert 8 * n <= est.optimizer_state < 8.01 * n
    # 01, 09: the 16 B/param of fp32 AdamW training within 0.1 %.
    fixed = est.params + est.gradients + est.optimizer_state
    assert 16 <= fixed / n < 16.01


def test_the_rounding_is_what_breaks_an_exact_equality():
    """Why the checks allow a slack: bert-large on CUDA is 4 n + 504 (its 8-byte bias)."""
    info = describe_model("bert-large")
    est = estimate(info, 4, 512, device=CUDA)
    assert est.params - 4 * info.n_params == 504
    assert est.params - 4 * info.n_params <= rounding_slack(len(info.params), CUDA)
    assert rounding_slack(len(info.params), torch.device("cpu")) == 0


def test_tracker_counts_only_its_device():
    """On CUDA torch's AdamW steps are CPU tensors: the device's tracker must not count them."""
    x = torch.ones(1024)  # 4 KiB on the CPU
    with CategoryTracker(device="cpu") as here:
        y = x * 2
    with CategoryTracker(device=CUDA) as elsewhere:
        z = x * 2
    assert here.peaks().peak == 4096 and elsewhere.peaks().peak == 0
    del y, z


def test_16_bit_copies_check_holds_on_cuda_numbers():
    """Lesson 05: 2 B per Linear weight and bias element, + 1 % for CUDA's rounding of each."""
    for name in ("bert-tiny", "bert-large"):
        model = _meta_model(name)
        n_linear = sum(
            p.numel()
            for m in model.modules()
            if isinstance(m, torch.nn.Linear)
            for p in m.parameters(recurse=False)
        )
        for b in (8, 64):
            est = estimate(name, b, 64, precision="fp16", device=CUDA)
            assert 2 * n_linear <= est.weight_copies < 2.02 * n_linear, (name, b)
            assert math.isclose(est.weight_copies, 2 * n_linear, rel_tol=0.02)
