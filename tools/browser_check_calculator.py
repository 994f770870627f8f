"""See the memory calculator (helpers.calculator) work in a real JupyterLab, in a browser.

Runs under a Python that has Playwright (kept out of the course's environment):

    python3 -m venv /tmp/pw && /tmp/pw/bin/pip install playwright
    /tmp/pw/bin/python tools/browser_check_calculator.py            # starts its own JupyterLab
    /tmp/pw/bin/python tools/browser_check_calculator.py --url 'http://127.0.0.1:8899/?token=tok'

Without ``--url`` it starts JupyterLab from the course's Python (``--lab-python``, default
``.venv/bin/python``) in a scratch folder outside the repository, and stops it at the end.
Either way it uploads a scratch notebook (``import helpers; helpers.calculator()``) through
the server's contents API, runs the cell in Chromium, and then: waits for the widget and its
figure, types a micro-batch and presses Enter, picks another GPU, picks a model too large for
it, clicks Suggest, types a sequence longer than the model's positions. It prints what it
checked and saves a screenshot after each step under ``--shots``. Exit status 0 when every
check held. ``--python``, or PLAYWRIGHT_PYTHON, names
the Python with Playwright when this one has none (the script runs itself again under it).
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
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = "calculator_check.ipynb"
CELL = "import helpers\nhelpers.calculator()"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking"]  # fmt: skip
VERDICT = "usable on the"  # every verdict line says "... of X usable on the <card>"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module doc)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--url",
        default=os.environ.get("CALC_JUPYTER_URL"),
        help="a running JupyterLab, with its token: http://host:port/?token=...",
    )
    p.add_argument(
        "--python",
        default=os.environ.get("PLAYWRIGHT_PYTHON"),
        help="a Python with Playwright, if this one has none",
    )
    p.add_argument("--lab-python", default=str(ROOT / ".venv" / "bin" / "python"))
    p.add_argument("--chromium", default=os.environ.get("CHROMIUM", "/usr/bin/chromium"))
    p.add_argument("--shots", default="/tmp/calc_shots", help="folder for the screenshots")
    p.add_argument("--timeout", type=float, default=180, help="seconds to wait for the widget")
    return p.parse_args(argv)


def rerun_under(python: str | None) -> None:
    """Run this script again under ``python`` when Playwright does not import here."""
    try:
        import playwright  # noqa: F401
    except ImportError:
        if not python:
            sys.exit("no Playwright here: pass --python /tmp/pw/bin/python (or PLAYWRIGHT_PYTHON)")
        os.execv(python, [python, __file__, *sys.argv[1:]])


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lab(lab_python: str, folder: Path) -> tuple[subprocess.Popen, str]:
    """JupyterLab from the course's Python in ``folder``; returns it and its URL with token."""
    port, token = free_port(), "calc-check"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [lab_python, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
               f"--port={port}", f"--IdentityProvider.token={token}",
               f"--LabApp.app_settings_dir={ROOT / 'tools' / 'lab-settings'}",
               f"--ServerApp.root_dir={folder}"]  # fmt: skip
    with open(folder / "lab.log", "w") as log:  # the server keeps its own copy of the file
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/?token={token}"
    for _ in range(120):
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


def upload_notebook(url: str) -> None:
    """Put the scratch notebook (one cell: the calculator) into the server's root folder."""
    cell = {"cell_type": "code", "execution_count": None, "id": "calc", "metadata": {},
            "outputs": [], "source": CELL}  # fmt: skip
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook = {"nbformat": 4, "nbformat_minor": 5, "cells": [cell],
                "metadata": {"kernelspec": kernel}}  # fmt: skip
    body = json.dumps({"type": "notebook", "format": "json", "content": notebook}).encode()
    request = urllib.request.Request(api(url, f"contents/{NOTEBOOK}"), data=body, method="PUT",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    urllib.request.urlopen(request, timeout=10)


def notebook_address(url: str) -> str:
    """The lab page that opens the scratch notebook."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}/lab/tree/{NOTEBOOK}?{parts.query}"


class Check:
    """The browser session: a page, the screenshots taken, and the checks' outcomes."""

    def __init__(self, page, shots: Path, timeout: float) -> None:
        """Drive ``page``; save screenshots in ``shots``; wait up to ``timeout`` seconds."""
        self.page, self.shots, self.timeout = page, shots, timeout
        self.failures: list[str] = []

    def report(self, ok: bool, what: str) -> None:
        """Print one check's outcome and remember a failure."""
        print(f"[{'ok' if ok else 'FAIL'}] {what}")
        if not ok:
            self.failures.append(what)

    def shot(self, name: str) -> None:
        """A screenshot of the calculator's output (the whole page if it is not there)."""
        path = self.shots / name
        output = self.page.locator(".jp-OutputArea-output").first
        (output if output.count() else self.page).screenshot(path=str(path))
        print(f"      screenshot: {path}")

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
        redrawn = self.figure() != figure
        self.report(redrawn, f"the figure changed with the verdict after {what}")
        return now

    def control(self, label: str, kind: str):
        """The ``kind`` element (input, select) of the control described ``label``."""
        box = self.page.locator(".widget-inline-hbox").filter(
            has=self.page.locator("label", has_text=re.compile(f"^{re.escape(label)}$"))
        )
        return box.locator(kind).first


def run_cell(check: Check, url: str) -> None:
    """Open the notebook, run its cell once the kernel is idle, wait for the widget and figure."""
    page = check.page
    page.goto(notebook_address(url))
    editor = page.locator(".jp-Notebook .jp-Cell .cm-content").first
    editor.wait_for(timeout=60_000)
    page.get_by_text(re.compile(r"\| Idle$")).first.wait_for(timeout=120_000)  # the status bar
    prompt = page.locator(".jp-Notebook .jp-Cell .jp-InputPrompt").first
    for _ in range(3):  # a run sent while the kernel connects can be lost: send it again
        editor.click()
        page.keyboard.press("Control+Enter")
        try:
            page.wait_for_function("p => /\\[(\\*|\\d+)\\]/.test(p.textContent)",
                                   arg=prompt.element_handle(), timeout=15_000)  # fmt: skip
            break
        except Exception:  # Playwright's TimeoutError: send the run once more
            continue
    widget = page.locator(".jp-OutputArea-output .widget-vbox").first
    widget.wait_for(timeout=check.timeout * 1000)
    page.locator(".jp-OutputArea-output .widget-output img").first.wait_for(timeout=60_000)
    text = widget.inner_text()
    check.report("Memory calculator" in text, "the widget rendered (title shown)")
    check.report(bool(check.verdict()), f"a verdict is shown: {check.verdict()!r}")
    check.shot("01_rendered.png")


def change_batch_and_gpu(check: Check) -> None:
    """Type a micro-batch of 64 and press Enter, then pick the A100 MIG slice."""
    before = check.verdict()
    box = check.control("micro-batch", "input")
    after = check.change(lambda: (box.fill("64"), box.press("Enter")), "micro-batch 64")
    peaks = [re.search(r":\s*(\S+ \S+) of", v) for v in (before, after)]
    changed = after != before and peaks[0] and peaks[1] and peaks[0][1] != peaks[1][1]
    check.report(changed, f"the peak changed with the batch: {before!r} -> {after!r}")
    select = check.control("GPU", "select")
    label = next(o for o in select.locator("option").all_inner_texts() if "MIG" in o)
    now = check.change(lambda: select.select_option(label=label), f"GPU {label}")
    check.report("MIG" in now, f"the verdict names the GPU picked ({label}): {now!r}")
    check.shot("02_batch_64_on_a100_mig.png")


def pick_large_model(check: Check) -> None:
    """Pick bert-large: at micro-batch 64 it does not fit the slice, and the verdict says so."""
    select = check.control("model", "select")
    now = check.change(lambda: select.select_option(label="bert-large"), "model bert-large")
    check.report(now.startswith("does not fit"), f"bert-large does not fit: {now!r}")
    check.shot("03_bert_large_does_not_fit.png")


def suggest(check: Check) -> None:
    """Click Suggest and wait for the planner's answer."""
    page = check.page
    page.get_by_role("button", name=re.compile("Suggest the fastest setup")).click()
    answer = page.locator(".widget-html-content", has_text=re.compile("Fastest predicted|Nothing"))
    answer.first.wait_for(timeout=120_000)
    text = answer.first.inner_text()
    check.report("Fastest predicted to fit" in text, f"a suggestion: {text[:160]!r}...")
    check.shot("04_suggestion.png")


def refused_setting(check: Check) -> None:
    """Type a sequence longer than bert-large's positions: one red line, no traceback."""
    box = check.control("sequence length", "input")
    now = check.change(lambda: (box.fill("5000"), box.press("Enter")), "sequence 5000")
    output = check.page.locator(".jp-OutputArea-output").first.inner_text()
    ok = "exceeds max_position_embeddings" in now and "Traceback" not in output
    check.report(ok, f"a refused setting is one line, no traceback: {now!r}")
    check.shot("05_refused_setting.png")


def browse(url: str, args: argparse.Namespace) -> list[str]:
    """Run the checks in Chromium; returns the failed ones."""
    from playwright.sync_api import sync_playwright

    shots = Path(args.shots)
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1500})
        check = Check(page, shots, args.timeout)
        try:
            for step in (
                run_cell,
                change_batch_and_gpu,
                pick_large_model,
                suggest,
                refused_setting,
            ):
                step(check, url) if step is run_cell else step(check)
        except Exception as err:  # a step that could not finish: say which, keep the picture
            check.report(False, f"{type(err).__name__}: {str(err).splitlines()[0]}")
            page.screenshot(path=str(shots / "99_failure.png"))
        finally:
            browser.close()
    return check.failures


def main(argv: list[str] | None = None) -> int:
    """Start (or use) JupyterLab, run the checks, stop what was started; 0 when all held."""
    args = parse_args(argv)
    rerun_under(args.python)
    server, folder = None, None
    url = args.url
    if not url:
        folder = Path(tempfile.mkdtemp(prefix="calc_nb_"))
        server, url = start_lab(args.lab_python, folder)
    try:
        upload_notebook(url)
        failures = browse(url, args)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
            shutil.rmtree(folder, ignore_errors=True)
    print("all checks held" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
