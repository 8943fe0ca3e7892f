"""Figures of the live runs of the theory and practice chapters: the error of the
estimator against the sample size (:ref:`practice`, :ref:`consistency`) and a flow seen
in two parametrisations (:ref:`natural-gradient`). Each takes the arrays the chapter
computed and returns a :class:`matplotlib.figure.Figure` drawn in the book's style
(:mod:`studies.kit.style`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from studies.kit.style import FIG_WIDTH_IN, book_figure, grid_ticks

__all__ = ["plot_error_vs_n", "plot_rates", "plot_two_parametrisations"]


def _n_axis(ax, sizes: Sequence[int], label: str = "number of samples $N$") -> None:
    ax.set_xscale("log")
    ax.set_yscale("log")
    grid_ticks(ax, list(sizes), most=5)
    ax.set_xlabel(label)


@book_figure
def plot_error_vs_n(sizes: Sequence[int], errors: np.ndarray,
                    reference_slope: float = -0.25):
    """The relative error of every draw (grey), their median and a reference line
    ``N^reference_slope`` through the first median, against ``N`` (log–log).
    ``errors`` has one row per sample size and one column per draw."""
    import matplotlib.pyplot as plt

    errors = np.asarray(errors, dtype=float)
    if errors.ndim != 2 or errors.shape[0] != len(sizes):
        raise ValueError(f"errors must be (len(sizes), runs), got {errors.shape}")
    median = np.median(errors, axis=1)
    n = np.asarray(sizes, dtype=float)
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN * 0.75, 3.4))
    ax.plot(n, errors, ".", color="0.7")
    ax.plot(n, median, "o-", label="median")
    ax.plot(n, median[0] * (n / n[0]) ** reference_slope, "k--",
            label=f"slope {reference_slope:g}")
    _n_axis(ax, sizes)
    ax.set_ylabel("relative error")
    ax.legend()
    fig.tight_layout()
    return fig


@book_figure
def plot_rates(Ns: Sequence[int], measured: dict, models: Sequence[str],
               curves: dict, reference_slope: float = -1 / 3):
    """One panel per model: the mean error of each schedule (``curves``: key of
    ``measured[model, key]`` -> label) against ``N``, with an ``N^reference_slope``
    line through the first point of the first curve; the panels share the y axis and
    the legend stands under them."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(models), figsize=(FIG_WIDTH_IN, 3.6), sharey=True,
                             squeeze=False)
    n = np.asarray(Ns, dtype=float)
    first = next(iter(curves))
    for ax, name in zip(axes[0], models):
        for key, label in curves.items():
            ax.plot(n, measured[name, key], "o-", label=label)
        ref = measured[name, first][0] * (n / n[0]) ** reference_slope
        ax.plot(n, ref, "k--", lw=1, label=f"slope {reference_slope:.2g}")
        ax.set_title(name)
        _n_axis(ax, Ns, "$N$")
    axes[0, 0].set_ylabel("relative error")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    return fig


@book_figure
def plot_two_parametrisations(flows: dict, xlabel: str, ylabel: str, title: str):
    """Two coordinates of flows computed in two parametrisations: for each method
    (``flows[method] = (mapped, direct)``, arrays of points), the flow computed in the
    first parametrisation and mapped to the second (thick, light) and the flow computed
    in the second (thin, black), with the same line style."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN * 0.75, 4.0))
    for (method, (mapped, direct)), style in zip(flows.items(), ("-", "--", ":", "-.")):
        mapped, direct = np.asarray(mapped), np.asarray(direct)
        ax.plot(mapped[:, 0], mapped[:, 1], style, lw=3, alpha=0.5,
                label=f"{method}: Ψ(θ_s)")
        ax.plot(direct[:, 0], direct[:, 1], style, color="k", lw=1,
                label=f"{method}: ψ_s")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig
