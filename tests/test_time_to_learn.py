"""Each lesson's "## Time to learn" figure stays near what its own text and code take to study.

The rule (README, "A path for the time you have"): reading the markdown at 200 words a minute,
reading the code at 30 non-blank lines a minute, 20 seconds looking at each code cell's output,
1 minute of running (each notebook runs in about a minute at the tiny scale on 2 CPU cores) and
5 minutes for the "Try it" section. A stated figure passes between 0.6x and 2.5x of that
estimate: reading speed alone ranges from about 150 to 300 words a minute (0.67x to 1.33x of
200), so a figure below 0.6x could only be met by skimming; above 2.5x the figure promises far
more than the lesson holds, since even slow study and repeated "Try it" runs stay within it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PROSE_WPM, CODE_LPM, LOOK_S, RUN_MIN, TRY_MIN = 200, 30, 20, 1, 5
LOW, HIGH = 0.6, 2.5
STATED = re.compile(r"^## Time to learn\s*\nAbout (\d+) minutes", re.M)


def estimate_minutes(path: Path) -> float:
    """Minutes to study a notebook by the rule above."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    words = sum(len("".join(c["source"]).split()) for c in cells if c["cell_type"] == "markdown")
    code = [c for c in cells if c["cell_type"] == "code"]
    lines = sum(1 for c in code for line in "".join(c["source"]).splitlines() if line.strip())
    return words / PROSE_WPM + lines / CODE_LPM + len(code) * LOOK_S / 60 + RUN_MIN + TRY_MIN


def stated_minutes(path: Path) -> int:
    """The figure in the notebook's "## Time to learn" section ("About N minutes")."""
    text = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"][:3])
    found = STATED.search(text)
    assert found, f'{path.name}: no "## Time to learn" with "About N minutes" near the top'
    return int(found.group(1))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_time_to_learn_matches_the_lesson(path: Path):
    estimate, stated = estimate_minutes(path), stated_minutes(path)
    assert LOW * estimate <= stated <= HIGH * estimate, (
        f"{path.name} says {stated} min; its words and code estimate {estimate:.0f} min "
        f"(allowed {LOW * estimate:.0f}-{HIGH * estimate:.0f}): update the figure"
    )


def test_the_rule_counts_what_a_notebook_holds(tmp_path: Path):
    cell = {"metadata": {}, "source": []}
    cells = [
        {**cell, "cell_type": "markdown", "source": ["## Time to learn\n", "About 9 minutes.\n"]},
        {**cell, "cell_type": "markdown", "source": [" ".join(["word"] * 393)]},
        {**cell, "cell_type": "code", "source": ["x = 1\n", "\n", "y = 2\n"] * 15},
    ]
    path = tmp_path / "99_example.ipynb"
    path.write_text(json.dumps({"cells": cells}))
    # 400 words (2 min) + 30 non-blank lines (1 min) + one cell's output (1/3 min) + 1 + 5.
    assert estimate_minutes(path) == pytest.approx(2 + 1 + 1 / 3 + 1 + 5)
    assert stated_minutes(path) == 9


def test_readme_states_the_rule_and_the_whole_course():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for number in (f"{PROSE_WPM} words a minute", f"{CODE_LPM} lines of code a minute"):
        assert number in readme, f"README no longer states the rule's {number!r}"
    found = re.search(r"the whole course \(about (\d+) hours", readme, re.I)
    assert found, "README's paths: no 'the whole course (about N hours'"
    total_hours = sum(stated_minutes(p) for p in NOTEBOOKS) / 60
    assert abs(int(found.group(1)) - total_hours) <= 1, (found.group(1), total_hours)
