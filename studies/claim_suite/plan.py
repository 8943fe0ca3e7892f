"""The claim suite's plans: ``claim_select`` (the step-size selection: every method
of :data:`~studies.cifar.methods.CLAIM_METHODS` × {ill, well} ×
:data:`~studies.cifar.methods.LR_GRID`, each a few epochs at a constant step on the
training set minus a held-out split, scored on the held-out images; results under
``results/cifar/claim/selection/lr<lr>/``) and ``claim`` (the suite: ``epochs`` epochs
with the ``claim`` schedule at the selected steps, in priority order: seed 0 of every
method in both conditionings, seed 1 of
:data:`~studies.cifar.methods.CLAIM_TWO_SEEDS`, then the ablations)."""

from __future__ import annotations

from studies.cifar.hooks import register_plan
from studies.cifar.methods import (
    CLAIM,
    CLAIM_ABLATIONS,
    CLAIM_METHODS,
    CLAIM_SELECTION,
    CLAIM_TWO_SEEDS,
)
from studies.cifar.plans import grid_jobs, seeded_jobs

__all__ = ["claim_select_plan", "claim_plan"]


def claim_select_plan(common: dict, *, select: dict, **_) -> list[dict]:
    """The selection runs (``select``: their epochs, training subset, held-out size)."""
    return grid_jobs(CLAIM_METHODS, common, CLAIM_SELECTION, epochs=select["epochs"],
                     schedule="constant", train_subset=select["subset"],
                     val_size=select["val"])


def claim_plan(common: dict, *, epochs: int, with_ablations: bool | None = None,
               **_) -> list[dict]:
    """The suite's runs (the ablations unless ``with_ablations`` is false)."""
    base = {
        **common,
        "epochs": epochs,
        "lr": "selected",
        "schedule": "claim",
        "out": str(CLAIM),
        "selection_file": str(CLAIM_SELECTION / "selected.json"),
    }
    jobs = seeded_jobs(base, CLAIM_METHODS, 0) + seeded_jobs(base, CLAIM_TWO_SEEDS, 1)
    if with_ablations is None or with_ablations:
        jobs += seeded_jobs(base, CLAIM_ABLATIONS, 0)
    return jobs


register_plan("claim_select", claim_select_plan)
register_plan("claim", claim_plan)
