"""helpers.compat: the tested range as doctor reports it, and the API differences inside it."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from helpers import compat
from helpers.course.cli import main as cli
from helpers.models import build_model, load_config


@pytest.mark.parametrize(
    ("installed", "phrase"),
    [
        ("2.11.0+cu130", "in the tested range"),  # the GPU image's build
        ("2.13.0+cpu", "in the tested range"),  # a local label is the same release
        ("2.10.1", "OLDER than the oldest tested (2.11.0): pip install 'torch>=2.11.0'"),
        ("2.15.0rc1", "newer than tested (up to 2.13.0)"),
        (None, "not installed"),
    ],
)
def test_a_version_is_placed_against_the_tested_range(installed, phrase):
    assert phrase in compat.range_verdict("torch", installed)


def test_untested_versions_names_what_is_outside_and_nothing_else(monkeypatch):
    assert compat.untested_versions() == ""  # this environment is the lock or the floor
    fake = {"torch": "2.10.1", "peft": "0.99.0"}
    real = compat.installed_version
    monkeypatch.setattr(compat, "installed_version", lambda d: fake.get(d) or real(d))
    note = compat.untested_versions()
    assert "torch 2.10.1 (tested 2.11.0 to 2.13.0; every lesson)" in note
    assert "peft 0.99.0 (tested 0.20.0 to 0.21.2; lessons 09 13 14)" in note
    assert "pip install 'torch>=2.11.0'." in note and "peft>=" not in note
    assert "transformers" not in note and "\n" not in note  # one paragraph


def test_importing_compat_prints_nothing():
    import subprocess

    code = "import helpers.compat"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout == "", done.stdout


def test_doctor_reports_versions_and_what_a_missing_package_costs(monkeypatch, capsys):
    real = compat.importable
    monkeypatch.setattr(compat, "importable", lambda m: m != "deepspeed" and real(m))
    assert cli(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"required transformers  {compat.installed_version('transformers')}" in out
    assert "in the tested range 5.17.0 - 5.23.0" in out
    assert "optional deepspeed     missing" in out and "lessons 08: the ZeRO runs" in out


def test_doctor_fails_on_a_required_package_missing_or_too_old(monkeypatch, capsys):
    monkeypatch.setattr(compat, "importable", lambda m: m != "datasets")
    assert cli(["doctor"]) == 1
    assert "required packages missing or too old: datasets" in capsys.readouterr().out
    monkeypatch.setattr(compat, "importable", lambda m: True)
    monkeypatch.setattr(compat, "installed_version", lambda d: "5.9.0" if d == "transformers"
                        else "99.0")  # fmt: skip
    assert cli(["doctor"]) == 1
    assert "transformers" in capsys.readouterr().out.splitlines()[-1]


def test_a_missing_optional_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    assert compat.missing_optional("bitsandbytes") == (
        "bitsandbytes is not installed (pip install bitsandbytes)"
    )
    assert compat.missing_optional("torch") is None


def test_checkpointing_is_switched_and_read_without_deprecated_names():
    model = build_model(load_config("llama-tiny"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # 5.2x warns on the old names
        assert not compat.is_checkpointing(model)
        compat.checkpointing_enable(model, {"use_reentrant": False})
        assert compat.is_checkpointing(model)
        compat.checkpointing_disable(model)
        assert not compat.is_checkpointing(model)


def test_idle_layerdrop_is_skipped_without_changing_the_layers():
    # transformers 5.17's OPT draws torch.rand([]) per layer in training even at layerdrop 0:
    # on fake tensors that comparison stops the trace (the traced estimator's OPT runs).
    model = build_model(load_config("opt-tiny"))
    model.train()
    assert compat.skip_idle_layerdrop(model) == 1
    decoder = model.model.decoder
    assert not decoder.training and decoder.layerdrop == 0
    assert all(layer.training for layer in decoder.layers)  # dropout still trains
    assert compat.skip_idle_layerdrop(model) == 0  # nothing left to do


def test_cuda_autocast_gained_rms_norm_in_torch_2_12(monkeypatch):
    base = frozenset({"layer_norm"})
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert compat.cuda_autocast_fp32_ops(base) == base
    monkeypatch.setattr(torch, "__version__", "2.12.0")
    assert compat.cuda_autocast_fp32_ops(base) == base | {"rms_norm"}


def test_the_trainer_is_switched_with_this_versions_keyword(tmp_path):
    from helpers.train import trainer_arguments

    keywords = compat.trainer_checkpointing(True, {"use_reentrant": False})
    (name,) = [k for k in keywords if not k.endswith("_kwargs")]
    assert name in ("activation_checkpointing", "gradient_checkpointing")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # never the deprecated alias
        args = trainer_arguments(str(tmp_path), "cpu", **keywords)
    assert getattr(args, name) is True and keywords[f"{name}_kwargs"] == {"use_reentrant": False}


def test_readme_names_what_each_missing_optional_package_costs():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("| missing | lessons | what happens |", 1)[1].split("\n\n", 1)[0]
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:]}
    for package in compat.OPTIONAL:
        row = next((line for names, line in rows.items() if package.distribution in names), "")
        assert row, f"README's table of missing packages lacks {package.distribution}"
        assert package.lessons in row, (package.distribution, package.lessons, row)
