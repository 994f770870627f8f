"""BERT (BertForSequenceClassification) as stages, block by block, after modeling_bert.py."""

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
            mlp.recompute_transient += _returned_weights(x)
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
    at = _weighted_stage(x.m, z, name)
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
    _bert_add_norm(x, at)
    at.transient = {"output dropout result": ea * th, "LayerNorm output": FP32 * th}
    if returned := _returned_weights(x):
        at.transient["attention weights returned to the layer"] = returned
    if z.amp:
        at.transient["layer input (residual)"] = FP32 * th
    at.backward = _bert_attention_backward(x, at)
    return at


def _returned_weights(x: _Bert) -> int:
    """Bytes of the attention weights BertLayer holds to its end beyond what backward keeps.

    Eager attention returns its (dropped) probabilities and ``BertLayer.forward`` keeps them
    in a local (``self_attention_output, _ = self.attention(...)``) until it returns. Under
    CUDA autocast they are fp32 (softmax runs in fp32) while backward keeps their 16-bit cast:
    one more fp32 a·s² tensor alive to the end of the layer, in forward and in a recompute.
    Elsewhere the returned tensor is one backward keeps anyway (0); SDPA returns none.
    """
    if x.fused or x.p_attn == 0:
        return 0
    kept = x.es if x.math_sdpa else x.z.ea  # the dtype of the dropped probabilities kept
    return x.es * x.scores if kept != x.es else 0


def _bert_norm_saved(x: _Bert) -> dict[str, int]:
    """What a sub-block's output dropout, residual sum and LayerNorm keep for backward."""
    saved = {"output dropout mask": _mask(x.z.ea, x.z.dev) * x.th} if x.p_hidden > 0 else {}
    saved["residual sum (LayerNorm input)"] = FP32 * x.th
    saved["LayerNorm mean, 1/std"] = 2 * FP32 * x.z.t
    return saved


def _bert_add_norm(x: _Bert, stage: Stage) -> None:
    """Add the output dropout's, residual sum's and LayerNorm's saved tensors to ``stage``."""
    stage.saved.update(_bert_norm_saved(x))


def _bert_layernorm_keep(x: _Bert) -> int:
    """Bytes of ``_bert_norm_saved``: freed first in the sub-block's backward."""
    return sum(_bert_norm_saved(x).values())


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
        # The output dense's input gradient (the context's) stays alive in the tracked step
        # through the scores' backward, to the q/k/v projections (the tracker's op-by-op
        # record on the CPU; the H200's fp32 rows: 8 MiB at bert-large 4 x 512).
        held = ea * th
        moments += [
            # bmm(probs, v) backward: gradient of the (dropped) probabilities and of v
            Moment(
                g + (FP32 if x.math_sdpa else ea) * th + x.es * scores + eq * th,
                released=ln + ctx,
                **after_o,
            ),
            # dropout and softmax backward: two score-sized gradients
            Moment(
                g + held + eq * th + 2 * x.es * scores,
                released=ln + ctx + dropped + eq * th,
                **after_o,
            ),
            # bmm(q, k^T) backward: gradient of the scores, of q and of k
            Moment(
                g + held + 3 * eq * th + x.es * scores,
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
    mlp = _weighted_stage(x.m, z, name)
    if z.amp:
        mlp.saved["intermediate input cast"] = 2 * th
    else:
        mlp.saved["intermediate input (attention LayerNorm output)"] = FP32 * th
    mlp.saved["GELU input"] = ea * ti
    mlp.saved["GELU output"] = ea * ti
    _bert_add_norm(x, mlp)
    mlp.transient = {"output dropout result": ea * th, "layer output": FP32 * th}
    if returned := _returned_weights(x):
        mlp.transient["attention weights returned to the layer"] = returned
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
    head = _weighted_stage(x.m, z, "head")
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
