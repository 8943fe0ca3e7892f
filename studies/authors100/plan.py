"""The authors'-horizon study's plans: ``authors100`` (the runs of
:data:`~studies.authors100.plan.AUTHORS100_RUNS` of tiers 1–3, every run with its own
epochs and step size) and ``authors100_all`` (tier 4 too); results under
``results/cifar/authors100/lr<lr>/``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from studies.cifar.hooks import register_plan
from studies.cifar.methods import AUTHORS100

__all__ = ["AUTHORS100_RUNS", "AUTHORS100_TIERS", "AUTHORS100_SETTINGS",
           "authors100_out",
           "authors100_plan"]

#: The authors'-horizon study (plan ``authors100``), 100 epochs of the authors' schedule
#: (``authors``, ×0.1 after epoch 50), batch 128, clip 1, bf16 forward/backward in
#: channels_last, every capturable step replayed from a CUDA graph. Entries: (tier,
#: method, conditioning, step size, seed, epochs, extra settings). Tier 1 is the study's
#: first list, tier 2 the Euclidean baselines at 10× their selected step, tier 3 a
#: second seed and an fp32 control of the first 30 epochs, tier 4 (not in the plan by
#: default: it does not fit one GPU budget with the others) M = 20.
#: The Euclidean step sizes are the claim suite's selection
#: (the claim suite's ``selected.json``: sgd 0.1, adam 1e-4, kfac 1).
AUTHORS100_RUNS: tuple[tuple[int, str, str, float, int, int, dict], ...] = (
    (1, "kwng", "ill", 10.0, 0, 100, {}),
    (1, "kwng", "well", 10.0, 0, 100, {}),
    (1, "kwng", "ill", 1.0, 0, 100, {}),
    (1, "diag_Ttilde", "ill", 10.0, 0, 100, {}),
    (1, "kfac", "ill", 1.0, 0, 100, {}),
    (1, "sgd", "ill", 0.1, 0, 100, {}),
    (1, "sgd", "well", 0.1, 0, 100, {}),
    (1, "adam", "ill", 1e-4, 0, 100, {}),
    (2, "kfac", "ill", 10.0, 0, 100, {}),
    (2, "sgd", "ill", 1.0, 0, 100, {}),
    (2, "adam", "ill", 1e-3, 0, 100, {}),
    (3, "kwng", "ill", 10.0, 1, 100, {}),
    (3, "kwng", "ill", 10.0, 0, 30, {"precision": "fp32", "channels_last": False}),
    (4, "kwng_basis20", "ill", 10.0, 0, 30, {}),
)
#: the tiers of :data:`AUTHORS100_RUNS`
AUTHORS100_TIERS = tuple(sorted({run[0] for run in AUTHORS100_RUNS}))
#: the settings every run of the plan ``authors100`` shares
AUTHORS100_SETTINGS = {"schedule": "authors", "precision": "bf16",
                       "channels_last": True, "capture": True}


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
