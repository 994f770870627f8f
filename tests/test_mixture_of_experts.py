"""The sparse/dense pair: equal FFN FLOPs per token, E/k FFN parameters, a sane router count."""

from __future__ import annotations

import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM

from helpers.lessons.mixture_of_experts import (
    ffn_params,
    pair_for,
    router_load,
    train_flops_per_token,
)
from helpers.models import load_config


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
    load = router_load(pair_for("tiny")[0], 2, 16)
    assert len(load.shares) == 2 and load.tokens == 32
    for layer in load.shares:
        assert abs(sum(layer) - 1) < 1e-9 and all(s >= 0 for s in layer)
    assert torch.isfinite(torch.tensor(load.aux_loss))
