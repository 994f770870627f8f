#!/usr/bin/env python3
"""``make book``: the course as a static HTML site, every lesson with its executed outputs.

    python tools/book.py                       # build/executed-test -> build/book
    python tools/book.py --executed DIR --out DIR

The site is built by Sphinx with MyST-NB and the Sphinx Book Theme (configuration:
``book/conf.py``): it renders the outputs a notebook already has (it executes nothing), ships
its scripts, styles and search index in the output folder (no CDN at view time), and needs
nothing but pip to install. The pages, staged in ``build/book-src`` first:

- ``index``: README.md, its links to files of the repository turned into links to the pages
  below (or to the repository on GitHub, for files the site has no page for);
- ``lessons/NN_*``: each notebook as ``make test`` executed it (tools/keep_executed.py keeps
  the copies in ``build/executed-test``: tiny scale on a CPU, in CI), or, where a GPU report
  under ``reports/gpu/<report>/executed/full/`` holds a full-scale copy that ran without an
  error, that one; a line under each title says which (card, date, scale) and links to Colab
  and Binder;
- ``cheatsheet``, ``recipes/<name>`` (each recipe's change against ``recipes/base.py``, then
  its source), ``gpu/<report>`` (the GPU reports).

A lesson without an executed copy stops the build with one line that says to run ``make test``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helpers.recipes import recipe_diff, recipe_names  # noqa: E402
from helpers.syllabus import LESSONS  # noqa: E402

REPOSITORY = "https://github.com/single-gpu-course/single-gpu-course"  # pyproject's [project.urls]
COLAB = "https://colab.research.google.com/github/single-gpu-course/single-gpu-course/blob/main/notebooks/{}"
BINDER = "https://mybinder.org/v2/gh/single-gpu-course/single-gpu-course/main?urlpath=lab/tree/notebooks/{}"
HEADER = re.compile(r"scale=(\w+) on (\w+(?::\d+)?)")
LINK = re.compile(r"(\]\()([^)\s]+)(\))")


@dataclass
class BookConfig:
    """Where the executed notebooks are, where the site goes."""

    executed: Path = ROOT / "build" / "executed-test"
    out: Path = ROOT / "build" / "book"
    staging: Path = ROOT / "build" / "book-src"
    reports: Path = ROOT / "reports" / "gpu"
    lessons: tuple[str, ...] | None = None  # lesson numbers; None: every lesson (tests: two)


@dataclass
class BookResult:
    """What was built: the site's folder, its pages, its bytes, the build's seconds."""

    out: Path
    pages: list[str] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)  # lesson -> where its outputs came from
    size_bytes: int = 0
    seconds: float = 0.0


class BookError(Exception):
    """A reason the book cannot be built, in one line a reader can act on."""


# --------------------------------------------------------------------------------------------
# Where each file of the repository lives in the book


def page_for(repo_path: str) -> str | None:
    """The book's source path for a repository file, or None where the site has no page."""
    path = Path(repo_path)
    if repo_path == "README.md":
        return "index.md"
    if repo_path == "CHEATSHEET.md":
        return "cheatsheet.md"
    if path.parent == Path("notebooks") and path.suffix == ".ipynb":
        return f"lessons/{path.name}"
    if path.parent == Path("recipes") and path.suffix == ".py":
        return f"recipes/{path.stem}.md"
    if path.parent == Path("reports/gpu") and path.suffix == ".md":
        return "gpu/index.md" if path.name == "README.md" else f"gpu/{path.name}"
    return None


def rewrite_links(text: str, source: str, staged: set[str] | None = None) -> str:
    """Markdown links in ``text`` (from repository file ``source``) as the book needs them: to
    the target's page (where ``staged``, the book's source paths, has it), or to the file on
    GitHub; web links and anchors stay."""
    page = page_for(source) or source

    def one(match: re.Match) -> str:
        target = match.group(2)
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            return match.group(0)
        path, _, anchor = target.partition("#")
        repo = os.path.normpath(os.path.join(os.path.dirname(source), path))
        if repo.startswith(".."):
            return match.group(0)
        dest = page_for(repo)
        if dest is None or (staged is not None and dest not in staged):
            new = f"{REPOSITORY}/blob/main/{repo}"
        else:
            new = os.path.relpath(dest, os.path.dirname(page) or ".")
        return f"{match.group(1)}{new}{'#' + anchor if anchor else ''}{match.group(3)}"

    return LINK.sub(one, text)


# --------------------------------------------------------------------------------------------
# The lessons' executed copies


def executed_copy(notebook: str, cfg: BookConfig) -> tuple[Path, str]:
    """The executed copy a lesson's page shows and a line saying where it ran: a GPU report's
    full-scale copy that ran without an error, else make test's."""
    for report in sorted(cfg.reports.glob("*.json"), reverse=True):  # the latest first
        copy = report.with_suffix("") / "executed" / "full" / notebook
        if copy.is_file() and not _errors(copy):
            data = json.loads(report.read_text())
            card, when = data.get("card", "a GPU"), str(data.get("started", ""))[:10]
            return copy, f"full scale on an {card}, `make gpu-check` of {when}"
    copy = cfg.executed / notebook
    if not copy.is_file():
        raise BookError(
            f"no executed copy of {notebook} in {cfg.executed}: run make test first (it keeps "
            "the notebooks it executes there), then make book"
        )
    return copy, _where(copy)


def _errors(path: Path) -> bool:
    nb = json.loads(path.read_text())
    return any(o.get("output_type") == "error" for c in nb["cells"] for o in c.get("outputs", []))


def _where(copy: Path) -> str:
    """'tiny scale on a CPU, make test of <date> at <commit>', from the lesson's own header."""
    nb = json.loads(copy.read_text())
    found = None
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            text = "".join(out.get("text", ""))
            found = found or HEADER.search(text)
    scale, device = found.groups() if found else ("unknown", "an unknown device")
    device = "a CPU" if device == "cpu" else device
    run = nb["metadata"].get("course_executed", {})
    commit = f" at {run['commit']}" if run.get("commit") else ""
    took = f", {run['seconds']:.0f} s to run" if run.get("seconds") else ""
    return f"{scale} scale on {device}, `make test` of {run.get('when', '?')[:10]}{commit}{took}"


def lesson_page(notebook: str, cfg: BookConfig, staged: set[str]) -> tuple[dict, str]:
    """The notebook to stage: its executed copy, links rewritten, a line under its title."""
    copy, where = executed_copy(notebook, cfg)
    nb = json.loads(copy.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            text = "".join(cell["source"])
            cell["source"] = rewrite_links(text, f"notebooks/{notebook}", staged)
    banner = (
        f"*Outputs: {where}.* Run it yourself: [Open in Colab]({COLAB.format(notebook)}) · "
        f"[Binder]({BINDER.format(notebook)}) · [the notebook on GitHub]"
        f"({REPOSITORY}/blob/main/notebooks/{notebook})"
    )
    at = 1 if nb["cells"] and nb["cells"][0]["cell_type"] == "markdown" else 0
    nb["cells"].insert(
        at, {"cell_type": "markdown", "id": "course-outputs", "metadata": {}, "source": banner}
    )
    return nb, where


# --------------------------------------------------------------------------------------------
# Staging and building


def recipe_page(name: str) -> str:
    """A recipe's page: its change against the base, then its whole source."""
    source = (ROOT / "recipes" / f"{name}.py").read_text()
    lines = [f"# Recipe: `{name}.py`", ""]
    if name != "base":
        diff = recipe_diff(name)
        lines += [f"Against `base.py`: +{diff.added} -{diff.removed} lines.", "", "```diff",
                  diff.text, "```", ""]  # fmt: skip
    lines += ["The whole script:", "", "```python", source.rstrip(), "```", ""]
    return "\n".join(lines)


def stage(cfg: BookConfig) -> tuple[list[str], dict[str, str]]:
    """Write the book's sources into ``cfg.staging``; the pages and each lesson's source line."""
    if cfg.staging.exists():
        shutil.rmtree(cfg.staging)
    for folder in ("lessons", "recipes", "gpu"):
        (cfg.staging / folder).mkdir(parents=True)
    lessons = [e for e in LESSONS if cfg.lessons is None or e.number in cfg.lessons]
    reports = sorted(cfg.reports.glob("*.md"))
    files = {
        **{f"notebooks/{e.notebook}": e for e in lessons},
        **{f"recipes/{name}.py": name for name in recipe_names()},
        **{f"reports/gpu/{md.name}": md for md in reports},
        "README.md": ROOT / "README.md",
        "CHEATSHEET.md": ROOT / "CHEATSHEET.md",
    }
    staged = {page_for(repo) for repo in files} | {"gpu/index.md"}
    sources = {}
    for repo, what in files.items():
        dest = cfg.staging / page_for(repo)
        if repo.startswith("notebooks/"):
            nb, sources[what.number] = lesson_page(what.notebook, cfg, staged)
            dest.write_text(json.dumps(nb, indent=1))
        elif repo.startswith("recipes/"):
            dest.write_text(recipe_page(what))
        else:
            dest.write_text(rewrite_links(what.read_text(), repo, staged))
    gpu_index = cfg.staging / "gpu" / "index.md"
    if not gpu_index.exists():
        gpu_index.write_text("# Reports from real GPUs\n")
    report_pages = [md.stem for md in reports if md.name != "README.md"]
    gpu_index.write_text(gpu_index.read_text() + _toctree("", report_pages))
    toc = {
        "Lessons": [f"lessons/{Path(e.notebook).stem}" for e in lessons],
        "Reference": ["cheatsheet", "gpu/index"],
        "Recipes": [f"recipes/{name}" for name in recipe_names()],
    }
    index = cfg.staging / "index.md"
    index.write_text(index.read_text() + "".join(_toctree(c, e) for c, e in toc.items()))
    pages = ["index", *toc["Lessons"], *toc["Reference"], *toc["Recipes"]]
    return pages + [f"gpu/{p}" for p in report_pages], sources


def _toctree(caption: str, entries: list[str]) -> str:
    head = f":caption: {caption}\n" if caption else ""
    return (
        "\n\n```{toctree}\n:hidden:\n" + head + ":maxdepth: 1\n\n" + "\n".join(entries) + "\n```\n"
    )


def build_book(cfg: BookConfig) -> BookResult:
    """Stage the sources and run Sphinx (warnings are errors); the site's pages, size, seconds."""
    start = time.perf_counter()
    missing = [m for m in ("sphinx", "myst_nb", "sphinx_book_theme") if not _importable(m)]
    if missing:
        raise BookError(
            f"make book needs {', '.join(missing)}: pip install -e '.[book]' (make install "
            "installs it)"
        )
    pages, sources = stage(cfg)
    if cfg.out.exists():
        shutil.rmtree(cfg.out)
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-W", "--keep-going",
           "-c", str(ROOT / "book"), str(cfg.staging), str(cfg.out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(cfg.out, ignore_errors=True)  # no half-built site to check or serve
        raise BookError(f"Sphinx failed (exit {done.returncode}):\n{done.stderr.strip()}")
    size = sum(p.stat().st_size for p in cfg.out.rglob("*") if p.is_file())
    figures = _figure_text(cfg)
    (cfg.out / "_course").mkdir(exist_ok=True)
    words = json.dumps(search_words(cfg.staging), indent=1)
    (cfg.out / "_course" / "search_words.json").write_text(words)
    (cfg.out / "_course" / "figures.json").write_text(json.dumps(figures, indent=1))  # last
    return BookResult(cfg.out, pages, sources, size, time.perf_counter() - start)


def _figure_text(cfg: BookConfig) -> dict[str, list]:
    """Per lesson page, each PNG output's smallest text in pixels of the PNG, in page order
    (tools/keep_executed.py notes them; None where no note): the book's check scales them."""
    found = {}
    for nb_path in sorted((cfg.staging / "lessons").glob("*.ipynb")):
        nb = json.loads(nb_path.read_text())
        sizes = []
        for cell in nb["cells"]:
            for out in cell.get("outputs", []):
                if "image/png" in out.get("data", {}):
                    sizes.append(out.get("metadata", {}).get("image/png", {}).get(
                        "course_min_text_px"))  # fmt: skip
        found[f"lessons/{nb_path.stem}.html"] = sizes
    return found


def search_words(staging: Path) -> dict[str, str | None]:
    """Per lesson page, the word of its prose (6+ letters) used most there and in no other
    lesson's prose (None if it has none): what make book-check searches it by."""
    words = {}
    for nb in sorted((staging / "lessons").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        text = " ".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        text = re.sub(r"\([^)]*\)|`[^`]*`", " ", text)  # no link targets, no code
        words[f"lessons/{nb.stem}.html"] = collections.Counter(
            w.lower() for w in re.findall(r"\b[A-Za-z]{6,}\b", text)
        )
    chosen = {}
    for page, counts in words.items():
        others = set().union(*(set(c) for p, c in words.items() if p != page))
        mine = [(n, w) for w, n in counts.items() if w not in others]
        chosen[page] = max(mine)[1] if mine else None
    return chosen


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executed", type=Path, default=BookConfig.executed)
    parser.add_argument("--out", type=Path, default=BookConfig.out)
    args = parser.parse_args(argv)
    cfg = BookConfig(executed=args.executed, out=args.out)
    try:
        result = build_book(cfg)
    except BookError as err:
        print(f"make book: {err}", file=sys.stderr)
        return 1
    print(f"The book: {len(result.pages)} pages, {result.size_bytes / 2**20:.1f} MiB in "
          f"{result.out}/ (open index.html), built in {result.seconds:.0f} s")  # fmt: skip
    for number, where in result.sources.items():
        print(f"  lesson {number}: {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
