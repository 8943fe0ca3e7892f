"""The synthetic study's headline findings, computed from the committed records, for the
five-line summary of :ref:`ten-minutes` (the chapters that make each point quote the
same numbers from the same files).

Every function takes records already loaded (the loaders live with the experiments:
:func:`~studies.toy.setup.load_rows`,
:func:`~studies.toy.setup.load_flow`, and the step-cost JSON) and returns
plain numbers.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from studies.toy.setup import summarise

__all__ = ["relerr_headline", "bandwidth_range", "divergence_step"]


def relerr_headline(rows: Sequence[dict]) -> dict[str, float]:
    """At the largest dimension and sample size of an error-against-``N`` sweep (panel
    (b) of Figs. 1 and 4): ``{"d", "N", "median", "mean", "slope"}``, the slope being
    that of ``log(mean error)`` against ``log N``."""
    by_n = summarise(rows, "N", "N")
    if not by_n:
        raise ValueError("rows hold no error-against-N panel")
    d = max(by_n)
    s = by_n[d]
    slope = float(np.polyfit(np.log(s["x"]), np.log(s["mean"]), 1)[0])
    return {"d": d, "N": int(s["x"][-1]), "median": float(s["median"][-1]),
            "mean": float(s["mean"][-1]), "slope": slope}


def bandwidth_range(rows: Sequence[dict], factor: float = 2.0) -> tuple[float, float]:
    """The smallest and largest bandwidth of a Fig. 5 sweep whose mean error, at the
    largest dimension, is within ``factor`` of the best one."""
    by_sigma = summarise(rows, "sigma", "bandwidth_spec")
    if not by_sigma:
        raise ValueError("rows hold no bandwidth panel")
    s = by_sigma[max(by_sigma)]
    good = s["x"][s["mean"] <= factor * s["mean"].min()]
    return float(good.min()), float(good.max())


def divergence_step(loss: Sequence[float]) -> int | None:
    """The iteration after which a flow's loss stops being finite (the run diverged),
    or ``None`` if it stays finite."""
    finite = np.isfinite(np.asarray(loss, dtype=float))
    return None if finite.all() else int(np.flatnonzero(finite)[-1]) + 1
