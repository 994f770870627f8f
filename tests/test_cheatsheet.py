"""The cheat sheet's ratios come from the right records (helpers/course/cheatsheet.py)."""

from helpers.course.cheatsheet import find, markdown, rows
from helpers.results import Record


def _rec(lesson, label, speed=None, peak=None, error=None):
    return Record(config={"label": label}, lesson=lesson, samples_per_s=speed,
                  memory=None if peak is None else {"peak": peak}, error=error)  # fmt: skip


def test_ratios_are_variant_over_baseline_of_the_same_lesson():
    records = [
        _rec("14", "vanilla", speed=10.0, peak=1000),
        _rec("14", "16-bit", speed=5.0, peak=800),
        _rec("05", "16-bit", speed=99.0, peak=1),  # another lesson's record of that name
    ]
    row = next(r for r in rows(records) if r.method.name == "Mixed precision training")
    assert (row.speed_ratio, row.memory_ratio) == (0.5, 0.8)
    assert round(row.v100_speed, 2) == 2.10  # 18.64 / 8.86 samples/s in the v4.30 guide


def test_the_largest_matching_number_wins_and_failures_are_skipped():
    records = [
        _rec("11", "slow, 1 workers", speed=2.0),
        _rec("11", "slow, 4 workers", speed=3.0, error="crash"),
        _rec("11", "slow, 2 workers", speed=4.0),
        _rec("11", "slow, 0 workers", speed=1.0),
    ]
    assert find(records, "11", r"slow, (\d+) workers").label == "slow, 2 workers"
    row = next(r for r in rows(records) if r.method.name == "Data preloading")
    assert row.speed_ratio == 4.0 and row.memory_ratio is None and row.ran


def test_an_empty_store_says_not_run_yet():
    assert all(not r.ran and r.speed_ratio is None for r in rows([]))
    assert markdown([]).count("not run yet") == 2 * len(rows([]))  # speed and memory, each row
