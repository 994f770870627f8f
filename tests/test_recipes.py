"""recipes/: each technique as a plain script a learner copies.

Every recipe runs here with its defaults and two steps (in this process where it can, in a
fresh one where it launches processes or sets up torch.distributed), differs from
recipes/base.py only inside its marked blocks, imports no course code, and, where a lesson
measures the same setting, trains with the same bytes per category as the lesson measured.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.compat import importable

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
NAMES = sorted(p.stem for p in RECIPES.glob("*.py"))
LIBRARIES = {"torch", "transformers", "accelerate", "peft", "bitsandbytes", "deepspeed",
             "datasets", "torchao", "optimi"}  # fmt: skip
# Recipes that start processes or a process group run in a fresh process, as a learner runs them.
LAUNCHED = {"ddp": "torchrun", "fsdp2": "torchrun", "deepspeed_offload": "python",
            "accelerate_loop": "python"}  # fmt: skip


def test_every_technique_the_course_teaches_has_a_recipe():
    wanted = {"base", "accumulation", "checkpointing", "mixed_precision", "optimizers",
              "accelerate_loop", "deepspeed_offload", "attention", "data_loading", "compile",
              "lora", "optimizer_in_backward", "selective_checkpointing", "activation_offload",
              "chunked_loss", "packing", "fp8", "ddp", "fsdp2", "profile_memory",
              "pure_bf16"}  # fmt: skip
    assert wanted <= set(NAMES), f"missing: {sorted(wanted - set(NAMES))}"


@pytest.mark.parametrize("name", [n for n in NAMES if n != "base"])
def test_a_recipe_differs_from_the_base_only_in_its_marked_blocks(name):
    from helpers.recipes import body_lines, marked, stray_changes

    assert any(marked(body_lines(name))), f"{name}.py marks no change (# >>> title ... # <<<)"
    assert stray_changes(name) == []


def test_the_markers_pair_up_and_strays_are_found(tmp_path, monkeypatch):
    from helpers import recipes

    assert recipes.marked(["a", "# >>> x", "b", "# <<<", "c"]) == [False, True, True, True, False]
    for unpaired in (["# >>> x", "b"], ["b", "# <<<"], ["# >>> x", "# >>> y", "# <<<"]):
        with pytest.raises(ValueError):
            recipes.marked(unpaired)
    base = "\n".join(['"""base"""', "import torch", "x = 1", "y = 2", "print(x, y)"])
    (tmp_path / "base.py").write_text(base)
    (tmp_path / "good.py").write_text(base.replace("x = 1", "# >>> t\nx = 3\n# <<<"))
    (tmp_path / "bad.py").write_text(base.replace("x = 1", "x = 3"))
    (tmp_path / "gone.py").write_text(base.replace("y = 2\n", ""))
    monkeypatch.setattr(recipes, "RECIPES", tmp_path)
    assert recipes.stray_changes("good") == []
    assert recipes.stray_changes("bad") == ["changed: 'x = 3'"]
    assert recipes.stray_changes("gone") == ["removed without a block: 'y = 2'"]
    diff = recipes.recipe_diff("good")
    assert (diff.added, diff.removed) == (3, 1) and "-x = 1" in diff.text
    assert "```diff" in diff._repr_markdown_()


@pytest.mark.parametrize("name", NAMES)
def test_a_recipe_imports_only_the_libraries_it_teaches(name):
    tree = ast.parse((RECIPES / f"{name}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            roots = [(node.module or "").split(".")[0]]
        else:
            continue
        for root in roots:
            assert root in LIBRARIES or root in sys.stdlib_module_names, (
                f"{name}.py imports {root!r}: a recipe imports only the standard library and "
                f"{', '.join(sorted(LIBRARIES))}"
            )


def run_here(name: str, *args: str) -> str:
    """Run recipes/<name>.py as its own ``__main__`` in this process; its printed output.

    A recipe that cannot run here (a missing package, no GPU of the kind it needs) exits with
    a message that says so: the test is then skipped with that message as its reason.
    """
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [str(RECIPES / f"{name}.py"), *args]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code in (None, 0):
            return out.getvalue()
        message = str(stop.code)
        if "pip install" in message or message.startswith("needs "):
            pytest.skip(f"{name}.py: {message}")
        raise AssertionError(f"{name}.py exited with {message!r}") from None
    finally:
        sys.argv = argv
    return out.getvalue()


def run_launched(name: str, *args: str) -> str:
    """Run recipes/<name>.py in a fresh process (under torchrun with two CPU processes where
    it is a distributed recipe); its output."""
    script = str(RECIPES / f"{name}.py")
    if LAUNCHED[name] == "torchrun":
        # --standalone: torchrun picks a free port itself (--master-port 0 would hand the
        # workers port 0, on which they wait forever: pytorch/pytorch#130656).
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", script, *args]  # fmt: skip
    else:
        cmd = [sys.executable, script, *args]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    if done.returncode != 0:
        message = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        if "pip install" in message or message.startswith("needs "):
            pytest.skip(f"{name}.py: {message}")
        raise AssertionError(f"{name}.py failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


# Where a lesson measures the same setting (recipe[:variant]): the recipe's flags (none: its
# defaults), the lesson's RunConfig, and bytes the lesson's step holds that the recipe's does
# not (exact, each with its reason).
SAME_SETTING = {
    "base": ((), {}, {}),
    # helpers.train.train_step keeps a running total of the micro-batches' losses (a float32
    # scalar tensor, 4 bytes on the CPU) while the next micro-batch runs its forward.
    "accumulation": ((), {"grad_accum": 4}, {"activations": 4}),
    "checkpointing": ((), {"gradient_checkpointing": True}, {}),
    "mixed_precision": ((), {"precision": "bf16"}, {}),
    "pure_bf16": ((), {"precision": "bf16", "weight_dtype": "bf16", "bf16_update": "kahan"}, {}),
    "optimizers": ((), {"optimizer": "adafactor"}, {}),
    "optimizers:adamw8bit": (("--optim", "adamw8bit"), {"optimizer": "adamw8bit"}, {}),
    "optimizers:lion": (("--optim", "lion"), {"optimizer": "lion"}, {}),
    "optimizers:lion8bit": (("--optim", "lion8bit"), {"optimizer": "lion8bit"}, {}),
    "optimizers:muon": (("--optim", "muon"), {"optimizer": "muon"}, {}),
    "lora": ((), {"lora_r": 16, "lora_targets": "all-linear"}, {}),
    "lora:dora": (("--dora",), {"lora_r": 16, "lora_targets": "all-linear", "dora": True}, {}),
    "chunked_loss": ((), {"loss_chunk": 128}, {}),
}


# The recipes of SAME_SETTING train with their defaults in that test, tracked.
@pytest.mark.parametrize("name", [n for n in NAMES if n not in SAME_SETTING])
def test_a_recipe_trains_with_its_defaults(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # whatever a recipe writes (a trace, a snapshot) lands here
    args = ("--steps", "2", "--device", "cpu")
    out = run_launched(name, *args) if name in LAUNCHED else run_here(name, *args)
    assert "step 2" in out and "tokens/s" in out, out


def test_fsdp2_in_bf16_with_checkpointing_saves_a_distributed_checkpoint(tmp_path):
    """recipes/fsdp2.py --bf16 --checkpointing --save on two CPU processes: each writes its
    shards; read back whole (DCP's offline converter), the weights are every parameter at its
    full shape and still fp32 (MixedPrecisionPolicy computes in bf16 over fp32 shards), with
    AdamW's state beside them."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from helpers.models import build_model, load_config

    folder = tmp_path / "dcp"
    out = run_launched("fsdp2", "--steps", "2", "--device", "cpu", "--bf16", "--checkpointing",
                       "--save", str(folder))  # fmt: skip
    assert "step 2" in out
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    dcp_to_torch_save(folder, tmp_path / "whole.pt")
    saved = torch.load(tmp_path / "whole.pt", weights_only=False)
    model = build_model(load_config("llama-tiny"))
    weights = {k: v for k, v in saved["model"].items()}
    assert {k: tuple(v.shape) for k, v in weights.items()} == {
        k: tuple(v.shape) for k, v in model.state_dict().items() if "rotary" not in k
    }
    assert {v.dtype for v in weights.values()} == {torch.float32}
    assert len(saved["optimizer"]["state"]) == len(weights)  # exp_avg, exp_avg_sq, step each


@pytest.fixture(scope="module")
def training_config(tmp_path_factory):
    """The lessons' llama-tiny with ``use_cache`` off, as the recipes build it. (The lessons'
    models keep transformers' default, a KV cache even in training, which the estimator
    models; in fp32 it holds the tensors autograd saves anyway, in 16-bit it adds copies.)"""
    from helpers.models import config_path

    settings = json.loads(config_path("llama-tiny").read_text())
    path = tmp_path_factory.mktemp("config") / "llama-tiny-no-cache.json"
    path.write_text(json.dumps({**settings, "use_cache": False}))
    return str(path)


@pytest.mark.parametrize("name", sorted(SAME_SETTING))
def test_the_recipe_trains_in_the_bytes_its_lesson_measured(name, training_config):
    """The course's tracker over the recipe's own training step gives the bytes per category
    that the lesson's measurement of the same setting gives: the code a learner copies is the
    code that was measured."""
    from helpers.memory import CategoryTracker, dora_graphs_collected
    from helpers.train import RunConfig, Trainee

    flags, fields, harness = SAME_SETTING[name]
    name = name.split(":")[0]
    if fields.get("bf16_update") == "kahan" and not importable("optimi"):
        pytest.skip(f"{name}.py: torch-optimi is not installed (pip install torch-optimi)")
    if fields.get("optimizer", "") in ("adamw8bit", "lion", "lion8bit") and not importable(
        "bitsandbytes"
    ):
        pytest.skip(f"{name}.py {' '.join(flags)}: bitsandbytes is not installed")
    recipe = runpy.run_path(str(RECIPES / f"{name}.py"), run_name="recipe")
    args = recipe["parse_args"](["--config", training_config, "--steps", "1", "--device", "cpu",
                                 *flags])  # fmt: skip
    model, optimizer, loader, device = recipe["build"](args)
    batches = list(loader)  # collated before the tracked step, as the lesson's batch is
    with contextlib.redirect_stdout(io.StringIO()):
        recipe["train"](args, model, optimizer, batches, device)  # creates the optimizer state
        tracker = CategoryTracker(device=device)
        tracker.track_external(model, optimizer)
        with dora_graphs_collected(model), tracker:  # (a no-op without DoRA)
            times = recipe["train"](args, model, optimizer, batches, device)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            recipe["report"](args, times, device)  # main() is parse_args, build, train, report
    assert "tokens/s" in printed.getvalue()
    ours = tracker.peaks().as_dict()
    # The lesson's measurement (helpers.train.measure's exact view, without its timing):
    # a step that creates the optimizer state, then one tracked steady-state step.
    trainee = Trainee(RunConfig(model=training_config, attn="sdpa", batch_size=4, seq_len=64,
                                device="cpu", **fields))  # fmt: skip
    trainee.step()
    tracker = CategoryTracker(device=trainee.device)
    tracker.track_external(trainee.model, trainee.optimizer)
    with dora_graphs_collected(trainee.model), tracker:
        trainee.step()
    lesson = tracker.peaks().as_dict()
    keys = ("params", "gradients", "optimizer_state", "activations", "temporaries", "peak")
    assert {k: ours[k] + harness.get(k, 0) for k in keys} == {k: lesson[k] for k in keys}


def test_every_recipe_has_its_command_in_the_readme():
    readme = (RECIPES.parent / "README.md").read_text()
    table = readme[readme.index("## Recipes") :]
    table = table[: table.index("\n## ")]
    for name in NAMES:
        assert f"recipes/{name}.py" in table, f"README's recipe table has no row for {name}.py"
