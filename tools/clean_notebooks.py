#!/usr/bin/env python3
"""Strip outputs, execution counts and stray metadata from notebooks, in place.

The course commits its notebooks without outputs (tests/test_repo_consistency.py checks it).
This script makes a notebook pass that check:

- code cells: ``outputs = []``, ``execution_count = None``;
- cell metadata: only ``tags`` is kept, and only the tags the course uses;
- notebook metadata: only ``kernelspec`` and ``language_info`` (reduced to its name, so the
  author's Python patch version does not show up in diffs);
- missing or duplicate cell ids are replaced by fresh ones.

Usage::

    python tools/clean_notebooks.py                 # every notebooks/*.ipynb
    python tools/clean_notebooks.py a.ipynb dir/    # these files / folders
    python tools/clean_notebooks.py --check         # change nothing, exit 1 if any is dirty

Only the standard library is used, so it runs before the course is installed. The file is
written the way Jupyter writes it (one-space indent, sorted keys, source split into lines).
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path

ALLOWED_TAGS = ("nbval-check-output", "nbval-skip", "nbval-ignore-output", "raises-exception")
ALLOWED_NOTEBOOK_METADATA = ("kernelspec", "language_info")
DEFAULT_KERNELSPEC = {
    "display_name": "Python 3 (ipykernel)",
    "language": "python",
    "name": "python3",
}
MULTILINE_FIELDS = ("source",)

REPO_ROOT = Path(__file__).resolve().parent.parent


def _split_lines(text: str | list[str]) -> list[str]:
    if isinstance(text, list):
        text = "".join(text)
    return text.splitlines(keepends=True)


def clean_notebook(nb: dict, name: str = "") -> list[str]:
    """Clean ``nb`` in place; return messages about what was dropped that the author chose."""
    notes: list[str] = []
    seen_ids: set[str] = set()
    for index, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        metadata = cell.get("metadata", {})
        tags = metadata.get("tags", [])
        kept = [tag for tag in tags if tag in ALLOWED_TAGS]
        for tag in tags:
            if tag not in ALLOWED_TAGS:
                notes.append(f"{name}: cell {index}: dropped tag {tag!r}")
        cell["metadata"] = {"tags": kept} if kept else {}
        for field in MULTILINE_FIELDS:
            if field in cell:
                cell[field] = _split_lines(cell[field])
        cell_id = cell.get("id")
        if not cell_id or cell_id in seen_ids:
            cell["id"] = uuid.uuid4().hex[:8]
        seen_ids.add(cell["id"])

    metadata = nb.get("metadata", {})
    cleaned = {key: metadata[key] for key in ALLOWED_NOTEBOOK_METADATA if key in metadata}
    cleaned.setdefault("kernelspec", dict(DEFAULT_KERNELSPEC))
    cleaned["language_info"] = {"name": "python"}
    nb["metadata"] = cleaned
    # Cell ids need nbformat 4.5 or later.
    if nb.get("nbformat") == 4 and nb.get("nbformat_minor", 0) < 5:
        nb["nbformat_minor"] = 5
    return notes


def dumps(nb: dict) -> str:
    return json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def collect(paths: list[str]) -> list[Path]:
    if not paths:
        return sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found.extend(sorted(path.glob("*.ipynb")))
        else:
            found.append(path)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="notebooks or folders (default: notebooks/)")
    parser.add_argument("--check", action="store_true", help="report dirty notebooks, change none")
    args = parser.parse_args(argv)

    dirty = 0
    for path in collect(args.paths):
        original = path.read_text(encoding="utf-8")
        nb = json.loads(original)
        for note in clean_notebook(nb, str(path)):
            print(note, file=sys.stderr)
        text = dumps(nb)
        if text == original:
            continue
        dirty += 1
        if args.check:
            print(f"would clean {path}")
        else:
            path.write_text(text, encoding="utf-8")
            print(f"cleaned {path}")
    if args.check and dirty:
        print(
            f"{dirty} notebook(s) need cleaning: python tools/clean_notebooks.py", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
