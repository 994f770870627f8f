"""A function a lesson writes in a notebook cell, for tests to run: the cell's own code.

The lessons write their techniques in cells (the cell is what the lesson measures); a test
that needs the technique takes it from the notebook instead of keeping a copy of its own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def cell_function(notebook: str, name: str, **scope):
    """The function or class ``name`` as the code cell of ``notebook`` that defines it writes
    it. The cell runs alone, with torch and ``scope`` (what the notebook's earlier cells give
    it) as its globals: it defines things and computes nothing."""
    cells = json.loads((NOTEBOOKS / notebook).read_text())["cells"]
    for cell in cells:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and re.search(rf"^(def|class) {name}\b", source, re.M):
            # __main__, as in a kernel: helpers.isolate sends such a function by value
            scope = {"__name__": "__main__", "torch": torch, **scope}
            exec(compile(source, f"{notebook}: {name}", "exec"), scope)
            return scope[name]
    raise LookupError(f"no code cell of {notebook} defines {name}")
