"""What a reader of a figure would see as broken, found from the drawn figure (test helper).

``figure_problems(fig)`` draws ``fig`` with the Agg renderer and lists, in words: tick labels
that overlap on an axis, labels written in the axes that overlap each other, a legend that
covers a bar or a plotted point, and text that runs outside the figure. Every plotting
helper's test calls it (tests/test_plots.py and the lessons' own tests).
"""

from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg


def _visible_ticklabels(ax, axis):
    """The drawn tick labels of ``axis``: visible, non-empty, inside the view limits."""
    lo, hi = sorted(axis.get_view_interval())
    slack = 1e-9 * abs(hi - lo)
    out = []
    axis.get_majorticklabels()  # brings the ticks up to date with the locators
    axis.get_minorticklabels()
    for locs, ticks in ((axis.get_majorticklocs(), axis.get_major_ticks),
                        (axis.get_minorticklocs(), axis.get_minor_ticks)):  # fmt: skip
        for tick in ticks(len(locs)):
            label = tick.label1
            inside = lo - slack <= tick.get_loc() <= hi + slack
            if label.get_visible() and label.get_text().strip() and inside:
                out.append(label)
    return out


def _overlapping_ticks(ax, renderer) -> list[str]:
    problems = []
    for name, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
        labels = _visible_ticklabels(ax, axis)
        boxes = [t.get_window_extent(renderer) for t in labels]
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                if boxes[i].overlaps(boxes[j]) and labels[i].get_text() != labels[j].get_text():
                    problems.append(
                        f"{ax.get_title()!r}: {name} tick labels {labels[i].get_text()!r} and "
                        f"{labels[j].get_text()!r} overlap"
                    )
    return problems


def _overlapping_annotations(ax, renderer) -> list[str]:
    texts = [t for t in ax.texts if t.get_visible() and t.get_text().strip()]
    boxes = [t.get_window_extent(renderer) for t in texts]
    return [
        f"{ax.get_title()!r}: labels {texts[i].get_text()!r} and {texts[j].get_text()!r} overlap"
        for i in range(len(texts))
        for j in range(i + 1, len(texts))
        if boxes[i].overlaps(boxes[j])
    ]


def _legend_covers(ax, renderer) -> list[str]:
    legend = ax.get_legend()
    if legend is None:
        return []
    box = legend.get_window_extent(renderer).shrunk(0.98, 0.98)
    problems = []
    for patch in ax.patches:  # bars
        if patch.get_height() and patch.get_width() and box.overlaps(patch.get_window_extent()):
            problems.append(f"{ax.get_title()!r}: the legend covers a bar")
            break
    for line in ax.lines:  # plotted points (markers), not reference lines
        if line.get_marker() in (None, "None", "", " "):
            continue
        points = ax.transData.transform(line.get_xydata())
        if any(box.contains(x, y) for x, y in points):
            problems.append(f"{ax.get_title()!r}: the legend covers {line.get_label()!r}")
            break
    return problems


def _text_outside(fig, renderer) -> list[str]:
    frame = fig.bbox.padded(2)
    undrawn = set().union(*(_ticklabels_outside_view(ax) for ax in fig.axes))
    problems = []
    for text in fig.findobj(lambda a: hasattr(a, "get_text") and hasattr(a, "get_window_extent")):
        if not text.get_visible() or not str(text.get_text()).strip():
            continue
        if text in undrawn:
            continue
        box = text.get_window_extent(renderer)
        if box.width and not (frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1)):
            problems.append(f"text {text.get_text()!r} runs outside the figure")
    return problems


def _ticklabels_outside_view(ax) -> set:
    """Tick label objects matplotlib keeps but does not draw (off the axis, or spare)."""
    drawn = set(_visible_ticklabels(ax, ax.xaxis)) | set(_visible_ticklabels(ax, ax.yaxis))
    ticks = [t for a in (ax.xaxis, ax.yaxis) for t in a.majorTicks + a.minorTicks]
    return {label for t in ticks for label in (t.label1, t.label2)} - drawn


def figure_problems(fig) -> list[str]:
    """Everything ``figure_problems`` finds wrong in ``fig`` (an empty list: none found)."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    problems = []
    for ax in fig.axes:
        problems += _overlapping_ticks(ax, renderer)
        problems += _legend_covers(ax, renderer)
        problems += _overlapping_annotations(ax, renderer)
    problems += _text_outside(fig, renderer)
    return problems
