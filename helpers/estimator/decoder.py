"""Llama-style decoders (Llama, Mistral, Qwen2) and Mixtral's MoE as stages, block by block."""

from __future__ import annotations

import math
from dataclasses import dataclass

from helpers.estimator.model import FP32, INT64, ModelInfo
from helpers.estimator.stages import (
    Moment,
    Stage,
    _cast_moment,
    _mask,
    _Shape,
    _Sizes,
    _weight_grad,
    _weighted_stage,
)


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
        eager_mask=z.ew * z.b * z.s * z.s if attn == "eager" else 0,  # the model's dtype
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
            at.checkpoint_input = z.ew * x.th
            # The input RMSNorm saves the layer input itself only when it is fp32 already
            # (16-bit weights: an fp32 upcast of it).
            at.input_in_saved = z.ew == FP32
            # The post-attention residual sum is computed in the decoder layer's own forward,
            # outside any submodule: the tracker labels its recomputation a temporary.
            mlp.recompute_temp = z.ew * x.th
            # Recomputation stops once the last saved tensor is rebuilt; under autocast over
            # fp32 weights the post-attention RMSNorm output (not saved: the MLP keeps 16-bit
            # casts) is still held by the decoder layer at that point.
            mlp.recompute_transient += FP32 * x.th if z.cast else 0
        stages += [at, mlp]
    return [*stages, *_decoder_head_and_loss(x)]


def _decoder_embed(x: _Decoder) -> Stage:
    """The token embedding, the rotary tables, and what the checkpoints keep as arguments."""
    m, g, ew = x.m, x.g, x.z.ew
    emb = Stage("embed", grads=0 if m.tied else m.stage_bytes("embed"))
    emb.saved["rotary cos, sin"] = 2 * ew * x.z.s * x.d  # computed in fp32, cast to the model's
    if x.gc:  # the checkpoints keep the layers' arguments
        emb.saved["causal mask (checkpoint argument)"] = x.eager_mask
        emb.saved["position ids"] = INT64 * x.z.s
    if m.tied:  # the head's gradient for the shared weight, this one, and their sum
        emb.backward = [Moment(temp=g + 2 * ew * x.vocab * x.h)]
    else:  # embedding_dense_backward: a full-size gradient
        emb.backward = [Moment(temp=g + ew * x.vocab * x.h)]
    return emb


def _decoder_attention(x: _Decoder, i: int) -> Stage:
    """Input RMSNorm, q/k/v projections with RoPE, attention, o_proj, residual sum."""
    z, ea, ew, tq, tkv, scores = x.z, x.z.ea, x.z.ew, x.tq, x.tkv, x.scores
    at = _normed_stage(x.m, z, f"L{i}.attn", "input", "q/k/v", 3)
    qkv = probs = 0  # bytes of the saved q/k/v copies, and of the probabilities and masks
    cache_saved = False
    if x.fused:
        if z.cast:
            at.saved["q, k, v 16-bit casts"] = 2 * (tq + 2 * tkv)
        else:
            at.saved["q (after RoPE)"] = ew * tq
            at.saved["k, v" + (" (the KV-cache tensors)" if x.use_cache else "")] = 2 * ew * tkv
            cache_saved = x.use_cache
        at.saved["attention output"] = ea * tq
        lse_len = z.s if z.dev == "cpu" else 32 * math.ceil(z.s / 32)
        at.saved["log-sum-exp"] = FP32 * z.b * x.a * lse_len
    else:
        if x.math_sdpa:
            qkv += _put(at, "q scaled, k, v repeated (fp32, math kernel)", 3 * FP32 * tq)
        elif z.cast:
            qkv += _put(at, "q, k, v 16-bit copies (k, v repeated to all heads)", 3 * 2 * tq)
        elif x.a // x.kv > 1 or not x.use_cache:
            qkv += _put(at, "q, k, v copies (matmul; k, v repeated to all heads)", 3 * ew * tq)
        else:  # MHA reading the contiguous cache tensors: only q is copied
            qkv += _put(at, "q copy (matmul)", ew * tq)
            qkv += _put(at, "k, v (the KV-cache tensors)", 2 * ew * tkv)
            cache_saved = True
        probs += _put(at, "attention probabilities (fp32 softmax)", FP32 * scores)
        if x.p_attn > 0:  # on the probabilities in the model's dtype (the math kernel: fp32)
            mask = _mask(FP32 if x.math_sdpa else ew, z.dev)
            probs += _put(at, "attention dropout mask", mask * scores)
        if z.amp and not x.math_sdpa:  # the matmul with v keeps a 16-bit copy
            probs += _put(at, "attention probabilities 16-bit copy", 2 * scores)
        elif x.p_attn > 0:
            probs += _put(at, "dropped probabilities", FP32 * scores)
        at.saved["context (o_proj input)"] = ea * tq
    if x.use_cache and not cache_saved:
        at.forward_only["KV cache (held by the model output)"] = 2 * ew * tkv
    at.transient = {"o_proj output": ea * x.th, "residual sum": ew * x.th}
    if not x.fused:  # 16-bit scores plus the mask: the mask's dtype, the model's
        at.transient["masked scores (softmax input)"] = ew * scores
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
    z, ea, ew, g, tq, tkv, scores = x.z, x.z.ea, x.z.ew, x.g, x.tq, x.tkv, x.scores
    o_numel = x.m.numel_named(at.name, "o_proj")
    o_copy = 2 * o_numel if z.cast else 0
    w = _weight_grad(x.h * x.a * x.d, z)
    ctx = ea * tq
    first = Moment(g + (2 * x.th if z.cast else 0) + ea * tq + w)  # g's 16-bit cast
    moments = [first, *_cast_moment(g + ea * tq, x.h * x.a * x.d, z, first, o_copy)]
    after_o = {"grads_done": x.m.stage_bytes(at.name, "o_proj"), "copies_released": o_copy}
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
    # RoPE runs in the model's dtype (fp32 under autocast over fp32 weights): q and k
    # gradients, then the projections' backward. The input RMSNorm's tensors stay to the
    # end, the projections' input until their backward.
    saved, norm = sum(at.saved.values()), _rmsnorm_bytes(z, x.h)
    proj_input = 3 * 2 * x.th if z.cast else ew * x.th
    last = {"grads_done": at.grads - ew * x.h, "copies_released": at.copies}
    moments += [
        Moment(
            g + ew * (tq + 2 * tkv) + ea * x.th + w, released=saved - norm - proj_input, **after_o
        ),
        Moment(4 * g, released=saved - norm, **last),
    ]
    return moments


def _decoder_head_and_loss(x: _Decoder) -> list[Stage]:
    """The final RMSNorm, lm_head (maybe tied to the embedding), and the causal-LM loss."""
    if x.z.chunk:
        return [_chunked_head_and_loss(x)]
    m, z, ea, ew, t, vocab, h = x.m, x.z, x.z.ea, x.z.ew, x.z.t, x.vocab, x.h
    cast = m.stage_numel("head", cast_only=True) + (vocab * h if m.tied and z.cast else 0)
    head = Stage("head", copies=2 * cast if z.amp else 0)
    head.grads = m.stage_bytes("head")
    if m.tied:  # the shared weight's gradient stays a temporary until the embedding adds its own
        head.pending_grads = ew * vocab * h
    _rmsnorm(head, "final RMSNorm", z, h)
    if z.cast:
        head.saved["lm_head input cast"] = 2 * x.th
        head.forward_only["final RMSNorm output (held by the model output)"] = FP32 * x.th
    else:
        head.saved["final RMSNorm output (lm_head input)"] = ew * x.th
    head.forward_only["logits (held by the model output)"] = ea * t * vocab
    lm_copy = 2 * vocab * h if z.cast else 0
    first = Moment((2 if z.amp else FP32) * t * vocab + ea * x.th + _weight_grad(vocab * h, z))
    head.backward = [
        first,
        *_cast_moment(ea * x.th, vocab * h, z, first, lm_copy),
        Moment(4 * x.g, grads_done=ew * vocab * h, copies_released=head.copies),
    ]
    loss = Stage("loss", saved={"log-softmax (fp32)": FP32 * t * vocab, "loss scalars": 8})
    loss.forward_only = {"labels, padded and shifted": INT64 * (z.b * (z.s + 1) + t)}
    if z.amp:
        loss.transient = {"logits upcast to fp32 by the loss": FP32 * t * vocab}
    loss.backward = [Moment(temp=2 * FP32 * t * vocab)]  # nll grad + log-softmax grad
    return [head, loss]


def _chunked_head_and_loss(x: _Decoder) -> Stage:
    """The head and loss as ``helpers.memory_savers.ChunkedCausalLMLoss`` runs them (lesson 16).

    Each chunk of c tokens makes its logits and log-softmax (fp32; under autocast the 16-bit
    logits are freed once upcast) inside a checkpoint, and frees them; forward keeps only the
    final RMSNorm output. Backward recomputes one chunk at a time (the last first). Its largest
    moments, as the tracker sees them: the log-softmax backward (its recomputed output and
    two c x V gradients in fp32), then the matmul (the chunk's new lm_head gradient, as the
    matmul makes it, and the logits' gradient). Autograd holds the chunks' weight gradients and
    sums them once every chunk is done (under autocast over fp32 weights, in 16 bits, cast to
    fp32 after); the recomputation casts the weight to 16 bits again, chunk by chunk.
    """
    m, z, vocab, h, ew = x.m, x.z, x.vocab, x.h, x.z.ew
    c = min(z.chunk, z.t)
    cast = m.stage_numel("head", cast_only=True) + (vocab * h if m.tied and z.cast else 0)
    head = Stage("head", copies=2 * cast if z.amp else 0)
    head.grads = m.stage_bytes("head")
    if m.tied:
        head.pending_grads = ew * vocab * h
    _rmsnorm(head, "final RMSNorm", z, h)
    head.saved["final RMSNorm output (the chunks' inputs)"] = ew * x.th
    head.forward_only["labels, padded and shifted"] = INT64 * (z.b * (z.s + 1) + z.t)
    head.transient["one chunk's logits and log-softmax (fp32)"] = 2 * FP32 * c * vocab
    logits = FP32 * c * vocab  # one chunk's logits (and each of their gradients) in fp32
    wg = z.ea * vocab * h  # a chunk's lm_head gradient as its matmul makes it
    earlier = wg if z.t > c else 0  # the chunks already done: held by autograd
    done = {"copies_released": head.copies}  # forward's cast went with autocast's cache
    recast = head.copies  # the recomputation's own 16-bit cast of the weight
    head.backward = [
        Moment(earlier + recast + 3 * logits, **done),
        Moment(earlier + recast + wg + (logits // 2 if z.amp else logits), **done),
    ]
    if earlier:  # every chunk's gradient, and their sum
        head.backward.append(Moment(3 * wg, **done))
    if z.cast:  # the sum cast to fp32 for the fp32 weight
        head.backward.append(Moment(wg + FP32 * vocab * h, **done))
    head.backward.append(Moment(4 * x.g, grads_done=ew * vocab * h, **done))
    return head


def _rmsnorm(stage: Stage, label: str, z: _Shape, h: int) -> None:
    """An RMSNorm's saved tensors: its input in fp32 (the residual stream itself when the
    weights are fp32, an upcast copy of it when they are 16-bit), 1/rms per token, and the
    normalised values cast back to the model's dtype (the weight multiplies them)."""
    upcast = "input (residual stream)" if z.ew == FP32 else "input upcast to fp32"
    stage.saved[f"{label} {upcast}"] = FP32 * z.t * h
    stage.saved[f"{label} 1/rms"] = FP32 * z.t
    stage.saved[f"{label} normalised"] = z.ew * z.t * h


def _rmsnorm_bytes(z: _Shape, h: int) -> int:
    """Bytes of what ``_rmsnorm`` saves."""
    return (FP32 + z.ew) * z.t * h + FP32 * z.t


def _normed_stage(m: ModelInfo, z: _Shape, name: str, norm: str, to: str, n: int):
    """A decoder sub-block's stage up to its RMSNorm output, read by ``n`` projections ``to``."""
    th = z.t * m.config["hidden_size"]
    st = _weighted_stage(m, z, name)
    _rmsnorm(st, f"{norm} RMSNorm", z, m.config["hidden_size"])
    if z.cast:  # each projection casts the normalised input to 16 bits itself
        st.saved[f"{to} input casts ({n} x 16-bit)"] = n * 2 * th
    else:
        st.saved[f"{norm} RMSNorm output ({to} input)"] = z.ew * th
    return st


def _mlp_stage(m: ModelInfo, z: _Shape, i: int) -> Stage:
    """Post-attention RMSNorm + SwiGLU MLP (gate, up, down) + residual sum."""
    h, inter = m.config["hidden_size"], m.config["intermediate_size"]
    t, ea, ew = z.t, z.ea, z.ew
    th, ti = t * h, t * inter
    g = ew * th
    name = f"L{i}.mlp"
    st = _normed_stage(m, z, name, "post-attention", "gate/up", 2)
    st.saved["gate, SiLU(gate), up, product"] = 4 * ea * ti
    st.transient = {"down_proj output": ea * th, "residual sum (layer output)": ew * th}
    w = _weight_grad(h * inter, z)
    down = 2 * m.numel_named(name, "down_proj") if z.cast else 0
    down_grads = m.stage_bytes(name, "down_proj")
    first = Moment(g + (2 * th if z.cast else 0) + ea * ti + w)
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
            4 * g, released=4 * ea * ti, grads_done=st.grads - ew * h, copies_released=st.copies
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
