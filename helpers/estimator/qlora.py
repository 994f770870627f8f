"""QLoRA on paper: LoRA adapters on a base model whose Linear weights are stored in 4 bits.

QLoRA (Dettmers et al., 2023) keeps the frozen Linear weights of the transformer layers in
NF4 (bitsandbytes' ``Linear4bit``: two 4-bit codes per byte, one absmax per block of 64
weights, and the NF4 code book of 16 fp32 values; with double quantisation the absmaxes are
themselves 8-bit, one fp32 scale per 256 of them, with their own fp32 code book), the other
frozen weights (embeddings, norms, the LM head) in bf16, and trains fp32 LoRA adapters in bf16
compute. The step is estimated in two parts:

- traced (exact, as ``helpers.estimator.traced``): the model built in bf16 with peft's fp32
  adapters, trained under bf16 autocast: activations, gradients, optimizer state and every
  moment of the step;
- counted: each quantised weight's 2 bytes per number in that trace become ``nf4_bytes``,
  and the dequantised bf16 copy bitsandbytes' CUDA matmul makes of one weight at a time
  (forward and backward) is added to the peak, as if it were alive at the peak's moment.

bitsandbytes' 4-bit kernels have no fake-tensor version, so the 4-bit layers themselves are
not traced: what they save for backward is taken to be what a bf16 Linear saves (its input,
when an adapter or an earlier layer needs the gradient). Measured on a CPU
(``RunConfig(qlora=True)``, tests/test_bf16_weights.py), that holds to the byte for the
activations, temporaries, gradients and optimizer state of a Llama; the weights differ by
exactly bitsandbytes' quantisation state, which it keeps beside the parameters (the tracker's
``params`` do not include it), and the CPU kernel makes no dequantised copy. Never measured on
a GPU yet.
"""

from __future__ import annotations

import math
from dataclasses import replace

from helpers.estimator.model import ModelInfo, ParamInfo
from helpers.estimator.simulate import Estimate

BLOCK = 64  # NF4 weights per absmax
DQ_BLOCK = 256  # absmaxes per fp32 scale under double quantisation
DQ_CODE = 256 * 4 + 4  # per tensor: the 8-bit absmax code book (fp32) and its offset
NF4_CODE = 16 * 4  # per tensor: the NF4 code book, its 16 values in fp32 (quant_state.code)
BF16 = 2


def nf4_bytes(n: int, double_quant: bool = True) -> int:
    """Bytes bitsandbytes keeps for one NF4 weight of ``n`` numbers (codes and scales)."""
    blocks = math.ceil(n / BLOCK)
    codes = math.ceil(n / 2) + NF4_CODE
    if not double_quant:
        return codes + 4 * blocks
    return codes + blocks + 4 * math.ceil(blocks / DQ_BLOCK) + DQ_CODE


def quantized(p: ParamInfo) -> bool:
    """A frozen Linear weight inside the layers: what ``load_in_4bit`` stores as NF4
    (transformers keeps the LM head, embeddings and norms unquantised)."""
    is_layer = p.stage.startswith("L")
    return is_layer and p.cast and not p.trainable and len(p.shape) == 2 and ".lora_" not in p.name


def qlora_estimate(traced: Estimate, info: ModelInfo, double_quant: bool = True) -> Estimate:
    """``traced`` (a LoRA step on a bf16 base, ``frozen_16bit``) with its quantised weights
    in 4 bits and one dequantised weight at a time on top."""
    weights = [p for p in info.params if quantized(p)]
    if not weights:
        raise ValueError(f"{info.model_type}: no Linear weights in the layers to quantise")
    saved = sum(BF16 * p.numel - nf4_bytes(p.numel, double_quant) for p in weights)
    dequantized = BF16 * max(p.numel for p in weights)
    return replace(
        traced,
        params=traced.params - saved,
        weight_copies=traced.weight_copies + dequantized,
        peak=traced.peak - saved + dequantized,
        path="traced + 4-bit weights counted",
    )
