"""helpers.course.schedule: jobs side by side within slots and a byte budget, on a deadline."""

from __future__ import annotations

import threading
import time

import pytest

from helpers.course.schedule import Ledger, run_at_once


def test_jobs_run_side_by_side_within_their_slots():
    live, most = set(), []
    lock = threading.Lock()

    def work(name):
        with lock:
            live.add(name)
            most.append(len(live))
        time.sleep(0.3)
        with lock:
            live.discard(name)
        return name.upper()

    start = time.monotonic()
    out = run_at_once(["a", "b", "c", "d"], work, slots=2)
    took = time.monotonic() - start
    assert sorted(r.value for r in out.ran) == ["A", "B", "C", "D"]
    assert max(most) == out.most_at_once == 2 and out.overlapped()
    assert took < 4 * 0.3  # two at a time: about 0.6 s, not 1.2 s
    assert all(0 <= r.started < r.ended for r in out.ran)


def test_the_bytes_they_need_never_add_up_past_the_capacity():
    needs = {"big": 6, "big too": 6, "small": 3}
    out = run_at_once(list(needs), lambda name: time.sleep(0.2), slots=3, capacity=10,
                      need=needs.get)  # fmt: skip
    spans = {r.name: (r.started, r.ended) for r in out.ran}
    first, second = spans["big"], spans["big too"]
    assert second[0] >= first[1] or first[0] >= second[1]  # 12 > 10: never together
    assert spans["small"][0] < first[1]  # 6 + 3 fit: the small one ran beside the first
    assert out.most_at_once == 2 and {r.name: r.need for r in out.ran} == needs


def test_what_cannot_start_is_named_with_the_reason():
    needs = {"unknown": None, "too big": 20, "fits": 5}
    out = run_at_once(list(needs), lambda name: name, slots=2, capacity=10, need=needs.get)
    assert [r.name for r in out.ran] == ["fits"]
    assert "could not be predicted" in out.not_started["unknown"]
    assert "more than the" in out.not_started["too big"]
    late = run_at_once(["x"], lambda name: name, slots=1, left=lambda: 10.0, min_left=30.0)
    assert not late.ran and "10 s left" in late.not_started["x"]


def test_a_job_that_raises_is_reported_with_its_error_and_the_others_go_on():
    def work(name):
        if name == "bad":
            raise RuntimeError("the card fell over\nand a traceback")
        return 1

    seen = []
    out = run_at_once(["bad", "good"], work, slots=2, on_done=lambda ran: seen.append(ran.name))
    errors = {r.name: r.error for r in out.ran}
    assert errors == {"bad": "RuntimeError: the card fell over", "good": ""}
    assert sorted(seen) == ["bad", "good"]  # on_done saw each, in the order they ended
    with pytest.raises(ValueError, match="slots"):
        run_at_once(["a"], work, slots=0)


def test_schedules_in_two_threads_share_the_cards_bytes_through_a_ledger():
    """Settings and notebooks of gpu-check run in threads of their own: what they hold
    together never passes the ledger's capacity, and a job waiting for another schedule's
    bytes starts once they are given back."""
    from concurrent.futures import ThreadPoolExecutor

    ledger = Ledger(10)
    held, most = [0], [0]
    lock = threading.Lock()

    def work(need):
        def run(name):
            with lock:
                held[0] += need[name]
                most[0] = max(most[0], held[0])
            time.sleep(0.3)
            with lock:
                held[0] -= need[name]

        return run

    first, second = {"a": 6, "b": 6}, {"x": 4, "y": 7}
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(run_at_once, list(n), work(n), 2, need=n.get, ledger=ledger)
                for n in (first, second)]  # fmt: skip
        outs = [j.result() for j in jobs]
    assert [sorted(r.name for r in out.ran) for out in outs] == [["a", "b"], ["x", "y"]]
    assert most[0] <= 10 and ledger.held == 0
