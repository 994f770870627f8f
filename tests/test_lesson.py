"""A lesson's opening line, ``L = lesson("NN")``: it starts the fork server with the lesson's
preload before anything else, and ``print(L)`` carries the versions note; ``L.save`` keeps a
record with its speed from an interleaved comparison."""

from __future__ import annotations

from dataclasses import replace

import helpers.lesson as lesson_module
from helpers import results
from helpers.lesson import lesson
from helpers.results import Record
from helpers.timing import Comparison


def _record_starts(monkeypatch) -> list[tuple[str, ...]]:
    started: list[tuple[str, ...]] = []
    monkeypatch.setattr(lesson_module.forkserver, "start", lambda *extra: started.append(extra))
    return started


def test_the_fork_server_starts_with_the_lessons_preload(monkeypatch):
    started = _record_starts(monkeypatch)
    lesson("13", device="cpu")
    lesson("03", device="cpu")
    lesson("99", device="cpu")  # a scratch notebook's number: the usual preload
    assert started == [("peft",), (), ()]


def test_print_names_the_scale_then_any_library_outside_the_tested_versions(monkeypatch):
    _record_starts(monkeypatch)
    monkeypatch.setattr(lesson_module, "untested_versions", lambda: "")
    quiet = str(lesson("05", scale="tiny", device="cpu"))
    assert quiet.startswith("Lesson 05. ") and "\n" not in quiet, quiet
    note = "Outside the versions this course is tested with: torch 99.0 (tested ...)."
    monkeypatch.setattr(lesson_module, "untested_versions", lambda: note)
    shown = str(lesson("05", scale="tiny", device="cpu"))
    assert shown == f"{quiet}\n{note}"


def test_save_with_a_comparison_keeps_the_speed_of_its_rounds(monkeypatch, tmp_path):
    _record_starts(monkeypatch)
    monkeypatch.setenv(results.RESULTS_ENV, str(tmp_path / "results.jsonl"))
    L = lesson("03", scale="tiny", device="cpu")
    rounds = Comparison({"1x4": [1.0, 3.0, 2.0]})  # seconds per sample, round by round
    record = Record({"batch_size": 1, "grad_accum": 4, "seq_len": 8, "label": "encoder 1x4"})
    saved = L.save(record, speed=rounds, label="1x4")
    assert saved == replace(results.with_speed(record, rounds, "1x4"), lesson="03")
    assert saved.step_times == [4.0, 12.0, 8.0] and saved.samples_per_s == 0.5
    assert results.load(tmp_path / "results.jsonl") == [saved]
    assert L.save(record) == replace(record, lesson="03")  # without a comparison: as it was
