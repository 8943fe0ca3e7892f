"""Figures and tables of the Fisher–Rao vs Wasserstein comparison (chapter
"fisher_rao").

Every function takes what :mod:`studies.fisher.cli` writes
(:func:`~studies.fisher.sweep.load_sweep` rows,
:func:`~studies.fisher.flow.load_flow` curves) and returns a figure or a table.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import numpy as np

from studies.kit.style import FIG_WIDTH_IN, book_figure, grid_ticks, method_color

__all__ = [
    "ESTIMATORS",
    "median_by",
    "plot_fisher_relerr",
    "plot_fisher_sphere",
    "plot_fisher_flow",
    "comparison_table",
]

# column -> (label, line style)
ESTIMATORS = {
    "err_wng": ("KWNG vs exact WNG", "-"),
    "err_fng": ("kernel Fisher, λ = 0", "--"),
    "err_fng_lam": ("kernel Fisher, λ = 1e-4", "-."),
    "err_fng_score": ("kernel Fisher, score T", ":"),
}
# method -> (label, line style); the colour is the method's (studies.kit.style)
_METHOD_STYLE = {
    "wng": ("exact WNG", "-"),
    "kwng": ("KWNG", "--"),
    "fng": ("exact Fisher NG", "-"),
    "kfng": ("kernel Fisher NG", "--"),
    "eg": ("Euclidean", ":"),
}


def median_by(
    rows: Sequence[dict], column: str, keys: Sequence[str]
) -> dict[tuple, tuple[float, float, float]]:
    """``{key: (median, 25%, 75%)}`` of ``column`` over the rows grouped by the columns
    ``keys`` (NaN values are left out; a group with only NaN gives NaN)."""
    if not rows:
        raise ValueError("rows must be a non-empty list of sweep rows")
    if column not in rows[0]:
        raise ValueError(f"column must be one of {sorted(rows[0])}, got {column!r}")
    groups: dict[tuple, list] = defaultdict(list)
    for r in rows:
        groups[tuple(r[k] for k in keys)].append(float(r[column]))
    out = {}
    for k, v in groups.items():
        v = np.array(v)
        v = v[np.isfinite(v)]
        out[k] = (
            (
                float(np.median(v)),
                float(np.quantile(v, 0.25)),
                float(np.quantile(v, 0.75)),
            )
            if len(v)
            else (np.nan, np.nan, np.nan)
        )
    return out


def _dims(rows):
    return sorted({int(r["d"]) for r in rows})


@book_figure
def plot_fisher_relerr(
    rows: Sequence[dict], models: Sequence[str] = ("normal", "lognormal")
):
    """Median relative error (band: quartiles of KWNG and of the regularised Fisher
    estimate) against ``N`` (top, ``M = ⌊d√N⌋``) and ``M`` (bottom, fixed ``N``), one
    column per model, one colour per dimension, one line style per estimator
    (``ESTIMATORS``)."""
    import matplotlib.pyplot as plt

    dims = _dims(rows)
    colors = {d: f"C{i}" for i, d in enumerate(dims)}
    fig, axes = plt.subplots(
        2, len(models), figsize=(FIG_WIDTH_IN, 8.6), squeeze=False
    )
    for j, model in enumerate(models):
        sub = [r for r in rows if r["model"] == model]
        if not sub:
            raise ValueError(f"no rows for model {model!r}")
        for i, (panel, x) in enumerate((("N", "N"), ("M", "M"))):
            ax = axes[i, j]
            for col, (label, ls) in ESTIMATORS.items():
                med = median_by([r for r in sub if r["panel"] == panel], col, ("d", x))
                for d in dims:
                    xs = sorted(k[1] for k in med if k[0] == d)
                    ys = [med[(d, v)] for v in xs]
                    ax.plot(
                        xs,
                        [y[0] for y in ys],
                        ls,
                        color=colors[d],
                        marker="o",
                        ms=3,
                        label=f"{label}, d={d}",
                    )
                    if col in ("err_wng", "err_fng_lam"):
                        ax.fill_between(
                            xs,
                            [y[1] for y in ys],
                            [y[2] for y in ys],
                            color=colors[d],
                            alpha=0.08,
                        )
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(
                "N (M = ⌊d√N⌋)" if panel == "N" else f"M (N = {_fixed_N(sub)})"
            )
            ax.set_ylabel("relative error")
            ax.set_title(f"{model}: error vs {x}")
            xs_all = sorted({r[x] for r in sub if r["panel"] == panel})
            grid_ticks(ax, xs_all)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.05 + 0.028 * -(-len(labels) // 2), 1, 1))
    return fig


def _fixed_N(rows) -> int:
    Ns = {r["N"] for r in rows if r["panel"] == "M"}
    return int(next(iter(Ns))) if Ns else 0


def _style_sphere_axes(axes, titles, rows: Sequence[dict]) -> None:
    """Log–log axes against ``N`` with the sweep's ``N`` values as ticks (one per panel
    of :func:`plot_fisher_sphere`)."""
    for ax, t in zip(axes, titles):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("N (M = ⌊d√N⌋)")
        ax.set_title(t)
        ax.legend()
        xs_all = sorted({r["N"] for r in rows if r["panel"] == "N"})
        grid_ticks(ax, xs_all)


@book_figure
def plot_fisher_sphere(rows: Sequence[dict]):
    """Where the Fisher metric does not exist. Left: the largest eigenvalue of the
    kernel Fisher metric ``Ĝ_F`` against ``N`` (``M = ⌊d√N⌋``) on the sphere and the
    normal model (with the exact ``λ_max(G_F)`` of the normal as a reference). Middle:
    the part of ``T`` outside the range of ``C``. Right: KWNG's relative error on the
    sphere (the Wasserstein side converges)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(FIG_WIDTH_IN, 10.5))
    dims = _dims(rows)

    def median_line(ax, sub, col, *fmt, **style):  # median of ``col`` against N
        med = median_by(sub, col, ("N",))
        xs = sorted(k[0] for k in med)
        ax.plot(xs, [med[(v,)][0] for v in xs], *fmt, **style)

    for model, marker in (("sphere", "o"), ("normal", "s")):
        for k, d in enumerate(dims):
            sub = [r for r in rows
                   if r["model"] == model and r["panel"] == "N" and r["d"] == d]
            c = f"C{k}"
            for ax, col in ((axes[0], "gf_max"), (axes[1], "range_residual")):
                median_line(ax, sub, col, marker=marker, color=c,
                            ls="-" if model == "sphere" else "--",
                            label=f"{model}, d={d}")
            if model == "normal":
                median_line(axes[0], sub, "gf_exact_max", ":", color=c,
                            label=f"exact λmax(G_F), normal d={d}")
            if model == "sphere":
                median_line(axes[2], sub, "err_wng", marker=marker, color=c,
                            label=f"sphere, d={d}")
    titles = (
        "largest eigenvalue of the kernel Fisher metric",
        "‖(I - P_C)T‖ / ‖T‖ (reparametrised T)",
        "KWNG relative error on the sphere",
    )
    _style_sphere_axes(axes, titles, rows)
    fig.tight_layout()
    return fig


@book_figure
def plot_fisher_flow(flow: dict[str, dict[str, np.ndarray]]):
    """Loss against iteration for each loss (``w2``, ``kl``) and method of the flow
    experiment."""
    import matplotlib.pyplot as plt

    if not flow:
        raise ValueError("flow must map a loss name to {method: values}")
    titles = {"w2": "loss W2²(ρ_θ, ρ*)", "kl": "loss KL(ρ_θ ‖ ρ*)"}
    fig, axes = plt.subplots(1, len(flow), figsize=(FIG_WIDTH_IN, 3.6), squeeze=False)
    for ax, (loss, curves) in zip(axes[0], flow.items()):
        for method, v in curves.items():
            label, ls = _METHOD_STYLE.get(method, (method, "-"))
            ax.plot(np.arange(len(v)), v, ls, color=method_color(method), label=label)
        ax.set_yscale("log")
        ax.set_xlabel("iteration")
        ax.set_title(titles.get(loss, loss))
        ax.legend()
    fig.tight_layout()
    return fig


def comparison_table(rows: Sequence[dict], N: int) -> list[dict]:
    """One row per model: median relative errors of every estimator at ``N`` (panel
    ``N``, all dimensions pooled), median seconds per estimate, and the median of
    ``λ_max(Ĝ_F)``."""
    out = []
    for model in sorted({r["model"] for r in rows}):
        sub = [
            r for r in rows if r["model"] == model and r["panel"] == "N" and r["N"] == N
        ]
        if not sub:
            raise ValueError(f"no rows of panel N at N = {N} for model {model!r}")
        row = {"model": model, "N": N}
        for col in (*ESTIMATORS, "time_wng_s", "time_fng_s", "gf_max"):
            v = np.array([r[col] for r in sub], dtype=float)
            v = v[np.isfinite(v)]
            row[col] = float(np.median(v)) if len(v) else float("nan")
        out.append(row)
    return out
