"""The amortized step's plans: ``amortized`` (the study at KWNG's Fig. 3 steps,
:func:`amortized_plan`) and ``amortized_seeds`` (its seed study,
:func:`amortized_seeds_plan`)."""

from __future__ import annotations

import math
import os
from pathlib import Path

from studies.cifar.hooks import register_plan
from studies.cifar.runtime import RUN_MARGIN, START_S, run_seconds, wall_times
from studies.fig3.amortized.seed_study import (
    AMORTIZED,
    AMORTIZED_METHODS,
    AMORTIZED_SEEDS,
    seed_study_groups,
)
from studies.fig3.plan import fig3_job
from studies.fig3.protocol import (
    FIG3,
    grid_state,
    load_protocol,
    protocol_commit,
    record_at,
    run_status,
)
from studies.kit.provenance import read_json

__all__ = ["amortized_plan", "amortized_seeds_plan", "runs_left", "out_of_running"]


def out_of_running(spec: dict, out: str | os.PathLike, epochs: int) -> set[str]:
    """The settings out of the running: a method with a finished ill-conditioned run
    under ``out`` that stalled (final test accuracy below ``spec["stall_below"]``).
    The study runs the well-conditioned seeds of the settings still in the running
    only (issue: "then WC at step 1: 3 seeds of the settings still in the running"), so
    the plan leaves out a stalled setting's well-conditioned runs."""
    below = float(spec.get("stall_below", 0.0))
    out_ = set()
    for mp in Path(out).glob("lr*/*/ill/*/seed*/metrics.json"):
        rec = read_json(mp)
        if run_status(rec, epochs) != "finished":
            continue
        final = rec["epochs"][-1].get("test_acc")
        if final is not None and float(final) < below:
            out_.add(mp.parts[-3])
    return out_


def amortized_plan(common: dict, p: dict | None = None, root: str | os.PathLike = FIG3,
                   out: str | os.PathLike = AMORTIZED) -> list[dict]:
    """The amortized-step study (:data:`AMORTIZED_METHODS`, seed 0) in each
    conditioning at KWNG's final Fig. 3 step there, under ``out``: the runs not finished
    yet (:func:`amortized_seeds_plan` with one group a conditioning)."""
    spec = {"groups": [{"conditioning": c, "methods": list(AMORTIZED_METHODS),
                        "seeds": [0], "lr_of": "kwng"} for c in ("ill", "well")]}
    return amortized_seeds_plan(common, p, root, out, spec)


def runs_left(p: dict | None = None, root: str | os.PathLike = FIG3,
              out: str | os.PathLike = AMORTIZED_SEEDS,
              spec: dict | None = None) -> list[tuple[str, str, int, float]]:
    """The seed study's runs not finished yet, ``(conditioning, method, seed, step)``
    in its order (``spec`` default ``out/plan.json``): each group at the Fig. 3 step
    of its ``lr_of`` method (left out while not final), without the
    well-conditioned runs of a setting out of the running (:func:`out_of_running`)."""
    p, out = load_protocol() if p is None else p, Path(out)
    spec = read_json(out / "plan.json") if spec is None else spec
    state, epochs = grid_state(p, root), int(p["settings"]["epochs"])
    dropped = out_of_running(spec, out, epochs)
    left = []
    for g in seed_study_groups(spec):
        st, cond = state.get(f"{g['conditioning']}/{g['lr_of']}"), g["conditioning"]
        left += [(cond, m, s, st["selected"]) for s in g["seeds"] for m in g["methods"]
                 if st and st["final"] and not (cond == "well" and m in dropped)
                 and run_status(record_at(out, "", st["selected"], cond, m, s),
                                epochs) in ("missing", "running")]
    return left


def amortized_seeds_plan(common: dict, p: dict | None = None,
                         root: str | os.PathLike = FIG3,
                         out: str | os.PathLike = AMORTIZED_SEEDS,
                         spec: dict | None = None) -> list[dict]:
    """The seed study's runs not finished yet (:mod:`studies.fig3.amortized.seed_study`,
    :func:`runs_left`) as run settings; estimates read the amortized studies' own
    records first."""
    p, out = load_protocol() if p is None else p, Path(out)
    times, commit = run_seconds(root), protocol_commit()
    for m, t in {**wall_times(AMORTIZED), **wall_times(out)}.items():
        times[m] = min(times.get(m, math.inf), t * RUN_MARGIN + START_S)
    return [fig3_job(p, "", cond, m, lr, s, out, commit, times, early_stop=None,
                     **common) for cond, m, s, lr in runs_left(p, root, out, spec)]


register_plan("amortized", lambda common, **_: amortized_plan(common))
register_plan("amortized_seeds", lambda common, **_: amortized_seeds_plan(common))
