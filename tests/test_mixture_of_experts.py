"""The sparse/dense pair: equal FFN FLOPs per token, E/k FFN parameters, a sane router count."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from transformers.models.switch_transformers.modeling_switch_transformers import (
    router_z_loss_func,
)

from helpers.lessons.mixture_of_experts import (
    block_io,
    lora_sites,
    pair_for,
    router_heatmap,
    train_flops_per_token,
)
from helpers.models import build_model, load_config
from tests.cells import cell_function
from tests.plot_checks import figure_problems

NOTEBOOK = "09_mixture_of_experts.ipynb"
router_load = cell_function(NOTEBOOK, "router_load")  # the lesson's cells: what it runs
moe_by_hand = cell_function(NOTEBOOK, "moe_by_hand")
ffn_params = cell_function(NOTEBOOK, "ffn_params")
router_z_loss = cell_function(NOTEBOOK, "router_z_loss")


def _routed(name: str, top_k: int | None = None):
    """The bundled sparse model ``name`` (top-k overridden if given) and one batch of 2 x 16."""
    config = load_config(name)
    if top_k is not None:
        config.num_experts_per_tok = top_k
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    return build_model(config).eval(), ids


class _Logits:
    """A stand-in for a Mixtral whose forward returns the given router logits."""

    def __init__(self, logits: torch.Tensor, k: int):
        self.config = SimpleNamespace(num_local_experts=logits.shape[-1], num_experts_per_tok=k)
        self.logits = logits

    def __call__(self, input_ids, output_router_logits):
        return SimpleNamespace(router_logits=(self.logits,))


def test_pair_differs_only_in_the_ffn():
    sparse, dense = (load_config(n) for n in pair_for("tiny"))
    k, n_exp = sparse.num_experts_per_tok, sparse.num_local_experts
    assert dense.intermediate_size == k * sparse.intermediate_size
    with init_empty_weights():
        ms, md = (AutoModelForCausalLM.from_config(c) for c in (sparse, dense))
    router = sparse.num_hidden_layers * sparse.hidden_size * n_exp
    assert ffn_params(ms) - router == (n_exp // k) * ffn_params(md)
    rest = [sum(p.numel() for p in m.parameters()) - ffn_params(m) for m in (ms, md)]
    assert rest[0] == rest[1]


def test_flops_per_token_equal_up_to_the_router():
    sparse, dense = (train_flops_per_token(n, 2, 16) for n in pair_for("tiny"))
    assert sparse.ffn_per_token - sparse.router_per_token == dense.ffn_per_token > 0
    assert sparse.router_per_token > 0 and dense.router_per_token == 0


def test_router_shares_sum_to_one_per_layer():
    shares, aux_loss, z_loss, logit_rms = router_load(*_routed(pair_for("tiny")[0]))
    assert len(shares) == 2
    for layer in shares:
        assert abs(sum(layer) - 1) < 1e-9 and all(s >= 0 for s in layer)
    assert torch.isfinite(torch.tensor(aux_loss))
    assert z_loss > 0
    # A random router (std initializer_range) on RMS-normalised hidden states of unit scale:
    # logits of size ~ 0.02 * sqrt(h), not 0.02.
    config = load_config(pair_for("tiny")[0])
    expected = config.initializer_range * config.hidden_size**0.5
    assert 0.8 < logit_rms / expected < 1.2, (logit_rms, expected)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_aux_loss_fractions_sum_to_k_and_the_lesson_shares_to_one(k):
    # transformers' f_e is assignments over tokens: with every probability exactly 1/E (zero
    # logits) its loss E * sum_e f_e * (1/E) is sum_e f_e, which is k, not 1.
    n_exp = 8
    assert load_balancing_loss_func((torch.zeros(32, n_exp),), n_exp, k).item() == pytest.approx(k)
    # The lesson's shares are f_e / k: they sum to 1 and rebuild transformers' loss exactly.
    logits = torch.randn(64, n_exp, generator=torch.Generator().manual_seed(k))
    (shares,), aux_loss, _, _ = router_load(_Logits(logits, k), None)
    assert sum(shares) == pytest.approx(1)
    probs = logits.softmax(-1).mean(0).tolist()  # P_e: each expert's mean probability
    by_hand = n_exp * sum(k * s * p for s, p in zip(shares, probs, strict=True))
    assert aux_loss == pytest.approx(by_hand, rel=1e-5)
    assert load_balancing_loss_func((logits,), n_exp, k).item() == pytest.approx(by_hand, rel=1e-5)


def test_top_k_override_scales_the_experts_flops():
    # Each routed token costs one expert's FLOPs: top-1 does half of top-2's expert work,
    # the router (h x E, on every token) stays the same.
    sparse = pair_for("tiny")[0]
    one, two = (train_flops_per_token(sparse, 2, 16, top_k=k) for k in (1, 2))
    assert one.router_per_token == two.router_per_token > 0
    experts = [r.ffn_per_token - r.router_per_token for r in (one, two)]
    assert experts[1] == 2 * experts[0] > 0
    shares, aux_loss, _, _ = router_load(*_routed(sparse, top_k=1))
    assert all(abs(sum(layer) - 1) < 1e-9 for layer in shares)
    # At init the loss sits near its uniform value k: 1 here, not the config's 2 (32 tokens:
    # a few per cent of noise).
    assert abs(aux_loss - 1) < 0.25, aux_loss


def test_block_by_hand_matches_the_library_block():
    # On a real block's inputs (captured in a forward pass), against transformers' block.
    config = load_config(pair_for("tiny")[0])
    model = build_model(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    x, y = block_io(model, 0, ids)
    assert x.shape == y.shape == (2, 16, config.hidden_size)
    block, k = model.model.layers[0].mlp, config.num_experts_per_tok
    tokens, y = x.reshape(-1, x.shape[-1]), y.reshape(-1, x.shape[-1])
    # Same float32 operations, perhaps summed in another order: 16 eps x max|y| (see lesson).
    tol = 16 * torch.finfo(torch.float32).eps * y.abs().max().item()
    assert (moe_by_hand(block, tokens, k)[0] - y).abs().max().item() <= tol
    # Without renormalising the top-k weights (they sum to ~k/E at init) it is far off.
    wrong = moe_by_hand(block, tokens, k, renormalise=False)[0]
    assert (wrong - y).abs().max().item() > 100 * tol


def test_router_heatmap_is_readable_tiny_and_full():
    tiny = router_load(*_routed(pair_for("tiny")[0]))[0]
    assert figure_problems(router_heatmap(tiny, 2)) == []
    full = [[(0.5 + ((i * 7 + e * 3) % 8) / 8) / 8 for e in range(8)] for i in range(12)]
    fig = router_heatmap(full, 2)
    assert figure_problems(fig) == []
    width, height = fig.get_size_inches()
    assert width * fig.dpi < 900 and height < width  # not the 1800-px strip of bars any more


def test_router_z_loss_matches_switch_transformers_and_log_e_at_zero_logits():
    # Zero logits: every token's log-sum-exp is log E exactly, so the z-loss is (log E)^2.
    n_exp = 8
    zero = router_z_loss((torch.zeros(5, n_exp), torch.zeros(3, n_exp)))
    assert zero.item() == pytest.approx(math.log(n_exp) ** 2, rel=1e-6)
    # On random logits, per layer: transformers' Switch Transformers function (mean over
    # layers x tokens) gives the same number; a shift of every logit by c moves it.
    layers = tuple(torch.randn(2, 16, n_exp, generator=torch.Generator().manual_seed(1)).unbind(0))
    ours = router_z_loss(layers).item()
    assert ours == pytest.approx(router_z_loss_func(torch.stack(layers)).item(), rel=1e-6)
    assert router_z_loss(tuple(x - 3 for x in layers)).item() != pytest.approx(ours)


def test_lora_sites_count_each_experts_adapter_pair():
    from peft import LoraConfig, get_peft_model

    config = load_config(pair_for("tiny")[0])
    n_exp, h, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    lora = LoraConfig(r=2, target_modules=["q_proj"], target_parameters=experts)
    model = get_peft_model(build_model(config), lora)
    sites = lora_sites(model)
    assert set(sites) == {"self_attn.q_proj", *experts}
    layers = config.num_hidden_layers
    assert sites["self_attn.q_proj"] == {"rank": 2, "shape": (h, h), "layers": layers,
                                         "params": layers * 2 * (h + h)}  # fmt: skip
    assert sites["mlp.experts.gate_up_proj"]["params"] == layers * 2 * n_exp * (h + 2 * inter)
    assert sites["mlp.experts.down_proj"]["params"] == layers * 2 * n_exp * (inter + h)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(v["params"] for v in sites.values()) == trainable
