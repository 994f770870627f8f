"""COURSE_PRETRAINED: real weights and text through the switch, proven offline from local files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import pretrained
from helpers.pretrained import HUB_MODELS, Switch, real_run, switch
from helpers.train import RunConfig

SENTENCES = [
    "the cat sat on the mat and the dog sat on the rug",
    "a model learns the next word from the words before it",
    "the dog ran to the cat and the cat ran to the mat",
    "memory and time are what a training step costs",
] * 8


def _tiny_saved_model(folder: Path):
    """A tiny Llama and a word-level tokenizer, written as save_pretrained writes them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    config = LlamaConfig(
        vocab_size=words.get_vocab_size(), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


@pytest.fixture
def offline(monkeypatch):
    """No hub, as in CI: the variables for child processes, and the values the hub libraries
    read from them when they were imported (before this test could set them)."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def test_the_switch_is_read_from_the_environment(tmp_path):
    assert switch({}) == Switch(False, None, None)
    assert switch({"COURSE_PRETRAINED": "0"}).on is False
    assert switch({"COURSE_PRETRAINED": "1"}) == Switch(True, None, None)
    local = switch({"COURSE_PRETRAINED": str(tmp_path), "COURSE_DATA": "/x/wiki.txt"})
    assert local == Switch(True, tmp_path, Path("/x/wiki.txt"))
    # On with the hub: a bundled config's hub model; a directory stands in for any config.
    assert Switch(True).source("bert-large") == HUB_MODELS["bert-large"].hub_id
    assert Switch(True).source("llama-tiny") is None
    assert local.source("llama-tiny") == str(tmp_path)
    assert Switch(False).source("bert-large") is None


def test_every_hub_model_names_a_bundled_config_and_its_licence():
    from helpers.models import config_path

    for name, hub in HUB_MODELS.items():
        assert config_path(name).is_file(), name
        assert hub.licence and hub.download_gb > 0 and "/" in hub.hub_id, name
    assert HUB_MODELS["llama-3.2-1b"].gated and not HUB_MODELS["qwen3-0.6b"].gated


def test_off_says_how_to_turn_it_on_in_one_line_and_loads_nothing():
    run = real_run("bert-large", RunConfig(), sw=Switch(False))
    assert not run.ok and run.model is None and run.losses == []
    assert "\n" not in run.problem and "COURSE_PRETRAINED=1" in run.problem
    assert "1.3 GB" in run.problem and "Apache-2.0" in run.problem


def test_no_hub_is_one_line_and_stays_synthetic(offline, tmp_path):
    # With the hub unreachable (offline), loading fails: reported in one line, not raised.
    run = real_run("bert-tiny", RunConfig(), sw=Switch(True), cache_dir=str(tmp_path))
    assert not run.ok and run.model is None
    assert "\n" not in run.problem and HUB_MODELS["bert-tiny"].hub_id in run.problem
    missing = real_run("bert-tiny", RunConfig(), sw=Switch(True, tmp_path / "none"))
    assert not missing.ok and "staying synthetic" in missing.problem


@pytest.mark.parametrize("data_kind", ["txt", "jsonl"])
def test_local_weights_and_text_fine_tune_through_the_switch(
    offline, tmp_path, monkeypatch, data_kind
):
    saved = _tiny_saved_model(tmp_path / "model")
    data = tmp_path / f"text.{data_kind}"
    if data_kind == "txt":
        data.write_text("\n".join(SENTENCES) + "\n")
    else:
        data.write_text("".join(json.dumps({"text": s}) + "\n" for s in SENTENCES))
    monkeypatch.setenv("COURSE_PRETRAINED", str(tmp_path / "model"))
    monkeypatch.setenv("COURSE_DATA", str(data))
    # The weights as loaded equal the saved ones (checked before any step changes them).
    loaded = pretrained.load_model(switch().source("llama-tiny"))
    saved_state = saved.state_dict()
    assert loaded.state_dict().keys() == saved_state.keys()
    assert all(torch.equal(v, saved_state[k]) for k, v in loaded.state_dict().items())
    setting = RunConfig(model="llama-tiny", batch_size=4, seq_len=8, grad_accum=2, device="cpu")
    run = real_run("llama-tiny", setting, steps=12, lr=1e-2, cache_dir=str(tmp_path / "cache"))
    assert run.ok, run.problem
    assert run.source == str(tmp_path / "model") and run.n_blocks > 4
    assert len(run.losses) == 12 and all(torch.isfinite(torch.tensor(run.losses)))
    assert run.falls(3), run.losses
    # The model trained is the saved one, now moved by the steps.
    trained = run.model.state_dict()["model.embed_tokens.weight"]
    assert not torch.equal(trained, saved_state["model.embed_tokens.weight"])


def test_classify_reads_real_text_as_reversed_or_not():
    blocks = torch.arange(24).view(3, 8)
    g = torch.Generator().manual_seed(0)
    batch = next(pretrained.text_batches(blocks, "classify", 16, g))
    for ids, label in zip(batch["input_ids"], batch["labels"], strict=True):
        row = ids.flip(0) if label else ids
        assert torch.equal(row, torch.arange(row[0], row[0] + 8)), (ids, label)
    assert 0 < int(batch["labels"].sum()) < 16  # both labels occur
