"""The authors'-horizon study's plans: ``authors100`` (the runs of
:data:`~studies.cifar.methods.AUTHORS100_RUNS` of tiers 1–3, every run with its own
epochs and step size) and ``authors100_all`` (tier 4 too); results under
``results/cifar/authors100/lr<lr>/``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from studies.cifar.hooks import register_plan
from studies.cifar.methods import AUTHORS100, AUTHORS100_RUNS, AUTHORS100_SETTINGS

__all__ = ["authors100_out", "authors100_plan"]


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


register_plan("authors100", lambda common, **_: authors100_plan(common, (1, 2, 3)))
register_plan("authors100_all",
              lambda common, **_: authors100_plan(common, (1, 2, 3, 4)))
