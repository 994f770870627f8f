"""Lesson 16's memory savers: the optimizer step inside backward and the chunked loss.

Each saver is checked for what it must not change (the training, the loss) and for what it
changes (the bytes), with the estimator's account of both checked against the tracker.
"""

import json

import pytest
import torch

from helpers.device import allocation_bytes
from helpers.estimator import describe_model, estimate, estimate_run
from helpers.memory_savers import ChunkedCausalLMLoss, OptimizerInBackward, causal_targets
from helpers.models import build_model, load_config
from helpers.train import RunConfig, Trainee, make_optimizer, measure

# The estimator's target, as tests/test_estimate.py states it: within 10 % of the measured
# peak and activations; the gradients are counted from shapes, so they must be exact.
TOLERANCE = 0.10


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory):
    """llama-tiny's layers at half width under a 32k vocabulary: the head dominates the step."""
    config = json.loads(json.dumps(load_config("llama-tiny").to_dict()))
    config.update(vocab_size=32000, hidden_size=64, head_dim=16, intermediate_size=176)
    path = tmp_path_factory.mktemp("configs") / "llama-32k.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """llama-tiny with the output embedding tied to the input one (Llama 3.2 1B does this)."""
    config = load_config("llama-tiny").to_dict()
    config["tie_word_embeddings"] = True
    path = tmp_path_factory.mktemp("configs") / "llama-tied.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_optimizer_in_backward_trains_exactly_like_the_optimizer():
    # On the CPU both run torch's single-tensor AdamW, parameter by parameter, with the same
    # numbers in the same order: the weights after three steps are bitwise equal.
    plain = Trainee(RunConfig(model="llama-tiny", batch_size=2, seq_len=16))
    fused = Trainee(RunConfig(model="llama-tiny", batch_size=2, seq_len=16,
                              optimizer_in_backward=True))  # fmt: skip
    for _ in range(3):
        assert plain.step() == fused.step()
    for p, q in zip(plain.model.parameters(), fused.model.parameters(), strict=True):
        assert torch.equal(p, q)
        assert q.grad is None  # every gradient was freed right after its own step
    assert fused.optimizer.state.keys() == set(fused.model.parameters())


def test_optimizer_in_backward_takes_the_hooks_off():
    model = build_model(load_config("llama-tiny"))
    opt = OptimizerInBackward(
        list(model.parameters()), lambda ps: make_optimizer("sgd", model, params=ps)
    )
    opt.remove()
    batch = {
        "input_ids": torch.ones(1, 4, dtype=torch.long),
        "labels": torch.ones(1, 4, dtype=torch.long),
    }
    model(**batch).loss.backward()
    assert all(p.grad is not None for p in model.parameters())  # nobody stepped and freed them


@pytest.mark.parametrize("setting", [dict(grad_accum=2), dict(precision="fp16")])
def test_optimizer_in_backward_refuses_what_it_cannot_do(setting):
    with pytest.raises(ValueError, match="grad_accum=1"):
        Trainee(RunConfig(model="llama-tiny", optimizer_in_backward=True, **setting))
    with pytest.raises(ValueError, match="grad_accum=1"):
        estimate("llama-tiny", 2, 16, optimizer_in_backward=True, **setting)


def test_causal_targets_shift_as_transformers_does():
    labels = torch.tensor([[5, 6, 7], [8, 9, -100]])
    assert causal_targets(labels).tolist() == [6, 7, -100, 9, -100, -100]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_chunked_loss_equals_the_models_loss_and_gradients(big_vocab, precision):
    trainee = Trainee(RunConfig(model=big_vocab, batch_size=2, seq_len=24, precision=precision))
    model, batch = trainee.model, trainee.batch()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    with autocast:
        full = model(**batch).loss
    full.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with autocast:
        chunked = ChunkedCausalLMLoss(model, 10)(batch)  # 48 tokens: chunks of 10, 10, ..., 8
    chunked.backward()
    # The loss: the same fp32 log-softmax values summed in another order, a few ulp of a
    # loss near log(32000) = 10.4, in fp32 and in bf16 (whose logits are upcast first).
    assert chunked.item() == pytest.approx(full.item(), rel=1e-6)
    for p, g in zip(model.parameters(), want, strict=True):
        if precision == "fp32":  # fp32 sums in another order
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)
        else:
            # Under autocast each chunk's weight-gradient matmul is rounded to bf16 (8 bits of
            # mantissa) before the chunks are added in fp32; the full matmul rounds once. The
            # two differ by about 2^-8 of the partial sums: 2^-7 of the largest entry bounds it.
            bound = 2**-7 * g.abs().max().item()
            torch.testing.assert_close(p.grad, g, rtol=2**-7, atol=bound)


def test_chunked_loss_refuses_an_encoder():
    with pytest.raises(ValueError, match="causal language models"):
        Trainee(RunConfig(model="bert-tiny", loss_chunk=16))
    with pytest.raises(ValueError, match="causal language models"):
        estimate("bert-tiny", 2, 16, loss_chunk=16)


SAVERS = {
    "in-backward": dict(optimizer_in_backward=True),
    "chunked": dict(loss_chunk=32),
    "both": dict(optimizer_in_backward=True, loss_chunk=32),
    "both-bf16": dict(optimizer_in_backward=True, loss_chunk=32, precision="bf16"),
    "both-checkpointing-sgd": dict(
        optimizer_in_backward=True, loss_chunk=16, gradient_checkpointing=True, optimizer="sgd"
    ),
    # Under autocast the chunks' recomputed weight casts and 16-bit weight gradients (the
    # stage model was 12 % over the tracker here before it counted them).
    "chunked-bf16-checkpointing-sgd": dict(
        loss_chunk=16, gradient_checkpointing=True, optimizer="sgd", precision="bf16"
    ),
    # bf16 weights (no fp32 master copy): the stage model in the weights' dtype.
    "both-bf16-weights": dict(
        optimizer_in_backward=True, loss_chunk=32, precision="bf16", weight_dtype="bf16"
    ),
    "chunked-bf16-weights-accum": dict(
        loss_chunk=32, precision="bf16", weight_dtype="bf16", grad_accum=2
    ),
}


@pytest.mark.parametrize("setting", list(SAVERS))
@pytest.mark.parametrize("model", ["big_vocab", "tied", "llama-tiny"])
def test_estimate_of_the_savers_matches_the_tracker(model, setting, request):
    name = request.getfixturevalue(model) if model in ("big_vocab", "tied") else model
    cfg = RunConfig(model=name, batch_size=2, seq_len=64, repeats=1, flops=False, **SAVERS[setting])
    rec = measure(cfg)
    assert rec.ok, rec.error
    est, mem = estimate_run(cfg), rec.memory
    for key in ("params", "gradients", "optimizer_state"):  # counted from shapes
        assert getattr(est, key) == mem[key], key
    assert abs(est.activations - mem["activations"]) < TOLERANCE * mem["activations"]
    assert abs(est.peak - mem["peak"]) < TOLERANCE * mem["peak"], (est.peak, est.peak_at, mem)


def test_in_backward_gradients_are_the_largest_single_gradient(big_vocab):
    info = describe_model(big_vocab)
    largest = max(4 * p.numel for p in info.params)
    plain = estimate(info, 2, 64, device="cpu")
    fused = estimate(info, 2, 64, optimizer_in_backward=True, device="cpu")
    assert fused.gradients == largest < plain.gradients == 4 * info.n_params
    # CUDA's branch: the same tensor, as the caching allocator holds it (512-byte blocks).
    on_cuda = estimate(info, 2, 64, optimizer_in_backward=True, device="cuda")
    assert on_cuda.gradients == allocation_bytes(largest, "cuda")
    assert "optimizer step" not in [on_cuda.peak_at, fused.peak_at]  # no step after backward


def test_chunked_estimate_removes_the_logits_from_the_activations(big_vocab):
    full = estimate(big_vocab, 2, 64, device="cpu")
    chunked = estimate(big_vocab, 2, 64, loss_chunk=32, device="cpu")
    logits = 4 * 2 * 64 * 32000  # fp32 logits of the whole batch; log-softmax is as large
    assert full.activations - chunked.activations >= logits  # 2 x logits out, 2 chunks' in
    moments: list = []
    estimate(big_vocab, 2, 64, loss_chunk=32, device="cpu", moments=moments)
    assert not any(m.label == "forward: loss" for m in moments)  # the loss is in the head now


def test_the_savers_need_the_stage_model():
    with pytest.raises(ValueError, match="come from the analytical stage model"):
        estimate("llama-tiny", 2, 16, path="traced", optimizer_in_backward=True)
    with pytest.raises(ValueError, match="estimated by the stage model"):
        estimate("gpt2-tiny", 2, 16, loss_chunk=8)


def test_the_timeline_of_steps_inside_backward_is_drawn_readably():
    from helpers.plots import memory_timeline
    from helpers.timeline import measure_timeline
    from tests.plot_checks import figure_problems

    cfg = RunConfig(model="llama-tiny", batch_size=1, seq_len=16, optimizer_in_backward=True)
    timeline = measure_timeline(cfg, isolate=False)
    assert "optimizer step" in timeline.phase  # each parameter's step, between backward's ops
    fig = memory_timeline(timeline, title="steps inside backward")
    assert figure_problems(fig) == []
    # One label for backward and its steps, not one per parameter (they would overlap).
    labels = [t.get_text() for t in fig.axes[0].texts if t.get_text() in
              ("fwd", "bwd", "opt", "bwd + a step per parameter")]  # fmt: skip
    assert labels == ["fwd", "bwd + a step per parameter"], labels
