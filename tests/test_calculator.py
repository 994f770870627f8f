"""The memory calculator (helpers/course/calculator.py): its table, live widgets, errors, figure.

The widgets are driven as a front end would: a control's ``.value`` is set, the Suggest
button is clicked. ipywidgets works without a kernel (its messages go nowhere), so this runs
in plain pytest, on the CPU, in a few seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers.compat import importable
from helpers.course.calculator import (
    CATEGORIES,
    INSTALL_HINT,
    WIDGET_MIME,
    Calculator,
    CalculatorSetting,
    StaticCalculator,
    calculator,
    calculator_figure,
    evaluate,
    verdict_html,
)
from helpers.estimator import estimate
from helpers.models import config_path
from tests.plot_checks import figure_problems

# The live calculator is ipywidgets; without it calculator() falls back to the static table
# (tested here too), as on a GPU image that lacks ipywidgets.
needs_widgets = pytest.mark.skipif(
    not importable("ipywidgets"), reason="ipywidgets is not installed: the static table is shown"
)


def test_importing_helpers_stays_cheap_and_the_calculator_is_callable():
    code = (
        "import sys, helpers; "
        "assert not {'ipywidgets', 'matplotlib', 'torch'} & set(sys.modules), sys.modules.keys(); "
        "assert callable(helpers.calculator); import helpers.course.calculator as c; "
        "assert helpers.calculator is c and 'ipywidgets' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_static_table_shows_every_category_and_the_estimators_numbers():
    shown = calculator("llama-tiny", batch_size=2, seq_len=64, precision="bf16", card="l4",
                       interactive=False)  # fmt: skip
    assert isinstance(shown, StaticCalculator)
    assert shown.estimate == estimate("llama-tiny", 2, 64, "bf16", device="cuda")
    page, text = shown._repr_html_(), repr(shown)
    for cat in CATEGORIES:
        assert cat.replace("_", " ") in page and cat.replace("_", " ") in text
    assert f"{shown.estimate.peak:,}" in page and "L4 usable" in text
    assert "fits: " in text and INSTALL_HINT not in text


def test_outside_a_kernel_the_default_is_the_static_table():
    assert isinstance(calculator(), StaticCalculator)


@needs_widgets
def test_the_widget_carries_its_view_and_the_static_table():
    calc = calculator(interactive=True)
    assert isinstance(calc, Calculator)
    bundle = calc._repr_mimebundle_()
    assert WIDGET_MIME in bundle and "model_id" in bundle[WIDGET_MIME]
    assert "<table>" in bundle["text/html"] and "peak" in bundle["text/plain"]
    assert calc.estimate == estimate("llama-tiny", 4, 256, device="cuda")
    assert calc.plot.outputs[0]["data"]["image/png"]  # the figure, drawn


@needs_widgets
def test_changing_a_control_updates_the_estimate_and_the_verdict():
    calc = calculator(interactive=True, batch_size=1)
    before, verdict = calc.estimate, calc.verdict.value
    calc.controls["batch_size"].value = 8
    assert calc.estimate.activations > before.activations
    assert calc.estimate == estimate("llama-tiny", 8, 256, device="cuda")
    assert calc.verdict.value != verdict and "fits" in calc.verdict.value
    calc.controls["card"].value = "h100"
    assert "H100" in calc.verdict.value and "H100" in calc.figure.axes[1].get_title()


@needs_widgets
def test_a_big_model_on_a_small_card_does_not_fit():
    calc = calculator("llama-7b", seq_len=512, interactive=True)
    assert "does not fit" in calc.verdict.value and calc.result.fits is False


@pytest.mark.parametrize(
    "control, value, message",
    [
        ("seq_len", 5000, "exceeds max_position_embeddings (1024)"),
        ("config_path", "no/such/config.json", "no config file no/such/config.json"),
        ("qlora", True, "QLoRA trains LoRA adapters"),
        ("batch_size", 0, "must be positive"),
        ("weight_dtype", "bf16", "bf16 weights compute in bf16, not fp32"),
    ],
)
@needs_widgets
def test_a_setting_the_estimator_refuses_is_one_red_line(control, value, message):
    calc = calculator(interactive=True)
    calc.controls[control].value = value  # does not raise
    assert calc.estimate is None and message in calc.error
    assert message in calc.verdict.value and "color:#b00020" in calc.verdict.value
    assert calc.plot.outputs == () and calc.figure is None
    assert message in calc._repr_mimebundle_()["text/html"]
    calc.controls["config_path"].value = ""
    calc.controls["qlora"].value = False
    calc.controls["weight_dtype"].value, calc.controls["bf16_update"].value = "fp32", "nearest"
    calc.controls["seq_len"].value, calc.controls["batch_size"].value = 256, 4
    assert calc.estimate is not None and calc.error == ""


@needs_widgets
def test_a_config_path_typed_in_overrides_the_model_list(tmp_path):
    data = json.loads(config_path("llama-tiny").read_text())
    data["num_hidden_layers"] = 4
    path = tmp_path / "deeper.json"
    path.write_text(json.dumps(data))
    calc = calculator(interactive=True)
    calc.controls["config_path"].value = str(path)
    assert calc.controls["model"].disabled
    assert calc.estimate == estimate(str(path), 4, 256, device="cuda")


@needs_widgets
def test_suggest_names_the_fastest_setup_that_fits():
    calc = calculator("llama-tiny", card="t4", interactive=True)
    calc.suggest_button.click()
    best = calc.plan.best
    assert best is not None and best.label in calc.suggestion.value
    assert calc.plan.reason.split(":")[0] in calc.suggestion.value
    calc.controls["batch_size"].value = 2  # the suggestion was for another setup
    assert calc.plan is None and "ask again" in calc.suggestion.value


@needs_widgets
def test_suggest_on_a_refused_setting_is_one_red_line():
    calc = calculator(interactive=True)
    calc.controls["seq_len"].value = 5000
    calc.suggest_button.click()
    assert "max_position_embeddings" in calc.suggestion.value and not calc.suggest_button.disabled


def test_without_ipywidgets_the_static_table_says_how_to_get_widgets(monkeypatch):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets: ImportError
    shown = calculator(interactive=True)
    assert isinstance(shown, StaticCalculator) and shown.estimate is not None
    assert INSTALL_HINT in shown._repr_html_() and INSTALL_HINT in repr(shown)


def test_an_unknown_card_names_the_cards():
    with pytest.raises(ValueError, match=r"unknown card 'a100'.*t4"):
        calculator(card="a100", interactive=False)


def test_a_card_without_bf16_says_so():
    result = evaluate(CalculatorSetting(precision="bf16", card="t4"))
    assert "cannot train in bf16" in result.verdict and "7.5" in result.verdict


@pytest.mark.parametrize(
    "setting",
    [
        CalculatorSetting(),  # a sliver of the card
        CalculatorSetting(model="bert-large", seq_len=512),  # close to the card
        CalculatorSetting(model="llama-7b", seq_len=512),  # far over it
        CalculatorSetting(model="gpt2-tiny", lora_r=8, card="a100-mig"),  # traced, longest name
    ],
    ids=["sliver", "close", "over", "traced-mig"],
)
def test_the_calculator_figure_reads_cleanly(setting):
    result = evaluate(setting)
    fig = calculator_figure(result)
    assert figure_problems(fig) == []
    assert len(fig.axes[1].lines) == 2  # the card's usable and total memory


@needs_widgets
def test_the_widgets_figure_reads_cleanly():
    calc = calculator(interactive=True)
    assert figure_problems(calc.figure) == []


@needs_widgets
def test_apply_sets_the_controls_to_the_suggestion_and_estimates_it():
    calc = calculator("bert-large", batch_size=8, seq_len=512, card="t4", interactive=True)
    assert calc.apply_button.layout.display == "none"  # nothing to apply yet
    calc.suggest_button.click()
    best = calc.plan.best
    assert best is not None and calc.apply_button.layout.display != "none"
    calc.apply_button.click()
    setting = calc.setting
    assert (setting.batch_size, setting.grad_accum, setting.precision, setting.optimizer) == (
        best.micro_batch, best.grad_accum, best.precision, best.optimizer
    )  # fmt: skip
    assert calc.estimate.peak == best.estimated_peak and calc.result.runs
    assert "Applied" in calc.suggestion.value and calc.plan is not None


@needs_widgets
def test_suggest_reports_its_progress_in_the_suggestion_line(monkeypatch):
    import helpers.course.calculator as calc_module

    seen = []
    real = calc_module.suggest
    monkeypatch.setattr(
        calc_module, "suggest", lambda s, report: real(s, lambda d, t: seen.append((d, t)))
    )
    calculator("llama-tiny", card="t4", interactive=True).suggest_button.click()
    # One report per estimate; setups the search leaves out (smaller micro-batches of one that
    # fits) count as done with it, so the count rises by one or more and ends at the total.
    done = [d for d, _ in seen]
    assert seen and seen[-1][0] == seen[-1][1] and len({t for _, t in seen}) == 1
    assert done == sorted(set(done)) and done[0] >= 1


def test_a_fitting_peak_in_a_precision_the_card_lacks_is_not_called_fits():
    result = evaluate(CalculatorSetting(precision="tf32", card="t4"))
    assert result.fits and not result.runs
    assert result.verdict.startswith("not on this card: ") and "cannot train in tf32" in (
        result.verdict
    )
    assert "color:#b00020" in verdict_html(result)
    assert evaluate(CalculatorSetting(precision="fp16", card="t4")).verdict.startswith("fits: ")


@needs_widgets
def test_bf16_weights_are_a_choice_of_the_calculator():
    """Weights in bf16 with Kahan's AdamW: the estimator's numbers for that setting, half the
    weights' bytes of fp32, and the setting named in the table."""
    calc = calculator(precision="bf16", card="l4", interactive=True)
    fp32_params = calc.estimate.params
    calc.controls["weight_dtype"].value = "bf16"
    calc.controls["bf16_update"].value = "kahan"
    want = estimate("llama-tiny", 4, 256, "bf16", attn="eager", device="cuda",
                    weight_dtype="bf16", bf16_update="kahan")  # fmt: skip
    assert calc.estimate == want and calc.error == ""
    assert calc.estimate.params < 0.51 * fp32_params and calc.estimate.weight_copies == 0
    assert "bf16 weights (kahan updates)" in calc._repr_mimebundle_()["text/plain"]


@needs_widgets
def test_the_bf16_update_applies_only_to_trained_bf16_weights():
    """The bf16 AdamW update is greyed out, and left out of the setting, unless the controls
    train bf16 weights: going back to fp32 weights (or to LoRA) is not refused for it."""
    calc = calculator(precision="bf16", card="l4", interactive=True)
    assert calc.controls["bf16_update"].disabled
    calc.controls["weight_dtype"].value = "bf16"
    calc.controls["bf16_update"].value = "kahan"
    assert not calc.controls["bf16_update"].disabled and calc.setting.bf16_update == "kahan"
    calc.controls["lora_r"].value = 8  # LoRA's adapters train in fp32 on the bf16 base
    assert calc.controls["bf16_update"].disabled and calc.setting.bf16_update == "nearest"
    assert calc.error == "", calc.error
    calc.controls["lora_r"].value = 0
    calc.controls["weight_dtype"].value = "fp32"
    assert calc.setting.bf16_update == "nearest" and calc.error == "", calc.error
    calc.controls["precision"].value = "tf32"
    calc.controls["card"].value = "t4"
    assert "cannot train in tf32" in calc.result.verdict


@needs_widgets
def test_lesson_16s_settings_are_choices_of_the_calculator():
    """Selective checkpointing, offload, the step in backward and the chunked loss: the
    estimator's numbers for each, and the setting named in the table."""
    calc = calculator(precision="bf16", card="l4", interactive=True)
    calc.controls["gradient_checkpointing"].value = True
    calc.controls["checkpoint_policy"].value = "selective"
    want = estimate("llama-tiny", 4, 256, "bf16", attn="eager", device="cuda",
                    gradient_checkpointing=True, checkpoint_policy="selective")  # fmt: skip
    assert calc.estimate == want and calc.error == ""
    assert "selective checkpointing" in calc._repr_mimebundle_()["text/plain"]
    calc.controls["gradient_checkpointing"].value = False
    assert "turn gradient_checkpointing on" in calc.error
    calc.controls["checkpoint_policy"].value = "full"
    calc.controls["offload_activations"].value = True
    assert calc.estimate == estimate("llama-tiny", 4, 256, "bf16", attn="eager", device="cuda",
                                     offload_activations=True)  # fmt: skip
    calc.controls["offload_activations"].value = False
    calc.controls["optimizer_in_backward"].value = True
    calc.controls["loss_chunk"].value = 64
    assert calc.estimate == estimate("llama-tiny", 4, 256, "bf16", attn="eager", device="cuda",
                                     optimizer_in_backward=True, loss_chunk=64)  # fmt: skip
    text = calc._repr_mimebundle_()["text/plain"]
    assert "optimizer step in backward" in text and "chunks of 64 tokens" in text
