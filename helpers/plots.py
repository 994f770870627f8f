"""Plots that return a matplotlib Figure; nothing is shown or saved as a side effect.

Figures are built with ``matplotlib.figure.Figure`` rather than pyplot, so no global figure
state is touched. In a notebook, ``%matplotlib inline`` makes a returned figure display.
"""

from __future__ import annotations

import itertools
import math
import textwrap
from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter, NullLocator

from helpers.names import MiB
from helpers.timeline import align

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


# Stacking order of a timeline: the floor (weights, buffers, optimizer state) first.
TIMELINE_ORDER = ("params", "buffers", "optimizer_state", "gradients", "activations",
                  "temporaries", "inputs")  # fmt: skip
_PHASE_SHORT = {"forward": "fwd", "backward": "bwd", "optimizer step": "opt",
                "bwd + opt": "bwd + a step per parameter"}  # fmt: skip


def short_module(name: str) -> str:
    """A module path without its top-level class: "model.layers.1.mlp" (the model: "model")."""
    head, _, rest = name.partition(".")
    return rest or ("model" if head and head[0].isupper() else head)


def memory_timeline(measured, predicted=None, title: str = "", ax=None,
                    budget: int | None = None) -> Figure:  # fmt: skip
    """One step's bytes alive by category (stacked), phases marked, the peak annotated.

    ``measured`` and ``predicted`` are ``helpers.timeline.Timeline``s; the prediction's total
    is drawn over the measurement, each moment placed where the measured step ran the same
    block (``helpers.timeline.align``). ``budget`` (bytes) is drawn as a line; a step stopped
    by it is annotated where it stopped. With ``ax``, draws there and returns its figure.
    """
    own = ax is None
    fig = Figure(figsize=(9, 4), layout="constrained") if own else ax.figure
    ax = fig.add_subplot() if own else ax
    xs = range(len(measured.phase))
    cats = [c for c in TIMELINE_ORDER if max(measured.alive.get(c, [0]), default=0) > 0]
    ax.stackplot(xs, *[[v / MiB for v in measured.alive[c]] for c in cats], labels=cats,
                 colors=[CATEGORY_COLORS[c] for c in cats], alpha=0.85, linewidth=0)  # fmt: skip
    if predicted is not None:
        px = align(predicted, measured)
        ax.plot(px, [t / MiB for t in predicted.total], "k.--", linewidth=1, markersize=4,
                label="predicted total")  # fmt: skip
    _mark_phases(ax, measured)
    if budget is not None:
        ax.axhline(budget / MiB, color="#C44E52", linestyle="--", linewidth=1.2, label="budget")
    i = len(measured.phase) - 1 if measured.error else measured.peak_index
    where = measured.where[i]
    first = "out of memory: needs" if measured.error else "peak"
    text = f"{first} {measured.total[i] / MiB:.2f} MiB\n{measured.phase[i]}"
    text += f": {short_module(where)}" if where else ""
    ax.annotate(text, (i, measured.total[i] / MiB), xytext=(0.98, 0.97), textcoords="axes fraction",
                ha="right", va="top", fontsize="small",
                arrowprops={"arrowstyle": "->", "color": "black", "lw": 0.8})  # fmt: skip
    top = max(measured.peak, predicted.peak if predicted else 0, budget or 0)
    ax.set_ylim(0, 1.3 * top / MiB)
    ax.set_xlim(0, max(1, len(measured.phase) - 1))
    ax.set_xlabel("allocations and frees, in order")
    ax.set_ylabel("MiB alive (exact, tracker)")
    ax.set_title(title, pad=14)  # room for the phase names above the axes
    if own:
        legend_outside(ax)
    return fig


def _mark_phases(ax, t) -> None:
    """Dotted lines where forward, backward and the optimizer step begin, named at the top."""
    import matplotlib.transforms as mtransforms

    top = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    micros = max(t.micro, default=1) > 1
    for phase, micro, lo, hi in _phase_runs(t.spans()):
        if phase not in _PHASE_SHORT:
            continue
        ax.axvline(lo, color="grey", linestyle=":", linewidth=0.8)
        name = _PHASE_SHORT[phase] + (f" {micro}" if micros and phase != "optimizer step" else "")
        ax.text((lo + hi) / 2, 1.01, name, transform=top, ha="center", va="bottom",
                fontsize="x-small")  # fmt: skip


def _phase_runs(spans: list) -> list:
    """``Timeline.spans()`` with optimizer steps taken inside backward (lesson 16) folded into
    that backward, named "bwd + opt", so that each parameter's step does not get a label."""
    pairs = itertools.pairwise(spans)
    if not any(a[0] == "optimizer step" and b[0] == "backward" for a, b in pairs):
        return spans  # the usual step: one optimizer step after backward
    out: list = []
    for phase, micro, lo, hi in spans:
        inside = out and out[-1][0] in ("backward", "bwd + opt") and out[-1][1] == micro
        if inside and phase in ("optimizer step", "backward"):
            was = out[-1][0]
            out[-1] = ("bwd + opt" if phase != was else was, micro, out[-1][2], hi)
        else:
            out.append((phase, micro, lo, hi))
    return out


def memory_timelines(panels: Mapping, ncols: int = 2, title: str = "",
                     budget: int | None = None) -> Figure:  # fmt: skip
    """A grid of ``memory_timeline`` panels: {title: (measured, predicted or None)}.

    The panels share their MiB axis, so heights compare across them; ``budget`` is drawn in
    each."""
    n = len(panels)
    nrows = -(-n // ncols)
    # 2 panels a row fit a notebook column (about 9.5 in at 100 dpi) with readable labels.
    fig = Figure(figsize=(4.2 * ncols + 1.6, 3.2 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True).ravel()
    for ax, (name, (measured, predicted)) in zip(axes, panels.items(), strict=False):
        memory_timeline(measured, predicted, title=name, ax=ax, budget=budget)
    highest = max(max(m.total, default=0) for m, _ in panels.values())
    highest = max([highest, budget or 0] + [max(p.total) for _, p in panels.values() if p])
    for ax in axes[:n]:
        ax.set_ylim(0, 1.3 * highest / MiB)  # room for the peak's note above every curve
        if ax.get_subplotspec().colspan.start:
            ax.set_ylabel("")
    for ax in axes[n:]:
        ax.set_visible(False)
    handles: dict = {}
    for ax in axes[:n]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), loc="outside right upper", fontsize="small")
    fig.suptitle(title)
    return fig
