"""Figures and tables of the CIFAR study from result records (book chapter :ref:`experiments-cifar`).

Each function takes the dictionary of :func:`kwng.experiments.cifar.results.load_results`
(``{(conditioning, method, seed): record}``) and returns a matplotlib figure or plain data:

* :func:`fig_accuracy_per_epoch` — the paper's Fig. 3 (test and training accuracy per epoch, ill- and
  well-conditioned side by side, mean over seeds with the min–max band);
* :func:`fig_accuracy_vs_time` — Fig. 7 (accuracy against training time: the wall clock recorded by
  each run, or the step time of each method measured alone);
* :func:`fig_ablation` — Fig. 8 (damping choices, diagonal conditioning alone, RQ kernel, scaled logits);
* :func:`fig_eps` — the Levenberg–Marquardt ε of every KWNG run at the end of each epoch;
* :func:`final_accuracy_table` — final test accuracy per method and conditioning, mean ± spread.

For the claim suite (records with per-class accuracy and KWNG diagnostics per epoch):

* :func:`fig_per_class_vs_U` — per-class test accuracy against the class's scaling ``U_k`` (IC);
* :func:`fig_kwng_diagnostics` — ε (authors' units), reduction ratio and clipped fraction per epoch;
* (the decision rule of the claim suite is :func:`kwng.experiments.cifar.results.claim_verdict`);
* :func:`selection_table` — the step-size selection as a Markdown table.
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np

from kwng.plots.style import FIG_WIDTH_IN, book_figure, method_color

__all__ = ["at_epoch", "curves", "diag_series", "final_accuracy_table", "format_table",
           "fig_accuracy_per_epoch", "fig_accuracy_vs_time", "fig_ablation", "fig_eps", "fig_per_class_vs_U",
           "fig_kwng_diagnostics", "selection_table", "class_scalings", "final_per_class"]

_STYLES = {"kwng_samples_before_U": "--", "kwng_lm_same_batch": "-.",
           "kwng_m20": "--", "kwng_momentum": "-.", "kwng_bigbatch": ":", "sgd_momentum": "--",
           "sgd_momentum_wd": ":", "ekfac": "--", "diag_T": "--", "diag_Ttilde": ":", "kwng_rq": "-.",
           "kwng_scaled_logits": "--"}


def at_epoch(results: dict, epoch: int) -> dict:
    """The records cut after ``epoch`` epochs (runs with fewer are left out): a comparison of runs
    that stopped at different epochs, all at the same point of their schedule."""
    if not isinstance(epoch, int) or epoch < 1:
        raise ValueError(f"epoch must be an integer >= 1, got {epoch!r}")
    return {k: {**r, "epochs": r["epochs"][:epoch]} for k, r in results.items() if len(r["epochs"]) >= epoch}


def curves(results: dict, conditioning: str, method: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(epochs, values)`` with values of shape ``(seeds, epochs)``, truncated to the shortest run."""
    runs = [r for (c, m, _), r in sorted(results.items()) if c == conditioning and m == method and r["epochs"]]
    if not runs:
        return np.zeros(0), np.zeros((0, 0))
    n = min(len(r["epochs"]) for r in runs)
    vals = np.array([[row[key] for row in r["epochs"][:n]] for r in runs], dtype=float)
    return np.arange(1, n + 1), vals


def final_accuracy_table(results: dict, methods: Sequence[str],
                         conditionings: Sequence[str] = ("ill", "well")) -> dict:
    """``{method: {cond: {"mean", "min", "max", "std", "n", "epochs", "diverged"}}}`` of the last-epoch
    test accuracy (absent entries: no run)."""
    out: dict = {}
    for m in methods:
        for c in conditionings:
            runs = [r for (cc, mm, _), r in results.items() if cc == c and mm == m and r["epochs"]]
            if not runs:
                continue
            acc = np.array([r["epochs"][-1]["test_acc"] for r in runs], dtype=float)
            out.setdefault(m, {})[c] = {
                "mean": float(np.nanmean(acc)) if np.isfinite(acc).any() else float("nan"),
                "min": float(np.nanmin(acc)) if np.isfinite(acc).any() else float("nan"),
                "max": float(np.nanmax(acc)) if np.isfinite(acc).any() else float("nan"),
                "std": float(np.nanstd(acc, ddof=1)) if np.isfinite(acc).sum() > 1 else 0.0,
                "n": len(runs), "epochs": [len(r["epochs"]) for r in runs],
                "planned": max(int(r["config"]["epochs"]) for r in runs),
                "complete": all(r.get("complete") for r in runs),
                "diverged": sum(bool(r.get("diverged")) for r in runs)}
    return out


def format_table(table: dict, conditionings: Sequence[str] = ("ill", "well")) -> str:
    """A Markdown table: mean ± std (min–max, n seeds) of the final test accuracy in %; runs stopped
    before their planned number of epochs are marked with the epochs they reached."""
    head = "| method | " + " | ".join(f"{c}-conditioned" for c in conditionings) + " |"
    lines = [head, "|---" * (len(conditionings) + 1) + "|"]
    for m, row in table.items():
        cells = []
        for c in conditionings:
            e = row.get(c)
            if e is None:
                cells.append("–")
                continue
            s = f"{100 * e['mean']:.1f}"
            if e["n"] > 1:
                s += f" ± {100 * e['std']:.1f} ({100 * e['min']:.1f}–{100 * e['max']:.1f}, n={e['n']})"
            if not e["complete"]:
                s += f" (incomplete: {min(e['epochs'])}/{e['planned']} epochs)"
            if e["diverged"]:
                s += f" ({e['diverged']} diverged)"
            cells.append(s)
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _band(ax, x, vals, label, color, ls="-"):
    if vals.size == 0:
        return
    mean = vals.mean(0)
    ax.plot(x, 100 * mean, color=color, label=label, lw=1.5, ls=ls, marker="o", ms=2.5)
    if vals.shape[0] > 1:
        ax.fill_between(x, 100 * vals.min(0), 100 * vals.max(0), color=color, alpha=0.2, lw=0)


def _legend_below(fig, axes):
    """One legend under the figure, in two columns, from the panel with the most
    labelled lines."""
    ax = max(axes.flat, key=lambda a: len(a.get_legend_handles_labels()[1]))
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=2, frameon=False)


def _below(axes) -> float:
    """The share of the figure's height that :func:`_legend_below` needs."""
    fig = axes.flat[0].figure
    n = max(len(a.get_legend_handles_labels()[1]) for a in axes.flat)
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
    """``method`` with ``n=k`` seeds, and the epochs reached where a run stopped early."""
    runs = [r for (c, m, _), r in results.items() if c == cond and m == method and r["epochs"]]
    lab = method + (f" (n={len(runs)})" if len(runs) > 1 else "")
    if runs and not all(r.get("complete") for r in runs):
        lab += f" [{min(len(r['epochs']) for r in runs)}/{runs[0]['config']['epochs']} ep.]"
    return lab


@book_figure
def fig_accuracy_per_epoch(results: dict, methods: Sequence[str], title: str = ""):
    """Fig. 3: rows test / training accuracy, columns ill- / well-conditioned (a column
    only for a conditioning with records)."""
    conds = _conditions(results)
    fig, axes = plt.subplots(2, len(conds), figsize=(FIG_WIDTH_IN, 6.2), sharex=True,
                             squeeze=False)
    for j, cond in enumerate(conds):
        for i, (key, name) in enumerate((("test_acc", "test accuracy (%)"), ("train_acc", "training accuracy (%)"))):
            ax = axes[i, j]
            for m in methods:
                x, v = curves(results, cond, m, key)
                _band(ax, x, v, _label(results, cond, m), method_color(m), _STYLES.get(m, "-"))
            ax.set_ylabel(name)
            ax.set_title(f"{cond}-conditioned")
            ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("epoch")
    _legend_below(fig, axes)
    fig.suptitle(title or "CIFAR-10, ResNet-18: accuracy per epoch (mean over seeds, band = min–max)", wrap=True)
    fig.tight_layout(rect=(0, _below(axes), 1, 0.93))
    return fig


@book_figure
def fig_accuracy_vs_time(results: dict, methods: Sequence[str], timing: dict | None = None,
                         train_size: int = 50_000, title: str = ""):
    """Fig. 7: accuracy against training time (evaluation excluded). Without ``timing``: the cumulative
    training wall clock recorded by each run (mean over seeds), which includes the slow-down from other
    runs sharing the GPU. With ``timing`` (the record of ``cifar timing``): ``epoch × steps per epoch ×
    seconds per step measured alone`` (methods missing from ``timing`` are left out)."""
    conds = _conditions(results)
    fig, axes = plt.subplots(len(conds), 2, figsize=(FIG_WIDTH_IN, 3.1 * len(conds) + 1.4),
                             squeeze=False)
    for i, cond in enumerate(conds):
        for j, (key, name) in enumerate((("train_acc", "training accuracy (%)"), ("test_acc", "test accuracy (%)"))):
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
                _band(ax, tx / 60, v, _label(results, cond, m), method_color(m), _STYLES.get(m, "-"))
            ax.set_title(f"{cond}-conditioned")
            ax.set_ylabel(name)
            ax.set_xlabel("training time (min)")
            ax.grid(alpha=0.3)
    _legend_below(fig, axes)
    fig.suptitle(title or "CIFAR-10: accuracy against training time\n"
                 + ("(per-step time measured alone)" if timing else "(recorded on a shared GPU)"), wrap=True)
    fig.tight_layout(rect=(0, _below(axes), 1, 0.93))
    return fig


@book_figure
def fig_ablation(results: dict, methods: Sequence[str]):
    """Fig. 8: ill-conditioned case, KWNG against its variants (training and test accuracy per epoch)."""
    fig, axes = plt.subplots(1, 2, figsize=(FIG_WIDTH_IN, 4.6), squeeze=False)
    for j, (key, name) in enumerate((("train_acc", "training accuracy (%)"), ("test_acc", "test accuracy (%)"))):
        ax = axes[0, j]
        for m in methods:
            x, v = curves(results, "ill", m, key)
            _band(ax, x, v, _label(results, "ill", m), method_color(m), _STYLES.get(m, "-"))
        ax.set_xlabel("epoch")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    _legend_below(fig, axes)
    fig.suptitle("Ill-conditioned CIFAR-10: damping, diagonal conditioning,\nkernel, "
                 "estimator input", wrap=True)
    fig.tight_layout(rect=(0, _below(axes), 1, 0.9))
    return fig


@book_figure
def fig_eps(results: dict, floor: float = 1e-10):
    """The Levenberg–Marquardt ε at the end of every epoch, one line per KWNG run (both conditionings)."""
    conds = _conditions(results)
    fig, axes = plt.subplots(1, len(conds), figsize=(FIG_WIDTH_IN, 3.6), sharey=True,
                             squeeze=False)
    for j, cond in enumerate(conds):
        ax = axes[0, j]
        for (c, m, s), r in sorted(results.items()):
            if c != cond or not r["epochs"] or "eps" not in r["epochs"][0]:
                continue
            eps = [row["eps"] for row in r["epochs"]]
            ax.semilogy(range(1, len(eps) + 1), eps, color=method_color(m), ls=_STYLES.get(m, "-"), marker="o",
                        ms=2.5, lw=1.2, label=m if s == 0 else None)
        ax.axhline(floor, color="k", lw=0.8, ls=":")
        ax.set_title(f"{cond}-conditioned")
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("ε at the end of the epoch")
    _legend_below(fig, axes)
    fig.suptitle("Levenberg–Marquardt ε of the KWNG runs (dotted: the floor ε_min)", wrap=True)
    fig.tight_layout(rect=(0, _below(axes), 1, 0.9))
    return fig


# ------------------------------------------------------------------------------------- claim suite
def class_scalings(results: dict) -> np.ndarray:
    """``U_k`` of each class in the ill-conditioned runs, from the records (the loader,
    :func:`kwng.experiments.cifar.results.load_results`, fills it in for old records)."""
    for (c, _, _), r in sorted(results.items()):
        if c == "ill" and r.get("U"):
            return np.asarray(r["U"], dtype=float)
    raise ValueError("results must hold an ill-conditioned record with its class scalings 'U' "
                     "(load them with kwng.experiments.cifar.results.load_results)")


def final_per_class(results: dict, cond: str, method: str) -> np.ndarray | None:
    """Per-class test accuracy after the last epoch, mean over seeds (None without such records)."""
    runs = [r for (c, m, _), r in results.items() if c == cond and m == method and r["epochs"]
            and "test_acc_per_class" in r["epochs"][-1]]
    if not runs:
        return None
    return np.mean([r["epochs"][-1]["test_acc_per_class"] for r in runs], axis=0)


@book_figure
def fig_per_class_vs_U(results: dict, methods: Sequence[str], cond: str = "ill",
                       mark: float | None = None):
    """Final test accuracy of each class against its scaling ``U_k`` (log x), one line per method
    (mean over seeds), with a dotted line at ``U_k = mark`` if given. A method invariant to the
    reparametrisation gives a flat line."""
    U = class_scalings(results)
    order = np.argsort(U)
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, 4.2))
    for m in methods:
        acc = final_per_class(results, cond, m)
        if acc is None:
            continue
        ax.semilogx(U[order], 100 * acc[order], marker="o", ms=4, lw=1.3, color=method_color(m),
                    ls=_STYLES.get(m, "-"), label=_label(results, cond, m))
    if mark is not None:
        ax.axvline(mark, color="k", lw=0.8, ls=":")
    ax.set_xlabel("$U_k$ of the class (log scale)")
    ax.set_ylabel("test accuracy of the class (%)")
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(ncol=2, loc="lower right")
    ax.set_title(f"{cond}-conditioned: per-class test accuracy\nafter the last epoch against $U_k$")
    fig.tight_layout()
    return fig


def diag_series(rec: dict, key: str) -> np.ndarray:
    """One KWNG diagnostic of a run record per epoch: ``"eps"`` (epoch mean, in the authors'
    units ``ε_ours / √N`` for runs of the authors' convention), ``"clipped"`` (fraction of the
    epoch's steps) or another ``info`` key's epoch mean (``"reduction_ratio"``, ...); an
    empty array when the record lacks it."""
    rows = rec["epochs"]
    if key == "clipped":
        if all("clipped_mean" in r for r in rows):
            return np.array([r["clipped_mean"] for r in rows], dtype=float)
        if all("clipped" in r for r in rows):  # cumulative counter -> fraction of the epoch's steps
            cum = np.array([0] + [r["clipped"] for r in rows], dtype=float)
            st = np.array([0] + [r["steps"] for r in rows], dtype=float)
            return np.diff(cum) / np.maximum(np.diff(st), 1)
        return np.zeros(0)
    if key == "eps":
        vals = [r.get("eps_mean", r.get("eps")) for r in rows]
        if any(v is None for v in vals):
            return np.zeros(0)
        from kwng.engine.config import authors_eps_factor

        conv = rec.get("method_spec", {}).get("eps_convention", "ours")
        return np.array(vals, dtype=float) / (authors_eps_factor(rec["batch_size"]) if conv == "authors" else 1.0)
    vals = [r.get(f"{key}_mean") for r in rows]
    return np.zeros(0) if any(v is None for v in vals) else np.array(vals, dtype=float)


@book_figure
def fig_kwng_diagnostics(results: dict, methods: Sequence[str] = ("kwng", "kwng_samples_before_U", "diag_Ttilde",
                                                                    "kwng_lm_same_batch")):
    """Rows: ε (epoch mean; in the authors' units ``ε_ours / √N`` for runs of the authors' convention),
    the reduction ratio (epoch mean over finite values) and the fraction of clipped steps; columns:
    ill- and well-conditioned. One line per run; panels without records say so."""
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
                plot(x, v, color=method_color(m), ls=_STYLES.get(m, "-"), marker="o", ms=2, lw=1.1,
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
    fig.suptitle("KWNG diagnostics per epoch\n(Levenberg–Marquardt ε, reduction ratio, clipping)", wrap=True)
    _legend_below(fig, axes)
    fig.tight_layout(rect=(0, _below(axes), 1, 0.94))
    return fig




def selection_table(selected: dict) -> str:
    """The step-size selection (the ``selected.json`` of ``cifar select``) as a Markdown table:
    held-out accuracy per step size of the grid, ``div`` for diverged runs, the chosen one in bold."""
    grid = selected["grid"]
    lines = ["| run | " + " | ".join(f"{g:g}" for g in grid) + " | chosen |", "|---" * (len(grid) + 2) + "|"]
    for key, v in sorted(selected["selected"].items()):
        acc = {c["lr"]: ("div" if not c["ok"] else f"{100 * c['val_acc']:.1f}") for c in v["candidates"]}
        cells = [f"**{acc[g]}**" if g == v["lr"] else acc.get(g, "–") for g in grid]
        lines.append(f"| {key.split('/', 1)[1]} | " + " | ".join(cells) + f" | {v['lr']:g} |")
    return "\n".join(lines)
