"""The interleaved comparison: its statistics, its rounds, its processes, its verdicts."""

import os

import pytest

from helpers.isolate import bench, compare_benches
from helpers.timing import (
    Claim,
    Comparison,
    Disturbance,
    check_claims,
    claims_summary,
    interleave,
    median_interval,
    pause,
    read_claims,
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


def test_when_every_contender_fails_the_error_names_each_one():
    # Seen on a GPU whose experiments could not start: timing nothing must not fail with a
    # ZeroDivisionError deep in the rounds, but say what stopped each contender.
    benches = {"broken": bench(pause, -1), "also broken": bench(pause, -2)}
    with pytest.raises(RuntimeError, match="no contender ran") as err:
        compare_benches(benches, "cpu", mode="fresh", rounds=5, max_rounds=5)
    assert "broken: ValueError" in str(err.value) and "also broken: ValueError" in str(err.value)


def test_a_wrong_way_claim_is_measured_again_before_it_can_fail():
    # The first measurement decides "a is faster" the wrong way (a machine hiccup on a's
    # side); fresh rounds measure again and find it holds: reported, not a failure.
    measurements = {"n": 0}
    hiccup = {"a": 3.0, "b": 2.0}

    def run(name: str) -> float:
        measurements["n"] += 1
        return hiccup[name] if measurements["n"] <= 10 else {"a": 1.0, "b": 2.0}[name]

    claim = Claim("a", "faster", "b")
    result = interleave(run, ["a", "b"], rounds=5, max_rounds=5, claims=[claim])
    assert result.first is not None and result.first.verdict(claim) == "fails"
    assert result.verdict(claim) == "holds" and result.decision(claim) == "unconfirmed"
    line = check_claims(result, [claim])[0]  # does not raise
    assert "first measurement median ratio 1.5" in line and line.endswith(
        "unconfirmed (the two measurements disagree; the rounds scatter widely: a noisy machine "
        "or a small effect at this size)"
    )
    assert measurements["n"] == 20  # two measurements of five rounds of two contenders


def test_a_wrong_way_claim_confirmed_twice_fails():
    claim = Claim("a", "faster", "b")
    wrong = interleave({"a": 3.0, "b": 2.0}.get, ["a", "b"], rounds=5, max_rounds=5,
                       claims=[claim])  # fmt: skip
    assert wrong.first is not None and wrong.decision(claim) == "fails"
    with pytest.raises(AssertionError, match="decided the other way, twice"):
        check_claims(wrong, [claim])
    # A claim that holds is measured once: nothing to confirm.
    right = interleave({"a": 1.0, "b": 2.0}.get, ["a", "b"], rounds=5, max_rounds=5,
                       claims=[claim])  # fmt: skip
    assert right.first is None and right.decision(claim) == "holds"


def test_a_comparison_built_from_a_result_is_measured_again_through_its_again():
    claim = Claim("a", "faster", "b")
    calls = []

    def again() -> Comparison:
        calls.append(1)
        return Comparison({"a": [1.0] * 5, "b": [2.0] * 5})

    wrong_once = Comparison({"a": [3.0] * 5, "b": [2.0] * 5}, again=again)
    assert "unconfirmed" in check_claims(wrong_once, [claim])[0] and calls == [1]
    never_again = Comparison({"a": [3.0] * 5, "b": [2.0] * 5})  # no way to measure again
    line = check_claims(never_again, [claim])[0]
    assert "unconfirmed (the other way in one measurement that its producer could not" in line
    import pickle

    assert pickle.loads(pickle.dumps(wrong_once)).again is None  # a closure stays home


def test_an_undecided_claim_never_fails_and_is_logged_with_its_reason(monkeypatch, tmp_path):
    log = tmp_path / "claims.jsonl"
    monkeypatch.setenv("COURSE_CLAIMS", str(log))
    result = Comparison({"a": [1.0, 3.0, 1.0, 3.0, 1.0], "b": [2.0] * 5, "c": [4.0] * 5})
    lines = check_claims(result, [Claim("a", "faster", "b"), Claim("a", "faster", "c")], "00")
    assert "undecided (the rounds scatter widely" in lines[0] and lines[1].endswith("holds")
    rows = read_claims(log)
    assert [r["verdict"] for r in rows] == ["undecided", "holds"]
    assert rows[0]["reason"].startswith("the rounds scatter") and rows[1]["reason"] == ""


def test_other_load_is_the_machines_ticks_less_ours_and_the_counters_rounding(monkeypatch):
    from helpers import hardware

    ticks = iter([1000, 1130])  # the machine's busy ticks before and after (100 per second)
    ours = iter([(400, 3), (460, 3)])  # this process tree's ticks, and its 3 processes
    clock = iter([10.0, 11.0])  # one second
    monkeypatch.setattr(hardware, "_busy_ticks", lambda cpus: next(ticks))
    monkeypatch.setattr(hardware, "_tree_ticks", lambda pid: next(ours))
    monkeypatch.setattr(hardware.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(hardware.os, "sysconf", lambda name: 100)
    with hardware.OtherLoad() as load:
        load.cpus = {0, 1}
    # 130 busy ticks, 60 of them ours, 2 CPUs + 3 processes of rounding: 65 ticks = 0.65 cores
    assert load.cores == pytest.approx(0.65)
    monkeypatch.setenv("COURSE_OTHERS_LIMIT", "0.25")
    watch = Disturbance()  # the limit from the environment
    monkeypatch.setattr(hardware, "OtherLoad", lambda: _Load(0.65))
    with watch.round():
        pass
    assert watch.set_aside() and watch.into.left_out == {
        "other processes used over 0.25 of a core": 1
    }
    monkeypatch.setattr(hardware, "OtherLoad", lambda: _Load(0.1))
    with watch.round():
        pass
    assert not watch.set_aside() and watch.into.others == [0.65, 0.1]


class _Load:  # helpers.hardware.OtherLoad with a known answer
    def __init__(self, cores):
        self.value = cores

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cores = self.value


def test_interleave_sets_aside_rounds_a_busy_machine_disturbed(monkeypatch):
    from helpers import hardware

    busy = iter([0.0, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0])
    monkeypatch.setattr(hardware, "OtherLoad", lambda: _Load(next(busy)))
    monkeypatch.delenv("COURSE_OTHERS_LIMIT")  # the default limit, as in a lesson
    result = interleave({"a": 1.0, "b": 2.0}.get, ["a", "b"], rounds=5, max_rounds=7,
                        claims=[Claim("a", "faster", "b")])  # fmt: skip
    assert result.rounds == 5 and result.left_out == {"other processes used over 0.25 of a core": 1}
    assert result.others == [0.0, 0.9, 0.0, 0.0, 0.0, 0.0] and result.busy() == (0.0, 0.9)


def test_cli_claims_summarises_the_log(monkeypatch, tmp_path, capsys):
    from helpers.course.cli import main

    log = tmp_path / "claims.jsonl"
    monkeypatch.setenv("COURSE_CLAIMS", str(log))
    result = Comparison({"a": [1.0, 3.0, 1.0, 3.0, 1.0], "b": [2.0] * 5, "c": [4.0] * 5},
                        others=[0.1, 0.5], left_out={"busy": 1})  # fmt: skip
    check_claims(result, [Claim("a", "faster", "c"), Claim("a", "faster", "b")], "03")
    assert main(["claims"]) == 0
    out = capsys.readouterr().out
    assert "2 checked in 1 lessons: 1 held, 1 undecided, 0 wrong once but not confirmed, " in out
    assert "0 confirmed wrong" in out and "rounds set aside (other processes busy): 2" in out
    assert "0.30 cores in a typical round, 0.50 at most" in out
    assert "03: time a / b < 1: undecided (median ratio 0.5, 5 rounds; a busy machine" in out
    wrong = interleave({"a": 3.0, "b": 2.0}.get, ["a", "b"], 5, 5, [Claim("a", "faster", "b")])
    with pytest.raises(AssertionError):
        check_claims(wrong, [Claim("a", "faster", "b")], "03")
    assert main(["claims"]) == 1  # a confirmed wrong claim fails the summary too
    assert "1 confirmed wrong" in claims_summary(read_claims(log))


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


def test_in_a_notebook_only_a_confirmed_wrong_claim_fails_the_cell(tmp_path, monkeypatch):
    # What a lesson does: print check_claims' lines. Undecided, and wrong once then right on
    # re-measurement, print and the cell passes; wrong twice raises in the cell.
    monkeypatch.setenv("COURSE_PROGRESS", "0")  # the kernel's rounds draw no progress widget
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    setup = (
        "from helpers.timing import Claim, Comparison, check_claims, interleave\n"
        "claim = Claim('a', 'faster', 'b')\n"
        "n = {'calls': 0}\n"
        "def hiccup(name):\n"
        "    n['calls'] += 1\n"
        "    return {'a': 3.0 if n['calls'] <= 10 else 1.0, 'b': 2.0}[name]\n"
    )
    cells = [
        setup,
        "noisy = Comparison({'a': [1.0, 3.0, 1.0, 3.0, 1.0], 'b': [2.0] * 5})\n"
        "print(check_claims(noisy, [claim])[0])",
        "once = interleave(hiccup, ['a', 'b'], 5, 5, [claim])\n"
        "print(check_claims(once, [claim])[0])",
        "twice = interleave({'a': 3.0, 'b': 2.0}.get, ['a', 'b'], 5, 5, [claim])\n"
        "check_claims(twice, [claim])",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})  # fmt: skip
    with pytest.raises(CellExecutionError, match="decided the other way, twice"):
        client.execute()
    outputs = ["".join(o.get("text", "") for o in c.outputs) for c in nb.cells]
    assert ": undecided (" in outputs[1] and ": unconfirmed (" in outputs[2]
    assert all(o.output_type == "stream" for c in nb.cells[:3] for o in c.outputs)  # no error


def test_a_machine_too_busy_to_decide_stops_the_rounds_early(monkeypatch):
    from helpers import hardware

    monkeypatch.setattr(hardware, "OtherLoad", lambda: _Load(0.9))  # every round disturbed
    monkeypatch.setenv("COURSE_OTHERS_LIMIT", "0.25")
    calls = []
    result = interleave(lambda n: calls.append(n) or 1.0, ["a", "b"], rounds=5, max_rounds=15,
                        claims=[Claim("a", "faster", "b")])  # fmt: skip
    # After 5 rounds, none of them kept (under a third): it stops, undecided.
    assert len(calls) == 2 * 5 and result.rounds == 0 and result.set_aside() == 5
    assert result.decision(Claim("a", "faster", "b")) == "undecided"
    assert "a busy machine: 5 rounds set aside" in result.describe(Claim("a", "faster", "b"))
    # Every other round disturbed: more than a third kept, it goes on until it decides.
    loads = iter([0.9, 0.0] * 20)
    monkeypatch.setattr(hardware, "OtherLoad", lambda: _Load(next(loads)))
    half = interleave({"a": 1.0, "b": 2.0}.get, ["a", "b"], rounds=5, max_rounds=15,
                      claims=[Claim("a", "faster", "b")])  # fmt: skip
    assert half.rounds == 5 and half.set_aside() == 5
    assert half.decision(Claim("a", "faster", "b")) == "holds"


def test_a_comparison_of_rounds_all_set_aside_still_reports():
    # A busy machine can set every round aside: the numbers are still reported (from all
    # rounds), nothing is decided, and a contender known only from set-aside rounds is there.
    every = Comparison.of({"a": []}, {"a": [1.0, 1.1, 0.9], "b": [2.0, 2.1, 1.9]})
    assert every.rounds == 0 and every.interval("a", "b") is None
    assert every.median("b") == 2.0 and every.ratio("a", "b") == pytest.approx(0.5)
    assert min(every.ratios("a", "b")) <= every.ratio("a", "b") <= max(every.ratios("a", "b"))
    assert every.decision(Claim("a", "faster", "b")) == "undecided"
    few = Comparison.of({"a": [1.0], "b": [2.0]}, {"a": [3.0, 3.0], "b": [2.0, 2.0]})
    assert few.rounds == 1 and len(few.ratios("a", "b")) == 3  # reported: every round
    assert few.ratio("a", "b") == pytest.approx(1.5) and few.interval("a", "b") is None


def test_a_fixed_count_of_rounds_stops_when_too_busy():
    from helpers.timing import Disturbance

    assert not Disturbance.too_busy(4, 0, 5)  # not yet the wanted number of attempts
    assert Disturbance.too_busy(5, 1, 5)  # 1 of 5 kept: under a third
    assert not Disturbance.too_busy(6, 2, 5)  # 2 of 6: a third exactly, go on
