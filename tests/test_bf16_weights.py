"""bf16 weights with no fp32 master copy (RunConfig.weight_dtype, state_dtype, bf16_update):
measured by the tracker and estimated on fake tensors, every category to the byte (and by the
stage model, for the Llama-style decoders, to the loss's scalars); the optimizers' state rules
against the state they really hold; every refused combination."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.compat import importable
from helpers.course import cli
from helpers.device import allocation_bytes
from helpers.estimator import describe_model, estimate, estimate_run
from helpers.optimizer_state import (
    ParamShape,
    expected_state,
    read_state,
    state_tensors,
    tracked_bytes,
)
from helpers.train import RunConfig, Trainee, make_optimizer
from tests.tracked import measured

CATEGORIES = ("params", "buffers", "gradients", "optimizer_state", "activations",
              "temporaries", "weight_copies", "peak")  # fmt: skip
BF16 = dict(precision="bf16", weight_dtype="bf16")
# What needs a package: torchao's stochastic rounding is not in make test's lock (it comes with
# requirements/gpu-extras.txt), torch-optimi's Kahan summation is.
NEEDS = {"stochastic": "torchao", "kahan": "optimi"}
SETTINGS = {
    "adamw": {},
    "sgd": {"optimizer": "sgd"},
    "adafactor": {"optimizer": "adafactor"},
    "adamw8bit": {"optimizer": "adamw8bit"},
    "kahan": {"bf16_update": "kahan"},
    "stochastic": {"bf16_update": "stochastic"},
    "lora on a bf16 base": {"lora_r": 4, "lora_targets": "all-linear"},
    "checkpointing+sdpa": {"gradient_checkpointing": True, "attn": "sdpa"},
    "accumulate 2": {"grad_accum": 2},
}


def needs(setting: dict) -> None:
    module = NEEDS.get(setting.get("bf16_update", ""))
    if setting.get("optimizer") == "adamw8bit":
        module = "bitsandbytes"
    if module and not importable(module):
        pytest.skip(f"{module} is not installed")


# Every setting on the decoder; on the encoder and on a family without a stage model (GPT-2)
# the ones whose bytes differ most by architecture: the optimizers' steps, LoRA, recomputation.
CASES = [("llama-tiny", name) for name in SETTINGS] + [
    (model, name)
    for model, names in {
        "bert-tiny": ("adamw", "adafactor", "kahan", "lora on a bf16 base", "checkpointing+sdpa"),
        "gpt2-tiny": ("adamw", "lora on a bf16 base", "accumulate 2"),
    }.items()
    for name in names
]


@pytest.mark.parametrize("model, setting", CASES)
def test_bf16_weights_estimated_to_the_byte(model, setting):
    needs(SETTINGS[setting])
    cfg = RunConfig(model=model, batch_size=2, seq_len=32, device="cpu", **BF16,
                    **SETTINGS[setting])  # fmt: skip
    traced, real = estimate_run(cfg, path="traced"), measured(cfg)
    for key in CATEGORIES:
        assert getattr(traced, key) == getattr(real, key), key
    if not cfg.lora_r:  # autocast has nothing to cast; peft's fp32 adapters it does cast
        assert traced.weight_copies == 0
    # "auto": the stage model for the Llama-style decoders (full fine-tuning), which lumps the
    # loss's two fp32 scalars (8 B); the trace for the other families, for LoRA, and for
    # torchao's stochastic rounding on a CPU (its eager step's scratch: from its trace only).
    est = estimate_run(cfg)
    staged = model == "llama-tiny" and not cfg.lora_r and cfg.bf16_update != "stochastic"
    assert est.path == ("analytical" if staged else "traced")
    for key in CATEGORIES:
        assert abs(getattr(est, key) - getattr(real, key)) <= (8 if staged else 0), key


def test_bf16_weights_halve_the_model_state():
    """Per parameter: weights 2 B, gradients 2 B, AdamW state 4 B (+ one 4 B step per tensor)."""
    cfg = RunConfig(model="llama-tiny", batch_size=1, seq_len=16, device="cpu", **BF16)
    trainee = Trainee(cfg)
    trainee.step()
    n, tensors = trainee.n_params, trainee.n_tensors
    assert all(p.dtype == torch.bfloat16 for p in trainee.model.parameters())
    real = measured(cfg)
    assert (real.params, real.gradients) == (2 * n, 2 * n)
    assert real.optimizer_state == 4 * n + 4 * tensors
    mixed = measured(RunConfig(model="llama-tiny", batch_size=1, seq_len=16, device="cpu",
                               precision="bf16"))  # fmt: skip
    assert mixed.params == 2 * real.params and mixed.optimizer_state == 8 * n + 4 * tensors


KEYS = {
    "nearest": {"step", "exp_avg", "exp_avg_sq"},
    "kahan": {"exp_avg", "exp_avg_sq", "kahan_comp"},
    "stochastic": {"step", "exp_avg", "exp_avg_sq"},
}


@pytest.mark.parametrize("update", list(KEYS))
def test_state_rules_are_the_state_each_adamw_holds(update):
    needs({"bf16_update": update})
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).bfloat16()
    optimizer = make_optimizer("adamw", model, bf16_update=update)
    model(torch.randn(3, 8, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    real = sorted((r.param, r.key, r.shape, r.dtype) for r in read_state(model, optimizer))
    rules = expected_state(model, "adamw", bf16_update=update)
    assert real == sorted((r.param, r.key, r.shape, r.dtype) for r in rules)
    assert {r.key for r in rules} == KEYS[update]


def test_on_a_gpu_torchaos_step_counters_stay_on_the_host():
    """torchao makes each step with torch.tensor(0.0), on the CPU, whatever the device."""
    weight = ParamShape("w", (1000, 24), dtype=torch.bfloat16)
    rows = state_tensors([weight], "adamw", "cuda", bf16_update="stochastic")
    assert [r.key for r in rows if r.host] == ["step"]
    assert tracked_bytes(rows, "cuda") == 2 * 48128  # 48,000 B each, in 512 B blocks


@pytest.mark.parametrize("update", ["kahan", "stochastic"])
def test_a_gpu_estimate_of_the_bf16_adamws(update):
    """On CUDA the state comes from the rules (no step is traced there): Kahan's third buffer
    counts, in 512 B blocks; torchao's step counters, on the host, do not."""
    est = {u: estimate("llama-tiny", 2, 32, "bf16", device="cuda", weight_dtype="bf16",
                       bf16_update=u) for u in ("nearest", update)}  # fmt: skip
    third = sum(allocation_bytes(p.nbytes, "cuda")
                for p in describe_model("llama-tiny", weight_dtype="bf16").params)  # fmt: skip
    extra = est[update].optimizer_state - est["nearest"].optimizer_state
    assert extra == (third if update == "kahan" else 0)


REFUSED = {
    "fp16 weights, trained": (dict(precision="fp16", weight_dtype="fp16"), "frozen LoRA base"),
    "an fp16 base in bf16 compute": (
        dict(precision="bf16", weight_dtype="fp16", lora_r=4),
        "use precision fp16",
    ),
    "bf16 weights in fp32 compute": (dict(weight_dtype="bf16"), "use precision bf16"),
    "bf16 weights under fp16 autocast": (dict(precision="fp16", weight_dtype="bf16"), "bf16"),
    "a state dtype for 8-bit AdamW": (
        dict(optimizer="adamw8bit", state_dtype="bf16"),
        "bitsandbytes",
    ),
    "bf16 state over fp32 weights": (dict(state_dtype="bf16"), "leave state_dtype unset"),
    "fp32 state over bf16 weights": (dict(**BF16, state_dtype="fp32"), "(bf16 here)"),
    "an unknown state dtype": (dict(state_dtype="fp8"), "unknown state_dtype"),
    "stochastic rounding of fp32 weights": (dict(bf16_update="stochastic"), "weight_dtype bf16"),
    "Kahan for LoRA adapters": (dict(**BF16, bf16_update="kahan", lora_r=4), "full fine-tuning"),
    "Kahan with SGD": (dict(**BF16, bf16_update="kahan", optimizer="sgd"), "use optimizer adamw"),
    "an unknown update": (dict(**BF16, bf16_update="round"), "unknown bf16_update"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_contradictory_weight_settings_are_refused_in_one_line(case, capsys):
    setting, words = REFUSED[case]
    cfg = RunConfig(model="llama-tiny", batch_size=1, seq_len=16, device="cpu", **setting)
    problem = cfg.problem()
    assert problem and words in problem and "\n" not in problem
    with pytest.raises(ValueError) as err:
        Trainee(cfg)
    assert str(err.value) == problem
    with pytest.raises(ValueError) as err:
        estimate_run(cfg)
    assert str(err.value) == problem
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in setting.items() if k != "lora_r"]
    flags += [f"--lora-r={setting['lora_r']}"] if "lora_r" in setting else []
    argv = ["estimate", "--model", "llama-tiny", "--batch-size", "1", "--seq-len", "16", *flags]
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    assert capsys.readouterr().err.strip() == f"error: {problem}"


def test_an_optional_package_missing_is_one_line(monkeypatch, capsys):
    """Without torch-optimi (or torchao) the run says what to install, and the CLI exits 2."""
    import builtins

    real_import = builtins.__import__

    def no_optimi(name, *args, **kwargs):
        if name == "optimi":
            raise ImportError("No module named 'optimi'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_optimi)
    argv = ["measure", "--model", "llama-tiny", "--batch-size", "1", "--seq-len", "16",
            "--precision", "bf16", "--weight-dtype", "bf16", "--bf16-update", "kahan",
            "--device", "cpu", "--no-flops"]  # fmt: skip
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    assert "pip install torch-optimi" in capsys.readouterr().err


def test_an_fp16_lora_base_is_estimated_to_the_byte():
    """A T4's LoRA: the frozen base in fp16, fp32 adapters, fp16 autocast with loss scaling."""
    cfg = RunConfig(model="llama-tiny", batch_size=2, seq_len=32, device="cpu", precision="fp16",
                    weight_dtype="fp16", lora_r=4, lora_targets="all-linear")  # fmt: skip
    est, real = estimate_run(cfg), measured(cfg)
    for key in CATEGORIES[:-1]:
        assert getattr(est, key) == getattr(real, key), key
    # fp16's GradScaler keeps 0-d fp32 and int32 tensors (its scale and growth tracker) that
    # the trace, which runs no scaler, does not hold: at most those 8 bytes at the peak.
    assert 0 <= real.peak - est.peak <= 8, (est.peak, real.peak)
    base = [p for p in Trainee(cfg).model.parameters() if not p.requires_grad]
    assert base and all(p.dtype == torch.float16 for p in base)


def quant_state_bytes(model) -> int:
    """Bytes of bitsandbytes' per-weight quantisation state (absmax, code books, the nested
    scales), each storage once: tensors it keeps beside the 4-bit parameters, not as them."""
    import bitsandbytes as bnb

    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            qs = module.weight.quant_state
            parts = [qs.absmax, qs.code] + ([qs.offset, *qs.state2.as_dict().values()]
                                            if qs.nested else [])  # fmt: skip
            for t in (p for p in parts if isinstance(p, torch.Tensor)):
                if t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
    return total


@pytest.mark.skipif(not importable("bitsandbytes"), reason="bitsandbytes is not installed")
def test_qlora_is_a_run_setting_measured_against_its_estimate(capsys):
    """RunConfig(qlora=True): NF4 Linear layers (bitsandbytes, here on the CPU), LoRA on top.
    What autograd and the optimizer hold is the traced bf16 step's, to the byte; the weights
    differ by bitsandbytes' quantisation state, which it keeps outside the parameters (the
    tracker's view) and the estimate counts; the estimate's peak adds one dequantised bf16
    weight, which CUDA's 4-bit matmul makes and the CPU kernel does not."""
    cfg = RunConfig(model="llama-tiny", batch_size=2, seq_len=32, device="cpu", precision="bf16",
                    lora_r=4, lora_targets="all-linear", qlora=True, attn="sdpa")  # fmt: skip
    est, real = estimate_run(cfg), measured(cfg)
    for key in ("gradients", "optimizer_state", "activations", "temporaries", "buffers"):
        assert getattr(est, key) == getattr(real, key), key
    assert est.params - real.params == quant_state_bytes(Trainee(cfg).model)
    dequantized = est.weight_copies - real.weight_copies
    assert dequantized == 2 * 352 * 128  # the largest 4-bit weight (gate/up/down), in bf16
    assert est.peak - real.peak == (est.params - real.params) + dequantized
    argv = ["estimate", "--model", "llama-tiny", "--batch-size", "2", "--seq-len", "32",
            "--precision", "bf16", "--lora-r", "4", "--lora-targets", "all-linear", "--qlora",
            "--device", "cpu", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["peak"] == est.peak


@pytest.mark.parametrize(
    "setting, words",
    [
        (dict(qlora=True, precision="bf16"), "lora_r > 0"),
        (dict(qlora=True, lora_r=4), "16-bit compute"),
        (dict(qlora=True, lora_r=4, precision="bf16", weight_dtype="bf16"), "leave weight_dtype"),
    ],
)
def test_contradictory_qlora_settings_are_refused(setting, words):
    cfg = RunConfig(model="llama-tiny", batch_size=1, seq_len=16, device="cpu", **setting)
    assert words in (cfg.problem() or "")
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        Trainee(cfg)
