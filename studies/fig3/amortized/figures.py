"""The figure of the amortized step's seed study (chapter :ref:`cifar-amortized`): how
the runs of one setting that stalled differ, epoch by epoch, from those that did not
(:func:`fig_stalls`)."""

from __future__ import annotations

import numpy as np

from studies.kit.style import FIG_WIDTH_IN, book_figure

__all__ = ["fig_stalls"]

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
