#!/usr/bin/env python3
"""A bursty CPU load: random busy spells and idle gaps on one core (or more), for N seconds.

The course's speed claims are tested under it (``make load-test``): on a machine whose speed
changes while a lesson runs, a claim must still come out right, or be reported undecided,
never decided the wrong way. Standard library only; it stops by itself.

    python tools/bursty_load.py --seconds 600               # one core, until 10 minutes pass
    python tools/bursty_load.py --seconds 600 --cores 2 --busy 0.5 3 --idle 0.2 1
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import signal
import sys
import time


def spells(seconds: float, busy: tuple[float, float], idle: tuple[float, float], seed: int):
    """Alternate busy loops and sleeps of random lengths until ``seconds`` have passed."""
    rng = random.Random(seed)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        until = min(end, time.monotonic() + rng.uniform(*busy))
        while time.monotonic() < until:
            sum(range(10_000))
        time.sleep(max(0.0, min(rng.uniform(*idle), end - time.monotonic())))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, required=True, help="stop after this long")
    parser.add_argument("--cores", type=int, default=1, help="busy processes (default 1)")
    parser.add_argument("--busy", type=float, nargs=2, default=(0.2, 2.0), metavar=("MIN", "MAX"),
                        help="seconds of each busy spell, drawn uniformly (0.2 2.0)")  # fmt: skip
    parser.add_argument("--idle", type=float, nargs=2, default=(0.1, 1.5), metavar=("MIN", "MAX"),
                        help="seconds of each idle gap, drawn uniformly (0.1 1.5)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.seconds <= 0 or args.cores < 1:
        parser.error("--seconds and --cores must be positive")
    procs = [
        mp.Process(target=spells, args=(args.seconds, args.busy, args.idle, args.seed + i))
        for i in range(args.cores)
    ]
    for proc in procs:
        proc.start()
    # Stopped early (make's trap sends SIGTERM): the busy processes stop with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        for proc in procs:
            proc.join()
    finally:
        for proc in procs:
            proc.terminate()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
