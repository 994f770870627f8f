"""Optimizer state tensor by tensor: predicted from parameter shapes, and read back.

The one home of the per-optimizer state rules: ``helpers.estimator`` sums them, and lesson 06
(``notebooks/06_optimizers.ipynb``, sections 1-3) checks them against the state the optimizers
really hold.

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
- ``lion`` / ``lion8bit`` (bitsandbytes ``Optimizer1State.init_state``): one moment,
  ``state1``, fp32 whatever the weight's dtype; 8-bit Lion keeps it as uint8 with one fp32
  ``absmax1`` per 256 values and one shared 256-entry map, with the same 32-bit exceptions as
  8-bit AdamW.
- ``muon`` (torch/optim/_muon.py): ``torch.optim.Muon`` keeps one ``momentum_buffer`` like the
  gradient and no step, for the hidden layers' 2-D matrices only (``hidden_matrices``); every
  other trained tensor is AdamW's (its state as above).
- AdamW for bf16 weights (lesson 05; torchao/optim/adam.py ``_AdamBase.step``,
  optimi/optimizer.py and adam.py): torchao's AdamW with stochastic rounding keeps
  ``exp_avg``/``exp_avg_sq`` like the parameter and a 0-d fp32 ``step`` that it always creates
  on the CPU; torch-optimi's AdamW with Kahan summation keeps ``exp_avg``, ``exp_avg_sq`` and
  ``kahan_comp`` like the parameter, and counts its step per parameter group.
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


def hidden_matrices(model: torch.nn.Module) -> set[int]:
    """ids of the weights Muon updates: the 2-D matrices of the hidden layers.

    torch's Muon docs and Muon's authors leave embeddings, the output head and every vector
    (norms, biases) to AdamW. The hidden layers are the transformers model's base model (its
    head is outside it; under peft, the wrapped model's), less its ``nn.Embedding`` weights.

    Example::

        >>> muon = [p for p in model.parameters() if id(p) in hidden_matrices(model)]
    """
    embeddings = embedding_params(model)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's
    base = getattr(inner, "base_model", inner)
    return {id(p) for p in base.parameters() if p.ndim == 2 and id(p) not in embeddings}


def expected_state(
    model: torch.nn.Module,
    optimizer: str,
    *,
    embeddings_32bit: bool = True,
    min_8bit_size: int = BNB_MIN_8BIT,
    fused: bool = False,
    impl: str = "torch",
    bf16_update: str = "nearest",
) -> list[StateTensor]:
    """The state ``optimizer`` (course name) will hold for ``model``, from parameter shapes only.

    ``fused=True`` keeps torch's step on the parameter's device; ``impl="transformers"`` with
    ``adafactor`` describes transformers' Adafactor (the Trainer's) instead of torch's;
    ``bf16_update`` names the AdamW of bf16 weights (``helpers.train.make_optimizer``).
    """
    embeddings = embedding_params(model) if embeddings_32bit else set()
    hidden = hidden_matrices(model)
    params = [
        ParamShape(name, tuple(p.shape), p.requires_grad, id(p) in embeddings, p.dtype,
                   id(p) in hidden)
        for name, p in model.named_parameters()
    ]  # fmt: skip
    first = next(model.parameters(), None)
    device_type = "cpu" if first is None else first.device.type
    return state_tensors(params, optimizer, device_type, min_8bit_size, fused, impl, bf16_update)


@dataclass(frozen=True)
class ParamShape:
    """What the state rules need to know of a parameter (``helpers.estimator.ParamInfo`` too)."""

    name: str
    shape: tuple[int, ...]
    trainable: bool = True
    embedding: bool = False  # gets 32-bit state from 8-bit AdamW (the Trainer's override)
    dtype: torch.dtype = torch.float32
    hidden: bool = False  # a hidden layer's 2-D matrix: Muon's (``hidden_matrices``)


def state_tensors(
    params,
    optimizer: str,
    device_type: str = "cpu",
    min_8bit_size: int = BNB_MIN_8BIT,
    fused: bool = False,
    impl: str = "torch",
    bf16_update: str = "nearest",
) -> list[StateTensor]:
    """The state tensors of ``optimizer`` for ``params`` (anything with the ParamShape fields).

    The one place the course's per-optimizer state rules live: lesson 06 checks them against
    state read back from the optimizers, and ``helpers.estimator`` sums them. ``bf16_update``
    "stochastic" or "kahan" is AdamW as torchao or torch-optimi keep it (``RunConfig``).
    """
    f32, rows, n_8bit = torch.float32, [], 0
    host = not fused and device_type != "cpu"  # torch keeps its step counters on the CPU
    if optimizer not in ("adamw", "sgd", "adafactor", "muon", *_BNB_MOMENTS):
        raise ValueError(f"unknown optimizer {optimizer!r}")
    for p in params:
        if not getattr(p, "trainable", True):
            continue
        name, shape, n = p.name, tuple(p.shape), math.prod(p.shape)
        dtype = getattr(p, "dtype", f32)
        if optimizer == "adafactor":
            rows += _adafactor_state(name, shape, dtype, host, impl)
        elif optimizer == "adamw" or (optimizer == "muon" and not getattr(p, "hidden", False)):
            rows += _adamw_state(name, shape, dtype, host, device_type, bf16_update)
        elif optimizer in ("sgd", "muon"):  # Muon's hidden matrices: a momentum buffer only
            rows.append(StateTensor(name, "momentum_buffer", shape, dtype))
        else:  # bitsandbytes: fp32 moments, or 8-bit ones where the tensor is big enough
            eight = (
                optimizer != "lion" and n >= min_8bit_size and not getattr(p, "embedding", False)
            )
            rows += _bnb_state(name, shape, _BNB_MOMENTS[optimizer], eight)
            n_8bit += eight
    if n_8bit:  # one signed map for state1 and one unsigned for state2, shared by all tensors
        owner = SHARED if n_8bit > 1 else next(r.param for r in rows if r.key == "absmax1")
        maps = ("qmap1", "qmap2")[: _BNB_MOMENTS[optimizer]]
        rows += [StateTensor(owner, k, (BNB_QMAP,), f32) for k in maps]
    return rows


_BNB_MOMENTS = {"adamw8bit": 2, "lion": 1, "lion8bit": 1}  # bitsandbytes' optimizers' moments


def _bnb_state(name, shape, moments: int, eight: bool) -> list[StateTensor]:
    """One parameter's bitsandbytes state: ``moments`` fp32 tensors like it, or uint8 codes and
    an fp32 absmax per block of 256 values for each (the maps are shared: ``state_tensors``)."""
    keys = ("state1", "state2")[:moments]
    if not eight:
        return [StateTensor(name, k, shape, torch.float32) for k in keys]
    blocks = (math.ceil(math.prod(shape) / BNB_BLOCK),)
    codes = [StateTensor(name, k, shape, torch.uint8) for k in keys]
    return codes + [StateTensor(name, f"absmax{k[-1]}", blocks, torch.float32) for k in keys]


def _adafactor_state(name, shape, dtype, host, impl) -> list[StateTensor]:
    """One parameter's Adafactor state: torch's, or transformers' (``impl="transformers"``)."""
    if impl == "transformers":
        factors = [StateTensor(name, "exp_avg_sq", shape, dtype)]
        if len(shape) > 1:
            row, col = shape[:-1], (*shape[:-2], shape[-1])
            factors = [StateTensor(name, "exp_avg_sq_row", row, dtype),
                       StateTensor(name, "exp_avg_sq_col", col, dtype)]  # fmt: skip
        return [*factors, StateTensor(name, "RMS", (), dtype)]
    step = StateTensor(name, "step", (), torch.float32, host=host)
    if len(shape) > 1:
        return [step, StateTensor(name, "row_var", (*shape[:-1], 1), dtype),
                StateTensor(name, "col_var", (*shape[:-2], 1, shape[-1]), dtype)]  # fmt: skip
    return [step, StateTensor(name, "variance", shape, dtype)]


def _adamw_state(name, shape, dtype, host, device_type, bf16_update) -> list[StateTensor]:
    """One parameter's AdamW state: torch's, torchao's (stochastic) or torch-optimi's (kahan)."""
    if bf16_update == "kahan":  # no step tensor: optimi counts steps per group
        return [StateTensor(name, k, shape, dtype) for k in ("exp_avg", "exp_avg_sq", "kahan_comp")]
    # torchao makes its step with torch.tensor(0.0): on the CPU, whatever the parameter's device
    on_host = device_type != "cpu" if bf16_update == "stochastic" else host
    step = StateTensor(name, "step", (), torch.float32, host=on_host)
    return [step, *(StateTensor(name, k, shape, dtype) for k in ("exp_avg", "exp_avg_sq"))]


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
