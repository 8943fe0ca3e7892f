"""Figures of the synthetic experiments (Figs. 1, 2, 5, 6 of Arbel et al., 2020).

Every function takes result rows as produced by :mod:`kwng.experiments.synthetic`
(:func:`~kwng.experiments.synthetic.load_rows`, :func:`~kwng.experiments.synthetic.load_flow`)
and returns a :class:`matplotlib.figure.Figure`. Colours run from yellow (``d = 1``) to dark red
(``d = 10``) as in the paper.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import numpy as np

__all__ = ["summarise", "plot_relerr", "plot_bandwidth", "plot_flow", "dim_colors"]


def dim_colors(dims: Sequence[int]) -> dict[int, tuple]:
    """Yellow-to-dark-red colour of each dimension."""
    import matplotlib

    dims = sorted(set(int(d) for d in dims))
    if not dims:
        raise ValueError("dims must be a non-empty sequence of dimensions")
    cmap = matplotlib.colormaps["YlOrRd"]
    lo, hi = min(dims), max(dims)
    return {d: cmap(0.3 + 0.7 * (d - lo) / max(hi - lo, 1)) for d in dims}


def summarise(rows: Sequence[dict], panel: str, x: str) -> dict[int, dict[str, np.ndarray]]:
    """``{d: {"x", "mean", "median", "q25", "q75", "errors"}}`` of the rows of one ``panel``,
    grouped by dimension and by the column ``x`` (``"N"``, ``"M"`` or ``"bandwidth_spec"``)."""
    if x not in ("N", "M", "bandwidth_spec"):
        raise ValueError(f"x must be one of ['N', 'M', 'bandwidth_spec'], got {x!r}")
    groups: dict[int, dict[float, list]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["panel"] == panel:
            groups[int(r["d"])][float(r[x])].append(float(r["error"]))
    out = {}
    for d, by_x in sorted(groups.items()):
        xs = np.array(sorted(by_x))
        errs = [np.array(by_x[v]) for v in xs]
        out[d] = {"x": xs, "mean": np.array([e.mean() for e in errs]),
                  "median": np.array([np.median(e) for e in errs]),
                  "q25": np.array([np.quantile(e, 0.25) for e in errs]),
                  "q75": np.array([np.quantile(e, 0.75) for e in errs]), "errors": errs}
    if not out:
        raise ValueError(f"no rows with panel {panel!r}")
    return out


def plot_relerr(rows: Sequence[dict], title: str = "", N_box: int | None = None, stat: str = "mean"):
    """Fig. 1 / Fig. 5 for one model: (a) box-plots over ``d`` at ``N = N_box`` (default: the
    largest ``N``) with ``M = ⌊d√N⌋``, (b) error vs ``N``, (c) error vs ``M`` at fixed ``N``.
    ``stat`` is the curve drawn in (b), (c): ``"mean"`` (the paper's average) or ``"median"``."""
    import matplotlib.pyplot as plt

    if stat not in ("mean", "median"):
        raise ValueError(f"stat must be 'mean' or 'median', got {stat!r}")
    byN = summarise(rows, "N", "N")
    byM = summarise(rows, "M", "M")
    colors = dim_colors(list(byN) + list(byM))
    N_box = N_box or int(max(max(v["x"]) for v in byN.values()))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    dims = sorted(byN)
    data = [byN[d]["errors"][list(byN[d]["x"]).index(N_box)] for d in dims]
    bp = axes[0].boxplot(data, tick_labels=[str(d) for d in dims], patch_artist=True, showfliers=True,
                         flierprops={"markersize": 2})
    for patch, d in zip(bp["boxes"], dims):
        patch.set_facecolor(colors[d])
    axes[0].set_yscale("log")
    axes[0].set_xlabel("dimension $d$")
    axes[0].set_ylabel("relative error")
    axes[0].set_title(f"(a) $N={N_box}$, $M=\\lfloor d\\sqrt{{N}}\\rfloor$")
    for ax, summ, lab, ttl in ((axes[1], byN, "sample size $N$", "(b) $M=\\lfloor d\\sqrt{N}\\rfloor$"),
                               (axes[2], byM, "basis points $M$", "(c) fixed $N$")):
        for d, s in summ.items():
            ax.plot(s["x"], s[stat], "o-", ms=3, color=colors[d], label=f"d={d}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        xs = sorted({x for s in summ.values() for x in s["x"]})
        ax.set_xticks(xs, [f"{x:g}" for x in xs])  # label the grid points, not log-minor ticks
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_xlabel(lab)
        ax.set_ylabel(f"{stat} relative error")
        ax.set_title(ttl)
    axes[2].legend(fontsize=7, ncol=2)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_bandwidth(rows_by_model: dict[str, Sequence[dict]], stat: str = "mean"):
    """Fig. 6: relative error against the fixed bandwidth ``σ``, one panel per model."""
    import matplotlib.pyplot as plt

    if not rows_by_model:
        raise ValueError("rows_by_model must hold at least one model")
    fig, axes = plt.subplots(1, len(rows_by_model), figsize=(4.3 * len(rows_by_model), 3.6), squeeze=False)
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
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def plot_flow(flow: dict):
    """Fig. 2: (a) W2² loss per iteration, (b) trajectories on the two leading PCA directions of
    the WNG trajectory. ``flow`` is the output of :func:`~kwng.experiments.synthetic.load_flow`."""
    import matplotlib.pyplot as plt

    if "loss" not in flow or "pca" not in flow:
        raise ValueError("flow must hold 'loss' and 'pca' (see load_flow)")
    style = {"wng": ("k", "-", "WNG"), "eg": ("tab:blue", "-", "EG"), "kwng": ("tab:red", "--", "KWNG")}
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for m, loss in flow["loss"].items():
        c, ls, lab = style.get(m, ("tab:orange", ":", m.upper().replace("_", " ")))
        axes[0].semilogy(np.arange(len(loss)), loss, ls, color=c, label=lab)
        P = flow["pca"][m]
        axes[1].plot(P[:, 0], P[:, 1], ls, color=c, marker=".", ms=2, label=lab)
    axes[0].set_xlabel("iteration")
    axes[0].set_ylabel(r"$W_2^2(\rho_\theta, \rho_{\theta^*})$")
    axes[0].set_title("(a) loss")
    axes[0].legend()
    axes[1].set_xlabel("PC 1 of the WNG trajectory")
    axes[1].set_ylabel("PC 2")
    axes[1].set_title("(b) projected trajectories")
    fig.tight_layout()
    return fig
