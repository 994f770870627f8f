#!/usr/bin/env python3
"""Download the wheels a GPU run carries to a host that has only its image's libraries.

    python tools/gpu_wheels.py                     # .whl/core and .whl/extras, for Python 3.12
    python tools/gpu_wheels.py --core-only --python-version 3.11 --dest .whl-3.11

Each requirements file (``requirements/gpu-carry.txt``: the notebook runner and datasets;
``requirements/gpu-extras.txt``: bitsandbytes, deepspeed, torchao, liger-kernel) lists exact
versions and every dependency the host lacks, so the download takes no dependencies
(``--no-deps``). A package with no wheel on PyPI (deepspeed publishes only its source) is
built into a wheel here. At the end it prints what would travel to the host: the working tree
(tracked and untracked, not ignored) plus the wheels, and exits 1 past the limit (64 MiB).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 64 * 2**20  # what a device call carries at most: working tree + carried paths
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_12_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]  # fmt: skip
SOURCE_ONLY = {"deepspeed"}  # no wheel on PyPI: built here (pure Python, ops compiled on use)


def requirements(path: Path) -> list[str]:
    """The ``name==version`` lines of a requirements file."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def _name(requirement: str) -> str:
    return requirement.split("==")[0].strip().lower().replace("_", "-")


def download(reqs: list[str], dest: Path, python_version: str) -> None:
    """Binary wheels for ``python_version`` on manylinux x86_64; source-only ones built here."""
    dest.mkdir(parents=True, exist_ok=True)
    binary = [r for r in reqs if _name(r) not in SOURCE_ONLY]
    source = [r for r in reqs if _name(r) in SOURCE_ONLY]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    pip = [sys.executable, "-m", "pip"]
    if binary:
        subprocess.run([*pip, "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "--python-version", python_version, "--implementation", "cp",
                        *platforms, "-d", str(dest), *binary], check=True)  # fmt: skip
    for req in source:
        subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "-w", str(dest), req], check=True)


def tree_bytes() -> int:
    """Bytes of the working tree a device call sends: tracked and untracked-not-ignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout  # fmt: skip
    files = [ROOT / name for name in out.decode().split("\0") if name]
    return sum(f.stat().st_size for f in files if f.is_file())


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl")
    parser.add_argument("--python-version", default="3.12", help="the host's Python (3.12)")
    parser.add_argument("--core-only", action="store_true", help="leave the extras out")
    args = parser.parse_args(argv)
    parts = {"core": ROOT / "requirements" / "gpu-carry.txt"}
    if not args.core_only:
        parts["extras"] = ROOT / "requirements" / "gpu-extras.txt"
    for part, path in parts.items():
        folder = args.dest / part
        wanted = requirements(path)
        have = {_name(w.name.split("-")[0]) + "==" + w.name.split("-")[1]
                for w in folder.glob("*.whl")}  # fmt: skip
        missing = [r for r in wanted if f"{_name(r)}=={r.split('==')[1].strip()}" not in have]
        if missing:
            download(missing, folder, args.python_version)
        print(f"{folder}: {len(wanted)} packages, {folder_bytes(folder) / 2**20:.1f} MiB")
    wheels, tree = folder_bytes(args.dest), tree_bytes()
    total = wheels + tree
    print(f"a device call carries {total / 2**20:.1f} MiB: the working tree {tree / 2**20:.1f} "
          f"MiB + wheels {wheels / 2**20:.1f} MiB (limit {LIMIT / 2**20:.0f} MiB)")  # fmt: skip
    if total > LIMIT:
        print("over the limit: carry fewer wheels (requirements/gpu-extras.txt)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
