"""The shared plotting helpers (helpers/plots.py) draw figures a reader can read.

Each helper is rendered with inputs shaped like the lessons' (long recipe names, many runs,
batch sizes on log axes) and checked with ``figure_problems``; the checker itself is shown
to catch each kind of problem on figures built to have it.
"""

from matplotlib.figure import Figure

from helpers import plots
from helpers.names import MiB
from tests.plot_checks import figure_problems

RECIPES = [
    "baseline",
    "Adafactor",
    "Adafactor + accum",
    "Adafactor + accum + ckpt",
    "Adafactor + accum + ckpt + 16-bit",
    "8-bit Adam + accum + ckpt + 16-bit",
    "accum + ckpt + 16-bit",
]


def _memory(scale: int) -> dict[str, int]:
    parts = dict(params=4, gradients=4, optimizer_state=8, activations=6, temporaries=2)
    mem = {k: v * scale * MiB for k, v in parts.items()}
    mem["peak"] = sum(mem.values()) - scale * MiB
    return mem


def test_the_checker_finds_overlapping_ticks_a_covering_legend_and_text_outside():
    fig = Figure(figsize=(3, 2))
    ax = fig.add_subplot()
    ax.bar([f"a long run label {i}" for i in range(6)], [5, 5, 5, 5, 5, 5], label="bars")
    ax.legend(loc="center")
    ax.set_title("far too long a title for a figure only three inches wide, running off it")
    found = figure_problems(fig)
    assert any("tick labels" in p for p in found), found
    assert any("legend covers a bar" in p for p in found), found
    assert any("outside the figure" in p for p in found), found


def test_the_checker_finds_a_legend_over_plotted_points():
    fig = Figure(figsize=(4, 3))
    ax = fig.add_subplot()
    ax.plot([0, 1, 2], [1, 1, 1], "o", label="points")
    ax.legend(loc="center")
    assert any("legend covers 'points'" in p for p in figure_problems(fig))


def test_memory_bars_stack_temporaries_and_keep_labels_and_legend_clear():
    fig = plots.memory_bars({r: _memory(i + 1) for i, r in enumerate(RECIPES)}, title="recipes")
    assert figure_problems(fig) == []
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "temporaries" in labels, labels
    # The stack reaches the measured peak: no dot floats above its bar.
    tops = {}
    for patch in ax.patches:
        x = round(patch.get_x() + patch.get_width() / 2)
        tops[x] = max(tops.get(x, 0), patch.get_y() + patch.get_height())
    peaks = ax.lines[0].get_ydata()
    assert all(tops[i] >= p for i, p in enumerate(peaks)), (tops, list(peaks))


def test_lines_on_log_axes_label_the_data_points_plainly():
    fig = plots.lines([2, 4, 8], {"act": [3, 6, 12], "peak": [10, 13, 19]}, "batch", "MiB",
                      logx=True, logy=True)  # fmt: skip
    assert figure_problems(fig) == []
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["2", "4", "8"]
    texts = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True)]
    assert not any("times" in t or "^" in t for t in texts), texts
    lo, hi = ax.get_ylim()  # 3 to 19 MiB: under one decade, yet several plain labels
    # Labels carry thousands separators ("1,000"); matplotlib 3.10 also lists ticks outside.
    values = [float(t.get_text().replace(",", "")) for t in ax.get_yticklabels() if t.get_text()]
    shown = [v for v in values if lo <= v <= hi]
    assert len(shown) >= 2, texts


def test_bars_with_long_names_and_ranges():
    values = {r: 10.0 + i for i, r in enumerate(RECIPES)}
    ranges = {r: (v - 1, v + 1) for r, v in values.items()}
    assert figure_problems(plots.bars(values, "samples/s", "speed", ranges=ranges)) == []
    assert figure_problems(plots.bars({"eager": 1.0, "compiled": 2.0}, "ms")) == []


def test_timeline_two_panels():
    runs = {
        "one after the other": {"A": [0.01] * 10, "B": [0.012] * 10},
        "interleaved": {"A": [0.01] * 10, "B": [0.012] * 10},
    }
    assert figure_problems(plots.timeline(runs, "ms per call", "timing", mark=5)) == []


def test_large_sizes_on_a_log_axis_read_as_whole_numbers():
    sizes = [2**k for k in (10, 14, 18, 22)]
    fig = plots.lines(sizes, {"eager": [4.0, 3.0, 2.5, 2.4]}, "elements", "ns", logx=True)
    assert figure_problems(fig) == []
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()][-1] == "4,194,304"


def test_a_short_bar_with_a_range_has_its_value_above_it():
    values = {"foreach": 5.0, "fused": 0.4, "for loop": 6.0}
    fig = plots.bars(values, "ms", ranges={k: (0.9 * v, 1.1 * v) for k, v in values.items()})
    assert figure_problems(fig) == []
    ax = fig.axes[0]
    above = [t for t in ax.texts if t.get_text() == "0.4"]
    assert len(above) == 1 and above[0].xy[1] >= 0.44, [t.get_text() for t in ax.texts]


def test_reference_lines_are_labelled_outside_the_axes():
    fig = plots.lines([1, 2, 3], {"loss": [4.0, 2.0, 1.0]}, "step", "loss", hlines={"best": 1.1})
    assert figure_problems(fig) == []
    label = next(t for t in fig.axes[0].texts if t.get_text() == "best")
    assert label.xy[0] == 1.0  # at the right edge, in axes fraction
