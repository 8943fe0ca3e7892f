"""The Fig. 3 protocol's verdicts (book chapter :ref:`cifar-fig3`): the selection
table, the runs at each selected step, the verdict per baseline by the protocol's rule
(:func:`fig3_verdicts`), the runs that had a GPU alone (the clocks of the time figure:
:mod:`studies.fig3.clocks`; the queue left: :func:`studies.fig3.plan.queue_left`), the
ablation's runs and the early-stop rule evaluated after the fact. Plots take these as
arguments (:func:`studies.cifar.figures.fig_accuracy_per_epoch`).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from studies.cifar.methods import LR_GRID
from studies.fig3.protocol import (
    FIG3,
    grid_state,
    record_at,
    round_of,
    rounds,
    run_status,
    stop_reason,
)
from studies.kit.provenance import read_json

__all__ = ["selection_rows", "selected_runs", "seed_summary", "settled",
           "fig3_verdicts", "alone_runs", "ablation_seeds", "ablation_runs",
           "ablation_rows", "posthoc_stops", "captured_epoch_seconds"]


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


def settled(v: dict) -> bool:
    """Whether a :func:`seed_summary` entry is settled: its selection final and every
    seed the protocol wants at that step run."""
    return bool(v["final"]) and v["seeds"] >= v["wanted"]


def fig3_verdicts(p: dict, root: str | os.PathLike = FIG3) -> dict[str, dict]:
    """The protocol's verdict per baseline (its ``verdict_rule``): ``drop`` (well −
    ill mean test accuracy), ``spread`` ((ill range + well range) / 2) for the baseline
    and for KWNG, and ``verdict`` — ``"holds"``, ``"fails"``, ``"within spread"``, or
    ``"pending"`` while either method lacks a final selection or its seeds in a
    conditioning."""
    s = seed_summary(p, root)

    def ready(m: str) -> bool:
        return all(f"{c}/{m}" in s and settled(s[f"{c}/{m}"]) for c in ("ill", "well"))

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


def alone_runs(p: dict, root: str | os.PathLike = FIG3) -> dict[tuple, dict]:
    """The part of :func:`selected_runs` whose run had its GPU alone (its provenance
    names a round of :func:`~studies.fig3.protocol.rounds` with ``alone`` true);
    of a method with a captured run among them, only the captured runs: an eager run
    does not time a step that can be replayed from a CUDA graph."""
    root, rs, out = Path(root), rounds(root), {}
    state = grid_state(p, root)
    for (cond, m, s), rec in selected_runs(p, root).items():
        lr = state[f"{cond}/{m}"]["selected"]
        prov = read_json(root / ("grid" if s == 0 else "seeds") / f"lr{lr:g}"
                         / p["dataset"] / cond / m / f"seed{s}" / "provenance.json")
        rd = round_of(prov, rs)
        if rd is not None and rd["alone"]:
            out[(cond, m, s)] = rec
    captured = {k[:2] for k, r in out.items() if r.get("capture")}
    return {k: r for k, r in out.items() if r.get("capture") or k[:2] not in captured}


def ablation_seeds(p: dict, seeds_root: str | os.PathLike | None
                   ) -> dict[str, list[int]]:
    """``{variant: [seed, ...]}``: the seeds of the protocol's ablation variants that
    the seed study's plan (``seeds_root/plan.json``, its groups and amendments) adds
    at KWNG's step in the ablation conditioning; empty without that plan."""
    plan = Path(seeds_root) / "plan.json" if seeds_root is not None else None
    if plan is None or not plan.is_file():
        return {}
    ab, out = p["ablations"], {}
    doc = read_json(plan)
    for g in [*doc.get("groups", []), *doc.get("amendments", [])]:
        if g["conditioning"] == ab["conditioning"] and g["lr_of"] == ab["lr_of"]:
            for m in g["methods"]:
                if m in ab["runs"]:
                    out.setdefault(m, []).extend(int(s) for s in g["seeds"])
    return {m: sorted(set(v)) for m, v in out.items()}


def _seeds_root(root: Path, seeds_root: str | os.PathLike | None | bool) -> Path | None:
    """The seed study beside ``root`` (``results/cifar/amortized_seeds``) by default;
    ``False`` for none."""
    if seeds_root is False:
        return None
    return root.parent / "amortized_seeds" if seeds_root is None else Path(seeds_root)


def ablation_runs(p: dict, root: str | os.PathLike = FIG3,
                  seeds_root: str | os.PathLike | None | bool = None
                  ) -> dict[tuple, dict]:
    """``{(conditioning, method, seed): record}``: the finished ablation runs (at
    KWNG's selected step in the protocol's ablation conditioning) and, beside them, the
    finished runs of KWNG itself at that step, every seed. The protocol's ablation
    runs (``root/ablation``, its seeds ``0 .. n-1``) are joined by the seeds that the
    seed study adds to a variant (:func:`ablation_seeds`; ``seeds_root`` defaults to
    ``results/cifar/amortized_seeds`` beside ``root``, ``False`` reads the protocol's
    runs alone)."""
    root, ab = Path(root), p["ablations"]
    cond, epochs = ab["conditioning"], int(p["settings"]["epochs"])
    lr = grid_state(p, root).get(f"{cond}/{ab['lr_of']}", {}).get("selected")
    if lr is None:
        return {}
    out = {k: r for k, r in selected_runs(p, root).items()
           if k[:2] == (cond, ab["lr_of"])}
    extra_root = _seeds_root(root, seeds_root)
    extra = ablation_seeds(p, extra_root)
    for m, n in ab["runs"].items():
        places = [(root, "ablation", s) for s in range(int(n))]
        places += [(extra_root, "", s) for s in extra.get(m, []) if s >= int(n)]
        for base, part, s in places:
            rec = record_at(base, part, lr, cond, m, s)  # part "": the study's own tree
            if run_status(rec, epochs) == "finished":
                out[(cond, m, s)] = rec
    return out


def ablation_rows(p: dict, root: str | os.PathLike = FIG3,
                  seeds_root: str | os.PathLike | None | bool = None) -> list[dict]:
    """One row per method of the ablation figure (KWNG first, then the protocol's
    variants): ``method``, ``runs`` (finished) and ``wanted`` (the protocol's runs and
    the seed study's, :func:`ablation_runs`), the mean final ``test`` and ``train``
    accuracy, the ``range`` of the test accuracy over its runs (``None`` while it has
    none) and ``finals`` (each run's final test accuracy, by seed)."""
    root, ab = Path(root), p["ablations"]
    runs, rows = ablation_runs(p, root, seeds_root), []
    extra = ablation_seeds(p, _seeds_root(root, seeds_root))
    wanted = {ab["lr_of"]: int(p["seeds"][ab["conditioning"]]),
              **{m: int(n) + len([s for s in extra.get(m, []) if s >= int(n)])
                 for m, n in ab["runs"].items()}}
    for m, n in wanted.items():
        recs = [r["epochs"][-1] for k, r in sorted(runs.items()) if k[1] == m]
        test = [e["test_acc"] for e in recs]
        rows.append({"method": m, "runs": len(recs), "wanted": n,
                     "test": statistics.fmean(test) if recs else None,
                     "train": statistics.fmean(e["train_acc"] for e in recs)
                     if recs else None,
                     "range": max(test) - min(test) if recs else None,
                     "finals": test})
    return rows


def captured_epoch_seconds(p: dict, cond: str, method: str,
                           root: str | os.PathLike = FIG3) -> float | None:
    """The median training seconds of an epoch (the first excluded) over the finished
    grid runs of ``method`` in ``cond`` whose step was replayed from a CUDA graph, or
    ``None`` when it has none."""
    root, epochs = Path(root), int(p["settings"]["epochs"])
    st = grid_state(p, root)[f"{cond}/{method}"]
    recs = [record_at(root, "grid", lr, cond, method, 0) for lr in st["runs"]]
    spe = [b["time_train"] - a["time_train"] for r in recs
           if run_status(r, epochs) == "finished" and r.get("capture")
           for a, b in zip(r["epochs"], r["epochs"][1:])]
    return statistics.median(spe) if spe else None


def posthoc_stops(p: dict, root: str | os.PathLike = FIG3,
                  num_classes: int = 10) -> dict[str, dict]:
    """The early-stop rule evaluated over the finished grid records, every sibling's
    rows known: per grid run ``"<conditioning>/<method>/lr<lr>"``, ``live`` (the stop
    its record names, or ``None``) and ``posthoc`` (:func:`stop_reason` at the first
    epoch the rule condemns it, comparing every sibling's row of that epoch, or
    ``None``)."""
    root, out = Path(root), {}
    for key in grid_state(p, root):
        cond, m = key.split("/")
        recs = {lr: record_at(root, "grid", lr, cond, m, 0) for lr in LR_GRID}
        recs = {lr: r for lr, r in recs.items() if r and r.get("epochs")}
        for lr, rec in recs.items():
            sibs = {f"lr{o:g}": r["epochs"] for o, r in recs.items() if o != lr}
            hit = next((s for row in rec["epochs"]
                        if (s := stop_reason(row, sibs, num_classes)) is not None),
                       None)
            out[f"{cond}/{m}/lr{lr:g}"] = {"live": rec.get("early_stop"),
                                           "posthoc": hit}
    return out
