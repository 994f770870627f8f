#!/usr/bin/env python3
"""How long the estimator and the planner take at full size, on this machine: a benchmark
that prints its times (not a timed test: the machine's speed drifts).

    python tools/estimator_speed.py            # ~2-3 minutes on 2 cores

Each estimate runs in a fresh process (``helpers.isolate.call_isolated``), so its time
includes the traces a first estimate of a model makes, as a learner's first question does
(a LoRA estimate's or plan's first import of peft, 2-10 s, is printed beside it, not in it);
one core each, one after another. The settings: Llama-3.2-3B (its published shape, built
here from Llama-3.2-1B's config) and Llama-3.1-8B in bf16 with no fp32 copy, LoRA r16 on a
bf16 base, QLoRA, each with checkpointing; full fine-tuning in bf16 with selective
checkpointing, and with offloaded activations instead; batch 1 x 4096 on a CUDA card. Then
``plan_for_card`` over its default search for Llama-3.2-1B and Llama-3.1-8B on an L4.
"""

from __future__ import annotations

import json
import os
import sys
import time

from helpers.isolate import call_isolated
from helpers.models import config_path

# Llama-3.2-3B's shape (meta-llama/Llama-3.2-3B's config.json; the same numbers in torchtune's
# llama3_2 builders: 28 layers, 24 heads, 8 key/value heads, 3072 wide, 8192 in the MLP); the
# rest (vocabulary, RoPE, tied embeddings) as Llama-3.2-1B's.
LLAMA_3B = dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                num_attention_heads=24, num_key_value_heads=8, head_dim=128)  # fmt: skip
SETTINGS = {
    "full, bf16 weights + Kahan": dict(weight_dtype="bf16", bf16_update="kahan"),
    "LoRA r16, bf16 base": dict(weight_dtype="bf16", lora_r=16, lora_targets="all-linear"),
    "QLoRA r16": dict(lora_r=16, lora_targets="all-linear", qlora=True),
    "full, bf16, selective": dict(weight_dtype="bf16", checkpoint_policy="selective"),
    "full, bf16, offload": dict(weight_dtype="bf16", offload_activations=True),
}


def timed_estimate(model, setting: dict) -> tuple[float, float, float]:
    """Seconds for one estimate (in this process), its peak in GiB, and the seconds spent
    importing peft before it (a LoRA estimate's first, once per process; 0 without LoRA)."""
    from helpers.estimator import estimate

    imported = 0.0
    if setting.get("lora_r"):
        start = time.perf_counter()
        import peft  # noqa: F401  (what the first LoRA estimate of a session imports)

        imported = time.perf_counter() - start
    start = time.perf_counter()
    gc = not setting.get("offload_activations")  # offload instead of checkpointing
    est = estimate(model, 1, 4096, "bf16", gradient_checkpointing=gc, attn="sdpa",
                   device="cuda", **setting)  # fmt: skip
    return time.perf_counter() - start, est.peak / 2**30, imported


def timed_plan(model, card: str, method: str) -> tuple[float, str, float]:
    """Seconds for ``plan_for_card``'s whole default search, its answer, and the seconds spent
    importing peft before it (a LoRA plan's first, as for an estimate)."""
    from helpers.planner import plan_for_card

    imported = 0.0
    if method != "full":
        start = time.perf_counter()
        import peft  # noqa: F401  (what the first LoRA estimate of a session imports)

        imported = time.perf_counter() - start
    start = time.perf_counter()
    result = plan_for_card(model, card, 8, 2048, method, report=lambda done, total: None)
    answer = result.best.label if result.best else "does not fit"
    return time.perf_counter() - start, f"{answer} ({result.considered} estimated)", imported


def main() -> int:
    llama_1b = json.loads(config_path("llama-3.2-1b").read_text())
    models = {"Llama-3.2-3B": {**llama_1b, **LLAMA_3B}, "Llama-3.1-8B": "llama-3.1-8b"}
    print(f"{os.cpu_count()} cores; each line one fresh process", flush=True)
    for name, model in models.items():
        for label, setting in SETTINGS.items():
            seconds, peak, imported = call_isolated(timed_estimate, model, setting).unwrap()
            first = f"  (after {imported:.1f} s importing peft)" if imported else ""
            print(f"estimate {name:<13} {label:<28} {seconds:5.1f} s  peak {peak:6.2f} GiB"
                  f"{first}", flush=True)  # fmt: skip
    for name, model in {"Llama-3.2-1B": "llama-3.2-1b", "Llama-3.1-8B": "llama-3.1-8b"}.items():
        for method in ("full", "lora"):
            seconds, answer, imported = call_isolated(timed_plan, model, "l4", method).unwrap()
            first = f"  (after {imported:.1f} s importing peft)" if imported else ""
            print(f"plan_for_card {name} on an L4, {method:<4} {seconds:5.1f} s  {answer}{first}",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
