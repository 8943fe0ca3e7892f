"""What the Fig. 3 protocol's records say so far (book chapter :ref:`cifar-fig3`): the
selection table, the runs at each selected step, the verdict per baseline by the
protocol's rule, the time to reach a test accuracy, and the queue left. Plots take
these as arguments (:func:`kwng.plots.cifar.fig_accuracy_per_epoch`)."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from kwng.experiments.cifar.fig3 import (
    FIG3,
    fig3_plan,
    grid_state,
    record_at,
    run_status,
)
from kwng.experiments.provenance import read_json

__all__ = ["selection_rows", "selected_runs", "seed_summary", "verdicts",
           "queue_left", "round_epoch_seconds", "rounds", "round_of",
           "alone_runs", "seconds_to_accuracy"]


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


def round_epoch_seconds(p: dict, root: str | os.PathLike = FIG3,
                        methods: tuple[str, ...] = ("sgd", "sgd_momentum",
                                                    "sgd_momentum_wd")
                        ) -> dict[int, list[float]]:
    """Per GPU round (:func:`rounds`), the training seconds of every epoch after the
    first of the finished 100-epoch runs of ``methods`` (grid and seeds), as they ran in
    that round's queue: the measure of what sharing a GPU costs."""
    root, rs, out = Path(root), rounds(root), {}
    epochs = int(p["settings"]["epochs"])
    for mp in sorted(root.glob("*/lr*/*/*/*/seed*/metrics.json")):
        rec = read_json(mp)
        if rec["config"]["method"] not in methods \
                or run_status(rec, epochs) != "finished":
            continue
        rd = round_of(read_json(mp.parent / "provenance.json"), rs)
        if rd is None:
            continue
        t = [r["time_train"] for r in rec["epochs"]]
        out.setdefault(rd["round"], []).extend(b - a for a, b in zip(t, t[1:]))
    return out


def rounds(root: str | os.PathLike = FIG3) -> list[dict]:
    """The GPU rounds of the queue (``rounds.json`` beside the records): machine, git
    commit, runs per GPU, whether each run had its GPU alone, device seconds."""
    return read_json(Path(root) / "rounds.json")["rounds"]


def round_of(prov: dict, rounds_: list[dict]) -> dict | None:
    """The round whose ``git_commit`` the provenance ``prov`` names (a prefix of the
    full hash matches), or ``None``."""
    commit = str(prov.get("git_commit", ""))
    hits = [r for r in rounds_ if commit and (commit.startswith(r["git_commit"])
                                                or r["git_commit"].startswith(commit))]
    return hits[0] if len(hits) == 1 else None


def _seconds_to(rows: list[dict], target: float) -> float | None:
    return next((r["time_train"] for r in rows if r["test_acc"] >= target), None)


def alone_runs(p: dict, root: str | os.PathLike = FIG3) -> dict[tuple, dict]:
    """The part of :func:`selected_runs` whose run had its GPU alone: its provenance
    names a round of :func:`rounds` with ``alone`` true."""
    root, rs, out = Path(root), rounds(root), {}
    state = grid_state(p, root)
    for (cond, m, s), rec in selected_runs(p, root).items():
        lr = state[f"{cond}/{m}"]["selected"]
        prov = read_json(root / ("grid" if s == 0 else "seeds") / f"lr{lr:g}"
                         / p["dataset"] / cond / m / f"seed{s}" / "provenance.json")
        rd = round_of(prov, rs)
        if rd is not None and rd["alone"]:
            out[(cond, m, s)] = rec
    return out


def seconds_to_accuracy(p: dict, root: str | os.PathLike = FIG3,
                     targets: tuple[float, ...] = (0.80, 0.85)) -> dict[str, dict]:
    """Per ``"<conditioning>/<method>"`` at its selected step, from
    :func:`alone_runs`: ``lr``, ``runs``, ``s_per_epoch`` (median training seconds an
    epoch, the first excluded), ``to`` (``{target: mean training seconds to the first
    epoch at or above that test accuracy, or None when a run never reached it}``) and
    ``epoch_to`` (the same in epochs). Training time only: the per-epoch evaluations
    are not counted."""
    state, out = grid_state(p, root), {}
    for (cond, m, _), rec in sorted(alone_runs(p, root).items()):
        rows = rec["epochs"]
        e = out.setdefault(f"{cond}/{m}", {"lr": state[f"{cond}/{m}"]["selected"],
                                            "runs": 0, "epochs": [],
                                            "to": {t: [] for t in targets},
                                            "epoch_to": {t: [] for t in targets}})
        e["runs"] += 1
        e["epochs"] += [b["time_train"] - a["time_train"]
                        for a, b in zip(rows, rows[1:])]
        for t in targets:
            e["to"][t].append(_seconds_to(rows, t))
            e["epoch_to"][t].append(next((r["epoch"] for r in rows
                                          if r["test_acc"] >= t), None))
    for e in out.values():
        e["s_per_epoch"] = statistics.median(e.pop("epochs"))
        for k in ("to", "epoch_to"):
            e[k] = {t: None if None in v else statistics.fmean(v)
                    for t, v in e[k].items()}
    return out
