"""The completeness of the claim suite's records (``cifar check --suite claim``)."""

from __future__ import annotations

import os

from studies.cifar.data import NUM_CLASSES
from studies.cifar.hooks import register_check
from studies.cifar.methods import CLAIM, milestones_for
from studies.cifar.results import claim_row_ok, records_of, report
from studies.claim_suite.plan import claim_plan

__all__ = ["check_claim"]


def check_claim(root: str | os.PathLike = CLAIM, dataset: str = "cifar10",
                min_epochs: int = 30) -> dict:
    """Completeness of the claim suite (the ``claim`` plan without ablations), with no
    exceptions: every run has ``metrics.json`` and ``provenance.json``,
    ``schedule == "claim"`` with its milestone, at least ``min_epochs`` planned epochs,
    all of them recorded (``complete``), finite test accuracy and a per-class test
    accuracy (one finite number per class) in every epoch. A run that diverged
    (non-finite training loss; it stops early) is listed under ``"diverged"`` instead of
    ``"ok"``. Returns ``{"missing", "incomplete", "diverged", "ok"}`` with run names
    ``cond/method/seedk``."""
    if isinstance(min_epochs, bool) or not isinstance(min_epochs, int) \
            or min_epochs < 1:
        raise ValueError(f"min_epochs must be an integer >= 1, got {min_epochs!r}")
    res: dict[str, list[str]] = {"missing": [], "incomplete": [], "diverged": [],
                                 "ok": []}
    plan = claim_plan({"dataset": dataset, "data_root": None}, epochs=min_epochs,
                      with_ablations=False)
    for name, rec in records_of(plan, root, dataset, res):
        want = int(rec["config"]["epochs"])
        proto = (rec["config"].get("schedule") == "claim"
                 and rec.get("milestones") == milestones_for(want, "claim")
                 and want >= min_epochs)
        if proto and rec.get("diverged") and rec["epochs"]:
            res["diverged"].append(name)
        elif proto and claim_row_ok(rec, NUM_CLASSES[dataset]):
            res["ok"].append(name)
        else:
            res["incomplete"].append(name)
    return res


register_check("claim", lambda a: report(check_claim(a.root or CLAIM, a.dataset,
                                                     a.min_epochs)))
