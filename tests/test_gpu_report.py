"""The estimator against what a real GPU measured: part b of the committed H200 report.

``reports/gpu/2026-11-28-nvidia-h200.json`` holds, for each setting it reached, the course's
tracker over one steady-state step on the card (bert-large, sequence 512, torch 2.11). The
traced path, which runs here on fake tensors with CUDA's semantics, must give the same model
state and temporaries to the byte. Its activations and peak fell short of the card's by 4 to
17 KiB (small tensors, under one 512-byte block each, that the trace does not show): that
measured gap is the bound below, not a tolerance chosen to pass. The analytical stage model
is held to the same rows; the gaps it still has are listed with what they are (xfail, strict:
a fix makes them fail until the mark goes).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.estimator import estimate
from helpers.train import RunConfig

REPORT = Path(__file__).parent.parent / "reports" / "gpu" / "2026-11-28-nvidia-h200.json"
ROWS = [r for r in json.loads(REPORT.read_text())["estimator"] if "tracked" in r]
EXACT = ("params", "gradients", "optimizer_state", "temporaries")
SMALL_TENSORS = 17 * 1024  # the largest shortfall the card showed (activations, peak)
# The stage model lumps the loss's scalars and rounds a moment's small tensors as one block
# (tests/test_traced.py): its largest shortfall on these rows is 21.5 KiB.
STAGE_SMALL_TENSORS = 22 * 1024


@pytest.mark.parametrize("row", ROWS, ids=[r["label"] for r in ROWS])
def test_the_traced_estimate_equals_what_the_h200_tracked(row):
    _check_against_the_card(row, "traced", SMALL_TENSORS)


def _check_against_the_card(row: dict, path: str, small_tensors: int) -> None:
    """``row``'s setting estimated on ``path`` for CUDA: the model state and temporaries the
    card tracked, to the byte; its activations and peak at most ``small_tensors`` short."""
    cfg = RunConfig(**{**row["config"], "device": "cpu"})  # the card is not here
    est = estimate(cfg.model, cfg.batch_size, cfg.seq_len, cfg.precision, cfg.optimizer,
                   cfg.gradient_checkpointing, cfg.attn, cfg.grad_accum, "cuda",
                   path=path)  # fmt: skip
    card = row["tracked"]
    assert {k: getattr(est, k) for k in EXACT} == {k: card[k] for k in EXACT}
    for key in ("activations", "peak"):
        assert 0 <= card[key] - getattr(est, key) <= small_tensors, key


def test_the_report_covers_the_settings_it_was_fixed_on():
    # Adafactor's scratch on CUDA (one tensor at a time) and an accumulated micro-batch's new
    # gradient were wrong before this report; both are in it.
    labels = {r["label"] for r in ROWS}
    assert {"Adafactor", "Adafactor + accum + ckpt + 16-bit", "bs1 + accum 4"} <= labels


# The stage model's known gaps on the card, each a tensor it does not place yet.
ANALYTICAL_GAPS = {
    # Accumulation + checkpointing + fp16: a moment inside a checkpointed layer's forward is
    # 4 MiB over the stage's end, which is all the stage model walks there.
    "Adafactor + accum + ckpt + 16-bit": "peak",
}


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(r, marks=pytest.mark.xfail(
            strict=True, reason=f"stage model: {ANALYTICAL_GAPS[r['label']]} short"))
        if r["label"] in ANALYTICAL_GAPS else r
        for r in ROWS
    ],
    ids=[r["label"] for r in ROWS],
)  # fmt: skip
def test_the_analytical_estimate_equals_what_the_h200_tracked(row):
    _check_against_the_card(row, "analytical", STAGE_SMALL_TENSORS)
