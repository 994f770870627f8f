"""Optimizer state tensor by tensor: predicted from parameter shapes, read back, and compared.

What each optimizer keeps per parameter tensor (sources: torch/optim/adamw.py, sgd.py,
_adafactor.py; bitsandbytes/optim/optimizer.py ``Optimizer2State.init_state``):

- ``adamw`` (torch): ``exp_avg`` and ``exp_avg_sq`` shaped like the parameter, and a 0-d fp32
  ``step`` tensor that torch keeps on the CPU unless the optimizer is fused or capturable.
- ``sgd`` with momentum: one ``momentum_buffer`` shaped like the parameter, no step.
- ``adafactor`` (torch): the second moment of a matrix as a row vector and a column vector
  (``row_var`` (..., rows, 1), ``col_var`` (..., 1, cols)); a vector keeps a full ``variance``;
  a CPU ``step`` tensor. No first moment. transformers' own Adafactor (the Trainer's
  ``optim="adafactor"``) keeps the same factors (``exp_avg_sq_row``/``_col``, without the
  size-1 axis), counts its step in a Python int and keeps the weight's RMS as a 0-d tensor.
- ``adamw8bit`` (bitsandbytes): tensors with at least ``min_8bit_size`` elements keep
  ``state1``/``state2`` as uint8 plus one fp32 ``absmax`` per block of 256 values for each, and
  share two 256-entry fp32 quantisation maps; smaller tensors, and any parameter registered
  for 32-bit state (the Trainer registers every ``nn.Embedding`` weight), keep two fp32 states.
  The step count is a Python int.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from helpers.device import allocation_bytes

BNB_BLOCK = 256  # values per absmax scale (bitsandbytes Optimizer2State.init_state)
BNB_MIN_8BIT = 4096  # default min_8bit_size: smaller tensors keep 32-bit state
BNB_QMAP = 256  # entries of each dynamic quantisation map (one signed, one unsigned)
SHARED = "(shared)"  # pseudo parameter name for state tensors that several parameters share


@dataclass(frozen=True)
class StateTensor:
    """One tensor of optimizer state: whose it is, what it is, and how big."""

    param: str  # parameter name, or SHARED
    key: str  # state key: exp_avg, row_var, state1, absmax1, ...
    shape: tuple[int, ...]
    dtype: torch.dtype
    host: bool = False  # on the CPU while its parameter lives on an accelerator

    @property
    def nbytes(self) -> int:
        """Bytes of this tensor: elements x element size."""
        return math.prod(self.shape) * torch.empty(0, dtype=self.dtype).element_size()


def embedding_params(model: torch.nn.Module) -> set[int]:
    """ids of the weights of every ``nn.Embedding`` (what the Trainer gives 32-bit state)."""
    return {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}


def expected_state(
    model: torch.nn.Module,
    optimizer: str,
    *,
    embeddings_32bit: bool = True,
    min_8bit_size: int = BNB_MIN_8BIT,
    fused: bool = False,
    impl: str = "torch",
) -> list[StateTensor]:
    """The state ``optimizer`` (course name) will hold for ``model``, from parameter shapes only.

    ``fused=True`` keeps torch's step on the parameter's device; ``impl="transformers"`` with
    ``adafactor`` describes transformers' Adafactor (the Trainer's) instead of torch's.
    """
    embeddings = embedding_params(model) if embeddings_32bit else set()
    params = [
        ParamShape(name, tuple(p.shape), p.requires_grad, id(p) in embeddings, p.dtype)
        for name, p in model.named_parameters()
    ]
    first = next(model.parameters(), None)
    device_type = "cpu" if first is None else first.device.type
    return state_tensors(params, optimizer, device_type, min_8bit_size, fused, impl)


@dataclass(frozen=True)
class ParamShape:
    """What the state rules need to know of a parameter (``helpers.estimate.ParamInfo`` too)."""

    name: str
    shape: tuple[int, ...]
    trainable: bool = True
    embedding: bool = False  # gets 32-bit state from 8-bit AdamW (the Trainer's override)
    dtype: torch.dtype = torch.float32


def state_tensors(
    params,
    optimizer: str,
    device_type: str = "cpu",
    min_8bit_size: int = BNB_MIN_8BIT,
    fused: bool = False,
    impl: str = "torch",
) -> list[StateTensor]:
    """The state tensors of ``optimizer`` for ``params`` (anything with the ParamShape fields).

    The one place the course's per-optimizer state rules live: lesson 06 checks them against
    state read back from the optimizers, and ``helpers.estimate`` sums them.
    """
    f32, rows, n_8bit = torch.float32, [], 0
    host = not fused and device_type != "cpu"  # torch keeps its step counters on the CPU
    for p in params:
        if not getattr(p, "trainable", True):
            continue
        name, shape, n = p.name, tuple(p.shape), math.prod(p.shape)
        dtype = getattr(p, "dtype", f32)
        if optimizer == "adafactor" and impl == "transformers":
            if len(shape) > 1:
                rows.append(StateTensor(name, "exp_avg_sq_row", shape[:-1], dtype))
                rows.append(StateTensor(name, "exp_avg_sq_col", (*shape[:-2], shape[-1]), dtype))
            else:
                rows.append(StateTensor(name, "exp_avg_sq", shape, dtype))
            rows.append(StateTensor(name, "RMS", (), dtype))
            continue
        if optimizer in ("adamw", "adafactor"):
            rows.append(StateTensor(name, "step", (), f32, host=host))
        if optimizer == "adamw":
            rows += [StateTensor(name, k, shape, dtype) for k in ("exp_avg", "exp_avg_sq")]
        elif optimizer == "sgd":
            rows.append(StateTensor(name, "momentum_buffer", shape, dtype))
        elif optimizer == "adafactor":
            if len(shape) > 1:
                rows.append(StateTensor(name, "row_var", (*shape[:-1], 1), dtype))
                rows.append(StateTensor(name, "col_var", (*shape[:-2], 1, shape[-1]), dtype))
            else:
                rows.append(StateTensor(name, "variance", shape, dtype))
        elif optimizer == "adamw8bit":
            if n < min_8bit_size or getattr(p, "embedding", False):
                rows += [StateTensor(name, k, shape, f32) for k in ("state1", "state2")]
            else:
                n_8bit += 1
                blocks = (math.ceil(n / BNB_BLOCK),)
                rows += [StateTensor(name, k, shape, torch.uint8) for k in ("state1", "state2")]
                rows += [StateTensor(name, k, blocks, f32) for k in ("absmax1", "absmax2")]
        else:
            raise ValueError(f"unknown optimizer {optimizer!r}")
    if n_8bit:  # one signed map for state1 and one unsigned for state2, shared by all tensors
        owner = SHARED if n_8bit > 1 else next(r.param for r in rows if r.key == "absmax1")
        rows += [StateTensor(owner, k, (BNB_QMAP,), f32) for k in ("qmap1", "qmap2")]
    return rows


def read_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[StateTensor]:
    """The state ``optimizer`` really holds, one row per distinct storage.

    A storage that several parameters' states point to (bitsandbytes' quantisation maps) is
    listed once, under SHARED. Non-tensor entries (Python ints and floats) take no tensor memory.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    owners: dict[int, set[str]] = {}
    first: dict[int, tuple[str, torch.Tensor, torch.Tensor]] = {}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                ptr = value.untyped_storage().data_ptr()
                owners.setdefault(ptr, set()).add(names[id(p)])
                first.setdefault(ptr, (key, value, p))
    rows = []
    for ptr, (key, value, p) in first.items():
        owner = SHARED if len(owners[ptr]) > 1 else next(iter(owners[ptr]))
        host = value.device.type == "cpu" and p.device.type != "cpu"
        rows.append(StateTensor(owner, key, tuple(value.shape), value.dtype, host))
    return rows


def bytes_per_param(rows: list[StateTensor]) -> dict[str, int]:
    """Total state bytes per parameter name (SHARED collects the shared tensors)."""
    out: dict[str, int] = {}
    for r in rows:
        out[r.param] = out.get(r.param, 0) + r.nbytes
    return out


def tracked_bytes(rows: list[StateTensor], device: torch.device | str) -> int:
    """What the course's tracker reports as ``optimizer_state`` for this state on ``device``.

    On the CPU: the plain sum. On an accelerator the tracker counts the device's tensors only
    (torch's CPU step counters are not device memory), and on CUDA it rounds every tensor up
    to the allocator's 512-byte blocks, as MemTracker does.
    """
    kind = torch.device(device).type
    if kind == "cpu":
        return sum(r.nbytes for r in rows)
    return sum(allocation_bytes(r.nbytes, kind) for r in rows if not r.host)


def adamw_step_times(cfg, variants: dict[str, dict], repeats: int = 20, claims=()) -> dict:
    """``optimizer.step()`` alone for torch AdamW built with each kwargs set, timed in turns.

    The model of ``cfg`` gets fixed random gradients once; every variant starts from the same
    weights, so the updated weights can be compared too (key ``max_diff``: the largest
    difference from the first variant after one step). The variants' optimizers then step in
    interleaved rounds (``helpers.timing.compare_calls``, at least ``repeats`` rounds, more
    while a claim is undecided): key ``comparison``. A variant that cannot be built on this
    device comes back as its error message instead of a time.
    """
    from helpers.device import resolve
    from helpers.models import build_model, load_config
    from helpers.timing import compare_calls

    device = resolve(cfg.device)
    model = build_model(load_config(cfg.model), device=device, seed=cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(cfg.seed)
    start = [p.detach().clone() for p in params]
    grads = [1e-3 * torch.randn(p.shape, generator=g).to(device) for p in params]
    steps, errors, max_diff, ref = {}, {}, {}, None
    for label, kwargs in variants.items():
        for p, p0, gr in zip(params, start, grads, strict=True):
            p.data.copy_(p0)
            p.grad = gr
        try:
            opt = torch.optim.AdamW(params, lr=1e-3, **kwargs)
            opt.step()  # creates the state, and is the step whose result is compared
        except (RuntimeError, ValueError) as err:
            errors[label] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            continue
        if ref is None:  # the first variant that runs is the reference
            ref = [p.detach().clone() for p in params]
        max_diff[label] = max(
            float((p.detach() - r).abs().max()) for p, r in zip(params, ref, strict=True)
        )
        steps[label] = opt.step
    ran = [c for c in claims if c.name in steps and c.versus in steps]
    comparison = compare_calls(steps, device, warmup=2, rounds=repeats,
                               max_rounds=max(repeats, 15), claims=ran)  # fmt: skip
    return {"comparison": comparison, "errors": errors, "max_diff": max_diff,
            "n_tensors": len(params), "n_params": sum(p.numel() for p in params)}  # fmt: skip


def markov_curves(runs: dict, steps: int) -> dict:
    """Loss curves on the learnable task for several ``(RunConfig, lr)`` pairs, in order.

    Each run builds its own model from its seed, so runs do not influence each other; they
    share one process only to pay the imports once.
    """
    from dataclasses import replace

    from helpers.train import Trainee, TrainResult

    out = {}
    for label, (cfg, lr) in runs.items():
        trainee = Trainee(replace(cfg, data="markov"))
        for group in trainee.optimizer.param_groups:
            group["lr"] = lr  # every optimizer here reads its group's lr at each step
        for _ in range(steps):
            trainee.step()
        task = trainee.task
        out[label] = TrainResult(trainee.losses, task.entropy_rate, task.uniform_loss)
    return out


def trainer_states(model_name: str, optims: list[str], steps: int = 2, seed: int = 0) -> dict:
    """Train ``steps`` steps with each of the Trainer's ``optim=`` names; report what it built.

    Per name: the optimizer's class, its hyper-parameters, the modules registered with
    bitsandbytes' GlobalOptimManager for 32-bit state, and ``read_state`` of the optimizer.
    A name that fails (bitsandbytes missing, say) comes back as {"error": message}.
    """
    return {optim: _trainer_state(model_name, optim, steps, seed) for optim in optims}


def _trainer_state(model_name: str, optim: str, steps: int, seed: int) -> dict:
    """One ``trainer_states`` entry: build, train and inspect one Trainer."""
    import tempfile
    import warnings
    from pathlib import Path

    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from helpers.data import MarkovTask, markov_dataset
    from helpers.device import resolve
    from helpers.models import build_model, load_config, task_kind

    config = load_config(model_name)
    device = resolve(None)
    model = build_model(config, device=device, seed=seed)
    task = MarkovTask(n_states=min(64, config.vocab_size), seed=seed)
    data = markov_dataset(task, task_kind(config), 4 * steps, 32, seed=seed)
    try:
        args = TrainingArguments(
            output_dir=str(Path(tempfile.gettempdir()) / "course-trainer-06"),
            optim=optim, max_steps=steps,
            per_device_train_batch_size=4, learning_rate=1e-3, report_to="none",
            save_strategy="no", logging_strategy="no", disable_tqdm=True,
            use_cpu=device.type == "cpu", seed=seed,
        )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = Trainer(model=model, args=args, train_dataset=data)
            trainer.remove_callback(PrinterCallback)  # no log lines: we report what it built
            trainer.train()
    except (ImportError, ValueError, RuntimeError) as err:
        return {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[0]}"}
    opt = trainer.optimizer
    opt = getattr(opt, "optimizer", opt)  # accelerate wraps it
    overrides = []
    if "bitsandbytes" in type(opt).__module__:
        import bitsandbytes as bnb

        manager = bnb.optim.GlobalOptimManager.get_instance()
        names = {id(m): n for n, m in model.named_modules()}
        overrides = [
            (names.get(id(m), "?"), attr, cfg)
            for m, attr, cfg in manager.module_weight_config_triple
        ]
    hyper = {k: v for k, v in opt.defaults.items() if isinstance(v, (int, float, bool, tuple))}
    if hasattr(opt, "args"):  # bitsandbytes keeps optim_bits and min_8bit_size here
        hyper.update({k: getattr(opt.args, k) for k in ("optim_bits", "min_8bit_size")})
    return {
        "class": f"{type(opt).__module__}.{type(opt).__name__}",
        "hyper": hyper,
        "overrides": overrides,
        "state": read_state(model, opt),
    }
