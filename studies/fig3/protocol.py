"""The Fig. 3 protocol (book chapter :ref:`cifar-fig3`): the paper's CIFAR-10 comparison
redone by its own rule, every method at its best step of the paper's grid, at the
authors' horizon, in both conditionings, with seeds.

The protocol is a committed file (:data:`PROTOCOL_FILE`), written before its first run;
this module reads it and derives everything else from it and from the records on disk:

* :func:`grid_state` — per (conditioning, method), the grid runs made so far, which
  finished, which the early-stop rule stopped, the step selected so far and the steps
  still to run (the first window, and the next grid value whenever the best step sits
  at an inner edge of what was run); the queue made of it is
  :func:`studies.fig3.plan.fig3_plan`;
* :func:`check_fig3` — every record against the protocol, with its provenance
  (``cifar check --suite fig3``: :func:`studies.fig3.plan.fig3_check`).

The early-stop rule (:func:`stop_reason`, the run setting ``early_stop="fig3"``). A
step-size grid spends most of its GPU time on steps that cannot win. The protocol stops
a grid run only when it cannot be selected, for one of three reasons, checked after
every epoch ``e`` on the validation accuracy (the split held out of the training set;
the test set plays no part):

* ``"non-finite loss"``: the training loss is not finite;
* ``"at chance"``: ``e ≥ 10`` and the validation accuracy is below chance plus
  :data:`CHANCE_MARGIN` (12 % on CIFAR-10);
* ``"behind"``: ``e ≥ 30`` and a run of the same method, conditioning and seed at
  another step of the grid reached at least :data:`GAP` (25 points) more validation
  accuracy at the same epoch ``e``.

The third reason compares epochs, never wall-clock: a sibling that runs slower does not
hide its lead. After every epoch the run compares each of its epochs ``e ≥ 30`` with
the siblings' rows at the same ``e`` that exist by then, so a run ahead of its
siblings in wall-clock is stopped as soon as a sibling reaches an epoch at which it
was 25 points behind (the stop names that epoch as ``compared_at``). A run that
finishes before its siblings reach such an epoch cannot be stopped live;
:func:`studies.fig3.verdicts.posthoc_stops` evaluates the rule over the
finished records and names every run the rule condemns, stopped live or not. A
stopped run keeps its record with ``"early_stop": {"reason", "epoch", ...}`` and
counts as finished.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
from pathlib import Path

from studies.cifar.hooks import register_early_stop
from studies.cifar.methods import LR_GRID, METHODS, RESULTS, milestones_for
from studies.cifar.records import (
    execution_problem,
    provenance_problem,
    read_record,
    rows_problem,
)
from studies.fig3.amendments import apply_amendment
from studies.kit.provenance import ResultFileError, read_json

__all__ = ["FIG3", "PROTOCOL_FILE", "AMENDMENTS_NAME", "CHANCE_MARGIN", "CHANCE_EPOCH",
           "GAP", "GAP_EPOCH", "RULE", "load_protocol", "window_for", "protocol_commit",
           "sibling_rows", "stop_reason", "run_status", "record_at",
           "grid_state", "record_problem", "check_fig3", "rounds",
           "round_of", "round_epoch_seconds"]

log = logging.getLogger(__name__)

#: the study's records, ``results/cifar/fig3`` of the checkout
#:
#: :meta hide-value:
FIG3 = RESULTS / "fig3"
#: the protocol, committed before the first run of the study
#:
#: :meta hide-value:
PROTOCOL_FILE = FIG3 / "protocol.json"
#: the name of the amendments file beside the protocol, each amendment committed before
#: the first run it changes and giving its reason (:func:`load_protocol` applies them)
AMENDMENTS_NAME = "amendments.json"
_PARTS = ("grid", "seeds", "ablation")

#: "at chance" means below ``1 / classes + CHANCE_MARGIN`` validation accuracy
CHANCE_MARGIN = 0.02
#: the first epoch at which "at chance" stops a run
CHANCE_EPOCH = 10
#: "behind" means at least this much validation accuracy (a fraction) below a sibling
GAP = 0.25
#: the first epoch at which "behind" stops a run
GAP_EPOCH = 30
#: the rule's constants as the protocol file states them (tested against it)
RULE = {"chance_margin": CHANCE_MARGIN, "chance_epoch": CHANCE_EPOCH, "gap": GAP,
        "gap_epoch": GAP_EPOCH}


def load_protocol(path: str | os.PathLike = PROTOCOL_FILE) -> dict:
    """The protocol file, checked: its grid is the paper's, its early-stop constants
    are :data:`RULE`, its methods are known; with the amendments of
    :data:`AMENDMENTS_NAME` beside it applied (listed under ``"amendments"``;
    :func:`studies.fig3.amendments.apply_amendment`: a substitution or added
    methods)."""
    p = read_json(path)
    if not isinstance(p, dict) or "settings" not in p:
        raise ResultFileError(f"{path}: not a protocol file (no 'settings')")
    if [float(v) for v in p["grid"]] != list(LR_GRID):
        raise ResultFileError(f"{path}: grid {p['grid']} is not {list(LR_GRID)}")
    if p["early_stop"] != RULE:
        raise ResultFileError(f"{path}: early_stop {p['early_stop']} differs from "
                              f"the code's rule {RULE}")
    amend = Path(path).with_name(AMENDMENTS_NAME)
    p["amendments"] = read_json(amend)["amendments"] if amend.exists() else []
    for a in p["amendments"]:
        apply_amendment(p, a)
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
    """The commit that last changed the protocol file or its amendments
    (:data:`AMENDMENTS_NAME` beside it), so that a run records the protocol as amended
    when it started: ``KWNG_PROTOCOL_COMMIT`` (a copied tree without ``.git``), else
    ``git log``. Raises if neither tells."""
    env = os.environ.get("KWNG_PROTOCOL_COMMIT")
    if env:
        return env
    amend = Path(path).with_name(AMENDMENTS_NAME)
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%H", "--", str(path),
                              str(amend)],
                             capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        raise RuntimeError(f"the commit of {path} is unknown ({exc}); set "
                           "KWNG_PROTOCOL_COMMIT") from exc
    if not out:
        raise RuntimeError(f"{path} is not committed: commit the protocol before its "
                           "first run")
    return out


def sibling_rows(rdir: str | Path) -> dict[str, list[dict]]:
    """The per-epoch rows of the runs of the same dataset, conditioning, method and seed
    at the other step sizes of the grid: ``rdir`` is
    ``<root>/lr<lr>/<dataset>/<conditioning>/<method>/seed<k>`` and the siblings are
    ``<root>/lr*/...`` with the same tail. Returns ``{"lr<lr>": rows}``; a sibling whose
    record cannot be read now (being written by another process) is skipped with a
    warning."""
    rdir = Path(rdir)
    lr_dir = rdir.parents[3]
    tail = rdir.relative_to(lr_dir)
    out = {}
    for d in sorted(lr_dir.parent.glob("lr*")):
        mp = d / tail / "metrics.json"
        if d == lr_dir or not mp.is_file():
            continue
        try:
            rec = read_json(mp)
        except ResultFileError as exc:
            log.warning("early stop: sibling %s not read (%s)", mp, exc)
            continue
        if isinstance(rec, dict) and isinstance(rec.get("epochs"), list):
            out[d.name] = rec["epochs"]
    return out


def stop_reason(row: dict, siblings: dict[str, list[dict]],
                num_classes: int, rows: list[dict] | None = None) -> dict | None:
    """Why the run whose latest epoch is ``row`` (with ``epoch``, ``train_loss`` and
    ``val_acc``) stops under the Fig. 3 rule, or ``None`` to go on. ``siblings`` maps
    each other step's name to its rows (:func:`sibling_rows`); ``rows`` are the run's
    epochs so far (default ``[row]``): "behind" compares each of them from epoch
    :data:`GAP_EPOCH` on with the siblings' row of the same epoch, where one exists,
    and names the epoch compared as ``compared_at`` (``epoch`` is always the run's
    last)."""
    if not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    e, acc = int(row["epoch"]), float(row["val_acc"])
    if not math.isfinite(row["train_loss"]) or not math.isfinite(acc):
        return {"reason": "non-finite loss", "epoch": e}
    chance = 1.0 / num_classes + CHANCE_MARGIN
    if e >= CHANCE_EPOCH and acc < chance:
        return {"reason": "at chance", "epoch": e, "val_acc": acc,
                "threshold": chance}
    own = [r for r in (rows if rows is not None else [row])
           if GAP_EPOCH <= int(r["epoch"]) <= e]
    for r in sorted(own, key=lambda r: int(r["epoch"])):
        at, mine = int(r["epoch"]), float(r["val_acc"])
        for name, sib in sorted(siblings.items()):
            same = [s for s in sib if s.get("epoch") == at]
            other = float(same[0].get("val_acc", math.nan)) if same else math.nan
            if math.isfinite(other) and other - mine >= GAP:
                return {"reason": "behind", "epoch": e, "compared_at": at,
                        "val_acc": mine, "sibling": name, "sibling_val_acc": other}
    return None


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
    return (execution_problem(rec)[0]
            or rows_problem(rec, ("train_loss", "val_acc", "test_acc")))


def check_fig3(root: str | os.PathLike = FIG3, p: dict | None = None) -> dict:
    """Every record of the study against the protocol: ``{"ok"`` (all epochs),
    ``"stopped"`` (by the early-stop rule, with reason and epoch), ``"incomplete"``
    (epochs still to run), ``"bad": [(run, problem)]``, ``"differs": [(run, note)]}``
    (a run whose execution differs from its identity and whose record names it:
    :func:`~studies.cifar.records.execution_problem`; it also counts under
    its status), run names
    ``<part>/lr<lr>/<conditioning>/<method>/seed<k>``. A malformed file is reported
    under ``bad`` with its problem, never skipped."""
    p = load_protocol() if p is None else p
    root, epochs = Path(root), int(p["settings"]["epochs"])
    res: dict[str, list] = {"ok": [], "stopped": [], "incomplete": [], "bad": [],
                            "differs": []}
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
            rec = read_json(mp)
            note = execution_problem(rec)[1]
            if note:
                res["differs"].append((name, note))
            status = run_status(rec, epochs)
            res[{"finished": "ok", "stopped": "stopped"}.get(status,
                                                             "incomplete")].append(name)
    return res


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


def early_stop(row: dict, rows: list[dict], rdir: Path,
               num_classes: int) -> dict | None:
    """The rule as the trainer calls it (:mod:`studies.cifar.hooks`):
    :func:`stop_reason`
    with the sibling runs read from the grid beside ``rdir``."""
    return stop_reason(row, sibling_rows(rdir), num_classes, rows=rows)


register_early_stop("fig3", early_stop)
