"""One training step, configurable the ways the course varies it, and its measurement."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace

import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers import compat, progress
from helpers import device as device_api
from helpers.data import MarkovTask, markov_batch, random_batch
from helpers.device import nvml_used_bytes, resolve
from helpers.hardware import hardware_report, precision_problem
from helpers.memory import (
    CategoryTracker,
    allocator_peaks,
    dora_graphs_collected,
    memory_budget,
    reset_device_peaks,
)
from helpers.memory_savers import (
    ChunkedCausalLMLoss,
    OptimizerGroup,
    OptimizerInBackward,
    offloaded,
    selective_context_fn,
)
from helpers.models import (
    WEIGHT_TORCH_DTYPES,
    apply_lora,
    build_model,
    count_params,
    enable_checkpointing,
    load_config,
    task_kind,
)
from helpers.names import (
    AUTOCAST,
    BNB_OPTIMIZERS,
    OPTIMIZERS,
    activations_problem,
    dora_problem,
    qlora_problem,
    seq_len_problem,
    setting_problem,
    weights_problem,
)
from helpers.optimizer_state import hidden_matrices
from helpers.quiet import quiet_loading
from helpers.results import Record
from helpers.timing import (
    OP_CLASSES,
    Comparison,
    Disturbance,
    by_op_class,
    confirmed,
    flops_utilisation,
    op_class,
    op_self_times,
    synchronize,
    time_fn,
    time_once,
    train_flops,
)


@dataclass
class RunConfig:
    """Everything that defines one measured training run."""

    model: str = "bert-tiny"  # bundled config name, config JSON path, or hub id
    batch_size: int = 4
    seq_len: int = 64
    precision: str = "fp32"
    optimizer: str = "adamw"
    # How the weights (and their gradients) are stored: "fp32", or "bf16" with no fp32 master
    # copy (precision must then be bf16). names.WEIGHT_DTYPES.
    weight_dtype: str = "fp32"
    state_dtype: str = ""  # the optimizer state's dtype; "" = the trained weights' own
    bf16_update: str = "nearest"  # bf16 weights' AdamW: nearest | stochastic | kahan (lesson 05)
    gradient_checkpointing: bool = False
    # What checkpointed layers keep: "full" (their input) or "selective" (also what matmuls
    # and attention kernels return; lesson 16). names.CHECKPOINT_POLICIES.
    checkpoint_policy: str = "full"
    offload_activations: bool = False  # tensors saved for backward go to host memory (lesson 16)
    # The course's default. transformers defaults to "sdpa"; eager keeps each layer's s x s
    # attention matrix as a saved activation, which lessons 01 and 04 count. Lesson 10 compares.
    attn: str = "eager"
    grad_accum: int = 1  # micro-batches of ``batch_size`` per optimizer step
    data: str = "random"  # random | markov (the learnable task)
    warmup: int = 1
    repeats: int = 3
    device: str | None = None  # None: helpers.device.default_device()
    budget: int | None = None  # bytes: raise OutOfMemoryError past it (see memory_budget)
    seed: int = 0
    flops: bool = True  # count FLOPs of a step (one extra step) for MFU
    label: str = ""  # a short name for tables and plots
    lora_r: int = 0  # LoRA rank (peft); 0 = full fine-tuning, every weight trained
    lora_targets: str = ""  # comma-separated module names, "all-linear", "" = peft's default
    qlora: bool = False  # the LoRA base's Linear layers in 4 bits (NF4, bitsandbytes; lesson 13)
    dora: bool = False  # DoRA: LoRA plus a trained magnitude per output row (peft use_dora; 13)
    optimizer_in_backward: bool = False  # step each parameter inside backward (lesson 16)
    loss_chunk: int = 0  # causal LM: tokens of logits per chunk of the loss; 0 = all (lesson 16)

    def as_dict(self) -> dict:
        """Plain dict for records and JSON."""
        return asdict(self)

    def problem(self) -> str | None:
        """What is wrong with this run before anything is built, if anything (one message).

        The checks that need no model config and no device (``names.setting_problem``): the
        command line asks here before it builds anything, ``Trainee`` before it trains.
        """
        if self.lora_r < 0:
            return f"LoRA rank {self.lora_r}: must be 0 (no LoRA) or positive"
        return setting_problem(self.precision, self.optimizer, self.attn, self.batch_size,
                               self.seq_len, self.grad_accum) or weights_problem(
            self.weight_dtype, self.state_dtype, self.bf16_update, self.precision,
            self.optimizer, self.lora_r) or qlora_problem(
            self.qlora, self.lora_r, self.precision, self.weight_dtype) or dora_problem(
            self.dora, self.lora_r, self.qlora) or activations_problem(
            self.gradient_checkpointing, self.checkpoint_policy)  # fmt: skip

    def model_config(self):
        """The model's config, read once for this run; a ValueError that says what to do."""
        try:
            config = load_config(self.model)
        except Exception as err:  # missing file, bad JSON, unknown model type, no hub
            raise ValueError(
                f"cannot read model config {self.model!r}: {type(err).__name__}: {err}"
            ) from None
        problem = seq_len_problem(
            self.seq_len, getattr(config, "max_position_embeddings", None), self.model
        )
        if problem:
            raise ValueError(problem)
        return config


def make_optimizer(
    name: str, model: torch.nn.Module, lr: float = 1e-3, params=None, bf16_update: str = "nearest"
):
    """The optimizer by course name: adamw, sgd (momentum 0.9), adafactor, adamw8bit, lion,
    lion8bit (bitsandbytes), muon (``MuonWithAdamW``).

    ``params``: the parameters it updates (default: the model's trainable ones); the model is
    still what 8-bit AdamW reads its embedding overrides from. ``bf16_update`` picks the AdamW
    for bf16 weights with no master copy (lesson 05): "nearest" is torch's own (each update
    rounded to the nearest bf16), "stochastic" torchao's AdamW with bf16 stochastic rounding,
    "kahan" torch-optimi's AdamW with Kahan summation.
    """
    if params is None:
        params = [p for p in model.parameters() if p.requires_grad]
    if bf16_update != "nearest" and name != "adamw":
        raise ValueError(f"bf16_update {bf16_update} is an AdamW: use optimizer adamw")
    if name == "adamw" and bf16_update == "stochastic":
        # The update in fp32, rounded to bf16 up or down with the odds of its distance to
        # each: unbiased, so updates far below a weight's bf16 spacing still add up.
        return compat.bf16_stochastic_adamw(params, lr=lr)
    if name == "adamw" and bf16_update == "kahan":
        try:
            import optimi  # torch-optimi: optional (pip install torch-optimi)
        except ImportError as err:
            raise RuntimeError(
                "bf16_update kahan needs torch-optimi: pip install torch-optimi "
                "(or use bf16_update nearest)"
            ) from err
        # torch's AdamW defaults (optimi's own are betas (0.9, 0.99), eps 1e-6), and its loop
        # over one tensor at a time on every device (no foreach lists, no Triton kernel).
        # Kahan summation keeps what each rounded update lost in a bf16 buffer (kahan_comp)
        # and adds it back at the next step.
        return optimi.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            kahan_sum=True, foreach=False, triton=False)  # fmt: skip
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adafactor":
        # torch's Adafactor keeps no first moment and factors the second moment of every
        # matrix into a row and a column vector (Shazeer & Stern, 2018).
        return torch.optim.Adafactor(params, lr=lr)
    if name == "muon":
        return MuonWithAdamW(model, params, lr=lr)
    if name in BNB_OPTIMIZERS:
        return _bnb_optimizer(name, model, params, lr)
    raise ValueError(f"unknown optimizer {name!r}: use one of {', '.join(OPTIMIZERS)}")


def _bnb_optimizer(name: str, model: torch.nn.Module, params, lr: float):
    """bitsandbytes' 8-bit AdamW, Lion or 8-bit Lion, with the Trainer's embedding override."""
    try:
        import bitsandbytes as bnb
    except ImportError as err:
        raise RuntimeError(
            f"{name} needs bitsandbytes: pip install bitsandbytes (or pick adamw)"
        ) from err
    if name == "lion":  # one moment: the sign of a blend of it and the gradient
        return bnb.optim.Lion(params, lr=lr, optim_bits=32)
    # As the Trainer does: embeddings keep 32-bit state, because quantising the state of
    # rarely-updated, widely-ranging embedding rows hurts training (bitsandbytes docs).
    manager = bnb.optim.GlobalOptimManager.get_instance()
    # The manager is one per process and keys its overrides by parameter id and by
    # (group, index): an earlier model's would reach this one's parameters (a recycled id,
    # the same index). The overrides are read at the optimizer's first step.
    manager.initialize()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})
    if name == "lion8bit":
        return bnb.optim.Lion8bit(params, lr=lr)
    return bnb.optim.AdamW8bit(params, lr=lr)


class MuonWithAdamW(OptimizerGroup):
    """``torch.optim.Muon`` on the hidden layers' matrices, ``torch.optim.AdamW`` on the rest.

    Muon orthogonalises each 2-D update (Newton-Schulz iterations in bf16) and keeps one
    momentum buffer per matrix; torch's docs leave embeddings, the head and vectors to AdamW
    (``helpers.optimizer_state.hidden_matrices`` picks them). Muon's ``"match_rms_adamw"``
    scaling (Moonshot's) lets both halves take AdamW's learning rate and weight decay. Steps,
    zeroes and lists state like one optimizer (``OptimizerGroup``); the tracker sees both.

    Example::

        >>> optimizer = MuonWithAdamW(model, [p for p in model.parameters() if p.requires_grad])
    """

    def __init__(self, model: torch.nn.Module, params, lr: float = 1e-3) -> None:
        hidden = hidden_matrices(model)
        muon = [p for p in params if id(p) in hidden]
        rest = [p for p in params if id(p) not in hidden]
        self.optimizers = {}
        if muon:
            self.optimizers["muon"] = torch.optim.Muon(
                muon, lr=lr, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"
            )
        if rest:
            self.optimizers["adamw"] = torch.optim.AdamW(rest, lr=lr)

    def step(self) -> None:
        """Muon's step, then AdamW's."""
        for optimizer in self.optimizers.values():
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Both halves' gradients."""
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=set_to_none)


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def quantize_4bit(model: torch.nn.Module, compute_dtype: torch.dtype, device) -> torch.nn.Module:
    """``model`` reloaded with its Linear layers in 4 bits, as QLoRA keeps them (lesson 13).

    ``from_config`` takes no ``quantization_config``, so the (random) weights are saved in
    ``compute_dtype`` and loaded back through ``from_pretrained`` with bitsandbytes' NF4, double
    quantisation and ``compute_dtype`` compute (the QLoRA paper's setting); transformers keeps
    the LM head, the embeddings and the norms in ``compute_dtype``. peft's
    ``prepare_model_for_kbit_training``, which the recipe calls, would also cast those to fp32:
    left out here, as the estimator (``helpers.estimator.qlora``) counts them 16-bit.
    """

    try:
        import bitsandbytes  # noqa: F401  (optional: QLoRA's 4-bit layers)
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    except ImportError as err:
        raise RuntimeError("qlora needs bitsandbytes: pip install bitsandbytes") from err
    nf4 = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )
    attn = model.config._attn_implementation
    with tempfile.TemporaryDirectory() as folder, quiet_loading():
        model.to(compute_dtype).save_pretrained(folder)
        return AutoModelForCausalLM.from_pretrained(
            folder,
            quantization_config=nf4,
            device_map=str(resolve(device)),
            attn_implementation=attn,
        )


def autocast_context(precision: str, device: torch.device):
    """autocast for bf16/fp16; nothing for fp32/tf32 (tf32: ``helpers.device.set_tf32``)."""
    if precision in AUTOCAST:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        return torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext()


def model_loss(model: torch.nn.Module, batch) -> torch.Tensor:
    """A transformers model's loss on a batch of keyword inputs (labels included)."""
    return model(**batch).loss


def train_step(
    model: torch.nn.Module,
    optimizer,
    micro_batches: Iterable,
    *,
    accumulate: int | None = None,
    precision: str = "fp32",
    scaler: torch.amp.GradScaler | None = None,
    loss_of: Callable = model_loss,
    backward: Callable | None = None,
    on_gradients: Callable | None = None,
) -> torch.Tensor:
    """The course's base training step: forward, backward and one optimizer step; the loss.

    Every lesson's loop is this step with some of its switches set:

    - ``micro_batches``: k batches whose gradients add up before the step (lesson 03); each
      micro-batch's mean loss is divided by k, so the sum is the mean over k equal batches.
      A list gives k; a generator with ``accumulate=k`` makes each micro-batch only when it
      is needed, so one micro-batch's inputs are alive at a time.
    - ``precision``: "bf16"/"fp16" run the forward under autocast (lesson 05).
    - ``scaler``: fp16's GradScaler scales the loss and unscales before stepping (lesson 05).
    - ``loss_of(model, batch)``: how a batch becomes a loss (default: a transformers model's
      ``.loss``; lesson 12's plain modules return the loss themselves).
    - ``backward(loss)``: who back-propagates (default ``loss.backward()``; DeepSpeed's engine
      does it itself in lesson 08).
    - ``on_gradients()``: called once the gradients are complete, before the optimizer step
      (gradient clipping, or keeping a copy to compare with, as lesson 12 does).

    ``optimizer`` needs ``step()`` and ``zero_grad(set_to_none=True)``. Checkpointing,
    8-bit optimizers and LoRA change the model or the optimizer, not this step.
    """
    k = accumulate or len(micro_batches)
    total = 0.0
    for batch in micro_batches:
        with autocast_context(precision, _device_of(batch)):
            loss = loss_of(model, batch) / k
        scaled = scaler.scale(loss) if scaler is not None else loss
        scaled.backward() if backward is None else backward(scaled)
        total += loss.detach()
    if on_gradients is not None:
        if scaler is not None:  # the callback sees true gradients, not scaled ones
            scaler.unscale_(optimizer)
        on_gradients()
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def _device_of(batch) -> torch.device:
    """The device of a batch: a tensor, or the first tensor of a dict of them."""
    first = batch if isinstance(batch, torch.Tensor) else next(iter(batch.values()))
    return first.device


class Trainee:
    """A model, optimizer and data source wired into ``step()``, built from a RunConfig."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.device = resolve(cfg.device)
        problem = cfg.problem() or precision_problem(cfg.precision, self.device)
        if problem:
            raise ValueError(problem)
        self.config = cfg.model_config()
        self.kind = task_kind(self.config)
        dtype = WEIGHT_TORCH_DTYPES[cfg.weight_dtype]
        self.model = build_model(self.config, cfg.attn, self.device, cfg.seed, dtype=dtype)
        if cfg.qlora:  # the frozen Linear weights in 4 bits (before checkpointing and LoRA)
            self.model = quantize_4bit(self.model, AUTOCAST_DTYPES[cfg.precision], self.device)
        if cfg.gradient_checkpointing:
            selective = cfg.checkpoint_policy == "selective"
            enable_checkpointing(self.model, selective_context_fn() if selective else None)
        if cfg.lora_r:  # freeze the weights and add adapters before the optimizer sees them
            self.model = apply_lora(self.model, cfg.lora_r, cfg.lora_targets, dora=cfg.dora)
        self.model.train()
        self.n_params = count_params(self.model)
        self.n_tensors = len(list(self.model.parameters()))
        self.optimizer = self._optimizer()
        self.loss_of = self._loss_of()  # how a batch becomes a loss (built once)
        self.scaler = torch.amp.GradScaler(self.device.type) if cfg.precision == "fp16" else None
        if self.device.type == "cuda":  # fp32 matmuls on tf32 tensor cores, or plain fp32
            device_api.set_tf32(cfg.precision == "tf32")
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.task = MarkovTask(n_states=min(64, self.config.vocab_size), seed=cfg.seed)
        self.losses: list[float] = []
        self._fixed = None

    def _optimizer(self):
        """The run's optimizer, or one per parameter stepped inside backward (lesson 16)."""
        c = self.cfg
        if c.loss_chunk and self.kind != "causal-lm":
            raise ValueError("loss_chunk applies to causal language models (decoders) only")
        if not c.optimizer_in_backward:
            return make_optimizer(c.optimizer, self.model, bf16_update=c.bf16_update)
        if c.grad_accum > 1 or c.precision == "fp16":
            raise ValueError(
                "optimizer_in_backward steps each parameter as soon as its gradient exists, so "
                "it cannot accumulate micro-batches or unscale fp16 gradients first: use "
                "grad_accum=1 and fp32/bf16"
            )

        return OptimizerInBackward(
            [p for p in self.model.parameters() if p.requires_grad],
            lambda one: make_optimizer(
                c.optimizer, self.model, params=one, bf16_update=c.bf16_update
            ),
        )

    def batch(self) -> dict[str, torch.Tensor]:
        """The next micro-batch on the device: fresh task data, or one fixed random batch."""
        c = self.cfg
        if c.data == "markov":
            data = markov_batch(self.task, self.kind, c.batch_size, c.seq_len, self.generator)
        else:
            if self._fixed is None:
                self._fixed = random_batch(
                    self.kind, c.batch_size, c.seq_len, self.config.vocab_size, seed=c.seed
                )
            data = self._fixed
        return {k: v.to(self.device, non_blocking=True) for k, v in data.items()}

    def step(self) -> float:
        """One optimizer step over ``grad_accum`` micro-batches; returns the mean loss."""
        c = self.cfg
        batches = (self.batch() for _ in range(c.grad_accum))
        loss = train_step(
            self.model, self.optimizer, batches, accumulate=c.grad_accum,
            precision=c.precision, scaler=self.scaler, loss_of=self.loss_of,
        )  # fmt: skip
        self.losses.append(float(loss))
        return self.losses[-1]

    def _loss_of(self) -> Callable:
        """How a batch becomes a loss: the model's own or the chunked loss, its forward's
        saved tensors offloaded to the host or not (lesson 16)."""
        loss_of = model_loss
        if self.cfg.loss_chunk:
            chunked = ChunkedCausalLMLoss(self.model, self.cfg.loss_chunk)
            loss_of = lambda model, batch: chunked(batch)  # noqa: E731
        return offloaded(loss_of, self.device) if self.cfg.offload_activations else loss_of


def trainee_step(cfg: RunConfig):
    """A Trainee's ``step``: the contender a speed comparison times (``helpers.isolate.bench``)."""
    return Trainee(cfg).step


def measure(cfg: RunConfig) -> Record:
    """Run ``cfg`` on this machine: per-category bytes of a steady-state step, timing, all views."""
    device = resolve(cfg.device)
    if cfg.budget and device.type == "cuda":
        # On a GPU the budget caps the caching allocator for the whole run, model building
        # included; on other devices the tracked step below enforces it.
        with memory_budget(cfg.budget, device=device):
            return _measure(cfg)
    return _measure(cfg)


def _measure(cfg: RunConfig) -> Record:
    t0 = time.perf_counter()
    trainee = Trainee(cfg)
    device = trainee.device
    for _ in range(max(1, cfg.warmup)):  # the first step creates the optimizer state
        trainee.step()
    # View 1: exact bytes per category for one steady-state step (the tracker slows the step
    # down, so it is timed separately below).
    tracker = CategoryTracker(budget=cfg.budget if device.type != "cuda" else None, device=device)
    tracker.track_external(trainee.model, trainee.optimizer)
    with dora_graphs_collected(trainee.model), tracker:
        trainee.step()
    categories = tracker.peaks()
    del tracker
    # Views 2 and 3 and the timing: untracked steps after a reset of the allocator's peaks.
    # The reset empties the allocator's cache, so one untimed step first takes the working
    # set back from the driver (cudaMalloc) instead of charging it to a timed step.
    reset_device_peaks(device)
    timing = time_fn(trainee.step, device, warmup=1, repeats=cfg.repeats)
    allocator = allocator_peaks(device)
    nvml = nvml_used_bytes(device)
    samples = cfg.batch_size * cfg.grad_accum
    report = hardware_report(device)
    step_flops = train_flops(trainee.step) if cfg.flops else None
    synchronize(device)
    model_util = hardware_util = None
    if device.type == "cuda":  # data-sheet peaks exist for NVIDIA GPUs only
        model_util, hardware_util = flops_utilisation(
            step_flops, timing.median, report.name, cfg.precision, report.multiprocessors,
            recomputes=cfg.gradient_checkpointing,
        )  # fmt: skip
    return Record(
        config=cfg.as_dict(),
        device=report.as_dict(),
        n_params=trainee.n_params,
        n_tensors=trainee.n_tensors,
        memory=categories.as_dict(),
        allocator=asdict(allocator) if allocator else None,
        nvml_used=nvml,
        step_time=timing.median,
        step_times=timing.times,
        samples_per_s=samples / timing.median,
        tokens_per_s=samples * cfg.seq_len / timing.median,
        flops_per_step=step_flops,
        mfu=model_util,
        hfu=hardware_util,
        losses=trainee.losses,
        wall_s=time.perf_counter() - t0,
    )


def measure_speeds(configs: list[RunConfig]) -> dict[str, dict]:
    """Speed only, several settings in turn in this one process: each built, stepped (its
    warmup, one untimed step, ``repeats`` timed), read by NVML, its FLOPs counted over one
    more step where ``cfg.flops``, freed before the next.

    ``measure`` in a fresh process per setting gives the bytes; this is the quiet-card timing
    of settings whose bytes are measured elsewhere (gpu-check's capstone), without a process
    and a tracked step each.

    Returns:
        Per label the ``Record`` fields it measured (step times, samples/s, tokens/s, FLOPs
        per step, MFU, HFU, NVML), or ``{"error": ...}`` for a setting that failed; the
        others still run.
    """
    out: dict[str, dict] = {}
    for cfg in configs:
        trainee = None
        try:
            trainee = Trainee(cfg)
            for _ in range(max(1, cfg.warmup)):
                trainee.step()
            timing = time_fn(trainee.step, trainee.device, warmup=1, repeats=cfg.repeats)
            nvml = nvml_used_bytes(trainee.device)  # after the timed steps, as in measure
            report, samples = hardware_report(trainee.device), cfg.batch_size * cfg.grad_accum
            flops = train_flops(trainee.step) if cfg.flops else None
            util = (None, None)
            if trainee.device.type == "cuda":
                util = flops_utilisation(flops, timing.median, report.name, cfg.precision,
                                         report.multiprocessors,
                                         recomputes=cfg.gradient_checkpointing)  # fmt: skip
            out[cfg.label] = {
                "step_time": timing.median, "step_times": timing.times,
                "samples_per_s": samples / timing.median,
                "tokens_per_s": samples * cfg.seq_len / timing.median,
                "flops_per_step": flops, "mfu": util[0], "hfu": util[1], "nvml_used": nvml,
            }  # fmt: skip
        except Exception as err:  # one setting's failure is its row's, never the others'
            out[cfg.label] = {"error": f"{type(err).__name__}: {err}".splitlines()[0]}
        finally:
            device = trainee.device if trainee is not None else resolve(cfg.device)
            del trainee
            device_api.release_cached(device)
    return out


@dataclass
class TrainResult:
    """Loss curve, step times and (fp16) loss scales of a run on the learnable task."""

    precision: str = "fp32"
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # seconds, one per optimizer step
    scales: list[float] = field(default_factory=list)  # GradScaler's scale after each step (fp16)
    best_loss: float = 0.0  # the task's entropy rate (causal LM)
    uniform_loss: float = 0.0  # log(n_states): a model that learnt nothing

    def final(self, last: int = 5) -> float:
        """Mean loss of the last ``last`` steps (one batch's loss is noisy)."""
        tail = self.losses[-last:]
        return sum(tail) / len(tail)

    @property
    def step_time(self) -> float:
        """Median seconds per step, the first (warm-up) step excluded."""
        times = sorted(self.step_times[1:] or self.step_times)
        return times[len(times) // 2]


def train_markov(cfg: RunConfig, steps: int, lr: float | None = None) -> TrainResult:
    """Train ``cfg`` on the learnable Markov task for ``steps`` optimizer steps, each timed.

    ``lr``, if given, replaces every parameter group's learning rate (each optimizer of the
    course reads its group's rate at every step).
    """
    trainee = Trainee(replace(cfg, data="markov"))
    if lr is not None:
        for group in trainee.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):  # torchao keeps it a tensor
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
    task = trainee.task
    out = TrainResult(cfg.precision, best_loss=task.entropy_rate, uniform_loss=task.uniform_loss)
    for _ in range(steps):
        out.step_times.append(time_once(trainee.step, trainee.device))
        out.losses.append(trainee.losses[-1])
        if trainee.scaler is not None:
            out.scales.append(float(trainee.scaler.get_scale()))
    return out


@dataclass
class ForwardBackwardResult:
    """Forward and backward of one micro-batch, apart: FLOPs, times, time by op class.

    Times come in rounds: each round times one forward and one backward back to back
    (``forward_times``, ``backward_times``) and profiles one forward and one forward+backward
    (``class_times``: per op class and pass, seconds per round), so that ratios can be taken
    round by round (``passes()`` and ``classes()``), on one machine state each.
    """

    forward_flops: int
    backward_flops: int
    forward_times: list[float]
    backward_times: list[float]
    forward_ops: dict[str, float]  # self-time per aten operator in one forward (last round)
    backward_ops: dict[str, float]  # the same for one backward (forward+backward minus forward)
    op_flops: dict[str, int]  # forward + backward FLOPs per op class
    class_times: dict[str, list[float]]  # "forward contractions" ... "backward element-wise"
    # Rounds disturbed by other processes and left out, and the cores others used each round.
    left_out: dict[str, int] = field(default_factory=dict)
    others: list[float] = field(default_factory=list)
    aside: ForwardBackwardResult | None = None  # the rounds set aside, in the same fields
    # The first measurement, when one of the claims it decided the wrong way was measured again.
    first: ForwardBackwardResult | None = None

    @property
    def forward_s(self) -> float:
        """Median seconds of a forward pass."""
        return self.passes().median("forward")

    @property
    def backward_s(self) -> float:
        """Median seconds of a backward pass."""
        return self.passes().median("backward")

    def _pass_times(self) -> dict[str, list[float]]:
        return {"forward": self.forward_times, "backward": self.backward_times}

    def _class_times(self) -> dict[str, list[float]]:
        ops = dict(self.class_times)
        rounds = list(zip(*self.class_times.values(), strict=True))
        ops["all ops"] = [sum(per_round) for per_round in rounds]
        forward, backward = (
            ops.get("forward element-wise", []),
            ops.get("backward element-wise", []),
        )
        ops["element-wise"] = [f + b for f, b in zip(forward, backward, strict=True)]
        return ops

    def passes(self):
        """The two passes' rounds as a ``Comparison`` ("forward", "backward")."""
        aside = self.aside._pass_times() if self.aside else {}
        first = self.first.passes() if self.first else None
        return self._comparison(self._pass_times(), aside, first)

    def classes(self):
        """Op-class rounds as a ``Comparison``, with "all ops" and "element-wise" (both passes)."""
        aside = self.aside._class_times() if self.aside else {}
        first = self.first.classes() if self.first else None
        return self._comparison(self._class_times(), aside, first)

    def _comparison(self, times: dict[str, list[float]], aside: dict, first):
        return Comparison.of(times, aside, left_out=dict(self.left_out),
                             others=list(self.others), first=first)  # fmt: skip

    def verdict(self, claim) -> str:
        """The claim's verdict on these rounds: on the passes, or on the op classes."""
        on_passes = {claim.name, claim.versus} <= {"forward", "backward"}
        return (self.passes() if on_passes else self.classes()).verdict(claim)

    def decided(self, claims) -> bool:
        """Every claim (on passes or on op classes, by its names) holds or fails."""
        return all(self.verdict(c) != "undecided" for c in claims)


def forward_backward(
    cfg: RunConfig, rounds: int = 5, max_rounds: int = 15, claims=()
) -> ForwardBackwardResult:
    """Split a training step: forward and backward FLOPs (counted) and times (in rounds).

    After ``rounds`` rounds, more are added while one of ``claims`` is undecided, up to
    ``max_rounds``; a round other processes disturbed is left out, and a claim decided the
    wrong way is measured again before it can fail (as ``helpers.timing.interleave`` does).
    """
    trainee = Trainee(cfg)
    device, model, batch = trainee.device, trainee.model, trainee.batch()

    def forward():
        with autocast_context(cfg.precision, device):
            return model(**batch).loss

    def both():
        model.zero_grad(set_to_none=True)
        forward().backward()

    fwd_counter, bwd_counter = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with fwd_counter:
        loss = forward()
    with bwd_counter:
        loss.backward()
    fwd_classes, bwd_classes = _class_flops(fwd_counter), _class_flops(bwd_counter)
    for _ in range(cfg.warmup):
        both()
    flops = (fwd_counter.get_total_flops(), bwd_counter.get_total_flops(),
             {k: fwd_classes[k] + bwd_classes[k] for k in fwd_classes})  # fmt: skip

    def measure() -> ForwardBackwardResult:
        """One measurement: rounds until decided, those disturbed by others left out."""
        out = ForwardBackwardResult(flops[0], flops[1], [], [], {}, {}, flops[2], {})
        out.aside = ForwardBackwardResult(flops[0], flops[1], [], [], {}, {}, flops[2], {})
        watch = Disturbance(into=out)
        for attempt in range(max_rounds):
            if len(out.forward_times) >= rounds and out.decided(claims):
                break
            if watch.too_busy(attempt, len(out.forward_times), rounds):
                break  # a machine that busy decides nothing: report what was measured
            model.zero_grad(set_to_none=True)
            with watch.round():
                row = _forward_backward_round(forward, both, device)
            _add_round(out.aside if watch.set_aside() else out, *row)
        if not out.forward_ops:  # every round was set aside: the last one's op times
            out.forward_ops, out.backward_ops = out.aside.forward_ops, out.aside.backward_ops
        return out

    return confirmed(measure, claims)  # a claim decided the wrong way: measured again


def _class_flops(counter) -> dict[str, int]:
    """A FlopCounterMode's counts summed per op class (contractions, normalisations, ...)."""
    out = dict.fromkeys(OP_CLASSES, 0)
    for op, n in counter.get_flop_counts()["Global"].items():  # keys like aten.mm
        out[op_class(str(op).removeprefix("aten.").split(".")[0])] += n
    return out


def _forward_backward_round(forward, both, device):
    """One round: a forward and a backward timed back to back, then both passes profiled;
    (forward s, backward s, forward's op self-times, backward's)."""
    synchronize(device)
    t0 = time.perf_counter()
    loss = forward()
    synchronize(device)
    t1 = time.perf_counter()
    loss.backward()
    synchronize(device)
    t2 = time.perf_counter()
    fwd_ops, all_ops = op_self_times(forward, device), op_self_times(both, device)
    bwd_ops = {k: max(0.0, v - fwd_ops.get(k, 0.0)) for k, v in all_ops.items()}
    return t1 - t0, t2 - t1, fwd_ops, bwd_ops


def _add_round(out: ForwardBackwardResult, forward_s, backward_s, fwd_ops, bwd_ops) -> None:
    """Keep one round in ``out``: the passes' times and the op classes' seconds."""
    out.forward_times.append(forward_s)
    out.backward_times.append(backward_s)
    for phase, ops in (("forward", fwd_ops), ("backward", bwd_ops)):
        for name, seconds in by_op_class(ops).items():
            out.class_times.setdefault(f"{phase} {name}", []).append(seconds)
    out.forward_ops, out.backward_ops = fwd_ops, bwd_ops


def trainer_arguments(output_dir: str, device: torch.device | str | None = None, **overrides):
    """``TrainingArguments`` for a measured Trainer run, quiet: no reports to tracking services,
    no checkpoints, no log lines; on the CPU when ``device`` is the CPU. Its progress bar shows
    where ``helpers.progress.enabled()`` says bars are on (a notebook, not CI or a child process).

    ``overrides`` are TrainingArguments' own names and win over these defaults (for example
    ``logging_strategy="steps", logging_steps=1`` to keep a loss per step).
    """
    # transformers' training arguments import accelerate (and it bitsandbytes): seconds that
    # only a Trainer run needs.
    from transformers import TrainingArguments

    quiet = dict(
        report_to="none", save_strategy="no", logging_strategy="no",
        disable_tqdm=not progress.enabled(),
        use_cpu=resolve(device).type == "cpu",
    )  # fmt: skip
    return TrainingArguments(output_dir=output_dir, **{**quiet, **overrides})


def quiet_trainer(trainer):
    """``trainer`` without its PrinterCallback (it prints the final metrics as a dict)."""
    from transformers import PrinterCallback  # as trainer_arguments' import

    trainer.remove_callback(PrinterCallback)
    return trainer
