"""Plans, lists of runs, and how their runs are spread over GPU slots by estimated
cost. The studies' own plans are registered by the studies
(:func:`studies.cifar.hooks.register_plan`); :func:`build_plan` builds one by name, or
reads a JSON list of run settings."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from studies.cifar import hooks
from studies.cifar.methods import BATCH_SIZE, LR_GRID, METHODS
from studies.kit.provenance import read_json

__all__ = ["job_cost", "assign_slots", "grid_jobs", "seeded_jobs", "build_plan"]


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


# ------------------------------------------------------------ building blocks
def grid_jobs(methods: Sequence[str], common: dict, out: Path,
              **settings) -> list[dict]:
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


def seeded_jobs(
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


# ---------------------------------------------------------------------- the named plans
def build_plan(name: str, dataset: str = "cifar10", epochs: int = 6,
               select_subset: int | None = 10_000,
               select_val: int = 2_000, data_root: str | None = None,
               select_epochs: int = 2, with_ablations: bool | None = None,
               methods: Sequence[str] | None = None) -> list[dict]:
    """The runs of the plan ``name`` (only the runs of ``methods``, when given: a suite
    run in parts): a plan a study registered (:func:`studies.cifar.hooks.plan_names`;
    each study's ``plan`` module says what its plans hold), or a path to a JSON list of
    run settings. ``select_*`` are the step-size selection runs' epochs, training subset
    and held-out size; ``epochs`` and ``with_ablations`` are read by the plans that use
    them."""
    if methods is not None:
        unknown = sorted(set(methods) - set(METHODS))
        if unknown:
            raise ValueError(
                f"methods must be names from {sorted(METHODS)}, got {unknown}"
            )
    select = {"epochs": select_epochs, "subset": select_subset, "val": select_val}
    common = {"dataset": dataset, "data_root": data_root}
    if name in hooks.plan_names():
        jobs = hooks.plan_builder(name)(common, epochs=epochs, select=select,
                                        with_ablations=with_ablations)
    elif Path(name).is_file():
        jobs = list(read_json(Path(name)))
    else:
        names = ", ".join(hooks.plan_names())
        raise ValueError(f"plan must be one of {names} or a JSON "
                         f"file of run settings, got {name!r}")
    return jobs if methods is None else [j for j in jobs if j["method"] in set(methods)]
