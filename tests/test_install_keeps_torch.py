"""Installing the course into an environment that already has torch keeps that torch.

pyproject.toml states ranges whose floors are the oldest tested versions (what GPU images
ship). pip keeps an installed package that satisfies a requirement, so the proof is pip's own
resolver, offline: ``pip install --dry-run --no-index`` of pyproject's requirements succeeds only
if everything it needs is already installed, and its report then lists nothing to install.
Each pip run takes one to two seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.test_repo_consistency import ROOT, _pyproject, floor_pins

# The floor environment of make compat; a checkout without one (CI) skips that case. A
# worktree can name another checkout's with COURSE_FLOOR_VENV.
FLOOR_VENV = Path(os.environ.get("COURSE_FLOOR_VENV", ROOT / ".venv-compat"))


def _dry_run(python: str | Path, requirements: list[str], pythonpath: str = "") -> tuple[int, str]:
    """pip's answer, offline, for installing ``requirements`` with ``python``: (exit code, the
    JSON report on success or pip's error)."""
    env = {**os.environ, "PYTHONPATH": pythonpath, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    command = [str(python), "-m", "pip", "install", "--dry-run", "--no-index", "--quiet"]
    done = subprocess.run(
        [*command, "--report", "-", *requirements],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )
    return done.returncode, done.stdout if done.returncode == 0 else done.stderr


def _would_install(python: str | Path, requirements: list[str], pythonpath: str = "") -> list:
    code, out = _dry_run(python, requirements, pythonpath)
    assert code == 0, f"pip could not keep what is installed for {requirements}:\n{out}"
    return [item["metadata"]["name"] for item in json.loads(out)["install"]]


def _installed_extras() -> list[str]:
    """pyproject's extra requirements this environment has (make's .venv: all of them)."""
    found = []
    for lines in _pyproject()["project"]["optional-dependencies"].values():
        try:
            [version(Requirement(line).name) for line in lines]
        except PackageNotFoundError:
            continue
        found.extend(lines)
    return found


def test_installing_the_course_here_installs_nothing():
    # This environment (CI's: the lock's versions) already satisfies every range, so pip
    # resolves the course against it without an index and replaces nothing.
    core = list(_pyproject()["project"]["dependencies"])
    assert (
        _would_install(sys.executable, core + _installed_extras(), os.environ.get("PYTHONPATH", ""))
        == []
    )


def test_a_floor_above_the_installed_torch_is_caught():
    # The same dry run fails when a range would make pip replace the installed torch, so the
    # check above can fail.
    newer = Version(version("torch")).release
    floor = f"torch>={newer[0]}.{newer[1] + 1}"
    code, out = _dry_run(sys.executable, [floor], os.environ.get("PYTHONPATH", ""))
    assert code != 0 and "torch" in out, out


def test_installing_the_course_at_the_floor_keeps_torch_and_transformers():
    python = FLOOR_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no floor environment at {FLOOR_VENV} (make compat builds it)")
    carried = FLOOR_VENV / "carried"  # datasets and the notebook runner, as make compat adds
    probe = "import torch, transformers; print(torch.__version__, transformers.__version__)"
    versions = subprocess.run(
        [str(python), "-c", probe], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    floor = floor_pins()
    assert [Version(v).public for v in versions] == [floor["torch"], floor["transformers"]]
    core = list(_pyproject()["project"]["dependencies"])
    assert _would_install(python, core, str(carried)) == []
