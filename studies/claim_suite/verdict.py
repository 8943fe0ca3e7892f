"""The claim suite's decision rule (30 epochs, fixed before its runs; read in the book
chapter :ref:`experiments-cifar`)."""

from __future__ import annotations

import numpy as np

from studies.cifar.methods import CLAIM_ALL
from studies.cifar.records import class_scalings, final_accuracy_table, final_per_class

__all__ = ["SMALL_U", "claim_verdict"]

#: Threshold of the claim suite's decision rule (its small-scaling classes have U_k at
#: most this).
SMALL_U = 1e-3


def claim_verdict(
    results: dict,
    within: float = 0.05,
    above_sgd: float = 0.20,
    class_ratio: float = 0.5,
    small_u: float = SMALL_U,
) -> dict:
    """The decision rule of the claim suite, fixed before the runs (book chapter,
    "Decision rule"): the claim holds if, in the final test accuracy (mean over seeds),
    (a) IC KWNG is within ``within`` of WC KWNG, (b) IC KWNG is at least ``above_sgd``
    above IC SGD, and (c) on every class with ``U_k ≤ small_u``, IC KWNG's accuracy is
    at least ``class_ratio`` times WC KWNG's on that class. Returns the numbers and the
    three booleans (``None`` where a run is missing)."""
    table = final_accuracy_table(results, methods=CLAIM_ALL)

    def fin(m, c):
        return table.get(m, {}).get(c, {}).get("mean")

    k_ill, k_well, s_ill = fin("kwng", "ill"), fin("kwng", "well"), fin("sgd", "ill")
    has_U = any(c == "ill" and r.get("U") for (c, _, _), r in results.items())
    U = class_scalings(results) if has_U else np.zeros(0)
    small = np.flatnonzero(U <= small_u)
    small = small[np.argsort(U[small])]  # ascending U_k
    pc_ill = final_per_class(results, "ill", "kwng")
    pc_well = final_per_class(results, "well", "kwng")
    out = {
        "kwng_ill": k_ill,
        "kwng_well": k_well,
        "sgd_ill": s_ill,
        "small_classes": small.tolist(),
        "U_small": U[small].tolist(),
        "a_within": None,
        "b_above_sgd": None,
        "c_small_classes": None,
        "drops": {
            m: (fin(m, "well") - fin(m, "ill"))
            if fin(m, "well") is not None and fin(m, "ill") is not None
            else None
            for m in CLAIM_ALL
        },
    }
    if k_ill is not None and k_well is not None:
        out["a_within"] = bool(abs(k_well - k_ill) <= within)
    if k_ill is not None and s_ill is not None:
        out["b_above_sgd"] = bool(k_ill - s_ill >= above_sgd)
    if pc_ill is not None and pc_well is not None:
        out["per_class_ill"] = pc_ill[small].tolist()
        out["per_class_well"] = pc_well[small].tolist()
        out["c_small_classes"] = bool(
            np.all(pc_ill[small] >= class_ratio * pc_well[small])
        )
    parts = (out["a_within"], out["b_above_sgd"], out["c_small_classes"])
    out["holds"] = None if any(p is None for p in parts) else all(parts)
    return out
