"""Lesson 16's own machinery (helpers.lessons.more_memory): sections 2, 4 and 5."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers.compat import is_checkpointing
from helpers.lessons.more_memory import (
    CHECKPOINTING,
    FP8_CAPABILITY,
    LinearLayer,
    PackingConfig,
    batch_picture,
    checkpointing_figure,
    checkpointing_memory,
    fp8_account,
    fp8_figure,
    fp8_filter,
    fp8_layers,
    fp8_problem,
    fp8_run,
    gradient_check,
    offload_moves,
    packed_batch,
    packed_bytes,
    packing_check,
    packing_memory,
    padded_batch,
    predicted_tokens,
    sample_lengths,
    save_matmuls,
    selective_context_fn,
    set_checkpointing,
)
from helpers.train import RunConfig, Trainee
from tests.fake_gpu import PROFILES, FakeGpu
from tests.plot_checks import figure_problems

# Small enough for a few seconds per test on 2 cores, large enough for every effect.
BASE = RunConfig(model="llama-tiny", batch_size=2, seq_len=32, attn="sdpa", repeats=1, flops=False)
aten = torch.ops.aten


# -- section 2 ---------------------------------------------------------------------------------


def test_the_policy_keeps_matmuls_and_attention_and_recomputes_the_rest():
    from torch.utils.checkpoint import CheckpointPolicy

    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default,
               aten._scaled_dot_product_efficient_attention.default):  # fmt: skip
        assert save_matmuls(None, op) is CheckpointPolicy.MUST_SAVE, op
    for op in (aten.mul.Tensor, aten.add.Tensor, aten.silu.default, aten.rsqrt.default):
        assert save_matmuls(None, op) is CheckpointPolicy.PREFER_RECOMPUTE, op


def test_selective_context_gives_the_two_contexts_checkpoint_needs():
    forward, recompute = selective_context_fn()()
    with forward:
        pass
    with recompute:
        pass


def test_transformers_passes_the_context_fn_to_checkpoint():
    # The policy must actually run: count its calls during a checkpointed forward and backward.
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from helpers.models import enable_checkpointing

    seen = []

    def policy(ctx, op, *args, **kwargs):
        seen.append(op)
        return save_matmuls(ctx, op, *args, **kwargs)

    trainee = Trainee(BASE)
    enable_checkpointing(trainee.model, functools.partial(create_selective_checkpoint_contexts,
                                                          policy))  # fmt: skip
    trainee.model(**trainee.batch()).loss.backward()
    assert aten.mm.default in seen and aten.mul.Tensor in seen


def test_set_checkpointing_switches_and_refuses_unknown_settings():
    trainee = Trainee(BASE)
    for mode, on in (("full", True), ("none", False), ("selective", True), ("offload", False)):
        set_checkpointing(trainee.model, mode)
        assert is_checkpointing(trainee.model) == on, mode
    with pytest.raises(ValueError, match="unknown setting"):
        set_checkpointing(trainee.model, "half")


def test_offload_moves_nothing_on_a_cpu_and_everything_elsewhere():
    moves, why = offload_moves(torch.device("cpu"))
    assert not moves and "host memory is the device's memory" in why
    moves, why = offload_moves(torch.device("cuda", 0))
    assert moves and "pinned host memory" in why


def test_four_settings_memory_flops_and_gradients():
    results = {mode: checkpointing_memory(BASE, mode) for mode in CHECKPOINTING}
    act = {mode: r.memory["activations"] for mode, r in results.items()}
    assert act["full"] < act["selective"] < act["none"] == act["offload"]
    flops = {mode: r.flops for mode, r in results.items()}
    assert flops["selective"] == flops["none"] == flops["offload"] < flops["full"]
    packed = results["offload"].packed
    assert 0.5 * act["none"] < packed <= act["none"]
    check = gradient_check(BASE)
    assert check.noise_floor == 0 and set(check.max_difference.values()) == {0.0}
    assert len(set(check.losses.values())) == 1


def test_packed_bytes_counts_each_storage_once_and_leaves_weights_out():
    linear = torch.nn.Linear(8, 8, bias=False)
    x = torch.randn(4, 8)

    def loss_of(model, batch):
        h = model(batch["x"])  # saves x (an input: left out) and the weight (left out)
        y = h * h  # saves h, twice: one storage
        return y.sum()

    assert packed_bytes(linear, {"x": x}, loss_of) == 4 * 8 * 4  # h only, in fp32


def _emulated_offload_activations(cfg: RunConfig) -> tuple[int, int, int]:
    """(none's activations, emulated offload's, packed bytes): each saved tensor copied where the
    tracker does not see it, as save_on_cpu copies it to the host of a GPU, and freed on the
    device once the forward pass drops it; unpacking makes a device copy, as on a GPU."""
    from torch.utils._python_dispatch import _disable_current_modes

    from helpers.lessons.more_memory import _checkpointing_trainee
    from helpers.memory import CategoryTracker
    from helpers.train import train_step

    def pack(t):
        with _disable_current_modes():
            return t.clone()

    def emulated(model, batch):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t.clone()):
            return model(**batch).loss

    trainee, _ = _checkpointing_trainee(cfg, "none")
    packed = packed_bytes(trainee.model, trainee.batch())
    out = []
    for loss_of in (None, emulated):
        kwargs = {"loss_of": loss_of} if loss_of else {}
        train_step(trainee.model, trainee.optimizer, [trainee.batch()], **kwargs)
        tracker = CategoryTracker(device=trainee.device)
        tracker.track_external(trainee.model, trainee.optimizer)
        with tracker:
            train_step(trainee.model, trainee.optimizer, [trainee.batch()], **kwargs)
        out.append(tracker.peaks().activations)
    return out[0], out[1], packed


def test_offload_on_a_gpu_would_free_most_of_what_it_packs():
    # The notebook's CUDA check (activations fall by at least half the packed bytes), tried on
    # an emulated move: what stays on the device is the forward pass's working set.
    none, emulated, packed = _emulated_offload_activations(BASE)
    assert none - emulated >= 0.5 * packed, (none, emulated, packed)
    assert emulated < none


def test_the_checkpointing_study_bundles_the_four_settings():
    from helpers.lessons.more_memory import CheckpointingResult, CheckpointingStudy, GradientCheck

    results = {mode: CheckpointingResult(mode, {"activations": a << 20, "peak": 9 << 20}, 10, p)
               for mode, a, p in (("none", 8, 0), ("full", 3, 0), ("selective", 5, 0),
                                  ("offload", 8, 6 << 20))}  # fmt: skip
    grads = GradientCheck(dict.fromkeys(results, 1.0), dict.fromkeys(results, 0.0), 0.0)
    study = CheckpointingStudy(BASE, torch.device("cpu"), results, grads, False, "why")
    assert study.activations == {"none": 8 << 20, "full": 3 << 20, "selective": 5 << 20,
                                 "offload": 8 << 20}  # fmt: skip
    assert study.packed == 6 << 20
    assert list(study.table().index) == list(CHECKPOINTING)
    ratios = dict.fromkeys(results, (1.0, 0.9, 1.1))
    assert figure_problems(study.figure(ratios, title="four settings")) == []


def test_fused_step_facts_same_training_and_the_refusal():
    from helpers.lessons.more_memory import fused_step_facts

    facts = fused_step_facts(replace(BASE, batch_size=1, seq_len=16))
    assert facts.weight_gap == 0.0  # bitwise on the CPU
    assert "grad_accum=1" in facts.refusal


def test_checkpointing_figure_is_readable():
    act = {"none": 8 << 20, "full": 3 << 20, "selective": 5 << 20, "offload": 8 << 20}
    ratios = {"none": (1, 1, 1), "full": (1.3, 1.1, 1.5), "selective": (1.5, 1.3, 1.7),
              "offload": (1.05, 0.9, 1.2)}  # fmt: skip
    fig = checkpointing_figure(act, ratios, packed=6 << 20, title="four settings")
    assert figure_problems(fig) == []


# -- section 4 ---------------------------------------------------------------------------------


def test_sample_lengths_are_wide_and_within_bounds():
    cfg = PackingConfig(samples=200, min_len=8, max_len=64)
    lengths = sample_lengths(cfg)
    assert min(lengths) >= 8 and max(lengths) <= 64
    assert min(lengths) < 12 and max(lengths) > 56  # the whole range is drawn
    assert sorted(lengths)[100] < 36  # log-uniform: the median below the midpoint


def test_padded_and_packed_batches_of_the_same_samples():
    samples = [torch.arange(1, n + 1) for n in (3, 5, 2)]
    padded, packed = padded_batch(samples), packed_batch(samples)
    assert padded["input_ids"].shape == (3, 5)
    assert padded["attention_mask"].sum() == 10 and (padded["labels"] == -100).sum() == 5
    assert packed["input_ids"].shape == (1, 10)
    assert packed["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    assert (packed["labels"][0, [0, 3, 8]] == -100).all()  # no sample predicts the next one
    assert predicted_tokens(padded) == predicted_tokens(packed) == 2 + 4 + 1


def test_packing_keeps_samples_apart_only_with_position_ids_and_no_cache():
    check = packing_check(PackingConfig(samples=4, max_len=32))
    assert check.max_difference <= 1e-5 * check.logit_scale
    assert check.no_positions_difference > 0.1 * check.logit_scale
    assert check.cache_on_difference > 0.1 * check.logit_scale
    assert abs(check.loss_packed - check.loss_padded) <= 1e-5 * check.loss_padded
    assert check.packed_tokens == check.padded_tokens - check.pad_tokens == sum(check.lengths)


def test_packing_saves_activations_when_lengths_differ():
    cfg = PackingConfig(samples=4, max_len=32)
    padded, packed = packing_memory(cfg, False), packing_memory(cfg, True)
    assert packed["activations"] < padded["activations"]
    for category in ("params", "gradients", "optimizer_state"):
        assert packed[category] == padded[category], category


def test_batch_picture_is_readable():
    assert figure_problems(batch_picture([61, 50, 8, 36], title="padded and packed")) == []


def test_packing_config_for_scale_and_the_picture_of_a_check():
    from helpers.lessons.more_memory import PackingCheck, packing_samples
    from helpers.scale import get_scale

    scale = get_scale("tiny")
    cfg = PackingConfig.for_scale(scale, torch.device("cpu"), min_len=16)
    assert (cfg.model, cfg.max_len, cfg.device) == (scale.decoder, scale.seq_len, "cpu")
    assert cfg.samples == packing_samples(scale) and cfg.min_len == 16
    check = PackingCheck([5, 3], 1.0, 0.0, 1.0, 1.0, 2.0, 2.0, 6, 6, 10, 2, 8)
    assert figure_problems(check.picture(title="two samples")) == []


# -- section 5 ---------------------------------------------------------------------------------


def test_fp8_is_refused_with_a_reason_on_a_cpu():
    problem = fp8_problem(torch.device("cpu"))
    assert problem and "compute capability 8.9" in problem and "skipped" in problem


@pytest.mark.parametrize(("card", "runs"), [("h100", True), ("l4", True), ("a100-80", False),
                                            ("a10g", False), ("t4", False)])  # fmt: skip
def test_fp8_needs_compute_capability_8_9(monkeypatch, card, runs):
    import helpers.lessons.more_memory as lesson

    monkeypatch.setattr(lesson, "torchao_missing", lambda: "")  # the card decides, not the install
    FakeGpu(monkeypatch, [PROFILES[card]])
    problem = fp8_problem(torch.device("cuda", 0))
    assert (problem is None) == runs, problem
    assert (PROFILES[card].capability >= FP8_CAPABILITY) == runs
    if not runs:
        major, minor = PROFILES[card].capability
        assert f"has {major}.{minor}" in problem and PROFILES[card].name in problem


def test_fp8_without_torchao_says_how_to_install(monkeypatch):
    import importlib.util

    import helpers.lessons.more_memory as lesson

    FakeGpu(monkeypatch, [PROFILES["h100"]])
    real = importlib.util.find_spec
    hide = lambda name, *a: None if name == "torchao" else real(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", hide)
    assert "pip install torchao" in lesson.torchao_missing()
    assert "pip install torchao" in fp8_problem(torch.device("cuda", 0))
    # Without torchao the layers are still listed, by the filter's decision alone.
    layers = lesson.converted_layers(torch.nn.Sequential(torch.nn.Linear(32, 48)))
    assert [(x.converted, x.auto) for x in layers] == [(True, None)]


def test_fp8_filter_keeps_the_output_layer_and_odd_shapes():
    assert fp8_filter(torch.nn.Linear(128, 352), "model.layers.0.mlp.up_proj")
    assert not fp8_filter(torch.nn.Linear(128, 1024), "lm_head")
    assert not fp8_filter(torch.nn.Linear(100, 128), "model.layers.0.mlp.up_proj")
    assert not fp8_filter(torch.nn.LayerNorm(128), "model.norm")


def test_fp8_layers_and_their_share_of_the_flops():
    # With torchao: its conversion of a copy; without it (optional): the filter's decision.
    out = fp8_layers(BASE)
    names = {x.name: x for x in out.layers}
    assert not names["lm_head"].converted and names["model.layers.0.mlp.up_proj"].converted
    for x in out.layers:
        assert x.forward_flops == 2 * out.tokens * x.in_features * x.out_features, x
    # the layers' matmuls (3 x forward) and the head's make up all but attention's products
    head = names["lm_head"].forward_flops * 3
    assert 0.5 < out.converted_share < 1 - head / out.step_flops


def test_fp8_account_by_hand():
    layers = [LinearLayer("a", 16, 32, True, False), LinearLayer("lm_head", 16, 64, False, False)]
    account = fp8_account(layers, tokens=10)
    bf16, fp8 = account["bf16 autocast"], account["float8 (torchao)"]
    assert bf16.saved_inputs == fp8.saved_inputs == 2 * 10 * 16
    assert (bf16.weight_copies, fp8.weight_copies) == (2 * 16 * 32, 0)
    # backward: grad_output twice (2 x 10 x 32) + weight (16 x 32) + input (10 x 16)
    assert (bf16.largest_casts, fp8.largest_casts) == (0, 640 + 512 + 160)
    assert figure_problems(fp8_figure(account, title="one layer")) == []


def test_fp8_layers_account_and_figure_are_the_functions():
    from helpers.lessons.more_memory import Fp8Layers

    layers = [LinearLayer("a", 16, 32, True, False), LinearLayer("lm_head", 16, 64, False, False)]
    out = Fp8Layers(layers, tokens=10, step_flops=10_000)
    assert out.account() == fp8_account(layers, 10)
    assert figure_problems(out.figure(title="one layer")) == []


def test_measure_fp8_without_torchao_runs_nothing(monkeypatch):
    import helpers.lessons.more_memory as lesson

    monkeypatch.setattr(lesson, "torchao_missing", lambda: "torchao is not installed")
    out = lesson.measure_fp8(BASE, 4, "no fp8 GPU", torch.device("cpu"))
    assert (out.reference, out.runs, out.times) == ("fp32", {}, None)
    assert out.skipped == "torchao is not installed"


def test_fp8_keeps_the_high_precision_inputs():
    # torchao's emulated float8 on the CPU: the same saved activations as without it (it saves
    # the high-precision input and casts again in backward), and a loss that follows fp32's.
    pytest.importorskip("torchao")
    cfg = replace(BASE, attn="sdpa")
    ref, fp8 = fp8_run(cfg, False, 4), fp8_run(cfg, True, 4, emulate=True)
    assert fp8.emulated and not ref.emulated
    assert fp8.memory["activations"] == ref.memory["activations"]
    assert abs(fp8.losses[-1] / ref.losses[-1] - 1) < 0.05
    assert fp8.losses != ref.losses  # the casts did round something


def test_fp8_step_builds_a_float8_model():
    # The contender the notebook times on an fp8 GPU; here only built (fp8 matmuls need one).
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from helpers.lessons.more_memory import fp8_trainee

    trainee = fp8_trainee(BASE, True)
    swapped = [n for n, m in trainee.model.named_modules() if isinstance(m, Float8Linear)]
    assert len(swapped) == 14 and "lm_head" not in swapped
    params = {id(p) for group in trainee.optimizer.param_groups for p in group["params"]}
    assert params == {id(p) for p in trainee.model.parameters()}
