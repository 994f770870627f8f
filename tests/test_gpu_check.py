"""``python -m helpers gpu-check``: the report written as it goes, notebooks run and read,
the deadline kept, the full-scale order continued from earlier reports, the settings a GPU
gets. The quick run here is the version ``make test`` runs so the command cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from helpers import compat
from helpers.course import gpu_check as G
from helpers.course.cli import main as cli
from helpers.lessons.putting_it_together import SEED_RECIPES
from tests.fake_gpu import PROFILES, FakeGpu


def _notebook(path: Path, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}  # fmt: skip
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick run on this CPU (make test's version), with a passing and a failing notebook."""
    folder = tmp_path_factory.mktemp("gpu-check")
    good = _notebook(folder / "good.ipynb", "x = 1 + 1", "print(x)")
    bad = _notebook(folder / "bad.ipynb", "y = 2", "raise ValueError('the number was wrong')")
    cfg = G.GpuCheckConfig(deadline_min=4, out=folder / "report", quick=True,
                           lessons=(str(good), str(bad)), device="cpu")  # fmt: skip
    result, md = G.run_gpu_check(cfg)
    return result, md


def test_the_quick_run_writes_every_part_of_the_report(quick_run):
    _, md = quick_run
    text = md.read_text()
    for heading in ("## a. Environment", "### Preflight", "## b. The estimator",
                    "## d. The capstone", "## e. The recipes", "## c. The lessons"):  # fmt: skip
        assert heading in text, heading
    data = json.loads(md.with_suffix(".json").read_text())
    assert data["finished"] and data["device"] == "cpu"
    assert set(data["part_seconds"]) == {"a", "d", "b", "e", "c", "alone"}  # in the text
    # The plan, made after part a: d first, then b, e and the tiny lessons side by side.
    assert [line.split(":")[0] for line in data["plan"][:4]] == ["d", "b", "e", "c tiny"]
    assert data["plan"][-1].startswith(("all fit", "will not fit")) and "### Plan" in text
    assert f" (a {data['part_seconds']['a'] / 60:.1f}, d " in text
    assert "torch" in data["environment"] and data["packages"]
    assert "budget cap" in data["preflight"] and "no check fails" in data["preflight"]
    rows = {r["label"]: r for r in data["estimator"]}
    # The capstone timed first, in one process; then every setting, beside parts e and c.
    together = [r for r in data["estimator"] if r["phase"] == "at once"]
    assert len(together) == 4, data["estimator"]
    speed = data["speed_phase"]
    assert speed["labels"] == ["vanilla", "16-bit"] and speed["error"] is None
    assert speed["ended_s"] <= min(t["started_s"] for t in together)
    spans = {part: [(r["started_s"], r["ended_s"]) for r in data[key]]
             for part, key in (("b", "estimator"), ("e", "recipes"), ("c", "lessons"))}  # fmt: skip
    overlap = any(x0 < y1 and y0 < x1 for x0, x1 in spans["b"] for y0, y1 in spans["c"])
    assert overlap, spans  # parts b and c ran at the same time (their timestamps overlap)
    threads = os.environ.get("OMP_NUM_THREADS", "1")  # 2 cores, 3 parts: one thread each
    assert ("Side by side: b, e and c at once with 1, 1 and 1 slots; the notebooks and recipes "
            f"with OMP_NUM_THREADS={threads}.") in text  # fmt: skip
    for label in ("vanilla", "16-bit"):  # on the CPU the estimator is exact for the encoder
        row = rows[label]
        assert row["predicted"]["peak"] == pytest.approx(row["tracked"]["peak"], rel=0.02)
    for row in together:  # and within its bound for the decoder, LoRA included
        assert row["predicted"]["peak"] == pytest.approx(row["tracked"]["peak"], rel=0.10)
    assert all(row["max_allocated"] is None for row in rows.values())  # no caching allocator
    assert "How they ran: 1 settings at once, beside parts e and c" in text
    assert [r["recipe"] for r in data["capstone"] if r["status"] == "ok"] == ["vanilla", "16-bit"]
    # The base recipe ran as a plain script on this device and printed its throughput.
    assert [(r["recipe"], r["outcome"]) for r in data["recipes"]] == [("base", "passed")]
    assert "tokens/s" in data["recipes"][0]["note"]


def test_the_recipes_on_a_gpu_include_the_gpu_only_variants():
    labels = [label for label, _ in G.recipe_runs("cuda")]
    assert {"base", "ddp", "fsdp2", "fp8", "profile_memory"} <= set(labels)
    assert {"mixed_precision --precision fp16", "optimizers --optim adamw8bit", "lora --qlora",
            "attention --backend flash --precision bf16", "optimizers --optim muon",
            "lora --dora"} <= set(labels)  # fmt: skip
    ddp = dict(G.recipe_runs("cuda"))["ddp"]
    assert "--standalone" in ddp and ddp[ddp.index("--device") + 1] == "cuda"
    assert [label for label, _ in G.recipe_runs("cpu", quick=True)] == ["base"]


def test_a_recipe_that_needs_what_is_missing_is_skipped_and_a_crash_fails(tmp_path):
    need = [sys.executable, "-c", "raise SystemExit('fp8.py needs an NVIDIA GPU of 8.9+')"]
    assert G.run_recipe("fp8", need, 60, tmp_path)["outcome"] == "skipped"
    crash = [sys.executable, "-c", "raise ValueError('broken')"]
    row = G.run_recipe("x", crash, 60, tmp_path)
    assert row["outcome"] == "failed" and "ValueError: broken" in row["note"]


def test_a_failing_notebook_is_reported_with_its_cell_and_error(quick_run):
    result, _ = quick_run
    rows = {r["notebook"]: r for r in result.lessons}
    assert rows["good.ipynb"]["outcome"] == "passed"
    bad = rows["bad.ipynb"]
    assert bad["outcome"] == "failed"
    assert bad["error"] == "code cell 2: ValueError: the number was wrong"
    assert result.problems == ["lesson bad (tiny): failed"]


def test_a_notebook_past_the_deadline_is_stopped_and_reported(tmp_path):
    slow = _notebook(tmp_path / "slow.ipynb", "import time\ntime.sleep(120)")
    rows = []
    clock = G.Clock(0.1)  # 6 s: the kernel starts, then the cell outlives the deadline
    start = time.monotonic()
    G.run_notebooks([slow], "tiny", tmp_path / "work", clock, 1, rows.append, "cpu",
                    estimate_s=lambda path: 5.0)  # fmt: skip
    assert time.monotonic() - start < 60
    assert rows[0]["outcome"] == "stopped at the deadline"
    too_late = G.Clock(0.0)
    G.run_notebooks([slow], "tiny", tmp_path / "work", too_late, 1, rows.append, "cpu")
    assert rows[1]["outcome"] == "not started" and "min left" in rows[1]["error"]


def test_notebooks_at_once_keep_within_the_cards_bytes_and_name_who_ran_beside(tmp_path):
    """a (6 bytes) and c (4) fill the 10 of the card; b (5) waits for a's bytes, then runs
    beside c, which takes longest."""
    seconds = {"a": 1, "b": 1, "c": 6}
    nbs = [_notebook(tmp_path / f"{n}.ipynb", f"import time\ntime.sleep({t})")
           for n, t in seconds.items()]  # fmt: skip
    need = {"a": 6, "b": 5, "c": 4}
    rows, ledger = [], G.Ledger(10)
    G.run_notebooks(nbs, "tiny", tmp_path / "work", G.Clock(2), 3, rows.append, "cpu",
                    estimate_s=lambda path: 1.0, need_bytes=lambda path: need[path.stem],
                    ledger=ledger)  # fmt: skip
    beside = {r["lesson"]: r["beside"] for r in rows}
    assert all(r["outcome"] == "passed" for r in rows), rows
    assert beside == {"a": ["c"], "b": ["c"], "c": ["a", "b"]} and ledger.held == 0
    span = {r["lesson"]: (r["started_s"], r["ended_s"]) for r in rows}
    assert span["b"][0] >= span["a"][1] - 0.6 and span["b"][0] < span["c"][1]  # polled each 0.5 s


def test_on_a_gpu_the_full_scale_runs_at_once_and_a_lesson_failing_beside_others_again_alone(
    monkeypatch, tmp_path
):
    """Part c on a (fake) H100 at the full scale: the tiny scale only for a lesson that does
    not fit the card, the rest at once within 90 % of it, a failure beside others run again
    alone, the lessons beside each one in the report."""
    from helpers.course.fullscale import LessonFit

    FakeGpu(monkeypatch, [PROFILES["h100"]])
    fits = [LessonFit(n, "does not fit" if n == "03" else "fits", "", n_gib * G.GiB)
            for n, n_gib in (("00", 10), ("03", 20), ("05", 30))]  # fmt: skip
    tables = []  # the fit table runs the estimator: once per run, before b's thread runs it
    monkeypatch.setattr(G, "fit_table", lambda scale, card: tables.append(1) or fits)
    calls = []

    def fake_run(paths, scale, work, clock, parallel, on_done, device=None, estimate_s=None,
                 need_bytes=None, ledger=None):  # fmt: skip
        names = [G.lesson_number(p) for p in paths]
        calls.append((scale, names, parallel, ledger is not None))
        for n in names:
            failed = scale == "full" and ledger is not None and n == "05"
            beside = [m for m in names if m != n] if ledger is not None else []
            on_done({"lesson": n, "notebook": next(p.name for p in paths if n in p.name),
                     "scale": scale, "outcome": "failed" if failed else "passed", "seconds": 1.0,
                     "error": "OutOfMemoryError" if failed else "", "beside": beside,
                     "claims": {"counts": {}, "not_holding": []}})  # fmt: skip

    monkeypatch.setattr(G, "run_notebooks", fake_run)
    card = PROFILES["h100"].total_memory
    result = G.GpuCheckResult("now", "cuda:0", "H100", 9.0, card_bytes=card,
                              environment={"scale": "scale=full on cuda:0: ..."})  # fmt: skip
    cfg = G.GpuCheckConfig(device="cuda:0", lessons=("00", "03", "05"))
    run = G._Run(cfg, result, G.Clock(9.0), lambda: None, lambda line: None, shares={"c": 4})
    again = G._part_c(run, tmp_path, {}, G.Ledger(int(G.CARD_SHARE * card)))
    G._part_c_alone(run, tmp_path, {}, again)
    assert calls == [("tiny", ["03"], 4, True), ("full", ["00", "05"], 4, True),
                     ("full", ["05"], 1, False)]  # fmt: skip
    outcomes = [(r["lesson"], r["scale"], r["outcome"]) for r in result.lessons]
    assert outcomes == [
        ("03", "tiny", "passed"), ("00", "full", "passed"),
        ("05", "full", "failed beside others"), ("05", "full", "passed"),
    ]  # fmt: skip
    assert result.problems == [] and "up to 4 at once within" in result.order
    assert tables == [1]
    text = "\n".join(G._lessons_markdown(result))
    assert "| 00 | full | passed | 1 | 05 |" in text and "lessons 00, 08, 11, 14" in text


def test_the_report_is_written_before_a_later_part_breaks(tmp_path, monkeypatch):
    def broken(*args):
        raise KeyboardInterrupt  # the run killed during part b

    monkeypatch.setattr(G, "_part_b", broken)
    cfg = G.GpuCheckConfig(deadline_min=2, out=tmp_path, quick=True, lessons=(), device="cpu")
    with pytest.raises(KeyboardInterrupt):
        G.run_gpu_check(cfg)
    (md,) = tmp_path.glob("*.md")
    text = md.read_text()
    assert "## a. Environment" in text and "budget cap" in text
    assert "in progress (or stopped before the end)" in text
    assert not json.loads(md.with_suffix(".json").read_text())["finished"]


def test_the_full_scale_continues_with_the_lessons_no_report_covered(tmp_path):
    earlier = {"device": "cuda:0", "lessons": [
        {"lesson": "14", "scale": "full", "outcome": "passed"},
        {"lesson": "00", "scale": "full", "outcome": "failed"},
        {"lesson": "01", "scale": "tiny", "outcome": "passed"},
    ]}  # fmt: skip
    (tmp_path / "2026-11-20-nvidia-h100.json").write_text(json.dumps(earlier))
    cpu_run = {"device": "cpu", "lessons": [{"lesson": "05", "scale": "full", "outcome": "passed"}]}
    (tmp_path / "2026-11-21-cpu.json").write_text(json.dumps(cpu_run))
    covered = G.covered_earlier(tmp_path)
    assert covered == {"14"}  # failed, tiny-scale and CPU runs do not count
    paths = G.notebook_paths(None)
    ordered, why = G.full_order(paths, covered)
    numbers = [G.lesson_number(p) for p in ordered]
    assert numbers[:3] == ["00", "01", "05"] and numbers[-1] == "14"
    assert sorted(numbers) == [f"{i:02d}" for i in range(18)]
    assert "already covered: 14" in why


def test_report_names_carry_the_date_and_card_and_never_overwrite(tmp_path):
    from datetime import datetime

    when = datetime(2026, 11, 27)
    md, js = G.report_paths(tmp_path, "NVIDIA H100 80GB HBM3", when)
    assert md.name == "2026-11-27-nvidia-h100-80gb-hbm3.md" and js.suffix == ".json"
    js.write_text("{}")
    assert G.report_paths(tmp_path, "NVIDIA H100 80GB HBM3", when)[1].name.endswith("-2.json")


def test_a_gpu_gets_at_least_twelve_settings_at_the_full_scale(monkeypatch):
    FakeGpu(monkeypatch, [PROFILES["h100"]])
    settings = G.estimator_settings("cuda:0")
    if compat.importable("bitsandbytes"):
        assert len(settings) >= 12
    labels = list(settings)
    wanted = [r.label for r in SEED_RECIPES if compat.importable("bitsandbytes")
              or r.optimizer != "adamw8bit"]  # fmt: skip
    assert labels[: len(wanted)] == wanted
    vanilla = settings["vanilla"]
    assert (vanilla.model, vanilla.seq_len, vanilla.batch_size) == ("bert-large", 512, 4)
    assert settings["16-bit"].precision == "fp16"  # the capstone's, as in the guide
    assert "llama-400m sdpa bf16" in settings  # the decoder in bf16 where the card has it
    assert settings["qwen3-0.6b sdpa bf16 (traced)"].model == "qwen3-0.6b"  # traced estimator
    assert any(c.lora_r for c in settings.values()) and "bert-large tf32" in settings
    assert settings["llama-400m selective checkpointing bf16"].checkpoint_policy == "selective"
    assert settings["llama-400m offloaded activations bf16"].offload_activations  # GPU-checked


def test_without_bitsandbytes_the_8bit_recipes_are_left_out(monkeypatch):
    FakeGpu(monkeypatch, [PROFILES["h100"]])
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    settings = G.estimator_settings("cuda:0")
    assert not any(c.optimizer == "adamw8bit" for c in settings.values())
    assert len(settings) >= 11  # 7 recipes, the decoder, the traced family, LoRA, tf32


def test_a_t4_gets_fp16_and_no_tf32(monkeypatch):
    FakeGpu(monkeypatch, [PROFILES["t4"]])
    settings = G.estimator_settings("cuda:0")
    assert settings["16-bit"].precision == "fp16" and not any("tf32" in k for k in settings)
    assert "llama-400m sdpa fp16" in settings  # a T4 only emulates bf16


def test_the_environment_names_the_card(monkeypatch):
    FakeGpu(monkeypatch, [PROFILES["h100"]])
    env = G.environment("cuda:0")
    assert env["card"] == "NVIDIA H100 80GB HBM3" and env["compute capability"] == "9.0"
    assert "580.95.05" in env["nvml"] and "scale=full" in env["scale"]


def test_an_estimate_that_fails_is_reported_in_its_row_not_raised(monkeypatch):
    from helpers.results import Record
    from helpers.train import RunConfig

    def refuse(cfg):
        raise ValueError("install torchao to estimate this")

    monkeypatch.setattr(G, "estimate_run", refuse)
    row = G.estimator_row("x", RunConfig(), Record({}))
    assert row["error"] == (
        "measured, but the estimate failed: ValueError: install torchao to estimate this"
    )


def test_worst_category_is_the_ratio_farthest_from_one():
    row = {"predicted": {"params": 100, "activations": 90, "peak": 190},
           "tracked": {"params": 100, "activations": 100, "peak": 200}}  # fmt: skip
    assert G.worst_category(row) == ("activations", 0.9)
    assert G.worst_category({"label": "x", "error": "OutOfMemoryError"}) is None


def test_the_command_line_refuses_a_bad_deadline_and_an_unknown_lesson(capsys):
    assert cli(["gpu-check", "--deadline", "0"]) == 2
    assert "--deadline must be positive" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no notebook for lesson"):
        G.notebook_paths(("42",))


def test_speed_claims_only_report_under_gpu_check(monkeypatch):
    from helpers.timing import Claim, check_claims, interleave

    claim = Claim("a", "faster", "b")
    wrong = interleave({"a": 2.0, "b": 1.0}.get, ["a", "b"], 7, 7, [claim])  # wrong, twice
    with pytest.raises(AssertionError, match="decided the other way"):
        check_claims(wrong, [claim])
    monkeypatch.setenv("COURSE_SPEED_CLAIMS", "report")
    assert check_claims(wrong, [claim])[0].endswith(": fails")


def test_gpu_host_script_and_wheel_lists_agree_with_the_floor():
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tools"))
    try:
        import gpu_wheels
    finally:
        sys.path.pop(0)
    floor = {r.split("==")[0].lower()
             for r in gpu_wheels.requirements(root / "requirements" / "floor.txt")}  # fmt: skip
    carried = [r.split("==")[0].lower() for name in ("gpu-carry.txt", "gpu-extras.txt")
               for r in gpu_wheels.requirements(root / "requirements" / name)]  # fmt: skip
    assert not floor & set(carried), "a carried wheel would replace one of the image's packages"
    assert len(carried) == len(set(carried))
    assert {"nbclient", "ipykernel", "datasets", "bitsandbytes"} <= set(carried)
    script = (root / "tools" / "gpu_host.sh").read_text()
    assert "--no-deps" in script and "--target" in script and "gpu-check" in script


def test_readme_summarises_the_committed_gpu_reports():
    readme = (G.ROOT / "README.md").read_text()
    start = "<!-- gpu-reports: python -m helpers gpu-check --summary -->\n"
    end = "<!-- /gpu-reports -->"
    assert start in readme and end in readme, "README lacks the summary of the GPU reports"
    assert readme.split(start, 1)[1].split(end, 1)[0] == G.reports_markdown(), (
        "README's GPU reports are stale: paste python -m helpers gpu-check --summary"
    )


def test_a_gpu_report_is_summarised_with_its_lessons_and_estimator(tmp_path):
    row = {"predicted": {"peak": 99}, "tracked": {"peak": 100}, "max_allocated": 110}
    data = {"device": "cuda:0", "card": "NVIDIA H100 80GB HBM3", "estimator": [row],
            "lessons": [{"lesson": "00", "scale": "tiny", "outcome": "passed"},
                        {"lesson": "14", "scale": "full", "outcome": "passed"},
                        {"lesson": "08", "scale": "full", "outcome": "failed"}]}  # fmt: skip
    (tmp_path / "2026-12-01-nvidia-h100-80gb-hbm3.json").write_text(json.dumps(data))
    text = G.reports_markdown(tmp_path)
    assert (
        "[2026-12-01-nvidia-h100-80gb-hbm3](reports/gpu/2026-12-01-nvidia-h100-80gb-hbm3.md)"
        in text
    )
    assert "| 00 / 14 | 08 (full) | 0.990 to 0.990 (1 settings) | 0.900 to 0.900" in text


def test_on_a_gpu_part_b_caps_each_setting_and_runs_one_past_its_cap_again_alone(monkeypatch):
    """Part b's GPU branch with fakes: caps from the predicted peaks held in the card's ledger
    (shared with parts e and c), an out-of-memory under a cap measured again uncapped once the
    others are done, NVML left out of the at-once rows, the capstone's FLOP count skipped."""
    from types import SimpleNamespace

    from helpers.course.schedule import Ledger
    from helpers.results import Record
    from helpers.train import RunConfig

    names = ("big", "small", "tight", "huge", "vanilla")  # vanilla: a capstone recipe
    settings = {name: RunConfig(label=name) for name in names}
    peaks = dict(zip(names, (50 * G.GiB, 10 * G.GiB, 5 * G.GiB, 70 * G.GiB, G.GiB), strict=True))
    calls = []

    def isolated(fn, cfg, timeout):
        calls.append((cfg.label, cfg.budget, cfg.flops))
        if cfg.label == "tight" and cfg.budget:  # past its cap among others
            return SimpleNamespace(error="OutOfMemoryError: over the budget", value=None)
        return SimpleNamespace(error=None, value=Record(cfg.as_dict(), nvml_used=7))

    monkeypatch.setattr(G, "estimate_run", lambda cfg: SimpleNamespace(peak=peaks[cfg.label]))
    monkeypatch.setattr(G, "call_isolated", isolated)
    peak = {"peak": 1, "max_allocated": None}
    monkeypatch.setattr(G, "estimator_row", lambda label, cfg, record: {
        "label": label, "predicted": peak, "tracked": peak, "max_allocated": None,
        "nvml_used": record.nvml_used, "nvml_minus_reserved": 1})  # fmt: skip
    result = G.GpuCheckResult("now", "cuda:0", "a card", 9.0, card_bytes=100 * G.GiB)
    run = G._Run(G.GpuCheckConfig(device="cuda:0"), result, G.Clock(9.0), lambda: None,
                 lambda line: None, shares={"b": 8})  # fmt: skip
    ledger = Ledger(90 * G.GiB)
    part = G._part_b(run, settings, ledger)
    assert ledger.held == 0  # every cap given back
    records = G._part_b_alone(part)
    cap = {n: int(G.CAP_MARGIN * p + G.CAP_EXTRA) for n, p in peaks.items()}
    assert sorted(c[:2] for c in calls if c[1]) == sorted(
        (n, cap[n]) for n in ("big", "small", "tight", "vanilla")
    )
    # Alone, uncapped: the one past its cap, the one over the card's share (107 GiB of 90).
    assert [c[:2] for c in calls if not c[1]] == [("tight", None), ("huge", None)]
    assert {c[2] for c in calls if c[0] == "vanilla"} == {False}  # counted in the speed phase
    rows = {r["label"]: r for r in result.estimator}
    assert {n: r["phase"] for n, r in rows.items()} == {
        "big": "at once", "small": "at once", "tight": "alone", "huge": "alone",
        "vanilla": "at once"}  # fmt: skip
    assert rows["big"]["nvml_used"] is None and rows["huge"]["nvml_used"] == 7
    assert set(records) == set(settings) and result.estimator_most_at_once == 3
    assert {r["timeout_s"] for r in rows.values()} == {300}  # no throughput measured: the most
    assert result.estimator_phases == (
        "8 settings at once, caps within 90 GiB of the card, beside parts e and c"
    )


def test_the_capstone_is_timed_in_one_process_and_a_failed_timing_fails_its_row(monkeypatch):
    """Part d's quiet-card timing (``_speed_phase``) and how its timings replace the shared
    card's in part b's records (``_with_speeds``)."""
    from types import SimpleNamespace

    from helpers.results import Record
    from helpers.train import RunConfig

    settings = {"vanilla": RunConfig(label="vanilla"), "16-bit": RunConfig(label="16-bit")}
    records = {label: Record(cfg.as_dict(), samples_per_s=1.0) for label, cfg in settings.items()}
    value = {"vanilla": {"samples_per_s": 3.0, "nvml_used": 8},
             "16-bit": {"error": "RuntimeError: boom"}}  # fmt: skip
    seen = []

    def isolated(fn, cfgs, timeout):
        seen.append((fn, [c.label for c in cfgs]))
        return SimpleNamespace(error=None, value=value)

    monkeypatch.setattr(G, "call_isolated", isolated)
    result = G.GpuCheckResult("now", "cpu", "cpu", 9.0)
    run = G._Run(G.GpuCheckConfig(device="cpu"), result, G.Clock(9.0), lambda: None,
                 lambda line: None)  # fmt: skip
    speeds = G._speed_phase(run, settings)
    assert seen == [(G.measure_speeds, ["vanilla", "16-bit"])]
    assert result.speed_phase["labels"] == ["vanilla", "16-bit"]
    merged = G._with_speeds(records, speeds, settings)
    assert merged["vanilla"].samples_per_s == 3.0 and merged["vanilla"].nvml_used == 8
    assert merged["16-bit"].error == "timing alone: RuntimeError: boom"
    assert records["vanilla"].samples_per_s == 1.0  # part b's own records are left as they were
    # The process itself died: every recipe's timing is missing, said in each record.
    monkeypatch.setattr(G, "call_isolated", lambda fn, cfgs, timeout: SimpleNamespace(
        error="crashed: signal 9", value=None))  # fmt: skip
    merged = G._with_speeds(records, G._speed_phase(run, settings), settings)
    assert {r.error for r in merged.values()} == {"timing alone: crashed: signal 9"}


def test_the_side_by_side_environment_is_set_for_the_children_and_restored(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("COURSE_TEST_VALUE", "before")
    with G._environment(OMP_NUM_THREADS="2", COURSE_TEST_VALUE="inside"):
        child = subprocess.run(
            [
                sys.executable,
                "-c",
                "import os; print(os.environ['OMP_NUM_THREADS'], os.environ['COURSE_TEST_VALUE'])",
            ],
            capture_output=True,
            text=True,
        )
    assert child.stdout.split() == ["2", "inside"]
    assert "OMP_NUM_THREADS" not in os.environ and os.environ["COURSE_TEST_VALUE"] == "before"


def test_parts_b_e_and_c_share_the_slots_a_quarter_each_for_b_and_e():
    assert G.shares(8) == {"b": 2, "e": 2, "c": 4}
    assert G.shares(2) == {"b": 1, "e": 1, "c": 1} and G.shares(1) == {"b": 1, "e": 1, "c": 1}


def test_a_setting_is_given_its_predicted_seconds_times_a_margin():
    """Part b's timeout per setting: a process's start plus its steps' training FLOPs over the
    preflight's throughput, times TIMEOUT_MARGIN, within TIMEOUT_S and what the deadline leaves."""
    from helpers.train import RunConfig

    low, high = G.TIMEOUT_S
    cfg = RunConfig(model="bert-large", batch_size=8, seq_len=512, grad_accum=4,
                    gradient_checkpointing=True)  # fmt: skip
    steps = cfg.warmup + cfg.repeats + 3
    flops = G.rough_training_flops("bert-large", 8 * 512 * 4, steps, gc=True)
    assert (
        flops == 6 * 335_143_938 * 8 * 512 * 4 * steps * 4 / 3
    )  # the course's bert-large, with its head
    forty = flops / 40.0  # the throughput at which its steps take 40 s
    assert G.setting_timeout(cfg, forty, 1000.0) == pytest.approx(G.TIMEOUT_MARGIN * (5 + 40))
    assert G.setting_timeout(cfg, forty / 10, 1000.0) == high  # 400 s of steps
    assert G.setting_timeout(RunConfig(model="bert-tiny"), forty, 1000.0) == low
    assert G.setting_timeout(cfg, None, 1000.0) == high  # no throughput: the most
    assert (
        G.setting_timeout(cfg, forty, 100.0) == 90.0 and G.setting_timeout(cfg, forty, 20.0) == 30
    )
