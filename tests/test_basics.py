"""Timing, MFU table, the learnable task, scale selection, hardware report and results store."""

from __future__ import annotations

import math
import time

import pytest
import torch

from helpers import results
from helpers.data import MarkovTask, markov_dataset
from helpers.hardware import hardware_report, precision_problem
from helpers.scale import FULL, TINY, get_scale
from helpers.timing import mfu, peak_tflops, time_fn
from tests.fake_gpu import PROFILES, FakeGpu


def test_time_fn_takes_the_median_after_warmup():
    calls = []

    def work():
        calls.append(1)
        time.sleep(0.02 if len(calls) > 2 else 0.2)  # two slow warm-up calls

    t = time_fn(work, torch.device("cpu"), warmup=2, repeats=5)
    assert len(calls) == 7 and len(t.times) == 5
    assert 0.019 < t.median < 0.1  # the slow warm-up calls are excluded


def test_peak_table_prefers_the_most_specific_name():
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops("Tesla T4", "bf16") is None  # T4 has no bf16 tensor cores
    assert peak_tflops("Some Future GPU", "bf16") is None
    assert mfu(989e12, 1.0, "NVIDIA H200", "bf16") == pytest.approx(1.0)
    assert mfu(1e12, 1.0, "unknown", "bf16") is None


def test_markov_entropy_rate_matches_a_long_sample():
    task = MarkovTask(n_states=32, branching=4, seed=1)
    assert 0 < task.entropy_rate < math.log(4) < task.uniform_loss
    walk = task.sample(64, 256, torch.Generator().manual_seed(0))  # (64, 256)
    prev, nxt = walk[:, :-1].reshape(-1), walk[:, 1:].reshape(-1)
    nll = -task.transition[prev, nxt].log()  # the true model's loss on each transition
    se = nll.std().item() / math.sqrt(nll.numel())
    # The true model's mean loss estimates the entropy rate; 4 standard errors of slack
    # (a false alarm about once in 16,000 seeds, and the seed is fixed).
    assert abs(nll.mean().item() - task.entropy_rate) < 4 * se


def test_markov_dataset_for_the_trainer():
    ds = markov_dataset(MarkovTask(), "classify", n=8, seq_len=16)
    assert len(ds) == 8 and tuple(ds[0]["input_ids"].shape) == (16,)
    assert {int(x) for x in ds["labels"]} <= {0, 1}


def test_scale_auto_and_override(monkeypatch):
    monkeypatch.setenv("COURSE_SCALE", "full")
    assert get_scale() is FULL
    monkeypatch.setenv("COURSE_SCALE", "auto")
    assert get_scale(device=torch.device("cpu")) is TINY
    FakeGpu(monkeypatch, [PROFILES["h100"]])  # on a GPU: the full scale, fitted to the card
    fitted = get_scale(device=torch.device("cuda"))
    assert fitted.name == "full" and "H100" in fitted.card
    assert (fitted.budget, fitted.batch_size, fitted.seq_len) == (FULL.budget, 4, 512)
    with pytest.raises(ValueError, match="unknown scale"):
        get_scale("huge")


def test_hardware_report_on_cpu_never_crashes():
    rep = hardware_report(torch.device("cpu"))
    assert rep.device == "cpu" and rep.tf32 is False
    assert rep.nvml.startswith("NVML")  # one line, whether or not a driver exists
    assert precision_problem("tf32", torch.device("cpu"))
    assert precision_problem("fp32", torch.device("cpu")) is None


def test_results_store_roundtrip(tmp_path):
    path = tmp_path / "r.jsonl"
    rec = results.Record(config={"label": "a", "model": "m"}, memory={"peak": 2**20})
    results.save(rec, lesson="99", path=path)
    results.save(results.Record(config={"label": "b"}, error="x", error_type="oom"), path=path)
    back = results.load(path)
    assert [r.label for r in back] == ["a", "b"] and back[0].lesson == "99"
    table = results.summary_table(back)
    assert list(table["status"]) == ["ok", "oom"] and table["peak MB"][0] == 1.0


def test_a_run_checks_its_setting_once_and_says_what_to_do(monkeypatch):
    # RunConfig.problem and RunConfig.model_config hold the checks the command line, the
    # estimator and Trainee share (helpers.names.setting_problem, seq_len_problem).
    import pytest

    from helpers import train
    from helpers.estimator import estimate_run
    from helpers.train import RunConfig, Trainee

    assert RunConfig().problem() is None
    assert "unknown optimizer 'lamb'" in RunConfig(optimizer="lamb").problem()
    assert "unknown attention" in RunConfig(attn="paged").problem()
    assert "must be positive" in RunConfig(batch_size=0).problem()
    assert "LoRA rank -1" in RunConfig(lora_r=-1).problem()
    assert "flash_attention_2" in RunConfig(attn="x").problem()  # a run may use it
    with pytest.raises(ValueError, match=r"use one of eager, sdpa$"):  # the estimator: not modelled
        estimate_run(RunConfig(attn="flash_attention_2"))
    too_long = RunConfig(model="bert-tiny", seq_len=100_000)
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        too_long.model_config()
    with pytest.raises(ValueError, match="exceeds max_position_embeddings"):
        estimate_run(too_long)
    with pytest.raises(ValueError, match=r"cannot read model config ./nonexistent\.json."):
        RunConfig(model="/nonexistent.json").model_config()
    # Trainee reads the config once, through model_config.
    reads = []
    real = train.load_config
    monkeypatch.setattr(train, "load_config", lambda name: reads.append(name) or real(name))
    with pytest.raises(ValueError, match="unknown optimizer"):
        Trainee(RunConfig(optimizer="lamb", device="cpu"))
    assert reads == []  # refused before anything was read or built
    Trainee(RunConfig(batch_size=1, seq_len=8, device="cpu"))
    assert reads == ["bert-tiny"]
