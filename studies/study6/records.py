"""The earlier 6-epoch study's frozen table and the completeness of its records
(``cifar check --suite study6``)."""

from __future__ import annotations

import math
import os
from pathlib import Path

from studies.cifar.hooks import register_check
from studies.cifar.methods import RESULTS
from studies.cifar.results import records_of, report
from studies.kit.provenance import read_json

__all__ = ["STUDY6_TABLE", "study6_table", "BUDGET_CUT", "check_results"]

#: The earlier 6-epoch study (book chapter :ref:`cifar-6epoch`), frozen as data: its 38
#: runs (``cond/method/seedk``, the plan ``main`` of that time), its method lists
#: (``main_methods``, ``ablations``) and the colour, line style and label of each of
#: its methods in its figures (``looks``); each record carries its ``method_spec``
#:
#: :meta hide-value:
STUDY6_TABLE = Path(__file__).with_name("study6.json")


def study6_table() -> dict:
    """The frozen table :data:`STUDY6_TABLE` of the earlier 6-epoch study."""
    return read_json(STUDY6_TABLE)


#: Runs of the earlier 6-epoch study that the GPU budget cut short, with the number of
#: epochs each reached (of 6). The sweep's deadline stopped them; their last checkpoint
#: was not kept. They are reported as ``"cut"`` by :func:`check_results` (not
#: ``"incomplete"``) only while their record has exactly this many finite epochs,
#: ``complete = false`` and a provenance file.
BUDGET_CUT = {"ill/kwng_m20/seed0": 3, "well/kwng_m20/seed0": 3}


def check_results(root: str | os.PathLike = RESULTS, dataset: str = "cifar10",
                  epochs: int | None = None,
                  allow_cut: dict[str, int] | None = None) -> dict:
    """Completeness of the earlier 6-epoch study's records: for every run of its frozen
    list (:data:`STUDY6_TABLE`), whether its ``metrics.json`` and ``provenance.json``
    exist, it is complete (or diverged, recorded as such), and has one row per epoch
    with finite test accuracy.

    ``allow_cut`` (default :data:`BUDGET_CUT` for CIFAR-10, none otherwise) maps run
    names to the number of epochs they are documented to have reached; such a run
    goes to ``"cut"`` if its record matches that exactly, to ``"incomplete"``
    otherwise (a complete run on the list is ``"ok"``). Returns ``{"missing": [...],
    "incomplete": [...], "cut": [...], "ok": [...]}`` with run names
    ``cond/method/seedk``."""
    if allow_cut is None:
        allow_cut = BUDGET_CUT if dataset == "cifar10" else {}
    res: dict[str, list[str]] = {"missing": [], "incomplete": [], "cut": [], "ok": []}
    plan = []
    for name in study6_table()["runs"]:
        cond, method, seed = name.split("/")
        plan.append({"conditioning": cond, "method": method,
                     "seed": int(seed.removeprefix("seed"))})
    for name, rec in records_of(plan, root, dataset, res):
        e = len(rec["epochs"])
        want = epochs or rec["config"]["epochs"]
        finite = all(math.isfinite(r["test_acc"]) for r in rec["epochs"])
        good = rec.get("diverged") or (rec.get("complete") and e == want and finite)
        cut = (name in allow_cut and not rec.get("complete") and e == allow_cut[name]
               and e < want and finite)
        res["ok" if good else "cut" if cut else "incomplete"].append(name)
    return res


register_check("study6", lambda a: report(check_results(a.root or RESULTS, a.dataset)))
