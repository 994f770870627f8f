"""Lesson 15's own machinery (its cells, helpers.lessons.seeing_memory) as the notebook uses it."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch

from helpers.lessons.seeing_memory import largest_rows, peak_match, short_where
from helpers.memory import CATEGORIES
from helpers.timeline import measure_timeline, predicted_timeline
from helpers.train import RunConfig
from tests.cells import cell_function
from tests.fake_gpu import PROFILES, FakeGpu

BASE = RunConfig(model="llama-tiny", batch_size=2, seq_len=32, repeats=1, flops=False)
NOTEBOOK = "15_seeing_memory.ipynb"
# The lesson's cells: what it runs. A constant comes with the cell of the function that reads it.
grid_config = cell_function(NOTEBOOK, "grid_config", replace=replace)
GRID = grid_config.__globals__["GRID"]
growth = cell_function(NOTEBOOK, "growth")
remedy = cell_function(NOTEBOOK, "remedy")
REMEDIES = remedy.__globals__["REMEDIES"]


def test_grid_settings_use_the_devices_16_bit_format():
    cfgs = {name: grid_config(BASE, s, "fp16") for name, s in GRID.items()}
    assert cfgs["fp32"] == BASE
    assert cfgs["16-bit + checkpointing"].precision == "fp16"
    assert cfgs["16-bit + checkpointing"].gradient_checkpointing


@pytest.mark.parametrize("setting", list(GRID))
def test_the_predicted_peak_is_the_measured_moment(setting):
    cfg = grid_config(BASE, GRID[setting], "bf16")
    m = peak_match(measure_timeline(cfg, isolate=False), predicted_timeline(cfg))
    assert abs(m.error) < 0.10 and m.same_phase
    assert m.measured_near_predicted >= 0.9 * m.measured


@pytest.mark.parametrize(("batch", "seq", "grew"), [(4, 64, "activations"), (1, 16, "gradients")])
def test_an_oom_names_what_grew_and_its_fix_fits(batch, seq, grew):
    # A large micro-batch fails while activations pile up (checkpointing fixes it); a small one
    # peaks in the optimizer step, where every gradient is alive and checkpointing cannot help.
    base = replace(BASE, batch_size=batch, seq_len=seq)
    plain = measure_timeline(base, isolate=False)
    budget = int(0.9 * plain.peak)
    failed = measure_timeline(replace(base, budget=budget), isolate=False)
    g = growth(failed, len(failed.phase) - 1)
    assert failed.error and max(g, key=g.get) == grew
    fix_for = cell_function(NOTEBOOK, "fix_for", replace=replace)  # the lesson's
    name, fixed_cfg = fix_for(replace(base, budget=budget), grew)
    fixed = measure_timeline(fixed_cfg, isolate=False)
    assert not fixed.error and fixed.peak <= budget, name
    rows = largest_rows(failed, 3)
    assert len(rows) == 3 and rows[0]["MiB"] >= rows[-1]["MiB"]


def test_every_category_has_advice():
    assert set(REMEDIES) == set(CATEGORIES)
    assert "checkpointing" in remedy("activations")


def test_short_where_drops_the_model_class():
    assert short_where("backward: LlamaForCausalLM.model.layers.0.mlp") == (
        "backward: model.layers.0.mlp"
    )
    assert short_where("optimizer step") == "optimizer step"
    assert short_where("model.embed_tokens.weight") == "model.embed_tokens.weight"


def _allocator_stats(allocated: int, reserved: int, ooms: int) -> dict:
    """torch._C._cuda_memoryStats' nested counters, all that memory_summary prints."""

    def stat(v: int) -> dict:
        return {"current": v, "peak": v, "allocated": v, "freed": 0}

    per_pool = {"allocated_bytes": allocated, "active_bytes": allocated,
                "requested_bytes": allocated, "reserved_bytes": reserved,
                "inactive_split_bytes": reserved - allocated, "allocation": 1, "active": 1,
                "segment": 1, "inactive_split": 1}  # fmt: skip
    stats = {
        k: {p: stat(v) for p in ("all", "large_pool", "small_pool")} for k, v in per_pool.items()
    }
    return {**stats, "oversize_allocations": stat(0), "oversize_segments": stat(0),
            "num_ooms": ooms, "num_alloc_retries": 0}  # fmt: skip


def test_the_oom_observer_dumps_the_history_and_the_allocators_counters(monkeypatch, tmp_path):
    # The lesson's observer as CUDA's allocator calls it, on a fake card (the notebook attaches it
    # to a real out-of-memory error on a GPU): its snapshot ends with the OOM event, and its
    # memory_summary counts the OOM.
    gpu = FakeGpu(monkeypatch, [PROFILES["t4"]])
    card = gpu.alloc[0]
    monkeypatch.setattr(
        torch._C, "_cuda_memoryStats", lambda i: _allocator_stats(card.allocated, card.reserved, 1)
    )
    at_oom, path = {}, tmp_path / "oom.pickle"
    snapshot_at_oom = cell_function(
        NOTEBOOK, "snapshot_at_oom", at_oom=at_oom, oom_snapshot_path=path
    )
    torch.cuda.memory._record_memory_history(max_entries=1000, stacks="python")
    torch.cuda.set_per_process_memory_fraction(0.25, torch.device("cuda", 0))
    gpu.allocate(2**30)
    limit = int(card.fraction * card.total)
    with pytest.raises(torch.OutOfMemoryError):
        gpu.allocate(limit)
    snapshot_at_oom(0, limit, limit, card.total - card.reserved)
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "rb") as f:
        actions = [e["action"] for e in pickle.load(f)["device_traces"][0]]
    assert actions[-1] == "oom" and "alloc" in actions, actions
    assert at_oom["alloc"] == at_oom["limit"] == limit
    assert "CUDA OOMs: 1 " in at_oom["summary"] and "GPU reserved memory" in at_oom["summary"]
