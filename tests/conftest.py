"""Fixtures shared by several test files."""

from __future__ import annotations

import os
import sys

import pytest

# Under pytest-xdist each worker takes its share of the cores for torch's threads (and the
# processes it starts inherit it): two workers of two threads each on two cores wait on each
# other. On this 2-core machine the four heaviest test files took 154 and 158 s with torch's
# default, 119 and 113 s with one thread per worker, run in turns (2026-11-30).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1 and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    _threads = max(1, (_cores or 1) // _workers)
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    if "torch" in sys.modules:  # imported by a plugin before this file: set it there too
        sys.modules["torch"].set_num_threads(_threads)

# The helpers' tests check how timed rounds are run and counted, on whatever this machine is
# doing meanwhile: no round is set aside for other processes' load here (helpers.timing,
# $COURSE_OTHERS_LIMIT), or a busy CI machine would change the counts they assert. Set before
# any fork server starts, so every child inherits it. The tests of the set-aside rule pass
# their own limit (tests/test_compare.py); the notebooks (make test-notebooks) run with it on.
os.environ["COURSE_OTHERS_LIMIT"] = "off"
# The tests check claims that are wrong on purpose: they must not land in the claims log of the
# run that calls pytest (make compat exports $COURSE_CLAIMS for its whole target, and its
# summary then counted the tests' claims as confirmed wrong). Tests that read a log set their own.
os.environ.pop("COURSE_CLAIMS", None)


@pytest.fixture
def cli_refuses(capsys):
    """``cli_refuses(argv)``: ``python -m helpers ARGV`` exits 2 with one "error: ..." line."""
    from helpers.course.cli import main

    def check(argv: list[str]) -> str:
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
        assert code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ")
        return lines[0]

    return check
