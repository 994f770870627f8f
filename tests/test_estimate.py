"""The estimator against the tracker: model state exact, activations and peak within 10 %."""

from __future__ import annotations

import dataclasses
import json
import resource
import time

import pytest

from helpers.estimator import describe_model, estimate, estimate_run, training_state
from helpers.train import RunConfig, measure

# Tiny configs of architectures the course does not train, built from transformers' own
# config classes: a tied-embedding decoder with q/k/v biases (Qwen2) and a sparse MoE
# (Mixtral, 4 experts, top-2, grouped-query attention).
TINY = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def tiny_configs() -> dict[str, dict]:
    from transformers import MixtralConfig, Qwen2Config

    qwen2 = Qwen2Config(**TINY, tie_word_embeddings=True)
    mixtral = MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2)
    return {"qwen2": qwen2.to_dict(), "mixtral": mixtral.to_dict()}


# family -> model; settings vary batch, sequence, precision, attention, checkpointing, optimizer.
FAMILIES = ["bert-tiny", "llama-tiny", "qwen2", "mixtral"]
SETTINGS = {
    "fp32-eager-b4s64": dict(batch_size=4, seq_len=64),
    "bf16-sdpa-b2s128": dict(batch_size=2, seq_len=128, precision="bf16", attn="sdpa"),
    "fp32-checkpointing-sgd": dict(
        batch_size=4, seq_len=64, gradient_checkpointing=True, optimizer="sgd"
    ),
    "fp16-checkpointing-adafactor-b1s32": dict(
        batch_size=1,
        seq_len=32,
        precision="fp16",
        gradient_checkpointing=True,
        optimizer="adafactor",
    ),
}
EXACT = ("params", "gradients", "optimizer_state")
# The target of the estimator: within 10 % of the measured peak. The activations get the same
# bound: they are what the formulas predict, and the peak is only as good as they are.
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("configs")
    out = {"bert-tiny": "bert-tiny", "llama-tiny": "llama-tiny"}
    for name, data in tiny_configs().items():
        path = folder / f"{name}-tiny.json"
        path.write_text(json.dumps(data))
        out[name] = str(path)
    return out


@pytest.fixture(scope="module")
def measured(models):
    """Every (family, setting) measured once, in this process (memory is deterministic)."""
    return {
        (fam, name): measure(
            RunConfig(model=models[fam], repeats=1, warmup=1, flops=False, **setting)
        )
        for fam in FAMILIES
        for name, setting in SETTINGS.items()
    }


def rel(estimated: int, measured: int) -> float:
    return abs(estimated - measured) / measured


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_estimate_matches_measurement(models, measured, family, setting):
    rec = measured[family, setting]
    assert rec.ok, rec.error
    est = estimate(models[family], device="cpu", **SETTINGS[setting])
    mem = rec.memory
    assert est.n_params == rec.n_params
    for key in EXACT:  # counted from the tensors' shapes: no reason for any difference
        assert getattr(est, key) == mem[key], key
    assert est.weight_copies == mem["weight_copies"]  # 2 B per matmul weight under autocast
    assert rel(est.activations, mem["activations"]) < TOLERANCE, (est.activations, mem)
    assert rel(est.peak, mem["peak"]) < TOLERANCE, (est.peak, est.peak_at, mem)


def test_peak_falls_where_the_tracker_sees_it(models, measured):
    # The gradients alive at the measured peak tell where in the step it happened: none before
    # the first parameter gradient of backward, all of them in the optimizer step.
    kinds = set()
    for (family, setting), rec in measured.items():
        est = estimate(models[family], device="cpu", **SETTINGS[setting])
        at, grads = rec.memory["peak_at"]["gradients"], rec.memory["gradients"]
        if est.peak_at == "optimizer step":
            assert at == grads, (family, setting)
        elif est.peak_at.startswith("forward") or est.peak_at == "backward: loss":
            assert at == 0, (family, setting, est.peak_at)
        else:  # inside backward, after some layers' gradients
            assert 0 < at < grads, (family, setting, est.peak_at)
        kinds.add(est.peak_at.split(":")[0])
    assert kinds == {"forward", "backward", "optimizer step"}  # the settings reach all three


@pytest.mark.parametrize("family", ["bert-tiny", "llama-tiny"])
def test_8bit_adamw_state_is_exact(models, family):
    bnb = pytest.importorskip("bitsandbytes")
    # make_optimizer's embedding overrides live in bitsandbytes' process-wide manager, keyed by
    # parameter position: a previous 8-bit optimizer in this process would leak into this one.
    bnb.optim.GlobalOptimManager.get_instance().initialize()
    cfg = RunConfig(model=models[family], optimizer="adamw8bit", repeats=1, flops=False)
    rec = measure(cfg)
    est = estimate_run(cfg)
    assert est.optimizer_state == rec.memory["optimizer_state"]
    assert rel(est.peak, rec.memory["peak"]) < TOLERANCE


def test_muon_state_is_exact(models):
    # Muon's step scratch is checked alone in tests/test_optimizers.py (to the byte, fp32), and
    # its split on an encoder with peft's head there too; here a decoder's bf16 weights: Muon's
    # state and the AdamW half's exact, the peak (in the optimizer step) within 10 %.
    # (Lion's state: tests/test_optimizers.py and tests/test_cuda_accounting.py.)
    cfg = RunConfig(model=models["llama-tiny"], optimizer="muon", batch_size=2, seq_len=32,
                    repeats=1, flops=False, precision="bf16", weight_dtype="bf16")  # fmt: skip
    rec, est = measure(cfg), estimate_run(cfg)
    assert rec.ok, rec.error
    for key in EXACT:
        assert getattr(est, key) == rec.memory[key], key
    assert rel(est.peak, rec.memory["peak"]) < TOLERANCE, (est.peak, rec.memory["peak"])
    assert est.peak_at == "optimizer step"


def test_dora_is_estimated_exactly_and_measured_the_same_twice(models):
    # DoRA drops a graph in every forward, which the tracker's hooks would keep until Python's
    # collector runs: measure and the trace collect after each DoRA layer, so a step measures
    # the same every time (without it: 3.7 to 5.0 MB of activations here) and the trace with it.
    cfg = RunConfig(model=models["llama-tiny"], lora_r=4, lora_targets="all-linear", dora=True,
                    batch_size=2, seq_len=32, repeats=1, flops=False)  # fmt: skip
    first, second = measure(cfg), measure(cfg)
    assert first.ok, first.error
    assert first.memory == second.memory
    est = estimate_run(cfg)
    for key in (*EXACT, "activations", "peak"):
        assert getattr(est, key) == first.memory[key], key
    plain = estimate_run(dataclasses.replace(cfg, dora=False))
    out_features = sum(
        p.shape[0] for p in describe_model(cfg.model).params if p.cast and "layers" in p.name
    )
    assert est.params - plain.params == 4 * out_features  # one fp32 magnitude per output row


@pytest.mark.parametrize(
    "kwargs, words",
    [(dict(dora=True), "lora_r > 0"),
     (dict(dora=True, lora_r=4, qlora=True, precision="bf16"), "4-bit"),
     (dict(dora=True, lora_r=4, path="analytical"), "traced path")],
)  # fmt: skip
def test_dora_settings_it_does_not_model_are_refused_in_one_line(kwargs, words):
    with pytest.raises(ValueError, match=words) as err:
        estimate("llama-tiny", 2, 32, device="cpu", **kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", ["llama-tiny", "bert-tiny"])
def test_accumulation_keeps_every_gradient_through_the_step(models, family):
    # Several micro-batches in one tracked step: torch's MemTracker refuses a second forward
    # of the root module, and CategoryTracker resets its per-module statistics instead.
    from helpers.memory import CategoryTracker
    from helpers.train import Trainee

    cfg = RunConfig(model=models[family], batch_size=2, grad_accum=2, repeats=1)
    trainee = Trainee(cfg)
    trainee.step()
    tracker = CategoryTracker()
    tracker.track_external(trainee.model, trainee.optimizer)
    with tracker:
        trainee.step()
    peaks = tracker.peaks()
    est = estimate_run(cfg)
    assert rel(est.peak, peaks.peak) < TOLERANCE
    # Every gradient, plus a later micro-batch's new gradient of the largest parameter until
    # it is added in (the embedding's; measured on an H200 too: tests/test_gpu_report.py).
    assert est.gradients == peaks.gradients
    # The second micro-batch runs with all gradients alive: the peak grows by at most them.
    single = estimate(models[family], 2, 64, device="cpu")
    assert single.peak < est.peak <= single.peak + est.gradients


def test_7b_config_is_estimated_without_weights():
    # 6.7 B fp32 parameters would need 27 GB: if the weights were built, this would not finish.
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.perf_counter()
    est = estimate(
        "llama-7b",
        1,
        2048,
        precision="bf16",
        attn="sdpa",
        gradient_checkpointing=True,
        device="cuda",
    )
    assert time.perf_counter() - start < 60
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 2**20  # less than 1 GiB more resident memory (KiB units)
    assert est.n_params == 6_738_415_616  # LLaMA-7B's published count
    info = describe_model("llama-7b")
    n_tensors = len(info.params)
    # On CUDA every tensor is rounded up to 512 B (here all are multiples of it already), and
    # AdamW's step counters stay on the CPU: its state is exactly two copies of the weights.
    assert est.params == est.gradients == 4 * est.n_params
    assert est.optimizer_state == 2 * est.params
    cpu = estimate("llama-7b", 1, 2048, precision="bf16", attn="sdpa", device="cpu")
    assert cpu.optimizer_state == 8 * est.n_params + 4 * n_tensors  # + a step per tensor
    assert est.weight_copies == 2 * sum(p.numel for p in info.params if p.cast)


def test_training_state_arithmetic_reproduces_the_seed():
    # The seed: 12 B per trainable parameter (fp32 master copy + two moments) for 7B -> 84 GB,
    # and for 0.2B of LoRA adapters -> 2.4 GB.
    full = training_state(7_000_000_000, optimizer="adamw", weight_bytes=2, master_copy=True)
    lora = training_state(7_200_000_000, 200_000_000, "adamw", weight_bytes=2, master_copy=True)
    assert full.optimizer_state == 84_000_000_000
    assert lora.optimizer_state == 2_400_000_000
    plain = training_state(1000, optimizer="adamw")  # the course's fp32 rule: 16 B/param
    assert plain.total == 16 * 1000
    assert training_state(1000, optimizer="sgd").optimizer_state == 4000
    with pytest.raises(ValueError, match="shapes"):
        training_state(1000, optimizer="adafactor")


def test_activations_follow_batch_sequence_and_checkpointing():
    base = estimate("llama-tiny", 4, 128, device="cpu")
    assert estimate("llama-tiny", 8, 128, device="cpu").activations == pytest.approx(
        2 * base.activations, rel=0.05
    )  # everything scales with the batch, except a few per-sequence tensors (RoPE tables)
    longer = estimate("llama-tiny", 4, 256, device="cpu")
    assert longer.activations > 2 * base.activations  # the a·s² attention scores
    flash = estimate("llama-tiny", 4, 256, attn="sdpa", device="cpu")
    assert flash.activations < longer.activations
    ckpt = estimate("llama-tiny", 4, 128, gradient_checkpointing=True, device="cpu")
    assert ckpt.activations < base.activations
    # One layer's saved tensors, labelled, and the paper's count for comparison.
    assert sum(base.layer_activations.values()) > 0 and base.paper_layer_bytes > 0


def test_estimate_works_for_a_device_that_is_not_here():
    # CUDA behaviour (1-byte dropout masks, fused SDPA) from a laptop: arithmetic only.
    gpu = estimate("bert-large", 4, 512, precision="fp16", attn="sdpa", device="cuda")
    cpu = estimate("bert-large", 4, 512, precision="fp16", attn="sdpa", device="cpu")
    assert gpu.activations < cpu.activations
    # The same weights, each rounded up to 512 B on CUDA: only the classifier's 8-byte bias is
    # not already a multiple (4 n + 504, as the tracker counts it on a GPU).
    assert gpu.params == cpu.params + 504


def test_an_architecture_without_a_stage_model_is_traced():
    gpt2 = {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2}
    assert estimate(gpt2, 1, 8).path == "traced"  # tests/test_traced.py checks the numbers
    with pytest.raises(ValueError, match="no analytical model for model_type 'gpt2'"):
        estimate(gpt2, 1, 8, path="analytical")


def test_cli_estimate_json_is_the_estimate(capsys):
    from helpers.course.cli import main

    argv = "estimate --model bert-tiny --batch-size 2 --seq-len 32 --device cpu --json".split()
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    est = estimate("bert-tiny", 2, 32, device="cpu", attn="sdpa")  # the command line's default
    assert data["attn"] == "sdpa"
    for key in ("n_params", "params", "gradients", "optimizer_state", "activations", "peak"):
        assert isinstance(data[key], int) and data[key] == getattr(est, key)


@pytest.mark.parametrize(
    "args",
    [
        ["--optimizer", "lamb"],
        ["--precision", "fp8"],
        ["--model", "/nonexistent/config.json"],
        ["--seq-len", "100000"],
        ["--batch-size", "0"],
        ["--bogus"],
    ],
)
def test_cli_estimate_bad_input_is_one_line_and_exit_2(args, cli_refuses):

    base = {"--model": "bert-tiny", "--batch-size": "2", "--seq-len": "32"}
    extra = []
    for flag, value in zip(args[::2], args[1::2], strict=False):
        base[flag] = value
    if len(args) % 2:
        extra = args[-1:]
    argv = ["estimate", "--json"] + [x for kv in base.items() for x in kv] + extra
    cli_refuses(argv)


def _attributes_read(function, name: str) -> set[str]:
    """The attributes of ``name`` that ``function``'s source reads (``cfg.batch_size``...)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == name
    }


def test_estimate_run_reads_every_runconfig_field_that_sets_the_bytes():
    # A field added to (or renamed in) RunConfig must be read by estimate_run, or be listed
    # in NOT_ESTIMATED: nothing falls back to estimate's default by a name that no longer
    # matches.
    from dataclasses import fields

    from helpers.estimator.api import NOT_ESTIMATED

    names = {f.name for f in fields(RunConfig)}
    read = _attributes_read(estimate_run, "cfg")
    assert not read & set(NOT_ESTIMATED), read & set(NOT_ESTIMATED)
    assert read | set(NOT_ESTIMATED) == names, {
        "read by estimate_run, not a RunConfig field": sorted(read - names),
        "neither read nor in NOT_ESTIMATED": sorted(names - read - set(NOT_ESTIMATED)),
        "in NOT_ESTIMATED, not a RunConfig field": sorted(set(NOT_ESTIMATED) - names),
    }
