"""Check the built book (``make book``) in headless Chromium, as a reader offline would see it.

    make book-check                   # build/book, screenshots in build/book-check/
    python3 tools/book_check.py --book build/book --shots /tmp/shots

It serves the book folder from a local HTTP server (as a workshop host would in a room with
no network) and opens every page at 1440x1000. It fails on:

- a page that does not load, a console error or an uncaught exception on it;
- any request that leaves the local server (a CDN, a web font: the site must work offline);
- a link to a page or an anchor of the site that does not exist;
- a widget output left as the widget's placeholder (blank without a kernel);
- an image that does not decode, and on lesson pages a figure whose smallest text is under
  ``--min-text-px`` pixels at the width the page shows it (the executed copies note each
  figure's smallest text in pixels of the PNG: tools/keep_executed.py; the book lists them in
  ``_course/figures.json``);
- a lesson page that the navigation does not reach from the front page;
- a lesson that Sphinx's search does not find by a word of its prose that no other lesson uses
  (make book lists them in ``_course/search_words.json``).

Screenshots of the front page, a lesson with a figure and a search go to ``--shots``, with
``summary.md``. Exit status 0 when every check held, 1 when one failed, 2 when Playwright or
Chromium is missing (the same setup as make browser-check).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import re
import sys
import threading
import time
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from browser_check import CHROMIUM_ARGS, VIEWPORT, free_port, rerun_under

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ("index.html", "lessons/09_mixture_of_experts.html")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--book", type=Path, default=ROOT / "build" / "book")
    p.add_argument("--shots", type=Path, default=ROOT / "build" / "book-check")
    p.add_argument("--python", default=None, help="a Python with Playwright")
    p.add_argument("--chromium", default="/usr/bin/chromium")
    p.add_argument("--min-text-px", type=float, default=8.0)
    return p.parse_args(argv)


def serve(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """The book on a local port, in a thread; the server and its address."""
    handler = functools.partial(_Quiet, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no line per request
        pass


class Check:
    """Failures and notes of one run, per page."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.notes: list[str] = []

    def fail(self, page: str, message: str) -> None:
        self.failures.append(f"{page}: {message}")


def check_page(page, url: str, path: str, check: Check, figures: dict, least: float):
    """Load one page; check its console, requests, images, figures; return its site links."""
    errors, outside = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on(
        "response", lambda r: errors.append(f"{r.status} for {r.url}") if r.status >= 400 else None
    )
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: outside.append(r.url) if not _local(r.url, url) else None)
    response = page.goto(url + path, wait_until="load")
    page.wait_for_load_state("networkidle")
    if response is None or not response.ok:
        check.fail(path, f"did not load ({response.status if response else 'no response'})")
    for text in (e for e in errors if not e.startswith("Failed to load resource")):  # said above
        check.fail(path, f"console error: {text[:160]}")
    for address in outside:
        check.fail(path, f"fetched from outside the site: {address[:160]}")
    images = page.evaluate(
        "() => [...document.images].map(i => ({src: i.currentSrc, ok: i.complete && "
        "i.naturalWidth > 0, w: i.clientWidth, nw: i.naturalWidth, "
        "output: !!i.closest('.cell_output')}))"
    )
    for img in images:
        if not img["ok"]:
            check.fail(path, f"image does not decode: {img['src'][:120]}")
    widgets = page.locator('script[type="application/vnd.jupyter.widget-view+json"]').count()
    if widgets:
        check.fail(path, f"{widgets} widget output(s) with nothing to draw them: blank on the page")
    outputs = [i for i in images if i["output"]]
    if path in figures:
        _check_figures(path, outputs, figures[path], check, least)
    links = page.evaluate("() => [...document.querySelectorAll('a[href]')].map(a => a.href)")
    return [link for link in links if _local(link, url)]


def _check_figures(path: str, outputs: list, sizes: list, check: Check, least: float) -> None:
    if len(outputs) != len(sizes):
        check.fail(path, f"{len(outputs)} figures on the page, {len(sizes)} in the lesson")
        return
    for n, (img, px) in enumerate(zip(outputs, sizes, strict=True), 1):
        if px is None:
            check.notes.append(f"{path}: figure {n}: its text size was not noted (not checked)")
            continue
        shown = px * img["w"] / img["nw"] if img["nw"] else 0
        if shown < least:
            check.fail(path, f"figure {n}: smallest text {shown:.1f} px as shown (< {least})")


def _local(address: str, url: str) -> bool:
    return address.startswith((url, "data:", "blob:", "about:"))


def check_links(links: dict[str, list[str]], url: str, book: Path, check: Check) -> None:
    """Every site link goes to a file of the book and, with #anchor, to an id on that page."""
    ids: dict[Path, set[str]] = {}
    for source, targets in links.items():
        for link in set(targets):
            parsed = urllib.parse.urlparse(link)
            rel = urllib.parse.unquote(parsed.path[len(urllib.parse.urlparse(url).path) :])
            target = book / rel
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                check.fail(source, f"broken link: {link[len(url) :]}")
                continue
            if parsed.fragment and target.suffix == ".html":
                if target not in ids:
                    ids[target] = set(re.findall(r'id="([^"]+)"', target.read_text()))
                if urllib.parse.unquote(parsed.fragment) not in ids[target]:
                    check.fail(source, f"broken anchor: {link[len(url) :]}")


def reachable(links: dict[str, list[str]], url: str, start: str) -> set[str]:
    """The pages reached from ``start`` by following the site's links."""
    graph = {p: {urllib.parse.urldefrag(x)[0][len(url) :] for x in ts} for p, ts in links.items()}
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def check_search(page, url: str, words: dict[str, str | None], check: Check, shots: Path) -> None:
    """Each lesson found by Sphinx's search under its own word; a screenshot of one search."""
    if not words:
        check.fail("search.html", "no lesson to search for")
    for n, (lesson, word) in enumerate(sorted(words.items())):
        if word is None:
            check.fail(lesson, "no word of its prose is its own: nothing to search it by")
            continue
        page.goto(f"{url}search.html?q={urllib.parse.quote(word)}")
        page.wait_for_selector(".search-summary", timeout=30_000)
        found = page.evaluate(
            "() => [...document.querySelectorAll('#search-results a')].map(a => a.href)"
        )
        if not any(urllib.parse.urldefrag(f)[0] == url + lesson for f in found):
            check.fail(lesson, f"search for {word!r} does not find it ({len(found)} results)")
        if n == 0:
            page.screenshot(path=str(shots / "search.png"))
            check.notes.append(f"search screenshot: {word!r} -> {lesson}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rerun_under(args.python, args.chromium, script=__file__)
    from playwright.sync_api import sync_playwright

    start = time.monotonic()
    if not (args.book / "_course" / "figures.json").is_file():  # written last by make book
        print(f"no book in {args.book}: make test, then make book", file=sys.stderr)
        return 1
    args.shots.mkdir(parents=True, exist_ok=True)
    figures = json.loads((args.book / "_course" / "figures.json").read_text())
    pages = sorted(str(p.relative_to(args.book)) for p in args.book.rglob("*.html"))
    pages = [p for p in pages if not p.startswith(("_", "search.html"))]
    server, url = serve(args.book)
    check, links = Check(), {}
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
            for path in pages:
                page = browser.new_page(viewport=VIEWPORT)
                links[path] = check_page(page, url, path, check, figures,
                                         args.min_text_px)  # fmt: skip
                if path in SHOTS:
                    figure = page.locator(".cell_output img").first
                    if path.startswith("lessons/") and figure.count():
                        figure.scroll_into_view_if_needed()  # the lesson's first figure
                    page.screenshot(path=str(args.shots / (Path(path).stem + ".png")))
                page.close()
            page = browser.new_page(viewport=VIEWPORT)
            words = json.loads((args.book / "_course" / "search_words.json").read_text())
            check_search(page, url, words, check, args.shots)
            browser.close()
    finally:
        server.shutdown()
    check_links(links, url, args.book, check)
    reached = reachable(links, url, "index.html")
    for lesson in (p for p in pages if p.startswith("lessons/")):
        if lesson not in reached:
            check.fail(lesson, "not reached by the navigation from index.html")
    lessons = sum(p.startswith("lessons/") for p in pages)
    lines = [f"{len(pages)} pages ({lessons} lessons) checked in "
             f"{time.monotonic() - start:.0f} s; {len(check.failures)} failures"]  # fmt: skip
    lines += [f"- FAIL {f}" for f in check.failures] + [f"- note {n}" for n in check.notes]
    lines.append(f"screenshots in {args.shots}")
    text = "\n".join(lines) + "\n"
    (args.shots / "summary.md").write_text(text)
    print(text)
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
