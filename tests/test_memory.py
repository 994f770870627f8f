"""Per-category bytes are exact; the budget raises at the right point; failures come back."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.compat import importable
from helpers.isolate import run
from helpers.memory import CategoryTracker, memory_budget
from helpers.train import RunConfig, Trainee, measure, measure_speeds

ARCHS = ["bert-tiny", "llama-tiny"]  # an encoder (classification) and a decoder (causal LM)
FP32 = 4


def expected_state_bytes(optimizer: str, params: list[torch.nn.Parameter]) -> int:
    """Optimizer-state bytes from each algorithm's definition, parameter by parameter."""
    total = 0
    for p in params:
        if optimizer == "adamw":  # exp_avg + exp_avg_sq, and a 0-dim float32 step per tensor
            total += 2 * FP32 * p.numel() + FP32
        elif optimizer == "sgd":  # one momentum buffer, no step counter
            total += FP32 * p.numel()
        elif optimizer == "adafactor":  # factored second moment: one row and one column vector
            if p.dim() >= 2:
                *lead, r, c = p.shape
                total += FP32 * math.prod(lead) * (r + c) + FP32
            else:  # vectors keep their full second moment
                total += FP32 * p.numel() + FP32
    return total


@pytest.fixture(scope="module")
def records():
    out = {}
    for arch in ARCHS:
        for opt in ["adamw", "sgd", "adafactor"]:
            cfg = RunConfig(
                model=arch, batch_size=2, seq_len=32, optimizer=opt, repeats=1, flops=False
            )
            out[arch, opt] = measure(cfg)
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("opt", ["adamw", "sgd", "adafactor"])
def test_categories_are_exact(records, arch, opt):
    rec = records[arch, opt]
    trainee = Trainee(RunConfig(model=arch, optimizer=opt))
    params = list(trainee.model.parameters())
    assert rec.n_params == sum(p.numel() for p in params)
    mem = rec.memory
    assert mem["params"] == FP32 * rec.n_params  # fp32 weights: 4 B/param
    assert mem["gradients"] == mem["params"]  # one fp32 gradient per weight
    assert mem["optimizer_state"] == expected_state_bytes(opt, params)
    assert mem["activations"] > 0
    # The peak is a simultaneous total: at least the persistent state, at most the sum of maxima.
    persistent = mem["params"] + mem["optimizer_state"] + mem["buffers"]
    assert persistent < mem["peak"] <= sum(mem[k] for k in mem if k not in ("peak", "peak_at"))


def test_activations_grow_with_batch_and_sequence():
    def act(bs, s):
        cfg = RunConfig(model="bert-tiny", batch_size=bs, seq_len=s, repeats=1, flops=False)
        return measure(cfg).memory["activations"]

    base = act(2, 32)
    # Doubling either dimension roughly doubles activations (attention scores grow as s^2,
    # so doubling s gives a bit more than double); never less than 1.6x.
    assert 1.6 * base < act(4, 32) < 2.4 * base
    assert 1.6 * base < act(2, 64) < 3.0 * base


def test_autocast_weight_copies_are_temporaries_not_params():
    cfg = RunConfig(
        model="bert-tiny", batch_size=2, seq_len=32, precision="bf16", repeats=1, flops=False
    )
    rec = measure(cfg)
    assert rec.memory["params"] == FP32 * rec.n_params
    assert rec.memory["gradients"] == FP32 * rec.n_params


def test_budget_raises_exactly_past_the_peak():
    cfg = RunConfig(model="bert-tiny", batch_size=2, seq_len=32, repeats=1, flops=False)
    peak = measure(cfg).memory["peak"]
    # The same steady-state step fits a budget of exactly its peak ...
    assert measure(RunConfig(**{**cfg.as_dict(), "budget": peak})).ok
    # ... and one byte less raises, as a full GPU would.
    with pytest.raises(torch.OutOfMemoryError, match="budget"):
        measure(RunConfig(**{**cfg.as_dict(), "budget": peak - 1}))


def test_budget_context_refuses_a_model_that_does_not_fit():
    model = torch.nn.Linear(256, 256)  # 257 KiB of fp32 weights
    with pytest.raises(torch.OutOfMemoryError):
        with memory_budget(100 * 1024, model, device=torch.device("cpu")):
            pass
    with memory_budget(10 * 2**20, model, device=torch.device("cpu")) as tracker:
        model(torch.randn(8, 256)).sum().backward()
    assert isinstance(tracker, CategoryTracker)
    assert tracker.peaks().gradients == 4 * (256 * 256 + 256)


def test_isolation_returns_oom_record_instead_of_crashing():
    cfg = RunConfig(model="bert-tiny", batch_size=2, seq_len=32, repeats=1, budget=2**20)
    rec = run(cfg)
    assert not rec.ok and rec.oom
    assert "OutOfMemoryError" in rec.error
    ok = run(RunConfig(model="bert-tiny", batch_size=2, seq_len=32, repeats=1, flops=False))
    assert ok.ok and ok.memory["params"] == FP32 * ok.n_params


def test_isolation_reports_a_dead_process():
    import os

    from helpers.isolate import call_isolated

    outcome = call_isolated(os._exit, 3)
    assert outcome.error_type == "crash" and "exit code 3" in outcome.error


def _divide(a: int, b: int) -> float:
    return a / b


def test_outcome_unwrap_and_both_paths_report_failures_alike():
    from helpers.isolate import call_isolated, capture

    assert call_isolated(_divide, 6, 3).unwrap() == 2.0
    here, there = capture(_divide, (1, 0)), call_isolated(_divide, 1, 0)
    for outcome in (here, there):
        assert outcome.error_type == "error" and outcome.error.startswith("ZeroDivisionError")
        with pytest.raises(RuntimeError, match="ZeroDivisionError") as err:
            outcome.unwrap()
        assert "Traceback" in str(err.value) and "_divide" in str(err.value)
    # In this process as in a fresh one, a failed run is a Record carrying the error.
    bad = RunConfig(model="bert-tiny", batch_size=2, seq_len=32, optimizer="nope", repeats=1)
    assert [run(bad, isolate=i).error.split(":")[0] for i in (False, True)] == ["ValueError"] * 2


def test_fork_server_preloads_extras_only_without_cuda(monkeypatch):
    from helpers import forkserver as server

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert server.preload_list("peft", "torch") == [*server.PRELOAD, "peft"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert server.preload_list("peft") == server.PRELOAD_CUDA
    assert server.preload_list() == server.PRELOAD_CUDA


def test_on_a_gpu_the_fork_server_imports_no_quantization_backend():
    # transformers' modeling_utils imports every installed quantization backend, and torchao
    # initialises CUDA while imported (an H200 run: every forked experiment failed). The
    # server's GPU preload must stop short of it, whichever backends this machine has.
    import json
    import subprocess
    import sys

    from helpers import forkserver as server

    probe = (
        "import importlib, json, sys, torch\n"
        "if sys.argv[1] == 'gpu': torch.cuda.is_available = lambda: True\n"
        "for m in sys.argv[2:]: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('torchao', "
        "'bitsandbytes', 'transformers.modeling_utils', 'transformers.quantizers')))))"
    )

    def loaded(modules, gpu):
        done = subprocess.run([sys.executable, "-c", probe, "gpu" if gpu else "cpu", *modules],
                              capture_output=True, text=True, check=True)  # fmt: skip
        return json.loads(done.stdout.strip().splitlines()[-1])

    assert loaded(server.PRELOAD_CUDA, gpu=True) == []
    # Why PRELOAD is not used there (imported as on a CPU: with CUDA faked, torchao would fail).
    assert "transformers.modeling_utils" in loaded(server.PRELOAD, gpu=False)


def test_a_child_forked_after_cuda_says_so(monkeypatch):
    from helpers import device, isolate

    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    sent = []

    class Conn:
        send = sent.append

        def close(self):
            pass

    isolate._child(Conn(), _divide, (1, 0), {})
    assert (
        sent[0].error.startswith(device.FORKED_AFTER_CUDA) and "ZeroDivisionError" in sent[0].error
    )
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    isolate._child(Conn(), _divide, (1, 0), {})
    assert sent[1].error.startswith("ZeroDivisionError")


def test_no_forkserver_env_spawns(monkeypatch):
    from helpers import forkserver as server

    monkeypatch.setenv(server.NO_FORKSERVER_ENV, "1")
    assert server.context().get_start_method() == "spawn"
    assert server.start() is False


def test_start_hands_the_preload_to_the_fork_server(monkeypatch):
    import multiprocessing as mp
    from multiprocessing import forkserver

    from helpers import forkserver as server

    if "forkserver" not in mp.get_all_start_methods():
        pytest.skip("no fork server on this platform")
    started = []
    monkeypatch.setattr(forkserver, "ensure_running", lambda: started.append(True))
    monkeypatch.setattr(server, "_started_with", None)  # later tests: the usual preload
    monkeypatch.setattr(forkserver._forkserver, "_preload_modules", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert server.start("peft")
    assert started == [True]
    assert forkserver._forkserver._preload_modules == [*server.PRELOAD, "peft"]
    server.context()  # a later experiment keeps what start chose
    assert forkserver._forkserver._preload_modules == [*server.PRELOAD, "peft"]


# Run in a fresh interpreter: which torch.cuda queries each module makes while it is imported.
CUDA_PROBE = """
import importlib, json, sys, torch
asked = []
for name in ("is_available", "device_count", "get_device_capability", "_lazy_init"):
    real = getattr(torch.cuda, name)
    setattr(torch.cuda, name, lambda *a, _n=name, _f=real, **k: asked.append(_n) or _f(*a, **k))
out = {}
for module in sys.argv[1:]:
    del asked[:]
    importlib.import_module(module)
    out[module] = sorted(set(asked))
print(json.dumps(out))
"""


def _cuda_questions(modules: list[str]) -> dict:
    """What each module asks torch.cuda when imported (in a fresh interpreter)."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", CUDA_PROBE, *modules], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_gpu_preload_never_asks_cuda():
    # Why preload_list leaves extras out on a GPU: a fork server that initialised CUDA hands
    # children a CUDA they cannot use; the modules it imports there never ask.
    from helpers import forkserver as server

    modules = [m for m in server.PRELOAD_CUDA if m != "torch"]
    asked = _cuda_questions(modules)
    assert all(asked[m] == [] for m in modules), asked


@pytest.mark.skipif(not importable("bitsandbytes"), reason="bitsandbytes is not installed")
def test_bitsandbytes_asks_cuda_when_imported():
    # The extra that preload_list leaves out on a GPU, and why.
    asked = _cuda_questions(["bitsandbytes"])
    assert "is_available" in asked["bitsandbytes"], asked


def test_the_private_memtracker_api_the_course_relies_on_is_still_there():
    # helpers.memory is the course's only contact with MemTracker's private methods. A torch
    # upgrade that renames or reshapes one fails here, by name, instead of somewhere deep in
    # a lesson: update CategoryTracker (and this list) to the new names.
    import inspect

    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from torch.distributed._tools.mod_tracker import ModTracker

    methods = {
        "_update_snap": ["u_type", "winfo", "old_mem_consumed", "old_reftype"],
        "_track": ["reftype", "t"],
        "_pre_fw_hook": ["module", "inputs"],
        "_track_module_params_and_buffers": ["module", "install_grad_hooks"],
        "_update_peak_stats": ["peak_state"],
        "_track_optimizer_states": ["reftype", "optimizer"],
        "_update_and_maybe_create_winfos": ["t", "reftype", "update_existing"],
        "reset_mod_stats": [],
    }
    for name, params in methods.items():
        assert hasattr(MemTracker, name), f"MemTracker.{name} is gone"
        found = list(inspect.signature(getattr(MemTracker, name)).parameters)[1:]
        assert found == params, f"MemTracker.{name}{tuple(found)}, the course expects {params}"
    tracker = MemTracker()
    for attr in ("_mod_tracker", "_curr_mem_snap", "_param_to_grad_hook_handles", "_in_opt",
                 "memory_tracking"):  # fmt: skip
        assert hasattr(tracker, attr), f"MemTracker instances have no {attr} any more"
    kinds = {"PARAM", "BUFFER", "GRAD", "OPT", "ACT", "TEMP", "OTH"}
    assert kinds <= _MemRefType.__members__.keys(), _MemRefType.__members__.keys()
    for attr in ("is_bw", "parents", "get_known_fqn"):
        assert hasattr(ModTracker(), attr), f"ModTracker has no {attr} any more"


def test_the_fsdp_tracker_internals_the_course_relies_on_are_still_there():
    """helpers.memory's FSDP2 tracker (lesson 17) overrides FSDPMemTracker's ``_track`` and
    ``_update_snap`` and maps every ``_FSDPRefType`` value to a course category."""
    import inspect

    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

    from helpers.memory import FSDP_CATEGORY

    methods = {
        "_track": ["reftype", "t"],
        "_update_snap": ["u_type", "winfo", "old_mem_consumed", "old_reftype"],
    }
    for name, params in methods.items():
        found = list(inspect.signature(getattr(FSDPMemTracker, name)).parameters)[1:]
        assert found == params, f"FSDPMemTracker.{name}{tuple(found)}, the course expects {params}"
    assert {r.value for r in _FSDPRefType} <= FSDP_CATEGORY.keys(), list(_FSDPRefType)
    assert hasattr(_FSDPRefType, "OPT") and hasattr(_FSDPRefType, "TEMP")


def test_measure_speeds_times_settings_in_turn_and_keeps_going_past_a_failure():
    """gpu-check's quiet-card timing: each setting built and timed in one process, a failing
    one reported in its own entry while the next still runs."""
    good = RunConfig(model="bert-tiny", batch_size=2, seq_len=16, warmup=1, repeats=3,
                     label="good")  # fmt: skip
    bad = RunConfig(model="bert-tiny", batch_size=2, seq_len=16, optimizer="no-such",
                    label="bad")  # fmt: skip
    again = RunConfig(**{**good.as_dict(), "label": "again", "flops": False})
    out = measure_speeds([good, bad, again])
    assert set(out) == {"good", "bad", "again"} and "no-such" in out["bad"]["error"]
    assert out["good"]["flops_per_step"] == measure(good).flops_per_step  # counted as measure does
    assert out["again"]["flops_per_step"] is None
    for label in ("good", "again"):
        times = out[label]["step_times"]
        assert len(times) == 3 and all(t > 0 for t in times)
        assert out[label]["samples_per_s"] == pytest.approx(2 / out[label]["step_time"])
        assert out[label]["mfu"] is None and out[label]["nvml_used"] is None  # a CPU has neither
