"""The full scale fits the card it finds: every lesson's experiments on every card profile.

The memory of each experiment is the estimator's CUDA branch (checked against measurements on
the CPU in test_estimate.py and against CUDA's accounting in test_cuda_accounting.py); what
else is on the card (the notebook's and the experiment's CUDA contexts, what the notebook
keeps, the allocator's margin) is helpers.course.fullscale's model of it.
"""

import pytest
import torch

from helpers.course.fullscale import LESSONS, fit_table, lesson_experiments, lesson_flops
from helpers.device import GpuInfo
from helpers.names import GiB
from helpers.scale import FULL, TINY, fit_scale, get_scale
from tests.fake_gpu import CARDS, PROFILES, FakeGpu


def card(key: str) -> GpuInfo:
    p = PROFILES[key]
    return GpuInfo(p.name, p.total_memory, p.capability, p.multiprocessors, p.uuid)


@pytest.fixture(scope="module")
def fitted():
    return {key: fit_scale(card(key)) for key in CARDS}


@pytest.mark.parametrize("key", [k for k in CARDS if k != "a100-mig"])  # MIG: tiny, below
def test_every_full_scale_experiment_fits_its_card(key, fitted):
    scale = fitted[key]
    assert scale.name == "full"
    total = card(key).total_memory
    bad = [
        f"{x.lesson} {x.label}: needs {x.need() / GiB:.1f} of {total / GiB:.1f} GiB"
        for x in lesson_experiments(scale, card(key))
        if not x.acceptable(total)
    ]
    assert not bad, "\n".join(bad)
    assert all(row.status != "does not fit" for row in fit_table(scale, card(key)))


def test_without_fitting_the_guides_sizes_do_not_fit_a_16_gb_card():
    """The reason for fitting: batch 8, a 16 GiB budget and 2048 tokens overflow a T4."""
    t4 = card("t4")
    bad = {x.label for x in lesson_experiments(FULL, t4) if not x.acceptable(t4.total_memory)}
    assert {"sweep b8", "search b8", "decoder eager s2048", "vanilla"} <= bad


def test_each_class_of_card_gets_its_setting(fitted):
    # 16 GB cards: the budget is the card less room for the notebook; sweeps stop at batch 4.
    for key in ("t4", "v100"):
        s = fitted[key]
        assert s.name == "full" and s.budget < 16 * GiB and s.max_batch == 4
        assert s.budget <= card(key).total_memory - GiB
        assert any("budget" in note for note in s.notes)
    # 24 GB cards: the guides' 16 GB budget and batch 8, a shorter sequence for lesson 10.
    for key in ("a10g", "l4"):
        s = fitted[key]
        assert (s.budget, s.max_batch, s.long_seq) == (16 * GiB, 8, 1024)
    # 40 and 80 GB cards: the full scale as designed.
    for key in ("a100-40", "a100-80", "h100"):
        s = fitted[key]
        assert (s.budget, s.max_batch, s.long_seq, s.notes) == (16 * GiB, 8, 2048, ())
    # A 10 GB MIG slice cannot hold bert-large's training at batch 4: tiny scale, said why.
    mig = fitted["a100-mig"]
    assert mig.name == "tiny" and mig.batch_size == TINY.batch_size
    assert "too small" in mig.notes[0] and "MIG" in mig.card


def test_forcing_the_full_scale_on_a_small_card_says_what_to_expect():
    forced = fit_scale(card("a100-mig"), forced=True)
    assert forced.name == "full" and any("out-of-memory" in n for n in forced.notes)


def test_get_scale_fits_the_card_it_finds(monkeypatch):
    monkeypatch.delenv("COURSE_SCALE", raising=False)
    monkeypatch.delenv("COURSE_DEVICE", raising=False)
    FakeGpu(monkeypatch, [PROFILES["t4"]])
    scale = get_scale()
    assert scale.name == "full" and scale.max_batch == 4 and "Tesla T4" in scale.card
    text = scale.describe(torch.device("cuda", 0))
    assert "fitted to Tesla T4" in text and "adapted: budget" in text
    monkeypatch.setenv("COURSE_SCALE", "tiny")
    assert get_scale() is TINY


def test_lesson_flops_are_counted_for_every_lesson(fitted):
    flops = lesson_flops(fitted["h100"], card("h100"))
    assert all(flops[lesson] > 0 for lesson in flops), flops
    # Lesson 14: ten bert-large runs of about 10 steps of 6 x 335 M x 2048 tokens (4 TFLOP).
    assert 1e14 < flops["14"] < 1e15


def test_cli_fit_on_a_gpu_prints_the_card_and_every_lesson(monkeypatch, capsys):
    from helpers.course.cli import main

    monkeypatch.delenv("COURSE_DEVICE", raising=False)
    FakeGpu(monkeypatch, [PROFILES["l4"]])
    assert main(["fit"]) == 0
    out = capsys.readouterr().out
    assert "fitted to L4" in out or "fitted to NVIDIA L4" in out
    assert sum(line[:2].isdigit() for line in out.splitlines()) == len(LESSONS)


def test_readme_shows_the_current_fit_table():
    """README's hardware table is generated: it cannot drift from what the code decides."""
    from pathlib import Path

    from helpers.course.fullscale import fit_markdown

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start, end = "<!-- fit-table: python -m helpers fit --reference -->\n", "<!-- /fit-table -->"
    assert start in readme and end in readme, "README lacks the generated fit table"
    block = readme.split(start, 1)[1].split(end, 1)[0]
    assert block == fit_markdown(), (
        "README's fit table is stale: paste python -m helpers fit --reference"
    )


def _operator_launches(model: str) -> int:
    """aten operators in one forward + backward of ``model`` (at most one kernel launch each)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from helpers.models import build_model, load_config

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with torch.device("meta"):
        net = build_model(load_config(model), device="meta")
    ids = torch.randint(0, 100, (1, 8), device="meta")
    with Count():
        net(input_ids=ids, labels=ids).loss.backward()
    return Count.n


def test_lesson_05_times_a_shape_where_16_bit_can_be_faster(fitted):
    """Lesson 05 asserts 16-bit < 0.8 x fp32 at the full scale: its step must be compute-bound.

    A roofline of one step: the longer of its arithmetic at the card's data-sheet peak and its
    operator launches at 10 us each (eager PyTorch's dispatch and launch cost per operator).
    With 256 tokens per step (the lesson's first version) the fp32 step is launch-bound on an
    H100, so 16 bits could not be faster; at the fitted shape the ratio is well under 0.8.
    """
    from helpers.scale import model_info as _info
    from helpers.timing import peak_tflops

    launches = 10e-6 * _operator_launches(FULL.decoder)
    n = _info(FULL.decoder).n_params

    def ratio(name: str, tokens: int) -> float:
        flops = 6 * n * tokens
        half = peak_tflops(name, "bf16") or peak_tflops(name, "fp16")
        fp32 = max(launches, flops / (peak_tflops(name, "fp32") * 1e12))
        return max(launches, flops / (half * 1e12)) / fp32

    for key, scale in fitted.items():
        name = card(key).name
        if scale.name != "full" or key == "a10g":  # NVIDIA publishes no data sheet for the A10G
            continue
        assert ratio(name, scale.max_batch * scale.seq_len) < 0.7, key
    assert ratio(card("h100").name, 4 * 64) > 0.8  # the old shape: launch-bound


def test_lesson_opener_on_a_gpu_fits_the_scale_to_the_card(monkeypatch):
    # helpers.lesson's CUDA branch: the device is the card, the scale is fitted to it, the
    # report is the card's, and what the learner reads first names it.
    from helpers.lesson import lesson

    monkeypatch.delenv("COURSE_SCALE", raising=False)
    monkeypatch.delenv("COURSE_DEVICE", raising=False)
    FakeGpu(monkeypatch, [PROFILES["t4"]])
    L = lesson("05")
    assert L.device.type == "cuda" and L.scale.name == "full" and "Tesla T4" in L.scale.card
    assert "Tesla T4" in L.report.name and L.report.total_memory > 14 * 2**30
    assert str(L).startswith("Lesson 05. scale=full on cuda") and "fitted to Tesla T4" in str(L)
    cfg = L.run_config(model="decoder", precision="bf16")
    assert (cfg.model, cfg.batch_size, cfg.seq_len) == (L.scale.decoder, 4, L.scale.seq_len)
    assert (cfg.warmup, cfg.repeats, cfg.precision) == (L.scale.warmup, L.scale.repeats, "bf16")
