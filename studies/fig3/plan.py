"""The Fig. 3 protocol's queues: ``fig3`` (the runs of the protocol still to make,
:func:`fig3_plan`) and ``fig3_audit`` (the audit's runs beyond the protocol,
:func:`audit_plan`), with the count of what is left (:func:`queue_left`)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from studies.cifar.hooks import register_check, register_plan
from studies.cifar.runtime import estimate_seconds, run_seconds
from studies.fig3.audit import FIG3_AUDIT, audit_groups
from studies.fig3.protocol import (
    FIG3,
    check_fig3,
    grid_state,
    load_protocol,
    protocol_commit,
    record_at,
    run_status,
)
from studies.kit.provenance import read_json
from studies.kit.wording import name_list

__all__ = ["fig3_job", "fig3_plan", "queue_left", "queue_phrase", "audit_plan",
           "fig3_check"]


def fig3_job(p: dict, part: str, cond: str, method: str, lr: float, seed: int,
         root: Path, commit: str, times: dict[str, float], **extra) -> dict:
    est = estimate_seconds(times, method)
    return {**p["settings"], "dataset": p["dataset"], "conditioning": cond,
            "method": method, "lr": lr, "seed": seed, "protocol": commit,
            "out": str(root / part / f"lr{lr:g}"), **extra,
            **({"est_s": round(est)} if est is not None else {})}


def fig3_plan(common: dict, p: dict | None = None, root: str | os.PathLike = FIG3,
              commit: str | None = None) -> list[dict]:
    """The runs of the protocol still to make, in its order: grid runs (early stop on),
    then the other seeds of every final selection, then the ablations once KWNG's
    ill-conditioned step is final. ``common`` adds settings (``data_root``)."""
    p = load_protocol() if p is None else p
    root, commit = Path(root), commit or protocol_commit()
    state, epochs, jobs = grid_state(p, root), int(p["settings"]["epochs"]), []
    times = run_seconds(root)
    rank = {m: i for i, m in enumerate(p["order"])}
    keys = sorted(state, key=lambda k: (rank[k.split("/")[1]],
                                        k.split("/")[0] != "ill"))
    for k in keys:
        cond, m = k.split("/")
        jobs += [fig3_job(p, "grid", cond, m, lr, 0, root, commit, times,
                      early_stop=p["early_stop_rule"], **common)
                 for lr in state[k]["next"]]
    for k in keys:
        cond, m = k.split("/")
        lr = state[k]["selected"]
        if state[k]["final"]:
            jobs += [fig3_job(p, "seeds", cond, m, lr, s, root, commit, times,
                          early_stop=None, **common)
                     for s in range(1, int(p["seeds"][cond]))
                     if run_status(record_at(root, "seeds", lr, cond, m, s), epochs)
                     in ("missing", "running")]
    kw = state.get(f"{p['ablations']['conditioning']}/{p['ablations']['lr_of']}")
    if kw and kw["final"]:
        cond, lr = p["ablations"]["conditioning"], kw["selected"]
        for m, n in p["ablations"]["runs"].items():
            jobs += [fig3_job(p, "ablation", cond, m, lr, s, root, commit, times,
                          early_stop=None, **common)
                     for s in range(int(n))
                     if run_status(record_at(root, "ablation", lr, cond, m, s), epochs)
                     in ("missing", "running")]
    return jobs


def queue_left(p: dict, root: str | os.PathLike = FIG3,
               methods: Sequence[str] | None = None) -> dict[str, int]:
    """Runs the protocol still needs, by part (grid, seeds, ablation), of ``methods``
    (default: all); grid values added by the extension rule and seeds of selections not
    yet final are counted once they are known."""
    jobs = fig3_plan({}, p, root, commit="(count only)")
    out = {"grid": 0, "seeds": 0, "ablation": 0}
    for j in jobs:
        if methods is None or j["method"] in methods:
            out[Path(j["out"]).parent.name] += 1
    return out


def queue_phrase(left: dict[str, int]) -> str:
    """The runs :func:`queue_left` counts, as a sentence: "Every run the protocol asks
    for is in." when none is left, else "Still to run: 2 grid runs and 1 seed run."."""
    parts = {"grid": "grid", "seeds": "seed", "ablation": "ablation"}
    if not isinstance(left, dict) or set(left) != set(parts) or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 0
            for n in left.values()):
        raise ValueError("left must map 'grid', 'seeds' and 'ablation' to counts >= 0 "
                         f"(queue_left's result), got {left!r}")
    words = [f"{left[k]} {w} run{'s' * (left[k] != 1)}" for k, w in parts.items()
             if left[k]]
    if not words:
        return "Every run the protocol asks for is in."
    return f"Still to run: {name_list(words)}."


def audit_plan(common: dict, p: dict | None = None, root: str | os.PathLike = FIG3,
               out: str | os.PathLike = FIG3_AUDIT, spec: dict | None = None
               ) -> list[dict]:
    """The Fig. 3 audit's runs not finished yet, in its plan's order
    (:mod:`studies.fig3.audit`; ``spec`` default ``out/plan.json``).

    A ``grid`` group runs at each of its ``lrs`` with the protocol's early-stop rule; a
    ``repro`` group runs without it, at the Fig. 3 step of its ``lr_of`` method (left
    out while that selection is not final). A method's time estimate is its fastest
    Fig. 3 run."""
    p, out = load_protocol() if p is None else p, Path(out)
    spec = read_json(out / "plan.json") if spec is None else spec
    state, epochs = grid_state(p, root), int(p["settings"]["epochs"])
    times, commit, jobs = run_seconds(root), protocol_commit(), []
    for g in audit_groups(spec):
        cond, part = g["conditioning"], g["part"]
        if part == "grid":
            lrs, rule = [float(v) for v in g["lrs"]], p["early_stop_rule"]
        else:
            st = state.get(f"{cond}/{g['lr_of']}")
            lrs, rule = ([st["selected"]] if st and st["final"] else []), None
        jobs += [fig3_job(p, part, cond, m, lr, s, out, commit, times, early_stop=rule,
                      **common)
                 for lr in lrs for s in g["seeds"] for m in g["methods"]
                 if run_status(record_at(out, part, lr, cond, m, s), epochs)
                 in ("missing", "running")]
    return jobs


def fig3_check(root: str | None, p: dict | None = None,
               home: str | os.PathLike = FIG3) -> int:
    """``cifar check --suite fig3``: every record of the Fig. 3 protocol (or of ``p``,
    whose records live under ``home``: the ViT study's) against the protocol
    (:func:`check_fig3`), then the selection so far and the queue left. Exit 1 if a
    record is bad or unfinished."""
    p = load_protocol() if p is None else p
    root = root or home
    res = check_fig3(root, p)
    for name, problem in res["bad"]:
        print("bad:", name, "-", problem)
    for name, note in res["differs"]:
        print("ran otherwise than its identity says:", name, "-", note)
    print(json.dumps({k: len(v) for k, v in res.items()}),
          "incomplete:", json.dumps(res["incomplete"]))
    for key, st in grid_state(p, root).items():
        runs = " ".join(f"{lr:g}:{s}" for lr, s in sorted(st["runs"].items()))
        print(f"{key:22s} selected {st['selected']} final {st['final']} "
              f"next {st['next']}  [{runs}]")
    return 1 if res["bad"] or res["incomplete"] else 0


register_plan("fig3", lambda common, **_: fig3_plan(common))
register_check("fig3", lambda a: fig3_check(a.root))
register_plan("fig3_audit", lambda common, **_: audit_plan(common))
