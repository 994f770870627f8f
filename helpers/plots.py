"""Plots that return a matplotlib Figure; nothing is shown or saved as a side effect.

Figures are built with ``matplotlib.figure.Figure`` rather than pyplot, so no global figure
state is touched. In a notebook, ``%matplotlib inline`` makes a returned figure display.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter, NullLocator

from helpers.names import MiB

# One colour per memory category, used by every lesson so the categories read the same.
CATEGORY_COLORS = {
    "params": "#4C72B0",
    "gradients": "#55A868",
    "optimizer_state": "#C44E52",
    "activations": "#8172B2",
    "temporaries": "#CCB974",
    "buffers": "#64B5CD",
    "inputs": "#999999",
}


# The categories a training step's memory is split into, in stacking order.
STEP_CATEGORIES = ("params", "gradients", "optimizer_state", "activations", "temporaries")


def plain_number(v: float) -> str:
    """A tick label: ``4,194,304`` and ``256`` for whole numbers, ``0.25`` otherwise."""
    return f"{v:,.0f}" if float(v).is_integer() else f"{v:g}"


def plain_ticks(ax, x: Sequence[float] | None = None) -> None:
    """Plain numbers on log axes: ticks at the data points ``x`` (if given), no minor labels."""
    import math

    plain = FuncFormatter(lambda v, _: plain_number(v))
    for axis, scale, limits in ((ax.xaxis, ax.get_xscale(), ax.get_xlim()),
                                (ax.yaxis, ax.get_yscale(), ax.get_ylim())):  # fmt: skip
        if scale == "log":
            lo, hi = sorted(limits)
            if lo > 0 and math.log10(hi / lo) < 2:  # under two decades: 1, 2, 5 in each
                axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(NullFormatter())
    if x is not None and ax.get_xscale() == "log":
        ax.set_xticks(list(x), [plain_number(v) for v in x])
        ax.xaxis.set_minor_locator(NullLocator())


def legend_outside(ax, **options) -> None:
    """The legend to the right of the axes, where it cannot cover a bar or a point."""
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1), **options)


def category_labels(ax, labels: Sequence[str], width: int = 14) -> None:
    """Run labels under bars, wrapped at ``width`` characters and slanted so none overlap."""
    import textwrap

    wrapped = ["\n".join(textwrap.wrap(str(lab), width, break_long_words=False)) or str(lab)
               for lab in labels]  # fmt: skip
    ax.set_xticks(range(len(labels)), wrapped, rotation=30 if len(labels) > 3 else 0,
                  ha="right" if len(labels) > 3 else "center", fontsize="small")  # fmt: skip


def separate_labels(fig: Figure, texts: Sequence, step: float = 9, passes: int = 12) -> None:
    """Nudge point labels (annotations placed in offset points) down until none overlaps."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    for _ in range(passes):
        canvas.draw()
        boxes = [t.get_window_extent(canvas.get_renderer()) for t in texts]
        moved = False
        for j in range(len(texts)):
            if any(boxes[i].overlaps(boxes[j]) for i in range(j)):
                x, y = texts[j].xyann
                texts[j].xyann = (x, y - step)
                moved = True
        if not moved:
            return


def memory_bars(
    memories: Mapping[str, Mapping[str, int]],
    categories: Sequence[str] = STEP_CATEGORIES,
    title: str = "",
    peaks: bool = True,
) -> Figure:
    """Stacked bars of per-category bytes (MiB) for each labelled run, the measured peak as a dot.

    The stack adds each category's own maximum, so it can exceed the peak: categories reach
    their maxima at different moments of the step (the dot shows the real simultaneous peak).
    Temporaries are in the stack by default, so the dot never floats above a stack that left
    part of the peak out.
    """
    fig = Figure(figsize=(max(5, 1.1 * len(memories) + 3), 4), layout="constrained")
    ax = fig.add_subplot()
    labels = list(memories)
    bottoms = [0.0] * len(labels)
    for cat in categories:
        values = [memories[lab].get(cat, 0) / MiB for lab in labels]
        ax.bar(labels, values, bottom=bottoms, label=cat, color=CATEGORY_COLORS.get(cat))
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    if peaks:
        ax.plot(labels, [memories[lab].get("peak", 0) / MiB for lab in labels], "ko", label="peak")
    ax.set_ylabel("MiB (exact, per category)")
    ax.set_title(title)
    legend_outside(ax)
    category_labels(ax, labels)
    return fig


def lines(
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
    xlabel: str,
    ylabel: str,
    title: str = "",
    logx: bool = False,
    logy: bool = False,
    hlines: Mapping[str, float] | None = None,
    ranges: Mapping[str, Sequence[tuple[float, float]]] | None = None,
) -> Figure:
    """One line per series against ``x``; optional labelled horizontal reference lines.

    ``ranges`` gives a series (low, high) per point, drawn as error bars: for medians of
    interleaved rounds, the slowest and the fastest round.
    """
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    for name, ys in series.items():
        spans = (ranges or {}).get(name)
        if spans is None:
            ax.plot(x, ys, marker="o", label=name)
            continue
        errors = [[y - lo for y, (lo, _) in zip(ys, spans, strict=True)],
                  [hi - y for y, (_, hi) in zip(ys, spans, strict=True)]]  # fmt: skip
        ax.errorbar(x, ys, yerr=errors, marker="o", capsize=3, label=name)
    for name, y in (hlines or {}).items():  # labelled outside the axes, clear of the curves
        ax.axhline(y, linestyle="--", color="grey", linewidth=1)
        ax.annotate(name, (1.0, y), xycoords=("axes fraction", "data"), xytext=(3, 0),
                    textcoords="offset points", fontsize="small", va="center")  # fmt: skip
    ax.set_xscale("log" if logx else "linear")
    ax.set_yscale("log" if logy else "linear")
    plain_ticks(ax, x)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def bars(
    values: Mapping[str, float],
    ylabel: str,
    title: str = "",
    fmt: str = "{:.3g}",
    ranges: Mapping[str, tuple[float, float]] | None = None,
) -> Figure:
    """Labelled bars with their values written on top.

    ``ranges`` (low, high) per bar draws an error bar: for a median of interleaved rounds,
    the slowest and the fastest round, so the bar's spread is in the picture.
    """
    fig = Figure(figsize=(max(4, 1.0 * len(values) + 2), 3.5), layout="constrained")
    ax = fig.add_subplot()
    errors = None
    if ranges:
        lows = [values[k] - ranges[k][0] for k in values]
        highs = [ranges[k][1] - values[k] for k in values]
        errors = [lows, highs]
    rects = ax.bar(list(values), list(values.values()), color="#4C72B0", yerr=errors,
                   capsize=4, ecolor="#333333")  # fmt: skip
    labels = [fmt.format(v) for v in values.values()]
    if ranges:  # inside the bars, clear of the error bars; a short bar's above its range
        top = max(hi for _, hi in ranges.values())
        tall = [v >= 0.15 * top for v in values.values()]
        ax.bar_label(rects, labels=[lab if t else "" for lab, t in zip(labels, tall, strict=True)],
                     fontsize="small", label_type="center", color="white")  # fmt: skip
        for i, (key, lab) in enumerate(zip(values, labels, strict=True)):
            if not tall[i]:
                ax.annotate(lab, (i, ranges[key][1]), xytext=(0, 3), textcoords="offset points",
                            ha="center", fontsize="small")  # fmt: skip
    else:
        ax.bar_label(rects, labels=labels, fontsize="small", padding=2)
    if ranges:
        fig.supxlabel("bar: median round; line: slowest to fastest round", fontsize="x-small")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    category_labels(ax, list(values))
    return fig


def timeline(runs: Mapping[str, Mapping[str, Sequence[float]]], ylabel: str, title: str = "",
             mark: int | None = None) -> Figure:  # fmt: skip
    """One panel per way of timing: each contender's calls in the order they ran.

    ``runs`` maps a panel title to {contender: seconds per call}; within a panel the calls
    are drawn in the order they were made (contenders after one another, or in turns).
    ``mark``: the call at which something changed (a background load switched on).
    """
    fig = Figure(figsize=(5 * len(runs), 3.6), layout="constrained")
    axes = fig.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    for ax, (name, times) in zip(axes, runs.items(), strict=True):
        order = name.lower().startswith("interleav")
        start = 0
        for i, (who, values) in enumerate(times.items()):
            xs = [2 * j + i for j in range(len(values))] if order else list(
                range(start, start + len(values)))  # fmt: skip
            ax.plot(xs, [1e3 * v for v in values], "o", label=who, markersize=4)
            start += len(values)
        if mark is not None:
            ax.axvline(mark - 0.5, color="grey", linestyle="--", linewidth=1)
            ax.annotate("load on", (mark - 0.5, 1), xycoords=("data", "axes fraction"),
                        xytext=(3, -12), textcoords="offset points", fontsize="small")  # fmt: skip
        ax.set_title(name)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("call, in the order made")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(ylabel)
    legend_outside(axes[-1])
    fig.suptitle(title)
    return fig
