"""Figures of the synthetic experiments (Figs. 1, 2, 4, 5 of Arbel et al., 2020).

Every function takes result rows as produced by :mod:`studies.synthetic.sweep`
(:func:`~studies.toy.setup.load_rows`,
:func:`~studies.toy.setup.load_flow`) and returns a
:class:`matplotlib.figure.Figure`. Colours run from yellow (``d = 1``) to dark red
(``d = 10``) as in the paper.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from studies.kit.style import FIG_WIDTH_IN, book_figure, grid_ticks, method_color
from studies.toy.setup import summarise

__all__ = [
    "plot_relerr",
    "plot_bandwidth",
    "plot_flow",
    "flow_styles",
    "plot_flow_study",
    "dim_colors",
]


def dim_colors(dims: Sequence[int]) -> dict[int, tuple]:
    """Yellow-to-dark-red colour of each dimension."""
    import matplotlib

    dims = sorted(set(int(d) for d in dims))
    if not dims:
        raise ValueError("dims must be a non-empty sequence of dimensions")
    cmap = matplotlib.colormaps["YlOrRd"]
    lo, hi = min(dims), max(dims)
    return {d: cmap(0.3 + 0.7 * (d - lo) / max(hi - lo, 1)) for d in dims}


@book_figure
def plot_relerr(
    rows: Sequence[dict], title: str = "", N_box: int | None = None, stat: str = "mean"
):
    """Fig. 1 / Fig. 4 for one model: (a) box-plots over ``d`` at ``N = N_box``
    (default: the largest ``N``) with ``M = ⌊d√N⌋``, (b) error vs ``N``, (c) error vs
    ``M`` at fixed ``N``. ``stat`` is the curve drawn in (b), (c): ``"mean"`` (the
    paper's average) or ``"median"``."""
    import matplotlib.pyplot as plt

    if stat not in ("mean", "median"):
        raise ValueError(f"stat must be 'mean' or 'median', got {stat!r}")
    byN = summarise(rows, "N", "N")
    byM = summarise(rows, "M", "M")
    colors = dim_colors(list(byN) + list(byM))
    N_box = N_box or int(max(max(v["x"]) for v in byN.values()))
    fig, axes = plt.subplots(1, 3, figsize=(FIG_WIDTH_IN, 2.9))
    dims = sorted(byN)
    data = [byN[d]["errors"][list(byN[d]["x"]).index(N_box)] for d in dims]
    bp = axes[0].boxplot(
        data,
        tick_labels=[str(d) for d in dims],
        patch_artist=True,
        showfliers=True,
        flierprops={"markersize": 2},
    )
    for patch, d in zip(bp["boxes"], dims):
        patch.set_facecolor(colors[d])
    axes[0].set_yscale("log")
    axes[0].set_xlabel("dimension $d$")
    axes[0].set_ylabel("relative error")
    axes[0].set_title(f"(a) N = {N_box}, M = ⌊d√N⌋")
    for ax, summ, lab, ttl in (
        (axes[1], byN, "sample size $N$", "(b) M = ⌊d√N⌋"),
        (axes[2], byM, "basis points $M$", "(c) fixed $N$"),
    ):
        for d, s in summ.items():
            ax.plot(s["x"], s[stat], "o-", ms=3, color=colors[d], label=f"d={d}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        xs = sorted({x for s in summ.values() for x in s["x"]})
        grid_ticks(ax, xs)  # label grid points, not log-minor ticks
        ax.set_xlabel(lab)
        ax.set_ylabel(f"{stat} relative error")
        ax.set_title(ttl)
    axes[2].legend(ncol=2, handlelength=1.2, columnspacing=0.8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


@book_figure
def plot_bandwidth(rows_by_model: dict[str, Sequence[dict]], stat: str = "mean"):
    """Fig. 5: relative error against the fixed bandwidth ``σ``, one panel per model."""
    import matplotlib.pyplot as plt

    if not rows_by_model:
        raise ValueError("rows_by_model must hold at least one model")
    fig, axes = plt.subplots(
        1,
        len(rows_by_model),
        figsize=(FIG_WIDTH_IN, 2.9),
        squeeze=False,
    )
    for ax, (name, rows) in zip(axes[0], rows_by_model.items()):
        summ = summarise(rows, "sigma", "bandwidth_spec")
        colors = dim_colors(list(summ))
        for d, s in summ.items():
            ax.plot(s["x"], s[stat], "o-", ms=3, color=colors[d], label=f"d={d}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(r"bandwidth $\sigma$")
        ax.set_ylabel(f"{stat} relative error")
        ax.set_title(name)
    axes[0][-1].legend(ncol=2, handlelength=1.2, columnspacing=0.8)
    fig.tight_layout()
    return fig


_FLOW_STYLES = {
    "wng": dict(ls="-", label="WNG (exact)"),
    "kwng": dict(ls="--", marker="o", ms=3, label="KWNG"),
    "eg": dict(ls=":", lw=2, label="EG"),
}
_EXTRA_STYLES = [
    dict(ls="-.", marker="s", ms=3),
    dict(ls=(0, (5, 1)), marker="^", ms=3),
    dict(ls=(0, (1, 1)), marker="v", ms=3),
    dict(ls=(0, (3, 1, 1, 1)), marker="D", ms=3),
]


def flow_styles(methods: Sequence[str]) -> dict[str, dict]:
    """A line style and marker for every method of a flow figure, in the method's colour
    (:func:`studies.kit.style.method_color`)."""
    styles, extra = {}, iter(_EXTRA_STYLES)
    for m in methods:
        if m in _FLOW_STYLES:
            styles[m] = dict(_FLOW_STYLES[m])
        else:
            try:
                styles[m] = dict(next(extra), label=m.upper().replace("_", " "))
            except StopIteration:
                raise ValueError(
                    f"at most {len(_EXTRA_STYLES)} extra methods, got {list(methods)}"
                ) from None
        styles[m].setdefault("lw", 1.5)
        styles[m]["color"] = method_color(m)
    return styles


def _check_flow_args(flow: dict, floor: float, markevery: int) -> None:
    """The argument checks of :func:`plot_flow`."""
    if "loss" not in flow or "pca" not in flow:
        raise ValueError("flow must hold 'loss' and 'pca' (see load_flow)")
    if not floor > 0:
        raise ValueError(f"floor must be > 0, got {floor}")
    if markevery < 1:
        raise ValueError(f"markevery must be >= 1, got {markevery}")


def _frame_finite_runs(ax_p, box: list) -> None:
    """Limits of panel (b) of :func:`plot_flow` from the runs that stayed finite."""
    if box:
        allP = np.concatenate(box)
        lo, hi = allP.min(axis=0), allP.max(axis=0)
        pad = 0.08 * np.maximum(hi - lo, 1e-12)
        ax_p.set_xlim(lo[0] - pad[0], hi[0] + pad[0])
        ax_p.set_ylim(lo[1] - pad[1], hi[1] + pad[1])


def _label_flow_axes(ax_l, ax_p) -> None:
    """Axis labels, titles and legends of :func:`plot_flow`."""
    ax_l.set_xlabel("iteration")
    ax_l.set_ylabel("squared W2 distance to the target")
    ax_l.set_title("(a) loss")
    ax_l.legend()
    ax_p.set_xlabel("PC 1 of the WNG trajectory")
    ax_p.set_ylabel("PC 2")
    ax_p.set_title("(b) projected trajectories")
    ax_p.legend()


@book_figure
def plot_flow(flow: dict, floor: float = 1e-12, markevery: int = 20):
    """Fig. 2: (a) W2² loss per iteration, (b) trajectories on the two leading PCA
    directions of the WNG trajectory. ``flow`` is the output of
    :func:`~studies.toy.setup.load_flow`.

    Losses below ``floor`` are drawn at the floor (dotted line): below it the computed
    W2² is round-off, and may even be negative. A run whose loss stops being finite is
    drawn up to its last finite iterate, marked with a cross and labelled "diverged";
    panel (b) takes its limits from the runs that stayed finite, so a diverged run
    leaves the frame instead of shrinking the others to a dot.
    """
    import matplotlib.pyplot as plt

    _check_flow_args(flow, floor, markevery)
    styles = flow_styles(list(flow["loss"]))
    fig, (ax_l, ax_p) = plt.subplots(1, 2, figsize=(FIG_WIDTH_IN, 3.2))
    box = []
    for m, loss in flow["loss"].items():
        loss = np.asarray(loss, dtype=float)
        finite = np.isfinite(loss)
        last = int(np.flatnonzero(finite)[-1]) if finite.any() else -1
        diverged = not finite.all()
        st = dict(styles[m])
        label = st.pop("label") + (f" (diverged at it. {last + 1})" if diverged else "")
        it = np.arange(last + 1)
        ax_l.semilogy(
            it,
            np.maximum(loss[: last + 1], floor),
            markevery=markevery,
            label=label,
            **st,
        )
        P = np.asarray(flow["pca"][m], dtype=float)[: last + 1]
        ax_p.plot(P[:, 0], P[:, 1], markevery=markevery, label=label, **st)
        if diverged:
            ax_l.plot(last, max(loss[last], floor), "x", color=st["color"], ms=9, mew=2)
            ax_p.plot(P[-1, 0], P[-1, 1], "x", color=st["color"], ms=9, mew=2)
        else:
            box.append(P)
    ax_l.axhline(floor, color="0.6", ls=(0, (1, 2)), lw=1)
    ax_l.annotate(
        "round-off floor",
        (0.98, floor),
        xycoords=("axes fraction", "data"),
        ha="right",
        va="bottom",
        color="0.4",
    )
    _frame_finite_runs(ax_p, box)
    _label_flow_axes(ax_l, ax_p)
    fig.tight_layout()
    return fig


@book_figure
def plot_flow_study(
    rows: dict, names: Sequence[str] | None = None, floor: float = 1e-12
):
    """Loss of the KWNG flow (coloured) next to the exact WNG flow of the same
    parametrisation (grey) for each variant of :mod:`studies.synthetic.flow_study`.

    ``rows`` is the ``"rows"`` entry of ``flow_study.json``; ``names`` selects and
    orders the variants (all by default). Losses are clamped at ``floor`` (round-off)
    and a stopped run ends with a cross, as in :func:`plot_flow`.
    """
    import matplotlib.pyplot as plt

    names = list(rows) if names is None else list(names)
    unknown = [n for n in names if n not in rows]
    if not names or unknown:
        raise ValueError(
            f"names must be a non-empty subset of the rows, unknown: {unknown}"
        )
    if not floor > 0:
        raise ValueError(f"floor must be > 0, got {floor}")
    cmap = plt.get_cmap("tab10")
    styles = ["-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1))]
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, 5.2))
    for i, name in enumerate(names):
        for method in ("wng", "kwng"):
            loss = np.asarray(rows[name][method]["loss"], dtype=float)
            finite = np.isfinite(loss)
            last = int(np.flatnonzero(finite)[-1])
            y = np.maximum(loss[: last + 1], floor)
            if method == "wng":
                ax.semilogy(
                    y,
                    color="0.75",
                    lw=3,
                    zorder=0,
                    label="exact WNG (each parametrisation)" if i == 0 else None,
                )
                continue
            color, ls = cmap(i % 10), styles[i % len(styles)]
            ax.semilogy(y, color=color, ls=ls, lw=1.6, label=name)
            if not finite.all():
                ax.plot(last, y[-1], "x", color=color, ms=9, mew=2)
    ax.axhline(floor, color="0.6", ls=(0, (1, 2)), lw=1)
    ax.set_xlabel("iteration")
    ax.set_ylabel("squared W2 distance to the target")
    fig.legend(loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.3, 1, 1))
    return fig
