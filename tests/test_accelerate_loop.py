"""Lesson 07: the loop the notebook shows is the loop the module runs, and measuring it
changes nothing it computes."""

from __future__ import annotations

import ast
import inspect
import json
import sys
from pathlib import Path

import pytest

from helpers.isolate import call_isolated
from helpers.lessons import accelerate_loop as lesson
from tests.cells import cell_definition


def test_the_notebook_writes_out_the_module_loop():
    # The learner reads and runs the notebook's copy; the script and `accelerate launch` run
    # the module's. They must be the same code (comments and formatting aside).
    cell = cell_definition("07_accelerate_loop.ipynb", "accelerate_train")
    module = ast.parse(inspect.getsource(lesson.accelerate_train)).body[0]
    assert ast.dump(cell) == ast.dump(module), "notebook 07's accelerate_train() drifted"


def _plain_and_measured(cfg: lesson.LoopConfig):
    """The loop run as is, then through the measuring wrapper, in one fresh process."""
    model, optimizer, loader, scheduler = lesson.loop_parts(cfg)
    plain = list(lesson.accelerate_train(cfg, model, optimizer, loader, scheduler))
    return plain, lesson.train_loop(cfg)


def test_the_measuring_wrapper_trains_exactly_as_the_plain_loop():
    cfg = lesson.LoopConfig(seq_len=32, optimizer="adamw", max_steps=3, cpu=True)
    plain, measured = call_isolated(_plain_and_measured, cfg).unwrap()
    # Same code, seed and data, deterministic CPU kernels: identical losses, bit for bit.
    assert measured.losses == plain and len(plain) == cfg.max_steps
    # Every step but the tracked one is timed; the tracked one has its memory.
    assert len(measured.step_times) == cfg.max_steps - 1
    assert measured.memory["params"] == 4 * measured.n_params
    assert measured.memory["optimizer_state"] >= 8 * measured.n_params  # AdamW's two moments
    assert measured.mixed_precision == "bf16" and measured.device == "cpu"


def test_the_trainer_twin_trains_the_loops_configuration():
    """trainer_run with lesson 07's cell (the loop's configuration as TrainingArguments)."""
    from helpers.compat import trainer_checkpointing
    from tests.cells import cell_function

    arguments = cell_function(
        "07_accelerate_loop.ipynb", "loop_as_trainer_arguments",
        trainer_checkpointing=trainer_checkpointing,
    )  # fmt: skip
    cfg = lesson.LoopConfig(seq_len=32, optimizer="adamw", max_steps=2, cpu=True)
    run = call_isolated(lesson.trainer_run, cfg, arguments).unwrap()
    assert len(run.losses) == cfg.max_steps and all(0 < x < 10 for x in run.losses)
    assert run.memory["weight_copies"] > 0  # bf16=True: autocast made 16-bit weight copies
    assert run.memory["optimizer_state"] >= 8 * run.n_params  # AdamW's two moments, tracked


def _accumulation_demo():
    """Lesson 07's "Try it" experiment, from its cell."""
    from tests.cells import cell_function

    return cell_function("07_accelerate_loop.ipynb", "accumulation_demo")


@pytest.mark.parametrize("k", [1, 4, 12])
def test_accumulate_steps_once_per_window_with_the_big_batch_gradient(k):
    demo = call_isolated(_accumulation_demo(), k).unwrap()
    assert demo["optimizer_steps"] == 12 // k
    # fp32 sums of at most 48 samples' gradients: rounding is ~1e-7 relative; 1e-5 is far
    # from the factor k that a missing 1/k on the loss would give.
    assert abs(demo["ratio"] - 1) < 1e-5 and demo["max_diff"] < 1e-5, demo


def test_accumulation_demo_refuses_a_window_that_does_not_divide_the_micro_batches():
    with pytest.raises(ValueError, match="must divide 12"):
        _accumulation_demo()(5)


class _Writes:
    """A stdout that keeps each write() call apart, as an unbuffered pipe does."""

    def __init__(self):
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_the_script_writes_its_json_line_in_one_write(monkeypatch):
    # Under `accelerate launch` every process writes to the same pipe. Unbuffered
    # (PYTHONUNBUFFERED=1), a line written in two pieces can be split by the other process's.
    result = lesson.LoopResult(losses=[0.5, 0.25], n_params=3, process_index=1, num_processes=2)
    monkeypatch.setattr(lesson, "train_loop", lambda cfg: result)
    out = _Writes()
    monkeypatch.setattr("sys.stdout", out)
    assert lesson.main(["--max-steps", "2"]) == 0
    assert len(out.calls) == 1 and out.calls[0].endswith("\n")
    row = json.loads(out.calls[0])
    assert row["losses"] == [0.5, 0.25] and row["process_index"] == 1


def test_the_script_falls_back_to_adamw_without_bitsandbytes(monkeypatch, capsys):
    # A GPU image often lacks bitsandbytes: the script's default 8-bit AdamW must not kill it.
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails, find_spec: None
    ran = []
    monkeypatch.setattr(lesson, "train_loop", lambda cfg: ran.append(cfg) or lesson.LoopResult())
    assert lesson.main(["--max-steps", "1"]) == 0
    assert ran[0].optimizer == "adamw"
    assert "bitsandbytes is not installed" in capsys.readouterr().err
    # Asked for by name, it says what to do instead of training something else.
    with pytest.raises(SystemExit) as stop:
        lesson.main(["--optimizer", "adamw8bit"])
    assert stop.value.code == 2 and "pick --optimizer adamw" in capsys.readouterr().err


def test_the_script_trains_with_adamw_when_bitsandbytes_is_missing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    assert lesson.main(["--max-steps", "1", "--mixed-precision", "no", "--cpu"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert len(row["losses"]) == 1 and row["losses"][0] > 0


def _resumable_run(resumable_train, cfg, folder, **checkpoint) -> list[float]:
    """The notebook's resumable_train on fresh parts, in the calling (fresh) process."""
    return list(resumable_train(cfg, *lesson.loop_parts(cfg), folder, **checkpoint))


def _plain_run(cfg) -> list[float]:
    return list(lesson.accelerate_train(cfg, *lesson.loop_parts(cfg)))


def test_save_state_then_load_state_in_a_fresh_process_resumes_bit_for_bit(tmp_path):
    from tests.cells import cell_function

    resumable_train = cell_function("07_accelerate_loop.ipynb", "resumable_train")
    cfg = lesson.LoopConfig(seq_len=32, optimizer="adamw", max_steps=4, cpu=True)
    folder = str(tmp_path / "state")

    def run(**checkpoint):
        return call_isolated(_resumable_run, resumable_train, cfg, folder, **checkpoint).unwrap()

    uninterrupted = run(save_after=2)
    resumed = run(resume_from=2)  # another fresh process: only the folder carries over
    # Saving changes no step, and the resumed steps are the uninterrupted ones: the weights,
    # AdamW's moments and the RNG (BERT's dropout) come back, the data goes on from batch 8.
    assert uninterrupted == call_isolated(_plain_run, cfg).unwrap()
    assert resumed == uninterrupted[2:], (uninterrupted, resumed)


def test_the_guides_variable_size_accumulation_gives_the_one_batch_gradient():
    import torch

    from tests.cells import cell_function

    token_accumulation = cell_function("07_accelerate_loop.ipynb", "token_accumulation")
    g = torch.Generator().manual_seed(1)
    labels = [torch.randint(0, 11, (n,), generator=g) for n in (16, 16, 16)]
    labels[1][3:] = -100  # 3, 16 and 9 real tokens: means of means would be far off
    labels[2][9:] = -100
    # fp32 sums over 28 tokens: ~1e-7 relative; a missing factor (k, or the count) is O(1).
    assert call_isolated(token_accumulation, labels).unwrap() < 1e-5


def _two_epochs_in_one_run(folder: str) -> None:
    """recipes/accelerate_loop.py's own functions, two epochs of 2 steps in one process."""
    import runpy

    recipe = runpy.run_path(str(Path(__file__).resolve().parents[1] / "recipes/accelerate_loop.py"))
    args = recipe["parse_args"](["--steps", "2", "--device", "cpu"])
    model, optimizer, loader, device = recipe["build"](args)
    for _epoch in range(2):
        recipe["train"](args, model, optimizer, loader, device)
    args.accelerator.save_state(folder)


def test_the_recipe_resumes_from_its_checkpoint_as_its_next_epoch(tmp_path):
    """Run twice with --checkpoint (two processes, as a learner does): the weights and AdamW's
    state equal those of one run that trains a second epoch, bit for bit."""
    import os
    import subprocess

    import torch
    from safetensors.torch import load_file

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "accelerate_loop.py"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(recipe), "--steps", "2", "--device", "cpu"]
    for _run in range(2):
        subprocess.run([*cmd, "--checkpoint", str(tmp_path / "resumed")], check=True, env=env,
                       capture_output=True, timeout=300)  # fmt: skip
    call_isolated(_two_epochs_in_one_run, str(tmp_path / "one_run")).unwrap()
    resumed, one_run = (
        load_file(tmp_path / d / "model.safetensors") for d in ("resumed", "one_run")
    )
    assert resumed.keys() == one_run.keys()
    assert all(torch.equal(resumed[k], one_run[k]) for k in resumed)
    state = torch.load(tmp_path / "resumed" / "optimizer.bin", weights_only=False)["state"]
    assert {float(s["step"]) for s in state.values()} == {4.0}  # 2 steps + 2 resumed
