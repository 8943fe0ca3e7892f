"""Tables and quoted numbers of the synthetic experiments (chapter
:ref:`experiments-synthetic`), from their committed results.

Each table function returns a Markdown table
(:func:`studies.kit.tables.markdown_table`);
each ``*_values`` function returns a dictionary ``{name: number}`` of the numbers the
chapter's prose quotes, under the names it glues them by. ``rows_by_model`` maps a
model's name to its rows (:func:`~studies.toy.setup.load_rows`):

* :func:`relerr_table` and :func:`relerr_values` — the error against ``N`` at the
  largest dimension and sample size (Figs. 1 and 5, panel (b));
* :func:`bandwidth_table` and :func:`bandwidth_values` — the best bandwidth and the
  bandwidths within a factor 2 of it (Fig. 5);
* :func:`flow_study_table` and :func:`flow_study_values` — the variants of the
  parametrisation study (``flow_study.json`` of :mod:`studies.synthetic.flow_study`).
"""

from __future__ import annotations

import re

import numpy as np

from studies.kit.tables import markdown_table
from studies.synthetic.findings import bandwidth_range, relerr_headline
from studies.toy.setup import summarise

__all__ = ["relerr_table", "relerr_values", "bandwidth_table", "bandwidth_values",
           "flow_study_table", "flow_study_values"]

#: the variant of the parametrisation study listed first
BASELINE = "baseline (μ, vech L)"


def _relerr(rows_by_model: dict, config: dict):
    d_max = max(config["dims"])
    for m, rr in rows_by_model.items():
        head = relerr_headline(rr)
        if head["d"] != d_max:
            raise ValueError(f"rows_by_model[{m!r}] reaches d = {head['d']}, the "
                             f"config's dims reach {d_max}")
        by_n = summarise(rr, "N", "N")
        per_d = [float(by_n[d]["median"][-1]) for d in sorted(by_n)]
        yield m, head, min(per_d), max(per_d)


def relerr_table(rows_by_model: dict, config: dict) -> str:
    """Per model, at the largest dimension and ``N`` of ``config`` (the sweep's
    ``relerr`` configuration): the median and mean error, the slope of the mean in
    ``N`` and the range of the median over the dimensions."""
    rows = [(m, f"{h['median']:.3f}", f"{h['mean']:.3f}", f"{h['slope']:+.2f}",
             f"{lo:.3f}–{hi:.3f}") for m, h, lo, hi in _relerr(rows_by_model, config)]
    head = [f"model (d = {max(config['dims'])}, N = {max(config['N_values'])})",
            "median", "mean", "slope in N", "median over d = 1..10"]
    return markdown_table(head, rows)


def relerr_values(rows_by_model: dict, config: dict) -> dict[str, float]:
    """``rel_<model>_<median|mean|slope|dmin|dmax>``: the numbers of
    :func:`relerr_table`; ``rel_M``: the basis size ``⌊d √N⌋`` at the largest ``d``
    and ``N``."""
    out = {}
    for m, h, lo, hi in _relerr(rows_by_model, config):
        out |= {f"rel_{m}_{k}": float(v) for k, v in (
            ("median", h["median"]), ("mean", h["mean"]), ("slope", h["slope"]),
            ("dmin", lo), ("dmax", hi))}
    d_max, N_max = max(config["dims"]), max(config["N_values"])
    return out | {"rel_M": int(d_max * N_max**0.5)}


def _bandwidth(rows_by_model: dict):
    for m, rr in rows_by_model.items():
        s = summarise(rr, "sigma", "bandwidth_spec")
        dm = max(s)
        i = int(np.argmin(s[dm]["mean"]))
        yield m, dm, s[dm]["x"][i], s[dm]["mean"][i], bandwidth_range(rr, 2.0)


def bandwidth_table(rows_by_model: dict) -> str:
    """Per model, at the largest dimension: the bandwidth with the smallest mean error,
    that error, and the bandwidths whose mean error is within 2× of it."""
    found = list(_bandwidth(rows_by_model))
    rows = [(m, f"{best:g}", f"{err:.3f}", f"{lo:g}–{hi:g}")
            for m, _, best, err, (lo, hi) in found]
    dm = found[-1][1] if found else None  # the dimension of the last model
    head = [f"model (d = {dm})", "best σ", "its mean error", "σ within 2× of it"]
    return markdown_table(head, rows)


def bandwidth_values(rows_by_model: dict) -> dict[str, float]:
    """``bw_<model>_best_sigma``, ``_best``, ``_lo`` and ``_hi``: the numbers of
    :func:`bandwidth_table`."""
    out = {}
    for m, _, best, err, (lo, hi) in _bandwidth(rows_by_model):
        out |= {f"bw_{m}_best_sigma": float(best), f"bw_{m}_best": float(err),
                f"bw_{m}_lo": float(lo), f"bw_{m}_hi": float(hi)}
    return out


def _variants(study: dict):
    names = study["rows"]
    for name in [BASELINE] + [n for n in names if n != BASELINE]:
        r = names[name]
        k, w = r["kwng"], r["wng"]
        ratio = None if k["stopped_at"] else k["loss"][-1] / w["loss"][-1]
        yield name, r, ratio


def flow_study_table(study: dict) -> str:
    """One row per variant, :data:`BASELINE` first: its number of parameters ``q``, the
    median error at ``θ_0``, where KWNG stopped and its final loss over WNG's."""
    rows = [(name, r["q"], f"{r['median_error']:.3g}",
             r["kwng"]["stopped_at"] or "never",
             "—" if ratio is None else f"{ratio:.3g}")
            for name, r, ratio in _variants(study)]
    head = ["variant", "$q$", "error at $\\theta_0$", "KWNG stopped at",
            "loss KWNG / WNG"]
    return markdown_table(head, rows, align="lrrrr")


def flow_study_values(study: dict) -> dict[str, float]:
    """``fs_<variant>_err`` and, where KWNG ran to the end, ``fs_<variant>_ratio`` (the
    variant's name reduced to letters, digits and ``_``); ``study_wall``: the study's
    wall time (s)."""
    out = {}
    for name, r, ratio in _variants(study):
        key = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")
        out[f"fs_{key}_err"] = float(r["median_error"])
        if ratio is not None:
            out[f"fs_{key}_ratio"] = float(ratio)
    return out | {"study_wall": float(study["provenance"]["wall_time_s"])}
