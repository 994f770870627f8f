#!/usr/bin/env python3
"""Every ``estimate_run`` over a grid of settings, one JSON line each: diff two trees' outputs.

A refactor that must not change what the estimator predicts (issue 32's "the estimator's grid
byte-identical") runs this on the commit before and after and compares the files byte for byte:

    PYTHONPATH=<tree> python tools/estimator_grid.py > grid.jsonl    # 2,304 settings, ~8 min

The grid: six bundled models (both estimator paths: bert and llama analytical, qwen3 traced),
fp32/bf16/fp16, the four optimizers, with and without checkpointing, accumulation 1 and 4,
eager and SDPA, full fine-tuning and LoRA r16, on the CPU and on CUDA (the estimator's CUDA
branch runs on paper here). A setting the estimator refuses is a line with its error.
"""

from __future__ import annotations

import itertools
import json
import sys
from dataclasses import asdict, is_dataclass

from helpers.estimator import estimate_run
from helpers.train import RunConfig

MODELS = ("bert-tiny", "llama-tiny", "bert-large", "llama-400m", "qwen3-tiny", "qwen3-0.6b")


def plain(x):
    """``x`` as JSON can hold it, every field included, in a stable order."""
    if is_dataclass(x):
        return {k: plain(v) for k, v in asdict(x).items()}
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x if isinstance(x, (int, float, str, bool, type(None))) else repr(x)


def settings():
    """The grid's RunConfigs, in a fixed order."""
    for model, precision, optimizer, ckpt, accum, attn, lora, device in itertools.product(
        MODELS, ("fp32", "bf16", "fp16"), ("adamw", "sgd", "adafactor", "adamw8bit"),
        (False, True), (1, 4), ("eager", "sdpa"), (0, 16), ("cpu", "cuda"),
    ):  # fmt: skip
        tiny = "tiny" in model
        yield RunConfig(model=model, batch_size=4 if tiny else 2, seq_len=64 if tiny else 512,
                        precision=precision, optimizer=optimizer, gradient_checkpointing=ckpt,
                        grad_accum=accum, attn=attn, lora_r=lora, device=device)  # fmt: skip


def main() -> int:
    for cfg in settings():
        try:
            answer = plain(estimate_run(cfg))
        except Exception as err:  # a refusal is part of the behaviour to compare
            answer = f"{type(err).__name__}: {err}"
        sys.stdout.write(json.dumps([cfg.as_dict(), answer], sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
