"""The Fig. 3 protocol (book chapter :ref:`cifar-fig3`): the paper's CIFAR-10 comparison
redone by its own rule, every method at its best step of the paper's grid, at the
authors' horizon, in both conditionings, with seeds.

The protocol is a committed file (:data:`PROTOCOL_FILE`), written before its first run;
this module reads it and derives everything else from it and from the records on disk:

* :func:`grid_state` — per (conditioning, method), the grid runs made so far, which
  finished, which the early-stop rule stopped
  (:mod:`~kwng.experiments.cifar.early_stop`), the step selected so far and the steps
  still to run (the first window, and the next grid value whenever the best step sits
  at an inner edge of what was run);
* :func:`fig3_plan` — the queue: the grid runs still to make, then the seeds of every
  final selection, then the ablations at KWNG's selected ill-conditioned step;
* :func:`check_fig3` — every record against the protocol, with its provenance.
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

from kwng.experiments.cifar.early_stop import RULE
from kwng.experiments.cifar.methods import (
    AMORTIZED_METHODS,
    AUTHORS100,
    LR_GRID,
    METHODS,
    RESULTS,
    milestones_for,
)
from kwng.experiments.cifar.records import provenance_problem, read_record, rows_problem
from kwng.experiments.provenance import ResultFileError, read_json

__all__ = ["FIG3", "AMORTIZED", "PROTOCOL_FILE", "load_protocol", "window_for",
           "protocol_commit", "run_status", "record_at", "grid_state", "fig3_plan",
           "amortized_plan", "record_problem", "check_fig3"]

#: the study's records, ``results/cifar/fig3`` of the checkout
#:
#: :meta hide-value:
FIG3 = RESULTS / "fig3"
#: the protocol, committed before the first run of the study
#:
#: :meta hide-value:
PROTOCOL_FILE = FIG3 / "protocol.json"
_PARTS = ("grid", "seeds", "ablation")


def load_protocol(path: str | os.PathLike = PROTOCOL_FILE) -> dict:
    """The protocol file, checked: its grid is the paper's, its early-stop constants
    are those of :mod:`~kwng.experiments.cifar.early_stop`, its methods are known."""
    p = read_json(path)
    if not isinstance(p, dict) or "settings" not in p:
        raise ResultFileError(f"{path}: not a protocol file (no 'settings')")
    if [float(v) for v in p["grid"]] != list(LR_GRID):
        raise ResultFileError(f"{path}: grid {p['grid']} is not {list(LR_GRID)}")
    if p["early_stop"] != RULE:
        raise ResultFileError(f"{path}: early_stop {p['early_stop']} differs from "
                              f"the code's rule {RULE}")
    names = [m for ms in p["methods"].values() for m in ms]
    names += list(p["ablations"]["runs"])
    unknown = sorted(set(names) - set(METHODS))
    if unknown:
        raise ResultFileError(f"{path}: unknown methods {unknown}")
    return p


def window_for(short_lr: float, grid: tuple[float, ...] = LR_GRID) -> list[float]:
    """The first three grid steps tried for a method whose short selection chose
    ``short_lr``: centred on ``10 · short_lr`` with its two grid neighbours (the two
    nearest inner values at an end of the grid), largest first."""
    g = sorted(grid, reverse=True)
    target = 10 * short_lr
    i = min(range(len(g)), key=lambda j: abs(math.log10(g[j]) - math.log10(target)))
    i = min(max(i, 1), len(g) - 2)
    return g[i - 1:i + 2]


def protocol_commit(path: str | os.PathLike = PROTOCOL_FILE) -> str:
    """The commit that last changed the protocol file: ``KWNG_PROTOCOL_COMMIT`` (a
    copied tree without ``.git``), else ``git log``. Raises if neither tells."""
    env = os.environ.get("KWNG_PROTOCOL_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%H", "--", str(path)],
                             capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        raise RuntimeError(f"the commit of {path} is unknown ({exc}); set "
                           "KWNG_PROTOCOL_COMMIT") from exc
    if not out:
        raise RuntimeError(f"{path} is not committed: commit the protocol before its "
                           "first run")
    return out


def _methods(p: dict, cond: str) -> list[str]:
    return list(p["methods"]["both"]) + list(p["methods"].get(f"{cond}_only", []))


def run_status(rec: dict | None, epochs: int) -> str:
    """``"missing"``, ``"running"`` (epochs still to come), ``"stopped"`` (the
    early-stop rule, or a non-finite loss), or ``"finished"`` (every epoch)."""
    if not isinstance(rec, dict) or not rec.get("epochs"):
        return "missing"
    if rec.get("early_stop") or rec.get("diverged"):
        return "stopped"
    if rec.get("complete") and len(rec["epochs"]) == epochs:
        return "finished"
    return "running"


def record_at(root: Path, part: str, lr: float, cond: str, method: str, seed: int,
              dataset: str = "cifar10") -> dict | None:
    """The record of one run of the study (``part``: grid, seeds or ablation), or
    ``None`` when it has none."""
    mp = (root / part / f"lr{lr:g}" / dataset / cond / method / f"seed{seed}"
          / "metrics.json")
    return read_json(mp) if mp.is_file() else None


def _final_val(rec: dict) -> float:
    return float(rec["epochs"][-1]["val_acc"])


def grid_state(p: dict, root: str | os.PathLike = FIG3) -> dict[str, dict]:
    """Per ``"<conditioning>/<method>"``: ``runs`` (``{lr: status}``), ``val_acc``
    (final validation accuracy of the finished runs), ``selected`` (the best finished
    step so far, ties to the lower final training loss), ``next`` (grid steps still to
    run) and ``final`` (every needed run finished and the best step is not at an inner
    edge of what was run)."""
    root, epochs, out = Path(root), int(p["settings"]["epochs"]), {}
    g = sorted(LR_GRID, reverse=True)
    for cond in p["conditionings"]:
        for m in _methods(p, cond):
            tried = sorted(set(p["windows"][f"{cond}/{m}"]), reverse=True)
            while True:
                recs = {lr: record_at(root, "grid", lr, cond, m, 0) for lr in tried}
                status = {lr: run_status(r, epochs) for lr, r in recs.items()}
                done = {lr: r for lr, r in recs.items() if status[lr] == "finished"}
                best = (max(done, key=lambda lr: (_final_val(done[lr]),
                                                  -done[lr]["epochs"][-1]["train_loss"]))
                        if done else None)
                settled = all(s in ("finished", "stopped") for s in status.values())
                grow = []
                if settled and best is None:
                    grow = [v for v in g if v not in tried]
                elif settled and best in (tried[0], tried[-1]):
                    i = g.index(best) + (-1 if best == tried[0] else 1)
                    grow = [g[i]] if 0 <= i < len(g) and g[i] not in tried else []
                if not grow:
                    break
                tried = sorted(set(tried) | set(grow), reverse=True)
            nxt = [lr for lr in tried if status[lr] in ("missing", "running")]
            out[f"{cond}/{m}"] = {
                "runs": status, "selected": best, "next": nxt,
                "val_acc": {lr: _final_val(r) for lr, r in done.items()},
                "final": settled and best is not None}
    return out


#: seconds a worker needs beside training and evaluation (start, data, capture)
START_S = 60.0
#: factor on the fastest finished run of a method, for a run on a GPU of its own
RUN_MARGIN = 1.15


def _wall_times(root: Path) -> dict[str, float]:
    times: dict[str, float] = {}
    for mp in root.glob("**/seed*/metrics.json"):
        rec = read_json(mp)
        rows = rec.get("epochs") if isinstance(rec, dict) else None
        if rows and rec.get("complete") and not rec.get("early_stop") \
                and len(rows) == 100 and "time_train" in rows[-1]:
            t = rows[-1]["time_train"] + sum(r.get("time_eval", 0.0) for r in rows)
            m = rec["config"]["method"]
            times[m] = min(times.get(m, math.inf), t)
    return times


def run_seconds(root: str | os.PathLike = FIG3,
                fallback: str | os.PathLike | None = AUTHORS100) -> dict[str, float]:
    """Per method, the wall time (training and evaluation) of its fastest finished
    100-epoch run under ``root`` or ``fallback`` (the authors100 study), times
    :data:`RUN_MARGIN`, plus :data:`START_S`: the estimate that keeps a queue from
    starting a run it cannot finish. The queue runs one run per GPU, and the fastest
    record is the one that shared its GPU least. A method without any finished run gets
    the estimate of the longest method, twice that for KFAC/EKFAC (eager steps)."""
    times = _wall_times(Path(root))
    for m, t in (_wall_times(Path(fallback)) if fallback is not None else {}).items():
        times[m] = min(t, times.get(m, math.inf))
    return {m: t * RUN_MARGIN + START_S for m, t in times.items()}


def _estimate(times: dict[str, float], method: str) -> float | None:
    """A method's own estimate; a KWNG variant (the same Jacobian block, another
    damping, kernel or momentum) at most KWNG's; else the longest method's, twice
    that for KFAC/EKFAC."""
    precond = METHODS[method].spec.get("precond")
    own = [times[k] for k in (method, "kwng" if precond == "kwng" else None)
           if k in times]
    if own:
        return min(own)
    if not times:
        return None
    return max(times.values()) * (2.0 if precond in ("kfac", "ekfac") else 1.0)


def _job(p: dict, part: str, cond: str, method: str, lr: float, seed: int,
         root: Path, commit: str, times: dict[str, float], **extra) -> dict:
    est = _estimate(times, method)
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
        jobs += [_job(p, "grid", cond, m, lr, 0, root, commit, times,
                      early_stop=p["early_stop_rule"], **common)
                 for lr in state[k]["next"]]
    for k in keys:
        cond, m = k.split("/")
        lr = state[k]["selected"]
        if state[k]["final"]:
            jobs += [_job(p, "seeds", cond, m, lr, s, root, commit, times,
                          early_stop=None, **common)
                     for s in range(1, int(p["seeds"][cond]))
                     if run_status(record_at(root, "seeds", lr, cond, m, s), epochs)
                     in ("missing", "running")]
    kw = state.get(f"{p['ablations']['conditioning']}/{p['ablations']['lr_of']}")
    if kw and kw["final"]:
        cond, lr = p["ablations"]["conditioning"], kw["selected"]
        for m, n in p["ablations"]["runs"].items():
            jobs += [_job(p, "ablation", cond, m, lr, s, root, commit, times,
                          early_stop=None, **common)
                     for s in range(int(n))
                     if run_status(record_at(root, "ablation", lr, cond, m, s), epochs)
                     in ("missing", "running")]
    return jobs


#: the amortized-step study's records, ``results/cifar/amortized`` of the checkout
#:
#: :meta hide-value:
AMORTIZED = RESULTS / "amortized"


def amortized_plan(common: dict, p: dict | None = None, root: str | os.PathLike = FIG3,
                   out: str | os.PathLike = AMORTIZED) -> list[dict]:
    """The amortized-step study
    (:data:`~kwng.experiments.cifar.methods.AMORTIZED_METHODS`, seed 0) in each
    conditioning where KWNG's Fig. 3 selection is final, at that step
    and with the protocol's settings, under ``out``: the runs not finished yet."""
    p = load_protocol() if p is None else p
    state, epochs = grid_state(p, root), int(p["settings"]["epochs"])
    times, commit, jobs = run_seconds(root), protocol_commit(), []
    for cond in ("ill", "well"):
        st = state.get(f"{cond}/kwng")
        if not (st and st["final"]):
            continue
        jobs += [_job(p, "", cond, m, st["selected"], 0, Path(out), commit, times,
                      early_stop=None, **common)
                 for m in AMORTIZED_METHODS
                 if run_status(record_at(Path(out), "", st["selected"], cond, m, 0),
                               epochs) in ("missing", "running")]
    return jobs


def record_problem(p: dict, mp: Path, part: str) -> str | None:
    """Why the record ``mp`` (under ``<part>/lr<lr>/``) breaks the protocol, or
    ``None``."""
    rec = read_record(mp)
    c = rec["config"]
    if not rec["epochs"]:
        return "no epoch recorded"
    problem = provenance_problem(rec, mp.with_name("provenance.json"))
    if problem:
        return problem
    prov = read_json(mp.with_name("provenance.json"))
    if not c.get("protocol") or prov["config"].get("protocol") != c["protocol"]:
        return "the record or its provenance lacks the protocol's commit"
    want = {**p["settings"], "dataset": p["dataset"],
            "early_stop": p["early_stop_rule"] if part == "grid" else None}
    bad = sorted(k for k, v in want.items() if c.get(k) != v)
    if bad:
        return f"settings differ from the protocol: {bad}"
    if mp.parents[4].name != f"lr{float(rec['lr']):g}":
        return f"step {rec['lr']} is not its folder's {mp.parents[4].name}"
    if rec.get("milestones") != milestones_for(int(c["epochs"]), c["schedule"]):
        return f"milestones {rec.get('milestones')} are not the schedule's"
    stop = rec.get("early_stop")
    if stop and (not stop.get("reason") or stop.get("epoch") != len(rec["epochs"])):
        return f"early stop {stop} does not name its reason and last epoch"
    return rows_problem(rec, ("train_loss", "val_acc", "test_acc"))


def check_fig3(root: str | os.PathLike = FIG3, p: dict | None = None) -> dict:
    """Every record of the study against the protocol: ``{"ok"`` (all epochs),
    ``"stopped"`` (by the early-stop rule, with reason and epoch), ``"incomplete"``
    (epochs still to run), ``"bad": [(run, problem)]}``, run names
    ``<part>/lr<lr>/<conditioning>/<method>/seed<k>``. A malformed file is reported
    under ``bad`` with its problem, never skipped."""
    p = load_protocol() if p is None else p
    root, epochs = Path(root), int(p["settings"]["epochs"])
    res: dict[str, list] = {"ok": [], "stopped": [], "incomplete": [], "bad": []}
    for part in _PARTS:
        for mp in sorted((root / part).glob(f"lr*/{p['dataset']}/*/*/seed*/"
                                            "metrics.json")):
            name = "/".join(mp.relative_to(root).parts[:2] + mp.parts[-4:-1])
            try:
                problem = record_problem(p, mp, part)
            except (ResultFileError, KeyError, TypeError, ValueError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if problem:
                res["bad"].append((name, f"{mp}: {problem}"))
                continue
            status = run_status(read_json(mp), epochs)
            res[{"finished": "ok", "stopped": "stopped"}.get(status,
                                                             "incomplete")].append(name)
    return res
