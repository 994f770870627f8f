"""A function a lesson writes in a notebook cell, for tests to run: the cell's own code.

The lessons write their techniques in cells (the cell is what the lesson measures); a test
that needs the technique takes it from the notebook instead of keeping a copy of its own.
"""

from __future__ import annotations

import ast
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


def cell_definition(notebook: str, name: str) -> ast.FunctionDef:
    """The syntax tree of the function ``name`` as a code cell of ``notebook`` writes it (to
    hold it to a module's copy: ``ast.dump`` leaves comments and formatting out)."""
    for cell in json.loads((NOTEBOOKS / notebook).read_text())["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or f"def {name}(" not in source:
            continue  # (other cells may hold IPython magics, which are not Python)
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                return node
    raise AssertionError(f"no code cell of {notebook} defines {name}()")
