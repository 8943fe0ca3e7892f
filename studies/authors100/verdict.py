"""The authors'-horizon study's decision rule (100 epochs, fixed before its runs; read
in the book chapter :ref:`experiments-cifar`)."""

from __future__ import annotations

import numpy as np

__all__ = ["authors100_verdict"]


def authors100_verdict(
    records: dict[tuple, dict],
    within: float = 0.05,
    above_sgd: float = 0.20,
    class_ratio: float = 0.5,
    small_u: float = 1e-3,
    learned: float = 0.5,
) -> dict:
    """The decision rule of the authors'-horizon study, fixed before its results were
    read into the book: the three criteria of the 30-epoch claim suite,
    evaluated at the last epoch (100), plus a fourth. With ``a`` the final test accuracy
    (mean over the seeds present) of ``kwng`` at the authors' step 10:

    1. ``|a_WC − a_IC| ≤ within``;
    2. ``a_IC − a_SGD ≥ above_sgd``, ``a_SGD`` the better of IC ``sgd`` at its selected
       step (0.1) and at 10× (1) — the fair baseline;
    3. on every class with ``U_k ≤ small_u``, IC ``kwng``'s recall (the per-class test
       accuracy, mean over seeds) is at least ``class_ratio`` times WC ``kwng``'s;
    4. the two classes with the smallest ``U_k`` reach recall ≥ ``learned`` and
       precision ≥ ``learned`` in IC ``kwng`` (mean over seeds).

    The claim holds if all four hold; ``None`` where a run is missing. ``records`` as
    :func:`studies.authors100.records.load_authors100`."""
    k_ill, k_well = (
        _final(records, "lr10", "ill", "kwng"),
        _final(records, "lr10", "well", "kwng"),
    )
    sgds = {t: _final(records, t, "ill", "sgd") for t in ("lr0.1", "lr1")}
    sgd_ok = {t: float(v) for t, v in sgds.items() if v is not None}
    out: dict = {
        "kwng_ill": None if k_ill is None else float(k_ill),
        "kwng_well": None if k_well is None else float(k_well),
        "sgd_ill_by_step": sgd_ok,
        "sgd_ill": max(sgd_ok.values(), default=None),
        "c1_within": None,
        "c2_above_sgd": None,
    }
    if k_ill is not None and k_well is not None:
        out["c1_within"] = bool(abs(float(k_well) - float(k_ill)) <= within)
    if k_ill is not None and out["sgd_ill"] is not None:
        out["c2_above_sgd"] = bool(float(k_ill) - out["sgd_ill"] >= above_sgd)
    out.update(_small_class_criteria(records, small_u, class_ratio, learned))
    parts = (
        out["c1_within"],
        out["c2_above_sgd"],
        out["c3_small_classes"],
        out["c4_two_smallest_learned"],
    )
    out["holds"] = None if any(p is None for p in parts) else all(parts)
    return out


def _final(records: dict, tag: str, cond: str, method: str, key: str = "test_acc"):
    """The last epoch's ``key`` of the runs ``(tag, cond, method)``, mean over seeds
    (``None`` entries of per-class lists read as NaN; ``None`` without runs)."""
    rows = [
        r["epochs"][-1][key]
        for (t, c, m, _), r in sorted(records.items())
        if t == tag and c == cond and m == method and r["epochs"]
    ]
    if not rows:
        return None
    arr = np.array(
        [
            [np.nan if v is None else v for v in x] if isinstance(x, list) else x
            for x in rows
        ],
        dtype=float,
    )
    return arr.mean(axis=0)


def _small_class_criteria(
    records: dict, small_u: float, class_ratio: float, learned: float
) -> dict:
    """Criteria 3 and 4 of :func:`authors100_verdict` and the numbers behind them."""
    out: dict = {"c3_small_classes": None, "c4_two_smallest_learned": None}
    ill = [
        r
        for (t, c, m, _), r in records.items()
        if t == "lr10" and c == "ill" and m == "kwng"
    ]
    if ill and ill[0].get("U"):
        U = np.array(ill[0]["U"])
        small = np.flatnonzero(U <= small_u)
        small = small[np.argsort(U[small])]
        rec_ill = _final(records, "lr10", "ill", "kwng", "test_acc_per_class")
        rec_well = _final(records, "lr10", "well", "kwng", "test_acc_per_class")
        prec_ill = _final(records, "lr10", "ill", "kwng", "test_precision_per_class")
        out.update(small_classes=small.tolist(), U_small=U[small].tolist())
        if rec_ill is not None and rec_well is not None:
            out["recall_ill"] = rec_ill[small].tolist()
            out["recall_well"] = rec_well[small].tolist()
            out["c3_small_classes"] = bool(
                np.all(rec_ill[small] >= class_ratio * rec_well[small])
            )
        if rec_ill is not None and prec_ill is not None:
            two = small[:2]
            out["precision_ill"] = prec_ill[small].tolist()
            out["c4_two_smallest_learned"] = bool(
                np.all(rec_ill[two] >= learned) and np.all(prec_ill[two] >= learned)
            )
    return out


# ------------------------------------------------- the Fig. 3 protocol's records
