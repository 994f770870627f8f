"""Real weights and real data, behind one switch: ``COURSE_PRETRAINED``.

The lessons build their models from configs with random weights (same memory, same time) and
generate their data, so nothing is downloaded. A learner who wants to see a real model learn
real text turns the switch on:

- ``COURSE_PRETRAINED=1``: a bundled config that names a hub model (``HUB_MODELS``) loads that
  model's pretrained weights and tokenizer with ``from_pretrained``, and the text comes from
  ``datasets.load_dataset("wikitext", "wikitext-2-raw-v1")``. Needs the network, the disk in
  ``HUB_MODELS``, and for a gated model its licence accepted and ``huggingface-cli login``.
- ``COURSE_PRETRAINED=/a/directory``: the weights and tokenizer come from that directory (what
  ``save_pretrained`` wrote), whatever config a lesson names. No network needed.
- ``COURSE_DATA=/a/file.txt`` (or ``.json`` / ``.jsonl`` with a ``text`` field): the text comes
  from that file instead of wikitext.

``switch()`` is the one place these variables are read. Anything that goes wrong while loading
(no hub, a gated model without login, a missing directory) becomes one line in ``RealRun.problem``
and the caller stays synthetic; nothing here raises for it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from helpers.device import resolve
from helpers.models import apply_lora, enable_checkpointing, task_kind
from helpers.train import RunConfig, make_optimizer, train_step

ENV = "COURSE_PRETRAINED"
DATA_ENV = "COURSE_DATA"
WIKITEXT = ("wikitext", "wikitext-2-raw-v1")  # ~13 MB of Wikipedia articles, CC BY-SA 3.0


@dataclass(frozen=True)
class HubModel:
    """The hub model a bundled config stands for, and what downloading it takes."""

    hub_id: str
    licence: str
    download_gb: float  # the weights' files, about
    gated: bool = False  # accept the licence on the model's page, then huggingface-cli login
    note: str = ""


HUB_MODELS: dict[str, HubModel] = {
    "bert-tiny": HubModel(
        "google/bert_uncased_L-2_H-128_A-2", "Apache-2.0", 0.02,
        note="Google's smallest BERT: the bundled bert-tiny's depth and width, 2 heads, "
        "the 30522-token vocabulary",
    ),
    "bert-large": HubModel(
        "google-bert/bert-large-uncased", "Apache-2.0", 1.3,
        note="the guides' model",
    ),
    "qwen3-0.6b": HubModel("Qwen/Qwen3-0.6B", "Apache-2.0", 1.5),
    "llama-3.2-1b": HubModel(
        "meta-llama/Llama-3.2-1B", "Llama 3.2 Community License (Meta)", 2.5, gated=True,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Switch:
    """What ``COURSE_PRETRAINED`` and ``COURSE_DATA`` ask for."""

    on: bool = False
    model_dir: Path | None = None  # weights and tokenizer from here instead of the hub
    data_file: Path | None = None  # text from here instead of wikitext

    def source(self, config_name: str) -> str | None:
        """Where ``config_name``'s weights come from: the directory, a hub id, or None."""
        if not self.on:
            return None
        if self.model_dir is not None:
            return str(self.model_dir)
        known = HUB_MODELS.get(config_name)
        return known.hub_id if known else None


def switch(environ: Mapping[str, str] | None = None) -> Switch:
    """The switch as the environment sets it (``os.environ`` unless given)."""
    env = os.environ if environ is None else environ
    value = env.get(ENV, "").strip()
    data = env.get(DATA_ENV, "").strip()
    data_file = Path(data).expanduser() if data else None
    if value.lower() in ("", "0", "false", "no", "off"):
        return Switch(False, None, data_file)
    if value.lower() in ("1", "true", "yes", "on"):
        return Switch(True, None, data_file)
    return Switch(True, Path(value).expanduser(), data_file)


def how_to_turn_on(config_name: str | None = None) -> str:
    """One line: how to switch real weights and data on, and what it needs."""
    models = [config_name] if config_name in HUB_MODELS else list(HUB_MODELS)
    needs = "; ".join(
        f"{name} = {HUB_MODELS[name].hub_id}, {HUB_MODELS[name].download_gb:g} GB, "
        f"{HUB_MODELS[name].licence}" + (" (gated: huggingface-cli login)" * HUB_MODELS[name].gated)
        for name in models
    )
    return (
        f"Real weights and data are off: set {ENV}=1 before starting Jupyter (needs the network, "
        f"~0.01 GB for wikitext-2 and the model: {needs}), or {ENV}=/a/saved/model/dir and "
        f"{DATA_ENV}=/a/text/file to work offline."
    )


# --------------------------------------------------------------------------------------------
# Loading: weights, tokenizer, text. Each may fail; real_run turns a failure into one line.


def load_model(source: str, attn: str = "eager", device: torch.device | str = "cpu"):
    """Pretrained weights from a hub id or a directory, with the course's head for its kind.

    Encoders get a sequence-classification head (new, randomly initialised: the pretrained
    checkpoint has none), decoders their causal LM head. fp32, on ``device``.
    """
    # the model classes import transformers' modeling code (and torchao where installed)
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
    )

    kind = task_kind(AutoConfig.from_pretrained(source))
    auto = AutoModelForSequenceClassification if kind == "classify" else AutoModelForCausalLM
    model = auto.from_pretrained(source, attn_implementation=attn, dtype=torch.float32)
    return model.to(device)


def load_texts(sw: Switch, cache_dir: str | None = None) -> list[str]:
    """The switch's text: its file's lines (or JSON records' ``text``), else wikitext-2's train
    split; empty lines dropped."""
    from datasets import load_dataset  # optional and slow to import: only when the switch is on

    if sw.data_file is None:
        data = load_dataset(*WIKITEXT, split="train", cache_dir=cache_dir)
    else:
        if not sw.data_file.is_file():
            raise FileNotFoundError(f"{DATA_ENV}={sw.data_file} is not a file")
        builder = "json" if sw.data_file.suffix in (".json", ".jsonl") else "text"
        data = load_dataset(
            builder, data_files=str(sw.data_file), split="train", cache_dir=cache_dir
        )
    return [t for t in data["text"] if t.strip()]


def token_blocks(tokenizer, texts: list[str], seq_len: int, n_blocks: int) -> torch.Tensor:
    """Up to ``n_blocks`` rows of ``seq_len`` tokens: the texts tokenised, joined end to end
    and cut into equal blocks (the usual way to train a language model on running text)."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) >= seq_len * n_blocks:
            break
    n = min(n_blocks, len(ids) // seq_len)
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one block of {seq_len}")
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)  # (n, seq_len)


def text_batches(
    blocks: torch.Tensor, kind: str, micro_batch: int, generator: torch.Generator
) -> Iterator[dict[str, torch.Tensor]]:
    """Endless micro-batches of real text for ``kind``.

    ``causal-lm`` predicts the next token. ``classify`` has no labels in running text, so it
    asks what the course's Markov task asks (helpers.data.markov_batch): was this passage
    reversed (label 1) or not? A pretrained encoder knows word order, so it learns this fast.
    """
    while True:
        rows = blocks[torch.randint(0, len(blocks), (micro_batch,), generator=generator)]
        if kind == "causal-lm":
            yield {"input_ids": rows, "labels": rows.clone()}
            continue
        flip = torch.randint(0, 2, (micro_batch,), generator=generator)  # (B,)
        ids = torch.where(flip[:, None].bool(), rows.flip(1), rows)
        yield {"input_ids": ids, "labels": flip}


# --------------------------------------------------------------------------------------------
# A short fine-tuning run with a planned setting


@dataclass
class RealRun:
    """A short fine-tuning run on real weights and text, or why it did not happen."""

    source: str = ""
    setting: RunConfig | None = None
    losses: list[float] = field(default_factory=list)  # one per optimizer step
    n_blocks: int = 0
    problem: str = ""  # one line when the run did not happen; empty when it did
    model: torch.nn.Module | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        """True when the model and the text loaded and every step ran."""
        return not self.problem

    def falls(self, window: int = 3) -> bool:
        """The mean of the last ``window`` losses is below the mean of the first ``window``."""
        first, last = self.losses[:window], self.losses[-window:]
        return len(self.losses) >= 2 * window and sum(last) / window < sum(first) / window


def fine_tune(
    model, setting: RunConfig, blocks: torch.Tensor, steps: int, lr: float
) -> list[float]:
    """``steps`` optimizer steps of ``setting`` (micro-batch, accumulation, checkpointing,
    precision, optimizer, LoRA) on ``blocks``; the loss of each step."""
    device = next(model.parameters()).device
    if setting.gradient_checkpointing:
        enable_checkpointing(model)
    if setting.lora_r:
        model = apply_lora(model, setting.lora_r, setting.lora_targets)
    model.train()
    optimizer = make_optimizer(setting.optimizer, model, lr=lr)
    scaler = torch.amp.GradScaler(device.type) if setting.precision == "fp16" else None
    generator = torch.Generator().manual_seed(setting.seed)
    batches = text_batches(blocks, task_kind(model.config), setting.batch_size, generator)
    losses = []
    for _ in range(steps):
        micro = (
            {k: v.to(device) for k, v in next(batches).items()} for _ in range(setting.grad_accum)
        )
        loss = train_step(
            model, optimizer, micro, accumulate=setting.grad_accum,
            precision=setting.precision, scaler=scaler,
        )  # fmt: skip
        losses.append(float(loss))
    return losses


def real_run(
    config_name: str,
    setting: RunConfig,
    steps: int = 30,
    lr: float = 5e-5,
    n_blocks: int = 64,
    sw: Switch | None = None,
    cache_dir: str | None = None,
) -> RealRun:
    """Fine-tune ``config_name``'s pretrained model with ``setting`` on the switch's text.

    Off, or for a config with no hub model, or when loading fails: a RealRun whose
    ``problem`` says so in one line (the caller stays synthetic). The model is the switch's
    directory or the config's hub model; ``setting.model`` is not used.
    """
    sw = switch() if sw is None else sw
    source = sw.source(config_name)
    if source is None:
        why = how_to_turn_on(config_name) if not sw.on else (
            f"{ENV} is on, but {config_name!r} names no hub model "
            f"(those that do: {', '.join(HUB_MODELS)}); staying synthetic"
        )  # fmt: skip
        return RealRun(problem=why)
    try:
        from transformers import AutoTokenizer  # slow (tokenizers): a real run only

        tokenizer = AutoTokenizer.from_pretrained(source)
        model = load_model(source, setting.attn, resolve(setting.device))
        blocks = token_blocks(tokenizer, load_texts(sw, cache_dir), setting.seq_len, n_blocks)
    except Exception as err:  # any loading failure is reported in one line, never raised
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return RealRun(
            source=source,
            problem=f"could not load {source} or its text ({type(err).__name__}: {first[:200]}); "
            "staying synthetic",
        )
    run = RealRun(source, replace(setting), n_blocks=len(blocks), model=model)
    run.losses = fine_tune(model, setting, blocks, steps, lr)
    if not all(math.isfinite(x) for x in run.losses):
        run.problem = f"the loss was not finite: {run.losses}"
    return run
