"""Predict the memory of a training step, category by category, without building the weights.

Two paths (``estimate(..., path=)``; ``Estimate.path`` says which answered): the analytical
stage model below, for BERT, Llama, Mistral, Qwen2 and Mixtral, which says *why* each byte is
there; and for every other architecture, every LoRA run and what the stage model does not know
(BERT's and Mixtral's bf16 weights, selective checkpointing, offloaded activations),
``helpers.estimator.traced``: the course's tracker over one real training step on fake tensors.
``qlora=True`` adds 4-bit weights to a LoRA step (``helpers.estimator.qlora``). The estimator
predicts only; the planner that runs candidates (``helpers.planner``) sits above it.

``estimate(...)`` returns the categories ``helpers.train.measure`` reports (the
``helpers.memory.CategoryTracker`` contract): each category's own largest size during one
steady-state step, and ``peak``, the largest total alive at one moment. The model is built on
PyTorch's ``meta`` device only (shapes, no storage), so a 7B config costs nothing; the rest is
arithmetic, derived from what PyTorch and these transformers implementations keep.

Model state (exact)
    params = 4 B x n_params (fp32 weights, the master copy under autocast too; 2 B with bf16
    weights, ``weight_dtype``); gradients = the same per trainable parameter; optimizer state
    per tensor of n numbers: AdamW 8n + 4 (exp_avg, exp_avg_sq, a 0-dim fp32 step), SGD-momentum
    4n, torch's Adafactor 4(r + c) + 4 per r x c matrix (factored second moment, times any
    leading dims) and 4n + 4 per vector, bitsandbytes' 8-bit AdamW 2n + 8 ceil(n/256) (two uint8
    states, one fp32 absmax per block of 256) plus two shared 256-entry fp32 quantisation maps,
    except tensors under min_8bit_size = 4096 numbers and nn.Embedding weights (make_optimizer's
    override), which keep two fp32 states (8n); bitsandbytes' Lion one fp32 state (4n), 8-bit
    Lion n + 4 ceil(n/256) and one map, with the same exceptions; Muon 4n per hidden matrix (a
    momentum buffer; its Newton-Schulz scratch in ``optimizer_step_temporaries``) and AdamW's
    state for every other tensor. ``training_state`` does the same from parameter counts alone.

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

    bf16 weights with no fp32 copy (``weight_dtype="bf16"``; Llama, Mistral, Qwen2 on this
    path, the other families traced): the residual stream, its gradient, RoPE, the KV cache and
    every weight gradient are bf16, and autocast has no weight or input to cast. Each RMSNorm
    keeps an fp32 upcast of its input, 1/rms and its bf16 output, the one tensor the next
    projections read (not one cast each); the attention softmax still keeps fp32.

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

from helpers.estimator.api import estimate, estimate_run, model_state_floor
from helpers.estimator.model import SUPPORTED, ModelInfo, ParamInfo, describe_model
from helpers.estimator.parallel import estimate_per_rank
from helpers.estimator.simulate import Estimate
from helpers.estimator.state import (
    TrainingState,
    optimizer_state_bytes,
    optimizer_step_temporaries,
    training_state,
)

__all__ = [
    "SUPPORTED",
    "Estimate",
    "ModelInfo",
    "ParamInfo",
    "TrainingState",
    "describe_model",
    "estimate",
    "estimate_per_rank",
    "estimate_run",
    "model_state_floor",
    "optimizer_state_bytes",
    "optimizer_step_temporaries",
    "training_state",
]
