"""LoRA: hand count = peft count; measured and estimated state follow the adapters."""

from __future__ import annotations

import pytest
import torch

from helpers.estimator import describe_model, estimate_run, training_state
from helpers.estimator.qlora import NF4_CODE
from helpers.lessons.peft_lora import four_bit_weight_bytes, meta_model, step_memory, target_names
from helpers.memory import CategoryTracker
from helpers.models import apply_lora, build_model, load_config
from helpers.train import RunConfig, Trainee, measure
from tests.cells import cell_function

NOTEBOOK = "13_peft_lora.ipynb"
# The lesson's hand count, as its cells write it
adapter_params = cell_function(NOTEBOOK, "adapter_params", target_names=target_names)
rank_for = cell_function(NOTEBOOK, "rank_for", adapter_params=adapter_params)
trainable_counts = cell_function(NOTEBOOK, "trainable_counts")


@pytest.mark.parametrize("targets", ["", "all-linear", "q_proj,k_proj,v_proj,o_proj"])
def test_hand_count_is_peft_count_and_the_start_is_the_base(targets):
    model = build_model(load_config("llama-tiny"))
    ids = torch.randint(0, 1024, (2, 16))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    hand = adapter_params(model, 4, targets)
    n_base = sum(p.numel() for p in model.parameters())
    peft_model = apply_lora(model, 4, targets)
    trainable, total, _ = trainable_counts(peft_model)
    assert peft_model.get_nb_trainable_parameters() == (trainable, total)
    assert trainable == hand and total == n_base + hand
    with torch.no_grad():  # B = 0: the adapted model computes exactly what the base did
        assert torch.equal(peft_model(input_ids=ids).logits, before)


def test_classifier_head_stays_trainable_for_encoders():
    model = build_model(load_config("bert-tiny"))
    hand = adapter_params(model, 4)  # peft's default for BERT: query and value
    head = sum(p.numel() for p in model.classifier.parameters())
    peft_model = apply_lora(model, 4)
    # A new task's head is random: peft trains a copy of it next to the adapters.
    assert trainable_counts(peft_model)[0] == hand + head


def test_seven_billion_arithmetic_from_the_config():
    net = meta_model("llama-7b")
    assert adapter_params(net, 1, "all-linear") == 32 * (4 * 8192 + 3 * (4096 + 11008))
    r = rank_for(net, 200e6, "all-linear")
    assert r == 80
    info = describe_model("llama-7b", lora_r=r, lora_targets="all-linear")
    assert info.n_trainable == adapter_params(net, r, "all-linear")
    base = info.n_params - info.n_trainable
    full = training_state(base, weight_bytes=2, master_copy=True)
    lora = training_state(info.n_params, info.n_trainable, weight_bytes=2, master_copy=True)
    assert full.optimizer_state == 12 * base  # the seed's 12 B per trainable parameter
    assert lora.optimizer_state == 12 * info.n_trainable  # about 2.4 GB
    assert 2.35e9 < lora.optimizer_state < 2.45e9


def test_four_bit_llama_7b_keeps_embeddings_and_output_layer_16_bit():
    # load_in_4bit quantises the layers' Linear weights; the embeddings (not a Linear) and the
    # output layer (transformers' get_keys_to_not_convert) stay 16-bit: lesson 13, section 6.
    net = meta_model("llama-7b")
    linear = 32 * (4 * 4096**2 + 3 * 4096 * 11008)  # 224 weights, each a multiple of 64
    rest = sum(p.numel() for p in net.parameters()) - linear
    assert rest == 2 * 32000 * 4096 + (2 * 32 + 1) * 4096  # embeddings, output layer, norms
    fp32_scales = four_bit_weight_bytes(net, double_quant=False)
    # 0.5 B of codes + 4 B of scale per 64 weights, and a 16-value code book per weight
    assert fp32_scales == 0.5625 * linear + 224 * NF4_CODE + 2 * rest
    assert round(fp32_scales / 1e9, 1) == 4.2  # not 0.5625 B x every parameter (3.8 GB)
    assert round(four_bit_weight_bytes(net) / 1e9, 1) == 3.9  # double quantisation
    fp32_rest = four_bit_weight_bytes(net, double_quant=False, other_bytes=4)
    assert fp32_rest - fp32_scales == 2 * rest  # prepare_model_for_kbit_training's fp32 cast


@pytest.mark.parametrize(
    "model, precision", [("llama-tiny", "fp32"), ("bert-tiny", "fp32"), ("llama-tiny", "bf16")]
)
def test_measured_state_follows_the_adapters_and_the_estimate_bounds_it(model, precision):
    cfg = RunConfig(model=model, precision=precision, lora_r=4, repeats=1, flops=False)
    rec = measure(cfg)
    assert rec.ok, rec.error
    trainee = Trainee(cfg)
    trainable, total, tensors = trainable_counts(trainee.model)
    mem = rec.memory
    assert rec.n_params == total
    assert mem["params"] == 4 * total  # frozen fp32 weights and adapters
    assert mem["gradients"] == 4 * trainable  # only adapters get gradients
    assert mem["optimizer_state"] == 8 * trainable + 4 * tensors  # AdamW: 2 moments + step
    est = estimate_run(cfg)
    for key in ("params", "gradients", "optimizer_state"):
        assert getattr(est, key) == mem[key], key
    # Frozen Linear layers keep less than full fine-tuning's account: an upper bound.
    assert est.activations >= mem["activations"]
    assert est.peak >= mem["peak"]


def test_lora_with_checkpointing_trains():
    trainee = Trainee(RunConfig(model="llama-tiny", lora_r=2, gradient_checkpointing=True))
    weights = {n: p.detach().clone() for n, p in trainee.model.named_parameters()}
    trainee.step()
    trainee.step()  # B moves away from zero on the first step, A on the second
    changed = {n for n, p in trainee.model.named_parameters() if not torch.equal(p, weights[n])}
    assert changed and all(".lora_" in n for n in changed)
    assert len(changed) == sum(p.requires_grad for p in trainee.model.parameters())


def test_step_memory_is_measure_for_lora():
    # Lesson 13's step_memory (for variants RunConfig lacks) counts a LoRA step as measure does.
    cfg = RunConfig(
        model="llama-tiny", lora_r=4, lora_targets="q_proj,v_proj", repeats=1, flops=False,
        batch_size=2, seq_len=32,
    )  # fmt: skip
    rec = measure(cfg)
    trainee = Trainee(cfg)
    got = step_memory(trainee.model, trainee.batch())
    for key in ("params", "gradients", "optimizer_state", "activations", "temporaries", "peak"):
        assert got[key] == rec.memory[key], key


def test_dora_adds_a_magnitude_per_output_row_and_two_saved_outputs_per_layer():
    from peft import LoraConfig, get_peft_model

    config = load_config("llama-tiny")
    ids = torch.randint(0, config.vocab_size, (2, 32))
    batch = {"input_ids": ids, "labels": ids}
    counts, mem = {}, {}
    for dora in (False, True):
        lora = LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
            use_dora=dora,
        )  # fmt: skip
        model = get_peft_model(build_model(config), lora)
        counts[dora] = trainable_counts(model)
        mem[dora] = step_memory(model, batch)
    # The same step again: DoRA's dropped weight-norm graphs must not linger in the count.
    assert step_memory(model, batch)["activations"] == mem[True]["activations"]
    layers = target_names(meta_model(config), "q_proj,v_proj")
    out = sum(meta_model(config).get_submodule(n).out_features for n in layers)
    assert counts[True][0] - counts[False][0] == out  # one magnitude per output row
    assert counts[True][2] - counts[False][2] == len(layers)  # one vector per adapted layer
    extra = {k: mem[True][k] - mem[False][k] for k in mem[True] if k != "peak_at"}
    assert extra["params"] == extra["gradients"] == 4 * out
    assert extra["optimizer_state"] == 8 * out + 4 * len(layers)  # 2 moments + a step each
    # The magnitude's gradient needs the base and the adapter output: 2 x T x out floats.
    saved = 2 * 4 * ids.numel() * out
    assert saved <= extra["activations"] < 1.05 * saved


def test_tracker_counts_frozen_weights_without_hooking_them():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    model[0].requires_grad_(False)
    tracker = CategoryTracker()
    with tracker:
        model(torch.randn(4, 8)).sum().backward()
    peaks = tracker.peaks()
    assert peaks.params == 4 * (72 + 18)
    assert peaks.gradients == 4 * 18


def test_cli_estimate_takes_lora_arguments(capsys):
    import json

    from helpers.course import cli

    args = ["estimate", "--model", "llama-tiny", "--batch-size", "1", "--seq-len", "16", "--json"]
    assert cli.main(args) == 0
    full = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert cli.main([*args, "--lora-r", "4", "--lora-targets", "q_proj,v_proj"]) == 0
    lora = json.loads(capsys.readouterr().out.splitlines()[-1])
    adapters = lora["n_params"] - full["n_params"]
    assert adapters > 0
    assert lora["gradients"] == 4 * adapters  # only the adapters are trained
    assert cli.main([*args, "--lora-r", "-1"]) == 2


@pytest.mark.parametrize(
    "trainable",
    [[3584, 74752, 634_000], [1_600_000, 31_000_000, 400_000_000]],
    ids=["tiny", "full"],  # lesson 13's three runs: LoRA q,v r=4, all-linear r=16, full
)
def test_proportion_figure_is_readable(trainable):
    from plot_checks import figure_problems

    from helpers.lessons.peft_lora import proportion_figure

    fig = proportion_figure(
        trainable,
        {
            "optimizer state (measured)": [8 * n + 32 for n in trainable],
            "gradients (measured)": [4 * n for n in trainable],
        },
        {"8 B x trainable": 8, "4 B x trainable": 4},
        "trainable parameters",
        "bytes",
        title="Gradients and optimizer state follow the trainable parameters",
    )
    assert figure_problems(fig) == []


@pytest.mark.parametrize(("targets", "names"), [
    ("q_proj,v_proj", ["q_proj", "v_proj"]),
    ("all-linear", "all-linear"),
])  # fmt: skip
def test_run_config_lora_is_the_lessons_add_lora(targets, names):
    """RunConfig(lora_r=...) (helpers.models.apply_lora) adapts a model exactly as lesson 13's
    add_lora cell does: the same LoraConfig, the same trainable tensors, equal from one seed."""
    from peft import LoraConfig, get_peft_model

    add_lora = cell_function(
        NOTEBOOK, "add_lora", LoraConfig=LoraConfig, get_peft_model=get_peft_model
    )
    config = load_config("llama-tiny")
    torch.manual_seed(1)  # peft draws A at random: the same seed for both
    cell = add_lora(build_model(config), 8, names)
    torch.manual_seed(1)
    ours = apply_lora(build_model(config), 8, targets)
    a, b = cell.peft_config["default"], ours.peft_config["default"]
    for field in ("r", "lora_alpha", "lora_dropout", "target_modules", "task_type", "bias"):
        assert getattr(a, field) == getattr(b, field), field
    shapes = {n: p.shape for n, p in cell.named_parameters() if p.requires_grad}
    assert shapes == {n: p.shape for n, p in ours.named_parameters() if p.requires_grad}
    for (n, p), (_, q) in zip(cell.named_parameters(), ours.named_parameters(), strict=True):
        assert torch.equal(p, q), n
