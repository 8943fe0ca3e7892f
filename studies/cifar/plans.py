"""The CIFAR study's plans, lists of runs (the claim suite, its selection, the authors'
horizon, the Fig. 3 protocol, the amortized step), and how their runs are spread over
GPU slots by estimated cost."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

from studies.fig3.protocol import (
    FIG3,
    grid_state,
    load_protocol,
    protocol_commit,
    record_at,
    run_status,
)
from studies.fig3.audit import FIG3_AUDIT, audit_groups
from studies.cifar.methods import (
    AMORTIZED_METHODS,
    AUTHORS100,
    AUTHORS100_RUNS,
    AUTHORS100_SETTINGS,
    BATCH_SIZE,
    CLAIM,
    CLAIM_ABLATIONS,
    CLAIM_METHODS,
    CLAIM_SELECTION,
    CLAIM_TWO_SEEDS,
    LR_GRID,
    METHODS,
)
from studies.cifar.runtime import (
    RUN_MARGIN,
    START_S,
    estimate_seconds,
    run_seconds,
    wall_times,
)
from studies.amortized.seed_study import (
    AMORTIZED,
    AMORTIZED_SEEDS,
    seed_study_groups,
)
from studies.kit.provenance import read_json
from studies.kit.wording import name_list

log = logging.getLogger(__name__)

#: the named plans of :func:`build_plan` (any other plan is a JSON file of run settings)
PLAN_NAMES = ("claim_select", "claim", "authors100", "authors100_all", "fig3",
              "amortized", "amortized_seeds", "fig3_audit")


# --------------------------------------------------------- the cost of a run, GPU slots
def job_cost(job: dict, timing: dict | None = None) -> float:
    """Relative cost of a run of ``job`` (per epoch, times its ``epochs`` when given;
    the timing file's seconds per step if given, else the method's
    ``Method.rel_cost``)."""
    m = job["method"]
    epochs = int(job.get("epochs", 1))
    if timing is not None and m in timing:
        steps = math.ceil(50_000 / timing[m].get("batch_size", BATCH_SIZE))
        return float(timing[m]["sec_per_step"]) * steps * epochs
    return METHODS[m].rel_cost * epochs


def assign_slots(
    plan: list[dict], gpus: int, procs_per_gpu: int, timing: dict | None = None
) -> list[dict]:
    """The plan with a ``slot`` (worker index ``g · procs_per_gpu + p``) for each of
    the first runs, chosen greedily (most expensive run first, to the GPU with the least
    load and a free worker) so that every GPU gets a similar total cost; runs beyond the
    number of workers get no slot (taken by the first worker to finish)."""
    gpus = max(gpus, 1)
    order = sorted(range(len(plan)), key=lambda i: -job_cost(plan[i], timing))
    load, used = [0.0] * gpus, [0] * gpus
    out = [dict(j) for j in plan]
    for i in order:
        free = [g for g in range(gpus) if used[g] < procs_per_gpu]
        if not free:
            break
        g = min(free, key=lambda g: (load[g], g))
        out[i]["slot"] = g * procs_per_gpu + used[g]
        used[g] += 1
        load[g] += job_cost(plan[i], timing)
    return out


# --------------------------------------------- the claim suite and the authors' horizon
def _grid(methods: Sequence[str], common: dict, out: Path, **settings) -> list[dict]:
    """Every method × {ill, well} × :data:`~studies.cifar.methods.LR_GRID`,
    seed 0, results under ``out/lr<lr>``."""
    return [
        {
            **common,
            "conditioning": cond,
            "method": m,
            "seed": 0,
            "lr": lr,
            **settings,
            "out": str(out / f"lr{lr:g}"),
        }
        for cond in ("ill", "well")
        for m in methods
        for lr in LR_GRID
    ]


def _seeded(
    base: dict,
    methods: Sequence[str],
    seed: int,
    conds: Sequence[str] = ("ill", "well"),
) -> list[dict]:
    """Seed ``seed`` of each method in each conditioning (method-major order)."""
    return [
        {**base, "conditioning": c, "method": m, "seed": seed}
        for m in methods
        for c in conds
    ]


def _claim_plan(common: dict, epochs: int, with_ablations: bool | None) -> list[dict]:
    base = {
        **common,
        "epochs": epochs,
        "lr": "selected",
        "schedule": "claim",
        "out": str(CLAIM),
        "selection_file": str(CLAIM_SELECTION / "selected.json"),
    }
    jobs = _seeded(base, CLAIM_METHODS, 0) + _seeded(base, CLAIM_TWO_SEEDS, 1)
    if with_ablations is None or with_ablations:
        jobs += _seeded(base, CLAIM_ABLATIONS, 0)
    return jobs


def authors100_out(lr: float, settings: dict) -> Path:
    """Where a run of the plan ``authors100`` writes:
    ``results/cifar/authors100/lr<lr>`` (``.../fp32/lr<lr>`` for the precision
    control)."""
    tag = f"lr{lr:g}"
    return AUTHORS100 / ("fp32" if settings.get("precision") == "fp32" else "") / tag


def authors100_plan(common: dict, tiers: Sequence[int] = (1, 2, 3)) -> list[dict]:
    """The runs of :data:`AUTHORS100_RUNS` of ``tiers``, in tier order."""
    jobs = []
    for tier, m, cond, lr, seed, epochs, extra in AUTHORS100_RUNS:
        if tier not in tiers:
            continue
        jobs.append(
            {
                **common,
                **AUTHORS100_SETTINGS,
                **extra,
                "method": m,
                "conditioning": cond,
                "lr": lr,
                "seed": seed,
                "epochs": epochs,
                "out": str(authors100_out(lr, extra)),
            }
        )
    return jobs


# --------------------------------------------------------- the Fig. 3 protocol's queues
def _job(p: dict, part: str, cond: str, method: str, lr: float, seed: int,
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


def queue_left(p: dict, root: str | os.PathLike = FIG3) -> dict[str, int]:
    """Runs the protocol still needs, by part (grid, seeds, ablation); grid values
    added by the extension rule and seeds of selections not yet final are counted
    once they are known."""
    jobs = fig3_plan({}, p, root, commit="(count only)")
    out = {"grid": 0, "seeds": 0, "ablation": 0}
    for j in jobs:
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




def amortized_plan(common: dict, p: dict | None = None, root: str | os.PathLike = FIG3,
                   out: str | os.PathLike = AMORTIZED) -> list[dict]:
    """The amortized-step study (:data:`AMORTIZED_METHODS`, seed 0) in each
    conditioning at KWNG's final Fig. 3 step there, under ``out``: the runs not finished
    yet (:func:`amortized_seeds_plan` with one group a conditioning)."""
    spec = {"groups": [{"conditioning": c, "methods": list(AMORTIZED_METHODS),
                        "seeds": [0], "lr_of": "kwng"} for c in ("ill", "well")]}
    return amortized_seeds_plan(common, p, root, out, spec)


def amortized_seeds_plan(common: dict, p: dict | None = None,
                         root: str | os.PathLike = FIG3,
                         out: str | os.PathLike = AMORTIZED_SEEDS,
                         spec: dict | None = None) -> list[dict]:
    """The seed study's runs not finished yet (:mod:`studies.amortized.seed_study`;
    ``spec`` default ``out/plan.json``), in its order, each group at the Fig. 3 step of
    its ``lr_of`` method (left out while not final); estimates read the amortized
    studies' own records first."""
    p, out = load_protocol() if p is None else p, Path(out)
    spec = read_json(out / "plan.json") if spec is None else spec
    state, epochs = grid_state(p, root), int(p["settings"]["epochs"])
    times, commit, jobs = run_seconds(root), protocol_commit(), []
    for m, t in {**wall_times(AMORTIZED), **wall_times(out)}.items():
        times[m] = min(times.get(m, math.inf), t * RUN_MARGIN + START_S)
    for g in seed_study_groups(spec):
        st, cond = state.get(f"{g['conditioning']}/{g['lr_of']}"), g["conditioning"]
        jobs += [_job(p, "", cond, m, st["selected"], s, out, commit, times,
                      early_stop=None, **common)
                 for s in g["seeds"] for m in g["methods"] if st and st["final"]
                 and run_status(record_at(out, "", st["selected"], cond, m, s),
                                epochs) in ("missing", "running")]
    return jobs


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
        jobs += [_job(p, part, cond, m, lr, s, out, commit, times, early_stop=rule,
                      **common)
                 for lr in lrs for s in g["seeds"] for m in g["methods"]
                 if run_status(record_at(out, part, lr, cond, m, s), epochs)
                 in ("missing", "running")]
    return jobs


# ---------------------------------------------------------------------- the named plans
def build_plan(name: str, dataset: str = "cifar10", epochs: int = 6,
               select_subset: int | None = 10_000,
               select_val: int = 2_000, data_root: str | None = None,
               select_epochs: int = 2, with_ablations: bool | None = None,
               methods: Sequence[str] | None = None) -> list[dict]:
    """Run lists (only the runs of ``methods``, when given: a suite run in parts).

    * ``claim_select``: every method of :data:`CLAIM_METHODS` × {ill, well} ×
      :data:`~studies.cifar.methods.LR_GRID`, each ``select_epochs`` epochs at
      a constant step on the training set minus ``select_val`` held-out images (on
      ``select_subset`` of the rest if given), scored on the held-out images; results
      under ``results/cifar/claim/selection/lr<lr>/``.
    * ``claim``: the claim suite, ``epochs`` epochs with the ``claim`` schedule and the
      step sizes of ``claim_select``, in priority order: seed 0 of every method of
      :data:`CLAIM_METHODS` in both conditionings, seed 1 of :data:`CLAIM_TWO_SEEDS`,
      then :data:`CLAIM_ABLATIONS` (seed 0, both conditionings) when ``with_ablations``
      (default: yes).
    * ``authors100``: the authors'-horizon study (:data:`AUTHORS100_RUNS` of tiers 1–3,
      every run with its own epochs and step size; ``epochs`` is not used; the plan
      ``authors100_all`` adds tier 4), results under
      ``results/cifar/authors100/lr<lr>/``.
    * ``fig3``: the runs of the Fig. 3 protocol still to make (:func:`fig3_plan`);
      ``epochs`` is not used.
    * ``amortized``: the amortized-step study at KWNG's Fig. 3 steps
      (:func:`amortized_plan`).
    * ``amortized_seeds``: its seed study (:func:`amortized_seeds_plan`).
    * ``fig3_audit``: the Fig. 3 audit's runs beyond the protocol (:func:`audit_plan`).
    * a path to a JSON list of run settings.
    """
    if methods is not None:
        unknown = sorted(set(methods) - set(METHODS))
        if unknown:
            raise ValueError(
                f"methods must be names from {sorted(METHODS)}, got {unknown}"
            )
    select = {"epochs": select_epochs, "subset": select_subset, "val": select_val}
    jobs = _named_plan(name, {"dataset": dataset, "data_root": data_root}, epochs,
                       select, with_ablations)
    return jobs if methods is None else [j for j in jobs if j["method"] in set(methods)]


def _named_plan(name: str, common: dict, epochs: int, select: dict,
                with_ablations: bool | None) -> list[dict]:
    """The plan ``name`` (``select``: the selection runs' epochs, training subset and
    held-out size)."""
    if name == "claim_select":
        return _grid(
            CLAIM_METHODS,
            common,
            CLAIM_SELECTION,
            epochs=select["epochs"],
            schedule="constant",
            train_subset=select["subset"],
            val_size=select["val"],
        )
    if name == "claim":
        return _claim_plan(common, epochs, with_ablations)
    if name in ("authors100", "authors100_all"):
        return authors100_plan(
            common, (1, 2, 3, 4) if name.endswith("all") else (1, 2, 3)
        )
    if name == "fig3":
        return fig3_plan(common)
    if name == "amortized":
        return amortized_plan(common)
    if name == "amortized_seeds":
        return amortized_seeds_plan(common)
    if name == "fig3_audit":
        return audit_plan(common)
    path = Path(name)
    if path.is_file():
        return list(read_json(path))
    raise ValueError(f"plan must be one of {', '.join(PLAN_NAMES)} or a JSON file of "
                     f"run settings, got {name!r}")
