"""The Fig. 3 audit's runs beyond the protocol (plan ``fig3_audit`` of
:func:`studies.cifar.plans.build_plan`, records under
``results/cifar/fig3_audit``): the grid's edge (step sizes above the paper's grid for
the methods the selection put at its top) and reruns of committed runs at the current
code. The plan is the committed file ``plan.json`` of that folder; every run has the
protocol's settings (``results/cifar/fig3/protocol.json``), so its record is checked as
a Fig. 3 record is; none of them enters the Fig. 3 selection or verdicts.

Layout: ``grid/lr<lr>/...`` for the edge runs (the early-stop rule on, as in the
protocol's grid) and ``repro/lr<lr>/...`` for the reruns (the rule off, as for the
protocol's seeds and ablations). A live early stop compares an edge run only with the
other edge steps (the siblings under the same folder); :func:`edge_runs` evaluates the
rule again with the protocol's own grid runs of the method as siblings as well."""

from __future__ import annotations

import json
import os
from pathlib import Path

from studies.cifar.hooks import register_check
from studies.cifar.methods import LR_GRID, METHODS, RESULTS
from studies.fig3.groups import check_group, record_verdict
from studies.fig3.protocol import (
    FIG3,
    grid_state,
    load_protocol,
    run_status,
    stop_reason,
)
from studies.fig3.verdicts import ablation_runs, selected_runs
from studies.kit.provenance import read_json
from studies.kit.wording import name_list, pct

__all__ = ["FIG3_AUDIT", "audit_groups", "check_audit", "audit_check", "edge_runs",
           "repro_runs", "edge_groups", "edge_table", "edge_phrase", "edge_short",
           "repro_pending",
           "repro_table", "repro_phrase"]

#: the audit's plan and records, ``results/cifar/fig3_audit`` of the checkout
#:
#: :meta hide-value:
FIG3_AUDIT = RESULTS / "fig3_audit"

#: for each part of the audit (its folder name), whether the early-stop rule is on
PARTS = {"grid": True, "repro": False}


def audit_groups(spec: dict) -> list[dict]:
    """The groups of the audit's plan ``spec`` (``plan.json``), each checked:
    ``part`` one of :data:`PARTS`, ``conditioning`` ill or well, ``methods`` known
    names, ``seeds`` distinct integers >= 0, and either ``lrs`` (positive step sizes
    outside the paper's grid, for ``grid``) or ``lr_of`` (the Fig. 3 method whose
    selected step the group reruns, for ``repro``)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("groups"), list):
        raise ValueError("the audit's plan must be a dict with a list 'groups', got "
                         f"{spec!r:.200}")
    for g in spec["groups"]:
        if not isinstance(g, dict) or g.get("part") not in PARTS:
            raise ValueError(f"each group needs part in {sorted(PARTS)}, "
                             f"got {g!r:.200}")
        check_group(g)
        if g["part"] == "grid":
            lrs = g.get("lrs")
            if (not isinstance(lrs, list) or not lrs or any(
                    isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0
                    or float(v) in LR_GRID for v in lrs)):
                raise ValueError("a grid group's lrs must be positive step sizes "
                                 f"outside the paper's grid {list(LR_GRID)}, "
                                 f"got {lrs!r}")
        elif g.get("lr_of") not in METHODS:
            raise ValueError(f"a repro group's lr_of must be a method name, got "
                             f"{g.get('lr_of')!r}")
    return spec["groups"]


def _records(root: Path, part: str, dataset: str):
    for mp in sorted((root / part).glob(f"lr*/{dataset}/*/*/seed*/metrics.json")):
        yield mp, float(mp.parts[-6][2:]), mp.parts[-4], mp.parts[-3], \
            int(mp.parts[-2][4:])


def check_audit(root: str | os.PathLike = FIG3_AUDIT,
                p: dict | None = None) -> dict[str, list]:
    """Every record under ``root`` against the protocol's settings
    (:func:`studies.fig3.protocol.record_problem`, the grid part with the
    early-stop rule) and the plan (a part, step, conditioning, method and seed it
    lists): ``{"ok", "stopped", "incomplete", "bad": [(run, problem)]}``."""
    p = load_protocol() if p is None else p
    root, epochs = Path(root), int(p["settings"]["epochs"])
    groups = audit_groups(read_json(root / "plan.json"))
    res: dict[str, list] = {"ok": [], "stopped": [], "incomplete": [], "bad": []}
    for part in PARTS:
        planned = {(g["conditioning"], m, s) for g in groups if g["part"] == part
                   for m in g["methods"] for s in g["seeds"]}
        for mp, lr, cond, m, seed in _records(root, part, p["dataset"]):
            name = f"{part}/lr{lr:g}/{cond}/{m}/seed{seed}"
            problem, status = record_verdict(p, mp, part, (cond, m, seed), planned,
                                             epochs)
            if problem:
                res["bad"].append((name, problem))
                continue
            res[{"finished": "ok", "stopped": "stopped"}.get(status,
                                                             "incomplete")].append(name)
    return res


def audit_check(root: str | None) -> int:
    """``cifar check --suite fig3_audit``: :func:`check_audit`, printed; exit 1 if a
    record is bad or unfinished."""
    res = check_audit(root or FIG3_AUDIT)
    for name, problem in res["bad"]:
        print("bad:", name, "-", problem)
    print(json.dumps({k: len(v) for k, v in res.items()}),
          "incomplete:", json.dumps(res["incomplete"]))
    return 1 if res["bad"] or res["incomplete"] else 0


def edge_runs(p: dict | None = None, root: str | os.PathLike = FIG3_AUDIT,
              fig3_root: str | os.PathLike = FIG3, num_classes: int = 10) -> list[dict]:
    """The grid-edge runs, one dict each: ``cond``, ``method``, ``lr``, ``epochs``
    run, ``diverged`` (a non-finite loss or a failed step ended it),
    ``failed_epoch`` (the epoch of a failed step, not among those run), ``final`` (test
    accuracy at the last epoch run), ``best_val`` (the best
    validation accuracy, what the selection reads), ``live`` (the stop the record
    names, or ``None``), ``posthoc`` (:func:`~studies.fig3.protocol.stop_reason`
    at the first epoch the rule condemns it with every step of the method as a
    sibling: the protocol's grid runs (seed 0) and the other edge steps), and the
    protocol's ``selected`` step with its ``selected_val`` (best validation
    accuracy of the selected grid run)."""
    p = load_protocol() if p is None else p
    root, fig3_root = Path(root), Path(fig3_root)
    state, recs = grid_state(p, fig3_root), {}
    for mp, lr, cond, m, seed in _records(root, "grid", p["dataset"]):
        if seed == 0:
            recs.setdefault((cond, m), {})[("edge", lr)] = read_json(mp)
    out = []
    for (cond, m), edge in sorted(recs.items()):
        sibs = {f"lr{lr:g}": r["epochs"] for lr in LR_GRID
                if (r := _grid_record(fig3_root, lr, cond, m, p["dataset"]))}
        sibs.update({f"lr{lr:g}": r["epochs"] for (_, lr), r in edge.items()})
        st = state.get(f"{cond}/{m}") or {}
        sel = st.get("selected")
        sel_rec = _grid_record(fig3_root, sel, cond, m, p["dataset"]) if sel else None
        for (_, lr), rec in sorted(edge.items()):
            rows = rec["epochs"]
            own = {k: v for k, v in sibs.items() if k != f"lr{lr:g}"}
            hit = next((s for row in rows
                        if (s := stop_reason(row, own, num_classes)) is not None), None)
            out.append({"cond": cond, "method": m, "lr": lr, "epochs": len(rows),
                        "diverged": bool(rec.get("diverged")),
                        "failed_epoch": (rec.get("failure") or {}).get("epoch"),
                        "final": float(rows[-1]["test_acc"]),
                        "best_val": max(float(r["val_acc"]) for r in rows),
                        "live": rec.get("early_stop"), "posthoc": hit,
                        "selected": sel,
                        "selected_val": (max(float(r["val_acc"]) for r in
                                             sel_rec["epochs"]) if sel_rec else None)})
    return out


def _grid_record(root: Path, lr: float, cond: str, m: str, dataset: str) -> dict | None:
    mp = (root / "grid" / f"lr{lr:g}" / dataset / cond / m / "seed0" / "metrics.json")
    if not mp.is_file():
        return None
    rec = read_json(mp)
    return rec if rec.get("epochs") else None


def repro_runs(p: dict | None = None, root: str | os.PathLike = FIG3_AUDIT,
               fig3_root: str | os.PathLike = FIG3,
               seeds_root: str | os.PathLike | None = RESULTS / "amortized_seeds"
               ) -> list[dict]:
    """The reruns at the current code, one dict each: ``cond``, ``method``, ``lr``,
    ``seed``, ``final`` (test accuracy), ``complete``, ``committed`` (the committed
    record of the same run, seed and step: its final test accuracy, or ``None``) and
    ``spread`` (the final test accuracies of every committed finished run of the
    method at that step and conditioning: the protocol's seed runs or ablation runs,
    and the seed study's runs of it under ``seeds_root``), ``within`` (the rerun's final
    inside [min, max] of ``spread``; ``None`` with fewer than two)."""
    p = load_protocol() if p is None else p
    root, fig3_root = Path(root), Path(fig3_root)
    epochs, out = int(p["settings"]["epochs"]), []
    # the committed runs: the protocol's at their selected steps, and the ablations'
    # (the protocol's and the seed study's seeds of them, verdicts.ablation_runs)
    known = {**selected_runs(p, fig3_root),
             **ablation_runs(p, fig3_root, False if seeds_root is None else seeds_root)}
    for mp, lr, cond, m, seed in _records(root, "repro", p["dataset"]):
        rec = read_json(mp)
        committed = {s: float(r["epochs"][-1]["test_acc"])
                     for (c, mm, s), r in known.items()
                     if (c, mm) == (cond, m) and float(r["lr"]) == lr}
        final = float(rec["epochs"][-1]["test_acc"])
        spread = sorted(committed.values())
        out.append({"cond": cond, "method": m, "lr": lr, "seed": seed, "final": final,
                    "complete": run_status(rec, epochs) == "finished",
                    "committed": committed.get(seed), "spread": spread,
                    "within": (spread[0] <= final <= spread[-1]) if len(spread) >= 2
                    else None})
    return out


def _label(m: str) -> str:
    return METHODS[m].label if m in METHODS else m


def _ran(r: dict) -> bool:
    """Whether an edge run trained to its end (neither stopped nor diverged)."""
    return not r["live"] and not r["diverged"]


def edge_groups(rows: list[dict]) -> dict[tuple[str, str], tuple[list[dict], bool]]:
    """The edge runs of :func:`edge_runs` by ``(conditioning, method)``, sorted by
    step, each with whether one of them beat the method's selected step on the
    validation accuracy the selection reads."""
    by: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by.setdefault((r["cond"], r["method"]), []).append(r)
    return {k: (sorted(rs, key=lambda r: r["lr"]),
                any(r["selected_val"] is not None and r["best_val"] > r["selected_val"]
                    for r in rs))
            for k, rs in sorted(by.items())}


def _ended(r: dict) -> str:
    """How an edge run ended, in a few words."""
    if r["live"]:
        return f"stopped live, {r['live']['reason']}, after epoch {r['live']['epoch']}"
    if r["diverged"]:
        return f"diverged in epoch {r.get('failed_epoch') or r['epochs']}"
    return f"ran {r['epochs']} epochs"


def edge_table(rows: list[dict]) -> tuple[tuple[str, ...], list[tuple]]:
    """``(header, rows)`` of the grid-edge table: each edge run beside its method's
    selected step, with how it ended and the post-hoc verdict of the early-stop rule."""
    header = ("cond.", "method", "step", "ended", "best val. (%)", "final test (%)",
              "post hoc", "selected step: best val. (%)")
    table = [(r["cond"], _label(r["method"]), f"{r['lr']:g}", _ended(r),
              pct(r["best_val"]),
              pct(r["final"]),
              f"{r['posthoc']['reason']} @ {r['posthoc']['epoch']}" if r["posthoc"]
              else "–",
              f"{r['selected']:g}: {pct(r['selected_val'])}" if r["selected"] else "–")
             for r in rows]
    return header, table


def edge_phrase(rows: list[dict]) -> str:
    """What the edge runs say about the selection: for each method, its best edge
    step against its selected step (validation accuracy, what the selection reads),
    and whether an edge step would have been selected instead."""
    if not rows:
        return "no grid-edge run has a record yet"
    parts, better = [], []
    for (cond, m), (rs, beat) in edge_groups(rows).items():
        each = " and ".join(f"{pct(r['best_val'])} % at step {r['lr']:g}"
                            + ("" if _ran(r) else f" ({_ended(r)})") for r in rs)
        parts.append(f"{_label(m)} ({cond}) reaches a best validation accuracy of "
                     f"{each}, against {pct(rs[0]['selected_val'])} % at its selected "
                     f"step {rs[0]['selected']:g}")
        if beat:
            better.append(_label(m))
    top = max(r["lr"] for r in rows)
    verdict = ("an edge step beats the selected step of " + name_list(better)
               + ": the selection there is a lower bound and the verdict must be read "
               "with it" if better else
               "no edge step does better than its method's selected step, so the "
               "selections, and the verdicts built on them, stand: on the grid "
               f"extended to step {top:g}, each method's selected step is still its "
               "best, not a lower bound")
    return "; ".join(parts) + "; " + verdict


def edge_short(rows: list[dict]) -> str:
    """:func:`edge_phrase` for a table cell: per method, each edge step's best
    validation accuracy (or how it ended) against the selected step's, and whether
    the selections stand."""
    if not rows:
        return "not run yet"
    groups = edge_groups(rows)
    parts = []
    for (cond, m), (rs, _) in groups.items():
        each = ", ".join(
            f"step {r['lr']:g} " + (pct(r["best_val"]) + " %" if _ran(r)
                                    else "at chance" if r["live"] else "diverged")
            for r in rs)
        parts.append(f"{_label(m)} ({cond}) {each} against step "
                     f"{rs[0]['selected']:g} {pct(rs[0]['selected_val'])} %")
    better = any(beat for _, beat in groups.values())
    return ("; ".join(parts) + " (best validation accuracy): "
            + ("an edge step does better, the selection is a lower bound" if better
               else "the selections stand"))


def repro_pending(root: str | os.PathLike = FIG3_AUDIT,
                  dataset: str = "cifar10") -> list[str]:
    """The reruns the audit's plan lists that have no record yet
    (``cond/method/seed``)."""
    root = Path(root)
    groups = audit_groups(read_json(root / "plan.json"))
    done = {(c, m, s) for _, _, c, m, s in _records(root, "repro", dataset)}
    return [f"{g['conditioning']}/{m}/seed{s}" for g in groups if g["part"] == "repro"
            for m in g["methods"] for s in g["seeds"]
            if (g["conditioning"], m, s) not in done]


def repro_table(rows: list[dict]) -> tuple[tuple[str, ...], list[tuple]]:
    """``(header, rows)`` of the reruns: the rerun's final test accuracy beside the
    committed run of the same seed and the committed spread."""
    header = ("cond.", "method", "step", "seed", "rerun (%)", "committed (%)",
              "committed runs (%)", "inside")
    table = [(r["cond"], _label(r["method"]), f"{r['lr']:g}", str(r["seed"]),
              pct(r["final"]),
              pct(r["committed"]), ", ".join(pct(v) for v in r["spread"]) or "–",
              {True: "yes", False: "no", None: "–"}[r["within"]]) for r in rows]
    return header, table


def repro_phrase(rows: list[dict], pending: list[str]) -> str:
    """The reruns in one sentence: each inside or outside the committed spread, and
    the reruns of the plan still to run."""
    said = []
    for r in rows:
        name = _label(r["method"])
        where = {True: "inside", False: "outside", None: "beside"}[r["within"]]
        if r["within"] is False:
            d = r["final"] - (r["spread"][-1] if r["final"] > r["spread"][-1]
                              else r["spread"][0])
            where = f"{pct(abs(d), 2)} points {'above' if d > 0 else 'below'}"
        said.append(f"{name} (step {r['lr']:g}, seed {r['seed']}) ends at "
                    f"{pct(r['final'], 2)} %, {where} the committed runs' "
                    f"{pct(r['spread'][0], 2) if r['spread'] else '–'}–"
                    f"{pct(r['spread'][-1], 2) if r['spread'] else '–'} %"
                    + (f" (its own seed's committed run: {pct(r['committed'], 2)} %)"
                       if r["committed"] is not None else ""))
    text = "; ".join(said) if said else "no rerun has a record yet"
    if pending:
        text += (f"; not yet run: {name_list(pending)}")
    return text


register_check("fig3_audit", lambda a: audit_check(a.root))
