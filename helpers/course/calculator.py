"""A memory calculator for JupyterLab: ``helpers.calculator()`` drives the estimator live.

In a running kernel with ipywidgets, ``calculator(...)`` returns a ``Calculator``: controls
for the model (a bundled config, or a config JSON path typed in), micro-batch, sequence
length, precision, the weights' dtype (bf16 with no fp32 copy) and their AdamW update, optimizer,
gradient checkpointing, accumulation, LoRA rank (0: full
fine-tuning), QLoRA, attention and a reference GPU. Every change re-estimates one training
step with the estimator's CUDA branch (``helpers.estimator.estimate(..., device="cuda")``,
no GPU needed) and redraws the categories, the peak and the card's memory, with a one-line
verdict. A button asks the planner (``plan_for_card``) for the fastest setup that fits.
An estimator error a learner can act on (a sequence longer than the model's positions, a
config file that is not there) is one red line, never a traceback.

Without a kernel or without ipywidgets it returns a ``StaticCalculator``: the same numbers as
a table (HTML and text), with the ``Estimate`` as an attribute. The widget object also
carries that table in its mimebundle, so a page without the widget manager (nbconvert HTML,
nbval) still shows the numbers. The module is callable: ``helpers.calculator(...)`` is
``helpers.calculator.calculator(...)``.
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import os
import re
import sys
import types
import warnings
from dataclasses import dataclass, replace
from importlib import resources
from typing import TYPE_CHECKING

from helpers.names import (
    ATTENTION,
    BF16_UPDATES,
    CHECKPOINT_POLICIES,
    OPTIMIZERS,
    PRECISIONS,
    WEIGHT_DTYPES,
    GiB,
    MiB,
    human_bytes,
    trained_dtype,
)
from helpers.quiet import quiet_libraries

# The estimator, the planner, hardware and plots import torch (plots matplotlib too): they are
# imported where they are used, so this module (helpers.calculator) imports quickly.

if TYPE_CHECKING:
    from helpers.device import GpuInfo

INSTALL_HINT = "pip install ipywidgets for the interactive version"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
CATEGORIES = ("params", "gradients", "optimizer_state", "activations", "temporaries", "buffers")
# Errors the estimator and the planner raise for a setting a learner can change.
LEARNER_ERRORS = (ValueError, OSError, KeyError)
CAPTION = (
    "Each panel's left bar stacks every category at its own largest. They reach their largest at "
    "different moments of the step,\nso the stack is more than the peak: the largest total alive "
    "at one moment, which is what must fit. Usable = total - CUDA context - 10% margin."
)
CHOICES = {"precision": PRECISIONS, "optimizer": OPTIMIZERS, "attn": ATTENTION,
           "weight_dtype": WEIGHT_DTYPES, "bf16_update": BF16_UPDATES,
           "checkpoint_policy": CHECKPOINT_POLICIES}  # fmt: skip


@dataclass(frozen=True)
class CalculatorSetting:
    """One training setup the calculator estimates (the estimator's arguments and a card)."""

    model: str = "llama-tiny"  # a bundled config name or a config JSON path
    batch_size: int = 4  # micro-batch
    seq_len: int = 256
    precision: str = "fp32"
    optimizer: str = "adamw"
    gradient_checkpointing: bool = False
    grad_accum: int = 1
    lora_r: int = 0  # 0: full fine-tuning
    qlora: bool = False  # LoRA on 4-bit frozen weights
    attn: str = "eager"
    card: str = "t4"  # a key of helpers.hardware.REFERENCE_CARDS
    lora_targets: str = ""  # as RunConfig.lora_targets ("": peft's default modules)
    weight_dtype: str = "fp32"  # as RunConfig: "bf16" keeps no fp32 copy (a LoRA base: fp16 too)
    bf16_update: str = "nearest"  # as RunConfig: kahan, stochastic (bf16 weights' AdamW)
    checkpoint_policy: str = "full"  # as RunConfig: selective keeps matmuls' outputs too
    offload_activations: bool = False  # as RunConfig: saved tensors in host memory
    optimizer_in_backward: bool = False  # as RunConfig (lesson 16)
    loss_chunk: int = 0  # as RunConfig: tokens per chunk of a causal LM's loss (lesson 16)
    dora: bool = False  # as RunConfig: DoRA's adapters (with a LoRA rank; lesson 13)

    @property
    def method(self) -> str:
        """The planner's method: "qlora", "lora" (rank > 0) or "full"."""
        return "qlora" if self.qlora else "lora" if self.lora_r > 0 else "full"

    def estimate(self):
        """The estimator's ``Estimate`` of this setting on a CUDA card."""
        from helpers.estimator import estimate

        return estimate(
            self.model, self.batch_size, self.seq_len, self.precision, self.optimizer,
            self.gradient_checkpointing, self.attn, self.grad_accum, device="cuda",
            lora_r=self.lora_r, lora_targets=self.lora_targets, qlora=self.qlora,
            weight_dtype=self.weight_dtype, bf16_update=self.bf16_update,
            checkpoint_policy=self.checkpoint_policy,
            offload_activations=self.offload_activations,
            optimizer_in_backward=self.optimizer_in_backward, loss_chunk=self.loss_chunk,
            dora=self.dora,
        )  # fmt: skip

    def describe(self) -> str:
        """One line naming the setting, e.g. ``llama-tiny, micro-batch 4 x 1, ...``."""
        lora = "DoRA" if self.dora else "LoRA"
        method = {"full": "full fine-tuning", "lora": f"{lora} rank {self.lora_r}",
                  "qlora": f"QLoRA rank {self.lora_r}"}[self.method]  # fmt: skip
        parts = [
            self.model, f"micro-batch {self.batch_size} x {self.grad_accum} accumulated",
            f"sequence {self.seq_len}", self.precision, self.optimizer, f"{self.attn} attention",
            self._kept(), method,
        ]  # fmt: skip
        if self.optimizer_in_backward:
            parts.append("optimizer step in backward")
        if self.loss_chunk:
            parts.append(f"loss in chunks of {self.loss_chunk} tokens")
        if self.weight_dtype != "fp32":
            update = "" if self.bf16_update == "nearest" else f" ({self.bf16_update} updates)"
            parts.insert(4, f"{self.weight_dtype} weights{update}")
        return ", ".join(parts)

    def _kept(self) -> str:
        """What the step keeps for backward, in words."""
        policy = "selective " if self.checkpoint_policy == "selective" else ""
        kept = f"{policy}checkpointing" if self.gradient_checkpointing else "no checkpointing"
        return kept + (", activations offloaded" if self.offload_activations else "")


def bundled_models() -> list[str]:
    """Names of the bundled configs (``helpers/configs/*.json``), sorted."""
    folder = resources.files("helpers") / "configs"
    return sorted(
        p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json")
    )


def reference_cards() -> dict[str, GpuInfo]:
    """The cards the calculator offers: ``helpers.hardware.REFERENCE_CARDS``."""
    from helpers.hardware import REFERENCE_CARDS

    return REFERENCE_CARDS


def short_name(card: GpuInfo) -> str:
    """``T4`` for "Tesla T4", ``A100 MIG 1g.10gb`` for "NVIDIA A100-SXM4-80GB MIG 1g.10gb"."""
    name = card.name.removeprefix("NVIDIA ").removeprefix("Tesla ")
    return re.sub(r"-(SXM|PCIE)\d*-\d+GB| \d+GB( HBM\d\w*)?", "", name)


def card_label(key: str) -> str:
    """A card as the GPU list shows it: ``T4 (14.7 GiB)``."""
    card = reference_cards()[key]
    return f"{short_name(card)} ({card.total_memory / GiB:.1f} GiB)"


def check_choices(setting: CalculatorSetting) -> None:
    """Raise ValueError, naming the choices, for a card, precision, ... the lists do not offer."""
    offered = {"card": tuple(reference_cards()), **CHOICES}
    for name, choices in offered.items():
        value = getattr(setting, name)
        if value not in choices:
            raise ValueError(f"unknown {name} {value!r}: use one of {', '.join(choices)}")


@dataclass(frozen=True)
class CalculatorResult:
    """One setting's estimate on its card, or the message saying why there is none."""

    setting: CalculatorSetting
    card: GpuInfo
    usable: int  # what the peak may use on the card (helpers.planner.usable_budget)
    estimate: object = None  # helpers.estimator.Estimate, None when ``error`` says why
    error: str = ""

    @property
    def fits(self) -> bool | None:
        """True when the estimated peak is within the card's usable memory (None: no estimate)."""
        return None if self.estimate is None else self.estimate.peak <= self.usable

    @property
    def supported(self) -> bool:
        """Whether the card trains in the setting's precision (bf16 and tf32 need Ampere)."""
        from helpers.planner import card_precisions

        return self.setting.precision in card_precisions(self.card)

    @property
    def runs(self) -> bool | None:
        """True when the peak fits and the card has the precision (None: no estimate)."""
        return None if self.estimate is None else bool(self.fits and self.supported)

    @property
    def verdict(self) -> str:
        """One line: ``fits: 21.6 MiB of 12.9 GiB usable on the T4 (14.7 GiB in all); ...``.

        Its first word agrees with the rest: a setting whose peak fits but whose precision the
        card lacks reads ``not on this card``, not ``fits``.
        """
        if self.estimate is None:
            return self.error
        est, card = self.estimate, self.card
        word = "does not fit" if not self.fits else "fits" if self.supported else "not on this card"
        text = (
            f"{word}: {human_bytes(est.peak)} of {human_bytes(self.usable)} usable on the "
            f"{short_name(card)} ({human_bytes(card.total_memory)} in all); the peak falls at "
            f"{est.peak_at} ({est.path} estimate)"
        )
        return text + self.precision_note

    @property
    def precision_note(self) -> str:
        """``; the T4 cannot train in bf16 ...`` when the card lacks the precision, else ""."""
        if self.supported:
            return ""
        major, minor = self.card.capability
        return (
            f"; the {short_name(self.card)} cannot train in {self.setting.precision} (it needs "
            f"compute capability 8.0, this card has {major}.{minor}): pick fp16 or fp32"
        )


def evaluate(setting: CalculatorSetting) -> CalculatorResult:
    """``setting``'s estimate on its card; an error a learner can act on becomes ``error``."""
    import torch  # no torch until an estimate is asked for (import helpers stays cheap)

    from helpers.planner import usable_budget

    card = reference_cards()[setting.card]
    usable = usable_budget(card.total_memory, torch.device("cuda"))
    try:
        with _quiet():
            est = setting.estimate()
    except LEARNER_ERRORS as err:
        return CalculatorResult(setting, card, usable, error=one_line(err))
    return CalculatorResult(setting, card, usable, est)


@contextlib.contextmanager
def _quiet():
    """Library notices that teach nothing here (``helpers.quiet``; peft on GPT-2's Conv1D)."""
    with quiet_libraries(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to False")
        yield


def one_line(err: BaseException) -> str:
    """An exception as one line a learner reads: its message, without the traceback."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text.strip("'\"") if isinstance(err, KeyError) else text


def suggest(setting: CalculatorSetting, report=None):
    """The planner's answer (``plan_for_card``): the setting's model, effective batch, card.

    ``report(done, total)`` follows the estimates, as in ``helpers.planner.candidates``.
    """
    from helpers.planner import plan_for_card

    lora = {"lora_r": setting.lora_r, "lora_targets": setting.lora_targets, "dora": setting.dora}
    with _quiet():
        return plan_for_card(
            setting.model, setting.card, effective_batch=setting.batch_size * setting.grad_accum,
            seq_len=setting.seq_len, method=setting.method, report=report,
            **(lora if setting.lora_r else {}),
        )  # fmt: skip


def applied(setting: CalculatorSetting, best) -> CalculatorSetting:
    """``setting`` changed to the planner's candidate ``best``: what "Apply" sets."""
    return replace(
        setting, batch_size=best.micro_batch, grad_accum=best.grad_accum,
        gradient_checkpointing=best.gradient_checkpointing, precision=best.precision,
        optimizer=best.optimizer, attn=best.attn, weight_dtype=best.weight_dtype,
        bf16_update=best.bf16_update, checkpoint_policy=best.checkpoint_policy,
        offload_activations=best.offload_activations,
    )  # fmt: skip


# -------------------------------------------------------------------------------------------
# The figure


def _categories(est) -> list[str]:
    """The categories the bars stack: the step's five, and buffers when there are any."""
    return [c for c in CATEGORIES if c != "buffers" or est.buffers]


def _unit(nbytes: float) -> tuple[str, int]:
    """GiB from one GiB up, MiB below: the axis unit for sizes up to ``nbytes``."""
    return ("GiB", GiB) if nbytes >= GiB else ("MiB", MiB)


def _step_bars(ax, est, unit: tuple[str, int]) -> float:
    """Stacked categories at x=0 and the peak at x=1, each labelled; returns the tallest."""
    from matplotlib.ticker import FuncFormatter  # slow: only figures need it

    from helpers.plots import CATEGORY_COLORS, plain_number

    name, size = unit
    bottom = 0.0
    for cat in _categories(est):
        value = getattr(est, cat) / size
        ax.bar(0, value, bottom=bottom, width=0.6, color=CATEGORY_COLORS[cat],
               label=cat.replace("_", " "))  # fmt: skip
        bottom += value
    ax.bar(1, est.peak / size, width=0.6, color="#333333", label="peak (one moment)")
    stack = sum(getattr(est, c) for c in _categories(est))
    for x, nbytes in ((0, stack), (1, est.peak)):
        ax.annotate(human_bytes(nbytes), (x, nbytes / size), xytext=(0, 2), ha="center",
                    textcoords="offset points", va="bottom", fontsize="small")  # fmt: skip
    ax.set_xticks([0, 1], ["categories,\neach at its largest", "peak"], fontsize="small")
    ax.set_ylabel(name)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: plain_number(v)))
    return max(bottom, est.peak / size)


def _card_lines(ax, result: CalculatorResult, unit: tuple[str, int]) -> float:
    """The card's usable and total memory as labelled horizontal lines; returns the higher."""
    _, size = unit
    total, usable = result.card.total_memory / size, result.usable / size
    ax.axhline(total, color="#555555", linewidth=1.2)
    ax.axhline(usable, color="#C44E52", linestyle="--", linewidth=1.2)
    for y, text, dy, color in ((total, "total", 2, "#555555"), (usable, "usable", -2, "#C44E52")):
        ax.annotate(
            f"{text} {human_bytes(y * size)}", (1.45, y), xytext=(0, dy), color=color,
            textcoords="offset points", va="bottom" if dy > 0 else "top", fontsize="small",
        )  # fmt: skip
    return total


def calculator_figure(result: CalculatorResult):
    """The step's categories (stacked) and its peak, close up and against the card's memory."""
    from matplotlib.figure import Figure  # slow: only figures need it

    est = result.estimate
    if est is None:
        raise ValueError(f"nothing to draw: {result.error}")
    fig = Figure(figsize=(9.5, 4.2), layout="constrained")
    near, far = fig.subplots(1, 2, width_ratios=(2, 3))
    stack = sum(getattr(est, c) for c in _categories(est))
    top = _step_bars(near, est, _unit(max(stack, est.peak)))
    near.set_ylim(0, 1.15 * top)
    near.set_title("One training step, close up", fontsize="medium")
    unit = _unit(max(stack, est.peak, result.card.total_memory))
    top = max(_step_bars(far, est, unit), _card_lines(far, result, unit))
    far.set_ylim(0, 1.15 * top)
    far.set_title(f"Against the {short_name(result.card)}'s memory", fontsize="medium")
    near.set_xlim(-0.55, 1.55)
    far.set_xlim(-0.55, 2.6)  # room for the lines' labels right of the bars
    for ax in (near, far):
        ax.spines[["top", "right"]].set_visible(False)
    handles, labels = near.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize="small")
    fig.supxlabel(CAPTION, fontsize="small")
    return fig


def _png_output(fig) -> dict:
    """``fig`` as one display_data output (PNG) for an ``ipywidgets.Output``'s ``outputs``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # slow: only figures need it

    buffer = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buffer)
    data = {"image/png": base64.b64encode(buffer.getvalue()).decode("ascii"),
            "text/plain": "<memory calculator figure>"}  # fmt: skip
    return {"output_type": "display_data", "data": data, "metadata": {}}


# -------------------------------------------------------------------------------------------
# The static table


def _rows(result: CalculatorResult) -> list[tuple[str, str, str]]:
    """(what, size, bytes) rows: each category, the peak, and the card's memory."""
    est, card = result.estimate, result.card
    rows = [(c.replace("_", " "), human_bytes(getattr(est, c)), f"{getattr(est, c):,}")
            for c in CATEGORIES]  # fmt: skip
    rows.append(("peak (largest total at one moment)", human_bytes(est.peak), f"{est.peak:,}"))
    rows.append((f"{short_name(card)} usable", human_bytes(result.usable), f"{result.usable:,}"))
    total = card.total_memory
    rows.append((f"{short_name(card)} total", human_bytes(total), f"{total:,}"))
    return rows


def table_html(result: CalculatorResult, hint: str = "") -> str:
    """The result as an HTML table with its verdict (an error: one red line instead)."""
    head = f"<p><b>Memory calculator</b>: {html.escape(result.setting.describe())}</p>"
    tail = f"<p><i>{html.escape(hint)}</i></p>" if hint else ""
    if result.estimate is None:
        return head + error_html(result.error) + tail
    cells = "".join(
        f"<tr><td style='text-align:left'>{html.escape(a)}</td><td>{b}</td><td>{c}</td></tr>"
        for a, b, c in _rows(result)
    )
    table = f"<table><tr><th>category</th><th>size</th><th>bytes</th></tr>{cells}</table>"
    return head + table + verdict_html(result) + tail


def table_text(result: CalculatorResult, hint: str = "") -> str:
    """The result as a plain-text table with its verdict (an error: its one line instead)."""
    lines = [f"Memory calculator: {result.setting.describe()}"]
    if result.estimate is None:
        lines.append(f"error: {result.error}")
    else:
        rows = [("category", "size", "bytes"), *_rows(result)]
        width = max(len(r[0]) for r in rows)
        lines += [f"{a:<{width}}  {b:>10}  {c:>16}" for a, b, c in rows]
        lines.append(result.verdict)
    return "\n".join(lines + ([hint] if hint else []))


def error_html(message: str) -> str:
    """A message as one red line."""
    return f"<p style='color:#b00020;margin:0.3em 0'>&#9888; {html.escape(message)}</p>"


def verdict_html(result: CalculatorResult) -> str:
    """The verdict as one line: green when it fits, red when not, the error when no estimate."""
    if result.estimate is None:
        return error_html(result.error)
    color = "#1a7f37" if result.runs else "#b00020"
    word, _, rest = result.verdict.partition(":")
    return f"<p style='margin:0.3em 0'><b style='color:{color}'>{word}</b>:{html.escape(rest)}</p>"


@dataclass(repr=False)
class StaticCalculator:
    """The calculator without widgets: the setting's numbers as a table."""

    result: CalculatorResult
    hint: str = ""  # e.g. INSTALL_HINT when ipywidgets is missing

    @property
    def estimate(self):
        """The ``Estimate`` shown (None when the setting gave an error)."""
        return self.result.estimate

    @property
    def error(self) -> str:
        """The message shown instead of a table ("" when there is a table)."""
        return self.result.error

    def _repr_html_(self) -> str:
        """The table as HTML."""
        return table_html(self.result, self.hint)

    def __repr__(self) -> str:
        """The table as text."""
        return table_text(self.result, self.hint)


# -------------------------------------------------------------------------------------------
# The widgets


def _controls(w, s: CalculatorSetting) -> dict:
    """One widget per field of the setting (and the config path box), starting at ``s``."""
    style = {"description_width": "150px"}

    def make(cls, description, value, **options):
        return cls(value=value, description=description, style=style,
                   layout=w.Layout(width="380px"), **options)  # fmt: skip

    names = bundled_models()
    bundled = s.model in names
    cards = [(card_label(key), key) for key in reference_cards()]
    return {
        "model": make(w.Dropdown, "model", s.model if bundled else "llama-tiny", options=names),
        "config_path": make(w.Text, "or config JSON path", "" if bundled else s.model,
                            placeholder="path/to/config.json", continuous_update=False),
        "card": make(w.Dropdown, "GPU", s.card, options=cards),
        "precision": make(w.Dropdown, "precision", s.precision, options=PRECISIONS),
        "optimizer": make(w.Dropdown, "optimizer", s.optimizer, options=OPTIMIZERS),
        "weight_dtype": make(w.Dropdown, "weights stored in", s.weight_dtype,
                             options=WEIGHT_DTYPES),
        "bf16_update": make(w.Dropdown, "bf16 AdamW update", s.bf16_update,
                            options=BF16_UPDATES),
        "attn": make(w.Dropdown, "attention", s.attn, options=ATTENTION),
        "batch_size": make(w.IntText, "micro-batch", s.batch_size),
        "seq_len": make(w.IntText, "sequence length", s.seq_len),
        "grad_accum": make(w.IntText, "accumulation steps", s.grad_accum),
        "lora_r": make(w.IntText, "LoRA rank (0: full)", s.lora_r),
        "qlora": make(w.Checkbox, "QLoRA (4-bit base)", s.qlora),
        "dora": make(w.Checkbox, "DoRA (LoRA + magnitudes)", s.dora),
        "gradient_checkpointing": make(w.Checkbox, "checkpointing", s.gradient_checkpointing),
        "checkpoint_policy": make(w.Dropdown, "checkpoint policy", s.checkpoint_policy,
                                  options=CHECKPOINT_POLICIES),
        "offload_activations": make(w.Checkbox, "offload activations", s.offload_activations),
        "optimizer_in_backward": make(w.Checkbox, "optimizer step in backward",
                                      s.optimizer_in_backward),
        "loss_chunk": make(w.IntText, "loss chunk (tokens, 0: off)", s.loss_chunk),
    }  # fmt: skip


class Calculator:
    """The widgets, the live estimate of their setting, and the planner's suggestion."""

    LEFT = ("model", "config_path", "card", "precision", "weight_dtype", "bf16_update",
            "optimizer", "attn")  # fmt: skip

    def __init__(self, setting: CalculatorSetting) -> None:
        """Build the widgets at ``setting`` and draw its estimate."""
        import ipywidgets as w  # the widgets only: import helpers stays cheap

        self.lora_targets = setting.lora_targets
        self.controls = _controls(w, setting)
        self.verdict = w.HTML()
        self.plot = w.Output(layout=w.Layout(min_height="120px"))
        self.suggest_button = w.Button(
            description="Suggest the fastest setup that fits",
            icon="search",
            layout=w.Layout(width="max-content"),
        )
        self.suggestion = w.HTML()
        self.apply_button = w.Button(
            description="Apply this setup",
            icon="check",
            layout=w.Layout(width="max-content", display="none"),  # shown with a suggestion
        )
        self.result: CalculatorResult | None = None
        self.figure = None  # the Figure drawn last (None while the setting gives an error)
        self.plan = None  # the planner's CardPlan after a click
        self._cache: dict[CalculatorSetting, CalculatorResult] = {}
        self._applying = False
        self.box = self._layout(w)
        for control in self.controls.values():
            control.observe(self._changed, names="value")
        self.suggest_button.on_click(self._suggest)
        self.apply_button.on_click(self._apply)
        self._update()

    def _layout(self, w):
        """The whole calculator: title, two columns of controls, verdict, figure, planner."""
        left = [self.controls[k] for k in self.LEFT]
        right = [c for k, c in self.controls.items() if k not in self.LEFT]
        title = w.HTML("<b>Memory calculator</b>: one training step, estimated for a CUDA card")
        return w.VBox([title, w.HBox([w.VBox(left), w.VBox(right)]), self.verdict, self.plot,
                       self.suggest_button, self.suggestion, self.apply_button])  # fmt: skip

    @property
    def setting(self) -> CalculatorSetting:
        """The setting the controls show (a config path typed in overrides the model list)."""
        values = {name: c.value for name, c in self.controls.items()}
        if not self._trains_bf16_weights():  # the control is greyed out: its value is not used
            values["bf16_update"] = "nearest"
        path = values.pop("config_path").strip()
        if path:
            values["model"] = os.path.expanduser(path)
        return CalculatorSetting(**values, lora_targets=self.lora_targets)

    def _trains_bf16_weights(self) -> bool:
        """Whether the controls train bf16 weights: the only case a bf16 AdamW update is for."""
        c = self.controls
        return trained_dtype(c["weight_dtype"].value, c["lora_r"].value) == "bf16"

    @property
    def estimate(self):
        """The ``Estimate`` shown (None while the setting gives an error)."""
        return self.result.estimate if self.result else None

    @property
    def error(self) -> str:
        """The message shown instead of an estimate ("" when there is an estimate)."""
        return self.result.error if self.result else ""

    def _changed(self, change=None) -> None:
        """A control changed: estimate again, and say the old suggestion is for another setup."""
        if self._applying:  # "Apply" sets several controls: one estimate, after the last
            return
        self._update()
        if self.plan is not None or self.suggestion.value:
            self.plan = None
            self.suggestion.value = "<i>The setup changed: ask again for a suggestion.</i>"
            self.apply_button.layout.display = "none"

    def _update(self) -> None:
        """Estimate the controls' setting (cached); show its figure, then its verdict."""
        self.controls["model"].disabled = bool(self.controls["config_path"].value.strip())
        self.controls["bf16_update"].disabled = not self._trains_bf16_weights()
        setting = self.setting
        if setting not in self._cache:
            self.verdict.value = "<p style='margin:0.3em 0'><i>estimating...</i></p>"
            self._cache[setting] = evaluate(setting)
        self.result = self._cache[setting]
        has_estimate = self.result.estimate is not None
        self.figure = calculator_figure(self.result) if has_estimate else None
        self.plot.outputs = (_png_output(self.figure),) if has_estimate else ()
        self.verdict.value = verdict_html(self.result)  # last: the page's sign that all is new

    def _suggest(self, _button=None) -> None:
        """Ask the planner for the fastest setup predicted to fit, and show it with its reason."""
        setting = self.setting
        self.suggest_button.disabled = True
        self.apply_button.layout.display = "none"

        def report(done: int, total: int) -> None:
            self.suggestion.value = (
                f"<i>estimating setup {done} of {total} (a model without an analytical "
                "estimate is traced: a second or two per new setting)...</i>"
            )

        self.suggestion.value = "<i>estimating the setups that could fit...</i>"
        try:
            self.plan = suggest(setting, report)
        except LEARNER_ERRORS as err:
            self.plan = None
            self.suggestion.value = error_html(one_line(err))
        else:
            self.suggestion.value = suggestion_html(self.plan)
            if self.plan.best is not None:
                self.apply_button.layout.display = None
        finally:
            self.suggest_button.disabled = False

    def _apply(self, _button=None) -> None:
        """Set the controls to the suggested setup and estimate it once."""
        if self.plan is None or self.plan.best is None:
            return
        plan, target = self.plan, applied(self.setting, self.plan.best)
        self._applying = True
        try:
            for name in ("batch_size", "grad_accum", "gradient_checkpointing", "precision",
                         "optimizer", "attn", "weight_dtype", "bf16_update",
                         "checkpoint_policy", "offload_activations"):  # fmt: skip
                self.controls[name].value = getattr(target, name)
        finally:
            self._applying = False
        self._update()
        self.plan = plan  # still the answer for this model, batch and card
        self.suggestion.value = suggestion_html(plan) + "<p><i>Applied.</i></p>"

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        """The widget view, plus the static table for a page without the widget manager."""
        widget = getattr(self.box, "_repr_mimebundle_", None)
        bundle = dict((widget(include=include, exclude=exclude) if widget else None) or {})
        static = StaticCalculator(self.result)
        bundle["text/html"] = static._repr_html_()
        bundle["text/plain"] = repr(static)
        return bundle


def suggestion_html(plan) -> str:
    """The planner's best setup (or that none fits) and its reason, as HTML."""
    reason = html.escape(plan.reason)
    if plan.best is None:
        return f"<p><b style='color:#b00020'>Nothing fits.</b> {reason}</p>"
    best = plan.best
    return (
        f"<p><b>Fastest predicted to fit:</b> <code>{html.escape(best.label)}</code> "
        f"(estimated peak {human_bytes(best.estimated_peak)})</p>"
        f"<p style='max-width:900px'>{reason}</p>"
    )


# -------------------------------------------------------------------------------------------
# The entry point


def kernel_running() -> bool:
    """True inside an IPython kernel (JupyterLab, VS Code, Colab), False in a plain interpreter."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def calculator(
    model: str = "llama-tiny",
    batch_size: int = 4,
    seq_len: int = 256,
    precision: str = "fp32",
    optimizer: str = "adamw",
    gradient_checkpointing: bool = False,
    grad_accum: int = 1,
    lora_r: int = 0,
    qlora: bool = False,
    attn: str = "eager",
    card: str = "t4",
    lora_targets: str = "",
    interactive: bool | None = None,
    weight_dtype: str = "fp32",
    bf16_update: str = "nearest",
    checkpoint_policy: str = "full",
    offload_activations: bool = False,
    optimizer_in_backward: bool = False,
    loss_chunk: int = 0,
    dora: bool = False,
):
    """The memory calculator: widgets in a kernel with ipywidgets, else a static table.

    ``interactive``: None picks widgets when ipywidgets imports and an IPython kernel runs;
    False always gives the ``StaticCalculator``; True asks for widgets (without ipywidgets:
    the static table, saying how to install them). ``card``: a key of
    ``helpers.hardware.REFERENCE_CARDS`` ("t4", "l4", "a100-80", ...). ``weight_dtype`` and
    ``bf16_update`` are ``RunConfig``'s (bf16 weights with no fp32 copy, and their AdamW), as
    are ``checkpoint_policy``, ``offload_activations``, ``optimizer_in_backward`` and
    ``loss_chunk`` (lesson 16's settings), and ``dora`` (lesson 13).
    """
    setting = CalculatorSetting(model, batch_size, seq_len, precision, optimizer,
                                gradient_checkpointing, grad_accum, lora_r, qlora, attn, card,
                                lora_targets, weight_dtype, bf16_update, checkpoint_policy,
                                offload_activations, optimizer_in_backward,
                                loss_chunk, dora)  # fmt: skip
    check_choices(setting)
    wanted = kernel_running() if interactive is None else interactive
    if not wanted:
        return StaticCalculator(evaluate(setting))
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return StaticCalculator(evaluate(setting), hint=INSTALL_HINT)
    return Calculator(setting)


class _CallableModule(types.ModuleType):
    """This module's class: ``helpers.calculator(...)`` calls ``calculator(...)``."""

    def __call__(self, *args, **kwargs):
        """``calculator(*args, **kwargs)``."""
        return calculator(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
