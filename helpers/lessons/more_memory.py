"""Lesson 16 (notebooks/16_more_memory.ipynb): more memory from one GPU.

- the optimizer step inside backward and the chunked loss (``helpers.memory_savers``), each
  measured as a timeline next to the estimator's account of it (sections 1 and 3);
- selective activation checkpointing (keep what the matmuls return, recompute the cheap
  element-wise operations) and activation offload (``torch.autograd.graph.save_on_cpu``),
  against no checkpointing and lesson 04's full checkpointing;
- padding-free batches: the samples of a batch packed into one row by transformers'
  ``DataCollatorWithFlattening``, against the same samples padded;
- fp8 training of Linear layers with torchao, on GPUs of compute capability 8.9 or newer.

The notebook writes each technique itself (the hook, the policy, the context manager, the
collator, the filter); this module measures. One entry point per measurement, each returning
what a section prints, plots and asserts: ``measure_savers`` and ``fused_step_facts``
(section 1), ``measure_checkpointing`` (section 2), ``chunked_loss_facts`` (section 3),
``packing_check`` and ``measure_packing`` (section 4), ``fp8_layers`` and ``measure_fp8``
(section 5).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pandas as pd
import torch
from matplotlib.figure import Figure
from torch.nn.utils.rnn import pad_sequence
from torch.utils.flop_counter import FlopCounterMode

from helpers import isolate
from helpers.compat import is_checkpointing
from helpers.data import MarkovTask
from helpers.device import allocation_bytes, gpu_info, is_cuda, resolve
from helpers.estimator import Estimate, describe_model, estimate_run
from helpers.isolate import call_isolated
from helpers.memory import (
    CategoryTracker,
    allocator_peaks,
    reset_device_peaks,
    saved_for_backward,
)
from helpers.memory_savers import (  # noqa: F401 (SAVED_OPS, save_matmuls: the lesson's names)
    SAVED_OPS,
    ChunkedCausalLMLoss,
    causal_targets,
    offloaded,
    save_matmuls,
    selective_context_fn,
)
from helpers.models import build_model, disable_checkpointing, enable_checkpointing, load_config
from helpers.names import MiB
from helpers.plots import category_labels, legend_outside
from helpers.progress import progress
from helpers.results import Record
from helpers.timeline import Timeline, measure_timeline
from helpers.timing import train_flops
from helpers.train import (
    RunConfig,
    Trainee,
    autocast_context,
    make_optimizer,
    model_loss,
    train_step,
)

# --------------------------------------------------------------------------------------------
# Section 2: selective checkpointing and offload

CHECKPOINTING = ("none", "full", "selective", "offload")  # the settings section 2 compares


def offload_moves(device: torch.device) -> tuple[bool, str]:
    """Whether ``save_on_cpu`` takes saved tensors off ``device``, and why (a printable line)."""
    if device.type == "cpu":
        return False, (
            "on the CPU, host memory is the device's memory: save_on_cpu keeps each saved tensor "
            "where it is (.cpu() of a CPU tensor is the tensor itself), so the tracked "
            "activations cannot fall here; the bytes it packs are what it would move off a GPU"
        )
    pinned = "pinned " if device.type == "cuda" else ""
    return True, (
        f"on {device.type}, save_on_cpu copies every tensor saved for backward to {pinned}host "
        "memory during the forward pass and back during the backward pass"
    )


def offloaded_loss(device: torch.device) -> Callable:
    """``loss_of`` for ``train_step``: the model's loss with its forward under ``save_on_cpu``."""
    return offloaded(model_loss, device)


def set_checkpointing(
    model: torch.nn.Module, mode: str, context_fn: Callable | None = None
) -> None:
    """Switch ``model``'s layers to ``mode``'s checkpointing (none and offload: off).
    ``context_fn``: the selective setting's (the lesson's cell writes it; default: the policy
    ``RunConfig(checkpoint_policy="selective")`` names, ``memory_savers.save_matmuls``)."""
    if mode not in CHECKPOINTING:
        raise ValueError(f"unknown setting {mode!r}: use one of {', '.join(CHECKPOINTING)}")
    if mode == "full":
        enable_checkpointing(model)
    elif mode == "selective":
        enable_checkpointing(model, context_fn=context_fn or selective_context_fn())
    elif is_checkpointing(model):
        disable_checkpointing(model)


def _loss_for(mode: str, device: torch.device) -> Callable:
    return offloaded_loss(device) if mode == "offload" else model_loss


def checkpointing_step(
    cfg: RunConfig, mode: str, context_fn: Callable | None = None
) -> Callable[[], float]:
    """A training step of ``cfg`` in setting ``mode`` (the contender ``isolate.bench`` times)."""
    return _checkpointing_trainee(cfg, mode, context_fn)[1]


def _checkpointing_trainee(
    cfg: RunConfig, mode: str, context_fn: Callable | None = None
) -> tuple[Trainee, Callable[[], float]]:
    trainee = Trainee(replace(cfg, gradient_checkpointing=False))
    set_checkpointing(trainee.model, mode, context_fn)
    loss_of = _loss_for(mode, trainee.device)

    def step() -> float:
        batches = [trainee.batch()]
        loss = train_step(trainee.model, trainee.optimizer, batches, precision=cfg.precision,
                          scaler=trainee.scaler, loss_of=loss_of)  # fmt: skip
        return float(loss)

    return trainee, step


def packed_bytes(model: torch.nn.Module, batch: dict, loss_of: Callable = model_loss) -> int:
    """Bytes of the distinct storages autograd saves for backward that the forward created.

    What ``save_on_cpu`` would copy to the host and free on a GPU: a saved weight, buffer or
    input of the batch stays on the device anyway, so those are left out; a storage saved by
    several operations (a tensor and its views) counts once.
    """
    before = [*model.parameters(), *model.buffers(), *batch.values()]
    loss, saved = saved_for_backward(lambda: loss_of(model, batch), before)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return saved


@dataclass
class CheckpointingResult:
    """One setting's steady-state step: memory by category (view 1) and what offload packs."""

    mode: str
    memory: dict  # CategoryPeaks.as_dict(): bytes per category and the peak
    flops: int  # one step's FLOPs as FlopCounterMode counts them (recomputation included)
    packed: int = 0  # bytes autograd saved for backward that the forward made (see packed_bytes)


def checkpointing_memory(
    cfg: RunConfig, mode: str, context_fn: Callable | None = None
) -> CheckpointingResult:
    """Per-category peaks of one tracked steady-state step of ``cfg`` in setting ``mode``."""
    trainee, step = _checkpointing_trainee(cfg, mode, context_fn)
    packed = packed_bytes(trainee.model, trainee.batch()) if mode == "offload" else 0
    for _ in range(max(1, cfg.warmup)):  # the first step creates the optimizer state
        step()
    tracker = CategoryTracker(device=trainee.device)
    tracker.track_external(trainee.model, trainee.optimizer)
    with tracker:
        step()
    return CheckpointingResult(mode, tracker.peaks().as_dict(), train_flops(step), packed)


@dataclass
class GradientCheck:
    """Each setting's gradients of one batch against no checkpointing's, from the same weights."""

    losses: dict[str, float]
    max_difference: dict[str, float]  # max |gradient - no checkpointing's| over every weight
    # The same for no checkpointing run twice: 0 where the kernels are deterministic.
    noise_floor: float


def gradient_check(cfg: RunConfig, context_fn: Callable | None = None) -> GradientCheck:
    """The gradients of one batch in every setting, on one model switched between them."""
    trainee = Trainee(replace(cfg, gradient_checkpointing=False))
    model, batch = trainee.model, trainee.batch()

    def gradients(mode: str) -> tuple[float, dict]:
        set_checkpointing(model, mode, context_fn)
        loss = _loss_for(mode, trainee.device)(model, batch)
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return loss.item(), grads

    def difference(a: dict, b: dict) -> float:
        return max(float((a[k] - b[k]).abs().max()) for k in a)

    reference_loss, reference = gradients("none")
    losses, diffs = {"none": reference_loss}, {}
    for mode in ("none", *CHECKPOINTING[1:]):
        losses[mode], grads = gradients(mode)
        diffs[mode] = difference(grads, reference)
        del grads
    floor = diffs.pop("none")
    return GradientCheck(losses, {"none": 0.0, **diffs}, floor)


def checkpointing_figure(activations: dict[str, int], ratios: dict[str, tuple[float, float, float]],
                         packed: int = 0, title: str = "") -> Figure:  # fmt: skip
    """Activations (MiB) and step time relative to no checkpointing, one bar per setting.

    ``ratios``: per setting (median, slowest round, fastest round) of time / no checkpointing's.
    ``packed``: bytes offload moves off a GPU, hatched on the offload bar where they did not move.
    """
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    names = list(activations)
    values = [activations[n] / MiB for n in names]
    left.bar(names, values, color="#8172B2")
    if packed and "offload" in names:
        i = names.index("offload")
        left.bar([i], [packed / MiB], fill=False, hatch="//", edgecolor="#333333",
                 label="packed for backward: what\nsave_on_cpu moves off a GPU")  # fmt: skip
        legend_outside(left)
    left.bar_label(left.containers[0], fmt="%.2f", fontsize="small", padding=2)
    left.margins(y=0.12)
    left.set_title("memory", fontsize="medium")
    left.set_ylabel("activations, MiB (tracker, view 1)")
    category_labels(left, names)
    medians = [ratios[n][0] for n in names]
    spans = [[m - ratios[n][1] for m, n in zip(medians, names, strict=True)],
             [ratios[n][2] - m for m, n in zip(medians, names, strict=True)]]  # fmt: skip
    right.bar(names, medians, color="#4C72B0", yerr=spans, capsize=4, ecolor="#333333")
    right.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    right.set_title("time", fontsize="medium")
    right.set_ylabel("step time / no checkpointing's")
    category_labels(right, names)
    fig.supxlabel("time: median of interleaved rounds; line: slowest to fastest round",
                  fontsize="x-small")  # fmt: skip
    fig.suptitle(title)
    return fig


@dataclass
class CheckpointingStudy:
    """Section 2's measurements of the four settings, and what prints, times and draws them."""

    config: RunConfig
    device: torch.device
    results: dict[str, CheckpointingResult]  # per setting, a fresh process each
    grads: GradientCheck  # every setting's gradients of one batch, in one more process
    moves: bool  # whether save_on_cpu takes saved tensors off this device
    why: str  # the sentence that says so
    context_fn: Callable | None = None  # the selective setting's (None: save_matmuls)

    @property
    def activations(self) -> dict[str, int]:
        """Tracked activation bytes per setting."""
        return {mode: r.memory["activations"] for mode, r in self.results.items()}

    @property
    def packed(self) -> int:
        """Bytes autograd saves for backward that save_on_cpu would move off a GPU."""
        return self.results["offload"].packed

    def table(self) -> pd.DataFrame:
        """Activations, peak, counted FLOPs, loss and gradient difference, one row per setting."""
        return pd.DataFrame({
            mode: {
                "activations MiB": r.memory["activations"] / MiB,
                "peak MiB": r.memory["peak"] / MiB,
                "step GFLOPs (counted)": r.flops / 1e9,
                "loss": self.grads.losses[mode],
                "max |gradient - none's|": self.grads.max_difference[mode],
            }
            for mode, r in self.results.items()
        }).T  # fmt: skip

    def time(self, claims, rounds: int = 5, max_rounds: int = 20):
        """The four settings' steps timed in interleaved rounds, one long-lived process each
        (rounds are added while any claim is undecided): a ``helpers.timing`` comparison."""
        n = len(CHECKPOINTING)
        return isolate.compare_benches(
            {mode: isolate.bench(checkpointing_step, self.config, mode, self.context_fn)
             for mode in CHECKPOINTING},
            self.device, mode=isolate.mode_for([self.config] * n, self.device), per_round=3,
            claims=claims, rounds=rounds, max_rounds=max_rounds,
        )  # fmt: skip

    def figure(self, ratios: dict[str, tuple[float, float, float]], title: str = "") -> Figure:
        """``checkpointing_figure`` of these activations; offload's packed bytes hatched where
        they did not move."""
        packed = 0 if self.moves else self.packed
        return checkpointing_figure(self.activations, ratios, packed=packed, title=title)


def measure_checkpointing(
    cfg: RunConfig, device: torch.device, context_fn: Callable | None = None
) -> CheckpointingStudy:
    """Each setting's memory and FLOPs in a fresh process, then every setting's gradients.
    ``context_fn``: the selective setting's, as the lesson's cell writes it (it travels to the
    fresh processes by value: ``isolate.portable``); default: ``memory_savers.save_matmuls``."""
    moves, why = offload_moves(device)
    modes = progress(CHECKPOINTING, "four settings, a fresh process each")
    results = {mode: call_isolated(checkpointing_memory, cfg, mode, context_fn).unwrap()
               for mode in modes}  # fmt: skip
    grads = call_isolated(gradient_check, cfg, context_fn).unwrap()
    return CheckpointingStudy(cfg, device, results, grads, moves, why, context_fn)


# --------------------------------------------------------------------------------------------
# Section 4: padding-free batches


@dataclass
class PackingConfig:
    """The samples of section 4: Markov walks of lengths drawn from a wide, skewed range."""

    model: str = "llama-tiny"
    samples: int = 8
    min_len: int = 8
    max_len: int = 64
    attn: str = "sdpa"
    device: str | None = None
    seed: int = 0

    @classmethod
    def for_scale(cls, scale, device, **overrides) -> PackingConfig:
        """The lesson's samples at ``scale`` (``packing_samples`` of them, up to its sequence
        length) for its decoder on ``device``."""
        fields = dict(model=scale.decoder, samples=packing_samples(scale), max_len=scale.seq_len,
                      device=str(device))  # fmt: skip
        return cls(**{**fields, **overrides})


def packing_samples(scale) -> int:
    """Section 4's number of samples: twice the scale's batch at the tiny scale; the batch
    itself at the full scale, where the padded batch of 8 x 512 tokens of the decoder in fp32
    (15 GiB) would not fit a 16 GB card (``helpers.course.fullscale`` checks the card)."""
    return 2 * scale.batch_size if scale.name == "tiny" else scale.batch_size


def sample_lengths(cfg: PackingConfig) -> list[int]:
    """Each sample's length, log-uniform in [min_len, max_len]: many short, a few long."""
    g = torch.Generator().manual_seed(cfg.seed)
    logs = torch.empty(cfg.samples).uniform_(math.log(cfg.min_len), math.log(cfg.max_len + 1),
                                             generator=g)  # fmt: skip
    return logs.exp().floor().long().clamp(cfg.min_len, cfg.max_len).tolist()


def markov_samples(cfg: PackingConfig, vocab_size: int) -> list[torch.Tensor]:
    """One walk of the learnable Markov task per length: token ids of varied lengths."""
    task = MarkovTask(n_states=min(64, vocab_size), seed=cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    return [task.sample(1, n, g)[0] for n in sample_lengths(cfg)]


def padded_batch(samples: list[torch.Tensor], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The samples right-padded to the longest: attention_mask 0 and label -100 on the pads."""
    ids = pad_sequence(samples, batch_first=True, padding_value=pad_id)  # (B, longest)
    lengths = torch.tensor([len(s) for s in samples])
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def packed_batch(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The samples in one row by ``DataCollatorWithFlattening``: position ids restart per sample."""
    from transformers import DataCollatorWithFlattening  # data collators: packing only

    collate = DataCollatorWithFlattening(return_tensors="pt")
    return collate([{"input_ids": s.tolist()} for s in samples])


def predicted_tokens(batch: dict) -> int:
    """Tokens a causal LM loss averages over: labels not -100 after the one-token shift."""
    return int((batch["labels"][:, 1:] != -100).sum())


def packing_model(cfg: PackingConfig, use_cache: bool = False) -> torch.nn.Module:
    """The model of ``cfg`` in training mode; packing needs ``use_cache=False`` (section 4)."""
    config = load_config(cfg.model)
    config.use_cache = use_cache
    model = build_model(config, cfg.attn, resolve(cfg.device), cfg.seed)
    return model.train()


def _on(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


@dataclass
class PackingCheck:
    """The packed batch against the padded one: per-sample logits and the loss, forward only."""

    lengths: list[int]
    logit_scale: float  # the largest |logit| of the padded batch
    max_difference: float  # per-sample logits, packed against padded
    cache_on_difference: float  # the same with the model's KV cache left on
    no_positions_difference: float  # the same without position_ids: one long sequence
    loss_padded: float
    loss_packed: float
    predicted_padded: int  # tokens each loss averages over
    predicted_packed: int
    padded_tokens: int  # positions of the padded batch (samples x longest)
    pad_tokens: int  # of which pads (attention_mask 0)
    packed_tokens: int  # positions of the packed row

    def picture(self, title: str = "") -> Figure:
        """``batch_picture`` of these samples."""
        return batch_picture(self.lengths, title=title)


def _sample_logits(logits: torch.Tensor, lengths: list[int], packed: bool) -> list[torch.Tensor]:
    """Each sample's logits: its row of a padded batch, or its stretch of the packed row."""
    if not packed:
        return [logits[i, :n] for i, n in enumerate(lengths)]
    starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
    return [logits[0, a : a + n] for a, n in zip(starts, lengths, strict=False)]


def packing_check(cfg: PackingConfig) -> PackingCheck:
    """Padded and packed forwards of the same samples: logits per sample and the two losses."""
    model = packing_model(cfg)
    device = next(model.parameters()).device
    samples = markov_samples(cfg, model.config.vocab_size)
    lengths = [len(s) for s in samples]
    padded, packed = _on(padded_batch(samples), device), _on(packed_batch(samples), device)
    no_positions = {k: v for k, v in packed.items() if k != "position_ids"}

    def differences(out, reference) -> float:
        mine = _sample_logits(out.logits, lengths, packed=True)
        return max(float((a - b).abs().max()) for a, b in zip(mine, reference, strict=True))

    with torch.no_grad():
        pad_out, pack_out = model(**padded), model(**packed)
        reference = _sample_logits(pad_out.logits, lengths, packed=False)
        cache_on = model(**packed, use_cache=True)
        alone = model(**no_positions)
    return PackingCheck(
        lengths, float(pad_out.logits.abs().max()), differences(pack_out, reference),
        differences(cache_on, reference), differences(alone, reference), float(pad_out.loss),
        float(pack_out.loss), predicted_tokens(padded), predicted_tokens(packed),
        padded["input_ids"].numel(), int((padded["attention_mask"] == 0).sum()),
        packed["input_ids"].numel(),
    )  # fmt: skip


def _packing_trainee(cfg: PackingConfig, packed: bool):
    """The model, an AdamW and the packed or padded batch of ``cfg``, on its device."""
    model = packing_model(cfg)
    device = next(model.parameters()).device
    samples = markov_samples(cfg, model.config.vocab_size)
    batch = _on(packed_batch(samples) if packed else padded_batch(samples), device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch


def packing_step(cfg: PackingConfig, packed: bool) -> Callable[[], float]:
    """A training step on the packed or the padded batch (the contender ``bench`` times)."""
    model, optimizer, batch = _packing_trainee(cfg, packed)
    return lambda: float(train_step(model, optimizer, [batch]))


def packing_memory(cfg: PackingConfig, packed: bool) -> dict:
    """Per-category peaks (view 1) of one steady-state training step on either batch."""
    model, optimizer, batch = _packing_trainee(cfg, packed)
    train_step(model, optimizer, [batch])  # creates the optimizer state
    tracker = CategoryTracker(device=next(model.parameters()).device)
    tracker.track_external(model, optimizer)
    with tracker:
        train_step(model, optimizer, [batch])
    return tracker.peaks().as_dict()


@dataclass
class PackingRuns:
    """One training step on the padded and on the packed batch: memory, and time if measured."""

    memory: dict[str, dict]  # "padded", "packed": per-category peaks (view 1), a fresh process each
    times: object = None  # the interleaved rounds (a ``helpers.timing`` comparison), or None


def measure_packing(cfg: PackingConfig, claims=None, timed: bool = True) -> PackingRuns:
    """Both batches' memory in fresh processes; with ``timed``, their steps in interleaved
    rounds, in useful tokens (the samples' own, the same number in both) per second."""
    names = ("padded", "packed")
    memory = {name: isolate.call_isolated(packing_memory, cfg, name == "packed").unwrap()
              for name in names}  # fmt: skip
    if not timed:
        return PackingRuns(memory)
    useful = sum(sample_lengths(cfg))
    times = isolate.compare_benches(
        {name: isolate.bench(packing_step, cfg, name == "packed") for name in names},
        resolve(cfg.device), units=dict.fromkeys(names, useful), claims=claims or [],
        per_round=3, rounds=5, max_rounds=15,
    )  # fmt: skip
    return PackingRuns(memory, times)


def batch_picture(lengths: list[int], title: str = "") -> Figure:
    """The same samples padded (a row each) and packed (one row, drawn wrapped at that width)."""
    from matplotlib.colors import ListedColormap  # slow: only figures need it

    width = max(lengths)
    padded = torch.full((len(lengths), width), -1)
    for i, n in enumerate(lengths):
        padded[i, :n] = i
    flat = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    rows = -(-len(flat) // width)
    packed = torch.full((rows * width,), -1)
    packed[: len(flat)] = flat
    colours = ListedColormap(["#EEEEEE"] + ["#4C72B0", "#55A868", "#C44E52", "#8172B2"] * 8)
    fig = Figure(figsize=(8, 0.35 * (len(lengths) + rows) + 1.8), layout="constrained")
    top, bottom = fig.subplots(2, 1, height_ratios=[len(lengths), rows], sharex=True)
    waste = 1 - sum(lengths) / padded.numel()
    panels = ((top, padded, f"padded: {len(lengths)} rows x {width}, {waste:.0%} pads"),
              (bottom, packed.view(rows, width),
               f"packed: 1 row of {len(flat)} tokens, drawn {width} wide"))  # fmt: skip
    for ax, grid, name in panels:
        ax.imshow(((grid + 1) % colours.N).numpy(), cmap=colours, vmin=0, vmax=colours.N - 1,
                  aspect="auto", interpolation="nearest")  # fmt: skip
        ax.set_yticks([])
        ax.set_title(name, fontsize="small", loc="left")
    bottom.set_xlabel("token position (colours: samples; grey: padding, or past the row's end)")
    fig.suptitle(title)
    return fig


# --------------------------------------------------------------------------------------------
# Section 5: fp8 on Hopper and newer

FP8_CAPABILITY = (8, 9)  # Ada (sm_89) and Hopper (sm_90) were the first with fp8 tensor cores


def fp8_problem(device: torch.device) -> str | None:
    """Why fp8 training cannot run on ``device`` (a sentence to print), or None when it can."""
    need = f"compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer"
    if not is_cuda(device):
        return (f"fp8 training needs an NVIDIA GPU of {need} (L4, RTX 40xx, H100, B200); this "
                f"run is on {device.type}, so the fp8 steps are skipped")  # fmt: skip
    info = gpu_info(device)
    if info.capability < FP8_CAPABILITY:
        major, minor = info.capability
        return (f"fp8 training needs {need}; {info.name} has {major}.{minor}, whose tensor cores "
                "have no fp8 matmul, so the fp8 steps are skipped")  # fmt: skip
    if torchao_missing():
        return f"fp8 training needs torchao, and {torchao_missing()}"
    return None


def fp8_filter(module: torch.nn.Module, fqn: str) -> bool:
    """Which Linear layers become float8: both dimensions multiples of 16, the output layer kept."""
    if not isinstance(module, torch.nn.Linear) or fqn.split(".")[-1] == "lm_head":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


@dataclass
class LinearLayer:
    """A Linear layer of the model: its shape, and whether each filter converts it to float8."""

    name: str
    in_features: int
    out_features: int
    converted: bool  # by ``fp8_filter`` (what this lesson converts)
    auto: bool | None  # by torchao's filter for its tensorwise recipe (None: torchao missing)
    forward_flops: int = 0  # 2 x tokens x in x out, counted by FlopCounterMode


def torchao_missing() -> str:
    """Why torchao cannot be imported here ("" when it can): it is optional for this course."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (optional: pip install torchao==0.18.0)"
    return ""


def converted_layers(
    model: torch.nn.Module, module_filter_fn: Callable = fp8_filter
) -> list[LinearLayer]:
    """Every Linear layer of ``model``, and whether torchao swaps it when converting a copy
    with ``module_filter_fn`` (the lesson's cell writes it; default ``fp8_filter``).

    Without torchao (an optional package) ``converted`` is the filter's decision and
    ``auto`` is None: the conversion itself does not run.
    """
    shapes = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if torchao_missing():
        return [LinearLayer(n, m.in_features, m.out_features, module_filter_fn(m, n), None)
                for n, m in shapes.items()]  # fmt: skip
    # optional (lesson 16's fp8)
    from torchao.float8 import _auto_filter_for_recipe, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear  # optional (lesson 16's fp8)

    auto = _auto_filter_for_recipe("tensorwise", filter_fqns=["lm_head"])
    converted = convert_to_float8_training(copy.deepcopy(model), module_filter_fn=module_filter_fn)
    swapped = {n for n, m in converted.named_modules() if isinstance(m, Float8Linear)}
    return [LinearLayer(n, m.in_features, m.out_features, n in swapped, auto(m, n))
            for n, m in shapes.items()]  # fmt: skip


@dataclass
class Fp8Layers:
    """Section 5 on any device: the Linear layers torchao swaps, their share of a step's FLOPs."""

    layers: list[LinearLayer]
    tokens: int  # tokens per step (batch x sequence length)
    step_flops: int  # forward + backward of one step, every operation FlopCounterMode knows

    @property
    def converted_share(self) -> float:
        """The converted layers' FLOPs (3x the forward: backward is two matmuls) / the step's."""
        return 3 * sum(x.forward_flops for x in self.layers if x.converted) / self.step_flops

    def account(self) -> dict[str, Fp8Bytes]:
        """``fp8_account`` of the converted layers at this many tokens."""
        return fp8_account(self.layers, self.tokens)

    def figure(self, title: str = "") -> Figure:
        """``fp8_figure`` of that account."""
        return fp8_figure(self.account(), title=title)


def fp8_layers(cfg: RunConfig, module_filter_fn: Callable = fp8_filter) -> Fp8Layers:
    """The model of ``cfg`` (eager attention, so its matmuls are counted): layers and FLOPs,
    converted as ``module_filter_fn`` chooses."""
    trainee = Trainee(replace(cfg, attn="eager"))
    model, batch = trainee.model, trainee.batch()
    layers = converted_layers(model, module_filter_fn)
    counter = FlopCounterMode(display=False)
    with counter:
        loss = model(**batch).loss
    per_module = counter.get_flop_counts()
    prefix = type(model).__name__
    for x in layers:
        x.forward_flops = int(sum(per_module.get(f"{prefix}.{x.name}", {}).values()))
    del loss
    step = FlopCounterMode(display=False)
    with step:
        model(**batch).loss.backward()
    return Fp8Layers(layers, cfg.batch_size * cfg.seq_len, int(step.get_total_flops()))


@dataclass
class Fp8Bytes:
    """Predicted bytes of one step's converted Linear layers, 16-bit autocast against float8."""

    saved_inputs: int  # every converted layer's input, saved for backward (16-bit in both)
    weight_copies: int  # 16-bit weight copies autocast keeps until each layer's backward
    largest_casts: int  # the most float8 copies alive at once: one layer's, freed after it


def fp8_account(layers: list[LinearLayer], tokens: int) -> dict[str, Fp8Bytes]:
    """What changes when the converted layers go float8 (torchao 0.18, tensorwise), by arithmetic.

    bf16 autocast: each Linear saves its 16-bit input (2 B per value) and its 16-bit weight copy
    (2 B per weight), both alive until the layer's backward. torchao's ``Float8Linear`` saves
    the same 16-bit input (``ctx.save_for_backward(input_hp, weight_hp_t)`` in
    float8_linear.py) and the fp32 weight itself, a view: no copy. It casts to float8 (1 B per
    value) inside the layer: input and weight for the forward matmul; for the backward's two
    matmuls grad_output twice, the weight and the input again, all alive until the layer's
    backward returns. So at most one layer's casts exist at a time.
    """
    conv = [x for x in layers if x.converted]
    forward = [tokens * x.in_features + x.in_features * x.out_features for x in conv]
    backward = [2 * tokens * x.out_features + x.in_features * x.out_features
                + tokens * x.in_features for x in conv]  # fmt: skip
    inputs = 2 * sum(tokens * x.in_features for x in conv)
    weights = sum(x.in_features * x.out_features for x in conv)
    return {
        "bf16 autocast": Fp8Bytes(inputs, 2 * weights, 0),
        "float8 (torchao)": Fp8Bytes(inputs, 0, max(forward + backward, default=0)),
    }


@dataclass
class Fp8Run:
    """Losses and one step's memory (view 1) of a short training run, with or without float8."""

    fp8: bool
    emulated: bool  # torchao's emulate=True: float8 casts, products in fp32 (numerics only)
    losses: list[float] = field(default_factory=list)
    memory: dict = field(default_factory=dict)


def fp8_trainee(
    cfg: RunConfig, fp8: bool, emulate: bool = False, module_filter_fn: Callable = fp8_filter
) -> Trainee:
    """A Trainee of ``cfg`` whose Linear layers ``module_filter_fn`` chooses run in float8
    when ``fp8``."""
    trainee = Trainee(cfg)
    if fp8:
        # optional (lesson 16's fp8)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig(emulate=emulate)
        convert_to_float8_training(trainee.model, module_filter_fn=module_filter_fn, config=config)
        trainee.optimizer = make_optimizer(cfg.optimizer, trainee.model)
    return trainee


def fp8_step(
    cfg: RunConfig, fp8: bool, module_filter_fn: Callable = fp8_filter
) -> Callable[[], float]:
    """A training step with or without float8 Linear layers (the contender ``bench`` times)."""
    return fp8_trainee(cfg, fp8, module_filter_fn=module_filter_fn).step


def fp8_run(cfg: RunConfig, fp8: bool, steps: int, emulate: bool = False,
            module_filter_fn: Callable = fp8_filter) -> Fp8Run:  # fmt: skip
    """``steps`` steps on the learnable task, the second one tracked by category."""
    trainee = fp8_trainee(replace(cfg, data="markov"), fp8, emulate, module_filter_fn)
    out = Fp8Run(fp8, emulate and fp8)
    trainee.step()
    tracker = CategoryTracker(device=trainee.device)
    tracker.track_external(trainee.model, trainee.optimizer)
    with tracker:
        trainee.step()
    out.memory = tracker.peaks().as_dict()
    for _ in range(steps - 2):
        trainee.step()
    out.losses = list(trainee.losses)
    return out


@dataclass
class Fp8Runs:
    """Section 5's runs: the reference and fp8 (or its emulation), and their timing if any."""

    reference: str  # "bf16" on an fp8 GPU, else "fp32" (against the emulation)
    runs: dict[str, Fp8Run]  # the reference's and "fp8"; empty without torchao
    times: object = None  # interleaved rounds (a helpers.timing comparison) on an fp8 GPU
    skipped: str = ""  # why the runs did not happen ("" when they did)


def measure_fp8(cfg: RunConfig, steps: int, problem: str | None, device,
                module_filter_fn: Callable = fp8_filter) -> Fp8Runs:  # fmt: skip
    """Short runs with and without float8, each in a fresh process, and on an fp8 GPU
    (``problem`` None) both steps timed in interleaved rounds. Elsewhere the float8 run is
    torchao's emulation (fp8 casts, fp32 products) against fp32; without torchao, nothing.
    ``module_filter_fn``: which Linear layers go float8 (the lesson's cell writes it)."""
    reference = "fp32" if problem else "bf16"
    missing = torchao_missing()
    if missing:
        return Fp8Runs(reference, {}, skipped=missing)
    runs = {name: isolate.call_isolated(fp8_run, cfg, name != reference, steps,
                                        emulate=problem is not None,
                                        module_filter_fn=module_filter_fn).unwrap()
            for name in (reference, "fp8")}  # fmt: skip
    times = None
    if problem is None:
        times = isolate.compare_benches(
            {name: isolate.bench(fp8_step, cfg, name == "fp8", module_filter_fn)
             for name in ("bf16", "fp8")},
            device, mode=isolate.mode_for([cfg] * 2, device), rounds=5, max_rounds=15,
        )  # fmt: skip
    return Fp8Runs(reference, runs, times)


def fp8_figure(account: dict[str, Fp8Bytes], title: str = "") -> Figure:
    """Predicted bytes of the converted layers per recipe: kept until backward, and transient."""
    parts = (("saved inputs", "saved_inputs", "#8172B2", None),
             ("16-bit weight copies", "weight_copies", "#CCB974", None),
             ("float8 casts alive at once\n(one layer's, transient)", "largest_casts", "white",
              "//"))  # fmt: skip
    fig = Figure(figsize=(7, 3.6), layout="constrained")
    ax = fig.add_subplot()
    names = list(account)
    bottom = [0.0] * len(names)
    for label, attr, colour, hatch in parts:
        values = [getattr(account[n], attr) / MiB for n in names]
        drawn = [i for i, v in enumerate(values) if v]  # an empty part gets no outline
        ax.bar(drawn, [values[i] for i in drawn], bottom=[bottom[i] for i in drawn], label=label,
               color=colour, hatch=hatch, edgecolor="#333333" if hatch else None)  # fmt: skip
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_ylim(0, 1.1 * max(bottom))  # stacked bars stick to their tops: room made by hand
    ax.set_ylabel("MiB, predicted")
    legend_outside(ax)
    category_labels(ax, names)
    ax.set_title(title)
    return fig


# --------------------------------------------------------------------------------------------
# Sections 1 and 3: the optimizer step inside backward, and the logits of a large vocabulary


@dataclass
class SaverResult:
    """One setting of sections 1 and 3: its measured timeline and its estimate."""

    label: str
    config: RunConfig
    timeline: Timeline  # measured in a fresh process; ``maxima`` are the tracker's peaks
    predicted: Estimate

    @property
    def at_peak(self) -> dict[str, int]:
        """Bytes alive per category at the measured peak."""
        i = self.timeline.peak_index
        return {k: v[i] for k, v in self.timeline.alive.items()}

    def record(self, device: dict):
        """The results-store Record of this setting: its memory (view 1); time not measured."""
        memory = {**self.timeline.maxima, "peak": self.timeline.peak}
        config = replace(self.config, label=self.label).as_dict()
        return Record(config=config, device=device, n_params=self.predicted.n_params,
                      memory=memory)  # fmt: skip


class Savers(dict):
    """Labelled ``SaverResult``s, in the order measured; ``table()`` sets them side by side."""

    def table(self) -> pd.DataFrame:
        """``saver_table`` of these results."""
        return saver_table(self)


def measure_savers(configs: dict[str, RunConfig]) -> Savers:
    """Each labelled config's timeline (a fresh process each) next to its estimate."""
    return Savers({label: SaverResult(label, cfg, measure_timeline(cfg), estimate_run(cfg))
                   for label, cfg in configs.items()})  # fmt: skip


def saver_table(results: dict[str, SaverResult]) -> pd.DataFrame:
    """Measured and predicted MiB per category and at the peak, one row per setting."""
    rows = {}
    for label, r in results.items():
        m, p = r.timeline.maxima, r.predicted
        row = {f"{k} (MiB)": m[k] / MiB for k in ("gradients", "activations", "temporaries")}
        row["peak (MiB)"] = r.timeline.peak / MiB
        row["gradients at the peak (MiB)"] = r.at_peak["gradients"] / MiB
        row["predicted peak (MiB)"] = p.peak / MiB
        row["predicted / measured peak"] = p.peak / r.timeline.peak
        row["where the peak is"] = r.timeline.phase[r.timeline.peak_index]
        rows[label] = row
    return pd.DataFrame.from_dict(rows, orient="index")  # a row per setting, columns keep types


def largest_gradient_bytes(model, device: str = "cpu") -> int:
    """Bytes of the largest fp32 gradient of ``model`` (a config name, path or dict), as the
    device's allocator holds it: what the optimizer step inside backward keeps at most."""
    info = describe_model(model)
    return allocation_bytes(max(4 * p.numel for p in info.params if p.trainable), device)


def same_training(cfg: RunConfig, steps: int = 3) -> float:
    """Largest |difference| between the weights trained ``steps`` steps with the optimizer
    after backward and inside it (0.0: bitwise the same training)."""
    plain, fused = Trainee(cfg), Trainee(replace(cfg, optimizer_in_backward=True))
    for _ in range(steps):
        plain.step(), fused.step()
    pairs = zip(plain.model.parameters(), fused.model.parameters(), strict=True)
    return max((p - q).abs().max().item() for p, q in pairs)


def refusal(cfg: RunConfig) -> str:
    """The message a run that cannot step inside backward gets (its ValueError)."""
    try:
        Trainee(cfg)
    except ValueError as err:
        return str(err)
    return ""


@dataclass
class FusedStepFacts:
    """Section 1 beyond memory: the same training, and a setting the hooks cannot serve."""

    weight_gap: float  # largest |weight difference| after 3 steps after and inside backward
    refusal: str  # the message for the same run with gradient accumulation (grad_accum=2)


def fused_step_facts(cfg: RunConfig) -> FusedStepFacts:
    """``same_training(cfg)``, and ``refusal`` of ``cfg`` stepping inside backward with
    grad_accum=2."""
    fused = replace(cfg, optimizer_in_backward=True, grad_accum=2)
    return FusedStepFacts(same_training(cfg), refusal(fused))


# Llama 3's tokenizer has 128,256 tokens. The layers are llama-tiny's at half width at the tiny
# scale, so the output layer and its logits are most of the model and of the step, as they are
# for a 1B-parameter Llama 3.2 (a quarter of its weights are the vocabulary's).
LLAMA3_VOCAB = 128_256
_BIG_VOCAB = {
    "tiny": dict(hidden_size=64, head_dim=16, intermediate_size=176, num_hidden_layers=2),
    "full": dict(hidden_size=512, head_dim=64, intermediate_size=1408, num_hidden_layers=4),
}


def big_vocab_config(scale: str = "tiny") -> dict:
    """llama-tiny's architecture with Llama 3's 128k vocabulary, at the scale's width."""
    config = load_config("llama-tiny").to_dict()
    config.update(vocab_size=LLAMA3_VOCAB, **_BIG_VOCAB["full" if scale == "full" else "tiny"])
    return json.loads(json.dumps(config))  # plain JSON values: a RunConfig travels to processes


def loss_pair(cfg: RunConfig, chunk: int) -> tuple[float, float]:
    """The model's own loss and the chunked loss on the same batch."""
    trainee = Trainee(cfg)
    batch = trainee.batch()
    with torch.no_grad(), autocast_context(cfg.precision, trainee.device):
        full = trainee.model(**batch).loss.item()
        chunked = ChunkedCausalLMLoss(trainee.model, chunk)(batch).item()
    return full, chunked


def fused_loss_skip(device: torch.device) -> str:
    """Why Liger Kernel's fused linear cross-entropy cannot run here ("" when it can)."""
    if device.type != "cuda":
        return f"Liger Kernel's fused kernels are Triton kernels for CUDA GPUs; this is {device}"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel)"
    return ""


def fused_loss_peak(cfg: RunConfig) -> int:
    """Peak allocated bytes (CUDA) of a step whose loss is Liger's fused linear cross-entropy."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # optional

    trainee = Trainee(cfg)
    loss_fn = LigerFusedLinearCrossEntropyLoss()

    def loss_of(model, batch):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        hidden = model.get_decoder()(**inputs).last_hidden_state
        flat = hidden.reshape(-1, hidden.shape[-1])
        return loss_fn(model.get_output_embeddings().weight, flat, causal_targets(batch["labels"]))

    step = lambda: train_step(trainee.model, trainee.optimizer, [trainee.batch()],  # noqa: E731
                              precision=cfg.precision, loss_of=loss_of)  # fmt: skip
    step()
    reset_device_peaks(trainee.device)
    step()
    return allocator_peaks(trainee.device).allocated


@dataclass
class ChunkedLossFacts:
    """Section 3 beyond memory: the two losses, the recomputed head, Liger's fused kernel."""

    whole_loss: float  # model(**batch).loss
    chunked_loss: float  # ChunkedCausalLMLoss on the same batch
    extra_flops: int  # a chunked step's FLOPs minus a whole-loss step's (counted)
    liger_skip: str  # why Liger's fused kernel did not run here ("" when it did)
    liger_peak: int | None = None  # peak allocated bytes of a step with it (CUDA)


def chunked_loss_facts(cfg: RunConfig, chunk: int, device: torch.device) -> ChunkedLossFacts:
    """``loss_pair``, the FLOPs the chunked step adds, and Liger's peak where it can run."""
    whole, chunked = loss_pair(cfg, chunk)
    extra = step_flops(replace(cfg, loss_chunk=chunk)) - step_flops(cfg)
    skip = fused_loss_skip(device)
    return ChunkedLossFacts(whole, chunked, extra, skip, None if skip else fused_loss_peak(cfg))


def step_flops(cfg: RunConfig) -> int:
    """FLOPs of one training step of ``cfg`` (counted by torch's FlopCounterMode)."""
    trainee = Trainee(cfg)
    trainee.step()  # the optimizer state exists, as in every measured step
    return train_flops(trainee.step)
