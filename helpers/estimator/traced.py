"""The estimator's second path: a real forward and backward on fake tensors, tracked.

For a family without an analytical stage model (GPT-2, Qwen3, Gemma, Phi-3, OPT, ...) the
estimate is the course's own ``CategoryTracker`` run over the model's real forward and
backward, with every tensor a ``FakeTensor`` (PyTorch's ``FakeTensorMode``: shapes, dtypes
and devices, no storage and no arithmetic). The model, its LoRA adapters, checkpointing,
autocast and the loss are transformers', torch's and peft's own code; only the numbers are
missing, so a 7B config costs seconds and no memory.

What is traced, and what is added
    The tracker sees one micro-batch's forward and backward (two when gradients accumulate:
    every later micro-batch finds the gradients already there, as the second does). On the
    CPU, AdamW's and SGD's steps are traced after it (a first untracked step makes the
    state, as a real warm-up does). On CUDA (foreach kernels, step counters on the host) and
    for Adafactor and 8-bit AdamW (their steps read numbers, which fake tensors do not
    have), the state and the step's scratch come from ``helpers.estimator.state``, exact
    per optimizer (tests/test_estimate.py). The state is alive through the whole step, so
    the traced peak rises by it, and the step itself is one more moment.

Deep models: two shallow traces per layer kind (``layer_plan``)
    A 7-8B config traced whole takes 5-25 s on 2 cores; traced at 2 and 3 layers (one trace
    more per kind of ``layer_types``) and extrapolated moment by moment, 1-3 s. The moments
    are the tracker's own (``_MomentTracker``); tests/test_traced.py compares the result
    with whole traces of 7-layer models of every family, to the byte.

CPU semantics, and CUDA's differences on top
    Fake tensors follow CPU kernels (fake CUDA tensors need a CUDA build). For a CUDA
    estimate four differences are applied while tracing, each from PyTorch's sources:
    - every storage is rounded up to the caching allocator's 512-byte blocks;
    - dropout runs as ``native_dropout``, CUDA's fused kernel, which keeps a 1-byte bool mask
      (the CPU keeps a mask of the input's dtype);
    - SDPA with dropout keeps what the fused kernels keep (output and log-sum-exp: the CPU
      falls back to the math kernel and keeps the probabilities);
    - autocast follows CUDA's op lists (ATen/autocast_mode.h, AT_FORALL_FP32 and
      AT_FORALL_FP32_SET_OPT_DTYPE): softmax, pow, exp, layer_norm, sum... run in fp32 on
      16-bit inputs on CUDA, where the CPU keeps them 16-bit. The casts are applied to calls
      made from Python (every call in these models); an op reached only inside a C++
      composite keeps the CPU's policy.
    Left as on the CPU: the memory-efficient kernel pads its log-sum-exp to a multiple of 32
    positions (exact when the sequence length is one), and library workspaces (cuBLAS) that
    no tensor shows are the reserve margin's job (``helpers.planner.usable_budget``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import re
from dataclasses import dataclass, field, replace

import torch
from torch import _meta_registrations as torch_meta
from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from transformers import masking_utils

from helpers import compat
from helpers.data import random_batch
from helpers.memory import CATEGORY, CategoryTracker, dora_graphs_collected
from helpers.memory_savers import offloaded, selective_context_fn
from helpers.models import apply_lora, build_model, enable_checkpointing, load_config, task_kind
from helpers.names import AUTOCAST
from helpers.quiet import quiet_libraries
from helpers.train import make_optimizer, model_loss, train_step

# CUDA's autocast lists (ATen/autocast_mode.h), by the name a Python call carries.
# AT_FORALL_FP32: every floating input is cast to fp32 first. The list of the installed torch:
# ops added in later releases come from helpers.compat.
CUDA_FP32_OPS = compat.cuda_autocast_fp32_ops(frozenset(
    "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow "
    "softplus layer_norm native_layer_norm group_norm frobenius_norm nuclear_norm "
    "cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d "
    "hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss "
    "margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss "
    "multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp "
    "upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d "
    "upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d "
    "_upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa".split()
))  # fmt: skip
# AT_FORALL_FP32_SET_OPT_DTYPE: the op computes in fp32 (dtype=float32) unless given a dtype.
CUDA_FP32_DTYPE_OPS = frozenset(
    "prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum".split()
)
_DUNDER = {"__pow__": "pow", "__rpow__": "pow"}

# Optimizers whose step runs on fake tensors. Adafactor reads its step count as a number
# (.item()) and 8-bit AdamW builds its quantisation map from numbers; a fake tensor has none,
# so their step comes from helpers.estimator.state (exact, tests/test_estimate.py).
TRACED_OPTIMIZERS = ("adamw", "sgd")
# The AdamWs for bf16 weights (RunConfig.bf16_update), traced where their package is installed
# and every trained weight is bf16: torch-optimi's Kahan loop, torchao's stochastic rounding
# (its eager step, as helpers.compat runs it on a CPU).
BF16_UPDATE_PACKAGES = {"kahan": "optimi", "stochastic": "torchao"}


def step_name(optimizer: str, bf16_update: str = "nearest") -> str:
    """The key of an optimizer's traced step in ``Traced.steps``: "adamw", "adamw+kahan"..."""
    return optimizer if bf16_update == "nearest" else f"{optimizer}+{bf16_update}"


@dataclass(frozen=True)
class StepBytes:
    """The optimizer step of a trace: its state, its scratch and the total at its peak."""

    optimizer_state: int
    temporaries: int
    peak: int  # everything alive at the step's largest moment (the loss tensors included)


@dataclass(frozen=True)
class Traced:
    """What one traced forward and backward held, per category (bytes), and where it peaked;
    on the CPU, the optimizer steps asked for, traced after it (``steps``, by ``step_name``)."""

    params: int
    buffers: int
    gradients: int
    activations: int
    temporaries: int
    weight_copies: int
    peak: int  # without optimizer state (the caller adds it)
    peak_at: str
    leftovers: int  # held besides the model state when the optimizer runs (the loss tensors)
    steps: dict[str, StepBytes]  # the optimizer steps traced (CPU, on request: trace_step)
    # Each moment's maxima (``_MomentTracker``): ((phase, micro-batch, layer role, last layer
    # role), {category: bytes, "total": bytes}); an extrapolated trace has no middle layers.
    moments: tuple = ()


class CudaSemantics(TorchFunctionMode):
    """While tracing on the CPU, make the calls that differ on CUDA behave as they do there."""

    def __init__(self, autocast: bool) -> None:
        super().__init__()
        self.autocast = autocast

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _DUNDER.get(getattr(func, "__name__", ""), getattr(func, "__name__", ""))
        if name == "dropout":
            return _fused_dropout(func, args, kwargs)
        if name == "scaled_dot_product_attention":
            return _fused_sdpa(func, args, kwargs)
        if self.autocast and torch.is_autocast_enabled("cpu"):
            if name in CUDA_FP32_OPS:
                args, kwargs = _to_fp32(args), {k: _to_fp32(v) for k, v in kwargs.items()}
            elif name in CUDA_FP32_DTYPE_OPS and kwargs.get("dtype") is None:
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                if first is not None and first.dtype in (torch.float16, torch.bfloat16):
                    kwargs = {**kwargs, "dtype": torch.float32}
        return func(*args, **kwargs)


def _to_fp32(x):
    """autocast's fp32 cast: a 16-bit floating tensor becomes fp32 (recorded by autograd)."""
    if isinstance(x, torch.Tensor) and x.dtype in (torch.float16, torch.bfloat16):
        return x.to(torch.float32)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_fp32(v) for v in x)
    return x


def _fused_dropout(func, args, kwargs):
    """CUDA's dropout: ``native_dropout`` keeps a bool mask (``at::native::dropout``)."""
    x = args[0]
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", True)
    inplace = args[3] if len(args) > 3 else kwargs.get("inplace", False)
    # at::native::dropout takes the fused kernel only for 0 < p < 1 on a non-empty tensor.
    if not training or not 0 < p < 1 or x.numel() == 0 or inplace:
        return func(*args, **kwargs)
    return torch.native_dropout(x, p, True)[0]


def _fused_sdpa(func, args, kwargs):
    """SDPA with dropout: what CUDA's fused kernels keep (output and log-sum-exp)."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, args, strict=False)) | kwargs
    if not bound.get("dropout_p") or bound.get("enable_gqa"):
        return func(*args, **kwargs)
    # The CPU's flash kernel keeps the same two tensors as CUDA's fused ones; the CPU itself
    # would fall back to the math kernel with dropout (its flash kernel has no dropout), but
    # fake tensors never run a kernel, only its shape function.
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        bound["query"], bound["key"], bound["value"], bound["dropout_p"],
        bool(bound.get("is_causal")), attn_mask=bound.get("attn_mask"), scale=bound.get("scale"),
    )  # fmt: skip
    return out


def trace_step(
    config,
    batch_size: int,
    seq_len: int,
    precision: str,
    gradient_checkpointing: bool,
    attn: str,
    grad_accum: int,
    device_type: str,
    lora_r: int,
    lora_targets: str,
    frozen_16bit: bool = False,
    optimizer: str | None = None,
    bf16_update: str = "nearest",
    checkpoint_policy: str = "full",
    offload_activations: bool = False,
    dora: bool = False,
) -> Traced:
    """One forward and backward (two with accumulation) of ``config`` on fake tensors, tracked.

    ``frozen_16bit``: the model is built in 16 bits and LoRA adapters (fp32, as peft keeps
    them) train on it, as QLoRA's unquantised weights and a bf16 or fp16 base are kept
    (``helpers.estimator.qlora``); without LoRA every weight is bf16 (``weight_dtype``).
    ``optimizer`` (with ``bf16_update``): on the CPU, that optimizer's step is traced after
    the backward, on the same fake model, when its step can run on fake tensors
    (``Traced.steps`` then holds it under ``step_name``). ``checkpoint_policy`` and
    ``offload_activations`` are ``RunConfig``'s: the selective policy and ``save_on_cpu``
    run in the trace as in a real step (``_offload_hooks``: what a CUDA step moves to the host).
    ``dora``: the adapters are DoRA's (peft ``use_dora``).

    Deep models are traced at two small depths and extrapolated (``layer_depths``). Cached:
    the same model and setting is traced once per process (the planner asks for one trace
    per micro-batch, checkpointing, precision and attention), and each optimizer's step once
    on it.
    """
    # The trace builds the model in the dtype it is told (build_model's from_config sets the
    # config's own): a bf16 and an fp16 frozen base are one trace.
    fields = {k: v for k, v in config.to_dict().items() if k not in ("dtype", "torch_dtype")}
    key = json.dumps(fields, sort_keys=True, default=str)
    amp = precision in AUTOCAST  # fp16 and bf16 hold the same bytes, as do fp32 and tf32
    dtype = "bf16" if amp else "fp32"
    gc = checkpoint_policy if gradient_checkpointing else ""
    traced = _trace_cached(
        key, batch_size, seq_len, dtype, gc, attn, min(grad_accum, 2), device_type, lora_r,
        lora_targets, frozen_16bit, offload_activations, dora,
    )  # fmt: skip
    if optimizer is None or not traced.steppable(optimizer, bf16_update):
        return traced.traced
    name = step_name(optimizer, bf16_update)
    return replace(traced.traced, steps={name: traced.step(optimizer, bf16_update)})


@dataclass
class _Kept:
    """A traced fake model kept for its optimizer steps: the model, its fake mode, and the
    bytes the training step held besides the model state when the optimizer ran."""

    model: torch.nn.Module
    mode: FakeTensorMode
    leftovers: int


@dataclass
class TraceSet:
    """A setting's trace (``traced``, without optimizer steps) and the fake models behind it:
    the whole model, or the shallow ones and how many more layers of each kind the full
    model has. ``step`` traces an optimizer's step on them once, and extrapolates it."""

    traced: Traced
    base: _Kept | None  # None on CUDA: its steps come from helpers.estimator.state
    lines: list[tuple[_Kept, int]]
    _steps: dict[str, StepBytes] = field(default_factory=dict)

    def steppable(self, optimizer: str, bf16_update: str = "nearest") -> bool:
        """Whether this optimizer's step is traced here (the CPU; a step fake tensors run)."""
        if self.base is None:
            return False
        if bf16_update == "nearest":
            return optimizer in TRACED_OPTIMIZERS
        module = BF16_UPDATE_PACKAGES.get(bf16_update)
        trained = [p for p in self.base.model.parameters() if p.requires_grad]
        bf16 = bool(trained) and all(p.dtype == torch.bfloat16 for p in trained)
        return optimizer == "adamw" and bf16 and module is not None and compat.importable(module)

    def step(self, optimizer: str, bf16_update: str = "nearest") -> StepBytes:
        """The optimizer's steady-state step, traced on the kept models (cached)."""
        name = step_name(optimizer, bf16_update)
        if name not in self._steps:
            assert self.base is not None
            base = _trace_optimizer(optimizer, self.base, bf16_update)
            ups = [(_trace_optimizer(optimizer, kept, bf16_update), x) for kept, x in self.lines]

            def line(f: str) -> int:
                v0 = getattr(base, f)
                return v0 + sum((getattr(v1, f) - v0) * x for v1, x in ups)

            self._steps[name] = StepBytes(*(line(f) for f in StepBytes.__dataclass_fields__))
        return self._steps[name]


@functools.lru_cache(maxsize=256)
def _trace_cached(key, b, s, precision, gc, attn, accum, device_type, lora_r, lora_targets, half,
                  offload, dora=False):  # fmt: skip
    config = load_config(json.loads(key))
    setting = (b, s, precision, gc, attn, accum, device_type, lora_r, lora_targets, half, offload,
               dora)  # fmt: skip
    plan = layer_plan(config)
    if plan is None:
        traced, _, kept = _trace(config, *setting)
        return TraceSet(traced, kept, [])
    small, plus = plan
    base, base_moments, base_kept = _trace(_with_layers(config, small), *setting)
    lines, kept_lines = [], []
    for kind, types in plus.items():
        one_more, moments, kept = _trace(_with_layers(config, types), *setting)
        extra = _count(config, kind) - small.count(kind)  # the full model's other layers
        lines.append((one_more, moments, extra))
        kept_lines.append((kept, extra))
    traced = _extrapolate(base, base_moments, lines, config.num_hidden_layers)
    return TraceSet(traced, base_kept, kept_lines if base_kept else [])


# Config fields that make one layer unlike another (a dense layer among experts, ...): a
# model with any of them set is traced at its full depth.
UNEQUAL_LAYER_FIELDS = ("first_k_dense_replace", "mlp_only_layers", "moe_layer_freq",
                        "decoder_sparse_step", "dense_layers", "layers_block_type")  # fmt: skip
SMALLEST_EXTRAPOLATED = 6  # shallower models are traced whole
_LAYER = "layer"  # the one kind of layer of a config without layer_types


def layer_plan(config) -> tuple[list[str], dict[str, list[str]]] | None:
    """How to trace ``config`` shallow: the small model's layer kinds and, per kind, the small
    model plus one layer of that kind. None: trace the whole model.

    transformers builds every layer of a kind (``layer_types``: sliding or full attention;
    one kind without them) from one class and one config, so layers of a kind hold the same
    tensors, and at every moment of the step a model holds an amount that is a sum over its
    layers before and after that moment: one more layer of a kind adds the same to it
    wherever the moment is. So a small model with the full model's first and last layer
    kinds (and every other kind once), plus one trace per kind with one more such layer,
    give every moment's line. The exceptions are read from the config: fields that make
    some layers dense and others experts (``UNEQUAL_LAYER_FIELDS``) and per-layer lists
    other than ``layer_types``. tests/test_traced.py checks the lines against whole traces.
    """
    n = getattr(config, "num_hidden_layers", None)
    if not n or n < SMALLEST_EXTRAPOLATED:
        return None
    for name in UNEQUAL_LAYER_FIELDS:
        if getattr(config, name, None) not in (None, 0, 1, [], ()):
            return None
    for name, value in config.to_dict().items():
        per_layer = isinstance(value, (list, tuple)) and len(value) == n and name != "layer_types"
        if per_layer and len({json.dumps(v) for v in value}) > 1:
            return None
    types = list(getattr(config, "layer_types", None) or [_LAYER] * n)
    middle = [t for t in dict.fromkeys(types) if t not in (types[0], types[-1])]
    small = [types[0], *middle, types[-1]]
    if len(small) + len(set(types)) >= n:  # no cheaper than the whole model
        return None
    plus = {kind: [*small[:-1], kind, small[-1]] for kind in dict.fromkeys(types)}
    return small, plus


def _count(config, kind: str) -> int:
    types = getattr(config, "layer_types", None)
    return config.num_hidden_layers if not types else list(types).count(kind)


def _with_layers(config, kinds: list[str]):
    """A copy of ``config`` with these layers (kinds as in ``layer_types``)."""
    small = copy.deepcopy(config)
    small.num_hidden_layers = len(kinds)
    if getattr(config, "layer_types", None):
        small.layer_types = list(kinds)
    return small


def _trace(config, b, s, precision, gc, attn, accum, device_type, lora_r, lora_targets, half,
           offload, dora=False):  # fmt: skip
    """Trace ``config`` whole: what it held (``Traced``) and its maxima per moment.

    ``gc``: "" (no checkpointing) or the checkpoint policy; ``offload``: the forward's saved
    tensors offloaded to the host."""
    kind = task_kind(config)
    cuda = device_type == "cuda"
    mode = FakeTensorMode()
    with quiet_libraries(), mode, _as_a_real_run():
        model = build_model(config, attn, dtype=torch.bfloat16 if half else torch.float32)
        layers = _layers_name(model, config.num_hidden_layers)
        semantics = CudaSemantics(precision != "fp32") if cuda else None
        if gc:
            enable_checkpointing(model, context_fn=_checkpoint_contexts(gc, semantics))
        if lora_r:
            # peft deep-copies a classifier's head to train it; FakeCopyMode keeps the copy's
            # fresh tensors in this fake mode (a plain deepcopy makes them in another one).
            with FakeCopyMode(mode):
                model = apply_lora(model, lora_r, lora_targets, dora=dora)
        model.train()
        compat.skip_idle_layerdrop(model)  # older transformers draw a number per layer
        batch = random_batch(kind, b, s, config.vocab_size)
        tracker = _MomentTracker(model, layers, config.num_hidden_layers, cuda)
        tracker.track_external(model)
        at_step = _NoStep(tracker)
        with (
            dora_graphs_collected(model),  # as measure() tracks a DoRA step
            tracker,
            semantics or contextlib.nullcontext(),
        ):  # the course's step; TraceSet.step traces an optimizer's on the kept model
            train_step(model, at_step, (batch for _ in range(accum)), accumulate=accum,
                       precision=precision, loss_of=_loss_of(offload, cuda))  # fmt: skip
        peaks = tracker.peaks()
    # On CUDA the optimizers run foreach kernels and keep step counters on the host:
    # helpers.estimator.state accounts for that from PyTorch's sources instead. On the CPU
    # the fake model is kept, and TraceSet.step traces an optimizer's step on it when asked.
    kept = None if cuda else _Kept(model, mode, at_step.leftovers)
    traced = Traced(
        params=peaks.params,
        buffers=peaks.buffers,
        gradients=peaks.gradients,
        activations=peaks.activations,
        temporaries=peaks.temporaries,
        weight_copies=peaks.weight_copies,
        peak=peaks.peak,
        peak_at=tracker.peak_where,
        leftovers=at_step.leftovers,
        steps={},
        moments=tuple(tracker.moments.items()),
    )
    return traced, tracker.moments, kept


def _checkpoint_contexts(policy: str, semantics: CudaSemantics | None):
    """The trace's ``context_fn`` for ``torch.utils.checkpoint``: the policy's contexts (None:
    torch's default), with CUDA's semantics around the recomputation, which runs in backward,
    outside the modes this thread entered for the forward."""
    if policy == "full" and semantics is None:
        return None

    def contexts():
        if policy == "selective":
            forward, recompute = selective_context_fn()()
        else:
            forward, recompute = contextlib.nullcontext(), contextlib.nullcontext()
        return forward, recompute if semantics is None else _entered(recompute, semantics)

    return contexts


@contextlib.contextmanager
def _entered(*contexts):
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


def _loss_of(offload: bool, cuda: bool):
    """The traced step's loss: the model's own; offloaded, as ``RunConfig`` runs it on the
    CPU (``save_on_cpu``, which moves nothing there) or as it runs on CUDA (``_offload_hooks``)."""
    if not offload:
        return model_loss
    if not cuda:
        return offloaded(model_loss, torch.device("cpu"))

    def loss_of(model, batch):
        with torch.autograd.graph.saved_tensors_hooks(*_offload_hooks()):
            return model_loss(model, batch)

    return loss_of


def _offload_hooks():
    """``save_on_cpu`` as a CUDA step runs it, on fake CPU tensors: pack copies every saved
    tensor to the host (here the ``meta`` device, which the tracker does not count) and the
    device's tensor is freed once the forward lets go of it; unpack copies it back to the
    device for the backward node that needs it (a parameter too: ``save_on_cpu`` packs
    whatever autograd saves). torch/autograd/graph.py, ``save_on_cpu``."""

    def pack(t: torch.Tensor):
        return t.device, t.to("meta")

    def unpack(packed) -> torch.Tensor:
        device, host = packed
        return host.to(device)

    return pack, unpack


def _layers_name(model, n: int) -> str | None:
    """The qualified name of ``model``'s list of ``n`` layers (``model.layers``, ``h``...)."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n and name:
            return name
    return None


MOMENT_FIELDS = ("params", "buffers", "gradients", "activations", "temporaries",
                 "weight_copies", "total")  # fmt: skip


class _MomentTracker(CategoryTracker):
    """The course's tracker, also keeping each category's maximum per *moment*.

    A moment is the phase, the micro-batch, the layer running (as its role: the first or
    the last; middle layers are never the largest, as what is held grows or shrinks
    steadily along the layers) and, between layers, the role of the last layer seen. Every
    allocation within one moment of a deeper model holds more by the same amount (the
    layers before it or after it), which is the line ``_extrapolate`` follows.
    """

    def __init__(self, root, layers: str | None, depth: int, cuda: bool) -> None:
        super().__init__(device=torch.device("cpu"), module_peaks=False, cuda_storages=cuda)
        self.root, self.depth = root, depth
        # The layer modules themselves: in backward, torch's ModTracker leaves some finished
        # submodules (self_attn) among the parents, never a finished layer.
        self.layer_re = re.compile(re.escape(layers) + r"\.(\d+)$") if layers else None
        self.moments: dict[tuple, dict[str, int]] = {}
        self._micro = 0
        self._last_role = ""

    def on_forward(self, module) -> None:
        if module is self.root:
            self._micro += 1

    def on_count(self, snap) -> None:
        row = {name: snap[reftype] for reftype, name in CATEGORY.items() if name in MOMENT_FIELDS}
        row["weight_copies"], row["total"] = self.weight_copies_alive, snap["Total"]
        key = self._moment()
        old = self.moments.get(key)
        self.moments[key] = row if old is None else {k: max(v, old[k]) for k, v in row.items()}

    def _moment(self) -> tuple:
        if self.in_optimizer_step:
            return ("optimizer step", 0, "", "")
        running = self.current_modules()
        roles = {self._role(int(m.group(1))) for p in running if (m := self._layer(p))}
        role = roles.pop() if len(roles) == 1 else "middle" if roles else ""
        self._last_role = role or self._last_role
        return ("backward" if self.in_backward else "forward", self._micro, role, self._last_role)

    def _layer(self, fqn: str):
        return self.layer_re.search(fqn) if self.layer_re else None

    def _role(self, i: int) -> str:
        return "first" if i == 0 else "last" if i == self.depth - 1 else "middle"


def _extrapolate(base: Traced, m0: dict, lines: list, n: int) -> Traced:
    """The full model from the small one (``base``, ``m0``) and, per layer kind, the small one
    with one more such layer and how many more the full model has: every moment on its line."""
    keys = {k for k in m0 if "middle" not in k}
    for _, moments, _ in lines:
        if {k for k in moments if "middle" not in k} != keys:
            raise RuntimeError("a deeper trace has other moments: the layers are not alike")

    def line(v0: int, ups) -> int:  # ups: (value with one more layer, how many more)
        return v0 + sum((v1 - v0) * extra for v1, extra in ups)

    rows = {
        k: {f: line(m0[k][f], [(m[k][f], extra) for _, m, extra in lines]) for f in MOMENT_FIELDS}
        for k in keys
    }
    top = max(rows, key=lambda k: rows[k]["total"])
    return Traced(
        **{f: max(r[f] for r in rows.values()) for f in MOMENT_FIELDS if f != "total"},
        peak=rows[top]["total"],
        peak_at=_moment_name(top, n),
        leftovers=line(base.leftovers, [(t.leftovers, x) for t, _, x in lines]),
        steps={},
        moments=tuple(rows.items()),
    )


def _moment_name(key: tuple, n: int) -> str:
    """A moment as the tracker's ``peak_where`` says it, for a model of ``n`` layers."""
    phase, _, role, last = key
    if phase == "optimizer step":
        return phase
    where = {"first": "layer 0", "last": f"layer {n - 1}"}
    return f"{phase}: {where[role] if role else 'after ' + where[last] if last else 'model'}"


def _trace_optimizer(name: str, kept: _Kept, bf16_update: str = "nearest") -> StepBytes:
    """One steady-state step of optimizer ``name`` over a kept model's fake gradients, tracked.

    A first, untracked step creates the state, as the warm-up step of a real run does. The
    kept ``leftovers`` are the bytes the training step still held besides the model state
    when it called ``optimizer.step()`` (its loss tensors).
    """
    with quiet_libraries(), kept.mode:
        optimizer = make_optimizer(name, kept.model, bf16_update=bf16_update)
        optimizer.step()
        tracker = CategoryTracker(device=torch.device("cpu"), module_peaks=False)
        tracker.track_external(kept.model, optimizer)
        with tracker:
            optimizer.step()
        peaks = tracker.peaks()
        del optimizer
    return StepBytes(peaks.optimizer_state, peaks.temporaries, peaks.peak + kept.leftovers)


class _NoStep:
    """In place of the optimizer: notes what the step holds besides the model state when the
    optimizer would run (its loss tensors), and leaves the gradients for it."""

    def __init__(self, tracker) -> None:
        self.tracker = tracker
        self.leftovers = 0

    def step(self) -> None:
        now = self.tracker.current()
        self.leftovers = now["total"] - now["params"] - now["buffers"] - now["gradients"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


@contextlib.contextmanager
def _cpu_grouped_mm():
    """Fake tensors follow the CPU's grouped matmul (MoE experts), which takes fp32 inputs.

    ``aten._grouped_mm``'s meta function checks CUDA's rule (bf16 only); the CPU kernel that
    a real run on this machine uses also multiplies fp32, with an output of the same shape.
    """
    original = torch_meta._meta_grouped_mm_common

    def common(mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None,
               out_dtype=None, *args, **kwargs):  # fmt: skip
        if scale_a is None and mat_a.dtype == mat_b.dtype == torch.float32:
            return torch_meta._create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
        return original(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype,
                        *args, **kwargs)  # fmt: skip

    torch_meta._meta_grouped_mm_common = common
    try:
        yield
    finally:
        torch_meta._meta_grouped_mm_common = original


@contextlib.contextmanager
def _as_a_real_run():
    """Every rule below at once: the answers that make a trace take a real run's path."""
    with _moves_within_cpu_skipped(), _never_packed(), _no_padding(), _cpu_grouped_mm():
        yield


@contextlib.contextmanager
def _never_packed():
    """transformers' answer for the course's batches: no packed sequences.

    With no attention mask, transformers reads the position ids to detect several sequences
    packed in one row; a fake tensor cannot be read, so it assumes packing and builds a full
    s x s mask that a real run of the same batch never builds (SDPA would get ``is_causal``).
    Every row of these batches is one sequence (positions 0..s-1), which is what the check
    finds on real tensors.
    """
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


@contextlib.contextmanager
def _no_padding():
    """transformers' answer for the course's batches: no padding, so SDPA may use ``is_causal``.

    Where a model passes an attention mask of ones (OPT builds one itself before transformers
    5.2x), transformers asks whether every position is kept before it drops the mask; a fake
    tensor cannot answer, so it builds the b x s x s mask that a real run of the same batch
    never builds. The course's batches have no padding: the answer on real tensors is yes.
    """

    def unpadded(original):
        def ask(padding_mask, *args, **kwargs):
            return original(None if isinstance(padding_mask, FakeTensor) else padding_mask,
                            *args, **kwargs)  # fmt: skip

        return ask

    names = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa")
    originals = {n: getattr(masking_utils, n) for n in names if hasattr(masking_utils, n)}
    for name, original in originals.items():
        setattr(masking_utils, name, unpadded(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(masking_utils, name, original)


@contextlib.contextmanager
def _moves_within_cpu_skipped():
    """``Module.to`` within the CPU does nothing while tracing.

    A module of fake tensors cannot ``.to()`` itself (``_apply`` swaps every FakeTensor
    parameter, and the swap fails). The only moves in a trace are peft's: each new adapter
    goes to its base layer's device and dtype, then back to fp32 (``autocast_adapter_dtype``,
    peft's default), which is where it already is.
    """
    original = torch.nn.Module.to

    def to(self, *args, **kwargs):
        device, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if device is None or device.type == "cpu":
            return self
        return original(self, *args, **kwargs)

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original
