"""Lesson 17: lesson 07's loop on 2 processes (gloo, CPU), DDP and FSDP2, measured per process.

Two launches (DDP under torchrun, FSDP2 under ``accelerate launch``) and one single-process
run of the same loop on the global batch, shared by the tests below (about 35 s together);
then unit tests of the small pieces: where processes run (fake GPUs), the launch commands, the
per-rank estimator's arithmetic, the plot.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import isolate
from helpers.estimator import describe_model, estimate, estimate_per_rank
from helpers.estimator.parallel import fsdp_all_gathers, shard_rows, sharded, traffic
from helpers.lessons import beyond_one_gpu as lesson
from helpers.scale import FULL
from tests.fake_gpu import PROFILES, FakeGpu
from tests.plot_checks import figure_problems

CFG = lesson.ParallelConfig(model="llama-tiny", per_device_train_batch_size=2, seq_len=32, cpu=True)
B, S = CFG.per_device_train_batch_size, CFG.seq_len
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def runs():
    """One process on the global batch, DDP (torchrun) and FSDP2 (accelerate launch)."""
    single = isolate.call_isolated(
        lesson.single_run, replace(CFG, per_device_train_batch_size=2 * B)
    )
    return {
        "single": single.unwrap(),
        "ddp": lesson.launch(replace(CFG, strategy="ddp", launcher="torchrun")),
        "fsdp": lesson.launch(replace(CFG, strategy="fsdp", launcher="accelerate")),
    }


def test_every_process_reported_from_the_cpu_over_gloo(runs):
    for name in ("ddp", "fsdp"):
        result = runs[name]
        assert [r.rank for r in result.ranks] == [0, 1]
        for r in result.ranks:
            assert (r.strategy, r.backend, r.device, r.world_size) == (name, "gloo", "cpu", 2)
            assert len(r.losses) == CFG.max_steps and r.memory["peak"] > 0
    assert runs["fsdp"].rank(0).sharded_by == "this module"  # Accelerate runs FSDP on GPUs only
    assert runs["single"].world_size == 1 and runs["single"].collectives == {}


def test_ddp_replicates_parameters_gradients_and_optimizer_state(runs):
    one = runs["single"].memory
    for r in runs["ddp"].ranks:
        for key in ("params", "gradients", "optimizer_state"):
            assert r.memory[key] == one[key], (key, r.memory[key], one[key])
        # The buckets DDP adds: every gradient once more (lesson 07's loop keeps DDP's
        # default gradient_as_bucket_view=False), and nothing else registered with them.
        assert r.memory["communication_buffers"] == 4 * r.n_params
        assert r.memory["gathered_params"] == 0 and r.local_params == r.n_params


def test_fsdp_shards_all_three(runs):
    one, info = runs["single"].memory, describe_model(CFG.model)
    rows = sum(4 * math.prod(sharded(p, 2).shape) for p in info.params)
    steps = 4 * len(info.params)  # AdamW's 0-dim step counters: whole on every process
    for r in runs["fsdp"].ranks:
        assert r.memory["params"] == r.memory["gradients"] == rows
        assert r.memory["optimizer_state"] == (one["optimizer_state"] - steps) / 2 + steps
        # llama-tiny's first dimensions are all even: the shards are exact halves.
        assert r.memory["params"] == one["params"] / 2 and r.local_params == r.n_params / 2
        assert r.memory["gathered_params"] > 0  # what FSDP adds: whole layers, one at a time


def test_two_processes_train_exactly_as_one_on_the_global_batch(runs):
    # Same samples (process r gets batch r of each pair), gradients averaged over processes =
    # the global batch's mean gradient (equal samples and tokens per process). What is left is
    # fp32 rounding in sums taken in another order: ~1e-7 relative per step here.
    one = runs["single"].losses
    for name in ("ddp", "fsdp"):
        assert runs[name].losses == pytest.approx(one, rel=1e-5), (name, runs[name].losses, one)
    ranks = runs["ddp"].ranks
    assert ranks[0].losses[0] != ranks[1].losses[0]  # each process saw different data


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_per_rank_estimate_is_the_tracker(runs, strategy):
    est = estimate_per_rank(CFG.model, 2, strategy, B, S, device="cpu")
    for r in runs[strategy].ranks:
        m = r.memory
        for key in ("params", "gradients", "optimizer_state", "gathered_params"):
            assert getattr(est, key) == m[key], (key, getattr(est, key), m[key])
        # DDP's buckets exactly; FSDP2's two consecutive all-gather outputs, or one buffer
        # (at most a unit) more: gloo's worker thread can release a finished collective's
        # tensors after the next collective has started (seen once in a notebook run).
        extra = est.gathered_params if strategy == "fsdp" else 0
        assert est.communication_buffers <= m["communication_buffers"]
        assert m["communication_buffers"] <= est.communication_buffers + extra
        assert est.activations == pytest.approx(m["activations"], rel=0.10)
        # The one-process stage model's bound (tests/test_estimate.py); what the strategy adds
        # is counted exactly, or (FSDP's all-gather buffer kept through a layer) bounded above.
        assert est.peak == pytest.approx(m["peak"], rel=0.10), (est.peak, est.peak_at, m)


def test_the_collectives_are_what_the_model_says(runs):
    rows = {(x.scheme, x.what): x.payload for x in traffic(CFG.model, 2, B, S)}
    ddp, fsdp = runs["ddp"].rank(0).collectives, runs["fsdp"].rank(0).collectives
    assert ddp["allreduce_"]["bytes"] == rows["DDP", "gradients all-reduced"]
    assert ddp["broadcast_"]["bytes"] == rows["DDP", "buffers broadcast before forward"]
    again = rows["FSDP", "units gathered again for backward"]
    assert (
        fsdp["_allgather_base_"]["bytes"] == rows["FSDP", "parameters gathered for forward"] + again
    )
    assert fsdp["_reduce_scatter_base_"]["bytes"] == rows["FSDP", "gradients reduce-scattered"]
    gathers = fsdp_all_gathers(CFG.model, 2)  # the embedding, 2 layers, the head; 3 again
    assert fsdp["_allgather_base_"] == {"calls": len(gathers), "bytes": sum(gathers)}


def test_the_lessons_plot_draws_cleanly(runs):
    fig = lesson.rank_memory_bars(
        {
            "one process, batch 4": runs["single"].memory,
            "DDP, process 0 of 2, batch 2": runs["ddp"].rank(0).memory,
            "FSDP2, process 0 of 2, batch 2": runs["fsdp"].rank(0).memory,
        },
        title="Memory of one process",
    )
    assert figure_problems(fig) == []


# --------------------------------------------------------------------------------------------
# Where the processes run (the CUDA branch, on fake cards)


def test_processes_use_nccl_and_their_own_gpu_when_each_has_one(monkeypatch):
    FakeGpu(monkeypatch, [PROFILES["a100-40"], PROFILES["a100-40"]])
    for rank in (0, 1):
        p = lesson.place_rank(rank, 2)
        assert (p.backend, p.device, p.note) == ("nccl", torch.device("cuda", rank), "")
    cfg, placement = lesson.lesson_config(FULL, 2)
    assert placement.backend == "nccl" and not cfg.cpu


def test_fewer_gpus_than_processes_falls_back_to_the_cpu_and_says_so(monkeypatch):
    FakeGpu(monkeypatch, [PROFILES["t4"]])
    p = lesson.place_rank(1, 2)
    assert (p.backend, p.device) == ("gloo", torch.device("cpu"))
    assert "2 processes but 1 CUDA GPU:" in p.note
    cfg, _ = lesson.lesson_config(FULL, 2)
    assert cfg.cpu and cfg.model == "llama-tiny"  # a full-scale model would crawl on CPUs


def test_no_gpu_or_cpu_asked_means_gloo_without_a_note(monkeypatch):
    assert lesson.place_rank(0, 2) == lesson.Placement("gloo", torch.device("cpu"))
    FakeGpu(monkeypatch, [PROFILES["a100-40"], PROFILES["a100-40"]])
    assert lesson.place_rank(0, 2, cpu=True).backend == "gloo"


# --------------------------------------------------------------------------------------------
# Commands, environment, data split


def test_launch_commands_for_both_launchers():
    torchrun = lesson.launch_command(replace(CFG, strategy="ddp"), port=29555)
    assert torchrun[1:3] == ["-m", "torch.distributed.run"]
    assert "--nproc-per-node" in torchrun and "29555" in torchrun
    assert torchrun[torchrun.index("-m", 3) + 1] == "helpers.lessons.beyond_one_gpu"
    fsdp = lesson.launch_command(replace(CFG, strategy="fsdp", launcher="accelerate"), port=1)
    assert fsdp[1:3] == ["-m", "accelerate.commands.launch"]
    assert fsdp[fsdp.index("--fsdp_version") + 1] == "2" and "--use_fsdp" in fsdp
    assert "--cpu" not in fsdp[: fsdp.index("helpers.lessons.beyond_one_gpu")]  # one process
    assert "--cpu" in fsdp  # the module's own flag: gloo on the CPU
    ddp = lesson.launch_command(replace(CFG, launcher="accelerate"), port=1)
    assert "--multi_gpu" in ddp and "--use_fsdp" not in ddp
    with pytest.raises(ValueError, match="unknown launcher"):
        lesson.launch_command(replace(CFG, launcher="mpirun"))
    with pytest.raises(ValueError, match="rank_train"):
        lesson.launch(replace(CFG, strategy="single"))


def test_the_module_reads_back_its_own_command_line():
    cfg = replace(CFG, strategy="fsdp", max_steps=5, cpu=False, learning_rate=0.01)
    assert lesson.parse_args(lesson._script_args(cfg)) == cfg


def test_accelerate_launch_flags_choose_fsdp2(monkeypatch):
    assert lesson.strategy_from_env("ddp") == "ddp"
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert lesson.strategy_from_env("ddp") == "fsdp"
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match="fsdp_version 2"):
        lesson.strategy_from_env("ddp")


def test_the_launch_environment():
    env = lesson.launch_env(replace(CFG, threads=1, cpu=True))
    assert env["OMP_NUM_THREADS"] == "1" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)  # the processes import this checkout


def test_each_process_gets_accelerates_share_of_the_batches():
    from torch.utils.data import DataLoader

    loader = DataLoader(list(range(12)), batch_size=2)
    shares = [[b.tolist() for b in lesson.rank_loader(loader, r, 2)] for r in (0, 1)]
    assert shares == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10, 11]]]


def test_last_words_leave_library_notices_out():
    text = "a\nUserWarning: x\nFailed to load y.so\nRuntimeError: z"
    assert lesson._last_words(text) == "a\nRuntimeError: z"


def _count_one_all_reduce():
    """In a fresh process: a one-process gloo group, one all-reduce counted."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(lesson._free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with lesson.CollectiveCounter() as counter:
            dist.all_reduce(torch.ones(10))
            dist.barrier()
        return counter.ops, [t.numel() for t in counter.reduced]
    finally:
        dist.destroy_process_group()


def test_the_collective_counter_counts_payload_bytes():
    ops, reduced = isolate.call_isolated(_count_one_all_reduce).unwrap()
    assert ops == {"allreduce_": {"calls": 1, "bytes": 40}} and reduced == [10]


# --------------------------------------------------------------------------------------------
# The per-rank estimator's arithmetic


def test_fsdp_pads_each_tensor_to_equal_shares():
    info = describe_model("llama-tiny")
    embed = next(p for p in info.params if p.embedding)  # 1024 rows
    assert shard_rows(embed, 3) == 342 and sharded(embed, 3).shape == (342, 128)
    est3 = estimate_per_rank("llama-tiny", 3, "fsdp", 2, 32, device="cpu")
    padded = sum(4 * -(-p.shape[0] // 3) * math.prod(p.shape[1:]) for p in info.params)
    assert est3.params == padded > 4 * info.n_params / 3  # padding: 3 does not divide 1024
    one = estimate_per_rank("llama-tiny", 1, "fsdp", 2, 32, device="cpu")
    assert one.params == 4 * info.n_params  # one process: its share is everything


def test_fsdp_per_rank_state_falls_as_one_over_n_and_ddp_does_not():
    ddp = [estimate_per_rank("llama-3.2-1b", n, "ddp", 1, 512, device="cuda") for n in (2, 8)]
    fsdp = [estimate_per_rank("llama-3.2-1b", n, "fsdp", 1, 512, device="cuda") for n in (2, 8)]
    assert ddp[0].optimizer_state == ddp[1].optimizer_state
    assert fsdp[0].optimizer_state / fsdp[1].optimizer_state == pytest.approx(4, rel=0.01)
    assert fsdp[1].peak < fsdp[0].peak < ddp[0].peak


def test_ddp_per_rank_takes_the_settings_of_one_process():
    """LoRA on a bf16 base, selective checkpointing: one process's estimate plus DDP's buckets,
    which hold the trained gradients in their own dtype (the fp32 adapters only here)."""
    kw = dict(precision="bf16", weight_dtype="bf16", lora_r=4, lora_targets="all-linear",
              gradient_checkpointing=True, checkpoint_policy="selective", device="cpu")  # fmt: skip
    one = estimate("llama-tiny", 2, 32, **kw)
    ddp = estimate_per_rank("llama-tiny", 2, "ddp", 2, 32, **kw)
    info = describe_model("llama-tiny", lora_r=4, lora_targets="all-linear", weight_dtype="bf16")
    trained = sum(p.nbytes for p in info.params if p.trainable)
    assert 0 < trained < info.n_params  # the adapters only
    assert ddp.communication_buffers == trained and ddp.peak == one.peak + trained
    assert (ddp.params, ddp.gradients) == (one.params, one.gradients)


def test_fsdp_per_rank_walks_the_trace_for_what_only_the_trace_knows():
    """Offloaded activations (a CUDA step's, on the host) and a family without a stage model:
    the trace's walk, sharded. Offloading takes activations off every moment but the state
    and the gathered units stay what they are."""
    kw = dict(precision="bf16", weight_dtype="bf16", device="cuda")
    kept = estimate_per_rank("llama-tiny", 2, "fsdp", 2, 32, **kw, path="traced")
    off = estimate_per_rank("llama-tiny", 2, "fsdp", 2, 32, **kw, offload_activations=True)
    assert off.path == kept.path == "traced"
    assert (off.params, off.optimizer_state, off.gathered_params) == (
        kept.params, kept.optimizer_state, kept.gathered_params)  # fmt: skip
    assert off.activations < kept.activations and off.peak < kept.peak
    qwen = [estimate_per_rank("qwen3-tiny", n, "fsdp", 2, 32, device="cpu") for n in (1, 2)]
    assert qwen[0].path == "traced" and qwen[1].params < qwen[0].params
    assert qwen[1].peak < qwen[0].peak


def test_fsdp_per_rank_refuses_what_it_does_not_model():
    with pytest.raises(ValueError, match="does not model QLoRA"):
        estimate_per_rank("llama-tiny", 2, "fsdp", 2, 32, lora_r=4, qlora=True,
                          precision="bf16")  # fmt: skip
    with pytest.raises(ValueError, match="stochastic"):
        estimate_per_rank("llama-tiny", 2, "fsdp", 2, 32, weight_dtype="bf16", precision="bf16",
                          bf16_update="stochastic", device="cpu")  # fmt: skip


def test_the_estimator_says_what_it_does_not_model():
    with pytest.raises(ValueError, match="unknown strategy"):
        estimate_per_rank("llama-tiny", 2, "zero2", 2, 32)
    with pytest.raises(ValueError, match="adamw and sgd"):
        estimate_per_rank("llama-tiny", 2, "fsdp", 2, 32, optimizer="adamw8bit")


def test_traffic_of_the_guides_gpt2_run():
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
            "vocab_size": 50257, "n_positions": 1024}  # fmt: skip
    rows = {(x.scheme, x.what): x for x in traffic(gpt2, 2, 4, 1024)}
    grads = rows["DDP", "gradients all-reduced"]
    assert grads.payload == 4 * describe_model(gpt2).n_params  # ~124M fp32 gradients
    assert grads.moved == 2 * grads.payload  # 2 GPUs: each sends and receives it once
    dp = sum(x.moved for x in rows.values() if x.scheme == "DP")
    assert dp > grads.moved  # DP: the weights out, the gradients and the logits in


def test_a_launch_that_fails_says_why_and_leaves_no_process_behind():
    import psutil

    bad = replace(CFG, strategy="ddp", timeout=1.0, seed=424242)  # cannot even import in 1 s
    with pytest.raises(lesson.LaunchFailed, match="stopped after 1 s"):
        lesson.launch(bad)
    mine = [p for p in psutil.process_iter(["cmdline"]) if "424242" in (p.info["cmdline"] or [])]
    assert not mine, [p.info["cmdline"] for p in mine]


def test_a_timed_out_launch_stops_processes_that_left_its_session():
    # torchrun starts its workers in sessions of their own: stopping the launcher's session
    # left them running, holding the output pipes, and the launch (and make test) hung.
    import threading

    import psutil

    code = (
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
        "'import time; time.sleep(600)  # 737373'], start_new_session=True); time.sleep(600)"
    )
    done = {}

    def launch() -> None:
        done["out"] = lesson._run([sys.executable, "-c", code], dict(os.environ), 2.0)

    runner = threading.Thread(target=launch, daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive(), "the launch did not return after its timeout"
    assert done["out"][0] == -9 and "stopped after 2 s" in done["out"][1]
    time.sleep(0.5)  # SIGKILL is asynchronous
    left = [
        p for p in psutil.process_iter(["cmdline"]) if "737373" in " ".join(p.info["cmdline"] or [])
    ]
    assert not left, [p.info["cmdline"] for p in left]
