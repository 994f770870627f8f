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


def cpu_ticks(pid: int) -> int:
    """User + system clock ticks of one process (proc(5))."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


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
        spinner_before, own_before = cpu_ticks(busy[0]), _tree_ticks(os.getpid())[0]
        with OtherLoad() as mine:  # the load is this test's own descendant: not "others"
            time.sleep(1.0)
        spinner, own = cpu_ticks(busy[0]) - spinner_before, _tree_ticks(os.getpid())[0] - own_before
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        time.sleep(0.5)
        assert not [p for p in busy if Path(f"/proc/{p}").exists()], "busy process outlived it"
    finally:
        proc.kill()
    assert mine.cores is not None
    # The load's process was busy, and every tick of it is in this process tree's count (what
    # OtherLoad takes off the machine's busy time), however busy the machine was meanwhile:
    # the two readings differ by the ticks it ran between them, one or two at most.
    assert spinner > 0.2 * os.sysconf("SC_CLK_TCK"), spinner
    assert own >= spinner - 2, (own, spinner)


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
