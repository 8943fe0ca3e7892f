"""The amortized step's seed study (plan ``amortized_seeds`` of
:func:`kwng.experiments.cifar.plans.build_plan`, records under
``results/cifar/amortized_seeds``): each setting of the amortized KWNG step, and tuned
Adam beside it, at several seeds, with the Fig. 3 protocol's settings. Its plan is the
committed file ``plan.json`` of that folder; this module reads and checks it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kwng.experiments.cifar.fig3 import load_protocol, record_problem, run_status
from kwng.experiments.cifar.methods import METHODS, RESULTS
from kwng.experiments.provenance import ResultFileError, read_json

__all__ = ["AMORTIZED_SEEDS", "check_seed_study", "seed_check", "seed_study_groups"]

#: the amortized step's seed study, ``results/cifar/amortized_seeds`` of the checkout:
#: its committed plan (``plan.json``) and its records
#:
#: :meta hide-value:
AMORTIZED_SEEDS = RESULTS / "amortized_seeds"


def seed_study_groups(spec: dict) -> list[dict]:
    """The groups of the seed study's plan ``spec`` (``plan.json``), its amendments
    after them, each checked: ``conditioning`` ill or well, ``methods`` known names,
    ``seeds`` distinct integers >= 0, ``lr_of`` the Fig. 3 method whose selected step
    the group runs at."""
    if not isinstance(spec, dict) or not isinstance(spec.get("groups"), list):
        raise ValueError("the seed study's plan must be a dict with a list 'groups', "
                         f"got {spec!r:.200}")
    groups = [*spec["groups"], *spec.get("amendments", [])]
    for g in groups:
        if not isinstance(g, dict) or g.get("conditioning") not in ("ill", "well"):
            raise ValueError("each group needs conditioning 'ill' or 'well', got "
                             f"{g!r}")
        unknown = sorted(set(g.get("methods", [])) - set(METHODS))
        if unknown or not g.get("methods"):
            raise ValueError(f"a group's methods must be names from {sorted(METHODS)}, "
                             f"got {g.get('methods')!r}")
        seeds = g.get("seeds")
        if (not isinstance(seeds, list) or not seeds or len(set(seeds)) != len(seeds)
                or any(isinstance(s, bool) or not isinstance(s, int) or s < 0
                       for s in seeds)):
            raise ValueError(f"a group's seeds must be distinct integers >= 0, got "
                             f"{seeds!r}")
        if g.get("lr_of") not in METHODS:
            raise ValueError(f"a group's lr_of must be a method name, got "
                             f"{g.get('lr_of')!r}")
    return groups


def check_seed_study(root: str | os.PathLike = AMORTIZED_SEEDS,
                     p: dict | None = None) -> dict[str, list]:
    """Every record of the seed study under ``root`` against the Fig. 3 protocol's
    settings (:func:`kwng.experiments.cifar.fig3.record_problem`) and its plan (a
    method, conditioning and seed that ``plan.json`` lists): ``{"ok"``, ``"incomplete"``
    (epochs still to run), ``"bad": [(run, problem)]}``, runs named
    ``lr<lr>/<conditioning>/<method>/seed<k>``."""
    p = load_protocol() if p is None else p
    root, epochs = Path(root), int(p["settings"]["epochs"])
    planned = {(g["conditioning"], m, s) for g in seed_study_groups(
        read_json(root / "plan.json")) for m in g["methods"] for s in g["seeds"]}
    res: dict[str, list] = {"ok": [], "incomplete": [], "bad": []}
    for mp in sorted(root.glob(f"lr*/{p['dataset']}/*/*/seed*/metrics.json")):
        cond, m, seed = mp.parts[-4], mp.parts[-3], int(mp.parts[-2][4:])
        name = "/".join((mp.parts[-6], *mp.parts[-4:-1]))
        try:
            problem = record_problem(p, mp, "")
        except (ResultFileError, KeyError, TypeError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        if problem is None and (cond, m, seed) not in planned:
            problem = "not a run of the plan (plan.json)"
        if problem:
            res["bad"].append((name, problem))
            continue
        ok = run_status(read_json(mp), epochs) == "finished"
        res["ok" if ok else "incomplete"].append(name)
    return res


def seed_check(root: str | None) -> int:
    """``cifar check --suite amortized_seeds``: :func:`check_seed_study`, printed; exit
    1 if a record is bad or unfinished (runs the plan has not reached are not
    counted)."""
    res = check_seed_study(root or AMORTIZED_SEEDS)
    for name, problem in res["bad"]:
        print("bad:", name, "-", problem)
    print(json.dumps({k: len(v) for k, v in res.items()}),
          "incomplete:", json.dumps(res["incomplete"]))
    return 1 if res["bad"] or res["incomplete"] else 0
