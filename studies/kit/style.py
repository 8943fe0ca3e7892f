"""How the book's figures look: one size, one set of fonts, one colour per method.

Every figure function of the studies' figure modules draws inside :func:`book_figure`,
which sets
:data:`BOOK_STYLE` while the figure is drawn and, in a notebook, has the figure shown as
SVG (vector, so ``tools/check_book.py`` can read the size of every text from the file).

The sizes follow from the narrowest screen the book is read on. A phone shows a figure
about 342 px wide; a figure :data:`FIG_WIDTH_IN` inches wide (72 units an inch in its
SVG) is then drawn at 342 / (72 · 6.2) ≈ 0.77 px per point, so the smallest font of
:data:`BOOK_STYLE`, 9.5 pt, is 7.3 px there, above the 7 px a reader can read (the
margin covers a figure's content sticking out a little). On a laptop the same figure is
shown at its own size (595 px), 1.33 px per point. Everything a figure draws (titles,
legends) must stay inside its width.
"""

from __future__ import annotations

import functools

__all__ = ["BOOK_STYLE", "FIG_WIDTH_IN", "METHOD_COLORS", "method_color", "book_figure",
           "grid_ticks", "plain_log_ticks"]

FIG_WIDTH_IN = 6.2
BOOK_STYLE = {
    "font.size": 10.0,
    "axes.titlesize": 10.5,
    "axes.labelsize": 10.0,
    "legend.fontsize": 9.5,
    "legend.title_fontsize": 9.5,
    "xtick.labelsize": 9.5,
    "ytick.labelsize": 9.5,
    "figure.titlesize": 10.5,
    "figure.dpi": 100.0,
    "svg.fonttype": "path",
}

# One colour per method of the synthetic flows and the Fisher–Rao companion; a CIFAR
# method's colour is part of its record (studies.cifar.methods.METHODS; the
# CIFAR KWNG has the colour of the flows' "kwng").
METHOD_COLORS = {
    "wng": "#000000",
    "eg": "#4d4d4d",
    "fng": "#6a3d9a",
    "kfng": "#cab2d6",
    "kwng": "#d62728",
    "kwng_N1024": "#fdae6b",
}


def method_color(method: str) -> str:
    """The colour of ``method`` in every figure (:data:`METHOD_COLORS`); an unknown
    method raises, naming the known ones."""
    try:
        return METHOD_COLORS[method]
    except KeyError:
        raise ValueError(
            f"no colour for method {method!r}: add it to "
            f"studies.kit.style.METHOD_COLORS (known: {sorted(METHOD_COLORS)})"
        ) from None


def grid_ticks(ax, xs, most: int = 4) -> None:
    """Label at most ``most`` of the grid values ``xs`` on ``ax``'s (log) x axis, evenly
    spread and always the first and the last, and no minor labels: a panel a third of a
    phone wide has room for about four numbers."""
    import matplotlib.pyplot as plt

    xs = sorted(xs)
    step = max(1, -(-(len(xs) - 1) // max(most - 1, 1)))
    shown = xs[::step] if (len(xs) - 1) % step == 0 else xs[::step] + [xs[-1]]
    ax.set_xticks(shown, [f"{x:g}" for x in shown])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())


_SVG_SET = False


def _show_as_svg() -> None:
    """In an IPython kernel, have figures displayed as SVG with a PNG beside it (once
    per session). The book's pages show the SVG (MyST-NB prefers it), whose text sizes
    the book's checker reads; the PNG is the image a reader of the executed notebook
    (or a viewer without SVG) sees."""
    global _SVG_SET
    if _SVG_SET:
        return
    try:
        from IPython import get_ipython
    except ImportError:
        return
    if get_ipython() is None:
        return
    from matplotlib_inline.backend_inline import set_matplotlib_formats

    set_matplotlib_formats("svg", "png")
    _SVG_SET = True


def _decade(x: float, _pos=None) -> str:
    """A log axis' tick label as plain text at the label's own size: ``0.01``, ``1``,
    ``1000`` from 0.001 to 10⁴, else ``1e-10``, ``2e5``."""
    if x <= 0:
        return ""
    if 1e-3 <= x <= 1e4:
        return f"{x:g}"
    mant, exp = f"{x:.0e}".split("e")
    return f"{mant}e{int(exp)}"


def plain_log_ticks(fig) -> None:
    """Give every log axis of ``fig`` whose labels are matplotlib's default
    (``10`` with a superscript exponent, drawn at 0.7 of the label's size, about 5 px on
    a phone) the plain labels of :func:`_decade`, major and minor alike, by the same
    rule of which ticks to label; an axis with labels of its own keeps them."""
    from matplotlib import ticker

    class PlainLog(ticker.LogFormatter):
        def _num_to_string(self, x, vmin, vmax):
            return _decade(x)

    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() != "log":
                continue
            for get, put in ((axis.get_major_formatter, axis.set_major_formatter),
                             (axis.get_minor_formatter, axis.set_minor_formatter)):
                fmt = get()
                if isinstance(fmt, ticker.LogFormatterSciNotation):
                    put(PlainLog(base=fmt._base, labelOnlyBase=fmt.labelOnlyBase,
                                 minor_thresholds=fmt.minor_thresholds))


def book_figure(func):
    """Draw ``func``'s figure with :data:`BOOK_STYLE` and leave no global state behind.

    Only the keys of :data:`BOOK_STYLE` are set and restored. ``plt.rc_context`` is not
    used: it restores *every* rc parameter on exit, so when pyplot is first imported
    inside it, the interactive flag that the notebook backend switches on is switched
    off again and every later figure of the session is never shown."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        import matplotlib
        import matplotlib.pyplot  # noqa: F401  (the backend is set up outside the style)

        _show_as_svg()
        saved = {k: matplotlib.rcParams[k] for k in BOOK_STYLE}
        matplotlib.rcParams.update(BOOK_STYLE)
        try:
            out = func(*args, **kwargs)
            for fig in out if isinstance(out, tuple) else (out,):
                if isinstance(fig, matplotlib.figure.Figure):
                    plain_log_ticks(fig)
            return out
        finally:
            matplotlib.rcParams.update(saved)

    return wrapper
