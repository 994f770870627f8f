"""``python -m helpers measure``: JSON on the last stdout line, exit code 2 on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.course.cli import main
from helpers.models import config_path

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "COURSE_DEVICE": "cpu",
    }
    return subprocess.run(
        [sys.executable, "-m", "helpers", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_measure_json_encoder_from_config_path():
    out = cli("measure", "--model", str(config_path("bert-tiny")), "--batch-size", "2",
              "--seq-len", "32", "--json", "--no-flops")  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout.strip().splitlines()[-1])
    keys = ("n_params", "params", "gradients", "optimizer_state", "activations", "peak")
    assert all(isinstance(data[k], int) for k in keys)
    assert data["params"] == 4 * data["n_params"]
    assert data["gradients"] == data["params"]
    assert data["peak"] >= data["params"] + data["optimizer_state"]


def test_measure_json_decoder_sgd(capsys, monkeypatch):
    # In-process, the same main() as above: one real subprocess per kind of output is enough.
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    code = main(["measure", "--model", "llama-tiny", "--batch-size", "2", "--seq-len", "32",
                 "--optimizer", "sgd", "--json", "--no-flops"])  # fmt: skip
    assert code == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["optimizer_state"] == 4 * data["n_params"]  # momentum only


@pytest.mark.parametrize(
    "args",
    [
        ["--optimizer", "lamb"],  # unknown optimizer
        ["--precision", "fp8"],  # unknown precision
        ["--precision", "tf32"],  # a precision this CPU cannot do
        ["--model", "/nonexistent/config.json"],  # unreadable config
        ["--seq-len", "100000"],  # longer than the model's positions
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, capsys, monkeypatch):
    # In-process (the same main() the module runs) to keep the suite fast; the first test
    # runs the real ``python -m helpers`` once.
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    base = {"--model": "bert-tiny", "--batch-size": "2", "--seq-len": "32"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    argv = ["measure", "--json", "--no-flops"] + [x for kv in base.items() for x in kv]
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err


def test_bad_json_config_is_exit_2(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    code = main(["measure", "--model", str(bad), "--batch-size", "2", "--seq-len", "8", "--json"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: cannot read model config")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_every_runconfig_field_is_a_cli_option_or_listed_as_not_one():
    # _run_config names each RunConfig field it sets: a field added to (or renamed in)
    # RunConfig must get an option there or a place in NOT_CLI_OPTIONS, never silently keep
    # its default because an option's name no longer matches.
    import ast
    import inspect
    from dataclasses import fields

    from helpers.course import cli as cli_module
    from helpers.train import RunConfig

    tree = ast.parse(inspect.getsource(cli_module._run_config))
    (call,) = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "RunConfig"
    ]
    set_by_cli = {k.arg for k in call.keywords}
    names = {f.name for f in fields(RunConfig)}
    not_options = set(cli_module.NOT_CLI_OPTIONS)
    assert not set_by_cli & not_options, set_by_cli & not_options
    assert set_by_cli | not_options == names, {
        "neither set by _run_config nor in NOT_CLI_OPTIONS": sorted(
            names - set_by_cli - not_options
        ),
        "in NOT_CLI_OPTIONS, not a RunConfig field": sorted(not_options - names),
    }


def test_the_run_options_reach_the_runconfig():
    from helpers.course.cli import _run_config, parser
    from helpers.train import RunConfig

    args = parser().parse_args([
        "measure", "--model", "gpt2-tiny", "--batch-size", "3", "--seq-len", "17",
        "--precision", "bf16", "--optimizer", "sgd", "--gradient-checkpointing",
        "--lora-r", "2", "--lora-targets", "c_attn", "--attn", "eager", "--device", "cpu",
        "--warmup", "2", "--repeats", "5", "--no-flops", "--weight-dtype", "bf16",
        "--state-dtype", "fp32", "--bf16-update", "kahan",
    ])  # fmt: skip
    assert _run_config(args) == RunConfig(
        model="gpt2-tiny", batch_size=3, seq_len=17, precision="bf16", optimizer="sgd",
        gradient_checkpointing=True, lora_r=2, lora_targets="c_attn", attn="eager",
        device="cpu", warmup=2, repeats=5, flops=False, weight_dtype="bf16",
        state_dtype="fp32", bf16_update="kahan",
    )  # fmt: skip
    argv = ["estimate", "--model", "bert-tiny", "--batch-size", "2", "--seq-len", "8"]
    defaults = _run_config(parser().parse_args(argv))
    # RunConfig's own defaults, but for attention: a learner's model on the command line gets
    # transformers' default, SDPA (the lessons' eager keeps the attention matrices they count).
    assert defaults == RunConfig(model="bert-tiny", batch_size=2, seq_len=8, attn="sdpa")
