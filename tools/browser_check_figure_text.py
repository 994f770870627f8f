"""IPython startup file of ``make browser-check``: figures report their smallest text.

tools/browser_check.py copies this file into the scratch ``IPYTHONDIR`` of the JupyterLab it
starts (``profile_default/startup/``). Whenever a PNG formatter is registered for matplotlib's
``Figure`` (the inline backend does it when pyplot is first used, ``set_matplotlib_formats``
again), the function registered is wrapped: it still returns the same image (same
``bbox_inches``, dpi and retina handling: the original function makes it), and its metadata
gains ``course_min_text_px``, the font size in pixels of the PNG of the smallest non-empty
visible text drawn, and ``course_min_text``, that text. The check scales it by the width the
browser shows the image at.
"""

from __future__ import annotations

MIN_TEXT_PX = "course_min_text_px"
MIN_TEXT = "course_min_text"


def measured(format_figure):
    """``format_figure`` (figure -> PNG data) that also returns its smallest text's size."""

    def format_and_measure(figure, *args, **kwargs):
        from matplotlib.text import Text

        sizes: list[tuple[float, str]] = []
        draw = Text.draw

        def draw_and_note(text, renderer, *more, **named):
            if text.get_visible() and text.get_text().strip():
                sizes.append((renderer.points_to_pixels(text.get_fontsize()), text.get_text()))
            return draw(text, renderer, *more, **named)

        Text.draw = draw_and_note
        try:
            data = format_figure(figure, *args, **kwargs)
        finally:
            Text.draw = draw
        if data is None or not sizes:
            return data
        data, metadata = data if isinstance(data, tuple) else (data, {})
        pixels, text = min(sizes)
        return data, {**(metadata or {}), MIN_TEXT_PX: round(pixels, 2), MIN_TEXT: text[:80]}

    return format_and_measure


def install(shell) -> None:
    """Wrap every PNG function registered for matplotlib's Figure on ``shell`` from now on."""
    png = shell.display_formatter.formatters["image/png"]
    register = png.for_type

    def for_type(kind, function=None):
        name = kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"
        if function is not None and name == "matplotlib.figure.Figure":
            function = measured(function)
        return register(kind, function)

    png.for_type = for_type


try:
    install(get_ipython())  # type: ignore[name-defined]  # IPython startup: a builtin there
except NameError:  # imported outside IPython (a test): nothing to install
    pass
