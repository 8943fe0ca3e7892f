"""The CIFAR study's result records: loading, completeness checks and the step-size
selection rule (book chapter :ref:`experiments-cifar`), with their commands ``cifar
check`` and ``cifar select``."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
from pathlib import Path

from studies.cifar import hooks
from studies.cifar.data import DATASETS, NUM_CLASSES
from studies.cifar.methods import (
    CLAIM_SELECTION,
    CONDITION_NUMBER,
    LR_GRID,
    METHODS,
    RESULTS,
    SELECTION,
)
from studies.cifar.nets import DiagonalConditioning
from studies.cifar.records import provenance_problem, read_record, rows_problem
from studies.kit import guard
from studies.kit.provenance import ResultFileError, atomic_write_json, read_json

log = logging.getLogger(__name__)


def load_results(root: str | os.PathLike = RESULTS,
                 dataset: str = "cifar10") -> dict[tuple, dict]:
    """``{(conditioning, method, seed): metrics record}`` for the runs under
    ``root/dataset``. An ill-conditioned record written before records carried the
    class scalings ``U`` gets the study's default (:class:`DiagonalConditioning` with
    :data:`~studies.cifar.methods.CONDITION_NUMBER`), marked ``"U_source":
    "default"``."""
    out = {}
    for mp in sorted(Path(root, dataset).glob("*/*/seed*/metrics.json")):
        rec = read_json(mp)  # names the file if it is not JSON
        try:
            c = rec["config"]
            out[(c["conditioning"], c["method"], int(c["seed"]))] = rec
            if c["conditioning"] == "ill" and not rec.get("U"):
                U = DiagonalConditioning(NUM_CLASSES[dataset], CONDITION_NUMBER).diag
                rec["U"] = U.tolist()
                rec["U_source"] = "default"
        except (KeyError, TypeError, ValueError) as exc:
            raise ResultFileError(f"{mp}: not a metrics record "
                                  f"({type(exc).__name__}: {exc})") from exc
    return out


def checked_record(name: str, d: Path, res: dict) -> dict | None:
    """The record in ``d`` if it and its provenance can be counted; else ``None``, with
    the run in ``res["missing"]`` (no files) or ``res["incomplete"]`` (named with the
    file and the problem: malformed, a foreign or unreadable provenance, a non-finite
    loss or accuracy)."""
    mp = d / "metrics.json"
    if not mp.is_file() or not (d / "provenance.json").is_file():
        res["missing"].append(name)
        return None
    try:
        rec = read_record(mp)
        rows = rows_problem(rec)
        problem = (provenance_problem(rec, d / "provenance.json")
                   or (rows and f"{mp}: {rows}"))
    except (ResultFileError, KeyError, TypeError, ValueError) as exc:
        problem = str(exc) if str(mp) in str(exc) else f"{mp}: {exc}"
    if problem:
        res["incomplete"].append(f"{name} ({problem})")
        return None
    return rec


def records_of(plan: list[dict], root: str | os.PathLike, dataset: str, res: dict):
    """``(name, record)`` for each run of ``plan`` that :func:`checked_record`
    passes."""
    for job in plan:
        name = f"{job['conditioning']}/{job['method']}/seed{job['seed']}"
        d = (Path(root) / dataset / job["conditioning"] / job["method"]
             / f"seed{job['seed']}")
        rec = checked_record(name, d, res)
        if rec is not None:
            yield name, rec


def claim_row_ok(rec: dict, k: int) -> bool:
    """Every epoch recorded, in order, with finite test accuracy and ``k`` finite
    per-class accuracies."""
    rows, want = rec["epochs"], int(rec["config"]["epochs"])
    per_class_ok = all(len(r.get("test_acc_per_class", [])) == k
                       and all(math.isfinite(a) for a in r["test_acc_per_class"])
                       for r in rows)
    return bool(rec.get("complete") and len(rows) == want and per_class_ok
                and [r["epoch"] for r in rows] == list(range(1, want + 1))
                and all(math.isfinite(r["test_acc"]) for r in rows))


#: The per-epoch fields of the mechanism records (plan ``authors100``), per class
#: recall and precision (``None`` where nothing was predicted as the class), row norms,
#: logit scales ``U_k ‖W_k‖``, row movement (this epoch and cumulative);
#: ``feature_norm`` (mean ``‖φ‖``) and the update share are scalars
MECHANISM_FIELDS = ("test_acc_per_class", "test_precision_per_class",
                    "last_layer_row_norms", "logit_scale", "row_movement",
                    "cumulative_row_movement")


def mechanism_ok(rec: dict, k: int) -> bool:
    """Every epoch carries the mechanism fields (``k`` numbers each; precision may be
    NaN where a class was never predicted) and the record the final confusion
    matrix."""
    for r in rec["epochs"]:
        for f in MECHANISM_FIELDS:
            v = r.get(f)
            if not isinstance(v, list) or len(v) != k:
                return False
            if not all((a is None and f == "test_precision_per_class")
                       or (isinstance(a, (int, float)) and math.isfinite(a))
                       for a in v):
                return False
        if not math.isfinite(r.get("feature_norm", math.nan)) or \
                not math.isfinite(r.get("last_layer_update_share", math.nan)):
            return False
    cm = rec.get("confusion")
    return (isinstance(cm, list) and len(cm) == k and all(len(x) == k for x in cm)
            and sum(map(sum, cm)) == rec.get("eval_size"))


# -------------------------------------------------------------------------- selection
#: the rule as written into ``selected.json`` (the text of the committed selections)
SELECTION_RULE = (
    "Apply the selection rule to the short runs under ``root``.\n\n    Rule: for each "
    "(dataset, conditioning, method), the step size of :data:`LR_GRID` with the highest"
    "\n    held-out accuracy at the end of the short run; runs that diverged "
    "(non-finite loss) are excluded;\n    ties go to the lower final training loss.")


def select_lrs(root: str | os.PathLike = SELECTION, write: bool = True,
               force: bool = False) -> dict:
    """Apply the selection rule (:data:`SELECTION_RULE`) to the short runs under
    ``root``: for each (dataset, conditioning, method), the step size of
    :data:`~studies.cifar.methods.LR_GRID` with the highest held-out accuracy
    at the end of the short run; runs that diverged (non-finite loss) are excluded; ties
    go to the lower final training loss. Writes ``root/selected.json``.
    """
    runs = sorted(Path(root).glob("lr*/*/*/*/seed*/metrics.json"))
    if not runs:  # a mistyped root: nothing created, no empty selection written
        raise FileNotFoundError(f"root {root} holds no selection runs "
                                "(lr<lr>/<dataset>/<conditioning>/<method>/seed<k>/metrics.json)")
    rows: dict[str, list] = {}
    for mp in runs:
        rec = read_json(mp)
        c = rec["config"]
        last = rec["epochs"][-1] if rec["epochs"] else None
        ok = (last is not None and rec.get("complete") and not rec.get("diverged")
              and math.isfinite(last["train_loss"]))
        rows.setdefault(f"{c['dataset']}/{c['conditioning']}/{c['method']}", []).append(
            {"lr": rec["lr"], "val_acc": last["test_acc"] if last else None,
             "train_loss": last["train_loss"] if last else None, "ok": bool(ok),
             "steps": last["steps"] if last else 0})
    selected = {}
    for key, rs in rows.items():
        good = [r for r in rs if r["ok"]]
        if not good:
            continue
        best = max(good, key=lambda r: (r["val_acc"], -r["train_loss"]))
        selected[key] = {"lr": best["lr"], "val_acc": best["val_acc"],
                         "candidates": sorted(rs, key=lambda r: -r["lr"])}
    out = {"rule": SELECTION_RULE, "grid": list(LR_GRID),
           "selected": selected,
           "inherit": {m: s.spec["lr_from"] for m, s in METHODS.items()
                       if "lr_from" in s.spec}}
    if write:
        _write_selection(Path(root) / "selected.json", out, force)
    return out


def _write_selection(path: Path, out: dict, force: bool) -> None:
    """Write ``out`` to ``path``. A suite run in parts adds methods to an existing
    selection, and a method added to the table adds its ``inherit`` entry: entries
    that are only added are written without ``force``; a changed or removed entry
    (another rule, grid, step size or inheritance) is refused unless ``force`` (then
    the old file is backed up). The ``inherit`` entries of methods that have left the
    table (those of a frozen study) stay as the file records them."""
    if path.exists():
        gone = {m: v for m, v in read_json(path).get("inherit", {}).items()
                if m not in METHODS}
        out["inherit"] = dict(sorted({**gone, **out["inherit"]}.items()))
    if path.exists() and not force:
        old = read_json(path)
        added = {f"{part}.{k}" for part in ("selected", "inherit")
                 for k in set(out[part]) - set(old.get(part, {}))}
        changed = [k for k in guard.diff_keys(old, out) if k not in added]
        if not changed:
            if guard.diff_keys(old, out):
                log.info("%s: adding %s", path, sorted(added))
                atomic_write_json(path, out)
            return
    guard.write_json_guarded(path, out, force)


# ----------------------------------------------------------------------------- commands
def select_command(p: argparse.ArgumentParser, rest: list[str]) -> int:
    """``cifar select``: :func:`select_lrs` on the claim suite's selection runs."""
    p.add_argument("--root", default=str(CLAIM_SELECTION))
    a = p.parse_args(rest)
    out = select_lrs(a.root, force=a.force)
    for k, v in sorted(out["selected"].items()):
        log.info("selected %s: lr=%g (held-out acc %.3f)", k, v["lr"], v["val_acc"])
    return 0


def report(res: dict) -> int:
    """Print a completeness check's counts and the runs not ok; the exit status (1 when
    a run is missing or incomplete)."""
    extra = (("diverged:", res["diverged"]) if "diverged" in res
             else ("cut by the budget (documented):", res.get("cut", [])))
    print(json.dumps({k: len(v) for k, v in res.items()}),
          "not ok:", json.dumps(res["missing"] + res["incomplete"]),
          extra[0], json.dumps(extra[1]))
    return 0 if not res["missing"] and not res["incomplete"] else 1


def check_command(p: argparse.ArgumentParser, rest: list[str]) -> int:
    """``cifar check``: the completeness of a suite's records (exit 1 when a run is
    missing or incomplete): a suite a study registered
    (:func:`studies.cifar.hooks.register_check`; it receives the parsed options)."""
    p.add_argument("--suite", default="claim", choices=hooks.check_names())
    p.add_argument("--tiers", default="1", help="authors100: comma list of tiers")
    p.add_argument(
        "--root",
        default=None,
        help="default: results/cifar/claim (claim), results/cifar (study6)",
    )
    p.add_argument("--dataset", default="cifar10", choices=DATASETS)
    p.add_argument("--min-epochs", type=int, default=30)
    a = p.parse_args(rest)
    return hooks.check_of(a.suite)(a)
