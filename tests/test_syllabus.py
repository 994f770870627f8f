"""helpers/syllabus.py is the one list of lessons: everything else that names lessons agrees.

Adding a lesson adds a row there, its notebook and its module; these tests say what else is
missing (README's row, what it runs on a card) and catch a lesson named anywhere that the
table does not have.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import compat
from helpers.syllabus import LESSONS, NUMBERS, by_gpu_rank, lesson_entry

ROOT = Path(__file__).resolve().parents[1]


def _numbers(spec: str) -> set[str]:
    """compat's lesson field ("02-07 12 14", "06-08, 13-15") as lesson numbers."""
    out = set()
    for a, b in re.findall(r"(\d\d)(?:-(\d\d))?", spec):
        out.update(f"{i:02d}" for i in range(int(a), int(b or a) + 1))
    return out


def test_notebooks_are_the_table():
    """notebooks/ holds exactly the table's notebooks, numbered in order."""
    on_disk = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert on_disk == [e.notebook for e in LESSONS]
    assert list(NUMBERS) == sorted(NUMBERS) and len(set(NUMBERS)) == len(NUMBERS)


def test_each_lesson_module_is_in_the_table():
    """A lesson with a module has helpers/lessons/<name>.py; every such module is a lesson's."""
    modules = {p.stem for p in (ROOT / "helpers" / "lessons").glob("*.py")} - {"__init__"}
    assert modules == {e.name for e in LESSONS if e.module}
    for e in LESSONS:
        if e.module:
            assert importlib.util.find_spec(e.module_name) is not None, e.module_name


def test_timed_lessons_are_the_ones_checking_speed_claims():
    """``timed`` (make load-test's list) marks exactly the notebooks that call check_claims."""
    for e in LESSONS:
        source = (ROOT / "notebooks" / e.notebook).read_text()
        assert e.timed == ("check_claims(" in source), (
            f"{e.notebook}: timed={e.timed} in helpers/syllabus.py, but the notebook "
            f"{'does' if not e.timed else 'does not'} check speed claims"
        )


def test_readme_rows_carry_the_table_titles():
    """README's lesson table: one row per lesson, its title linking its notebook."""
    readme = (ROOT / "README.md").read_text()
    for e in LESSONS:
        row = f"| {e.number} | [{e.title}](notebooks/{e.notebook}) |"
        assert row in readme, f"README's lesson table lacks the row starting {row}"


def test_fullscale_has_what_each_lesson_runs_on_a_card():
    from helpers.course.fullscale import BUILDERS

    assert sorted(BUILDERS) == list(NUMBERS)


def test_gpu_order_is_every_lesson_once():
    from helpers.course.gpu_check import FULL_ORDER

    assert FULL_ORDER == by_gpu_rank()
    assert sorted(FULL_ORDER) == list(NUMBERS)
    ranks = [e.gpu_rank for e in LESSONS]
    assert len(set(ranks)) == len(ranks), "two lessons share a GPU rank"


def test_lessons_named_elsewhere_exist():
    """compat's package rows, the preflight's checks and the cheat sheet name table lessons."""
    from helpers.course.cheatsheet import METHODS
    from helpers.course.preflight import CHECKS

    for p in compat.REQUIRED + compat.OPTIONAL:
        if p.lessons != "all":
            assert _numbers(p.lessons) and _numbers(p.lessons) <= set(NUMBERS), p
    for name, lessons, *_ in CHECKS:
        assert set(lessons) <= set(NUMBERS), name
    for m in METHODS:
        lesson_entry(m.lesson)


def test_an_unknown_lesson_names_the_lessons():
    with pytest.raises(ValueError, match="no lesson '18': the lessons are 00, 01"):
        lesson_entry("18")


def test_command_line_lists_the_timed_notebooks():
    out = subprocess.run(
        [sys.executable, "-m", "helpers.syllabus", "--timed"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert out == [f"notebooks/{e.notebook}" for e in LESSONS if e.timed]
    assert "notebooks/07_accelerate_loop.ipynb" not in out


def test_makefile_reads_the_table():
    """make load-test's notebooks come from the table (no second list to keep)."""
    makefile = (ROOT / "Makefile").read_text()
    assert "TIMING_NOTEBOOKS = $(shell $(PYTHON) -m helpers.syllabus --timed)" in makefile
    assert not re.search(r"notebooks/\d\d_\w+\.ipynb", makefile)
