"""The figures of the amortized step's seed study (chapter :ref:`cifar-amortized`): how
the runs of one setting that stalled differ, epoch by epoch, from those that did not
(:func:`fig_stalls`), a traced run step by step (:func:`fig_trace`, from
:mod:`studies.fig3.amortized.stale_trace`), and one setting's runs under the guard and
the fallbacks side by side (:func:`fig_fallback_variants`)."""

from __future__ import annotations

import numpy as np

from studies.kit.style import FIG_WIDTH_IN, book_figure

__all__ = ["fig_stalls", "fig_trace", "fig_fallback_variants"]

#: the per-epoch fields drawn, with their panel titles
#:
#: :meta hide-value:
PANELS = (("test_acc", "test accuracy"),
          ("fallbacks", "steps that fell back to g\n(cumulative)"),
          ("ill_conditioned", "steps with a rank-deficient\nC Cᵀ (cumulative)"),
          ("eps", "ε at the epoch's end"))


@book_figure
def fig_stalls(runs: dict[int, dict], stall_below: float, title: str = ""):
    """One line per run of one setting (``runs``: ``{seed: record}``) in four panels,
    against the epoch: test accuracy, the cumulative counts of fallbacks and of
    rank-deficient systems, and ``ε``; runs that end below ``stall_below`` in red,
    the others in grey, each labelled with its seed."""
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("runs must hold at least one record")
    fig, axes = plt.subplots(2, 2, figsize=(FIG_WIDTH_IN, 0.75 * FIG_WIDTH_IN),
                             sharex=True)
    for seed, rec in sorted(runs.items()):
        rows = rec["epochs"]
        stalled = rows[-1]["test_acc"] < stall_below
        look = {"color": "#cb181d" if stalled else "#737373",
                "ls": "-" if stalled else "--", "lw": 1.4}
        ep = np.array([r["epoch"] for r in rows])
        for ax, (field, _) in zip(axes.flat, PANELS):
            ax.plot(ep, [r[field] for r in rows], label=f"seed {seed}"
                    + (" (stalled)" if stalled else ""), **look)
    for ax, (field, name) in zip(axes.flat, PANELS):
        ax.set_title(name)
        if field == "eps":
            ax.set_yscale("log")
    for ax in axes[1]:
        ax.set_xlabel("epoch")
    axes[0, 0].axhline(stall_below, color="k", lw=0.6, ls=":")
    axes[0, 0].legend(loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


@book_figure
def fig_trace(rows: list[dict[str, float]], ages: list[dict[str, float]],
              title: str = ""):
    """A traced amortized run (``rows`` of
    :func:`~studies.fig3.amortized.stale_trace.read_trace`, ``ages`` its
    :func:`~studies.fig3.amortized.stale_trace.by_age`) in three panels: the loss per
    step with the refresh steps marked; the cosine of each reused direction with a
    fresh system's, against the cosine of two fresh ones (basis noise alone); and, by
    the system's age, the median of both cosines and the share of steps that fell
    back to ``g``."""
    import matplotlib.pyplot as plt

    if not rows or not ages:
        raise ValueError("rows and ages must each hold at least one entry")
    fig, axes = plt.subplots(3, 1, figsize=(FIG_WIDTH_IN, 1.0 * FIG_WIDTH_IN))
    step = np.array([r["step"] for r in rows])
    refresh = np.array([bool(r["refresh"]) for r in rows])
    axes[0].plot(step, [r["loss"] for r in rows], color="#525252", lw=0.6)
    axes[0].plot(step[refresh], [r["loss"] for r, f in zip(rows, refresh) if f], "|",
                 color="#2171b5", ms=6, label="refresh")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("training loss")
    axes[0].legend(loc="upper left")
    for field, look in (("cos_fresh", {"color": "#cb181d", "label":
                                       "reused vs fresh"}),
                        ("cos_fresh_pair", {"color": "#737373", "label":
                                            "fresh vs fresh (basis noise)"})):
        axes[1].plot(step, [r[field] for r in rows], ".", ms=1.5, **look)
    axes[1].set_ylabel("cosine")
    axes[1].set_xlabel("step")
    axes[1].legend(loc="upper right", markerscale=6, framealpha=0.9)
    age = np.array([a["age"] for a in ages])
    axes[2].plot(age, [a["cos_fresh"] for a in ages], color="#cb181d",
                 label="reused vs fresh (median)")
    axes[2].plot(age, [a["cos_fresh_pair"] for a in ages], color="#737373",
                 label="fresh vs fresh (median)")
    axes[2].plot(age, [a["fallback"] for a in ages], color="#2171b5", ls="--",
                 label="share of steps falling back to g")
    axes[2].set_xlabel("steps since the refresh (age of the system)")
    axes[2].set_ylim(0, 1)
    axes[2].legend(loc="upper right", framealpha=0.9)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


@book_figure
def fig_fallback_variants(groups: dict[str, dict[int, dict]], stall_below: float,
                          title: str = ""):
    """Test accuracy against the epoch, one panel per variant, stacked (``groups``:
    ``{panel title: {seed: record}}``, in order), one line per run: red for a run that
    ends below ``stall_below``, grey otherwise, each labelled with its seed and the
    steps whose direction failed (the record's last ``fallbacks`` count)."""
    import matplotlib.pyplot as plt

    if not groups or not all(groups.values()):
        raise ValueError("groups must hold at least one panel, each with a run")
    fig, axes = plt.subplots(len(groups), 1, sharex=True, squeeze=False,
                             figsize=(FIG_WIDTH_IN, 0.3 * FIG_WIDTH_IN * len(groups)))
    for ax, (name, runs) in zip(axes[:, 0], groups.items()):
        for seed, rec in sorted(runs.items()):
            rows = rec["epochs"]
            bad = rows[-1]["test_acc"] < stall_below
            ax.plot([r["epoch"] for r in rows], [r["test_acc"] for r in rows],
                    color="#cb181d" if bad else "#737373", ls="-" if bad else "--",
                    lw=1.2, label=f"seed {seed}: {rows[-1]['fallbacks']:,} failed")
        ax.axhline(stall_below, color="k", lw=0.6, ls=":")
        ax.set_title(name)
        ax.set_ylabel("test accuracy")
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    axes[-1, 0].set_xlabel("epoch")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
