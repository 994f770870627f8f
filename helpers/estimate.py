"""Predict the memory of a training step, category by category, without building the weights.

``estimate(...)`` returns the categories ``helpers.train.measure`` reports (the
``helpers.memory.CategoryTracker`` contract): each category's own largest size during one
steady-state step, and ``peak``, the largest total alive at one moment. The model is built on
PyTorch's ``meta`` device only (shapes, no storage), so a 7B config costs nothing; the rest is
arithmetic, derived from what PyTorch and these transformers implementations keep.

Model state (exact)
    params = 4 B x n_params (fp32 weights, the master copy under autocast too); gradients =
    4 B per trainable parameter; optimizer state per tensor of n numbers: AdamW 8n + 4
    (exp_avg, exp_avg_sq, a 0-dim fp32 step), SGD-momentum 4n, torch's Adafactor 4(r + c) + 4
    per r x c matrix (factored second moment, times any leading dims) and 4n + 4 per vector,
    bitsandbytes' 8-bit AdamW 2n + 8 ceil(n/256) (two uint8 states, one fp32 absmax per block
    of 256) plus two shared 256-entry fp32 quantisation maps, except tensors under
    min_8bit_size = 4096 numbers and nn.Embedding weights (make_optimizer's override), which
    keep two fp32 states (8n). ``training_state`` does the same from parameter counts alone.

Activations: from the paper to these implementations
    Korthikanti et al. (2022) count s·b·h·(34 + 5·a·s/h) bytes per transformer layer in 16
    bits with 1-byte dropout masks: 34 sbh = 8 kept (s, b, h) tensors x 2 B (QKV input, Q, K,
    V, attention-output input, MLP input, two LayerNorm inputs) + 2 kept (s, b, 4h) MLP tensors
    x 2 B + 2 dropout masks x 1 B; 5as²b = softmax output (2) + dropout mask (1) + dropout
    output (2) per attention score. We keep this bookkeeping, tensor by tensor, but count what
    each op of modeling_bert.py / modeling_llama.py / modeling_mixtral.py saves for backward
    (checked against the tracker). With T = b·s tokens, e = 4 B (fp32) or 2 B (autocast):

    BERT layer = T·h·(4 [input] | 3x2 [q, k, v each cast their input])
                 + 3·T·h·e [q, k, v contiguous copies made by matmul] + T·h·e [context]
                 + 2 x (T·h·m [dropout mask] + T·h·4 [fp32 residual sum] + 8T [LN mean, 1/std])
                 + T·h·(4 | 2) [MLP input] + 2·T·I·e [GELU input, output]
                 + a·s²·b·(e + m + e) [probabilities, dropout mask, dropped probabilities]
    Llama layer = 2 x (T·h·4 [fp32 residual input] + T·h·4 [normalised] + 4T [1/rms])
                 + T·h·(4 | 3x2) [q, k, v input] + T·h·(4 | 2x2) [gate, up input]
                 + 3·T·a·d·e [q, and k, v repeated to all heads] + T·a·d·e [context]
                 + 4·T·I·e [gate, SiLU(gate), up, product] + a·s²·b·(4 | 4 + 2) [fp32 softmax,
                 its 16-bit copy] (+ 2·T·kv·d·4 fp32 KV cache, alive to the end of forward)
    where m, the dropout mask, is a float tensor of the input's dtype on the CPU (e) and a
    1-byte bool on CUDA. Why it is more than 34 sbh: the residual stream stays fp32 under
    autocast (embeddings, LayerNorm/RMSNorm, residual sums), autocast keeps one 16-bit copy of
    an input per Linear that reads it (q, k and v each), RMSNorm keeps its normalised input,
    RoPE runs in fp32 so Q and K come out fp32, and SwiGLU keeps 4 intermediate tensors, not 2.
    SDPA replaces the a·s²·b terms with its output and a log-sum-exp (4 B per head and token),
    except on the CPU with attention dropout (BERT), where it falls back to the math kernel,
    which keeps what eager keeps, in fp32. Mixtral's MoE keeps the router's fp32 softmax and
    k routed copies of each token through the experts' grouped matmuls, which stay fp32 even
    under autocast. The head keeps the logits (held by the model output) and the loss's fp32
    log-softmax, 4 B x T x vocab, often the largest single tensor of the step.

Temporaries and the peak
    The step is simulated in stages (embeddings, each layer's attention and MLP, head, loss):
    forward piles up each stage's saved tensors; autocast's 16-bit weight copies are cached
    until forward ends and then kept by the matmuls that saved them; backward frees the
    stages in reverse while gradient temporaries (incoming and outgoing activation gradients,
    one weight gradient in flight) come and go and parameter gradients accumulate; the
    optimizer step then holds every gradient plus its scratch tensors (CPU AdamW: sqrt and
    quotient of the tensor being updated plus the previous tensor's denominator; Adafactor:
    the rebuilt second moment of this and the previous tensor; 8-bit AdamW allocates inside a
    custom op the tracker cannot see, and fuses everything on CUDA). Gradient checkpointing
    keeps only each layer's input and recomputes one layer at a time in backward; gradient
    accumulation keeps every gradient alive through later micro-batches. The peak is the
    largest of these moments and ``peak_at`` names it ("backward: loss", "optimizer step"...).

LoRA (``lora_r`` > 0, the adapters peft's ``get_peft_model`` adds: ``helpers.models.apply_lora``)
    The model is wrapped by peft on the meta device too, so the adapters are real tensors of
    the model and every frozen weight is marked not trainable: params = 4 B x (base +
    adapters), and gradients, optimizer state and optimizer scratch count the adapters only
    (exact). Each adapter keeps its A's output (T·r·e) for B's weight gradient. Everything
    else keeps the full fine-tuning account above, with autocast copies of frozen weights
    counted like trainable ones, which makes activations and peak an upper bound for LoRA:
    a frozen Linear needs its weight, not its input, for the input gradient, so layers
    without an adapter (and every layer before the first adapter, whose input needs no
    gradient at all) save less than in full fine-tuning. The bound is measured in
    tests/test_peft_lora.py and lesson 13.

The tracker's own conventions are followed (tensors recomputed outside a submodule, like
Llama's residual sums, are temporaries; a tied weight's first gradient stays a temporary until
the embedding adds its own; the batch is not tracked). Only CPU behaviour is checked against
measurements here (tests/test_estimate.py); the CUDA branches (bool dropout masks, fp32
softmax under autocast, fused SDPA, foreach optimizers) follow PyTorch's sources, unmeasured.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

import torch

from helpers.device import allocation_bytes
from helpers.models import load_config, task_kind
from helpers.names import ATTENTION, AUTOCAST, OPTIMIZERS, PRECISION_BYTES
from helpers.optimizer_state import BNB_BLOCK, state_tensors, tracked_bytes

FP32 = 4
INT64 = 8

DECODERS = ("llama", "mistral", "qwen2")
MOE = ("mixtral",)
ENCODERS = ("bert",)
SUPPORTED = ENCODERS + DECODERS + MOE


# --------------------------------------------------------------------------------------------
# The model's tensors, from a meta-device build


@dataclass(frozen=True)
class ParamInfo:
    """One parameter tensor: where it lives in the step and how optimizers and autocast see it."""

    name: str
    shape: tuple[int, ...]
    stage: str  # "embed" | "L{i}.attn" | "L{i}.mlp" | "head"
    embedding: bool = False  # an nn.Embedding weight (8-bit AdamW keeps it 32-bit)
    cast: bool = False  # enters an autocast matmul as a Parameter: gets a cached 16-bit copy
    trainable: bool = True

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelInfo:
    """What the estimator needs to know about a model: its config and its parameter tensors."""

    model_type: str
    family: str  # "encoder" | "decoder" | "moe"
    config: dict
    params: tuple[ParamInfo, ...]  # in model.parameters() order (the optimizer's order)
    buffer_sizes: tuple[int, ...]  # bytes of each buffer (position ids, rotary frequencies...)
    tied: bool  # the LM head shares the input embedding's weight

    @property
    def buffer_bytes(self) -> int:
        """Bytes of all buffers."""
        return sum(self.buffer_sizes)

    @property
    def n_params(self) -> int:
        """Distinct parameters (tied weights once), as ``helpers.models.count_params``."""
        return sum(p.numel for p in self.params)

    @property
    def n_trainable(self) -> int:
        """Parameters that get gradients and optimizer state."""
        return sum(p.numel for p in self.params if p.trainable)

    def numel_named(self, stage: str, *parts: str) -> int:
        """Trainable numbers in ``stage`` whose names contain one of ``parts``."""
        return sum(
            p.numel
            for p in self.params
            if p.stage == stage and p.trainable and any(x in p.name for x in parts)
        )

    def stage_numel(self, stage: str, cast_only: bool = False) -> int:
        """Trainable numbers in ``stage``; with ``cast_only``, the autocast-cast ones, frozen too.

        Autocast makes a 16-bit copy of every weight that enters a matmul, trainable or not.
        """
        return sum(
            p.numel
            for p in self.params
            if p.stage == stage and (p.cast if cast_only else p.trainable)
        )


_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h)\.(\d+)\.(.*)$")
_ATTN_PARTS = ("self_attn", "attention", "input_layernorm", "attn", "ln_1")


def _family(model_type: str) -> str:
    if model_type in ENCODERS:
        return "encoder"
    if model_type in DECODERS:
        return "decoder"
    if model_type in MOE:
        return "moe"
    raise ValueError(
        f"no activation model for model_type {model_type!r}: the estimator knows "
        f"{', '.join(SUPPORTED)}"
    )


def describe_model(
    model, attn: str = "eager", lora_r: int = 0, lora_targets: str = ""
) -> ModelInfo:
    """Build ``model`` (name, path, dict or config) on the meta device and list its tensors.

    With ``lora_r`` > 0 peft adds LoRA adapters of that rank to ``lora_targets`` (as
    ``RunConfig.lora_targets``) and freezes everything else, as ``helpers.train.Trainee`` does.
    """
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        PretrainedConfig,
    )

    if isinstance(model, ModelInfo):
        return model
    config = model if isinstance(model, PretrainedConfig) else load_config(model)
    family = _family(config.model_type)
    auto = (
        AutoModelForSequenceClassification
        if task_kind(config) == "classify"
        else AutoModelForCausalLM
    )
    with torch.device("meta"):
        net = auto.from_config(config, attn_implementation=attn, dtype=torch.float32)
        if lora_r:
            from helpers.models import apply_lora

            net = apply_lora(net, lora_r, lora_targets)
    owner = {}  # the first module that holds each parameter (for a tied weight: the embedding)
    for mod in net.modules():
        for p in mod.parameters(recurse=False):
            owner.setdefault(id(p), mod)
    params, seen_layer = [], False
    for name, p in net.named_parameters():
        mod = owner[id(p)]
        match = _LAYER.search(name)
        if match:
            seen_layer = True
            part = "attn" if match.group(2).startswith(_ATTN_PARTS) else "mlp"
            stage = f"L{match.group(1)}.{part}"
        else:
            stage = "head" if seen_layer else "embed"
        is_embedding = isinstance(mod, torch.nn.Embedding)
        linear = isinstance(mod, torch.nn.Linear) or type(mod).__name__ == "Conv1D"
        cast = linear or (not is_embedding and p.dim() == 2)
        params.append(ParamInfo(name, tuple(p.shape), stage, is_embedding, cast, p.requires_grad))
    out_emb, in_emb = net.get_output_embeddings(), net.get_input_embeddings()
    tied = out_emb is not None and out_emb.weight is in_emb.weight
    buffers = tuple(b.numel() * b.element_size() for b in net.buffers())
    return ModelInfo(
        model_type=config.model_type,
        family=family,
        config={**config.to_dict(), "_experts_implementation": _experts_impl(net)},
        params=tuple(params),
        buffer_sizes=buffers,
        tied=tied,
    )


def _experts_impl(net) -> str | None:
    return getattr(net.config, "_experts_implementation", None)


# --------------------------------------------------------------------------------------------
# Parameters, gradients and optimizer state


@dataclass
class TrainingState:
    """Bytes of the model state: weights, gradients, optimizer state (no activations)."""

    params: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        """Sum of the three."""
        return self.params + self.gradients + self.optimizer_state


def training_state(
    n_params: int,
    n_trainable: int | None = None,
    optimizer: str = "adamw",
    weight_bytes: int = FP32,
    master_copy: bool = False,
    n_tensors: int = 0,
) -> TrainingState:
    """Model-state bytes from parameter counts alone (frozen weights get no grads or state).

    Per trainable parameter: AdamW 8 B, SGD-momentum 4 B, 8-bit AdamW 2 B + 8 B per 256 (its
    absmax blocks, ignoring its fp32 small tensors); Adafactor depends on tensor shapes, use
    ``optimizer_state_bytes``. ``master_copy`` adds the 4 B fp32 master weight that mixed
    precision keeps when the weights themselves are 16-bit (``weight_bytes=2``): with it,
    AdamW is the seed's 12 B per trainable parameter (84 GB for 7B, 2.4 GB for 0.2B of LoRA).
    ``n_tensors`` adds AdamW's 4-byte step per trainable tensor.
    """
    n_trainable = n_params if n_trainable is None else n_trainable
    per = {"adamw": 8.0, "sgd": 4.0, "adamw8bit": 2.0 + 2 * FP32 / BNB_BLOCK}
    if optimizer == "adafactor":
        raise ValueError("Adafactor's state depends on tensor shapes: use optimizer_state_bytes")
    if optimizer not in per:
        raise ValueError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    state = per[optimizer] * n_trainable + (FP32 * n_tensors if optimizer == "adamw" else 0)
    if master_copy:
        state += FP32 * n_trainable
    return TrainingState(
        params=int(weight_bytes * n_params),
        gradients=int(weight_bytes * n_trainable),
        optimizer_state=round(state),
    )


def optimizer_state_bytes(optimizer: str, params, device_type: str = "cpu") -> int:
    """Exact optimizer-state bytes for ``params`` (ParamInfo, or anything with shape/numel).

    The per-optimizer rules are ``helpers.optimizer_state.state_tensors`` (lesson 06 checks them
    tensor by tensor against real optimizers). On CUDA the bytes are the tracker's: each
    tensor rounded up to 512 B, and torch's step counters left out (they live on the CPU).
    """
    rows = state_tensors(params, optimizer, device_type)
    return tracked_bytes(rows, torch.device(device_type))


def optimizer_step_temporaries(optimizer: str, params, device_type: str = "cpu") -> int:
    """Largest scratch memory the optimizer's step allocates, as the tracker sees it."""
    sizes = [FP32 * math.prod(p.shape) for p in params if getattr(p, "trainable", True)]
    if not sizes or optimizer in ("sgd", "adamw8bit"):
        # SGD updates in place. 8-bit AdamW: fused CUDA kernels; on the CPU its kernel is a
        # custom op whose scratch tensors the tracker cannot see.
        return 0
    trainable = [p for p in params if getattr(p, "trainable", True)]
    if device_type != "cpu":  # foreach implementations: one scratch list over all tensors
        if optimizer == "adamw":
            return sum(sizes)  # exp_avg_sq.sqrt() for every tensor at once
        matrices = sum(n for n, p in zip(sizes, trainable, strict=True) if len(p.shape) >= 2)
        return max(matrices, 2 * (sum(sizes) - matrices))  # var_estimates; vectors: 2 lists
    worst, previous = 0, 0
    for p, size in zip(trainable, sizes, strict=True):
        if optimizer == "adamw":
            # denom = (exp_avg_sq.sqrt() / c).add_(eps): sqrt and quotient coexist, and the
            # previous tensor's denom is still referenced by the loop variable.
            worst = max(worst, 2 * size + previous)
        else:  # adafactor
            if len(p.shape) >= 2:
                *lead, rows, cols = p.shape
                means = FP32 * math.prod(lead) * (rows + cols)
                worst = max(worst, size + previous + means)  # row_var @ col_var, previous one
            else:
                worst = max(worst, 2 * size + previous)  # grad*grad and variance.clone()
        previous = size
    return worst


# --------------------------------------------------------------------------------------------
# Activations: the step as stages


@dataclass
class Moment:
    """One moment of a stage's backward: gradient temporaries alive, and what is already gone."""

    temp: int  # gradient temporaries alive (incoming/outgoing activation grads, weight grad)
    released: int = 0  # bytes of this stage's saved tensors already freed
    grads_done: int = 0  # bytes of this stage's parameter gradients already complete
    copies_released: int = 0  # bytes of this stage's 16-bit weight copies already freed


@dataclass
class Stage:
    """A piece of the step whose saved tensors live and die together."""

    name: str
    saved: dict[str, int] = field(default_factory=dict)  # kept for this stage's backward
    forward_only: dict[str, int] = field(default_factory=dict)  # alive to the end of forward
    transient: dict[str, int] = field(default_factory=dict)  # alive at this stage's forward end
    backward: list[Moment] = field(default_factory=list)
    grads: int = 0  # parameter-gradient bytes this stage leaves when its backward is done
    copies: int = 0  # autocast 16-bit weight copies created here
    region: int | None = None  # checkpointed layer this stage belongs to (None: not checkpointed)
    checkpoint_input: int = 0  # what the checkpoint keeps in forward (first stage of a region)
    input_in_saved: bool = True  # the checkpoint input is also one of ``saved`` (same storage)
    recompute_temp: int = 0  # saved bytes the tracker labels temporaries when recomputed
    recompute_transient: int = 0  # alive at the end of recomputing this (last) stage
    pending_grads: int = 0  # gradient bytes labelled temporaries until the embedding's backward


def _mask(elem: int, device_type: str) -> int:
    """Bytes per element of a dropout mask: CPU keeps a float tensor, CUDA a bool one."""
    return 1 if device_type == "cuda" else elem


@dataclass(frozen=True)
class _Shape:
    """The sizes every formula uses."""

    b: int
    s: int
    ea: int  # bytes of matmul outputs: 4 in fp32, 2 under autocast
    amp: bool
    dev: str  # device type

    @property
    def t(self) -> int:
        """Tokens in the micro-batch."""
        return self.b * self.s


def _weight_grad(numel: int, z: _Shape) -> int:
    """A weight gradient as its matmul produces it (16-bit under autocast, cast to fp32 later)."""
    return numel * z.ea


def _cast_moment(
    grad_stream: int, numel: int, z: _Shape, before: Moment, copy: int
) -> list[Moment]:
    """Under autocast, the moment a 16-bit weight gradient is cast to fp32 for the fp32 weight.

    The matmul's backward node has finished, so the weight's 16-bit copy (``copy`` bytes) is
    already freed; its input gradient (part of ``grad_stream``) is alive.
    """
    if not z.amp:
        return []
    return [
        Moment(
            grad_stream + numel * (2 + FP32),
            before.released,
            before.grads_done,
            before.copies_released + copy,
        )
    ]


@dataclass(frozen=True)
class _Sizes:
    """A config's sizes for one step's shape, what every block builder reads."""

    m: ModelInfo
    z: _Shape
    gc: bool  # gradient checkpointing
    h: int  # hidden size
    a: int  # attention heads

    @property
    def th(self) -> int:
        """Values in one hidden-sized activation."""
        return self.z.t * self.h

    @property
    def g(self) -> int:
        """The residual stream's gradient, fp32, alive through each layer's backward."""
        return FP32 * self.th

    @property
    def scores(self) -> int:
        """Values in one attention-score tensor (b, a, s, s)."""
        return self.z.b * self.a * self.z.s * self.z.s


@dataclass(frozen=True)
class _Bert(_Sizes):
    """A BERT config's sizes: what each encoder block builder reads."""

    inter: int
    layers: int
    labels: int
    p_hidden: float
    p_attn: float
    p_cls: float
    es: int  # bytes per attention probability
    eq: int  # bytes per q/k/v copy kept by the score matmuls
    math_sdpa: bool  # SDPA falls back to its math kernel (CPU, attention dropout)
    fused: bool  # SDPA with a fused kernel: no a·s² tensor kept


def _bert(m: ModelInfo, z: _Shape, attn: str, gc: bool) -> _Bert:
    """The sizes of ``m`` (a BERT config) that the encoder's block builders need."""
    c = m.config
    p_hidden, p_attn = c.get("hidden_dropout_prob", 0.0), c.get("attention_probs_dropout_prob", 0.0)
    # Attention probabilities: CPU autocast runs softmax in 16 bits, CUDA autocast in fp32.
    es = FP32 if (z.amp and z.dev == "cuda") else z.ea
    eq = z.ea
    # SDPA keeps no a·s^2 tensor, except on the CPU with dropout: there it runs the math
    # kernel, which keeps what eager keeps but computes in fp32 (it upcasts 16-bit inputs).
    math_sdpa = attn == "sdpa" and z.dev == "cpu" and p_attn > 0
    if math_sdpa:
        es = eq = FP32
    return _Bert(
        m=m, z=z, gc=gc, h=c["hidden_size"], a=c["num_attention_heads"],
        inter=c["intermediate_size"], layers=c["num_hidden_layers"],
        labels=len(c.get("id2label") or {}) or c.get("num_labels") or 2,
        p_hidden=p_hidden, p_attn=p_attn, p_cls=c.get("classifier_dropout") or p_hidden,
        es=es, eq=eq, math_sdpa=math_sdpa, fused=attn == "sdpa" and not math_sdpa,
    )  # fmt: skip


def _encoder_stages(m: ModelInfo, z: _Shape, attn: str, gc: bool) -> list[Stage]:
    """BERT (BertForSequenceClassification) as stages, following modeling_bert.py."""
    x = _bert(m, z, attn, gc)
    stages = [_bert_embed(x)]
    for i in range(x.layers):
        at, mlp = _bert_attention(x, i), _bert_mlp(x, i)
        if gc:
            at.region = mlp.region = i
            at.checkpoint_input = FP32 * x.th
            at.input_in_saved = not z.amp  # under autocast the layer keeps 16-bit casts instead
            # At the end of a recomputation the layer's LayerNorm output and the dropout result
            # that feeds it are alive (and under autocast the attention LayerNorm output, the
            # residual, that no one saves); the recomputed output itself is then dropped.
            mlp.recompute_transient = FP32 * x.th + z.ea * x.th + (FP32 * x.th if z.amp else 0)
        stages += [at, mlp]
    return [*stages, *_bert_head_and_loss(x)]


def _bert_embed(x: _Bert) -> Stage:
    """Word, position and token-type embeddings, summed, LayerNorm, dropout."""
    c, th, t = x.m.config, x.th, x.z.t
    emb = Stage("embed", grads=FP32 * x.m.stage_numel("embed"))
    emb.saved = {
        "embedding sum (LayerNorm input)": FP32 * th,
        "LayerNorm mean, 1/std": 2 * FP32 * t,
        "token-type ids": INT64 * x.z.s,
    }
    if x.p_hidden > 0:
        emb.saved["dropout mask"] = th * _mask(FP32, x.z.dev)
    if x.z.amp and not x.gc:  # not kept by the casting q/k/v; BertModel.forward holds it
        emb.forward_only["embedding output"] = FP32 * th
    # embedding_dense_backward makes a full-size gradient for each embedding table
    widest = max(c["vocab_size"], c["max_position_embeddings"])
    emb.backward = [Moment(temp=2 * x.g + FP32 * widest * x.h)]
    return emb


def _bert_attention(x: _Bert, i: int) -> Stage:
    """Self-attention (q, k, v, scores, softmax, dropout, context), output dense, LayerNorm."""
    z, th, ea, name = x.z, x.th, x.z.ea, f"L{i}.attn"
    copies = 2 * x.m.stage_numel(name, cast_only=True) if z.amp else 0
    at = Stage(name, grads=FP32 * x.m.stage_numel(name), copies=copies)
    if z.amp:
        at.saved["q/k/v input casts (3 x 16-bit)"] = 3 * 2 * th
    else:
        at.saved["layer input (q/k/v input)"] = FP32 * th
    if x.fused:
        at.saved["q, k, v"] = 3 * ea * th
        at.saved["attention output"] = ea * th
        lse_len = z.s if z.dev == "cpu" else 32 * math.ceil(z.s / 32)
        at.saved["log-sum-exp"] = z.b * x.a * lse_len * FP32
    else:
        at.saved["q, k, v contiguous copies (matmul)"] = 3 * x.eq * th
        at.saved["attention probabilities"] = x.es * x.scores
        if x.p_attn > 0:
            at.saved["attention dropout mask"] = _mask(x.es, z.dev) * x.scores
            at.saved["dropped probabilities"] = (x.es if x.math_sdpa else ea) * x.scores
        at.saved["context (.contiguous(), dense input)"] = ea * th
    if x.p_hidden > 0:
        at.saved["output dropout mask"] = _mask(ea, z.dev) * th
    at.saved["residual sum (LayerNorm input)"] = FP32 * th
    at.saved["LayerNorm mean, 1/std"] = 2 * FP32 * z.t
    at.transient = {"output dropout result": ea * th, "LayerNorm output": FP32 * th}
    if z.amp:
        at.transient["layer input (residual)"] = FP32 * th
    at.backward = _bert_attention_backward(x, at)
    return at


def _bert_layernorm_keep(x: _Bert) -> int:
    """What a sub-block's output dropout, residual sum and LayerNorm keep for backward."""
    mask = _mask(x.z.ea, x.z.dev) * x.th if x.p_hidden > 0 else 0
    return FP32 * x.th + 2 * FP32 * x.z.t + mask


def _bert_attention_backward(x: _Bert, at: Stage) -> list[Moment]:
    """The attention block's backward, node by node, from the output dense to q, k, v."""
    z, th, ea, eq, g, scores = x.z, x.th, x.z.ea, x.eq, x.g, x.scores
    ln = _bert_layernorm_keep(x)
    o_copy = 2 * (x.h * x.h + x.h) if z.amp else 0
    w = _weight_grad(x.h * x.h, z)
    ln_grads = FP32 * 2 * x.h
    o_grads = ln_grads + FP32 * (x.h * x.h + x.h)
    first = Moment(g + 2 * ea * th + w, released=ln, grads_done=ln_grads)
    moments = [first, *_cast_moment(g + ea * th, x.h * x.h, z, first, o_copy)]
    after_o = {"grads_done": o_grads, "copies_released": o_copy}
    if x.fused:  # the kernel's backward: gradients of q, k, v at once
        moments.append(Moment(g + ea * th + 3 * ea * th, released=ln, **after_o))
        inputs = FP32 * th if not z.amp else 3 * 2 * th  # the q/k/v input, kept to the end
        qkv_released = sum(at.saved.values()) - inputs
    else:
        mask = _mask(x.es, z.dev) * scores if x.p_attn > 0 else 0
        dropped = (x.es if x.math_sdpa else ea) * scores if x.p_attn > 0 else 0
        probs, ctx = x.es * scores, ea * th
        moments += [
            # bmm(probs, v) backward: gradient of the (dropped) probabilities and of v
            Moment(
                g + (FP32 if x.math_sdpa else ea) * th + x.es * scores + eq * th,
                released=ln + ctx,
                **after_o,
            ),
            # dropout and softmax backward: two score-sized gradients
            Moment(
                g + eq * th + 2 * x.es * scores, released=ln + ctx + dropped + eq * th, **after_o
            ),
            # bmm(q, k^T) backward: gradient of the scores, of q and of k
            Moment(
                g + 3 * eq * th + x.es * scores,
                released=ln + ctx + dropped + eq * th + mask + probs,
                **after_o,
            ),
        ]
        qkv_released = ln + ctx + dropped + 3 * eq * th + mask + probs
    # q, k, v projections' backward: three input gradients summed, one weight gradient
    moments.append(Moment(g + 3 * eq * th + ea * th + w, released=qkv_released, **after_o))
    return moments


def _bert_mlp(x: _Bert, i: int) -> Stage:
    """Intermediate dense, GELU, output dense, dropout, residual sum, LayerNorm."""
    z, th, ea, name = x.z, x.th, x.z.ea, f"L{i}.mlp"
    ti = z.t * x.inter
    copies = 2 * x.m.stage_numel(name, cast_only=True) if z.amp else 0
    mlp = Stage(name, grads=FP32 * x.m.stage_numel(name), copies=copies)
    if z.amp:
        mlp.saved["intermediate input cast"] = 2 * th
    else:
        mlp.saved["intermediate input (attention LayerNorm output)"] = FP32 * th
    mlp.saved["GELU input"] = ea * ti
    mlp.saved["GELU output"] = ea * ti
    if x.p_hidden > 0:
        mlp.saved["output dropout mask"] = _mask(ea, z.dev) * th
    mlp.saved["residual sum (LayerNorm input)"] = FP32 * th
    mlp.saved["LayerNorm mean, 1/std"] = 2 * FP32 * z.t
    mlp.transient = {"output dropout result": ea * th, "layer output": FP32 * th}
    if z.amp:
        mlp.transient["attention LayerNorm output (residual)"] = FP32 * th
        mlp.transient["layer input (encoder loop variable)"] = FP32 * th
    ln, g = _bert_layernorm_keep(x), x.g
    w = _weight_grad(x.h * x.inter, z)
    out_copy = 2 * (x.inter * x.h + x.h) if z.amp else 0
    first = Moment(g + ea * th + ea * ti + w, released=ln, grads_done=FP32 * 2 * x.h)
    mlp.backward = [
        first,
        *_cast_moment(g + ea * ti, x.h * x.inter, z, first, out_copy),
        # GELU backward's input gradient stays until the next node is done with its output
        Moment(
            g + ea * th + 2 * ea * ti + w,
            released=ln + 2 * ea * ti,
            grads_done=FP32 * (x.inter * x.h + 3 * x.h),
            copies_released=out_copy,
        ),
    ]
    return mlp


def _bert_head_and_loss(x: _Bert) -> list[Stage]:
    """The pooler (token 0, dense, tanh), dropout, the classifier, and the loss."""
    z, ea, b = x.z, x.z.ea, x.z.b
    copies = 2 * x.m.stage_numel("head", cast_only=True) if z.amp else 0
    head = Stage("head", grads=FP32 * x.m.stage_numel("head"), copies=copies)
    small = b * x.h
    if z.amp:
        head.saved["pooler input cast (token 0)"] = 2 * small
        head.forward_only["last hidden state (held by the output)"] = FP32 * x.th
    else:  # hidden[:, 0] is a view: the pooler's matmul keeps the whole tensor alive
        head.saved["last hidden state (the pooler keeps a view of it)"] = FP32 * x.th
    head.saved["pooler tanh output"] = ea * small
    if x.p_cls > 0:
        head.saved["classifier dropout mask"] = _mask(ea, z.dev) * small
    head.saved["classifier input"] = ea * small
    head.backward = [Moment(temp=x.g + 3 * ea * small)]  # select's backward: zeros(b, s, h)
    loss = Stage("loss", saved={"log-softmax": FP32 * b * x.labels, "loss scalars": 8})
    loss.backward = [Moment(temp=2 * FP32 * b * x.labels)]
    return [head, loss]


@dataclass(frozen=True)
class _Decoder(_Sizes):
    """A Llama-style config's sizes: what each decoder block builder reads."""

    kv: int  # key/value heads (fewer than a with grouped-query attention)
    d: int  # head dimension
    layers: int
    vocab: int
    p_attn: float
    use_cache: bool  # the forward builds a KV cache (not under checkpointing)
    math_sdpa: bool  # SDPA falls back to its math kernel (CPU, attention dropout)
    fused: bool  # SDPA with a fused kernel: no a·s² tensor kept
    eager_mask: int  # bytes of the causal mask eager attention builds

    @property
    def tq(self) -> int:
        """Values in the queries (all heads)."""
        return self.z.t * self.a * self.d

    @property
    def tkv(self) -> int:
        """Values in the keys, or in the values (key/value heads only)."""
        return self.z.t * self.kv * self.d


def _decoder(m: ModelInfo, z: _Shape, attn: str, gc: bool) -> _Decoder:
    """The sizes of ``m`` (a Llama-style config) that the decoder's block builders need."""
    c = m.config
    a = c["num_attention_heads"]
    p_attn = c.get("attention_dropout", 0.0) or 0.0
    # SDPA on the CPU with attention dropout runs the math kernel: like eager, but it upcasts
    # q, k, v to fp32, repeats k and v itself, and builds the causal mask internally.
    math_sdpa = attn == "sdpa" and z.dev == "cpu" and p_attn > 0
    return _Decoder(
        m=m, z=z, gc=gc, h=c["hidden_size"], a=a, kv=c.get("num_key_value_heads") or a,
        d=c.get("head_dim") or c["hidden_size"] // a, layers=c["num_hidden_layers"],
        vocab=c["vocab_size"], p_attn=p_attn,
        use_cache=bool(c.get("use_cache", True)) and not gc, math_sdpa=math_sdpa,
        fused=attn == "sdpa" and not math_sdpa,
        eager_mask=FP32 * z.b * z.s * z.s if attn == "eager" else 0,
    )  # fmt: skip


def _decoder_stages(m: ModelInfo, z: _Shape, attn: str, gc: bool) -> list[Stage]:
    """Llama-style decoders (Llama, Mistral, Qwen2) and Mixtral's MoE, as stages."""
    x = _decoder(m, z, attn, gc)
    stages = [_decoder_embed(x)]
    mlp_stage = _moe_stage if m.family == "moe" else _mlp_stage
    for i in range(x.layers):
        at, mlp = _decoder_attention(x, i), mlp_stage(m, z, i)
        if gc:
            at.region = mlp.region = i
            at.checkpoint_input = FP32 * x.th
            # The post-attention residual sum is computed in the decoder layer's own forward,
            # outside any submodule: the tracker labels its recomputation a temporary.
            mlp.recompute_temp = FP32 * x.th
            # Recomputation stops once the last saved tensor is rebuilt; under autocast the
            # post-attention RMSNorm output (not saved: the MLP keeps 16-bit casts) is still
            # held by the decoder layer at that point.
            mlp.recompute_transient += FP32 * x.th if z.amp else 0
        stages += [at, mlp]
    return [*stages, *_decoder_head_and_loss(x)]


def _decoder_embed(x: _Decoder) -> Stage:
    """The token embedding, the rotary tables, and what the checkpoints keep as arguments."""
    m, g = x.m, x.g
    emb = Stage("embed", grads=0 if m.tied else FP32 * m.stage_numel("embed"))
    emb.saved["rotary cos, sin"] = 2 * FP32 * x.z.s * x.d
    if x.gc:  # the checkpoints keep the layers' arguments
        emb.saved["causal mask (checkpoint argument)"] = x.eager_mask
        emb.saved["position ids"] = INT64 * x.z.s
    if m.tied:  # the head's gradient for the shared weight, this one, and their sum
        emb.backward = [Moment(temp=g + 2 * FP32 * x.vocab * x.h)]
    else:  # embedding_dense_backward: a full-size gradient
        emb.backward = [Moment(temp=g + FP32 * x.vocab * x.h)]
    return emb


def _decoder_attention(x: _Decoder, i: int) -> Stage:
    """Input RMSNorm, q/k/v projections with RoPE, attention, o_proj, residual sum."""
    z, ea, tq, tkv, scores = x.z, x.z.ea, x.tq, x.tkv, x.scores
    at = _normed_stage(x.m, z, f"L{i}.attn", "input", "q/k/v", 3)
    qkv = probs = 0  # bytes of the saved q/k/v copies, and of the probabilities and masks
    cache_saved = False
    if x.fused:
        if z.amp:
            at.saved["q, k, v 16-bit casts"] = 2 * (tq + 2 * tkv)
        else:
            at.saved["q (after RoPE)"] = FP32 * tq
            at.saved["k, v" + (" (the KV-cache tensors)" if x.use_cache else "")] = 2 * FP32 * tkv
            cache_saved = x.use_cache
        at.saved["attention output"] = ea * tq
        lse_len = z.s if z.dev == "cpu" else 32 * math.ceil(z.s / 32)
        at.saved["log-sum-exp"] = FP32 * z.b * x.a * lse_len
    else:
        if x.math_sdpa:
            qkv += _put(at, "q scaled, k, v repeated (fp32, math kernel)", 3 * FP32 * tq)
        elif z.amp:
            qkv += _put(at, "q, k, v 16-bit copies (k, v repeated to all heads)", 3 * 2 * tq)
        elif x.a // x.kv > 1 or not x.use_cache:
            qkv += _put(at, "q, k, v copies (matmul; k, v repeated to all heads)", 3 * FP32 * tq)
        else:  # MHA reading the contiguous cache tensors: only q is copied
            qkv += _put(at, "q copy (matmul)", FP32 * tq)
            qkv += _put(at, "k, v (the KV-cache tensors)", 2 * FP32 * tkv)
            cache_saved = True
        probs += _put(at, "attention probabilities (fp32 softmax)", FP32 * scores)
        if x.p_attn > 0:
            probs += _put(at, "attention dropout mask", _mask(FP32, z.dev) * scores)
        if z.amp and not x.math_sdpa:  # the matmul with v keeps a 16-bit copy
            probs += _put(at, "attention probabilities 16-bit copy", 2 * scores)
        elif x.p_attn > 0:
            probs += _put(at, "dropped probabilities", FP32 * scores)
        at.saved["context (o_proj input)"] = ea * tq
    if x.use_cache and not cache_saved:
        at.forward_only["KV cache (fp32, held by the model output)"] = 2 * FP32 * tkv
    at.transient = {"o_proj output": ea * x.th, "residual sum": FP32 * x.th}
    if not x.fused:
        at.transient["masked scores (softmax input)"] = FP32 * scores
        if not x.gc:
            at.transient["causal mask"] = x.eager_mask
    at.backward = _decoder_attention_backward(x, at, qkv, probs)
    return at


def _put(stage: Stage, label: str, nbytes: int) -> int:
    """Add a saved tensor of ``nbytes`` to ``stage`` under ``label``; return its bytes."""
    stage.saved[label] = nbytes
    return nbytes


def _decoder_attention_backward(x: _Decoder, at: Stage, qkv: int, probs: int) -> list[Moment]:
    """The attention block's backward, node by node, from o_proj to the input RMSNorm."""
    z, ea, g, tq, tkv, scores = x.z, x.z.ea, x.g, x.tq, x.tkv, x.scores
    o_numel = x.m.numel_named(at.name, "o_proj")
    o_copy = 2 * o_numel if z.amp else 0
    w = _weight_grad(x.h * x.a * x.d, z)
    ctx = ea * tq
    first = Moment(g + (2 * x.th if z.amp else 0) + ea * tq + w)
    moments = [first, *_cast_moment(g + ea * tq, x.h * x.a * x.d, z, first, o_copy)]
    after_o = {"grads_done": FP32 * o_numel, "copies_released": o_copy}
    if x.fused:  # the kernel's backward: gradients of q, k, v at once
        moments.append(Moment(g + ea * tq + ea * (tq + 2 * tkv), released=0, **after_o))
    else:
        eg = FP32 if x.math_sdpa else ea  # the math kernel's gradients are fp32
        moments += [
            # bmm(probs, v) backward: gradients of the probabilities and of v
            Moment(g + ea * tq + eg * scores + eg * tq, released=ctx, **after_o),
            # softmax backward in fp32 (under autocast after casting the gradient up)
            Moment(g + eg * tq + 2 * FP32 * scores, released=ctx + qkv // 3, **after_o),
            # bmm(q, k^T) backward: gradients of the scores, q and k
            Moment(g + 3 * eg * tq + eg * scores, released=ctx + qkv // 3 + probs, **after_o),
        ]
    # RoPE runs in fp32: q and k gradients in fp32, then the projections' backward. The input
    # RMSNorm's tensors stay to the end, the projections' input until their backward.
    saved, norm = sum(at.saved.values()), _rmsnorm_bytes(z, x.h)
    proj_input = 3 * 2 * x.th if z.amp else FP32 * x.th
    last = {"grads_done": at.grads - FP32 * x.h, "copies_released": at.copies}
    moments += [
        Moment(
            g + FP32 * (tq + 2 * tkv) + ea * x.th + w, released=saved - norm - proj_input, **after_o
        ),
        Moment(4 * g, released=saved - norm, **last),
    ]
    return moments


def _decoder_head_and_loss(x: _Decoder) -> list[Stage]:
    """The final RMSNorm, lm_head (maybe tied to the embedding), and the causal-LM loss."""
    m, z, ea, t, vocab, h = x.m, x.z, x.z.ea, x.z.t, x.vocab, x.h
    cast = m.stage_numel("head", cast_only=True) + (vocab * h if m.tied else 0)
    head = Stage("head", copies=2 * cast if z.amp else 0)
    head.grads = FP32 * m.stage_numel("head")
    if m.tied:  # the shared weight's gradient stays a temporary until the embedding adds its own
        head.pending_grads = FP32 * vocab * h
    _rmsnorm(head, "final RMSNorm", z, h)
    if z.amp:
        head.saved["lm_head input cast"] = 2 * x.th
        head.forward_only["final RMSNorm output (held by the model output)"] = FP32 * x.th
    else:
        head.saved["final RMSNorm output (lm_head input)"] = FP32 * x.th
    head.forward_only["logits (held by the model output)"] = ea * t * vocab
    lm_copy = 2 * vocab * h if z.amp else 0
    first = Moment(
        FP32 * t * vocab + (2 * t * vocab if z.amp else 0) + ea * x.th + _weight_grad(vocab * h, z)
    )
    head.backward = [
        first,
        *_cast_moment(ea * x.th, vocab * h, z, first, lm_copy),
        Moment(4 * x.g, grads_done=FP32 * vocab * h, copies_released=head.copies),
    ]
    loss = Stage("loss", saved={"log-softmax (fp32)": FP32 * t * vocab, "loss scalars": 8})
    loss.forward_only = {"labels, padded and shifted": INT64 * (z.b * (z.s + 1) + t)}
    if z.amp:
        loss.transient = {"logits upcast to fp32 by the loss": FP32 * t * vocab}
    loss.backward = [Moment(temp=2 * FP32 * t * vocab)]  # nll grad + log-softmax grad
    return [head, loss]


def _rmsnorm(stage: Stage, label: str, z: _Shape, h: int) -> None:
    """An RMSNorm's saved tensors: its input, 1/rms per token, the normalised values."""
    stage.saved[f"{label} input (residual stream)"] = FP32 * z.t * h
    stage.saved[f"{label} 1/rms"] = FP32 * z.t
    stage.saved[f"{label} normalised"] = FP32 * z.t * h


def _rmsnorm_bytes(z: _Shape, h: int) -> int:
    """Bytes of what ``_rmsnorm`` saves."""
    return 2 * FP32 * z.t * h + FP32 * z.t


def _normed_stage(m: ModelInfo, z: _Shape, name: str, norm: str, to: str, n: int):
    """A decoder sub-block's stage up to its RMSNorm output, read by ``n`` projections ``to``."""
    th = z.t * m.config["hidden_size"]
    st = Stage(
        name,
        grads=FP32 * m.stage_numel(name),
        copies=2 * m.stage_numel(name, cast_only=True) if z.amp else 0,
    )
    _rmsnorm(st, f"{norm} RMSNorm", z, m.config["hidden_size"])
    if z.amp:  # each projection casts the normalised input to 16 bits itself
        st.saved[f"{to} input casts ({n} x 16-bit)"] = n * 2 * th
    else:
        st.saved[f"{norm} RMSNorm output ({to} input)"] = FP32 * th
    return st


def _mlp_stage(m: ModelInfo, z: _Shape, i: int) -> Stage:
    """Post-attention RMSNorm + SwiGLU MLP (gate, up, down) + residual sum."""
    h, inter = m.config["hidden_size"], m.config["intermediate_size"]
    t, ea = z.t, z.ea
    th, ti = t * h, t * inter
    g = FP32 * th
    name = f"L{i}.mlp"
    st = _normed_stage(m, z, name, "post-attention", "gate/up", 2)
    st.saved["gate, SiLU(gate), up, product"] = 4 * ea * ti
    st.transient = {"down_proj output": ea * th, "residual sum (layer output)": FP32 * th}
    w = _weight_grad(h * inter, z)
    down = 2 * m.numel_named(name, "down_proj") if z.amp else 0
    down_grads = FP32 * m.numel_named(name, "down_proj")
    first = Moment(g + (2 * th if z.amp else 0) + ea * ti + w)
    st.backward = [
        first,
        *_cast_moment(g + ea * ti, h * inter, z, first, down),
        # product's backward: gradients of SiLU(gate) and of up
        Moment(g + 3 * ea * ti, released=ea * ti, grads_done=down_grads, copies_released=down),
        # gate and up projections' backward (one input gradient at a time)
        Moment(
            g + 2 * ea * ti + ea * th + w,
            released=4 * ea * ti,
            grads_done=down_grads,
            copies_released=down,
        ),
        Moment(
            4 * g, released=4 * ea * ti, grads_done=st.grads - FP32 * h, copies_released=st.copies
        ),
    ]
    return st


def _moe_stage(m: ModelInfo, z: _Shape, i: int) -> Stage:
    """Post-attention RMSNorm + Mixtral's sparse MoE block (grouped-matmul experts)."""
    c = m.config
    h, inter = c["hidden_size"], c["intermediate_size"]
    experts, k = c["num_local_experts"], c["num_experts_per_tok"]
    if c.get("_experts_implementation") not in (None, "grouped_mm"):
        raise ValueError("the MoE estimate follows the grouped_mm experts (transformers' default)")
    t = z.t
    th, routed = t * h, t * k  # every token goes to k experts
    g = FP32 * th
    name = f"L{i}.mlp"
    st = _normed_stage(m, z, name, "post-attention", "router", 1)
    st.saved["router probabilities (fp32 softmax)"] = FP32 * t * experts
    st.saved["top-k indices, weights, weight sums"] = t * k * (INT64 + FP32) + FP32 * t
    st.saved["sort order, token index, inverse order"] = 3 * INT64 * routed
    st.saved["routed token copies (fp32: grouped_mm is not autocast)"] = FP32 * routed * h
    st.saved["routing weights (sorted)"] = FP32 * routed + FP32 * experts
    st.saved["gate/up output"] = FP32 * routed * 2 * inter
    st.saved["SiLU(gate), product"] = 2 * FP32 * routed * inter
    st.saved["expert output"] = FP32 * routed * h
    st.transient = {
        "weighted and reordered expert outputs": 2 * FP32 * routed * h,
        "residual sum (layer output)": FP32 * th,
    }
    # Recomputation stops after the last saved tensor; the weighted expert outputs, the
    # sorted ids and the histogram input are alive at that point.
    st.recompute_transient = FP32 * routed * h + INT64 * routed + FP32 * routed + FP32 * t * experts
    gate_up, down = experts * 2 * inter * h, experts * h * inter
    ri = FP32 * routed * inter
    st.backward = [
        # down projection's backward: weighted-output and expert-output gradients, its input
        # gradient and the stacked weight's gradient
        Moment(g + 2 * FP32 * routed * h + ri + FP32 * down),
        Moment(g + 3 * ri, released=ri, grads_done=FP32 * down),  # product's backward
        Moment(g + 4 * ri, released=2 * ri, grads_done=FP32 * down),  # chunk: gradients cat
        # gate/up projection's backward: concatenated gradient, input gradient, weight gradient
        Moment(
            g + 2 * ri + FP32 * routed * h + FP32 * gate_up, released=4 * ri, grads_done=FP32 * down
        ),
        Moment(4 * g, released=4 * ri, grads_done=st.grads - FP32 * h, copies_released=st.copies),
    ]
    return st


# --------------------------------------------------------------------------------------------
# The step, moment by moment


@dataclass
class Estimate:
    """Predicted bytes per category (the measure contract) and where the peak falls."""

    n_params: int
    params: int
    buffers: int
    gradients: int
    optimizer_state: int
    activations: int
    temporaries: int
    weight_copies: int
    peak: int
    peak_at: str  # "forward: ...", "backward: <stage>", "optimizer step"
    layer_activations: dict[str, int] = field(default_factory=dict)  # one layer, labelled
    paper_layer_bytes: int = 0  # Korthikanti et al.'s s·b·h·(34 + 5as/h) for one layer

    def as_dict(self) -> dict:
        """Plain dict for records and JSON."""
        return asdict(self)


def _simulate(stages: list[Stage], base: int, grads_all: int, accumulate: bool, opt_temp: int):
    """Walk forward, backward and the optimizer step; return category maxima and the peak."""
    act_max = temp_max = copies_max = 0
    peak, where = 0, ""

    def seen(total: int, label: str) -> None:
        nonlocal peak, where
        if total > peak:
            peak, where = total, label

    grads0 = grads_all if accumulate else 0  # later micro-batches find every gradient there
    # Forward: saved tensors pile up; checkpointed layers keep their input only (and free
    # their intermediates as they go, so only the stage's transients are added).
    kept = fwd_only = copies = 0
    for st in stages:
        full = sum(st.saved.values())
        extra = sum(st.transient.values())
        if st.region is None:
            here = kept + full + extra
        else:
            here = kept + st.checkpoint_input + extra
        here += fwd_only + sum(st.forward_only.values())
        copies += st.copies
        act_max = max(act_max, here)
        copies_max = max(copies_max, copies)
        seen(base + grads0 + here + copies, f"forward: {st.name}")
        kept += st.checkpoint_input if st.region is not None else full
        fwd_only += sum(st.forward_only.values())
    temp_max = max(temp_max, copies)
    # Backward: stages in reverse; a checkpointed layer is recomputed when backward reaches it.
    act = kept
    copies = sum(st.copies for st in stages if st.region is None)  # autocast's cache is gone
    grads = grads0
    recomputed: set[int] = set()
    pending = 0  # a tied weight's first gradient, a temporary until the second one is added
    for st in reversed(stages):
        rtemp = st.recompute_temp if st.region is not None else 0
        if st.region is not None and st.region not in recomputed:
            recomputed.add(st.region)
            region = [x for x in stages if x.region == st.region]
            act += sum(sum(x.saved.values()) - x.recompute_temp for x in region)
            act -= sum(x.checkpoint_input for x in region if x.input_in_saved)
            copies += sum(x.copies for x in region)
            act_max = max(act_max, act + st.recompute_transient)
            copies_max = max(copies_max, copies)
        for mom in st.backward or [Moment(0)]:
            done = 0 if accumulate else mom.grads_done
            temp = copies - mom.copies_released + mom.temp + rtemp + pending
            temp_max = max(temp_max, temp)
            seen(base + grads + done + act - mom.released + temp, f"backward: {st.name}")
        act -= sum(st.saved.values()) - rtemp
        if st.region is not None and not st.input_in_saved:
            act -= st.checkpoint_input
        copies -= st.copies
        grads += 0 if accumulate else st.grads
        if st.pending_grads and not accumulate:  # with accumulation p.grad already exists
            pending = st.pending_grads
        elif st.name == "embed" and pending:
            grads += 0 if accumulate else pending
            pending = 0
    temp_max = max(temp_max, opt_temp)
    seen(base + grads_all + opt_temp, "optimizer step")
    return act_max, temp_max, copies_max, peak, where


def estimate(
    model,
    batch_size: int,
    seq_len: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
    gradient_checkpointing: bool = False,
    attn: str = "eager",
    grad_accum: int = 1,
    device: str | torch.device | None = None,
    lora_r: int = 0,
    lora_targets: str = "",
) -> Estimate:
    """Predicted per-category bytes of one steady-state training step (see the module doc).

    ``model`` is a bundled name, a config JSON path, a dict, a transformers config or a
    ``ModelInfo`` from ``describe_model`` (reuse one to estimate many settings quickly).
    ``device`` (default: ``helpers.device.default_device()``) picks CPU or CUDA behaviour.
    ``lora_r`` > 0 trains LoRA adapters of that rank on ``lora_targets`` instead of every
    weight (as ``RunConfig``; ignored when ``model`` is a ModelInfo, which already says it).
    """
    from helpers.device import resolve

    if precision not in PRECISION_BYTES:
        raise ValueError(f"unknown precision {precision!r}: use fp32, tf32, bf16 or fp16")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    if attn not in ATTENTION:
        raise ValueError(f"unknown attention {attn!r}: use eager or sdpa")
    if batch_size < 1 or seq_len < 1 or grad_accum < 1:
        raise ValueError("batch size, sequence length and accumulation must be positive")
    info = describe_model(model, attn, lora_r, lora_targets)
    limit = info.config.get("max_position_embeddings")
    if limit and seq_len > limit:
        raise ValueError(f"sequence length {seq_len} exceeds max_position_embeddings ({limit})")
    dev = resolve(device)
    amp = precision in AUTOCAST
    z = _Shape(b=batch_size, s=seq_len, ea=PRECISION_BYTES[precision], amp=amp, dev=dev.type)
    build = _encoder_stages if info.family == "encoder" else _decoder_stages
    stages = build(info, z, attn, gradient_checkpointing)
    _add_adapters(stages, info, z)
    if dev.type == "cuda":
        _round_to_allocations(stages, info)
    trainable = [p for p in info.params if p.trainable]

    def alloc(nbytes: int) -> int:  # a tensor's bytes as the allocator holds them
        return allocation_bytes(nbytes, dev.type)

    params = sum(alloc(FP32 * p.numel) for p in info.params)
    grads = sum(alloc(FP32 * p.numel) for p in trainable)
    buffers = sum(alloc(b) for b in info.buffer_sizes)
    state = optimizer_state_bytes(optimizer, trainable, dev.type)
    opt_temp = optimizer_step_temporaries(optimizer, trainable, dev.type)
    base = params + buffers + state
    act, temp, copies, peak, where = _simulate(stages, base, grads, grad_accum > 1, opt_temp)
    layer = {}
    for st in stages:
        if st.name.startswith("L0."):
            layer.update({f"{st.name[3:]}: {k}": v for k, v in st.saved.items()})
    c = info.config
    h, a = c["hidden_size"], c["num_attention_heads"]
    paper = 34 * seq_len * batch_size * h + 5 * a * seq_len * seq_len * batch_size
    return Estimate(
        n_params=info.n_params,
        params=params,
        buffers=buffers,
        gradients=grads,
        optimizer_state=state,
        activations=act,
        temporaries=temp,
        weight_copies=copies,
        peak=peak,
        peak_at=where,
        layer_activations=layer,
        paper_layer_bytes=paper,
    )


def _round_to_allocations(stages: list[Stage], m: ModelInfo) -> None:
    """CUDA's view of the stages: every storage rounded up to the allocator's 512 B blocks.

    Gradients and autocast copies are rounded tensor by tensor (one per parameter). Each
    saved or transient entry is rounded as one storage: exact where an entry is one tensor,
    and short by under 512 B per extra tensor where it groups several (q, k, v...).
    """

    def alloc(nbytes: int) -> int:
        return allocation_bytes(nbytes, "cuda")

    for st in stages:
        for part in (st.saved, st.forward_only, st.transient):
            for key, nbytes in part.items():
                part[key] = alloc(nbytes)
        mine = [p for p in m.params if p.stage == st.name]
        if st.grads:
            st.grads = sum(alloc(FP32 * p.numel) for p in mine if p.trainable)
        if st.copies:
            tied = 0  # the tied input embedding, cast for the LM head
            if st.name == "head" and m.tied:
                tied = next(p.numel for p in m.params if p.embedding and p.stage == "embed")
            st.copies = sum(alloc(2 * p.numel) for p in mine if p.cast) + (tied and alloc(2 * tied))
        if st.pending_grads:
            st.pending_grads = alloc(st.pending_grads)


def _add_adapters(stages: list[Stage], m: ModelInfo, z: _Shape) -> None:
    """LoRA adapters' own tensors: A's outputs, and peft's fp32 input casts under autocast."""
    kept: dict[str, int] = {}
    widest: dict[str, int] = {}
    for p in m.params:
        if p.trainable and ".lora_A." in p.name:  # A is (r, in)
            kept[p.stage] = kept.get(p.stage, 0) + z.t * p.shape[0] * z.ea
            widest[p.stage] = max(widest.get(p.stage, 0), p.shape[1])
    for st in stages:
        if not kept.get(st.name):
            continue
        # B keeps A's output (T x r) for its weight gradient until this stage's backward.
        st.saved["LoRA A outputs (B's input)"] = kept[st.name]
        if z.amp:
            # peft casts a 16-bit input to the adapter's fp32 dtype before A (which autocast
            # casts back): one fp32 T x in copy alive at a time, and its gradient in backward.
            st.transient["peft's fp32 copy of an adapter input"] = FP32 * z.t * widest[st.name]
            st.backward.append(Moment(temp=(FP32 + 2 * 2) * z.t * widest[st.name]))


def estimate_run(cfg) -> Estimate:
    """``estimate`` for a ``helpers.train.RunConfig`` (the same fields ``measure`` reads)."""
    return estimate(
        cfg.model,
        cfg.batch_size,
        cfg.seq_len,
        precision=cfg.precision,
        optimizer=cfg.optimizer,
        gradient_checkpointing=cfg.gradient_checkpointing,
        attn=cfg.attn,
        grad_accum=cfg.grad_accum,
        device=cfg.device,
        lora_r=getattr(cfg, "lora_r", 0),
        lora_targets=getattr(cfg, "lora_targets", ""),
    )
