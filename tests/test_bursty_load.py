"""tools/bursty_load.py: the load make load-test runs beside the lessons, and its stopping."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.hardware import OtherLoad, _tree_ticks

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bursty_load.py"


def children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                text = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(text[text.rindex(")") + 2 :].split()[1]) == pid:
                out.append(int(entry))
    return out


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux's /proc")
def test_load_is_seen_as_other_processes_and_stops_with_its_parent():
    # Started from here the load is this process's descendant, which OtherLoad counts as
    # this process tree's own, not as others'; its busy child is what make's trap has to stop.
    proc = subprocess.Popen([sys.executable, str(TOOL), "--seconds", "60", "--busy", "5", "5"])
    try:
        deadline = time.monotonic() + 20
        while not children(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        busy = children(proc.pid)
        assert busy, "the load started no busy process"
        time.sleep(0.5)
        own_before = _tree_ticks(os.getpid())[0]
        with OtherLoad() as mine:  # the load is this test's own descendant: not "others"
            time.sleep(1.0)
        own = (_tree_ticks(os.getpid())[0] - own_before) / os.sysconf("SC_CLK_TCK")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        time.sleep(0.5)
        assert not [p for p in busy if Path(f"/proc/{p}").exists()], "busy process outlived it"
    finally:
        proc.kill()
    assert mine.cores is not None
    # One core busy for the whole second, and OtherLoad counted it as ours (what it takes
    # off the machine's busy time), whatever else the machine was doing meanwhile.
    assert own > 0.7, own


SPIN = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 2.5:\n    pass"


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux's /proc")
def test_other_load_counts_a_process_that_is_not_ours():
    # An orphan (its parent exits at once) spins for 2.5 s: another process's core.
    launch = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {SPIN!r}])"
    subprocess.run([sys.executable, "-c", launch], check=True)
    time.sleep(0.5)  # the interpreter is up and spinning
    with OtherLoad() as other:
        time.sleep(1.0)
    # One core for the whole second; the machine's own noise may add, a scheduler hiccup
    # may take a little.
    assert other.cores is not None and other.cores > 0.7, other.cores
