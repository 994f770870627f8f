"""A model name that is not bundled: the local Hugging Face cache first, the hub only where it
answers, and offline one line at once (the hub client's retries took 30 s here)."""

from __future__ import annotations

import time

import pytest
from transformers import LlamaConfig

from helpers import models
from helpers.models import hub_host, load_config


@pytest.fixture
def calls(monkeypatch):
    """AutoConfig.from_pretrained's calls, recorded: nothing cached, nothing online."""
    seen = []

    def from_pretrained(model_id, **kwargs):
        seen.append(kwargs)
        raise OSError("not in the cache" if kwargs.get("local_files_only") else "offline")

    monkeypatch.setattr(models.AutoConfig, "from_pretrained", from_pretrained)
    return seen


def test_an_unknown_name_offline_is_one_line_and_asks_no_hub(monkeypatch, calls):
    def refused(*args, **kwargs):
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(models.socket, "create_connection", refused)
    with pytest.raises(FileNotFoundError, match="the hub is not reachable from here") as err:
        load_config("someone/some-model")
    assert "\n" not in str(err.value) and "bundled: " in str(err.value)  # what to pass instead
    assert calls == [{"local_files_only": True}]  # the cache only: no online attempt


def test_a_cached_config_is_read_without_the_network(monkeypatch):
    def from_pretrained(model_id, **kwargs):
        assert kwargs == {"local_files_only": True}
        return LlamaConfig(hidden_size=64)

    def no_network(*args, **kwargs):
        raise AssertionError("the network was asked")

    monkeypatch.setattr(models.AutoConfig, "from_pretrained", from_pretrained)
    monkeypatch.setattr(models.socket, "create_connection", no_network)
    assert load_config("someone/cached-model").hidden_size == 64


def test_hf_hub_offline_means_no_connection_is_tried(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models.socket, "create_connection", pytest.fail)
    assert hub_host() is None


def test_an_unknown_name_answers_in_seconds_here():
    """For real: this machine reaches no hub (a hub that answers says 404 as quickly)."""
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="someone-who-does-not-exist"):
        load_config("someone-who-does-not-exist/no-such-model")
    assert time.perf_counter() - start < 10
