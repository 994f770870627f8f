"""The recipes (``recipes/*.py``) as the lessons show them: each one's change against the base.

A recipe is ``recipes/base.py`` plus one technique, every changed line between a
``# >>> title`` line and a ``# <<<`` line. ``recipe_diff("accumulation")`` is that change as
a unified diff a notebook displays (rendered as a diff in JupyterLab, plain text elsewhere);
``stray_changes`` lists what a recipe changes outside its blocks (tests/test_recipes.py keeps
it empty). Reading files only: the recipes import nothing from the course, and this module
runs none of them.
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
BEGIN, END = "# >>>", "# <<<"


def recipe_path(name: str) -> Path:
    """recipes/<name>.py, or a FileNotFoundError that says where the recipes should be."""
    path = RECIPES / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(
            f"no recipe {name!r} in {RECIPES}: the recipes come with the course's repository "
            "(git clone it); an installed helpers package alone does not have them"
        )
    return path


def body_lines(name: str) -> list[str]:
    """A recipe's lines after its module docstring (each recipe's docstring is its own)."""
    text = recipe_path(name).read_text()
    body = ast.parse(text).body
    docstring = body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    return text.splitlines()[body[0].end_lineno if docstring else 0 :]


def marked(lines: list[str]) -> list[bool]:
    """Which lines belong to a marked block, marker lines included (ValueError if the markers
    do not pair up)."""
    inside, out = False, []
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if inside:
                raise ValueError(f"line {number}: a block opens inside another: {line!r}")
            inside = True
        out.append(inside)
        if stripped.startswith(END):
            if not inside:
                raise ValueError(f"line {number}: a block closes that never opened: {line!r}")
            inside = False
    if inside:
        raise ValueError("a marked block is never closed")
    return out


def stray_changes(name: str) -> list[str]:
    """What recipes/<name>.py changes against the base outside its marked blocks (empty for a
    well-formed recipe): lines added or replaced there, and base lines removed with no block
    at that place to say why."""
    base, recipe = body_lines("base"), body_lines(name)
    inside = marked(recipe)
    problems = []
    matcher = difflib.SequenceMatcher(a=base, b=recipe, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            continue
        if j2 > j1:
            problems += [f"changed: {recipe[j]!r}" for j in range(j1, j2) if not inside[j]]
        elif not any(inside[j] for j in (j1 - 1, j1) if 0 <= j < len(recipe)):
            problems += [f"removed without a block: {line!r}" for line in base[i1:i2]]
    return problems


@dataclass
class RecipeDiff:
    """A recipe's change against the base: ``text`` is a unified diff."""

    name: str
    text: str
    added: int  # lines the recipe adds or puts in place of the base's (marker lines included)
    removed: int  # base lines it takes out

    def __str__(self) -> str:
        return self.text

    def _repr_markdown_(self) -> str:
        head = f"`recipes/{self.name}.py` against `recipes/base.py`: +{self.added} -{self.removed}"
        return f"{head}\n\n```diff\n{self.text}\n```"


def recipe_diff(name: str, context: int = 2) -> RecipeDiff:
    """recipes/<name>.py against recipes/base.py, ``context`` unchanged lines around each change
    (docstrings left out: each recipe's is its own)."""
    base, recipe = body_lines("base"), body_lines(name)
    lines = list(difflib.unified_diff(base, recipe, "recipes/base.py", f"recipes/{name}.py",
                                      n=context, lineterm=""))  # fmt: skip
    body = [line for line in lines[2:]]
    added = sum(1 for line in body if line.startswith("+"))
    removed = sum(1 for line in body if line.startswith("-"))
    return RecipeDiff(name, "\n".join(lines), added, removed)


def recipe_names() -> list[str]:
    """Every recipe's name, base first."""
    names = sorted(p.stem for p in RECIPES.glob("*.py") if p.stem != "base")
    return ["base", *names] if (RECIPES / "base.py").is_file() else names
