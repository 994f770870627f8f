"""Fixtures shared by several test files."""

from __future__ import annotations

import pytest


@pytest.fixture
def cli_refuses(capsys):
    """``cli_refuses(argv)``: ``python -m helpers ARGV`` exits 2 with one "error: ..." line."""
    from helpers.cli import main

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
