"""Lesson 01's layer account: Korthikanti et al.'s terms against what autograd saves."""

from __future__ import annotations

import pytest
import torch

from helpers.lessons.anatomy_of_memory import (
    ATTN_MASK,
    DROPPED,
    HIDDEN_MASKS,
    OTHER,
    account_table,
    korthikanti_terms,
    layer_account,
    saved_in_first_layer,
    with_dropout,
)
from helpers.models import load_config
from tests.cells import cell_function

CPU = torch.device("cpu")
# The saved-tensor hook lesson 01 writes in its cell (the code the lesson measures with).
SAVED_INSIDE = cell_function("01_anatomy_of_memory.ipynb", "saved_inside")
# The Try-it cell's formula: the bytes dropout adds to a layer.
dropout_bytes = cell_function("01_anatomy_of_memory.ipynb", "dropout_bytes")


@pytest.mark.parametrize("dropout", [None, 0.0])
def test_every_term_matches_what_autograd_saves(dropout):
    # Storages are numel x element size on the CPU: the account must hold to the byte.
    account = layer_account(load_config("bert-tiny"), 2, 24, CPU, SAVED_INSIDE, dropout=dropout)
    table = account.table
    assert OTHER not in table.index, table
    assert (table["predicted B"] == table["measured B"]).all(), table
    assert account.predicted == account.measured == account.estimator_bytes
    config = load_config("bert-tiny")
    h, a = config.hidden_size, config.num_attention_heads
    s, b = 24, 2  # Korthikanti et al.: s·b·h·(34 + 5·a·s/h) = 34·sbh + 5·as²b
    assert account.paper_bytes == 34 * s * b * h + 5 * a * s * s * b
    assert table.loc["total", "paper B"] == account.paper_bytes


def test_dropout_zero_drops_masks_and_dropped_probabilities():
    config = load_config("bert-tiny")
    on = layer_account(config, 2, 24, CPU, SAVED_INSIDE)
    off = layer_account(config, 2, 24, CPU, SAVED_INSIDE, dropout=0.0)
    assert on.measured - off.measured == dropout_bytes(config, 2, 24, "cpu") > 0
    assert len(off.saved) == len(on.saved) - 4  # two hidden masks, the attention mask, the drop
    # CUDA's 1-byte masks: the cell's formula against the account's dropout terms.
    cuda = {t.name: t.ours for t in korthikanti_terms(config, "cuda")}
    sbh, as2b = 24 * 2 * config.hidden_size, config.num_attention_heads * 24 * 24 * 2
    expected = cuda[HIDDEN_MASKS] * sbh + (cuda[ATTN_MASK] + cuda[DROPPED]) * as2b
    assert dropout_bytes(config, 2, 24, "cuda") == expected > 0


def test_fp32_cpu_terms_double_the_paper_except_masks():
    # fp32: every 2-byte element becomes 4; a CPU mask is a 4-byte float, not a 1-byte bool.
    terms = {t.name: t for t in korthikanti_terms(load_config("bert-tiny"), "cpu")}
    for t in terms.values():
        if "mask" not in t.name and t.paper:
            assert t.ours == 2 * t.paper, t
    cuda = {t.name: t for t in korthikanti_terms(load_config("bert-tiny"), "cuda")}
    assert cuda["attention dropout mask"].ours == cuda["attention dropout mask"].paper == 1


def test_dropout_copy_leaves_the_caller_config_alone():
    config = load_config("bert-tiny")
    copy = with_dropout(config, 0.0)
    assert copy.hidden_dropout_prob == 0.0 and config.hidden_dropout_prob == 0.1


def test_table_for_reading_has_units_and_a_total():
    table = account_table(layer_account(load_config("bert-tiny"), 1, 8, CPU, SAVED_INSIDE))
    assert "measured KiB" in table.columns and "total" in table.index


def test_only_bert_is_accounted():
    with pytest.raises(ValueError, match="BERT"):
        saved_in_first_layer(load_config("llama-tiny"), 1, 8, CPU, SAVED_INSIDE)
