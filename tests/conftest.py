"""Fixtures shared by several test files."""

from __future__ import annotations

import os

import pytest

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
