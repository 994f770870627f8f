"""The interleaved comparison: its statistics, its rounds, its processes, its verdicts."""

import json
import os

import pytest

from helpers.isolate import bench, compare_benches
from helpers.timing import (
    STRICT_ENV,
    Claim,
    Comparison,
    check_claims,
    interleave,
    median_interval,
    pause,
)


def test_median_interval_is_the_binomial_order_statistic():
    assert median_interval([3, 1, 2, 5, 4]) == (1, 5)  # 5 rounds: 1 - 2/32 = 93.75 %
    assert median_interval([1, 2, 3, 4]) is None  # 4 rounds: 87.5 % at best
    assert median_interval(list(range(1, 10))) == (2, 8)  # 9 rounds: 96.1 %
    assert median_interval(list(range(1, 16)), confidence=0.95) == (4, 12)  # 96.5 %


def test_verdicts_follow_the_interval():
    fast = Comparison({"a": [1.0] * 5, "b": [2.0, 2.1, 1.9, 2.2, 2.0]})
    assert fast.verdict(Claim("a", "faster", "b")) == "holds"
    assert fast.verdict(Claim("a", "slower", "b")) == "fails"
    assert fast.verdict(Claim("a", "faster", "b", factor=0.4)) == "fails"
    assert fast.verdict(Claim("a", "similar", "b", factor=1.5)) == "fails"
    mixed = Comparison({"a": [1.0, 3.0, 1.0, 3.0, 1.0], "b": [2.0] * 5})
    assert mixed.verdict(Claim("a", "faster", "b")) == "undecided"
    same = Comparison({"a": [1.0, 1.1, 0.95, 1.0, 1.05], "b": [1.0] * 5})
    assert same.verdict(Claim("a", "similar", "b", factor=1.2)) == "holds"


def test_interleaving_cancels_a_drift_that_sequential_timing_mistakes_for_a_difference():
    """The machine slows down 2x halfway through: sequential timing blames the second contender."""
    clock = {"calls": 0}

    def machine(work: float, total_calls: int) -> float:
        clock["calls"] += 1
        return work * (2.0 if clock["calls"] > total_calls // 2 else 1.0)

    work = {"a": 1.0, "b": 1.0}  # the same work: the true ratio is 1
    sequential = {n: [machine(work[n], 20) for _ in range(10)] for n in work}
    naive = Comparison(sequential)
    assert naive.verdict(Claim("b", "slower", "a", factor=1.5)) == "holds"  # wrong!
    clock["calls"] = 0
    fair = interleave(lambda n: machine(work[n], 20), ["a", "b"], rounds=10, max_rounds=10)
    assert fair.verdict(Claim("b", "similar", "a", factor=1.5)) == "holds"


def test_more_rounds_are_taken_while_undecided_up_to_the_bound():
    values = iter([1.0, 3.0] * 50)
    noisy = interleave(lambda n: next(values), ["a", "b"], rounds=5, max_rounds=9,
                       claims=[Claim("a", "faster", "b")])  # fmt: skip
    assert noisy.rounds == 9 and noisy.verdict(Claim("a", "faster", "b")) == "undecided"
    clear = interleave({"a": 1.0, "b": 2.0}.get, ["a", "b"], rounds=5, max_rounds=9,
                       claims=[Claim("a", "faster", "b")])  # fmt: skip
    assert clear.rounds == 5


@pytest.mark.parametrize("mode", ["workers", "fresh"])
def test_contenders_in_their_own_processes(mode):
    benches = {"short": bench(pause, 0.01), "long": bench(pause, 0.03), "broken": bench(pause, -1)}
    result = compare_benches(benches, "cpu", mode=mode, rounds=5, max_rounds=5)
    claim = Claim("long", "slower", "short", factor=2.0, why="3x the wait")
    assert result.verdict(claim) == "holds", result.describe(claim)
    assert "broken" in result.errors and "ValueError" in result.errors["broken"]
    assert result.verdict(Claim("broken", "faster", "short")) == "undecided"


def test_check_claims_fails_on_a_wrong_verdict_and_on_undecided_when_strict(monkeypatch, tmp_path):
    log = tmp_path / "claims.jsonl"
    monkeypatch.setenv("COURSE_CLAIMS", str(log))
    monkeypatch.delenv(STRICT_ENV, raising=False)
    result = Comparison({"a": [1.0, 3.0, 1.0, 3.0, 1.0], "b": [2.0] * 5, "c": [4.0] * 5})
    lines = check_claims(result, [Claim("a", "faster", "b"), Claim("a", "faster", "c")], "00")
    assert "undecided" in lines[0] and "holds" in lines[1]
    with pytest.raises(AssertionError, match="decided the other way"):
        check_claims(result, [Claim("c", "faster", "a")])
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(AssertionError, match="undecided"):
        check_claims(result, [Claim("a", "faster", "b")])
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["verdict"] for r in rows] == ["undecided", "holds", "fails", "undecided"]


def test_cli_claims_summarises_the_log(monkeypatch, tmp_path, capsys):
    from helpers.cli import main

    log = tmp_path / "claims.jsonl"
    monkeypatch.setenv("COURSE_CLAIMS", str(log))
    monkeypatch.delenv(STRICT_ENV, raising=False)
    result = Comparison({"a": [1.0, 3.0, 1.0, 3.0, 1.0], "b": [2.0] * 5, "c": [4.0] * 5})
    check_claims(result, [Claim("a", "faster", "c"), Claim("a", "faster", "b")], "03")
    assert main(["claims"]) == 0
    out = capsys.readouterr().out
    assert "2 checked in 1 lessons: 1 holds, 1 undecided, 0 fails" in out
    assert "03: time a / b < 1: undecided" in out


def test_forward_backward_adds_rounds_until_its_claims_are_decided():
    from helpers.train import RunConfig, forward_backward

    cfg = RunConfig(model="bert-tiny", batch_size=2, seq_len=16, warmup=1, flops=False)
    plain = forward_backward(cfg, rounds=2, max_rounds=8)
    assert len(plain.forward_times) == 2 and plain.classes().rounds == 2
    # "all ops" includes the element-wise ones, so it is decided as soon as an interval exists:
    # five rounds (median_interval's minimum at 90 %).
    sure = Claim("all ops", "slower", "element-wise", 1.0)
    fb = forward_backward(cfg, rounds=2, max_rounds=8, claims=[sure])
    assert fb.passes().rounds == fb.classes().rounds == 5 and fb.decided([sure])


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")
def test_cpu_burner_is_busy_when_start_returns_and_gone_after_stop():
    # The load must be on when start() returns: lesson 00 times ten short calls right after it.
    import time

    from helpers.timing import CpuBurner

    def cpu_ticks(pid: int) -> int:  # user + system clock ticks of a process (proc(5))
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])

    burner = CpuBurner(1)
    burner.start()
    try:
        (proc,) = burner._procs
        before = cpu_ticks(proc.pid)
        time.sleep(0.5)
        assert cpu_ticks(proc.pid) - before >= 0.2 * os.sysconf("SC_CLK_TCK")  # >= 40 % busy
    finally:
        burner.stop()
    assert not proc.is_alive() and burner._procs == []
