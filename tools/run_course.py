#!/usr/bin/env python3
"""Run notebooks in order as ``make course`` does: each executed, timed, kept; then the tables.

    python tools/run_course.py notebooks/*.ipynb                # executed copies in build/executed
    python tools/run_course.py --out /tmp/run notebooks/05_mixed_precision.ipynb --no-tables

A notebook that fails does not stop the others: its error is printed where it happened, and
the run ends by listing the failed notebooks and exiting 1. The tables (``python -m helpers
summary``, ``capstone``, ``cheatsheet``, ``claims``) read the results the notebooks saved
($COURSE_RESULTS).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def execute(path: Path, out_dir: Path) -> str | None:
    """Execute ``path`` in its own folder; write the executed copy; the error, if it failed."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=None, resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
        return None
    except CellExecutionError as err:  # a cell raised: its traceback
        return str(err)
    except Exception as err:  # the kernel died (out of RAM, killed), or could not start
        return f"{type(err).__name__}: {err}"
    finally:
        out_dir.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out_dir / path.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=Path("build/executed"))
    parser.add_argument("--no-tables", action="store_true", help="skip the tables at the end")
    args = parser.parse_args(argv)
    failed = []
    for n, path in enumerate(args.notebooks, 1):
        tag = f"=== [{n}/{len(args.notebooks)}] {path}"
        print(tag, flush=True)
        start = time.perf_counter()
        error = execute(path, args.out)
        took = time.perf_counter() - start
        if error is None:
            print(f"{tag} done in {took:.0f} s", flush=True)
        else:
            print(error, file=sys.stderr)
            print(f"{tag} FAILED after {took:.0f} s", flush=True)
            failed.append(path)
    print(f"Executed notebooks are in {args.out}/")
    if not args.no_tables:
        from helpers.course.cli import main as helpers_cli

        for table in ("summary", "capstone", "cheatsheet", "claims"):
            helpers_cli([table])
            print()
    if failed:
        print("Failed notebooks (the error is printed above each FAILED line):")
        print("".join(f"  {p}\n" for p in failed), end="")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
