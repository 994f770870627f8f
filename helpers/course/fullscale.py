"""The full scale on the card at hand: what each lesson runs there, and whether it fits.

At the full scale the lessons run the guides' experiment (bert-large, sequence length 512,
batch 4, fp32 AdamW) and variations of it: batch sweeps, a Llama decoder, long sequences for
attention, an oversized model for ZeRO. Whether that fits depends on the card: a T4 has
14.7 GiB in all, an H100 79 GiB. This module

- lists the experiments of every lesson at a scale (``lesson_experiments``), each with the
  device memory the estimator's CUDA branch predicts for it and what else is on the card
  meanwhile (the notebook's own CUDA context and the tensors it keeps);
- uses the scale fitted to a card (``helpers.scale.fit_scale``, where the scale is chosen): the
  budget, the largest batch of the sweeps and lesson 10's long sequence are the largest that
  fit, and a card too small for the guides' experiment gets the tiny scale, with the reason;
- tabulates per lesson what fits, what was adapted and what the card skips (``fit_table``,
  printed by ``python -m helpers fit`` and in README's hardware notes).

What is on the card during an experiment in a fresh process: two CUDA contexts (the
notebook's and the experiment's), what the notebook holds, and the experiment's peak plus 10 %
for what the caching allocator reserves beyond live tensors (``RESERVE_MARGIN``). A budgeted
experiment is capped: the cap (its context included) plus the notebook's share must fit.
tests/test_fullscale.py walks every experiment through every card profile of tests/fake_gpu.py.
This list mirrors the notebooks: a lesson that adds an experiment at the full scale adds it here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from helpers.device import ASSUMED_CONTEXT, RESERVE_MARGIN, GpuInfo
from helpers.estimator import estimate_per_rank
from helpers.hardware import REFERENCE_CARDS
from helpers.lessons.deepspeed_zero import layer_counts, oversized_config
from helpers.lessons.mixture_of_experts import pair_for
from helpers.lessons.more_memory import big_vocab_config, packing_samples
from helpers.lessons.putting_it_together import SEED_RECIPES
from helpers.names import ATTENTION, GiB
from helpers.scale import FULL, Scale, cuda_estimate, fit_scale, model_info
from helpers.syllabus import NUMBERS as LESSONS


@dataclass(frozen=True)
class Experiment:
    """One thing a lesson runs on the device at the full scale, and what it needs there."""

    lesson: str
    label: str
    peak: int  # device bytes of the experiment itself (the estimator's CUDA branch)
    where: str = "child"  # "child": a fresh process (its own CUDA context); "kernel": the notebook
    held: int = 0  # device bytes the notebook keeps meanwhile
    budget: int | None = None  # run under a budget cap of this many bytes
    may_fail: bool = False  # an out-of-memory here is the lesson's point, or handled and reported
    flops: float = 0.0  # floating-point operations of the whole experiment (for time estimates)
    depends: tuple[str, ...] = ()  # the fitted sizes it uses: "max_batch", "long_seq", "budget"

    def need(self) -> int:
        """Device bytes in use on the card at the experiment's peak."""
        contexts = ASSUMED_CONTEXT * (2 if self.where == "child" else 1)
        if self.budget is not None:  # the cap covers the experiment's own context
            return contexts - ASSUMED_CONTEXT + self.held + self.budget
        return contexts + self.held + int(self.peak * (1 + RESERVE_MARGIN))

    def runs_under_budget(self) -> bool:
        """A budgeted experiment's own peak is within its cap (context and margin included)."""
        if self.budget is None:
            return True
        return ASSUMED_CONTEXT + int(self.peak * (1 + RESERVE_MARGIN)) <= self.budget

    def fits(self, total_memory: int) -> bool:
        """It runs to the end on a card of ``total_memory`` bytes."""
        return self.need() <= total_memory and self.runs_under_budget()

    def acceptable(self, total_memory: int) -> bool:
        """It fits, or it is an out-of-memory the lesson expects or reports and goes past.

        A capped experiment must keep its cap within the card even when it is meant to fail.
        """
        if self.budget is not None and self.need() > total_memory:
            return False
        return self.may_fail or self.fits(total_memory)


# --------------------------------------------------------------------------------------------
# The experiments


def rough_training_flops(model, tokens: int, steps: int, gc: bool = False) -> float:
    """Rough training FLOPs: 6 per parameter per token (2 forward, 4 backward), x4/3 recomputing."""
    return 6.0 * model_info(model).n_params * tokens * steps * (4 / 3 if gc else 1.0)


@dataclass
class _Lesson:
    """Builds one lesson's experiments from the scale and the card."""

    scale: Scale
    card: GpuInfo
    lesson: str = ""
    out: list[Experiment] = field(default_factory=list)

    @property
    def half(self) -> str:
        return "bf16" if self.card.capability >= (8, 0) else "fp16"

    def run(self, label, model, b, s, precision="fp32", optimizer="adamw", gc=False,
            attn="eager", ga=1, steps=None, savers=None, **kw):  # fmt: skip
        """A training run (``helpers.train.measure`` and the like)."""
        est = cuda_estimate(model, b, s, precision, optimizer, gc, attn, ga, **(savers or {}))
        steps = steps or self.scale.warmup + self.scale.repeats + 3  # + tracked, untimed, FLOPs
        flops = rough_training_flops(model, b * s * ga, steps, gc)
        self.out.append(Experiment(self.lesson, label, est.peak, flops=flops, **kw))

    def forward_backward(self, label, model, b, s, **kw):
        """Forward and backward without an optimizer (gradients, no optimizer state)."""
        est = cuda_estimate(model, b, s, optimizer="sgd")
        peak = est.peak - est.optimizer_state
        flops = rough_training_flops(model, b * s, self.scale.warmup + self.scale.repeats + 2)
        self.out.append(Experiment(self.lesson, label, peak, flops=flops, **kw))

    def tensors(self, label, nbytes, **kw):
        """Plain tensors (matmul operands, attention inputs, copies of gradients)."""
        self.out.append(Experiment(self.lesson, label, int(nbytes), **kw))

    def weights(self, model) -> int:
        return cuda_estimate(model, 1, 8, optimizer="sgd").params


def lesson_experiments(scale: Scale, card: GpuInfo) -> list[Experiment]:
    """Every experiment the lessons run on the device at ``scale`` (fitted to ``card``)."""
    out = []
    for lesson in LESSONS:
        x = _Lesson(scale, card, lesson)
        if lesson not in BUILDERS:  # a row added to helpers/syllabus.py, its needs not yet
            raise KeyError(f"lesson {lesson}: add _lesson_{lesson} (what it runs on a card) "
                           "to helpers/course/fullscale.py")  # fmt: skip
        BUILDERS[lesson](x)
        out += x.out
    return out


def _lesson_00(x: _Lesson) -> None:
    s = x.scale
    x.tensors("4096 x 4096 fp32 matmul", 3 * 4096**2 * 4, where="kernel")
    x.tensors("1 GiB tensor (allocator views)", GiB, where="kernel", held=2 * 4096**2 * 4)
    x.run("encoder step", s.encoder, s.batch_size, s.seq_len)
    peak = cuda_estimate(s.encoder, s.batch_size, s.seq_len).peak
    x.run("half budget", s.encoder, s.batch_size, s.seq_len, budget=peak // 2, may_fail=True)


def _lesson_01(x: _Lesson) -> None:
    s, mb = x.scale, x.scale.max_batch
    x.run("encoder fp32", s.encoder, s.batch_size, s.seq_len)
    x.run("decoder fp32", s.decoder, s.batch_size, s.seq_len)
    x.run(f"encoder {x.half}", s.encoder, s.batch_size, s.seq_len, precision=x.half)
    for b in (mb // 4, mb // 2, mb):
        x.run(f"activations b{b}", s.encoder, b, s.seq_len, steps=4, depends=("max_batch",))
    for q in (s.seq_len // 4, s.seq_len // 2, s.seq_len):
        x.run(f"activations s{q}", s.encoder, s.batch_size, q, steps=4)
    x.forward_backward("forward vs backward", s.encoder, mb, s.seq_len, depends=("max_batch",))


def _lesson_02(x: _Lesson) -> None:
    s, mb = x.scale, x.scale.max_batch
    b = 1
    while b <= mb:
        x.run(f"sweep b{b}", s.encoder, b, s.seq_len, depends=("max_batch",))
        b *= 2
    for b in (mb, 2 * mb):  # the search starts at the sweep's top; twice the answer must not fit
        x.run(f"search b{b}", s.encoder, b, s.seq_len, budget=s.budget, may_fail=True,
              steps=s.warmup + 3, depends=("budget",))  # fmt: skip
    x.run("Trainer auto_find_batch_size", s.encoder, mb, s.seq_len, budget=s.budget,
          may_fail=True, steps=2, depends=("budget",))  # fmt: skip
    x.tensors("matmuls 4088-4104 (16-bit)", 17 * 2 * 4104**2 * 2)
    x.tensors("a budget's error, in the notebook", 2 * GiB, where="kernel", budget=2 * GiB,
              may_fail=True)  # fmt: skip


def _lesson_03(x: _Lesson) -> None:
    s, b, mb = x.scale, x.scale.batch_size, x.scale.max_batch
    enc_weights = x.weights(s.encoder)
    # Two copies of the encoder (same weights, two ways to accumulate); gradients go to the CPU.
    x.forward_backward("1 x b vs b x 1 gradients", s.encoder, b, s.seq_len, where="kernel",
                       held=enc_weights)  # fmt: skip
    x.forward_backward("token-normalised decoder gradients", s.decoder, b, s.seq_len,
                       where="kernel")  # fmt: skip
    x.run("Trainer, decoder 1 x b", s.decoder, 1, s.seq_len, ga=b, where="kernel", steps=1)
    x.run("Trainer, encoder 1 x b", s.encoder, 1, s.seq_len, ga=b, where="kernel", steps=1)
    m = mb
    while m >= 1:
        x.run(f"effective {mb}: {m} x {mb // m}", s.encoder, m, s.seq_len, ga=mb // m,
              depends=("max_batch",))  # fmt: skip
        m //= 2
    x.run(f"{b} x 16", s.encoder, b, s.seq_len, ga=16)
    x.run(f"1 x {16 * b}", s.encoder, 1, s.seq_len, ga=16 * b)


def _lesson_04(x: _Lesson) -> None:
    s = x.scale
    grads = x.weights(s.encoder)  # one model's gradients, kept for the comparison
    x.forward_backward("identical gradients", s.encoder, s.batch_size, s.seq_len,
                       where="kernel", held=2 * grads)  # fmt: skip
    x.run("plain", s.encoder, s.batch_size, s.seq_len)
    x.run("checkpointing", s.encoder, s.batch_size, s.seq_len, gc=True)
    x.run("paired steps (one model, checkpointing toggled)", s.encoder, s.batch_size,
          s.seq_len, steps=62)  # fmt: skip
    x.run("Trainer", s.encoder, s.batch_size, s.seq_len, where="kernel", steps=4)
    x.run("Trainer + checkpointing", s.encoder, s.batch_size, s.seq_len, gc=True,
          where="kernel", steps=4)  # fmt: skip


def _lesson_05(x: _Lesson) -> None:
    s = x.scale
    short = s.seq_len // 8
    for b in (2 * s.batch_size, 4 * s.batch_size, 8 * s.batch_size, 16 * s.batch_size):
        for p in ("fp32", x.half):
            x.run(f"memory table b{b} {p}", s.encoder, b, short, precision=p, steps=4)
    for p in ("fp32", "tf32", "fp16", "bf16"):
        if (p == "bf16" and x.half != "bf16") or (p == "tf32" and x.card.capability < (8, 0)):
            continue
        x.run(f"learnable task, {p}", s.decoder, s.max_batch, s.seq_len, precision=p,
              steps=s.train_steps * 2 // 3, depends=("max_batch",))  # fmt: skip
    if x.card.capability >= (8, 0):  # two fp32 and three fp64 8192 x 8192 matrices
        x.tensors("tf32 matmul vs fp64", (3 * 4 + 3 * 8) * 8192**2, where="kernel")
    for p in ("fp16", "bf16", "fp32"):
        if p == "bf16" and x.half != "bf16":
            continue
        x.run(f"TrainingArguments({p})", s.decoder, s.batch_size, s.seq_len, precision=p,
              where="kernel", steps=1)  # fmt: skip


def _lesson_06(x: _Lesson) -> None:
    s, b, n = x.scale, x.scale.batch_size, x.scale.seq_len
    weights = x.weights(s.encoder)
    states = sum(
        cuda_estimate(s.encoder, 1, 8, optimizer=o).optimizer_state
        for o in ("adamw", "sgd", "adafactor", "adamw8bit", "adamw8bit")
    )
    fb = cuda_estimate(s.encoder, b, n, optimizer="sgd")
    # The backward has freed the activations before the optimizers create their state.
    kept = max(fb.peak - fb.optimizer_state, 2 * weights + states)  # weights, grads, states
    x.tensors("every optimizer's state, read back", kept, where="kernel")
    x.run("vanilla AdamW", s.encoder, b, n, held=weights)
    x.run("SGD", s.encoder, b, n, optimizer="sgd", held=weights)
    for opt in ("adafactor", "adamw8bit"):
        x.run(f"ga4 + gc + 16-bit + {opt}", s.encoder, max(1, b // 4), n, precision=x.half,
              optimizer=opt, gc=True, ga=4, held=weights)  # fmt: skip
    x.run("Trainer optimizers (3 in turn)", s.encoder, 4, 32, where="kernel", steps=2,
          held=weights)  # fmt: skip
    x.tensors("AdamW step variants", 7 * weights, held=weights)  # copies, grads, state, scratch
    x.forward_backward("Adafactor vs AdamW steps", s.encoder, b, n, where="kernel")
    for opt in ("adamw", "adafactor", "adamw8bit"):
        x.run(f"learnable task, {opt}", s.decoder, b, n, optimizer=opt, steps=s.train_steps,
              held=weights)  # fmt: skip


def _lesson_07(x: _Lesson) -> None:
    s = x.scale
    for who in ("Accelerate loop", "Trainer"):
        x.run(who, s.encoder, 1, s.seq_len, precision=x.half, optimizer="adamw8bit", gc=True,
              ga=4, steps=4)  # fmt: skip


def _lesson_08(x: _Lesson) -> None:
    s = x.scale
    big = oversized_config(s.decoder, s.budget)
    est = cuda_estimate(big, s.batch_size, s.seq_len)
    layer = 4 * layer_counts(big)[1]
    x.run("the oversized model without ZeRO", big, s.batch_size, s.seq_len, may_fail=True,
          depends=("budget",))  # fmt: skip
    x.run("the oversized model under the budget", big, s.batch_size, s.seq_len, budget=s.budget,
          may_fail=True, depends=("budget",))  # fmt: skip
    # ZeRO-2 with optimizer offload keeps the fp32 weights, activations and gradient buckets.
    x.tensors("ZeRO-2 + offload", est.params + est.activations + 2 * layer, may_fail=True,
              depends=("budget",))  # fmt: skip
    # ZeRO-3 with parameter offload: a few layers' weights and gradients, and the activations.
    x.tensors("ZeRO-3 + offload, budget", est.activations + 8 * layer, budget=s.budget,
              depends=("budget",))  # fmt: skip
    x.tensors("Trainer + ZeRO-3", est.activations + 8 * layer, depends=("budget",))


def _lesson_09(x: _Lesson) -> None:
    s = x.scale
    for name in pair_for(s.name):
        x.run(f"{name}", name, s.batch_size, s.seq_len)


def _lesson_10(x: _Lesson) -> None:
    s = x.scale
    d = model_info(s.decoder).config
    heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // heads
    longest = 8 * head_dim * 8
    # Attention written by hand keeps a few (heads, s, s) matrices and their gradients.
    x.tensors(f"attention layer at s={longest}", 6 * heads * longest**2 * 2)
    x.tensors("eager and sdpa models side by side", 2 * x.weights(s.decoder), where="kernel")
    precision = "bf16" if x.card.capability >= (8, 0) else "fp32"
    for attn in ATTENTION:
        x.run(f"decoder {attn} s{s.long_seq}", s.decoder, max(1, s.batch_size // 2), s.long_seq,
              precision=precision, attn=attn, depends=("long_seq",))  # fmt: skip


def _lesson_11(x: _Lesson) -> None:
    s = x.scale
    for who in ("starved loop, 0-2 workers", "Trainer, 0 and 1 workers"):
        x.run(who, s.encoder, s.batch_size, s.seq_len, steps=20)


def _lesson_12(x: _Lesson) -> None:
    s = x.scale
    fb = cuda_estimate(s.encoder, s.batch_size, s.seq_len, optimizer="sgd")
    x.tensors("captured encoder forward", fb.params + fb.activations, where="kernel")
    rows, h = s.batch_size * s.seq_len, model_info(s.encoder).config["hidden_size"]
    x.tensors("MLP block step, compiled", 40 * rows * h * 4)
    x.tensors("fusion sizes", 6 * 2**26 * 4)
    x.run("Trainer(torch_compile)", s.encoder, s.batch_size, s.seq_len, where="kernel", steps=3)


def _lesson_13(x: _Lesson) -> None:
    s = x.scale
    x.tensors("LoRA by hand and peft", 2 * x.weights(s.decoder), where="kernel")
    x.run("full fine-tuning", s.decoder, s.batch_size, s.seq_len)
    for label in ("LoRA, attention", "LoRA, all linear"):  # bounded by full fine-tuning
        x.run(label, s.decoder, s.batch_size, s.seq_len)


def _lesson_14(x: _Lesson) -> None:
    s = x.scale
    b = s.batch_size
    for r in SEED_RECIPES:
        batch = max(1, b // r.grad_accum) if r.grad_accum > 1 else b
        x.run(r.label, s.encoder, batch, s.seq_len, precision=x.half if r.half else "fp32",
              optimizer=r.optimizer, gc=r.checkpointing, ga=b // batch, budget=s.budget,
              depends=("budget",))  # fmt: skip
    x.run("planner, scale's budget (3 timed)", s.encoder, b, s.seq_len, budget=s.budget,
          may_fail=True, depends=("budget",))  # fmt: skip


def _lesson_15(x: _Lesson) -> None:
    s = x.scale
    for model in (s.encoder, s.decoder):  # section 2's grid, each step tracked
        for p in ("fp32", x.half):
            for gc in (False, True):
                x.run(f"timeline {model} {p}{' ckpt' if gc else ''}", model, s.batch_size,
                      s.seq_len, precision=p, gc=gc, steps=2)  # fmt: skip
    d, b = s.decoder, s.batch_size
    x.run("timeline overhead", d, b, s.seq_len, steps=12)
    x.run("accumulation", d, max(1, b // 2), s.seq_len, ga=2, steps=2)
    x.run("8-bit AdamW", d, b, s.seq_len, optimizer="adamw8bit", steps=2)
    x.run("profiled step", d, b, s.seq_len, steps=2)
    x.run("memory snapshot", d, b, s.seq_len, steps=2)
    # The OOM section's budget is the tracker's (no allocator cap): the failing step stops at
    # 90 % of the plain step's peak, the checkpointed one stays under it.
    x.run("checkpointing under the 90 % budget", d, b, s.seq_len, gc=True, steps=2)
    x.run("try it: half the sequence", d, b, max(1, s.seq_len // 2), steps=2)


def _lesson_16(x: _Lesson) -> None:
    s, d, b = x.scale, x.scale.decoder, x.scale.batch_size
    quarter = max(1, s.seq_len // 4)  # section 1: batch 1, a quarter of the length
    x.run("step after backward", d, 1, quarter, steps=5)  # tracked, and 3 for same_training
    x.run("step inside backward", d, 1, quarter, steps=5, savers={"optimizer_in_backward": True})
    for mode in ("none", "full", "selective", "offload"):  # section 2, one worker each
        x.run(f"checkpointing: {mode}", d, b, s.seq_len, gc=mode in ("full", "selective"),
              attn="sdpa")  # fmt: skip
    # gradient_check: the model and two sets of gradients
    x.tensors("gradients compared", 3 * x.weights(d))
    big, chunk = big_vocab_config(s.name), 2 * s.seq_len // 4  # section 3: 2 sequences
    x.run("whole loss", big, 2, s.seq_len, steps=4)
    x.run("chunked loss", big, 2, s.seq_len, steps=4, savers={"loss_chunk": chunk})
    x.run("chunked + step inside backward", big, 2, s.seq_len, steps=4,
          savers={"loss_chunk": chunk, "optimizer_in_backward": True})  # fmt: skip
    n = packing_samples(s)  # section 4: padded to the longest sample, at most seq_len
    x.run("packing: padded batch", d, n, s.seq_len, attn="sdpa")
    x.tensors("packing: the packed row's T x T mask", 4 * (n * s.seq_len) ** 2)
    x.run("fp8: 16-bit reference", d, b, s.seq_len, precision=x.half, attn="sdpa", steps=25)
    x.tensors("fp8: the model converted on a copy", 2 * x.weights(d))


def _lesson_17(x: _Lesson) -> None:
    """A card's share: with a GPU per process, each holds one process's step (else the lesson
    runs the tiny scale on CPU processes and nothing here touches the card)."""
    s, d = x.scale, x.scale.decoder
    x.run("one process, the global batch", d, s.batch_size, s.seq_len)
    for strategy in ("ddp", "fsdp"):
        est = estimate_per_rank(d, 2, strategy, max(1, s.batch_size // 2), s.seq_len,
                                device="cuda")  # fmt: skip
        x.tensors(f"{strategy} process (a GPU each)", est.peak)


# Each lesson's experiments, by lesson number: one builder per notebook.
BUILDERS = {
    "00": _lesson_00,
    "01": _lesson_01,
    "02": _lesson_02,
    "03": _lesson_03,
    "04": _lesson_04,
    "05": _lesson_05,
    "06": _lesson_06,
    "07": _lesson_07,
    "08": _lesson_08,
    "09": _lesson_09,
    "10": _lesson_10,
    "11": _lesson_11,
    "12": _lesson_12,
    "13": _lesson_13,
    "14": _lesson_14,
    "15": _lesson_15,
    "16": _lesson_16,
    "17": _lesson_17,
}


# --------------------------------------------------------------------------------------------
# Per lesson: fits / adapted / skipped


@dataclass(frozen=True)
class LessonFit:
    """One lesson on one card."""

    lesson: str
    status: str  # "fits", "adapted", "skips part", "does not fit"
    why: str  # what was adapted or skipped, and why
    need: int  # the most the lesson has on the card at one moment (bytes)
    skips: tuple[str, ...] = ()  # parts left out on this card, each with its reason


def _skips(lesson: str, card: GpuInfo) -> list[str]:
    """Parts a lesson skips on this card for lack of a hardware feature, not of memory."""
    old = card.capability < (8, 0)
    skips = {
        "01": ["bf16 (fp16 used)"] if old else [],
        "05": ["bf16 and tf32 (compute capability < 8.0)"] if old else [],
        "07": ["bf16 (fp16 used)"] if old else [],
        "10": ["flash attention and bf16 (compute capability < 8.0)"] if old else [],
        "11": ["GPU utilisation (NVML has none for a MIG slice)"] if card.mig else [],
        "14": ["bf16 (fp16 used)"] if old else [],
        "15": ["bf16 (fp16 used)"] if old else [],
    }
    return skips.get(lesson, [])


def fit_table(scale: Scale, card: GpuInfo) -> list[LessonFit]:
    """Per lesson on ``card`` at ``scale``: whether everything fits, what was adapted, skipped."""
    experiments = lesson_experiments(scale, card)
    adapted = {
        "max_batch": scale.max_batch < FULL.max_batch,
        "long_seq": scale.long_seq < FULL.long_seq,
        "budget": scale.budget < FULL.budget,
    }
    rows = []
    for lesson in LESSONS:
        mine = [x for x in experiments if x.lesson == lesson]
        total = card.total_memory
        need = max(x.need() for x in mine if x.fits(total) or x.budget is not None)
        failing = [x.label for x in mine if not x.acceptable(total)]
        changed = sorted({d for x in mine for d in x.depends if adapted[d]})
        skips = _skips(lesson, card) + [
            f"{x.label} (out of memory on this card; the lesson reports it and goes on)"
            for x in mine
            if x.budget is None and x.may_fail and not x.fits(total)
        ]
        if failing:
            status, why = "does not fit", ", ".join(failing)
        elif changed:
            what = {"max_batch": f"sweeps to batch {scale.max_batch}",
                    "long_seq": f"long sequence {scale.long_seq}",
                    "budget": f"budget {scale.budget / GiB:.1f} GiB"}  # fmt: skip
            status, why = "adapted", "; ".join([*(what[c] for c in changed), *skips])
        elif skips:
            status, why = "skips part", "; ".join(skips)
        else:
            status, why = "fits", ""
        rows.append(LessonFit(lesson, status, why, need, tuple(skips)))
    return rows


def lesson_flops(scale: Scale, card: GpuInfo) -> dict[str, float]:
    """Rough training FLOPs per lesson at ``scale`` (for a time estimate: FLOPs / throughput)."""
    out = dict.fromkeys(LESSONS, 0.0)
    for x in lesson_experiments(scale, card):
        out[x.lesson] += x.flops
    return out


def fit_markdown(cards: dict[str, GpuInfo] | None = None) -> str:
    """Markdown: the lesson x card table (fits / adapted / skips part), then each card's why."""
    cards = cards or REFERENCE_CARDS
    scales = {key: fit_scale(card) for key, card in cards.items()}
    tables = {
        key: {r.lesson: r for r in fit_table(scales[key], card)}
        for key, card in cards.items()
        if scales[key].name == "full"
    }

    def short(card: GpuInfo) -> str:
        return card.name.removeprefix("NVIDIA ").removeprefix("Tesla ")

    heads = [f"{short(c)} ({c.total_memory / GiB:.1f} GiB)" for c in cards.values()]
    lines = ["| lesson | " + " | ".join(heads) + " |", "|---" * (len(cards) + 1) + "|"]
    for lesson in LESSONS:
        cells = [tables[k][lesson].status if k in tables else "tiny scale" for k in cards]
        lines.append(f"| {lesson} | " + " | ".join(cells) + " |")
    lines.append("")
    for key, card in cards.items():
        scale = scales[key]
        why = list(scale.notes)
        if key in tables:
            why += [f"{r.lesson} skips {skip}" for r in tables[key].values() for skip in r.skips]
            sizes = (
                f"budget {scale.budget / GiB:.1f} GiB, sweeps to batch {scale.max_batch}, "
                f"lesson 10 at {scale.long_seq} tokens"
            )
        else:
            sizes = "tiny scale"
        lines.append(f"- **{short(card)}** ({sizes}): " + ("; ".join(why) or "as designed") + ".")
    return "\n".join(lines) + "\n"
