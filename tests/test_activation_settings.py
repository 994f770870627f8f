"""What a step keeps for backward as settings (RunConfig.checkpoint_policy, offload_activations;
lesson 16): measured by the tracker and estimated on fake tensors, every category to the byte
on the CPU; the CUDA estimate of offload against what it must move; every refusal."""

from __future__ import annotations

import pytest

from helpers.course import cli
from helpers.estimator import estimate, estimate_run
from helpers.names import activations_problem
from helpers.train import RunConfig, Trainee
from tests.tracked import measured

CATEGORIES = ("params", "buffers", "gradients", "optimizer_state", "activations",
              "temporaries", "weight_copies", "peak")  # fmt: skip
SELECTIVE = dict(gradient_checkpointing=True, checkpoint_policy="selective")
PURE_BF16 = dict(precision="bf16", weight_dtype="bf16")
OFFLOAD = dict(offload_activations=True)
SETTINGS = {
    "selective": SELECTIVE,
    "selective, bf16 autocast": {**SELECTIVE, "precision": "bf16"},
    "selective, pure bf16, sdpa": {**SELECTIVE, **PURE_BF16, "attn": "sdpa"},
    "selective, LoRA": {**SELECTIVE, "lora_r": 4, "lora_targets": "all-linear"},
    "offload": OFFLOAD,
    "offload, bf16 autocast": {**OFFLOAD, "precision": "bf16"},
    "offload + full checkpointing": {**OFFLOAD, "gradient_checkpointing": True},
    "offload + selective, accumulate 2": {**SELECTIVE, **OFFLOAD, "grad_accum": 2},
}
CASES = [("llama-tiny", name) for name in SETTINGS] + [
    (model, name)
    for model in ("bert-tiny", "gpt2-tiny")
    for name in ("selective", "offload", "offload + full checkpointing")
]


@pytest.mark.parametrize("model, setting", CASES)
def test_activation_settings_estimated_to_the_byte(model, setting):
    cfg = RunConfig(model=model, batch_size=2, seq_len=32, device="cpu", **SETTINGS[setting])
    got = measured(cfg)
    est = estimate_run(cfg)
    assert est.path == "traced"
    for name in CATEGORIES:
        assert getattr(est, name) == getattr(got, name), (model, setting, name)


def test_selective_keeps_more_than_full_and_less_than_none():
    """The policy changes what is kept: between full checkpointing and none (CPU, measured)."""
    base = dict(model="llama-tiny", batch_size=2, seq_len=64, device="cpu")
    none = measured(RunConfig(**base)).activations
    full = measured(RunConfig(**base, gradient_checkpointing=True)).activations
    selective = measured(RunConfig(**base, **SELECTIVE)).activations
    assert full < selective < none


def test_offload_on_cuda_moves_the_saved_activations_off_the_device():
    """The CUDA estimate of ``save_on_cpu``: what the step keeps on the device falls to about
    one layer's worth plus the tensors autograd does not save (the checkpoint's inputs, the
    loss); the same setting on the CPU moves nothing, as measured above."""
    kw = dict(batch_size=4, seq_len=256, precision="bf16", device="cuda", path="traced")
    kept = estimate("llama-400m", **kw)
    off = estimate("llama-400m", offload_activations=True, **kw)
    assert off.activations < kept.activations / 4
    assert off.params == kept.params and off.gradients == kept.gradients
    cpu = estimate("llama-tiny", 2, 32, device="cpu", offload_activations=True)
    assert cpu.activations == estimate("llama-tiny", 2, 32, device="cpu", path="traced").activations


@pytest.mark.parametrize(
    "gc, policy, words",
    [(False, "selective", "turn gradient_checkpointing on"), (True, "some", "unknown checkpoint")],
)
def test_refusals(gc, policy, words):
    assert words in activations_problem(gc, policy)
    cfg = RunConfig(model="llama-tiny", gradient_checkpointing=gc, checkpoint_policy=policy)
    assert words in cfg.problem()
    with pytest.raises(ValueError, match=words):
        estimate("llama-tiny", 2, 32, gradient_checkpointing=gc, checkpoint_policy=policy)
    with pytest.raises(ValueError, match=words):
        Trainee(cfg)


def test_the_stage_model_refuses_them_with_the_way_out():
    with pytest.raises(ValueError, match="traced path"):
        estimate("llama-tiny", 2, 32, path="analytical", offload_activations=True)
    with pytest.raises(ValueError, match="traced path"):
        estimate("llama-tiny", 2, 32, loss_chunk=16, **SELECTIVE)


def test_command_line_takes_them(capsys):
    code = cli.main(["estimate", "--model", "llama-tiny", "--batch-size", "2", "--seq-len", "32",
                     "--gradient-checkpointing", "--checkpoint-policy", "selective",
                     "--offload-activations", "--device", "cpu"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "traced" in out
    code = cli.main(["estimate", "--model", "llama-tiny", "--batch-size", "2", "--seq-len", "32",
                     "--checkpoint-policy", "selective"])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "turn gradient_checkpointing on" in err
