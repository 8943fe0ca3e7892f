"""Figures and tables of the CIFAR study at the authors' horizon (plan ``authors100``;
book chapter :ref:`experiments-cifar`). Each function takes the records of
:func:`studies.authors100.records.load_authors100` (keys ``(tag, conditioning,
method, seed)``, ``tag`` = ``lr<step>`` or ``fp32/lr<step>``).

* :func:`final_rows` — the final accuracy of every run and the recall and precision of
  its two classes with the smallest ``U_k``;
* :func:`scale_points` and :func:`scale_threshold` — the logit scale
  ``U_k ‖W_k‖ ‖φ‖`` of every (run, class, epoch) against whether the class is learned;
* :func:`fig_logit_scale` — that scale per class and epoch, one panel per IC run;
  :func:`learned_epochs` and :func:`max_scale` — when a class is learned, how far its
  scale goes;
* :func:`fig_accuracy` — test accuracy per epoch and per second (Figs. 3 and 7 of the
  paper; the seconds per epoch of
  :func:`studies.cifar.records.epoch_seconds`).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

from studies.cifar.methods import METHODS
from studies.cifar.records import run_label
from studies.kit.style import FIG_WIDTH_IN, book_figure

__all__ = ["final_rows", "scale_points", "scale_threshold", "fig_logit_scale",
           "learned_epochs", "max_scale",
           "fig_accuracy"]

_DASHES = ("-", "--", ":", "-.")  # one per step size of a method, in order seen

#: a class counts as learned when its test recall and precision both reach this
LEARNED = 0.5


def _order(records: dict, key: tuple) -> np.ndarray:
    U = records[key].get("U")
    return np.argsort(np.asarray(U)) if U else np.arange(10)


def final_rows(records: dict) -> list[dict]:
    """One row per run: conditioning, method, step, seed, epochs, final and best test
    accuracy, and (IC) recall and precision of the two classes with the smallest
    ``U_k``; sorted IC first, then by method."""
    rows = []
    for key, r in sorted(records.items(), key=lambda kv: (kv[0][1] != "ill", kv[0][2],
                                                          kv[0][0], kv[0][3])):
        tag, cond, method, seed = key
        last = r["epochs"][-1]
        row = {"key": key, "conditioning": cond, "method": method,
               "step": float(tag.split("lr")[-1]), "seed": seed,
               "precision": r.get("precision"), "epochs": len(r["epochs"]),
               "final": last["test_acc"],
               "best": max(e["test_acc"] for e in r["epochs"])}
        two = _order(records, key)[:2]
        row["recall_small"] = [last["test_acc_per_class"][k] for k in two]
        row["precision_small"] = [last["test_precision_per_class"][k] for k in two]
        rows.append(row)
    return rows


def scale_points(records: dict, small_u: float = 1e-3) -> dict[str, np.ndarray]:
    """For every IC run, class with ``U_k ≤ small_u`` and epoch: the logit scale
    ``s = U_k ‖W_k‖ ‖φ‖`` (``‖φ‖`` the epoch's mean feature norm on the test set: the
    typical size of the class's logit) and whether the class is learned (test recall
    and precision ≥ :data:`LEARNED`)."""
    s, learned = [], []
    for r in records.values():
        if not r.get("U"):
            continue
        small = np.asarray(r["U"]) <= small_u
        for e in r["epochs"]:
            scale = np.asarray(e["logit_scale"]) * e["feature_norm"]
            rec = np.asarray(e["test_acc_per_class"])
            prec = np.array([0.0 if p is None else p
                             for p in e["test_precision_per_class"]])
            s.extend(scale[small])
            learned.extend(((rec >= LEARNED) & (prec >= LEARNED))[small])
    return {"scale": np.array(s), "learned": np.array(learned, dtype=bool)}


def scale_threshold(records: dict, small_u: float = 1e-3) -> dict:
    """The smallest logit scale at which a small-``U_k`` class was learned, the number
    of points, of learned points, and of points at or above that scale that were not
    learned (the condition is necessary, not sufficient)."""
    pts = scale_points(records, small_u)
    s, ok = pts["scale"], pts["learned"]
    lo = float(s[ok].min()) if ok.any() else float("nan")
    return {"min_learned": lo, "points": int(len(s)), "learned": int(ok.sum()),
            "unlearned_above": int(((s >= lo) & ~ok).sum()),
            "max_unlearned": float(s[~ok].max()) if (~ok).any() else float("nan")}


@book_figure
def fig_logit_scale(records: dict, keys: Sequence[tuple] | None = None,
                    threshold: float | None = None):
    """``U_k ‖W_k‖ ‖φ‖`` against epoch for every class, one panel per run (default:
    the IC runs of seed 0 at 100 epochs); a line is drawn thick where the class is
    learned, and ``threshold`` is marked."""
    if keys is None:
        keys = sorted((k for k in records if k[1] == "ill" and k[3] == 0
                       and not k[0].startswith("fp32")),
                      key=lambda k: (METHODS[k[2]].order,
                                     -float(k[0].split("lr")[-1])))
    n = len(keys)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(FIG_WIDTH_IN, 2.4 * rows + 0.4),
                             sharey=True, squeeze=False, layout="constrained")
    cmap = plt.get_cmap("viridis")
    for ax, key in zip(axes.flat, keys):
        r = records[key]
        U = np.asarray(r["U"])
        ep = np.array([e["epoch"] for e in r["epochs"]])
        s = np.array([np.asarray(e["logit_scale"]) * e["feature_norm"]
                      for e in r["epochs"]])
        rec = np.array([e["test_acc_per_class"] for e in r["epochs"]])
        prec = np.array([[0.0 if p is None else p
                          for p in e["test_precision_per_class"]]
                         for e in r["epochs"]])
        learned = (rec >= LEARNED) & (prec >= LEARNED)
        logu = np.log10(U)
        for k in np.argsort(U):
            c = cmap((logu[k] - logu.min()) / max(np.ptp(logu), 1e-12))
            ax.plot(ep, s[:, k], color=c, lw=0.7, alpha=0.6)
            ax.plot(ep, np.where(learned[:, k], s[:, k], np.nan), color=c, lw=2.2)
        if threshold is not None:
            ax.axhline(threshold, color="k", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.set_title(run_label(key))
        ax.grid(alpha=0.3, which="major")
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("class logit scale U‖W‖‖φ‖")
    for ax in axes[-1]:
        ax.set_xlabel("epoch")
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(-6, 1))
    fig.colorbar(sm, ax=axes, label="log10 of the class's U", shrink=0.8,
                 location="bottom", aspect=40)
    return fig


@book_figure
def fig_accuracy(records: dict, seconds: dict[str, float] | None = None,
                 keys: Sequence[tuple] | None = None):
    """Test accuracy per epoch (Fig. 3 of the paper), or, with ``seconds`` (per method,
    :func:`epoch_seconds`), per second of one GPU (Fig. 6): IC and WC panels."""
    if keys is None:
        keys = [k for k in sorted(records) if not k[0].startswith("fp32")]
    fig, axes = plt.subplots(1, 2, figsize=(FIG_WIDTH_IN, 3.4), sharey=True)
    seen: dict[str, dict[str, int]] = {}  # method -> step tag -> its line style
    for ax, cond, name in zip(axes, ("ill", "well"), ("ill-conditioned",
                                                       "well-conditioned")):
        for key in keys:
            if key[1] != cond:
                continue
            r = records[key]
            ep = np.array([e["epoch"] for e in r["epochs"]])
            acc = np.array([e["test_acc"] for e in r["epochs"]])
            x = ep if seconds is None else ep * seconds[key[2]]
            steps = seen.setdefault(key[2], {})
            ls = _DASHES[steps.setdefault(key[0], len(steps)) % len(_DASHES)]
            ax.plot(x, 100 * acc, ls, lw=1.2, color=METHODS[key[2]].color,
                    label=run_label(key))
        ax.set_title(name)
        ax.set_xlabel("epoch" if seconds is None else "seconds (one GPU, alone)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy (%)")
    ax = max(axes, key=lambda a: len(a.get_legend_handles_labels()[1]))
    handles, labels = ax.get_legend_handles_labels()
    rows = -(-len(labels) // 2)
    fig.set_figheight(3.2 + 0.19 * rows)
    fig.legend(handles, labels, loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, (0.2 + 0.19 * rows) / fig.get_figheight(), 1, 1))
    return fig


def learned_epochs(records: dict, key: tuple, classes: int = 2) -> list[int | None]:
    """For the ``classes`` classes with the smallest ``U_k`` of run ``key``: the first
    epoch at which the class is learned (test recall and precision ≥ :data:`LEARNED`),
    ``None`` if never."""
    out = []
    for k in _order(records, key)[:classes]:
        hit = None
        for e in records[key]["epochs"]:
            prec = e["test_precision_per_class"][k]
            if e["test_acc_per_class"][k] >= LEARNED and (prec or 0.0) >= LEARNED:
                hit = int(e["epoch"])
                break
        out.append(hit)
    return out


def max_scale(records: dict, key: tuple, rank: int = 0) -> float:
    """The largest logit scale ``U_k ‖W_k‖ ‖φ‖`` over the epochs of run ``key`` of the
    class with the ``rank``-th smallest ``U_k``."""
    k = _order(records, key)[rank]
    return float(max(e["logit_scale"][k] * e["feature_norm"]
                     for e in records[key]["epochs"]))
