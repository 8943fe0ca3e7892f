"""Tables and quoted numbers of the Fisher–Rao vs Wasserstein comparison (chapter
:ref:`fisher-rao`), from the rows of
:func:`~studies.fisher.sweep.load_sweep`.

Each table function returns a Markdown table
(:func:`studies.kit.tables.markdown_table`);
each ``*_values`` function returns a dictionary ``{name: number}`` of the numbers the
chapter's prose quotes, under the names it glues them by:

* :func:`convergence_table` and :func:`convergence_values` — every estimator's median
  error at the largest ``N`` and its log-log slope in ``N``, per model and dimension;
* :func:`sphere_table` and :func:`sphere_values` — the metric's largest eigenvalue, the
  part of ``T`` outside the range of ``C`` and KWNG's error at the largest ``N``;
* :func:`time_table` and :func:`time_values` — the seconds per estimate of KWNG and of
  the kernel Fisher estimator.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from kwng.theory.nystrom import loglog_slope
from studies.fisher.figures import ESTIMATORS, median_by
from studies.kit.tables import markdown_table

__all__ = ["convergence", "convergence_table", "convergence_values", "sphere_table",
           "sphere_values", "time_table", "time_values"]

#: the sample sizes of the ``N`` panel, and its (model, dimension) cells
SWEEP_N = (250, 500, 1000, 2000, 4000)
CELLS = tuple((m, d) for m in ("normal", "lognormal") for d in (2, 4))

#: the columns of :func:`sphere_table`
SPHERE_COLUMNS = ("gf_max", "gf_exact_max", "range_residual", "err_wng", "fng_norm")


def _rows_of(rows: Sequence[dict], panel: str) -> list[dict]:
    if not rows:
        raise ValueError("rows must be a non-empty list of sweep rows")
    return [r for r in rows if r["panel"] == panel]


def convergence(rows: Sequence[dict]) -> tuple[dict, dict]:
    """``(at, slope)``: for every estimator column ``col`` and cell ``(m, d)`` of
    :data:`CELLS`, the median error at the largest ``N`` of :data:`SWEEP_N` and the
    log-log slope of the medians against ``N``, keyed ``(col, m, d)``."""
    dens = [r for r in _rows_of(rows, "N") if r["model"] != "sphere"]
    at, slope = {}, {}
    for col in ESTIMATORS:
        med = median_by(dens, col, ("model", "d", "N"))
        for m, d in CELLS:
            ys = [med[(m, d, N)][0] for N in SWEEP_N]
            at[col, m, d], slope[col, m, d] = ys[-1], loglog_slope(SWEEP_N, ys)
    return at, slope


def convergence_table(rows: Sequence[dict]) -> str:
    """One row per estimator, one column per cell: the error at the largest ``N`` and,
    in brackets, the slope in ``N`` (:func:`convergence`)."""
    at, slope = convergence(rows)
    table = [[label] + [f"{at[col, m, d]:.3f} ({slope[col, m, d]:+.2f})"
                        for m, d in CELLS]
             for col, (label, _) in ESTIMATORS.items()]
    return markdown_table(["estimator"] + [f"{m} d = {d}" for m, d in CELLS], table)


def _span(name: str, values: Iterable[float]) -> dict[str, float]:
    values = list(values)
    return {f"{name}_lo": float(min(values)), f"{name}_hi": float(max(values))}


def convergence_values(rows: Sequence[dict]) -> dict[str, float]:
    """The ranges (``<name>_lo``, ``<name>_hi``) over the cells of every estimator's
    error and slope, of the λ = 0 Fisher error over KWNG's and of the slopes of the
    two cured Fisher estimators; four single errors; and from the ``M`` panel the
    λ = 0 Fisher error at ``M`` = 30 and 300 (normal, ``d`` = 2) and the range over
    the estimators at ``M`` = 10, ``d`` = 4."""
    at, slope = convergence(rows)
    out = {}
    for col in ESTIMATORS:
        out |= _span(f"fr_{col}", [at[(col, *c)] for c in CELLS])
        out |= _span(f"fr_{col}_slope", [slope[(col, *c)] for c in CELLS])
    out |= _span("fr_fng_over_wng",
                 [at[("err_fng", *c)] / at[("err_wng", *c)] for c in CELLS])
    out |= _span("fr_cured_slope", [slope[(c, *x)] for c in ("err_fng_lam",
                                                             "err_fng_score")
                                    for x in CELLS])
    for col, m, d in [("err_fng_score", "lognormal", 4), ("err_wng", "lognormal", 4),
                      ("err_fng_score", "normal", 2), ("err_wng", "normal", 2)]:
        out[f"fr_{col}_{m}_{d}"] = at[col, m, d]
    panel_M = _rows_of(rows, "M")
    med = {col: median_by(panel_M, col, ("model", "d", "M")) for col in ESTIMATORS}
    out["fr_M30"] = med["err_fng"][("normal", 2, 30)][0]
    out["fr_M300"] = med["err_fng"][("normal", 2, 300)][0]
    for m in ("normal", "lognormal"):
        out |= _span(f"fr_M10_{m}4", [med[c][(m, 4, 10)][0] for c in ESTIMATORS])
    return out


def _sphere_medians(rows: Sequence[dict], N: int = 4000):
    for m in ("sphere", "normal"):
        sub = [r for r in _rows_of(rows, "N") if r["model"] == m]
        for d in (2, 4):
            yield m, d, {c: median_by(sub, c, ("d", "N"))[(d, N)][0]
                         for c in SPHERE_COLUMNS}


def sphere_table(rows: Sequence[dict]) -> str:
    """The medians of :data:`SPHERE_COLUMNS` at ``N`` = 4000, λ = 0, on the sphere and
    the normal model in dimensions 2 and 4 (``–`` where not finite)."""
    table = [[m, d] + [f"{meds[c]:.3g}" if np.isfinite(meds[c]) else "–"
                       for c in SPHERE_COLUMNS]
             for m, d, meds in _sphere_medians(rows)]
    head = ["model", "d", "λmax(Ĝ_F)", "λmax(G_F)", "T outside range(C)",
            "KWNG error", "‖Fisher est.‖ / ‖∇L‖"]
    return markdown_table(head, table, align="lrrrrrr")


def sphere_values(rows: Sequence[dict]) -> dict[str, float]:
    """``sph_<model>_<d>_<column>``: the medians of :func:`sphere_table`."""
    return {f"sph_{m}_{d}_{c}": meds[c]
            for m, d, meds in _sphere_medians(rows) for c in SPHERE_COLUMNS}


def _times(rows: Sequence[dict], N: int = 4000):
    for m in ("normal", "lognormal", "sphere"):
        sub = [r for r in _rows_of(rows, "N") if r["model"] == m]
        t = {c: median_by(sub, c, ("d", "N")) for c in ("time_wng_s", "time_fng_s")}
        for d in (2, 4):
            yield m, d, t["time_wng_s"][(d, N)][0], t["time_fng_s"][(d, N)][0]


def time_table(rows: Sequence[dict]) -> str:
    """The median seconds per estimate of KWNG and of the kernel Fisher estimator at
    ``N`` = 4000, and their ratio, per model and dimension."""
    table = [(m, d, f"{w:.2f}", f"{f:.2f}", f"{f / w:.2f}")
             for m, d, w, f in _times(rows)]
    head = ["model", "d", "KWNG (s)", "kernel Fisher (s)", "ratio"]
    return markdown_table(head, table)


def time_values(rows: Sequence[dict]) -> dict[str, float]:
    """``time_<model>_<d>_wng`` and ``..._fng``: the seconds of :func:`time_table`;
    ``fr_time_ratio_lo`` and ``_hi``: the range of their ratio."""
    out, ratio = {}, []
    for m, d, w, f in _times(rows):
        out |= {f"time_{m}_{d}_wng": w, f"time_{m}_{d}_fng": f}
        ratio.append(f / w)
    return out | _span("fr_time_ratio", ratio)
