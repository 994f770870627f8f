"""Run every lesson in a real JupyterLab, in headless Chromium, and check what a reader sees.

``make browser-check`` runs it (a Python with Playwright and Debian's Chromium needed, kept
out of the course's environment)::

    python3 -m venv .venv-playwright && .venv-playwright/bin/pip install playwright
    apt-get install -y chromium          # the browser: Playwright's own download is not used
    make browser-check                   # every notebooks/*.ipynb, then the calculator
    PLAYWRIGHT_PYTHON=/tmp/pw/bin/python python3 tools/browser_check.py notebooks/00_*.ipynb

It starts JupyterLab from the course's Python (``--lab-python``) with the course's settings
(tools/lab-settings) in a scratch folder, copies each notebook there (the checkout's stay
clean; the checkout is on the kernel's PYTHONPATH, as under ``make lab``), opens it at
1440x1000, runs all cells and polls once a second until the kernel is idle. It fails a
notebook on:

- a cell silent for more than ``--silence`` seconds while it runs (no new output, no update);
- an error output, or anything written to stderr;
- a progress bar left red (``bar_style`` danger) or short of its end, and a text meter
  (``40%|████      |``) left below 100 % in a finished cell;
- "Error displaying widget" (a widget whose model is gone), and a widget output that renders
  nothing, both right after the run and after saving, shutting the kernel down and reopening;
- text in a figure smaller than ``--min-text-px`` pixels at the width the notebook shows it
  (the kernel notes each figure's smallest text: tools/browser_check_figure_text.py).

Then it drives the memory calculator (``helpers.calculator()``) in a scratch notebook: types a
micro-batch, picks another GPU, a model too large, clicks Suggest and Apply, picks a precision
the card lacks, types a sequence too long.
Screenshots (after the run, after reopening, at each failing cell) and ``summary.json`` and
``summary.md`` go to ``--shots``. Exit status 0 when every check held, 1 when one failed, 2
when Playwright or Chromium is missing. ``--url`` uses a running JupyterLab instead (its
settings and PYTHONPATH are then its own; the copies go to a folder browser-check-<pid> in its
root, left there). ``--python``, or PLAYWRIGHT_PYTHON, names the
Python with Playwright when this one has none (the script runs itself again under it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CALCULATOR = "calculator_check.ipynb"
CALCULATOR_CELL = "import helpers\nhelpers.calculator()"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking"]  # fmt: skip
VIEWPORT = {"width": 1440, "height": 1000}
VERDICT = "usable on the"  # every verdict line says "... of X usable on the <card>"
INSTALL = (
    "make browser-check and make book-check need a Python with Playwright and Chromium:\n"
    "  python3 -m venv .venv-playwright && .venv-playwright/bin/pip install playwright\n"
    "  apt-get install -y chromium     (or name another: --chromium PATH / CHROMIUM=PATH)\n"
    "then: make browser-check or make book-check (PLAYWRIGHT_PYTHON=/path/to/python to name one)"
)
# A text meter left unfinished: tqdm's "name:  40%|████      | 8/20 [...]".
METER = re.compile(r"(\d{1,3})%\|")
FIGURE_TEXT = ROOT / "tools" / "browser_check_figure_text.py"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module doc)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="*", help="notebooks to check (default notebooks/*.ipynb)")
    p.add_argument("--shots", default=str(ROOT / "build" / "browser-check"),
                   help="folder for screenshots, summary.json and summary.md")  # fmt: skip
    p.add_argument("--timeout", type=float, default=1200, help="seconds per notebook")
    p.add_argument("--silence", type=float, default=20,
                   help="seconds a running cell may go without new output")  # fmt: skip
    p.add_argument("--min-text-px", type=float, default=8, help="smallest figure text shown")
    p.add_argument("--url", help="a running JupyterLab with its token: http://host:port/?token=")
    p.add_argument("--python", default=os.environ.get("PLAYWRIGHT_PYTHON"),
                   help="a Python with Playwright, if this one has none")  # fmt: skip
    p.add_argument("--lab-python", default=str(ROOT / ".venv" / "bin" / "python"))
    p.add_argument("--chromium", default=os.environ.get("CHROMIUM", "/usr/bin/chromium"))
    p.add_argument(
        "--cells",
        type=lambda t: [int(n) for n in t.split(",") if n],
        default=[],
        help="also screenshot these cells (1-based), e.g. 21,39",
    )
    p.add_argument("--no-calculator", dest="calculator", action="store_false",
                   help="skip the memory calculator's checks")  # fmt: skip
    args = p.parse_args(argv)
    if not args.notebooks and not args.url:
        args.notebooks = sorted(str(n) for n in (ROOT / "notebooks").glob("*.ipynb"))
    return args


def rerun_under(python: str | None, chromium: str, script: str = __file__) -> None:
    """Run ``script`` (this one, or tools/book_check.py) again under ``python`` when Playwright
    does not import here."""
    if not Path(chromium).exists():
        print(f"no Chromium at {chromium}\n{INSTALL}", file=sys.stderr)
        sys.exit(2)
    try:
        import playwright  # noqa: F401
    except ImportError:
        candidates = [python, str(ROOT / ".venv-playwright" / "bin" / "python")]
        found = next((c for c in candidates if c and Path(c).exists()), None)
        if found is None or os.environ.get("BROWSER_CHECK_RERUN"):  # not found, or not there
            print(f"no Playwright for {sys.executable}\n{INSTALL}", file=sys.stderr)
            sys.exit(2)
        os.environ["BROWSER_CHECK_RERUN"] = found
        os.execv(found, [found, script, *sys.argv[1:]])


# ---------------------------------------------------------------------------------------------
# The JupyterLab server


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lab_settings(folder: Path) -> Path:
    """The course's lab settings, plus every cell kept in the page (the check reads them all)."""
    settings = json.loads((ROOT / "tools" / "lab-settings" / "overrides.json").read_text())
    tracker = settings.setdefault("@jupyterlab/notebook-extension:tracker", {})
    tracker["windowingMode"] = "none"  # the default skips rendering cells out of view
    out = folder / "lab-settings"
    out.mkdir()
    (out / "overrides.json").write_text(json.dumps(settings, indent=2))
    return out


def lab_environment(folder: Path) -> dict[str, str]:
    """The server's environment: the checkout importable, bars on, stores in the scratch."""
    startup = folder / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    shutil.copy(FIGURE_TEXT, startup / "00-course-figure-text.py")
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "IPYTHONDIR": str(folder / "ipython"),
        "COURSE_PROGRESS": "1",  # bars as a reader sees them, even under CI
        "COURSE_RESULTS": str(folder / "results.jsonl"),
        "COURSE_CLAIMS": str(folder / "claims.jsonl"),
    }


def start_lab(lab_python: str, folder: Path) -> tuple[subprocess.Popen, str]:
    """JupyterLab from the course's Python in ``folder``; returns it and its URL with token."""
    port, token = free_port(), "browser-check"
    command = [lab_python, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
               f"--port={port}", f"--IdentityProvider.token={token}",
               f"--LabApp.app_settings_dir={lab_settings(folder)}",
               "--LabApp.expose_app_in_browser=True", f"--ServerApp.root_dir={folder}"]  # fmt: skip
    env = lab_environment(folder)
    with open(folder / "lab.log", "w") as log:  # the server keeps its own copy of the file
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/?token={token}"
    for _ in range(240):
        try:
            urllib.request.urlopen(api(url, "status"), timeout=2)
            return server, url
        except OSError:
            if server.poll() is not None:
                break
            time.sleep(0.5)
    server.terminate()
    sys.exit(f"JupyterLab did not start; its log: {folder / 'lab.log'}")


def api(url: str, path: str) -> str:
    """The server's REST address ``/api/<path>`` with the token of ``url``."""
    parts = urllib.parse.urlsplit(url)
    token = urllib.parse.parse_qs(parts.query).get("token", [""])[0]
    return f"{parts.scheme}://{parts.netloc}/api/{path}?token={token}"


def call(url: str, path: str, method: str = "GET", body: dict | None = None):
    """One REST call to the server; the decoded JSON answer (None when it has no body)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(api(url, path), data=data, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as answer:
        text = answer.read()
    return json.loads(text) if text else None


def upload(url: str, path: str, notebook: dict) -> None:
    """Put ``notebook`` at ``path`` on the server (its folder made first)."""
    folder = path.rpartition("/")[0]
    if folder:
        try:
            call(url, f"contents/{folder}", "PUT", {"type": "directory"})
        except urllib.error.HTTPError as err:  # 409 or 400 when the folder is there already
            if err.code not in (400, 409):
                raise
    call(url, f"contents/{path}", "PUT", {"type": "notebook", "format": "json",
                                          "content": notebook})  # fmt: skip


def shut_kernel(url: str, path: str) -> None:
    """End the notebook's session and kernel, as a reader closing it for the day does."""
    for session in call(url, "sessions") or []:
        if session.get("path") == path:
            call(url, f"sessions/{session['id']}", "DELETE")


def calculator_notebook() -> dict:
    """The scratch notebook with one cell: the calculator."""
    cell = {"cell_type": "code", "execution_count": None, "id": "calc", "metadata": {},
            "outputs": [], "source": CALCULATOR_CELL}  # fmt: skip
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return {"nbformat": 4, "nbformat_minor": 5, "cells": [cell],
            "metadata": {"kernelspec": kernel}}  # fmt: skip


def page_address(url: str, path: str) -> str:
    """The lab page that opens the notebook at ``path``."""
    parts = urllib.parse.urlsplit(url)
    # reset: a fresh workspace, so the notebooks opened before are not opened again
    return f"{parts.scheme}://{parts.netloc}/lab/tree/{path}?{parts.query}&reset"


# ---------------------------------------------------------------------------------------------
# One notebook in the browser

# The open notebook as the check sees it: per cell its prompt ("[*]:", "[3]:", "[ ]:"), and the
# running cell's output signature (text, outputs and images: any update changes it).
STATE_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const panel = window.jupyterapp.shell.currentWidget.node;
  const cells = [...panel.querySelectorAll('.jp-Notebook .jp-Cell')];
  const prompts = cells.map(c => (c.querySelector('.jp-InputPrompt') || {}).textContent || '');
  const running = prompts.findIndex(p => p.includes('*'));
  let signature = '';
  if (running >= 0) {
    const area = cells[running].querySelector('.jp-OutputArea');
    const text = area ? area.textContent : '';
    let hash = 0;
    for (let i = 0; i < text.length; i++) hash = (hash * 31 + text.charCodeAt(i)) | 0;
    const images = area ? [...area.querySelectorAll('img')].map(i => i.src.length) : [];
    signature = [text.length, hash, area ? area.children.length : 0, images.join()].join(':');
  }
  const status = w && w.sessionContext ? w.sessionContext.kernelDisplayStatus : 'none';
  return {prompts, running, signature, status};
}"""

# What each cell's outputs show in the page: errors, stderr, bars, widgets, images.
OUTPUTS_JS = """() => {
  const panel = window.jupyterapp.shell.currentWidget.node;
  const cells = [...panel.querySelectorAll('.jp-Notebook .jp-Cell')];
  return cells.map((cell, index) => {
    const outputs = [...cell.querySelectorAll('.jp-OutputArea-output')]
      .filter(o => !o.closest('.widget-output'));
    const mimes = outputs.map(o => o.getAttribute('data-mime-type') || '');
    const bars = [...cell.querySelectorAll(
      '.widget-hprogress .progress-bar, .widget-vprogress .progress-bar')].map(b => ({
      danger: b.classList.contains('progress-bar-danger'),
      width: parseFloat(b.closest('.widget-vprogress') ? b.style.height : b.style.width),
    }));
    const widgets = outputs.filter((o, i) => mimes[i].includes('widget-view'))
      .map(o => ({empty: o.offsetHeight < 2 || o.textContent.trim() === ''
                  && !o.querySelector('img, canvas, svg, input, select, .progress-bar')}));
    const images = outputs.filter((o, i) => mimes[i] === 'image/png')
      .map(o => { const img = o.querySelector('img');
                  return img ? {shown: img.clientWidth, natural: img.naturalWidth} : null; });
    const text = outputs.map(o => o.innerText).join('\\n');
    return {index, mimes, bars, widgets, images,
            widgetError: /Error displaying widget|model not found/i.test(text)};
  });
}"""


@dataclass
class Failure:
    """One check that did not hold: where, which kind, what it saw, its screenshot."""

    cell: int | None
    kind: str
    message: str
    shot: str = ""


@dataclass
class Outcome:
    """One notebook's run: its cells, seconds, screenshots and failures."""

    notebook: str
    cells: int = 0
    seconds: float = 0.0  # Run All until idle
    checked_in: float = 0.0  # all of it: opening, running, checks, screenshots, reopening
    shots: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)

    def fail(self, cell: int | None, kind: str, message: str) -> None:
        """Note a failure (``cell`` counts every cell from 1, markdown ones too)."""
        self.failures.append(Failure(cell, kind, message))
        where = f"cell {cell}" if cell is not None else "notebook"
        print(f"  [FAIL] {self.notebook} {where}: {kind}: {message}", flush=True)


def open_notebook(page, url: str, path: str) -> None:
    """Load the lab page of ``path`` and wait until its kernel is idle."""
    page.goto(page_address(url, path))
    page.wait_for_function(
        "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
        " && window.jupyterapp.shell.currentWidget.sessionContext"
        " && document.querySelector('.jp-NotebookPanel .jp-Notebook .jp-Cell')",
        timeout=120_000,
    )
    page.wait_for_function(
        "() => window.jupyterapp.shell.currentWidget.sessionContext.kernelDisplayStatus === 'idle'",
        timeout=120_000,
    )


def run_all(page) -> None:
    """Run all cells; sent again when the first run is lost while the kernel connects."""
    for _ in range(3):
        # not awaited: the command's promise settles only when the last cell has run
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        try:
            page.wait_for_function(
                f"() => ({STATE_JS})().prompts.some(p => /\\[(\\*|\\d+)\\]/.test(p))",
                timeout=15_000,
            )
            return
        except Exception:  # Playwright's TimeoutError: send the run once more
            continue
    raise RuntimeError("Run All started no cell in 45 s")


def watch(page, outcome: Outcome, start: float, args: argparse.Namespace) -> None:
    """Poll once a second until no cell runs; fail cells silent longer than ``--silence``."""
    timeout, silence = args.timeout, args.silence
    running, signature, since, longest = -1, "", start, {}
    while True:
        state = page.evaluate(STATE_JS)
        now = time.monotonic()
        if state["running"] != running or state["signature"] != signature:
            running, signature, since = state["running"], state["signature"], now
        if running >= 0:
            longest[running] = max(longest.get(running, 0.0), now - since)
        elif state["status"] == "idle":
            break
        if now - start > timeout:
            outcome.fail(running + 1, "timeout", f"still running after {timeout:.0f} s")
            break
        page.wait_for_timeout(1000)
    outcome.seconds = round(time.monotonic() - start, 1)
    outcome.cells = len(state["prompts"])
    for index, quiet in sorted(longest.items()):
        if quiet > silence:
            outcome.fail(index + 1, "silent", f"no output for {quiet:.0f} s (limit {silence:.0f})")


def meter_left(text: str) -> str:
    """The last state of a text meter in ``text`` below 100 % ("" when none is)."""
    for line in text.split("\n"):  # not splitlines(): it splits at "\r" too
        last = line.split("\r")[-1]
        found = METER.search(last)
        if found and int(found.group(1)) < 100:
            return last.strip()
    return ""


def check_saved(outcome: Outcome, notebook: dict) -> list[list[dict]]:
    """Errors, stderr and unfinished text meters in the saved outputs; returns them per cell."""
    per_cell = []
    for number, cell in enumerate(notebook["cells"], 1):
        outputs = cell.get("outputs", [])
        per_cell.append(outputs)
        for out in outputs:
            kind = out.get("output_type")
            if kind == "error":
                outcome.fail(number, "error", f"{out.get('ename')}: {out.get('evalue', '')[:200]}")
            elif kind == "stream" and out.get("name") == "stderr":
                first = next((s for s in out.get("text", "").splitlines() if s.strip()), "")
                outcome.fail(number, "stderr", first[:200])
            data = out.get("data", {})
            text = out.get("text", "") if kind == "stream" else "".join(data.get("text/plain", ""))
            widget = "application/vnd.jupyter.widget-view+json" in data  # text/plain unseen
            left = meter_left(text) if not widget else ""
            if left:
                outcome.fail(number, "unfinished meter", left[:200])
    return per_cell


def check_page(outcome: Outcome, cells: list[dict], when: str) -> None:
    """Bars, widgets that show an error or nothing, as the page shows them ``when``."""
    for cell in cells:
        number = cell["index"] + 1
        if cell["widgetError"]:
            outcome.fail(number, f"widget {when}", "Error displaying widget (model not found)")
        elif any(w["empty"] for w in cell["widgets"]):
            outcome.fail(number, f"widget {when}", "a widget output renders nothing")
        for bar in cell["bars"]:
            if bar["danger"]:
                outcome.fail(number, f"red bar {when}", "a progress bar is red (danger)")
            elif bar["width"] < 99.9:
                outcome.fail(
                    number, f"bar {when}", f"a progress bar stopped at {bar['width']:.0f}%"
                )


def check_figures(outcome: Outcome, saved: list[list[dict]], cells: list[dict], least: float):
    """Each figure's smallest text at the width the page shows it: at least ``least`` px."""
    for outputs, cell in zip(saved, cells, strict=True):  # both: every cell, in order
        pngs = [o for o in outputs if "image/png" in o.get("data", {})]
        for n, (out, shown) in enumerate(zip(pngs, cell["images"], strict=False), 1):
            measured = out.get("metadata", {}).get("image/png", {})
            pixels = measured.get("course_min_text_px")
            if pixels is None or not shown or not shown["natural"]:
                continue  # no text in the figure, or an image not drawn by matplotlib
            scale = shown["shown"] / shown["natural"]
            if pixels * scale < least:
                text = measured.get("course_min_text", "")
                outcome.fail(cell["index"] + 1, "small figure text",
                             f"figure {n}: {text!r} is {pixels * scale:.1f} px on screen "
                             f"({pixels:.1f} px, image shown at {scale:.0%})")  # fmt: skip


def save(page) -> None:
    """Save the notebook (with the widgets' state, when the settings keep it)."""
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    page.wait_for_function(
        "() => !window.jupyterapp.shell.currentWidget.context.model.dirty", timeout=60_000
    )


class Shots:
    """Screenshots of one notebook under one folder, named in order."""

    def __init__(self, page, folder: Path, stem: str, outcome: Outcome) -> None:
        """Take shots of ``page`` into ``folder`` as ``stem``-..., listed in ``outcome``."""
        self.page, self.folder, self.stem, self.outcome = page, folder, stem, outcome

    def take(self, name: str) -> Path:
        """The page as it is now."""
        path = self.folder / f"{self.stem}-{name}.png"
        self.page.screenshot(path=str(path))
        self.outcome.shots.append(str(path))
        return path

    def pages(self, name: str, most: int = 6) -> None:
        """The notebook from the top, one screen at a time (at most ``most`` screens)."""
        scroller = ".jp-NotebookPanel .jp-WindowedPanel-outer"
        height = self.page.evaluate(f"() => document.querySelector('{scroller}').scrollHeight")
        for n in range(min(most, max(1, -(-height // VIEWPORT["height"])))):
            self.page.evaluate(f"() => document.querySelector('{scroller}').scrollTop = {n * 900}")
            self.page.wait_for_timeout(150)
            self.take(f"{name}-{n + 1}")

    def cells(self, phase: str, numbers) -> None:
        """The cells numbered ``numbers`` (1-based, as failures name them) scrolled into view."""
        cell = self.page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell")
        for number in numbers:
            if number <= cell.count():
                cell.nth(number - 1).scroll_into_view_if_needed(timeout=5_000)
                self.page.wait_for_timeout(150)
                self.take(f"{phase}-cell{number:03d}")

    def failures(self, phase: str) -> None:
        """Each failing cell scrolled into view (one shot per cell and ``phase``)."""
        done: dict[int, str] = {}
        for failure in self.outcome.failures:
            if failure.cell is None or failure.shot:
                continue
            if failure.cell not in done:
                cell = self.page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell")
                cell.nth(failure.cell - 1).scroll_into_view_if_needed(timeout=5_000)
                done[failure.cell] = str(self.take(f"{phase}-cell{failure.cell:03d}"))
            failure.shot = done[failure.cell]


def check_notebook(page, url: str, path: str, args: argparse.Namespace, steps=()) -> Outcome:
    """Run ``path`` in the page, check it, run ``steps`` on the live page, save, reopen, check."""
    outcome, begun = Outcome(path), time.monotonic()
    shots = Shots(page, Path(args.shots), Path(path).stem, outcome)
    print(f"{path}: running", flush=True)
    open_notebook(page, url, path)
    start = time.monotonic()
    run_all(page)
    watch(page, outcome, start, args)
    for step in steps:
        step(Calculator(page, shots, outcome))
    save(page)
    saved = check_saved(outcome, call(url, f"contents/{path}")["content"])
    cells = page.evaluate(OUTPUTS_JS)
    check_page(outcome, cells, "after the run")
    check_figures(outcome, saved, cells, args.min_text_px)
    shots.failures("run")
    shots.cells("run", args.cells)
    shots.pages("run")
    page.goto("about:blank")
    shut_kernel(url, path)
    open_notebook(page, url, path)
    page.wait_for_timeout(2000)  # widgets render from the saved state a moment after the cells
    check_page(outcome, page.evaluate(OUTPUTS_JS), "after reopening")
    shots.failures("reopened")
    shots.cells("reopened", args.cells)
    shots.pages("reopened", most=2)
    page.goto("about:blank")
    shut_kernel(url, path)
    outcome.checked_in = round(time.monotonic() - begun, 1)
    print(f"{path}: {len(outcome.failures)} failure(s), run {outcome.seconds:.0f} s, "
          f"checked in {outcome.checked_in:.0f} s", flush=True)  # fmt: skip
    return outcome


# ---------------------------------------------------------------------------------------------
# The memory calculator's steps (on the live page, after its cell ran)


class Calculator:
    """The calculator on the page: its controls, verdict and figure; outcomes go to a notebook's."""

    def __init__(self, page, shots: Shots, outcome: Outcome) -> None:
        """Drive ``page``; screenshots through ``shots``; failures into ``outcome``."""
        self.page, self.shots, self.outcome = page, shots, outcome

    def report(self, ok: bool, what: str) -> None:
        """Print one check's outcome and note a failure."""
        if ok:
            print(f"  [ok] {what}")
        else:
            self.outcome.fail(1, "calculator", what)

    def shot(self, name: str) -> None:
        """A screenshot of the page as the step left it, the verdict line at the top."""
        verdict = self.page.locator(
            ".widget-html-content", has_text=re.compile(VERDICT + "|\u26a0")
        )
        if verdict.count():
            verdict.first.evaluate("e => e.scrollIntoView({block: 'start'})")
            self.page.wait_for_timeout(150)
        self.shots.take(f"calculator-{name}")

    def verdict(self) -> str:
        """The calculator's verdict line as the page shows it ("" when there is none)."""
        lines = self.page.locator(".widget-html-content").all_inner_texts()
        return next((t.strip() for t in lines if VERDICT in t or "\u26a0" in t), "")

    def figure(self) -> str:
        """The drawn figure's image address ("" when none is shown)."""
        image = self.page.locator(".jp-OutputArea-output .widget-output img")
        return image.first.get_attribute("src") or "" if image.count() else ""

    def wait_for_change(self, before: str) -> str:
        """The verdict once it differs from ``before`` (``before`` after 60 s)."""
        for _ in range(240):
            now = self.verdict()
            if now and now != before and "estimating" not in now:
                return now
            self.page.wait_for_timeout(250)
        return before

    def change(self, act, what: str) -> str:
        """Do ``act()``; wait for a new verdict; check the figure changed with it (or went)."""
        verdict, figure = self.verdict(), self.figure()
        act()
        now = self.wait_for_change(verdict)
        self.page.wait_for_timeout(300)  # anything still on its way would land here
        self.report(self.figure() != figure, f"the figure changed with the verdict after {what}")
        return now

    def control(self, label: str, kind: str):
        """The ``kind`` element (input, select) of the control described ``label``."""
        box = self.page.locator(".widget-inline-hbox").filter(
            has=self.page.locator("label", has_text=re.compile(f"^{re.escape(label)}$"))
        )
        return box.locator(kind).first


def rendered(check: Calculator) -> None:
    """The widget and its figure are shown, with a title and a verdict."""
    widget = check.page.locator(".jp-OutputArea-output .widget-vbox").first
    widget.wait_for(timeout=120_000)
    check.page.locator(".jp-OutputArea-output .widget-output img").first.wait_for(timeout=60_000)
    check.report("Memory calculator" in widget.inner_text(), "the widget rendered (title shown)")
    check.report(bool(check.verdict()), f"a verdict is shown: {check.verdict()!r}")
    check.shot("01_rendered")


def change_batch_and_gpu(check: Calculator) -> None:
    """Type a micro-batch of 64 and press Enter, then pick the A100 MIG slice."""
    before = check.verdict()
    box = check.control("micro-batch", "input")
    after = check.change(lambda: (box.fill("64"), box.press("Enter")), "micro-batch 64")
    peaks = [re.search(r":\s*(\S+ \S+) of", v) for v in (before, after)]
    changed = after != before and peaks[0] and peaks[1] and peaks[0][1] != peaks[1][1]
    check.report(bool(changed), f"the peak changed with the batch: {before!r} -> {after!r}")
    select = check.control("GPU", "select")
    label = next(o for o in select.locator("option").all_inner_texts() if "MIG" in o)
    now = check.change(lambda: select.select_option(label=label), f"GPU {label}")
    check.report("MIG" in now, f"the verdict names the GPU picked ({label}): {now!r}")
    check.shot("02_batch_64_on_a100_mig")


def pick_large_model(check: Calculator) -> None:
    """Pick bert-large: at micro-batch 64 it does not fit the slice, and the verdict says so."""
    select = check.control("model", "select")
    now = check.change(lambda: select.select_option(label="bert-large"), "model bert-large")
    check.report(now.startswith("does not fit"), f"bert-large does not fit: {now!r}")
    check.shot("03_bert_large_does_not_fit")


def suggest(check: Calculator) -> None:
    """Click Suggest and wait for the planner's answer."""
    page = check.page
    page.get_by_role("button", name=re.compile("Suggest the fastest setup")).click()
    answer = page.locator(".widget-html-content", has_text=re.compile("Fastest predicted|Nothing"))
    answer.first.wait_for(timeout=120_000)
    text = answer.first.inner_text()
    check.report("Fastest predicted to fit" in text, f"a suggestion: {text[:160]!r}...")
    check.shot("04_suggestion")


def apply_suggestion(check: Calculator) -> None:
    """Click Apply: the controls take the suggested setup and the verdict says it fits."""
    page = check.page
    button = page.get_by_role("button", name=re.compile("Apply this setup"))
    label = page.locator(".widget-html-content code").first.inner_text()  # "mb4 x ga16, ..."
    now = check.change(button.click, "Apply")
    micro = check.control("micro-batch", "input").input_value()
    ok = now.startswith("fits") and label.startswith(f"mb{micro} x")
    check.report(ok, f"Apply set the suggestion ({label}), micro-batch now {micro}: {now!r}")
    check.shot("05_applied")


def precision_the_card_lacks(check: Calculator) -> None:
    """Pick the T4, fp32 weights and tf32: the verdict's first word does not say "fits"
    beside its warning. (The weights first: Apply may have set bf16 weights, which compute in
    bf16 only, and the calculator would refuse tf32 for that reason before the card's.)"""
    select = check.control("GPU", "select")
    t4 = next(o for o in select.locator("option").all_inner_texts() if o.startswith("T4"))
    check.change(lambda: select.select_option(label=t4), f"GPU {t4}")
    weights = check.control("weights stored in", "select")
    if weights.locator("option:checked").inner_text().strip() != "fp32":
        check.change(lambda: weights.select_option(label="fp32"), "weights fp32")
    precision = check.control("precision", "select")
    now = check.change(lambda: precision.select_option(label="tf32"), "precision tf32")
    ok = not now.startswith("fits") and "cannot train in tf32" in now
    check.report(ok, f"tf32 on the T4 is not called 'fits': {now!r}")
    check.shot("06_tf32_on_t4")


def refused_setting(check: Calculator) -> None:
    """Type a sequence longer than bert-large's positions: one red line, no traceback."""
    box = check.control("sequence length", "input")
    now = check.change(lambda: (box.fill("5000"), box.press("Enter")), "sequence 5000")
    output = check.page.locator(".jp-OutputArea-output").first.inner_text()
    ok = "exceeds max_position_embeddings" in now and "Traceback" not in output
    check.report(ok, f"a refused setting is one line, no traceback: {now!r}")
    check.shot("07_refused_setting")


def calculator_steps(check: Calculator) -> None:
    """Every calculator step in order; one that cannot finish is a failure with its picture."""
    steps = (rendered, change_batch_and_gpu, pick_large_model, suggest, apply_suggestion,
             precision_the_card_lacks, refused_setting)  # fmt: skip
    for step in steps:
        try:
            step(check)
        except Exception as err:  # a step that could not finish: say which, keep the picture
            check.report(
                False, f"{step.__name__}: {type(err).__name__}: {str(err).splitlines()[0]}"
            )
            check.shot("99_failure")
            return


# ---------------------------------------------------------------------------------------------
# The run and its summary


def browse(url: str, args: argparse.Namespace, paths: list[str]) -> list[Outcome]:
    """Check each notebook at ``paths`` on the server in one Chromium; the outcomes."""
    from playwright.sync_api import sync_playwright

    outcomes = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport=VIEWPORT)
        for path in paths:
            steps = (calculator_steps,) if Path(path).name == CALCULATOR else ()
            try:
                outcomes.append(check_notebook(page, url, path, args, steps))
            except Exception as err:  # the check itself could not finish: a failure, with a shot
                outcome = Outcome(path)
                outcome.fail(None, "check", f"{type(err).__name__}: {str(err).splitlines()[0]}")
                shot = Path(args.shots) / f"{Path(path).stem}-aborted.png"
                page.screenshot(path=str(shot))
                outcome.failures[-1].shot = str(shot)
                outcomes.append(outcome)
                shut_kernel(url, path)
        browser.close()
    return outcomes


def summarize(outcomes: list[Outcome], shots: Path, seconds: float) -> str:
    """The summary table (Markdown); also written to summary.md and summary.json in ``shots``."""
    lines = ["| notebook | cells | run s | total s | failures |", "|---|---:|---:|---:|---|"]
    for o in outcomes:
        found = "; ".join(
            f"{'cell ' + str(f.cell) if f.cell else 'notebook'} {f.kind}: {f.message}"
            for f in o.failures
        )
        lines.append(
            f"| {Path(o.notebook).name} | {o.cells} | {o.seconds:.0f} | {o.checked_in:.0f} "
            f"| {found or 'none'} |"
        )
    failed = sum(bool(o.failures) for o in outcomes)
    lines += ["", f"{len(outcomes) - failed} of {len(outcomes)} notebooks passed "
              f"in {seconds / 60:.1f} min; screenshots in {shots}"]  # fmt: skip
    text = "\n".join(lines) + "\n"
    (shots / "summary.md").write_text(text)
    record = {"seconds": round(seconds, 1), "passed": failed == 0,
              "notebooks": [asdict(o) for o in outcomes]}  # fmt: skip
    (shots / "summary.json").write_text(json.dumps(record, indent=2) + "\n")
    return text


def main(argv: list[str] | None = None) -> int:
    """Start (or use) JupyterLab, check every notebook, stop what was started; 0 when all held."""
    args = parse_args(argv)
    rerun_under(args.python, args.chromium)
    start = time.monotonic()
    shots = Path(args.shots)
    shots.mkdir(parents=True, exist_ok=True)
    for old in [*shots.glob("*.png"), *shots.glob("summary.*")]:  # an earlier run's, only
        old.unlink()
    server, folder, url = None, None, args.url
    if not url:
        folder = Path(tempfile.mkdtemp(prefix="browser_check_"))
        server, url = start_lab(args.lab_python, folder)
    try:
        # Under --url, a folder of its own: the server may be serving the checkout itself.
        paths, into = [], "notebooks" if server else f"browser-check-{os.getpid()}"
        for notebook in args.notebooks:
            paths.append(f"{into}/{Path(notebook).name}")
            upload(url, paths[-1], json.loads(Path(notebook).read_text()))
        if args.calculator:
            paths.append(f"{into}/{CALCULATOR}")
            upload(url, paths[-1], calculator_notebook())
        outcomes = browse(url, args, paths)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
            shutil.rmtree(folder, ignore_errors=True)
    print(summarize(outcomes, shots, time.monotonic() - start))
    return 1 if any(o.failures for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
