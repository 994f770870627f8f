"""The import graph of ``helpers``, imports inside functions included.

Every ``helpers/**/*.py`` is parsed with ``ast``; each ``import``/``from ... import`` is
resolved to the helpers module it names (relative forms and ``from helpers import x`` where x
is a submodule included). An import is *deferred* when it sits inside a function body, and
*top-level* otherwise (module body, ``if``/``try`` at module level, class bodies).

    python tools/import_graph.py            # summary: cycles, deferred imports, repeats
    python tools/import_graph.py --edges    # every helpers-to-helpers edge, one a line

tests/test_layers.py uses ``build`` to keep the layers.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "helpers"


@dataclass(frozen=True)
class Import:
    """One import statement's target, as found in one module."""

    source: str  # importing module, dotted (helpers.estimator.api)
    target: str  # imported module, dotted; a helpers module or a third-party top-level name
    line: int
    deferred: bool  # inside a function body


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    names = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _package_of(module: str, path: Path) -> str:
    """The package a relative import in ``module`` is resolved against."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve_from(node: ast.ImportFrom, module: str, path: Path, known: set[str]) -> list[str]:
    """Targets of one ``from X import a, b``: X itself, or X.a where that is a module."""
    if node.level:
        base = _package_of(module, path)
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        stem = f"{base}.{node.module}" if node.module else base
    else:
        stem = node.module or ""
    targets = []
    for alias in node.names:
        sub = f"{stem}.{alias.name}"
        targets.append(sub if sub in known else stem)
    return targets


def _walk(tree: ast.AST):
    """(node, inside a function) for every import node of a module."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, deferred = stack.pop()
        for child in ast.iter_child_nodes(node):
            inner = deferred or isinstance(child, functions)
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, deferred
            stack.append((child, inner))


def _top_name(target: str, known: set[str]) -> str:
    """A helpers module as named; anything else by its top-level package."""
    return target if target in known else target.split(".")[0]


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    """Every import of one module (helpers targets by module, others by top-level name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node, deferred in _walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
            targets = [_longest_known(t, known) for t in targets]
        else:
            targets = _resolve_from(node, module, path, known)
        for target in targets:
            found.append(Import(module, _top_name(target, known), node.lineno, deferred))
    return sorted(set(found), key=lambda i: (i.line, i.target))


def _longest_known(dotted: str, known: set[str]) -> str:
    """``import helpers.estimator.api`` names helpers.estimator.api; unknown names stay."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return dotted


def build(root: Path = ROOT) -> list[Import]:
    """Every import of every helpers module."""
    names = module_names(root)
    known = set(names)
    return [imp for name, path in names.items() for imp in imports_of(name, path, known)]


def internal(imports: list[Import]) -> list[Import]:
    """The helpers-to-helpers imports (a package importing its own parent excluded)."""
    return [
        i
        for i in imports
        if i.target.split(".")[0] == PACKAGE and i.target != i.source and i.target != PACKAGE
    ]


def cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), largest first."""
    graph: dict[str, set[str]] = {}
    for imp in internal(imports):
        graph.setdefault(imp.source, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found, key=len, reverse=True)


def summary(imports: list[Import]) -> dict:
    """Counts for the issue: cycles, deferred helpers imports, deferred ones repeating a top one."""
    inner = internal(imports)
    top = {(i.source, i.target) for i in inner if not i.deferred}
    deferred = [i for i in inner if i.deferred]
    return {
        "modules": len({i.source for i in imports}),
        "helpers_imports": len(inner),
        "deferred_helpers_imports": len(deferred),
        "deferred_repeating_top_level": sum((i.source, i.target) in top for i in deferred),
        "deferred_third_party": sum(1 for i in imports if i.deferred and i not in inner),
        "cycles": cycles(imports),
    }


def main(argv: list[str] | None = None) -> int:
    """Print the summary, or every helpers-to-helpers edge."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="print every internal edge")
    args = parser.parse_args(argv)
    imports = build()
    if args.edges:
        for i in internal(imports):
            where = "deferred" if i.deferred else "top"
            print(f"{i.source}:{i.line} -> {i.target} ({where})")
        return 0
    counts = summary(imports)
    for key, value in counts.items():
        if key != "cycles":
            print(f"{key}: {value}")
    print(f"cycles: {len(counts['cycles'])}")
    for component in counts["cycles"]:
        print(f"  {len(component)} modules: {', '.join(component)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
