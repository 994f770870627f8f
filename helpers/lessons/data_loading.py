"""Lesson 11, sections 1-9 (notebooks/11_data_loading.ipynb).

A CPU-heavy input pipeline, and what lesson 11 measures about feeding a training step.

Text is generated, never downloaded: made-up words built from syllables, and documents that
are walks of a random Markov chain over those words. A WordPiece vocabulary of the syllables
lets a real BERT tokenizer split every word into pieces. The collate function tokenises each
whole document and cuts a random window of ``seq_len`` tokens from it, every time a document
is drawn: a deliberate stand-in for a slow input pipeline (real pre-training pipelines
tokenise once and cut windows from stored token ids). With transformers' pure-Python
tokenizer that is slow enough to keep a training step waiting. The measuring functions take
sizes, not objects, so they can run in a fresh process (``helpers.isolate.call_isolated``).
"""

from __future__ import annotations

import itertools
import math
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from helpers import hardware
from helpers.data import MarkovTask
from helpers.device import UtilSampler, resolve
from helpers.isolate import call_isolated
from helpers.models import build_model, load_config
from helpers.names import MiB
from helpers.plots import category_labels, legend_outside
from helpers.results import Record
from helpers.timing import Comparison, compare_calls, interleave, synchronize
from helpers.train import make_optimizer, quiet_trainer, train_step

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
CODAS = ("", "n", "r", "s")  # a syllable may end in one of these
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TOKENIZERS = ("slow", "fast")


def syllables(seed: int = 0) -> list[str]:
    """Consonant-vowel syllables, some closed by a consonant: the pieces every word is made of."""
    rng = random.Random(seed)
    return sorted({c + v + rng.choice(CODAS) for c in CONSONANTS for v in VOWELS})


def wordpiece_vocab(seed: int = 0) -> list[str]:
    """WordPiece vocabulary: special tokens, letters, syllables and their ``##`` continuations."""
    pieces = list(CONSONANTS + VOWELS) + syllables(seed)
    return SPECIALS + pieces + ["##" + p for p in pieces]


def make_words(n_words: int, seed: int = 0) -> list[str]:
    """``n_words`` distinct made-up words of one to three syllables each."""
    rng, parts, words = random.Random(seed), syllables(seed), {}
    while len(words) < n_words:
        word = "".join(rng.choice(parts) for _ in range(rng.randint(1, 3)))
        words.setdefault(word, None)
    return list(words)


def make_tokenizer(kind: str = "slow", seed: int = 0):
    """BERT WordPiece tokenizer over ``wordpiece_vocab``: pure Python (slow) or Rust (fast)."""
    from transformers import BertTokenizer, BertTokenizerLegacy  # slow: tokenizer modules

    classes = {"slow": BertTokenizerLegacy, "fast": BertTokenizer}
    if kind not in classes:
        raise ValueError(f"unknown tokenizer {kind!r}: use one of {', '.join(TOKENIZERS)}")
    with tempfile.TemporaryDirectory() as folder:  # both read the file once, when built
        path = Path(folder) / "vocab.txt"
        path.write_text("\n".join(wordpiece_vocab(seed)) + "\n")
        return classes[kind](str(path))


def markov_walks(n_walks: int, length: int, n_states: int, seed: int = 0) -> torch.Tensor:
    """(n_walks, length) state ids: walks of ``MarkovTask(n_states)`` from its stationary law."""
    task = MarkovTask(n_states=n_states, seed=seed)
    g = torch.Generator().manual_seed(seed)
    cum = task.transition.cumsum(1)  # (n, n): inverse-CDF sampling, one uniform per step
    cum[:, -1] = 1.0  # exact top, so rounding can never step past the last state
    walks = torch.empty(n_walks, length, dtype=torch.long)
    walks[:, 0] = torch.multinomial(task.stationary, n_walks, True, generator=g)
    u = torch.rand(length, n_walks, 1, generator=g, dtype=torch.float64)
    for t in range(1, length):
        walks[:, t] = torch.searchsorted(cum[walks[:, t - 1]], u[t])[:, 0]
    return walks


class Documents(Dataset):
    """Generated documents (walks over made-up words); label 1 when the walk runs backwards."""

    def __init__(self, n_docs: int, words_per_doc: int, n_words: int = 256, seed: int = 0):
        words = make_words(n_words, seed)
        walks = markov_walks(n_docs, words_per_doc, n_words, seed)  # (N, W)
        g = torch.Generator().manual_seed(seed + 1)
        flip = torch.randint(0, 2, (n_docs,), generator=g)  # (N,)
        walks = torch.where(flip[:, None].bool(), walks.flip(1), walks)
        self.texts = [" ".join(words[i] for i in row) for row in walks.tolist()]
        self.labels = flip.tolist()

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict:
        return {"text": self.texts[i], "label": self.labels[i]}


class WindowCollator:
    """Tokenise each whole document, keep a random window of ``seq_len`` tokens, make a batch."""

    def __init__(self, tokenizer, seq_len: int, timed: bool = False):
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        # timed: the batch also carries "collate_s" and "collate_cpu_s", the wall-clock and
        # CPU seconds the call took where it ran (a worker or the training process).
        self.timed = timed

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        wall_start, cpu_start = time.perf_counter(), time.thread_time()
        tok, body = self.tokenizer, self.seq_len - 2  # room for [CLS] and [SEP]
        ids = torch.full((len(features), self.seq_len), tok.pad_token_id)  # (B, S)
        mask = torch.zeros(len(features), self.seq_len, dtype=torch.long)  # (B, S)
        for row, feature in enumerate(features):
            pieces = tok(feature["text"], add_special_tokens=False)["input_ids"]  # whole text
            # torch's generator: DataLoader seeds it differently in every worker.
            start = int(torch.randint(max(1, len(pieces) - body + 1), ()))
            window = [tok.cls_token_id, *pieces[start : start + body], tok.sep_token_id]
            ids[row, : len(window)] = torch.tensor(window)
            mask[row, : len(window)] = 1
        labels = torch.tensor([f["label"] for f in features])  # (B,)
        batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        if self.timed:
            cpu = time.thread_time() - cpu_start
            batch["collate_s"] = torch.tensor(time.perf_counter() - wall_start, dtype=torch.float64)
            batch["collate_cpu_s"] = torch.tensor(cpu, dtype=torch.float64)
        return batch


def start_method() -> str | None:
    """``fork`` on Linux, where it starts a worker in milliseconds; else the platform default."""
    return "fork" if sys.platform.startswith("linux") else None


def make_loader(
    docs: Dataset,
    batch_size: int,
    seq_len: int,
    tokenizer: str = "slow",
    num_workers: int = 0,
    pin_memory: bool = False,
    method: str | None = "auto",
    timed: bool = False,
    **kwargs,
) -> DataLoader:
    """A DataLoader that tokenises in its collate function; workers start with ``method``."""
    # "auto" is start_method(); None keeps multiprocessing's default, which is forkserver
    # inside a helpers.isolate process (seconds per worker). kwargs go to the DataLoader.
    method = start_method() if method == "auto" else method
    context = mp.get_context(method) if num_workers > 0 and method else None
    collate = WindowCollator(make_tokenizer(tokenizer), seq_len, timed)
    return DataLoader(
        docs,
        batch_size=batch_size,
        collate_fn=collate,
        num_workers=num_workers,
        pin_memory=pin_memory,
        multiprocessing_context=context,
        **kwargs,
    )


def loader_settings(loader: DataLoader) -> dict:
    """The arguments a DataLoader was built with (those lesson 11 sets), for a table or a
    comparison: the notebook's hand-built loader against ``make_loader``'s."""
    context, collate = loader.multiprocessing_context, loader.collate_fn
    return {
        "batch_size": loader.batch_size,
        "collate_fn": type(collate).__name__,
        "tokenizer": type(getattr(collate, "tokenizer", None)).__name__,
        "seq_len": getattr(collate, "seq_len", None),
        "num_workers": loader.num_workers,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "pin_memory": loader.pin_memory,
        "multiprocessing_context": context.get_start_method() if context else None,
    }


@dataclass
class DeviceWaits:
    """Steps behind a stand-in device (``waits_behind_device``), in seconds."""

    waits: list[float]  # time each step spent in next(loader)
    collates: list[float]  # each of those batches' collate, where it ran (a timed loader)


def waits_behind_device(
    loader: DataLoader, device_s: float, steps: int = 6, warmup: int = 2
) -> DeviceWaits:
    """Time each of ``steps`` steps waited in ``next(loader)``, the step itself being
    ``device_s`` of sleep: a stand-in for a GPU, which computes while the training process's
    core is free (for workers, or for the collate function at the next ``next``). A loader
    built with ``timed=True`` also reports its batches' collate seconds."""
    it, out = iter(loader), DeviceWaits([], [])
    for i in range(warmup + steps):
        start = time.perf_counter()
        batch = next(it)
        if i >= warmup:  # the first batches include starting the workers
            out.waits.append(time.perf_counter() - start)
            if "collate_s" in batch:
                out.collates.append(float(batch["collate_s"]))
        time.sleep(device_s)
    del it  # shuts non-persistent workers down
    return out


def to_device(batch: dict, device: torch.device, non_blocking: bool = False) -> dict:
    """Every tensor of ``batch`` on ``device``: the same mapping of model inputs, moved."""
    return {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}


def _model_and_optimizer(name: str, device: torch.device, seed: int):
    """The lesson's model (random init, fp32) and AdamW, on ``device``."""
    model = build_model(load_config(name), device=device, seed=seed)
    model.train()
    return model, make_optimizer("adamw", model)


def _device(device: str | None) -> torch.device:
    """``device`` as a torch.device (None: the default device)."""
    return resolve(device)


def batch_times(loader: DataLoader, n: int) -> list[float]:
    """Seconds each of the first ``n`` ``next(loader)`` calls took (iterator creation excluded)."""
    it, times = iter(loader), []
    for _ in range(n):
        start = time.perf_counter()
        next(it)
        times.append(time.perf_counter() - start)
    return times


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity), which its workers share."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def predicted_step(
    t_data: float,
    t_model: float,
    workers: int,
    cores: int,
    model_cpu: float | None = None,
    data_cpu: float | None = None,
) -> float:
    """Seconds per step: serial without workers, else the slowest of three limits."""
    # The device needs t_model per step; the workers deliver a batch every t_data / workers;
    # all the CPU work of a step, the batch's CPU seconds data_cpu plus the training
    # process's own model_cpu (all of t_model on a CPU, kernel launches on a GPU), must fit
    # on the cores. Without CPU seconds given, the wall-clock times stand in for them.
    if workers == 0:
        return t_data + t_model
    model_cpu = t_model if model_cpu is None else model_cpu
    data_cpu = t_data if data_cpu is None else data_cpu
    return max(t_model, t_data / workers, (data_cpu + model_cpu) / cores)


def prediction_band(workers: int, cores: int) -> tuple[float, float]:
    """Bounds on measured step / ``predicted_step`` from a run's own costs (lesson 11).

    Without workers the step is the serial sum by construction, up to the loader's
    bookkeeping and preemption on a shared machine: 10 % either way. With workers the
    prediction is a limit reached only with perfect overlap; each hand-over of a batch costs
    a few ms more (up to 3/10 of a 50 ms step), so up to 1.3x; and a mean over 10 steps can
    beat the limit by the batches the workers had ready when the window opened
    (``prefetch_factor`` per worker), so down to 0.85x. Where the workers and the model share
    two cores they also slow each other down (tokenising ran 30-50 % slower beside training),
    which the limits ignore: up to 1.5x there (a fresh-clone CI run measured 1.32x).
    """
    if workers == 0:
        return 0.9, 1.1
    return 0.85, 1.5 if cores < 3 else 1.3


@dataclass
class CalibrationResult:
    """The step and tokenizer costs the lesson sizes its documents from (seconds)."""

    t_model: float  # one training step, batch already on the device
    model_cpu: float  # CPU seconds the training process spends on that step
    words_per_doc: int  # document length that makes t_data about ratio x t_model (slow)
    t_data: dict[str, float]  # one batch from the loader alone (no model), per tokenizer
    ratio: float  # the t_data / t_model the documents were sized for (slow tokenizer)
    batch_size: int  # documents per batch
    tokenizers: object = None  # helpers.timing.Comparison: the tokenizers' batches, in turns

    def per_word(self, kind: str) -> float:
        """Seconds to tokenise one word (collating included) with tokenizer ``kind``."""
        return self.t_data[kind] / self.batch_size / self.words_per_doc


def endless(loader: DataLoader):
    """Batches of ``loader`` without end: a new epoch starts when one runs out."""
    while True:
        yield from loader


def calibrate(
    model: str,
    batch_size: int,
    seq_len: int,
    ratio: float = 1.5,
    device: str | None = None,
    threads: int = 1,
    repeats: int = 5,
    probe_words: int = 400,
    seed: int = 0,
    claims=(),
) -> CalibrationResult:
    """Measure t_model, size documents so the slow pipeline takes ``ratio`` x t_model per batch.

    The two tokenizers' batches at that size are then timed in turns (``repeats`` rounds at
    least, more while one of ``claims`` about them is undecided).
    """
    torch.set_num_threads(threads)
    dev = _device(device)
    net, optimizer = _model_and_optimizer(model, dev, seed)
    probe = Documents(batch_size, seq_len, seed=seed)
    batch = to_device(next(iter(make_loader(probe, batch_size, seq_len))), dev)
    t_model, model_cpu = _step_costs(net, optimizer, batch, dev, repeats)
    words = _words_per_doc(ratio * t_model, batch_size, seq_len, probe_words, seed)
    docs = Documents(batch_size * 4, words, seed=seed)
    tokenizers = _tokenizer_rounds(docs, batch_size, seq_len, max(5, repeats), claims)
    t_data = {kind: tokenizers.median(kind) for kind in TOKENIZERS}
    return CalibrationResult(t_model, model_cpu, words, t_data, ratio, batch_size, tokenizers)


def _step_costs(net, optimizer, batch: dict, dev: torch.device, repeats: int):
    """Median (wall-clock, CPU) seconds of the base training step on ``batch``, warmed up."""
    walls, cpus = [], []
    for i in range(2 + repeats):  # two warm-up steps (the first creates AdamW's state)
        synchronize(dev)
        wall, cpu = time.perf_counter(), time.thread_time()
        train_step(net, optimizer, [batch])
        cpu = time.thread_time() - cpu  # before synchronising: work, not waiting
        synchronize(dev)
        if i >= 2:
            walls.append(time.perf_counter() - wall)
            cpus.append(cpu)
    return statistics.median(walls), statistics.median(cpus)


def _words_per_doc(t_target: float, batch_size: int, seq_len: int, probe_words: int, seed: int):
    """Document length at which the slow pipeline takes about ``t_target`` seconds per batch."""
    # Sizing, not a claim: the slow tokenizer's seconds per word on long probe documents.
    probe_docs = Documents(batch_size * 3, probe_words, seed=seed)
    probe_s = statistics.median(batch_times(make_loader(probe_docs, batch_size, seq_len), 3)[1:])
    return max(seq_len, math.ceil(t_target * probe_words / probe_s))


def _tokenizer_rounds(docs: Documents, batch_size: int, seq_len: int, rounds: int, claims):
    """Batches of ``docs`` from each tokenizer's loader, timed in turns (a Comparison)."""
    batches = {kind: endless(make_loader(docs, batch_size, seq_len, kind)) for kind in TOKENIZERS}
    return compare_calls(
        {kind: (lambda it=it: next(it)) for kind, it in batches.items()},
        torch.device("cpu"),  # the loader runs on the CPU whatever the model's device
        rounds=rounds,
        claims=claims,
    )


@dataclass
class LoaderConfig:
    """One measured training loop fed by the tokenising DataLoader (``loader_loop``)."""

    model: str = "bert-tiny"
    batch_size: int = 4
    seq_len: int = 64
    words_per_doc: int = 200
    tokenizer: str = "slow"
    num_workers: int = 0
    pin_memory: bool = False
    steps: int = 30  # measured steps
    warmup: int = 3  # steps before measuring: worker start-up, optimizer state, queue filling
    threads: int = 1  # torch intra-op threads of the training process
    device: str | None = None
    seed: int = 0


@dataclass
class LoaderResult:
    """Per-step seconds spent waiting in ``next(loader)`` and computing, after the warm-up."""

    config: LoaderConfig  # the loop that ran
    waits: list[float] = field(default_factory=list)  # seconds in next(loader), per step
    computes: list[float] = field(default_factory=list)  # seconds of each training step
    collates: list[float] = field(default_factory=list)  # seconds each batch's collate took
    collate_cpus: list[float] = field(default_factory=list)  # CPU seconds of those
    model_cpus: list[float] = field(default_factory=list)  # CPU seconds of each step
    first_batch_s: float = 0.0  # iter() to the first batch: includes starting the workers
    cores: int = 0  # CPU cores of the machine (``cpu_cores``)
    gpu_util: float | None = None  # mean NVML utilisation (%) over the measured steps
    others_cpu: float | None = None  # cores other processes used meanwhile (OtherLoad)

    @property
    def t_data(self) -> float:
        """Mean seconds to collate a batch, wherever it ran, during the measured steps."""
        return statistics.fmean(self.collates)

    @property
    def t_model(self) -> float:
        """Mean seconds of the training step itself during the measured steps."""
        return statistics.fmean(self.computes)

    @property
    def predicted(self) -> float:
        """``predicted_step`` from this run's own t_data and t_model."""
        model_cpu, data_cpu = statistics.fmean(self.model_cpus), statistics.fmean(self.collate_cpus)
        w = self.config.num_workers
        return predicted_step(self.t_data, self.t_model, w, self.cores, model_cpu, data_cpu)

    @property
    def step_time(self) -> float:
        """Mean seconds per step, waiting included."""
        return (sum(self.waits) + sum(self.computes)) / len(self.waits)

    @property
    def wait_fraction(self) -> float:
        """Share of the loop's time spent waiting for data."""
        return sum(self.waits) / (sum(self.waits) + sum(self.computes))

    @property
    def samples_per_s(self) -> float:
        """Training throughput."""
        return self.config.batch_size / self.step_time


def check_workers_allowed(num_workers: int) -> None:
    """Raise a clear error where DataLoader workers cannot start: in a daemon process."""
    if num_workers > 0 and mp.current_process().daemon:
        raise RuntimeError(
            f"{num_workers} DataLoader worker(s) asked for in a daemon process, and daemon "
            "processes may not have children: run this experiment with "
            "isolate.call_isolated(..., daemon=False)"
        )


def loader_loop(config: LoaderConfig) -> LoaderResult:
    """Train ``config.steps`` steps from the DataLoader; time the wait for data and the compute."""
    # The collate function times itself (WindowCollator(timed=True)), so each run also yields
    # its own t_data and t_model, measured while it ran: the prediction and the measurement
    # share the machine's state of that moment.

    c = config
    check_workers_allowed(c.num_workers)
    torch.set_num_threads(c.threads)
    dev = _device(c.device)
    net, optimizer = _model_and_optimizer(c.model, dev, c.seed)
    docs = Documents(c.batch_size * (c.warmup + c.steps), c.words_per_doc, seed=c.seed)
    loader = make_loader(
        docs, c.batch_size, c.seq_len, c.tokenizer, c.num_workers, c.pin_memory, timed=True
    )
    result = LoaderResult(c, cores=cpu_cores())

    def step(it) -> tuple[float, float, float, float, float]:
        """One step: (wait, compute, collate, collate CPU, step CPU) seconds."""
        t0 = time.perf_counter()
        batch = next(it)
        t1 = time.perf_counter()
        collate, collate_cpu = float(batch.pop("collate_s")), float(batch.pop("collate_cpu_s"))
        cpu = time.thread_time()
        train_step(net, optimizer, [to_device(batch, dev, non_blocking=c.pin_memory)])
        cpu = time.thread_time() - cpu  # before the synchronisation: work, not waiting
        synchronize(dev)
        return t1 - t0, time.perf_counter() - t1, collate, collate_cpu, cpu

    start = time.perf_counter()
    it = iter(loader)
    compute = step(it)[1]
    result.first_batch_s = time.perf_counter() - start - compute  # iter() + first batch
    for _ in range(c.warmup - 1):
        step(it)

    with UtilSampler(dev) as sampler, hardware.OtherLoad() as others:
        for _ in range(c.steps):
            wait, compute, collate, collate_cpu, cpu = step(it)
            result.waits.append(wait)
            result.computes.append(compute)
            result.collates.append(collate)
            result.collate_cpus.append(collate_cpu)
            result.model_cpus.append(cpu)
    del it  # shuts the workers down
    result.gpu_util, result.others_cpu = sampler.mean, others.cores
    return result


def pooled(results: list[LoaderResult]) -> LoaderResult:
    """Several runs of one configuration as one result: their measured steps together."""
    out = LoaderResult(results[0].config, cores=results[0].cores)
    for r in results:
        for name in ("waits", "computes", "collates", "collate_cpus", "model_cpus"):
            getattr(out, name).extend(getattr(r, name))
    out.first_batch_s = statistics.median(r.first_batch_s for r in results)
    utils = [r.gpu_util for r in results if r.gpu_util is not None]
    out.gpu_util = statistics.fmean(utils) if utils else None
    others = [r.others_cpu for r in results if r.others_cpu is not None]
    out.others_cpu = max(others) if others else None
    return out


@dataclass
class LoaderRoundsResult:
    """Training loops run in rotating rounds, each run in a fresh process (``loop_rounds``)."""

    steps: object  # helpers.timing.Comparison: each run's mean step seconds, every round
    quiet: object  # the same for the rounds no other process disturbed (for the claims)
    runs: dict[str, list[LoaderResult]]  # every run of every configuration, in order

    def pooled(self) -> dict[str, LoaderResult]:
        """Each configuration's runs as one ``LoaderResult`` (``pooled``), keyed by its name."""
        return {name: pooled(runs) for name, runs in self.runs.items() if runs}

    def waited(self) -> Comparison:
        """Seconds each step waited for its batch, per round, as a Comparison of contenders
        named "waited in <configuration>": the rounds ``quiet`` kept and set aside (and its
        first measurement, if it measured again), so a claim about waiting is decided on the
        same undisturbed rounds as the speed claims, and is undecided where they are."""
        q = self.quiet
        n_first = len(q.first.kept) if q.first is not None else 0
        out = _waits_like(q, {n: rs[n_first:] for n, rs in self.runs.items()})
        if q.first is not None:
            out.first = _waits_like(q.first, {n: rs[:n_first] for n, rs in self.runs.items()})
        return out


def _waits_like(like: Comparison, runs: dict[str, list[LoaderResult]]) -> Comparison:
    """The mean wait per step of ``runs``, round by round, with ``like``'s record of rounds."""
    waits = {f"waited in {n}": [statistics.fmean(r.waits) for r in rs] for n, rs in runs.items()}
    kept = None if like.kept is None else list(like.kept)
    return Comparison(
        waits, like.confidence, left_out=dict(like.left_out), others=list(like.others), kept=kept
    )


def loop_rounds(
    configs: dict[str, LoaderConfig], claims=(), max_others: float | None = 0.2, **rounds
) -> LoaderRoundsResult:
    """``loader_loop`` of every configuration, each run a fresh process, in rotating rounds.

    A round runs every configuration once, so a burst of load on the machine hits all of them;
    ``rounds`` as for ``helpers.timing.interleave`` (more rounds while a claim is undecided).
    Interleaving cancels a load that slows every run alike, but a worker overlaps only if a
    core is free for it: a round in which other processes used ``max_others`` cores or more
    during a run (``helpers.hardware.OtherLoad``; Linux) is left out of ``quiet``, the
    comparison the claims are decided on (counted in ``quiet.left_out``; ``claims`` ask for
    more rounds while undecided there), and kept in ``steps`` and ``runs``. 0.2: the claims
    have a margin of ~0.15 in the ratio (one worker measures ~0.65 of no worker on two cores,
    claimed < 0.8), and a run that loses a core to a burst for a fifth of its time moves its
    ratio towards 1 by about that much.
    """
    runs: dict[str, list[LoaderResult]] = {name: [] for name in configs}
    this_round: dict[str, LoaderResult] = {}

    def run(name: str) -> float:
        """One run of configuration ``name`` in a fresh process; its mean step seconds."""
        out = call_isolated(loader_loop, configs[name], daemon=False)
        if out.error:
            raise RuntimeError(f"{name}: {out.error}")
        this_round[name] = out.value
        return out.value.step_time

    def reject() -> str | None:
        """Keep the round's runs; why the round is left out of ``quiet``, if it is."""
        done = dict(this_round)
        this_round.clear()
        for name, r in done.items():
            runs[name].append(r)
        busy = [r.others_cpu for r in done.values() if r.others_cpu is not None]
        if max_others is not None and busy and max(busy) >= max_others:
            return f"other processes took {max_others:g}+ of a core"
        return None

    quiet = interleave(run, list(configs), claims=claims, reject=reject, **rounds)
    steps = Comparison({name: [r.step_time for r in rs] for name, rs in runs.items()})
    return LoaderRoundsResult(steps, quiet, runs)


@dataclass
class StartupResult:
    """Seconds from ``iter(loader)`` to the first batch: each set-up's first epoch (one-off,
    workers start either way), then later epochs timed in turns (``later``, a Comparison)."""

    first_epoch: dict[str, float]  # per set-up: the first epoch's delay
    later: object  # helpers.timing.Comparison: later epochs' delays, one epoch each per round


def startup_rounds(
    setups: dict[str, tuple[int, bool]],
    batch_size: int = 4,
    seq_len: int = 64,
    batches: int = 2,
    claims=(),
    method: str | None = "auto",
    **rounds,
) -> StartupResult:
    """First-batch delay of loaders with (num_workers, persistent_workers) ``setups``.

    All loaders live in this process (run it with ``call_isolated(..., daemon=False)``); an
    epoch of each is one unit, so the set-ups alternate epoch by epoch (``rounds`` as for
    ``helpers.timing.interleave``). Short documents: the delay is start-up, not tokenising.
    """
    check_workers_allowed(max(w for w, _ in setups.values()))
    docs = Documents(batch_size * batches, seq_len, seed=0)
    loaders = {
        name: make_loader(
            docs,
            batch_size,
            seq_len,
            "slow",
            w,
            method=method,
            persistent_workers=persistent and w > 0,
        )
        for name, (w, persistent) in setups.items()
    }

    def epoch(name: str) -> float:
        """One epoch of loader ``name``; seconds to its first batch."""
        start = time.perf_counter()
        it = iter(loaders[name])
        next(it)
        first = time.perf_counter() - start
        for _ in it:  # finish the epoch (non-persistent workers shut down at its end)
            pass
        return first

    first = {name: epoch(name) for name in loaders}
    return StartupResult(first, interleave(epoch, list(loaders), claims=claims, **rounds))


class StepClock:
    """A TrainerCallback's two events: time stamps of each optimizer step's start and end.

    The Trainer fetches a step's batch before ``on_step_begin``. This class and
    ``CollateTimes`` meet transformers' base classes only inside ``trainer_runs``
    (``_on_base``): importing those pulls in peft and bitsandbytes, a second or more in each
    of the fresh processes that import this module to run a loop.
    """

    def __init__(self):
        self.begins: list[float] = []
        self.ends: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        """The step starts: its batch is here."""
        self.begins.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        """The optimizer step is done."""
        self.ends.append(time.perf_counter())


class CollateTimes:
    """Trainer mix-in: keeps each batch's ``collate_s`` instead of passing it to the model."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.collates: list[float] = []  # seconds each batch's collate took, in order

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's step on ``inputs`` without the collate function's timings."""
        self.collates.append(float(inputs.pop("collate_s")))
        inputs.pop("collate_cpu_s")
        return super().training_step(model, inputs, num_items_in_batch)


def _on_base(mixin: type, base: type) -> type:
    """``class Mixin(mixin, base)``: a mix-in on top of a transformers class."""
    return type(mixin.__name__, (mixin, base), {})


@dataclass
class TrainerLoaderResult:
    """One ``Trainer`` run of ``trainer_runs``: its DataLoader settings and its steps' times."""

    num_workers: int  # dataloader_num_workers asked for
    loader_workers: int | None  # num_workers of the DataLoader the Trainer built
    pin_memory_arg: bool  # dataloader_pin_memory as TrainingArguments kept it
    loader_pin_memory: bool | None  # pin_memory of the DataLoader the Trainer built
    step_time: float  # mean seconds per measured step, fetching the batch included
    t_data: float  # mean seconds of each measured batch's collate, where it ran
    t_model: float  # mean seconds from on_step_begin to on_step_end
    wait_fraction: float  # share of the measured time spent before the steps began
    samples_per_s: float  # batch_size / step_time
    train_samples_per_second: float  # the Trainer's own throughput, start-up included


@dataclass
class _TrainerRun:
    """What one Trainer run leaves to measure."""

    clock: StepClock
    collates: list[float]
    loader: object  # the DataLoader the Trainer built
    args: object  # its TrainingArguments
    metrics: dict


def trainer_runs(
    arguments: Callable,
    model: str,
    batch_size: int,
    seq_len: int,
    words_per_doc: int,
    workers: tuple[int, ...] = (0, 1),
    steps: int = 8,
    warmup: int = 2,
    threads: int = 1,
    device: str | None = None,
) -> list[TrainerLoaderResult]:
    """Train with ``Trainer`` on the same documents and collator, once per worker count.

    ``arguments(folder, device, batch_size, steps, workers)`` gives the ``TrainingArguments``
    of one run (lesson 11 writes it in a cell).
    """
    # One process for all: importing the Trainer costs seconds, once. Per run: seconds per
    # step, the share spent before the step began (fetching the batch), the collate's own
    # seconds (a Trainer subclass takes them out of the batch before the model sees it), the
    # Trainer's own throughput (start-up included) and the DataLoader settings it used.
    check_workers_allowed(max(workers, default=0))
    dev = _device(device)
    from transformers import Trainer, TrainerCallback  # seconds: only this call needs it

    torch.set_num_threads(threads)
    docs = Documents(batch_size * (steps + warmup), words_per_doc, seed=0)
    collate = WindowCollator(make_tokenizer("slow"), seq_len, timed=True)
    classes = _on_base(CollateTimes, Trainer), _on_base(StepClock, TrainerCallback)
    out = []
    for num_workers in workers:
        with tempfile.TemporaryDirectory() as folder:
            args = arguments(folder, dev, batch_size, steps + warmup, num_workers)
            run = _train(classes, model, args, docs, collate)
        out.append(_trainer_result(run, num_workers, batch_size, warmup))
    return out


def _train(classes: tuple[type, type], model: str, args, docs: Documents, collate) -> _TrainerRun:
    """A fresh ``model`` trained by a quiet, timed Trainer (``classes``: Trainer, clock)."""
    trainer_class, clock_class = classes
    clock = clock_class()
    net = build_model(load_config(model), seed=0)
    trainer = quiet_trainer(
        trainer_class(
            model=net, args=args, train_dataset=docs, data_collator=collate, callbacks=[clock]
        )
    )
    loader = trainer.get_train_dataloader()
    metrics = trainer.train().metrics
    return _TrainerRun(clock, trainer.collates, loader, args, metrics)


def _trainer_result(
    run: _TrainerRun, num_workers: int, batch_size: int, warmup: int
) -> TrainerLoaderResult:
    """A Trainer run's steps after ``warmup``: the wait before each, and the step itself."""
    begins, ends = np.array(run.clock.begins[warmup:]), np.array(run.clock.ends[warmup:])
    waits = begins - np.array(run.clock.ends[warmup - 1 : -1])  # fetching the batch, mostly
    computes = ends - begins
    step = float(np.mean(waits + computes))
    return TrainerLoaderResult(
        num_workers=num_workers,
        loader_workers=getattr(run.loader, "num_workers", None),
        pin_memory_arg=run.args.dataloader_pin_memory,
        loader_pin_memory=getattr(run.loader, "pin_memory", None),
        step_time=step,
        t_data=statistics.fmean(run.collates[warmup:]),
        t_model=float(np.mean(computes)),
        wait_fraction=float(waits.sum() / (waits.sum() + computes.sum())),
        samples_per_s=batch_size / step,
        train_samples_per_second=run.metrics["train_samples_per_second"],
    )


def copy_comparison(hosts: dict[str, torch.Tensor], device: str, claims=(), **rounds):
    """Copies of each host tensor to ``device`` timed in turns (non-blocking where pinned)."""
    dev = torch.device(device)
    dest = torch.empty_like(next(iter(hosts.values())), device=dev)
    calls = {
        name: (lambda h=host: dest.copy_(h, non_blocking=h.is_pinned()))
        for name, host in hosts.items()
    }
    return compare_calls(calls, dev, claims=claims, **rounds)


def host_held(device: str, pinned: bool, non_blocking: bool, nbytes: int, busy_s: float = 0.05):
    """(GPU busy, Python held, total) seconds of a host-to-device copy behind queued work."""
    dev = torch.device(device)
    a = torch.randn(2048, 2048, device=dev)
    a @ a  # the first matmul initialises the BLAS library
    synchronize(dev)
    start = time.perf_counter()
    for _ in range(3):
        a @ a
    synchronize(dev)
    n_mm = max(1, math.ceil(3 * busy_s / (time.perf_counter() - start)))
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def queue_work():
        """Queue the matmuls that keep the GPU busy for about ``busy_s``."""
        for _ in range(n_mm):
            a @ a

    queue_work()  # warm-up
    synchronize(dev)
    start = time.perf_counter()
    queue_work()
    synchronize(dev)
    busy = time.perf_counter() - start
    queue_work()
    start = time.perf_counter()
    host.to(dev, non_blocking=non_blocking)
    held = time.perf_counter() - start
    synchronize(dev)
    return busy, held, time.perf_counter() - start


@dataclass
class PinMemoryResult:
    """What ``pin_memory=True`` does on this machine (``pin_report``); copies on CUDA only."""

    warnings: list[str]  # what DataLoader(pin_memory=True) warned
    batch_pinned: bool  # whether its batch came back in pinned memory
    batch_bytes: int  # bytes of one batch of token ids
    copies: object = None  # helpers.timing.Comparison: pageable and pinned copies in turns
    nbytes: int | None = None  # bytes of each copied host buffer
    # (pinned, non_blocking) -> (GPU busy, Python held, total) seconds (``host_held``)
    held: dict[tuple[bool, bool], tuple[float, float, float]] | None = None


def pin_report(device: str | None = None, nbytes: int = 64 * MiB, claims=()) -> PinMemoryResult:
    """What pin_memory=True does here: DataLoader's warning, pinned batches, copy speeds.

    On CUDA, ``copies`` compares a pageable and a pinned host buffer copied in turns.
    """
    dev = _device(device)
    docs = Documents(4, 64, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = next(iter(make_loader(docs, 4, 64, pin_memory=True)))
    report = PinMemoryResult(
        warnings=[str(w.message) for w in caught],
        batch_pinned=batch["input_ids"].is_pinned(),
        batch_bytes=sum(t.numel() * t.element_size() for t in batch.values()),
    )
    if dev.type == "cuda":
        hosts = {
            "pageable": torch.ones(nbytes, dtype=torch.uint8),
            "pinned": torch.ones(nbytes, dtype=torch.uint8, pin_memory=True),
        }
        report.copies = copy_comparison(hosts, str(dev), claims)
        report.nbytes = nbytes
        report.held = {
            (pinned, nb): host_held(str(dev), pinned, nb, nbytes)
            for pinned, nb in ((False, False), (True, False), (True, True))
        }
    return report


def starvation_figure(
    runs: dict[str, LoaderResult],
    prior: dict | None = None,
    title: str = "",
    rates: dict | None = None,
):
    """Wait and compute per step with each run's prediction; samples/s against num_workers."""
    # prior: {num_workers: step seconds} predicted before the runs, drawn as a grey line.
    # rates: {label: (median, slowest, fastest)} samples/s of interleaved rounds (error bars).
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    labels = list(runs)
    compute = [1e3 * r.t_model for r in runs.values()]
    wait = [1e3 * statistics.fmean(r.waits) for r in runs.values()]
    left.bar(labels, compute, color="#4C72B0", label="compute (training step)")
    left.bar(labels, wait, bottom=compute, color="#C44E52", label="waiting for data")
    left.plot(labels, [1e3 * r.predicted for r in runs.values()], "ko", label="predicted step")
    left.set_ylabel("ms per training step")
    category_labels(left, labels)
    legend_outside(left)  # beside the bars, never over them
    rs = sorted(runs.values(), key=lambda r: r.config.num_workers)
    xs = [r.config.num_workers for r in rs]
    batch = rs[0].config.batch_size
    if rates:
        label_of = {id(r): label for label, r in runs.items()}
        ranked = [rates[label_of[id(r)]] for r in rs]  # (median, slowest, fastest)
        med = [m for m, _, _ in ranked]
        errors = [[m - lo for m, lo, _ in ranked], [hi - m for m, _, hi in ranked]]
        right.errorbar(xs, med, yerr=errors, marker="o", capsize=4,
                       label="measured (median round; slowest to fastest)")  # fmt: skip
    else:
        right.plot(xs, [r.samples_per_s for r in rs], marker="o", label="measured")
    right.plot(xs, [batch / r.predicted for r in rs], linestyle="--", marker="x",
               label="predicted from the run's own t_data, t_model")  # fmt: skip
    if prior:
        ws = sorted(prior)
        right.plot(ws, [batch / prior[w] for w in ws], linestyle=":", color="grey", marker=".",
                   label="predicted before the runs")  # fmt: skip
    right.set_xlabel("num_workers")
    right.set_ylabel("samples/s")
    right.set_xticks(sorted(set(xs) | set(prior or ())))
    right.set_ylim(bottom=0)
    right.grid(alpha=0.3)
    legend_outside(right)
    fig.suptitle(title)
    return fig


def loop_record(result: LoaderResult, device: dict, label: str):
    """A loop's measurement as a course ``Record`` (for ``helpers.results.save``)."""
    cfg = result.config
    config = {
        "label": label,
        "model": cfg.model,
        "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "num_workers": cfg.num_workers,
        "tokenizer": cfg.tokenizer,
        "pin_memory": cfg.pin_memory,
        "words_per_doc": cfg.words_per_doc,
        "threads": cfg.threads,
    }
    extra = {
        "t_data": result.t_data,
        "t_model": result.t_model,
        "predicted_step": result.predicted,
        "wait_fraction": result.wait_fraction,
        "gpu_util": result.gpu_util,
    }
    return Record(
        config=config,
        device=device,
        step_time=result.step_time,
        step_times=[w + c for w, c in zip(result.waits, result.computes, strict=True)],
        samples_per_s=result.samples_per_s,
        tokens_per_s=result.samples_per_s * cfg.seq_len,
        extra=extra,
    )


# Section 9: texts of uneven length, and the padding their batches carry.


def varied_texts(
    n_docs: int, median_words: int, sigma: float = 0.7, max_words: int = 160, seed: int = 0
) -> list[str]:
    """``Documents`` cut to log-normal word counts (median ``median_words``, 2 to
    ``max_words``): lengths as uneven as real text's, a few long texts among many short ones."""
    rng = random.Random(seed)
    law = (math.log(median_words), sigma)
    counts = [min(max_words, max(2, round(rng.lognormvariate(*law)))) for _ in range(n_docs)]
    texts = Documents(n_docs, max_words, seed=seed).texts
    return [" ".join(text.split()[:n]) for text, n in zip(texts, counts, strict=True)]


@dataclass
class TokenSlots:
    """The token slots of padded batches, each as long as its longest sample."""

    batches: int
    slots: int  # rows x padded length, summed over the batches
    real: int  # slots that hold a token (attention_mask 1)

    @property
    def padding(self) -> int:
        """Slots that hold padding."""
        return self.slots - self.real

    @property
    def padding_share(self) -> float:
        """Padding as a share of all slots."""
        return self.padding / self.slots


def token_slots(loader) -> TokenSlots:
    """One epoch of ``loader``'s batches (each with an ``attention_mask``), every slot counted."""
    batches = slots = real = 0
    for batch in loader:
        mask = batch["attention_mask"]  # (B, longest in the batch)
        batches, slots, real = batches + 1, slots + mask.numel(), real + int(mask.sum())
    return TokenSlots(batches, slots, real)


def sorted_slots(lengths: list[int], batch_size: int) -> TokenSlots:
    """Batches cut from ``lengths`` in sorted order, a short remainder batch placed where it
    costs least: the fewest padded slots any split into batches of ``batch_size`` can have,
    and no randomness left."""
    ordered = sorted(lengths)
    full, rest = divmod(len(ordered), batch_size)
    plans = [[batch_size] * k + [rest] + [batch_size] * (full - k) for k in range(full + 1)]
    best = None
    for plan in plans if rest else [[batch_size] * full]:  # batch sizes, shortest texts first
        edges = [0, *itertools.accumulate(plan)]
        chunks = [ordered[a:b] for a, b in itertools.pairwise(edges)]
        slots = sum(len(c) * c[-1] for c in chunks)  # each padded to its longest, its last
        if best is None or slots < best.slots:
            best = TokenSlots(len(chunks), slots, sum(ordered))
    return best
