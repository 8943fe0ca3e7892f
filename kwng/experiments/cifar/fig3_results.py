"""What the Fig. 3 protocol's records say so far (book chapter :ref:`cifar-fig3`): the
selection table, the runs at each selected step, the verdict per baseline by the
protocol's rule, and the queue left. Plots take these as arguments
(:func:`kwng.plots.cifar.fig_accuracy_per_epoch`)."""

from __future__ import annotations

import os
from pathlib import Path

from kwng.experiments.cifar.fig3 import (
    FIG3,
    fig3_plan,
    grid_state,
    record_at,
    run_status,
)

__all__ = ["selection_rows", "selected_runs", "seed_summary", "verdicts",
           "queue_left", "epoch_seconds"]


def selection_rows(p: dict, root: str | os.PathLike = FIG3) -> list[dict]:
    """One row per grid run made: ``conditioning``, ``method``, ``lr``, ``status``,
    ``val_acc`` and ``test_acc`` of its last epoch, ``stop`` (``"<reason> @ <epoch>"``
    or ``""``), ``selected`` (the best finished step so far) and ``final``."""
    root, rows = Path(root), []
    for key, st in grid_state(p, root).items():
        cond, m = key.split("/")
        for lr in sorted(st["runs"], reverse=True):
            rec = record_at(root, "grid", lr, cond, m, 0)
            if rec is None:
                continue
            last, stop = rec["epochs"][-1], rec.get("early_stop") or {}
            rows.append({"conditioning": cond, "method": m, "lr": lr,
                         "status": st["runs"][lr], "val_acc": last.get("val_acc"),
                         "test_acc": last["test_acc"],
                         "stop": f"{stop['reason']} @ {stop['epoch']}" if stop else "",
                         "selected": lr == st["selected"], "final": st["final"]})
    return rows


def selected_runs(p: dict, root: str | os.PathLike = FIG3,
                  final_only: bool = False) -> dict[tuple, dict]:
    """``{(conditioning, method, seed): record}``: the finished runs at each method's
    selected step (the grid run is seed 0, the others under ``seeds/``); with
    ``final_only`` only methods whose selection is final."""
    root, out = Path(root), {}
    epochs = int(p["settings"]["epochs"])
    for key, st in grid_state(p, root).items():
        if st["selected"] is None or (final_only and not st["final"]):
            continue
        cond, m = key.split("/")
        for s in range(int(p["seeds"][cond])):
            part = "grid" if s == 0 else "seeds"
            rec = record_at(root, part, st["selected"], cond, m, s)
            if run_status(rec, epochs) == "finished":
                out[(cond, m, s)] = rec
    return out


def seed_summary(p: dict, root: str | os.PathLike = FIG3) -> dict[str, dict]:
    """Per ``"<conditioning>/<method>"`` with a selected step: ``lr``, ``final`` (the
    selection), ``seeds`` (finished runs at that step), ``wanted`` (the protocol's
    seeds), the final test accuracies, their ``mean`` and ``range`` (max − min)."""
    state, runs, out = grid_state(p, root), selected_runs(p, root), {}
    for key, st in state.items():
        if st["selected"] is None:
            continue
        cond, m = key.split("/")
        accs = [r["epochs"][-1]["test_acc"] for (c, mm, _), r in sorted(runs.items())
                if (c, mm) == (cond, m)]
        out[key] = {"lr": st["selected"], "final": st["final"], "seeds": len(accs),
                    "wanted": int(p["seeds"][cond]), "test_acc": accs,
                    "mean": sum(accs) / len(accs),
                    "range": max(accs) - min(accs)}
    return out


def verdicts(p: dict, root: str | os.PathLike = FIG3) -> dict[str, dict]:
    """The protocol's verdict per baseline (its ``verdict_rule``): ``drop`` (well −
    ill mean test accuracy), ``spread`` ((ill range + well range) / 2) for the baseline
    and for KWNG, and ``verdict`` — ``"holds"``, ``"fails"``, ``"within spread"``, or
    ``"pending"`` while either method lacks a final selection or its seeds in a
    conditioning."""
    s = seed_summary(p, root)

    def ready(m: str) -> bool:
        return all(f"{c}/{m}" in s and s[f"{c}/{m}"]["final"]
                   and s[f"{c}/{m}"]["seeds"] == s[f"{c}/{m}"]["wanted"]
                   for c in ("ill", "well"))

    def drop(m: str) -> tuple[float, float]:
        ill, well = s[f"ill/{m}"], s[f"well/{m}"]
        return well["mean"] - ill["mean"], (ill["range"] + well["range"]) / 2

    out = {}
    for m in p["methods"]["both"]:
        if m == "kwng":
            continue
        if not (ready(m) and ready("kwng")):
            out[m] = {"verdict": "pending"}
            continue
        (dm, sm), (dk, sk) = drop(m), drop("kwng")
        margin = sm + sk
        verdict = ("holds" if dm - dk > margin else "fails" if dk - dm > margin
                   else "within spread")
        out[m] = {"drop": dm, "spread": sm, "drop_kwng": dk, "spread_kwng": sk,
                  "verdict": verdict}
    return out


def queue_left(p: dict, root: str | os.PathLike = FIG3) -> dict[str, int]:
    """Runs the protocol still needs, by part (grid, seeds, ablation); grid values
    added by the extension rule and seeds of selections not yet final are counted
    once they are known."""
    jobs = fig3_plan({}, p, root, commit="(count only)")
    out = {"grid": 0, "seeds": 0, "ablation": 0}
    for j in jobs:
        out[Path(j["out"]).parent.name] += 1
    return out


def epoch_seconds(p: dict, root: str | os.PathLike = FIG3,
                  methods: tuple[str, ...] = ("sgd", "sgd_momentum",
                                              "sgd_momentum_wd")) -> list[float]:
    """The training seconds of every epoch after the first of the finished grid runs of
    ``methods``, as they ran in the queue (several runs on a GPU at the start of a wave,
    fewer at its end)."""
    out = []
    for key, st in grid_state(p, root).items():
        cond, m = key.split("/")
        if m not in methods:
            continue
        for lr, status in st["runs"].items():
            rec = record_at(Path(root), "grid", lr, cond, m, 0)
            if status == "finished":
                t = [r["time_train"] for r in rec["epochs"]]
                out += [b - a for a, b in zip(t, t[1:])]
    return out
