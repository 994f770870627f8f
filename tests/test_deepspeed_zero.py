"""helpers.lessons.deepspeed_zero: sizes, the decision tree, the device tracker, a real run."""

from __future__ import annotations

import ast
import importlib.util
import inspect

import pytest
import torch

from helpers.isolate import call_isolated
from helpers.lessons import deepspeed_zero as zero
from helpers.memory import CategoryTracker, OffloadView
from helpers.models import build_model, count_params, load_config
from helpers.names import MiB
from tests.cells import cell_definition, cell_function

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
# The DeepSpeed config as lesson 08 writes it in a cell: the one every ZeRO run uses.
zero_config = cell_function("08_deepspeed_zero.ipynb", "zero_config")
# The training step through the engine as the lesson writes it: every ZeRO run takes it.
engine_step = cell_function("08_deepspeed_zero.ipynb", "engine_step")


def test_the_notebook_writes_out_the_modules_engine_step():
    """The lesson's runs take the cell's engine_step; the preflight takes the module's. They
    must be the same code (comments and formatting aside)."""
    cell = cell_definition("08_deepspeed_zero.ipynb", "engine_step")
    module = ast.parse(inspect.getsource(zero.engine_step)).body[0]
    assert ast.dump(cell) == ast.dump(module), "notebook 08's engine_step() drifted"


def _step_that_says_it_ran(engine, batch):
    raise RuntimeError("the step handed to measure_zero ran")


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed")
def test_measure_zero_trains_with_the_step_it_is_given():
    run = zero.ZeroConfig("llama-tiny", zero_config(2, 128, 2), batch_size=2, seq_len=16,
                          warmup=1, repeats=1)  # fmt: skip
    out = call_isolated(zero.measure_zero, run, _step_that_says_it_ran)
    assert out.error is not None and "the step handed to measure_zero ran" in out.error, out


def test_layer_counts_match_a_built_model():
    model = build_model(load_config("llama-tiny"))
    total, largest = zero.layer_counts("llama-tiny")
    assert total == count_params(model)
    # llama-tiny's largest module is its 1024 x 128 embedding (the untied lm_head is as large).
    assert largest == 1024 * 128


def test_widen_keeps_the_head_size():
    base = load_config("llama-tiny").to_dict()
    wide = zero.widen(base, 3)
    assert wide["hidden_size"] == 3 * base["hidden_size"]
    assert wide["hidden_size"] // wide["num_attention_heads"] == (
        base["hidden_size"] // base["num_attention_heads"]
    )
    assert wide["num_key_value_heads"] == 3 * base["num_key_value_heads"]


def test_oversized_config_is_the_narrowest_that_exceeds_the_budget():
    budget = 64 * MiB
    big = zero.oversized_config("llama-tiny", budget, over=1.5, layers=4)
    n, _ = zero.layer_counts(big)
    assert 16 * n >= 1.5 * budget
    factor = big["hidden_size"] // load_config("llama-tiny").hidden_size
    narrower = zero.widen(
        {**load_config("llama-tiny").to_dict(), "num_hidden_layers": 4}, factor - 1
    )
    assert 16 * zero.layer_counts(narrower)[0] < 1.5 * budget


def test_zero_config_takes_the_sizes_of_a_run_config():
    from helpers.train import RunConfig

    plain = RunConfig(model="llama-tiny", batch_size=3, seq_len=32, warmup=2, repeats=5, seed=7)
    ds = zero_config(2, 128, 3)
    spec = zero.ZeroConfig.from_run(plain, ds_config=ds, label="ZeRO-2")
    sizes = (spec.model, spec.batch_size, spec.seq_len, spec.warmup, spec.repeats, spec.seed)
    assert sizes == ("llama-tiny", 3, 32, 2, 5, 7)
    assert (spec.stage, spec.offload_params, spec.label, spec.budget) == (2, False, "ZeRO-2", None)
    assert "precision" not in spec.as_dict()  # RunConfig's switches that ZeRO runs do not take
    assert spec.as_dict()["stage"] == 2 and spec.as_dict()["ds_config"] == ds
    three = zero.ZeroConfig.from_run(plain, ds_config=zero_config(3, 128, 3, offload_params=True))
    assert (three.stage, three.offload_params) == (3, True)


def test_a_zero_config_refuses_a_missing_or_contradictory_deepspeed_config():
    with pytest.raises(ValueError, match="zero_config cell"):
        zero.ZeroConfig(model="llama-tiny")
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu is 2 but batch_size is 4"):
        zero.ZeroConfig(model="llama-tiny", ds_config=zero_config(3, 128, 2), batch_size=4)


def test_deepspeed_estimates_name_each_option():
    est = zero.deepspeed_estimates(10**6, 10**5)
    if est is None:
        pytest.skip("deepspeed is not installed")
    assert est["ZeRO-3 + offload optimizer + params"].device < est["ZeRO-2"].device
    assert all(e.host > 0 for name, e in est.items() if "offload" in name)


def test_plan_walks_the_decision_tree():
    gib = 2**30
    fits = zero.plan(10**6, 10**5, activations=10 * MiB, budget=gib, host_ram=64 * gib)
    assert fits.choice == "plain" and fits.host_need == 0
    # 100 M params: 1.6 GB of states > 1 GiB, but the 400 MB fp32 weights fit: ZeRO-2.
    z2 = zero.plan(10**8, 10**7, activations=100 * MiB, budget=gib, host_ram=64 * gib)
    assert z2.choice == "ZeRO-2 + offload optimizer" and z2.device_need == 4 * 10**8 + 100 * MiB
    # 1 B params: the weights alone exceed 1 GiB; one 50 M layer (400 MB) plus activations fits.
    z3 = zero.plan(10**9, 5 * 10**7, activations=100 * MiB, budget=gib, host_ram=64 * gib)
    assert z3.choice == "ZeRO-3 + offload optimizer + params"
    nvme = zero.plan(10**9, 5 * 10**7, activations=100 * MiB, budget=gib, host_ram=8 * gib)
    assert nvme.choice == "ZeRO-3 + NVMe offload"
    assert zero.plan(10**9, 5 * 10**8, 0, gib, 64 * gib).choice == "more devices"


def test_zero_config_offloads_and_accepts_a_torch_optimizer():
    cfg = zero_config(3, hidden_size=64, batch_size=2, offload_params=True)
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"]["device"] == "cpu"
    assert z["offload_param"]["device"] == "cpu" and z["reduce_bucket_size"] == 64 * 64
    assert cfg["zero_force_ds_cpu_optimizer"] is False
    assert "offload_param" not in zero_config(2, 64, 2)["zero_optimization"]
    with pytest.raises(ValueError):
        zero_config(2, 64, 2, offload_params=True)


def test_one_process_env_is_a_world_of_one():
    env = zero.one_process_env()
    assert env["WORLD_SIZE"] == "1" and env["RANK"] == "0" and int(env["MASTER_PORT"]) > 0


def test_storage_and_tensor_bytes_count_views_differently():
    flat = torch.zeros(100)
    views = [flat[:30], flat[30:]]
    assert zero.storage_bytes(views) == 400  # one storage behind both views
    assert zero.tensor_bytes(views) == 400  # 30 + 70 elements
    assert zero.tensor_bytes([flat[:10]]) == 40 and zero.storage_bytes([flat[:10]]) == 400


def test_offload_view_ignores_host_buffers_and_enforces_the_budget():
    host = torch.zeros(1024, 1024)  # 4 MiB "offloaded"
    view = OffloadView(torch.device("cpu"), {host.untyped_storage().data_ptr()})
    with CategoryTracker(offload=view) as tracker:
        host.add_(1)  # in place: no allocation
        _ = host * 2  # 4 MiB on the device side
        view = host[:10]  # a view of a host buffer is not device memory
        view.sum()
    assert 4 * MiB <= tracker.device_peak < 4 * MiB + 4096
    view = OffloadView(torch.device("cpu"), set(), fetched=lambda: 2 * MiB)
    fetched = CategoryTracker(budget=5 * MiB, offload=view)
    with pytest.raises(torch.OutOfMemoryError, match="fetched"):
        with fetched:
            torch.zeros(1024, 1024)  # 4 MiB + 2 MiB of fetched weights > 5 MiB


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed")
def test_zero3_offload_in_one_process_matches_plain_training():
    from helpers.train import RunConfig, Trainee

    ds_config = zero_config(3, 128, 2, offload_params=True)  # llama-tiny's width
    run = zero.ZeroConfig("llama-tiny", ds_config, batch_size=2, seq_len=16, warmup=1, repeats=1)
    out = call_isolated(zero.measure_zero, run, engine_step)
    assert out.error is None, out.error
    rec = out.value
    n = rec.n_params
    # memory holds the course's categories in bytes; the lesson's own numbers are in extra.
    categories = {"params", "gradients", "optimizer_state", "activations", "temporaries", "peak"}
    assert set(rec.memory) == categories
    assert all(isinstance(v, int) for v in rec.memory.values())
    assert rec.extra["offloaded_on"] == ["cpu"]
    assert rec.extra["resident_params"] < 0.05 * 4 * n  # only the small persistent params
    assert rec.extra["offloaded_optimizer_state"] >= 8 * n
    assert 0 < rec.extra["fetched"] <= 4 * n
    trainee = Trainee(RunConfig(model="llama-tiny", batch_size=2, seq_len=16))
    plain = [trainee.step() for _ in range(2)]
    assert rec.losses[0] == pytest.approx(plain[0], rel=1e-6)  # same init, batch, forward
    assert rec.losses[1] == pytest.approx(plain[1], rel=1e-4)  # same AdamW step


def _record(peak: int, offloaded: int = 0, n_params: int = 0, allocated: int | None = None):
    from helpers.results import Record

    allocator = None if allocated is None else {"allocated": allocated}
    return Record(config={}, memory={"peak": peak}, extra={"offloaded": offloaded},
                  n_params=n_params, allocator=allocator)  # fmt: skip


def test_timing_mode_keeps_the_contenders_alive_together_only_where_they_fit(monkeypatch):
    from tests.fake_gpu import PROFILES, FakeGpu

    runs = {"plain": _record(100 * MiB, n_params=10**6), "ZeRO-3": _record(10 * MiB, 300 * MiB)}
    # On a CPU the device is the host: 110 MiB x 1.1 + 300 MiB offloaded + 4 MB of weights
    # built on the host = 429 MiB, against half the RAM.
    monkeypatch.setattr(zero, "host_ram_bytes", lambda: 1024 * MiB)
    assert zero.timing_mode(runs, "cpu") == "workers"
    monkeypatch.setattr(zero, "host_ram_bytes", lambda: 512 * MiB)
    assert zero.timing_mode(runs, "cpu") == "fresh"
    # On a GPU the allocator's peaks, with the margin and a context each (and the notebook's).
    GiB = 1024 * MiB
    monkeypatch.setattr(zero, "host_ram_bytes", lambda: 64 * GiB)
    FakeGpu(monkeypatch, [PROFILES["a100-40"]])
    fit = {k: _record(1, allocated=15 * GiB) for k in ("a", "b")}  # 33 + 1.5 GiB < 39.6
    assert zero.timing_mode(fit, "cuda") == "workers"
    crowded = {k: _record(1, allocated=18 * GiB) for k in ("a", "b")}  # 39.6 + 1.5 > 39.6
    assert zero.timing_mode(crowded, "cuda") == "fresh"


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed")
def test_zero_step_is_a_contender_timed_in_turns_with_a_plain_step():
    from helpers.isolate import bench, compare_benches
    from helpers.train import RunConfig, trainee_step

    plain = RunConfig(model="llama-tiny", batch_size=2, seq_len=16)
    run = zero.ZeroConfig.from_run(plain, ds_config=zero_config(2, 128, 2))
    contenders = {
        "plain": bench(trainee_step, plain),
        "ZeRO-2": bench(zero.zero_step, run, engine_step),
    }
    out = compare_benches(contenders, "cpu", rounds=2, max_rounds=2)
    assert not out.errors, out.errors
    assert out.rounds == 2 and all(t > 0 for times in out.times.values() for t in times)


def test_a_zero_run_on_a_gpu_reads_the_allocator_after_a_reset(monkeypatch):
    # measure_zero's CUDA branch, driven on a fake card with a stand-in engine: the tracked
    # step resets the allocator's peaks first (the warm-up's spike must not count), tracks
    # nothing itself, and the record's device memory is the allocator's peak of that step.
    from types import SimpleNamespace

    from helpers.timing import Timing
    from tests.fake_gpu import PROFILES, FakeGpu

    fake = FakeGpu(monkeypatch, [PROFILES["a100-40"]])
    cuda = torch.device("cuda", 0)
    fake.allocate(50 * MiB)  # what lives through the steps
    fake.alloc[0].peak_allocated = 500 * MiB  # a warm-up spike before the tracked step
    run = zero.ZeroConfig(ds_config=zero_config(2, 128, 4), device="cuda")
    module = torch.nn.Linear(4, 4)
    setup = zero._ZeroSetup(
        engine=SimpleNamespace(module=module),
        ds_optimizer=SimpleNamespace(),
        batch={},
        ds_config={"zero_optimization": {"stage": 2}},
        n_params=20,
    )

    def step():
        fake.events.append("step")
        fake.allocate(10 * MiB)

    assert zero._tracked_step(step, setup, run, cuda) is None
    assert fake.events[-2:] == ["reset peaks", "step"]
    record = zero._zero_record(run, cuda, setup, None, Timing(0.5, [0.5]), [1.0], t0=0.0)
    assert record.memory == {"peak": 60 * MiB}  # the step's peak, not the warm-up's
    assert record.allocator["allocated"] == 60 * MiB and "A100" in record.device["name"]
    assert record.extra["resident_params"] == 20 * 4 and record.config["zero"] == {"stage": 2}


@pytest.mark.parametrize("scale", [MiB, 1024 * MiB])  # tiny (MiB) and full-scale-like (GiB)
def test_placement_figure_is_readable(scale):
    from tests.plot_checks import figure_problems

    def run(params, grads, state, acts, temps):
        mem = dict(params=params, gradients=grads, optimizer_state=state, activations=acts,
                   temporaries=temps)  # fmt: skip
        return {k: int(v * scale) for k, v in {**mem, "peak": 0.9 * sum(mem.values())}.items()}

    device = {
        "oversized plain, no budget": run(40, 40, 80, 30, 10),
        "ZeRO-2 + offload optimizer": run(40, 2, 0, 30, 5),
        "ZeRO-3 + offload all, budget": run(4, 2, 0, 30, 5),
    }
    host = {"ZeRO-2 + offload optimizer": int(210 * scale),
            "ZeRO-3 + offload all, budget": int(240 * scale)}  # fmt: skip
    assert figure_problems(zero.placement_figure(device, host, int(100 * scale))) == []
