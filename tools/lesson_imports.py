"""How many names each notebook takes from the course's package.

    python tools/lesson_imports.py          # names from its lesson module (helpers.lessons.<name>)
    python tools/lesson_imports.py --all    # names from anywhere in helpers, and the median

A name is counted once per notebook, whether imported (``from helpers.timing import Claim``)
or read from a module imported whole (``from helpers import isolate`` then ``isolate.run``:
``helpers.isolate.run``; ``from helpers.lessons import data_loading as dl`` then
``dl.loop_rounds``). The first cell's opening (``helpers.lesson.lesson``) counts too: a
learner reads it.
"""

import ast
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def _is_module(dotted: str) -> bool:
    """Whether ``helpers.x.y`` names a module or package of the checkout (not a function)."""
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def helper_names(notebook: Path, prefix: str = "helpers") -> set[str]:
    """Every ``helpers...`` name under ``prefix`` that a notebook's code cells use."""
    names: set[str] = set()
    modules: dict[str, str] = {}  # a local name -> the helpers module it stands for
    trees = _trees(notebook)
    for node in (n for tree in trees for n in ast.walk(tree)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("helpers"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if _is_module(full):
                    modules[alias.asname or alias.name] = full
                else:
                    names.add(full)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("helpers") and alias.asname:
                    modules[alias.asname] = alias.name
    for node in (n for tree in trees for n in ast.walk(tree)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in modules:
                names.add(f"{modules[node.value.id]}.{node.attr}")
    return {n for n in names if n.startswith(prefix + ".")}


def lesson_imports(notebook: Path) -> dict[str, set[str]]:
    """The names a notebook's code cells take from each helpers.lessons module."""
    found: dict[str, set[str]] = {}
    for name in helper_names(notebook, "helpers.lessons"):
        module, _, attr = name.rpartition(".")
        found.setdefault(module, set()).add(attr)
    return found


def main(argv: list[str]) -> int:
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    if argv == ["--all"]:
        counts = {nb.stem: len(helper_names(nb)) for nb in notebooks}
        for stem, n in counts.items():
            print(f"{stem:32} {n:3d}")
        print(f"{'median':32} {statistics.median(counts.values()):5.1f}")
        return 0
    for notebook in notebooks:
        counts = lesson_imports(notebook)
        total = sum(len(v) for v in counts.values())
        print(f"{notebook.stem:32} {total:3d}  {', '.join(sorted(counts))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
