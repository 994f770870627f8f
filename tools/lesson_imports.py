"""How many names each notebook takes from its lesson module (helpers.lessons.<name>).

    python tools/lesson_imports.py          # notebook, names, modules

A module imported whole (``from helpers.lessons import data_loading as dl``) counts the names
the notebook reads from it (``dl.loop_rounds``).
"""

import ast
import json
import sys
from pathlib import Path


def _trees(notebook: Path) -> list[ast.AST]:
    """Each code cell's syntax tree (IPython magics and shell lines left out)."""
    trees = []
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        lines = "".join(cell["source"]).splitlines()
        code = "\n".join(x for x in lines if not x.lstrip().startswith(("%", "!")))
        try:
            trees.append(ast.parse(code))
        except SyntaxError:
            continue
    return trees


def lesson_imports(notebook: Path) -> dict[str, set[str]]:
    """The names a notebook's code cells take from each helpers.lessons module."""
    found: dict[str, set[str]] = {}
    modules: dict[str, str] = {}  # a local name -> the helpers.lessons module it is
    trees = _trees(notebook)
    for node in (n for tree in trees for n in ast.walk(tree)):
        if not isinstance(node, ast.ImportFrom) or not node.module:
            continue
        if node.module == "helpers.lessons":
            modules.update({a.asname or a.name: f"helpers.lessons.{a.name}" for a in node.names})
        elif node.module.startswith("helpers.lessons."):
            found.setdefault(node.module, set()).update(a.asname or a.name for a in node.names)
    for node in (n for tree in trees for n in ast.walk(tree)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in modules:
                found.setdefault(modules[node.value.id], set()).add(node.attr)
    return found


def main() -> int:
    root = Path(__file__).resolve().parents[1] / "notebooks"
    for notebook in sorted(root.glob("*.ipynb")):
        counts = lesson_imports(notebook)
        total = sum(len(v) for v in counts.values())
        print(f"{notebook.stem:32} {total:3d}  {', '.join(sorted(counts))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
