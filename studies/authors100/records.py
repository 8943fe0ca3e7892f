"""The authors'-horizon study's records: their completeness (``cifar check --suite
authors100``, :func:`check_authors100`) and the loader the chapter reads
(:func:`load_authors100`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from studies.authors100.plan import AUTHORS100_TIERS, authors100_plan
from studies.cifar.data import NUM_CLASSES
from studies.cifar.hooks import register_check
from studies.cifar.methods import RESULTS, milestones_for
from studies.cifar.results import checked_record, claim_row_ok, mechanism_ok, report
from studies.kit.provenance import read_json

__all__ = ["check_authors100", "load_authors100"]


def check_authors100(root: str | os.PathLike = RESULTS / "authors100",
                     dataset: str = "cifar10", tiers: tuple[int, ...] = (1,)) -> dict:
    """Completeness of the authors'-horizon study (plan ``authors100``) for the runs of
    ``tiers``: each has ``metrics.json`` and ``provenance.json`` under
    ``root/lr<lr>/``, the ``authors`` schedule with its milestones, the plan's
    precision, every planned epoch recorded in order with finite test accuracy, and the
    mechanism records (:data:`MECHANISM_FIELDS`, the confusion matrix). Returns
    ``{"missing", "incomplete", "diverged", "ok"}`` with run names
    ``lr<lr>/cond/method/seedk``."""
    bad = [t for t in tiers if t not in AUTHORS100_TIERS]
    if not tiers or bad:
        raise ValueError(f"tiers must be a non-empty selection of {AUTHORS100_TIERS}, "
                         f"got {tuple(tiers)}")
    res: dict[str, list[str]] = {"missing": [], "incomplete": [], "diverged": [],
                                 "ok": []}
    k = NUM_CLASSES[dataset]
    for job in authors100_plan({"dataset": dataset}, tiers):
        sub = Path(job["out"]).relative_to(RESULTS / "authors100")
        name = (f"{sub}/{job['conditioning']}/{job['method']}/seed{job['seed']}")
        d = (Path(root) / sub / dataset / job["conditioning"] / job["method"]
             / f"seed{job['seed']}")
        rec = checked_record(name, d, res)
        if rec is None:
            continue
        want = int(job["epochs"])
        proto = (rec.get("config", {}).get("schedule") == "authors"
                 and rec.get("milestones") == milestones_for(want, "authors")
                 and int(rec["config"].get("epochs", -1)) == want
                 and rec.get("precision") == job["precision"]
                 and float(rec.get("lr", -1)) == float(job["lr"]))
        if proto and rec.get("diverged") and rec["epochs"]:
            res["diverged"].append(name)
        elif proto and claim_row_ok(rec, k) and mechanism_ok(rec, k):
            res["ok"].append(name)
        else:
            res["incomplete"].append(name)
    return res


def load_authors100(root: str | os.PathLike = RESULTS / "authors100",
                    dataset: str = "cifar10") -> dict[tuple, dict]:
    """``{(tag, conditioning, method, seed): metrics record}`` for the runs under
    ``root`` (``tag`` = ``lr<lr>`` or ``fp32/lr<lr>``)."""
    out = {}
    root = Path(root)
    for mp in sorted(root.glob(f"**/{dataset}/*/*/seed*/metrics.json")):
        rec = read_json(mp)
        rel = mp.relative_to(root).parts
        tag = "/".join(rel[:rel.index(dataset)])
        c = rec["config"]
        out[(tag, c["conditioning"], c["method"], int(c["seed"]))] = rec
    return out




def _check(a: argparse.Namespace) -> int:
    try:
        tiers = tuple(int(t) for t in a.tiers.split(","))
    except ValueError:
        tiers = ()
    if not tiers or set(tiers) - set(AUTHORS100_TIERS):
        raise ValueError(f"--tiers: a comma list of {AUTHORS100_TIERS}, "
                         f"got {a.tiers!r}")
    return report(check_authors100(a.root or RESULTS / "authors100", a.dataset, tiers))


register_check("authors100", _check)
