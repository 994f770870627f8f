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


# The slowest test files, seconds in all on 2 cores (pytest --durations=0, 2026-11-30). make
# test-unit runs each file in one of two workers (pytest-xdist --dist loadfile, with
# --no-loadscope-reorder so that this order holds): the longest start first, so that no long
# file is left to one worker at the end while the other idles.
SLOWEST_FILES = {
    "test_traced.py": 105, "test_plan.py": 71, "test_memory_savers.py": 69,
    "test_recipes.py": 58, "test_estimate.py": 55, "test_fsdp_settings.py": 55,
    "test_memory.py": 47, "test_gpu_check.py": 44, "test_beyond_one_gpu.py": 35,
    "test_accelerate_loop.py": 34, "test_full_scale_on_fake_tensors.py": 28,
    "test_fullscale.py": 21, "test_activation_settings.py": 21, "test_more_memory.py": 18,
    "test_timeline.py": 18, "test_bf16_weights.py": 18,
}  # fmt: skip


def pytest_collection_modifyitems(items) -> None:
    """The slowest files first (``SLOWEST_FILES``); the others, and each file's tests, in the
    order collected."""
    items.sort(key=lambda item: -SLOWEST_FILES.get(item.path.name, 0))


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
