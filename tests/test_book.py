"""make book (tools/book.py) and the copies make test keeps for it (tools/keep_executed.py).

The plugin runs under nbval on a scratch notebook; the book is built from two lessons whose
"executed copies" are the committed notebooks with a lesson header written into them, so no
lesson runs here. Sphinx and its extensions are the ``book`` extra: without them (the floor
environment of make compat) the build tests are skipped, saying so; staging needs none of them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import book  # noqa: E402
from tests.test_browser_check import CHROMIUM, playwright_python  # noqa: E402

LESSONS = ("07", "09")
NOTEBOOKS = {"07": "07_accelerate_loop.ipynb", "09": "09_mixture_of_experts.ipynb"}
needs_sphinx = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("sphinx", "myst_nb", "sphinx_book_theme")),
    reason="Sphinx, myst-nb and sphinx-book-theme are not installed (the book extra: make install)",
)


def scratch_notebook(*cells: str) -> dict:
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return {"nbformat": 4, "nbformat_minor": 5, "metadata": {"kernelspec": kernel},
            "cells": [{"cell_type": "code", "execution_count": None, "id": f"c{i}",
                       "metadata": {}, "outputs": [], "source": s}
                      for i, s in enumerate(cells)]}  # fmt: skip


@pytest.mark.skipif(not importlib.util.find_spec("nbval"), reason="nbval is not installed")
def test_nbval_runs_keep_each_notebook_with_its_outputs_and_figure_text(tmp_path):
    good = scratch_notebook(
        "print('Lesson 99. scale=tiny on cpu: a header')",
        "%matplotlib inline\nimport matplotlib.pyplot as plt\nfig, ax = plt.subplots()\n"
        "ax.set_title('title', fontsize=10)\nplt.show()",
        "21 * 2",
    )
    bad = scratch_notebook("x = 1", "raise ValueError('on purpose')", "print('after')")
    for name, nb in (("good.ipynb", good), ("bad.ipynb", bad)):
        (tmp_path / name).write_text(json.dumps(nb))
    kept = tmp_path / "kept"
    path = [str(ROOT / "tools"), str(ROOT), os.environ.get("PYTHONPATH", "")]  # + a carried site
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    cmd = [sys.executable, "-m", "pytest", "-q", "--nbval-lax", "--nbval-current-env",
           "-p", "no:cacheprovider", "-p", "keep_executed", "--keep-executed", str(kept),
           "good.ipynb", "bad.ipynb"]  # fmt: skip
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert "1 failed" in done.stdout, done.stdout[-2000:]
    ran = json.loads((kept / "good.ipynb").read_text())
    cells = ran["cells"]
    assert [c["execution_count"] for c in cells] == [1, 2, 3]
    assert "".join(cells[0]["outputs"][0]["text"]).startswith("Lesson 99. scale=tiny")
    png = next(o for o in cells[1]["outputs"] if "image/png" in o.get("data", {}))
    # 10 pt at the inline backend's dpi: more than 10 px, and noted for the book's check
    assert png["metadata"]["image/png"]["course_min_text_px"] > 10
    assert "".join(cells[2]["outputs"][0]["data"]["text/plain"]) == "42"
    assert ran["metadata"]["course_executed"]["failed_cells"] == []
    assert 0 < ran["metadata"]["course_executed"]["seconds"] < 300  # kernel start included
    failed = json.loads((kept / "bad.ipynb").read_text())
    assert failed["metadata"]["course_executed"]["failed_cells"] == [1]
    assert failed["cells"][1]["outputs"][0]["ename"] == "ValueError"


def executed_copies(folder: Path, scale: str = "tiny", device: str = "cpu") -> Path:
    """The two lessons' committed notebooks with a lesson header output: stand-ins for make
    test's copies."""
    folder.mkdir(parents=True, exist_ok=True)
    for number, name in NOTEBOOKS.items():
        nb = json.loads((ROOT / "notebooks" / name).read_text())
        code = next(c for c in nb["cells"] if c["cell_type"] == "code")
        header = f"Lesson {number}. scale={scale} on {device}: models\n"
        code["outputs"] = [{"output_type": "stream", "name": "stdout", "text": header}]
        nb["metadata"]["course_executed"] = {"when": "2026-11-30 06:00 UTC", "commit": "abc1234"}
        (folder / name).write_text(json.dumps(nb))
    return folder


def config(tmp_path: Path, reports: Path | None = None) -> book.BookConfig:
    reports = reports or tmp_path / "no-reports"
    reports.mkdir(exist_ok=True)
    return book.BookConfig(executed=executed_copies(tmp_path / "executed"), out=tmp_path / "site",
                           staging=tmp_path / "src", reports=reports, lessons=LESSONS)  # fmt: skip


def test_links_go_to_the_books_pages_or_to_github():
    staged = {"lessons/07_accelerate_loop.ipynb", "cheatsheet.md", "index.md"}
    text = ("[07](notebooks/07_accelerate_loop.ipynb#the-loop) [cheat](CHEATSHEET.md) "
            "[make](Makefile) [08](notebooks/08_deepspeed_zero.ipynb) [web](https://x.org/a) "
            "[here](#section)")  # fmt: skip
    out = book.rewrite_links(text, "README.md", staged)
    assert "(lessons/07_accelerate_loop.ipynb#the-loop)" in out
    assert "(cheatsheet.md)" in out
    assert f"({book.REPOSITORY}/blob/main/Makefile)" in out
    # a lesson the book does not have goes to GitHub
    assert f"({book.REPOSITORY}/blob/main/notebooks/08_deepspeed_zero.ipynb)" in out
    assert "(https://x.org/a)" in out and "(#section)" in out
    # from a lesson: a sibling lesson, and a file up a level
    lesson = "[07](07_accelerate_loop.ipynb) [r](../recipes/lora.py)"
    out = book.rewrite_links(lesson, "notebooks/09_mixture_of_experts.ipynb", staged)
    assert "(07_accelerate_loop.ipynb)" in out
    assert f"({book.REPOSITORY}/blob/main/recipes/lora.py)" in out


def test_staging_says_where_each_lessons_outputs_came_from(tmp_path):
    cfg = config(tmp_path)
    pages, sources = book.stage(cfg)
    assert sources == {n: "tiny scale on a CPU, `make test` of 2026-11-30 at abc1234"
                       for n in LESSONS}  # fmt: skip
    assert {"index", "cheatsheet", "lessons/07_accelerate_loop", "recipes/lora"} <= set(pages)
    staged = json.loads((cfg.staging / "lessons" / NOTEBOOKS["09"]).read_text())
    banner = staged["cells"][1]["source"]
    assert "tiny scale on a CPU" in banner and "colab.research.google.com" in banner
    assert "mybinder.org" in banner
    recipe = (cfg.staging / "recipes" / "lora.md").read_text()
    assert "```diff" in recipe and "import peft" in recipe


def test_a_gpu_reports_full_scale_copy_wins_unless_it_failed(tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "2026-12-01-nvidia-h200.json").write_text(
        json.dumps({"card": "NVIDIA H200", "started": "2026-12-01 10:00 UTC"})
    )
    full = executed_copies(
        reports / "2026-12-01-nvidia-h200" / "executed" / "full", "full", "cuda:0"
    )
    cfg = config(tmp_path, reports)
    _, sources = book.stage(cfg)
    assert sources["07"] == "full scale on an NVIDIA H200, `make gpu-check` of 2026-12-01"
    nb = json.loads((full / NOTEBOOKS["07"]).read_text())
    code = next(c for c in nb["cells"] if c["cell_type"] == "code")
    code["outputs"].append({"output_type": "error", "ename": "E", "evalue": "", "traceback": []})
    (full / NOTEBOOKS["07"]).write_text(json.dumps(nb))
    _, sources = book.stage(cfg)
    assert sources["07"].startswith("tiny scale on a CPU")  # the failed copy is not shown


def test_a_lesson_without_an_executed_copy_says_run_make_test_first(tmp_path):
    cfg = config(tmp_path)
    (cfg.executed / NOTEBOOKS["09"]).unlink()
    with pytest.raises(book.BookError, match="run make test first"):
        book.stage(cfg)


@needs_sphinx
def test_the_site_builds_offline_with_every_page_and_the_figure_notes(tmp_path):
    cfg = config(tmp_path)
    result = book.build_book(cfg)
    html = {p: (cfg.out / f"{p}.html").read_text() for p in result.pages}
    assert "tiny scale on a CPU" in html["lessons/09_mixture_of_experts"]
    # README's links to lessons are links to their pages
    assert 'href="lessons/07_accelerate_loop.html' in html["index"]
    # nothing the browser loads comes from outside the folder (scripts, styles, fonts)
    for page, text in html.items():
        outside = re.findall(r'<(?:script|link|img)[^>]+(?:src|href)="(https?://[^"]+)"', text)
        assert not outside, (page, outside)
    assert (cfg.out / "searchindex.js").is_file()
    figures = json.loads((cfg.out / "_course" / "figures.json").read_text())
    assert set(figures) == {f"lessons/{Path(n).stem}.html" for n in NOTEBOOKS.values()}
    words = json.loads((cfg.out / "_course" / "search_words.json").read_text())
    assert set(words) == set(figures) and all(words.values()), words  # make book-check's
    assert result.size_bytes > 0


@needs_sphinx
def test_the_book_check_catches_a_cdn_a_broken_link_a_blank_widget_and_small_text(tmp_path):
    if not Path(CHROMIUM).exists() or playwright_python() is None:
        pytest.skip(f"no Chromium at {CHROMIUM} or no Python with Playwright (CI has neither)")
    cfg = config(tmp_path)
    book.build_book(cfg)
    index = cfg.out / "index.html"
    index.write_text(index.read_text().replace(
        "</head>", '<script src="https://cdn.example.invalid/x.js"></script></head>'))  # fmt: skip
    cheat = cfg.out / "cheatsheet.html"
    broken = '<a href="lessons/nope.html">x</a><a href="index.html#no-such">y</a>'
    broken += '<script type="application/vnd.jupyter.widget-view+json">{}</script>'
    cheat.write_text(cheat.read_text().replace("</article>", broken + "</article>"))
    figures_json = cfg.out / "_course" / "figures.json"
    figures = json.loads(figures_json.read_text())
    lesson = "lessons/09_mixture_of_experts.html"
    assert figures[lesson] == []  # the stand-in copies have no figures: give the page one
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(1, 0.5), dpi=32)  # a 32 x 16 PNG
    (cfg.out / "_images").mkdir(exist_ok=True)
    fig.savefig(cfg.out / "_images" / "tiny.png", dpi=32)
    plt.close(fig)
    page = cfg.out / lesson
    shown = '<div class="cell_output"><img src="../_images/tiny.png" width="64"></div>'
    page.write_text(page.read_text().replace('<div class="cell_output', shown + "<div class="
                                             '"cell_output', 1))  # fmt: skip
    figures[lesson] = [4.0]  # 4 px of text in the PNG, shown at 64 / 32 = 2x: 8 px
    figures_json.write_text(json.dumps(figures))
    shots = tmp_path / "shots"
    cmd = [sys.executable, str(ROOT / "tools" / "book_check.py"), "--python",
           playwright_python(), "--chromium", CHROMIUM, "--book", str(cfg.out),
           "--shots", str(shots), "--min-text-px", "9"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    summary = (shots / "summary.md").read_text()
    assert done.returncode == 1, done.stdout + done.stderr
    assert "index.html: fetched from outside the site: https://cdn.example.invalid/x.js" in summary
    assert "cheatsheet.html: broken link: lessons/nope.html" in summary
    assert "cheatsheet.html: broken anchor: index.html#no-such" in summary
    assert "cheatsheet.html: 1 widget output(s) with nothing to draw them" in summary
    assert f"{lesson}: figure 1: smallest text 8.0 px as shown (< 9.0)" in summary
    assert "search for" not in summary  # each lesson is still found by its own word
    assert (shots / "index.png").is_file() and (shots / "search.png").is_file()
