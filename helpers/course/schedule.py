"""Jobs run several at a time, within a number of slots and a byte budget, on a deadline.

``gpu-check`` runs its estimator settings this way: each job starts a process of its own
(``helpers.isolate.call_isolated``) from a thread here, so the threads only wait. A job
holds at most ``need(job)`` bytes of the device (on a GPU its process is capped to that);
jobs start while the slots and the bytes allow, in the order given (a smaller one goes ahead
of one waiting for bytes), and each one's outcome comes back in this thread as it ends, with
when it started and ended.

Several schedules running at once in threads of their own (gpu-check's settings, recipes and
notebooks) share one card through a ``Ledger`` of its bytes.

Example::

    ran = run_at_once(["a", "b", "c"], work=lambda name: len(name), slots=2)
    [r.name for r in ran]  # in the order they ended
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field


@dataclass
class Ran:
    """One job's outcome: what ``work`` returned (or the error it raised) and when it ran."""

    name: str
    value: object = None
    error: str = ""  # the exception ``work`` raised, one line
    started: float = 0.0  # seconds since the schedule began
    ended: float = 0.0
    need: int | None = None  # the bytes it was admitted with (None: not counted)


@dataclass
class Schedule:
    """What ``run_at_once`` did: every job that ran, and those it could not start, and why."""

    ran: list[Ran] = field(default_factory=list)
    not_started: dict[str, str] = field(default_factory=dict)  # name -> why
    most_at_once: int = 0  # the largest number of jobs that ran together

    def overlapped(self) -> bool:
        """Whether two jobs ran at the same time (from their start and end times)."""
        spans = sorted((r.started, r.ended) for r in self.ran)
        return any(b[0] < a[1] for a, b in itertools.pairwise(spans))


class Ledger:
    """The bytes of one card that jobs hold, shared by schedules in several threads.

    A job takes its bytes before it starts and gives them back when it ends. It fits beside
    what is held within ``capacity``; when nothing is held it fits whatever it needs (a job
    larger than the card is refused before it asks: ``run_at_once``'s ``not_started``).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity, self.held = capacity, 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        """Hold ``nbytes`` if they fit; whether they did."""
        with self._lock:
            if self.held and self.held + nbytes > self.capacity:
                return False
            self.held += nbytes
            return True

    def give(self, nbytes: int) -> None:
        """Give back what ``take`` held."""
        with self._lock:
            self.held -= nbytes


def concurrency(device_type: str, cores: int | None = None) -> int:
    """Experiments at once, each in its own process: on a GPU two host cores each (a process
    builds its model and feeds the card), at most 8; on a CPU one per core, at most 2.
    ``cores``: the host's (default: this machine's)."""
    cores = cores or os.cpu_count() or 1
    if device_type == "cuda":
        return max(1, min(8, cores // 2))
    return max(1, min(2, cores))


def run_at_once(
    names: Iterable[str],
    work: Callable[[str], object],
    slots: int,
    capacity: int | None = None,
    need: Callable[[str], int | None] = lambda name: None,
    left: Callable[[], float] = lambda: math.inf,
    min_left: float = 0.0,
    on_done: Callable[[Ran], None] = lambda ran: None,
    origin: float | None = None,
    ledger: Ledger | None = None,
) -> Schedule:
    """``work(name)`` for every name, at most ``slots`` at once and, with ``capacity`` (or a
    ``ledger`` shared with other schedules), at most that many bytes of ``need`` together.

    Args:
        names: the jobs, in the order they may start.
        work: runs one job (in a thread of its own); its return value is the job's outcome.
        slots: how many jobs run at once.
        capacity: bytes the running jobs' needs may add up to (None: no limit).
        need: a job's bytes, asked once, when it is next to start; a job whose need is
            unknown (None) or larger than ``capacity`` is not started (``not_started``).
        left: seconds left to the deadline; a job is not started with less than ``min_left``.
        on_done: called in this thread with each job's ``Ran`` as it ends.
        origin: the ``time.monotonic()`` the jobs' start and end times count from
            (default: this call's start).
        ledger: the card's bytes, shared with schedules in other threads.

    Returns:
        A ``Schedule``: every ``Ran`` in the order the jobs ended, the jobs not started.
    """
    if slots < 1:
        raise ValueError("slots must be at least 1")
    queue, out = list(names), Schedule()
    needs: dict[str, int | None] = {}
    running: dict[Future, Ran] = {}
    start = time.monotonic() if origin is None else origin
    ledger = ledger or (Ledger(capacity) if capacity is not None else None)

    with ThreadPoolExecutor(max_workers=slots) as pool:
        while queue or running:
            while len(running) < slots:
                name = _next_fitting(queue, needs, need, ledger, left, min_left, out)
                if name is None:
                    break  # nothing left, or nothing that fits beside what runs
                queue.remove(name)
                ran = Ran(name, need=needs[name])
                running[pool.submit(_timed, work, ran, start)] = ran
                out.most_at_once = max(out.most_at_once, len(running))
            if not running:  # what is left waits for bytes that other schedules hold
                time.sleep(0.2)
                continue
            done, _ = wait(running, return_when=FIRST_COMPLETED, timeout=1.0)
            for future in sorted(done, key=lambda f: running[f].ended):
                ran = running.pop(future)
                if ledger is not None and ran.need:
                    ledger.give(ran.need)
                out.ran.append(ran)
                on_done(ran)
    return out


def _timed(work: Callable[[str], object], ran: Ran, start: float) -> Ran:
    """``work(ran.name)`` into ``ran``: its value or its error, when it started and ended."""
    ran.started = time.monotonic() - start
    try:
        ran.value = work(ran.name)
    except Exception as err:  # reported with the job, never raised here
        ran.error = f"{type(err).__name__}: {err}".splitlines()[0]
    ran.ended = time.monotonic() - start
    return ran


def _next_fitting(queue, needs, need, ledger, left, min_left, out) -> str | None:
    """The first queued job that fits beside the running ones, its bytes then held in the
    ledger (a later, smaller one may go ahead of one waiting for bytes); jobs that can never
    start leave the queue, with why."""
    capacity = ledger.capacity if ledger is not None else None
    for name in list(queue):
        if name not in needs:
            needs[name] = need(name) if capacity is not None else None
        why = _why_not(needs[name], capacity, left(), min_left)
        if why:
            out.not_started[name] = why
            queue.remove(name)
        elif ledger is None or ledger.take(needs[name]):
            return name
    return None


def _why_not(need: int | None, capacity: int | None, left: float, min_left: float) -> str:
    """Why a job cannot start at all, or ""."""
    if left < min_left:
        return f"{max(0.0, left):.0f} s left, {min_left:.0f} s needed to start one"
    if capacity is None:
        return ""
    if need is None:
        return "its memory could not be predicted"
    if need > capacity:
        return f"needs {need / 2**30:.1f} GiB, more than the {capacity / 2**30:.1f} GiB shared"
    return ""
