"""The per-tensor state prediction matches what each optimizer really allocates."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers.estimator import optimizer_step_temporaries
from helpers.memory import CategoryTracker
from helpers.optimizer_state import (
    SHARED,
    ParamShape,
    StateTensor,
    bytes_per_param,
    expected_state,
    read_state,
    tracked_bytes,
)
from helpers.train import make_optimizer

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None


class Tiny(torch.nn.Module):
    """An embedding, two large matrices, a small matrix and vectors: every state rule applies."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 96)  # 6144 elements: 8-bit-sized, but an embedding
        self.big = torch.nn.Linear(96, 100)  # 9600 elements, not a multiple of the 256 block
        self.big2 = torch.nn.Linear(100, 96)
        self.small = torch.nn.Linear(96, 4)  # 384 elements: under min_8bit_size

    def forward(self, ids):
        return self.small(self.big2(self.big(self.emb(ids)))).square().mean()


def stepped(model: torch.nn.Module, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    model(torch.arange(8)).backward()
    opt.step()
    return opt


@pytest.mark.parametrize(
    "name, make",
    [
        ("adamw", lambda ps: torch.optim.AdamW(ps)),
        ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
        ("adafactor", lambda ps: torch.optim.Adafactor(ps)),
    ],
)
def test_torch_state_matches_prediction(name, make):
    model = Tiny()
    opt = stepped(model, make(model.parameters()))
    real, predicted = read_state(model, opt), expected_state(model, name)
    assert bytes_per_param(real) == bytes_per_param(predicted)
    assert sorted(real, key=repr) == sorted(predicted, key=repr)  # same keys, shapes, dtypes


def test_transformers_adafactor_matches_prediction():
    from transformers.optimization import Adafactor

    model = Tiny()
    opt = stepped(model, Adafactor(model.parameters(), lr=1e-3, relative_step=False))
    predicted = expected_state(model, "adafactor", impl="transformers")
    assert sorted(read_state(model, opt), key=repr) == sorted(predicted, key=repr)


def test_fused_adamw_keeps_step_on_device():
    model = Tiny()
    opt = stepped(model, torch.optim.AdamW(model.parameters(), fused=True))
    assert bytes_per_param(read_state(model, opt)) == bytes_per_param(
        expected_state(model, "adamw", fused=True)
    )


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes is not installed")
@pytest.mark.parametrize("override", [True, False])
def test_bnb_8bit_state_matches_prediction(override):
    import bitsandbytes as bnb

    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.initialize()  # the manager is process-global: forget earlier tests' overrides
    model = Tiny()
    opt = bnb.optim.AdamW8bit(model.parameters())
    if override:  # as the Trainer does, after building the optimizer (read at the first step)
        manager.register_module_override(model.emb, "weight", {"optim_bits": 32})
    stepped(model, opt)
    real = bytes_per_param(read_state(model, opt))
    predicted = bytes_per_param(expected_state(model, "adamw8bit", embeddings_32bit=override))
    assert real == predicted
    assert SHARED in real  # two 8-bit tensors share the quantisation maps
    assert real["emb.weight"] == (8 * 6144 if override else 2 * 6144 + 2 * 4 * 24)
    assert real["big.weight"] == 2 * 9600 + 2 * 4 * 38  # ceil(9600 / 256) = 38 blocks


@pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes is not installed")
@pytest.mark.parametrize("name", ["lion", "lion8bit"])
def test_bnb_lion_state_matches_prediction(name):
    import bitsandbytes as bnb

    bnb.optim.GlobalOptimManager.get_instance().initialize()  # forget earlier overrides
    model = Tiny()
    opt = stepped(model, make_optimizer(name, model))
    real, predicted = read_state(model, opt), expected_state(model, name)
    assert sorted(real, key=repr) == sorted(predicted, key=repr)
    one = 9600 if name == "lion8bit" else 4 * 9600  # one moment: uint8 codes, or fp32
    assert bytes_per_param(real)["big.weight"] == one + (4 * 38 if name == "lion8bit" else 0)
    assert bytes_per_param(real)["emb.weight"] == 4 * 6144  # fp32: the Trainer's override


def test_muon_state_matches_prediction():
    model = Tiny()
    opt = stepped(model, make_optimizer("muon", model))
    real, predicted = read_state(model, opt), expected_state(model, "muon")
    assert sorted(real, key=repr) == sorted(predicted, key=repr)
    # A plain Module is its own base model: its hidden matrices are every 2-D weight but the
    # embedding's; Muon keeps a momentum buffer for them, AdamW everything else.
    assert set(opt.optimizers["muon"].state) == {model.big.weight, model.big2.weight,
                                                   model.small.weight}  # fmt: skip
    assert bytes_per_param(real)["big.weight"] == 4 * 9600  # no step counter
    assert bytes_per_param(real)["emb.weight"] == 8 * 6144 + 4


def test_muon_leaves_the_head_to_adamw_under_peft_too():
    from helpers.models import apply_lora, build_model, load_config
    from helpers.optimizer_state import hidden_matrices

    model = apply_lora(build_model(load_config("bert-tiny")), 4)  # peft trains the classifier
    hidden = hidden_matrices(model)
    rest = {n for n, p in model.named_parameters() if p.requires_grad and id(p) not in hidden}
    assert all(".classifier." in n for n in rest), rest  # the adapters are all Muon's
    assert any(n.endswith("classifier.modules_to_save.default.weight") for n in rest), rest


def test_muon_step_scratch_is_the_rule():
    """Muon's step scratch, tracked on one matrix, equals optimizer_step_temporaries' rule."""
    for shape in [(64, 48), (48, 64), (32, 32)]:
        layer = torch.nn.Linear(*shape, bias=False)
        layer.weight.grad = torch.randn_like(layer.weight)
        opt = make_optimizer("muon", layer)
        opt.step()  # the state, as a warm-up step makes it
        tracker = CategoryTracker(device=torch.device("cpu"), module_peaks=False)
        tracker.track_external(layer, opt)
        with tracker:
            opt.step()
        params = [ParamShape("w", tuple(layer.weight.shape), hidden=True)]
        assert tracker.peaks().temporaries == optimizer_step_temporaries("muon", params), shape


def test_tracked_bytes_follows_the_tracker_rules():
    rows = [
        StateTensor("w", "exp_avg", (10,), torch.float32),
        StateTensor("w", "step", (), torch.float32, host=True),
    ]
    assert tracked_bytes(rows, torch.device("cpu")) == 44  # everything, exactly
    assert tracked_bytes(rows, torch.device("cuda")) == 512  # device tensors, 512-B blocks


def test_adamw_step_times_compares_implementations():
    from helpers.lessons.optimizers import adamw_step_times
    from helpers.train import RunConfig

    out = adamw_step_times(
        RunConfig(model="bert-tiny", device="cpu"),
        {
            "for-loop": {"foreach": False},
            "foreach": {"foreach": True},
            "bad": {"fused": True, "foreach": True},
        },
        repeats=2,
    )
    assert set(out.comparison.times) == {"for-loop", "foreach"} and "bad" in out.errors
    assert out.comparison.rounds >= 2  # both variants stepped in turns
    assert out.max_diff["foreach"] < 1e-6  # the same update, computed another way


def test_markov_curves_sets_each_runs_learning_rate():
    from helpers.lessons.optimizers import markov_curves
    from helpers.train import RunConfig

    cfg = RunConfig(model="llama-tiny", batch_size=2, seq_len=16, device="cpu")
    curves = markov_curves({"frozen": (cfg, 0.0), "moving": (cfg, 1e-3)}, steps=3)
    frozen, moving = curves.runs["frozen"].losses, curves.runs["moving"].losses
    assert len(frozen) == 3 and frozen[0] == moving[0]  # same model, same first batch
    assert frozen[-1] != moving[-1]  # lr 0 changes nothing; 1e-3 changes the weights
    assert 0 < curves.best_loss < curves.uniform_loss
    assert (curves.best_loss, curves.uniform_loss) == (
        curves.runs["moving"].best_loss,
        curves.runs["moving"].uniform_loss,
    )


def test_trainer_states_reports_what_the_trainer_built_or_why_not():
    """Lesson 06's trained_with cell (the Trainer with optim=...), read by trainer_states."""
    import tempfile
    from types import SimpleNamespace

    from transformers import PrinterCallback

    from helpers.lessons.optimizers import trainer_states
    from helpers.models import build_model, load_config
    from tests.cells import cell_function

    lesson = SimpleNamespace(scale=SimpleNamespace(encoder="bert-tiny"), device=torch.device("cpu"))
    trained_with = cell_function(
        "06_optimizers.ipynb", "trained_with", L=lesson, build_model=build_model,
        load_config=load_config, tempfile=tempfile, PrinterCallback=PrinterCallback,
    )  # fmt: skip
    out = trainer_states(
        lambda optim: trained_with(optim, steps=1), ["adamw_torch", "no_such_optimizer"]
    )
    built, failed = out["adamw_torch"], out["no_such_optimizer"]
    assert built.error is None and built.optimizer_class == "torch.optim.adamw.AdamW"
    assert built.overrides == [] and built.hyper["lr"] == 1e-3
    assert {row.key for row in built.state} == {"exp_avg", "exp_avg_sq", "step"}
    assert failed.error.startswith("ValueError") and failed.state == []


def test_import_bitsandbytes_returns_the_module_or_none():
    from helpers.lessons.optimizers import import_bitsandbytes

    bnb = import_bitsandbytes()
    assert (bnb is None) == (not HAS_BNB)
    if HAS_BNB:
        assert hasattr(bnb.optim, "AdamW8bit")


def test_state_rules_match_real_optimizers_on_one_matrix():
    """Section 4's table: each rule's bytes for one matrix are what the installed library keeps,
    its optim= names are the Trainer's, and measurements land in their rows."""
    from transformers.optimization import Adafactor
    from transformers.training_args import OptimizerNames

    from helpers.lessons.optimizers import STATE_RULES, state_rule_table

    rules = {rule.key or rule.optim: rule for rule in STATE_RULES}
    assert {rule.optim for rule in STATE_RULES if rule.optim} <= {o.value for o in OptimizerNames}
    makers = {
        "adamw_torch": lambda ps: torch.optim.AdamW(ps),
        "adafactor": lambda ps: Adafactor(ps, lr=1e-3, relative_step=False),
        "muon": lambda ps: torch.optim.Muon(ps),
    }
    if HAS_BNB:
        import bitsandbytes as bnb

        bnb.optim.GlobalOptimManager.get_instance().initialize()  # no earlier overrides
        makers |= {
            "adamw_bnb_8bit": lambda ps: bnb.optim.AdamW8bit(ps),
            "lion_32bit": lambda ps: bnb.optim.Lion(ps),
            "lion_8bit": lambda ps: bnb.optim.Lion8bit(ps),
        }
    for key, make in makers.items():
        layer = torch.nn.Linear(128, 96, bias=False)  # 12288 values: 8-bit sized, 48 blocks
        layer.weight.grad = torch.randn_like(layer.weight)
        opt = make([layer.weight])
        opt.step()
        real = sum(r.nbytes for r in read_state(layer, opt))
        assert real == rules[key].matrix_bytes(96, 128, 0), key
    rows = {r["optimizer"]: r for r in state_rule_table({"adamw_torch": 8.5, "muon": 5.0})}
    per = {name: r["4096 x 4096 matrix"] for name, r in rows.items()}
    assert per["AdamW (torch)"] == 8.0 and per["Lion (bitsandbytes)"] == 4.0
    assert per["4-bit AdamW (torchao)"] == 1.0625 and per["GaLore AdamW"] == 0.375  # rank 128
    assert rows["Muon (torch.optim) + AdamW"]["tiny encoder (measured)"] == 5.0
    assert rows["8-bit Lion"]["tiny encoder (measured)"] is None
    assert rows["8-bit Lion"]["obtained"].endswith("not measured here")
