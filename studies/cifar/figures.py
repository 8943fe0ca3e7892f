"""Figures of the CIFAR study from result records (book chapter
:ref:`experiments-cifar`).

Each function takes the dictionary of
:func:`studies.cifar.results.load_results` (``{(conditioning, method, seed):
record}``) and returns a matplotlib figure; the numbers behind them are the tables of
:mod:`studies.cifar.records`, every method is drawn in the colour and line
style of its record (:class:`studies.cifar.methods.Method`), and a legend
counts the seeds each curve averages (:func:`seed_label`):

* :func:`fig_accuracy_per_epoch` — the paper's Fig. 3 (accuracy per epoch, IC and WC);
* :func:`fig_accuracy_vs_time` — Fig. 6 (accuracy against training seconds);
* :func:`fig_ablation` — Fig. 7 (KWNG against each of its variants, one row each);
* :func:`fig_eps` — the Levenberg–Marquardt ε of every KWNG run per epoch;
* :func:`fig_per_class_vs_U` — per-class test accuracy against ``U_k`` (IC);
* :func:`fig_kwng_diagnostics` — ε, reduction ratio and clipped fraction per epoch.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

from studies.cifar.methods import METHODS
from studies.cifar.records import (
    class_scalings,
    curves,
    diag_series,
    final_per_class,
)
from studies.kit.style import FIG_WIDTH_IN, book_figure

__all__ = ["fig_accuracy_per_epoch", "fig_accuracy_vs_time", "fig_ablation", "fig_eps",
           "fig_per_class_vs_U", "fig_kwng_diagnostics", "seed_label"]


def _look(method: str, looks: dict | None = None) -> dict:
    """The colour and line style of ``method``: from ``looks`` (``{method: {"color",
    "style", ...}}``, the frozen table of a finished study) when given, else from its
    record (:data:`studies.cifar.methods.METHODS`); an unknown method
    raises."""
    table = METHODS if looks is None else looks
    try:
        m = table[method]
    except KeyError:
        where = "METHODS" if looks is None else "the looks given"
        raise ValueError(f"no method {method!r} in {where} "
                         f"(known: {sorted(table)})") from None
    if looks is not None:
        return {"color": m["color"], "ls": m["style"]}
    return {"color": m.color, "ls": m.style}


def _band(ax, x, vals, label, color, ls, seen: dict | None = None, cond: str = "",
          lw: float = 1.5, ms: float = 2.5, z: float = 2.0):
    """The mean of ``vals`` (seeds × epochs) against ``x`` with its min–max band; the
    number of seeds averaged goes to ``seen[label][cond]`` (the legend counts them)."""
    if vals.size == 0:
        return
    if seen is not None:
        seen.setdefault(label, {})[cond] = vals.shape[0]
    mean = vals.mean(0)
    ax.plot(x, 100 * mean, color=color, label=label, lw=lw, ls=ls, marker="o", ms=ms,
            zorder=z)
    if vals.shape[0] > 1:
        ax.fill_between(x, 100 * vals.min(0), 100 * vals.max(0), color=color, alpha=0.2,
                        lw=0, zorder=z - 0.5)


_SHORT = {"ill": "IC", "well": "WC"}


def seed_label(method: str, counts: dict[str, int]) -> str:
    """``method`` with the number of seeds its curves average, ``counts`` =
    ``{conditioning: seeds}`` as plotted: ``"kwng (n=3)"``, or per conditioning where
    they differ, ``"kwng (n=3 IC, 2 WC)"``; a single run is not marked."""
    ns = set(counts.values())
    if ns <= {1}:
        return method
    if len(ns) == 1:
        return f"{method} (n={ns.pop()})"
    parts = [f"{n} {_SHORT.get(c, c)}" for c, n in counts.items()]
    return f"{method} (n={', '.join(parts)})"


def _legend_below(fig, axes, seen: dict | None = None, extra=()):
    """One legend under the figure, in two columns: every labelled line of every panel
    once, named with the seeds it averages in each panel (``seen``, filled by
    :func:`_band`), then the ``extra`` ``(handle, label)`` pairs."""
    handles: dict[str, object] = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    items = [(h, seed_label(lab, seen[lab]) if seen and lab in seen else lab)
             for lab, h in handles.items()] + list(extra)
    if items:
        fig.legend(*zip(*items), loc="lower center", ncol=2, frameon=False)
    return len(items)


def _target_line(axes, target: float | None) -> list:
    """A dotted line at the test accuracy ``target`` (a fraction) on each of ``axes``;
    its legend entry (none without a target)."""
    if target is None:
        return []
    from matplotlib.lines import Line2D

    for ax in axes:
        ax.axhline(100 * target, color="k", lw=0.9, ls=":", zorder=1)
    return [(Line2D([], [], color="k", lw=0.9, ls=":"),
             f"{100 * target:g} % test accuracy")]


def _below(fig, n: int) -> float:
    """The share of the figure's height that a legend of ``n`` entries in two columns
    under it needs."""
    return min(0.45, (0.25 + 0.19 * -(-n // 2)) / fig.get_figheight())


def _conditions(results: dict) -> tuple[str, ...]:
    """The conditionings (``"ill"``, ``"well"``) of which ``results`` hold a run with at
    least one epoch: a figure draws a column only for those (no empty panels)."""
    present = {c for (c, _, _), r in results.items() if r["epochs"]}
    conds = tuple(c for c in ("ill", "well") if c in present)
    if not conds:
        raise ValueError("results hold no run with a recorded epoch")
    return conds


def _label(results: dict, cond: str, method: str) -> str:
    """``method``, with the epochs reached where a run of it in ``cond`` stopped
    early (the seeds are counted by :func:`seed_label`)."""
    runs = [r for (c, m, _), r in results.items()
            if c == cond and m == method and r["epochs"]]
    if not runs or all(r.get("complete") for r in runs):
        return method
    return (f"{method} [{min(len(r['epochs']) for r in runs)}/"
            f"{runs[0]['config']['epochs']} ep.]")


@book_figure
def fig_accuracy_per_epoch(results: dict, methods: Sequence[str], title: str = "",
                           looks: dict | None = None):
    """Fig. 3: rows test / training accuracy, columns ill- / well-conditioned (a column
    only for a conditioning with records). ``looks``: the colours and line styles of a
    finished study's frozen table (default: the live methods'), as in every figure
    here that takes it."""
    conds = _conditions(results)
    fig, axes = plt.subplots(2, len(conds), figsize=(FIG_WIDTH_IN, 6.2), sharex=True,
                             squeeze=False)
    seen: dict = {}
    for j, cond in enumerate(conds):
        for i, (key, name) in enumerate(
            (("test_acc", "test accuracy (%)"), ("train_acc", "training accuracy (%)"))
        ):
            ax = axes[i, j]
            for m in methods:
                x, v = curves(results, cond, m, key)
                _band(ax, x, v, _label(results, cond, m), **_look(m, looks),
                      seen=seen, cond=cond)
            ax.set_ylabel(name)
            ax.set_title(f"{cond}-conditioned")
            ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("epoch")
    n = _legend_below(fig, axes, seen)
    fig.suptitle(
        title
        or "CIFAR-10, ResNet-18: accuracy per epoch (mean over seeds, band = min–max)",
        wrap=True,
    )
    fig.tight_layout(rect=(0, _below(fig, n), 1, 0.93))
    return fig


@book_figure
def fig_accuracy_vs_time(
    results: dict,
    methods: Sequence[str],
    timing: dict | None = None,
    train_size: int = 50_000,
    title: str = "",
    looks: dict | None = None,
    target: float | None = None,
    xmax: float | None = None,
):
    """Fig. 6: accuracy against training seconds (evaluation excluded). Without
    ``timing``: the cumulative training wall clock recorded by each run (mean over
    seeds), which includes the slow-down from other runs sharing the GPU. With
    ``timing`` (the record of ``cifar timing``): ``epoch × steps per epoch × seconds per
    step measured alone`` (methods missing from ``timing`` are left out). ``target``
    (a fraction, e.g. 0.85) draws the test accuracy the text times as a dotted line;
    ``xmax`` cuts the time axis (seconds)."""
    conds = _conditions(results)
    fig, axes = plt.subplots(
        len(conds), 2, figsize=(FIG_WIDTH_IN, 3.1 * len(conds) + 1.4), squeeze=False
    )
    seen: dict = {}
    for i, cond in enumerate(conds):
        for j, (key, name) in enumerate(
            (("train_acc", "training accuracy (%)"), ("test_acc", "test accuracy (%)"))
        ):
            ax = axes[i, j]
            for m in methods:
                x, v = curves(results, cond, m, key)
                if v.size == 0:
                    continue
                if timing is not None:
                    if m not in timing["methods"]:
                        continue
                    t = timing["methods"][m]
                    tx = x * (-(-train_size // t["batch_size"]) * t["sec_per_step"])
                else:
                    _, tt = curves(results, cond, m, "time_train")
                    tx = tt.mean(0)
                _band(ax, tx, v, _label(results, cond, m), **_look(m, looks),
                      seen=seen, cond=cond)
            if xmax is not None:
                ax.set_xlim(0, xmax)
            ax.set_title(f"{cond}-conditioned")
            ax.set_ylabel(name)
            ax.set_xlabel("training time (s)")
            ax.grid(alpha=0.3)
    extra = _target_line(axes[:, 1], target)
    n = _legend_below(fig, axes, seen, extra)
    fig.suptitle(
        title
        or "CIFAR-10: accuracy against training time\n"
        + (
            "(per-step time measured alone)" if timing else "(recorded on a shared GPU)"
        ),
        wrap=True,
    )
    fig.tight_layout(rect=(0, _below(fig, n), 1, 0.93))
    return fig


@book_figure
def fig_ablation(results: dict, methods: Sequence[str], looks: dict | None = None,
                 title: str = "Ill-conditioned CIFAR-10: damping, diagonal "
                 "conditioning,\nkernel, estimator input"):
    """Fig. 7: ill-conditioned case, KWNG (``methods[0]``) against each of its variants
    (``methods[1:]``): one row per variant, training and test accuracy per epoch, the
    variant solid and KWNG thin and dashed on top, so that a variant that ends where
    KWNG does hides neither curve."""
    ref, variants = methods[0], [m for m in methods[1:]
                                 if curves(results, "ill", m, "test_acc")[1].size]
    rows = max(1, len(variants))
    fig, axes = plt.subplots(rows, 2, figsize=(FIG_WIDTH_IN, 1.75 * rows + 1.6),
                             sharex=True, sharey="col", squeeze=False)
    seen: dict = {}
    for i, m in enumerate(variants or [ref]):
        for j, (key, name) in enumerate(
            (("train_acc", "training (%)"), ("test_acc", "test (%)"))
        ):
            ax = axes[i, j]
            x, v = curves(results, "ill", m, key)
            _band(ax, x, v, _label(results, "ill", m), **_look(m, looks), seen=seen,
                  cond="ill")
            if m != ref:
                x, v = curves(results, "ill", ref, key)
                look = {**_look(ref, looks), "ls": (0, (3, 2))}
                _band(ax, x, v, _label(results, "ill", ref), **look, seen=seen,
                      cond="ill", lw=1.0, ms=0, z=3)
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
            ax.set_title(f"{m}: {name.split()[0]}")
    for ax in axes[-1]:
        ax.set_xlabel("epoch")
    n = _legend_below(fig, axes, seen)
    fig.suptitle(title, wrap=True)
    fig.tight_layout(rect=(0, _below(fig, n), 1, 1 - 0.6 / fig.get_figheight()))
    return fig


@book_figure
def fig_eps(results: dict, floor: float = 1e-10, looks: dict | None = None):
    """The Levenberg–Marquardt ε at the end of every epoch, one line per KWNG run (both
    conditionings)."""
    conds = _conditions(results)
    fig, axes = plt.subplots(1, len(conds), figsize=(FIG_WIDTH_IN, 3.6), sharey=True,
                             squeeze=False)
    for j, cond in enumerate(conds):
        ax = axes[0, j]
        for (c, m, s), r in sorted(results.items()):
            if c != cond or not r["epochs"] or "eps" not in r["epochs"][0]:
                continue
            eps = [row["eps"] for row in r["epochs"]]
            ax.semilogy(range(1, len(eps) + 1), eps, **_look(m, looks), marker="o",
                        ms=2.5, lw=1.2, label=m if s == 0 else None)
        ax.axhline(floor, color="k", lw=0.8, ls=":")
        ax.set_title(f"{cond}-conditioned")
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("ε at the end of the epoch")
    n = _legend_below(fig, axes)
    fig.suptitle(
        "Levenberg–Marquardt ε of the KWNG runs (dotted: the floor ε_min)", wrap=True
    )
    fig.tight_layout(rect=(0, _below(fig, n), 1, 0.9))
    return fig


# -------------------------------------------------------------------------------------
# claim suite
@book_figure
def fig_per_class_vs_U(results: dict, methods: Sequence[str], cond: str = "ill",
                       mark: float | None = None):
    """Final test accuracy of each class against its scaling ``U_k`` (log x), one line
    per method (mean over seeds), with a dotted line at ``U_k = mark`` if given. A
    method invariant to the reparametrisation gives a flat line."""
    U = class_scalings(results)
    order = np.argsort(U)
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, 4.2))
    for m in methods:
        acc = final_per_class(results, cond, m)
        if acc is None:
            continue
        ax.semilogx(U[order], 100 * acc[order], marker="o", ms=4, lw=1.3, **_look(m),
                    label=_label(results, cond, m))
    if mark is not None:
        ax.axvline(mark, color="k", lw=0.8, ls=":")
    ax.set_xlabel("U of the class (log scale)")
    ax.set_ylabel("test accuracy of the class (%)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(ncol=2, loc="lower right")
    ax.set_title(
        f"{cond}-conditioned: per-class test accuracy\nafter the last epoch against "
        "the class's U"
    )
    fig.tight_layout()
    return fig


@book_figure
def fig_kwng_diagnostics(
    results: dict,
    methods: Sequence[str] = (
        "kwng",
        "kwng_samples_before_U",
        "diag_Ttilde",
        "kwng_lm_same_batch",
    ),
):
    """Rows: ε (epoch mean; in the authors' units ``ε_ours / √N`` for runs of the
    authors' convention), the reduction ratio (epoch mean over finite values) and the
    fraction of clipped steps; columns: ill- and well-conditioned. One line per run;
    panels without records say so."""
    keys = (("eps", "ε (authors' units)"), ("reduction_ratio", "reduction ratio r"),
            ("clipped", "fraction of steps clipped"))
    conds = _conditions(results)
    fig, axes = plt.subplots(3, len(conds), figsize=(FIG_WIDTH_IN, 7.5), sharex=True,
                             squeeze=False)
    for j, cond in enumerate(conds):
        for i, (key, name) in enumerate(keys):
            ax = axes[i, j]
            n = 0
            for (c, m, s), r in sorted(results.items()):
                if c != cond or m not in methods or not r["epochs"]:
                    continue
                v = diag_series(r, key)
                if v.size == 0:
                    continue
                x = np.arange(1, v.size + 1)
                plot = ax.semilogy if key == "eps" else ax.plot
                plot(x, v, **_look(m), marker="o", ms=2, lw=1.1,
                     label=f"{m} s{s}")
                n += 1
            if not n:  # a note, not an empty frame
                ax.set_axis_off()
                ax.text(0.5, 0.5, f"{name}: not recorded", ha="center", va="center",
                        transform=ax.transAxes)
            if key == "clipped":
                ax.set_ylim(-0.03, 1.03)
            if key == "eps" and n:
                ax.axhline(1e-10, color="k", lw=0.8, ls=":")  # the authors' floor
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
            if i == 0:
                ax.set_title(f"{cond}-conditioned")
    for ax in axes[-1]:
        ax.set_xlabel("epoch")
    fig.suptitle(
        "KWNG diagnostics per epoch\n"
        "(Levenberg–Marquardt ε, reduction ratio, clipping)",
        wrap=True,
    )
    n = _legend_below(fig, axes)
    fig.tight_layout(rect=(0, _below(fig, n), 1, 0.94))
    return fig




