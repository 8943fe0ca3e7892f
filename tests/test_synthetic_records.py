"""Audits of the committed synthetic results that ``book/experiments_synthetic.md``
reads.

The chapter glues the numbers of these records into its prose; what the prose says
about them is checked here (moved out of the chapter's cells).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from studies.toy import setup as synthetic_setup

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _rows(name):
    prov = json.loads((RESULTS / name / "provenance.json").read_text())
    return prov, {
        m: synthetic_setup.load_rows(RESULTS / name / f"{m}.csv")
        for m in prov["config"]["models"]
    }


@pytest.fixture(scope="module")
def relerr():
    return _rows("relerr")


def test_relerr_headline(relerr):
    prov, rows = relerr
    d_max = max(prov["config"]["dims"])
    for m, rr in rows.items():
        byN = synthetic_setup.summarise(rr, "N", "N")
        s = byN[d_max]
        slope = np.polyfit(np.log(s["x"]), np.log(s["mean"]), 1)[0]
        assert s["mean"][-1] < s["mean"][0] and slope < 0, m  # falls with N
    sphere = synthetic_setup.summarise(rows["sphere"], "N", "N")
    assert np.median(sphere[d_max]["errors"][-1]) < 0.2
    # median error at the largest N: flat in d on the sphere, not on the normal model
    med = [float(v["median"][-1]) for v in sphere.values()]
    assert max(med) < 0.01 and max(med) / min(med) < 2
    normal = synthetic_setup.summarise(rows["normal"], "N", "N")
    nmed = [float(v["median"][-1]) for _, v in sorted(normal.items())]
    assert nmed[-1] > 5 * nmed[0]
    logn = synthetic_setup.summarise(rows["lognormal"], "N", "N")[d_max]
    assert logn["mean"][-1] > 1 and logn["median"][-1] < 0.2


def test_relerr_threshold_in_M(relerr):
    _, rows = relerr
    thr = {}
    for m, rr in rows.items():
        s = synthetic_setup.summarise(rr, "M", "M")
        lo, hi = min(s), max(s)
        thr[m] = [
            int(s[d]["x"][np.argmax(s[d]["mean"] <= 1.5 * s[d]["mean"].min())])
            for d in (lo, hi)
        ]
        top = int(max(s[hi]["x"]))
    assert all(t[1] >= t[0] for t in thr.values())
    assert thr["sphere"][1] == thr["lognormal"][1] == top  # no plateau inside the grid
    assert thr["sphere"][0] == thr["normal"][0] == 30


def test_bandwidth_robustness():
    _, rows = _rows("bandwidth")
    best = {}
    for m, rr in rows.items():
        s = synthetic_setup.summarise(rr, "sigma", "bandwidth_spec")
        dm = max(s)
        best[m] = float(s[dm]["mean"].min())
        good = s[dm]["x"][s[dm]["mean"] <= 2 * s[dm]["mean"].min()]
        if m != "lognormal":
            assert good.min() <= 10 and good.max() >= 1000, m
        else:
            assert len(good) == 1
    assert all(np.isfinite(v) for v in best.values())
    assert best["lognormal"] > 0.5  # the log-normal model is not robust


def test_flow_record():
    flow = synthetic_setup.load_flow(RESULTS / "flow")
    wng = flow["loss"]["wng"]
    K = len(wng) - 1
    rate = np.exp(np.mean(np.log(wng[1:11] / wng[:10])))
    assert abs(rate - 0.64) < 0.02  # first-order prediction (1 - 2·0.1)²
    assert flow["loss"]["eg"][-1] > wng[min(K, 20)]
    big = flow["loss"]["kwng_N1024"]
    assert np.nanmin(big) < 1e-2 * big[0]


def test_flow_study_record():
    study = json.loads((RESULTS / "flow_study" / "flow_study.json").read_text())
    rows = study["rows"]
    assert rows["diagonal Σ, q = 20"]["kwng"]["stopped_at"] is None
    assert rows["bandwidth σ0 = 2"]["kwng"]["stopped_at"] is None
    assert rows["baseline (μ, vech L)"]["kwng"]["stopped_at"] is not None
    assert rows["paper's coordinates (μ, tril Σ)"]["kwng"]["stopped_at"] == 1
    same = {
        rows[n]["median_error"]
        for n in (
            "baseline (μ, vech L)",
            "damping D = I",
            "damping D = diag(TᵀT)",
            "ε = 1e-5",
        )
    }
    assert max(same) - min(same) < 1e-4  # equal to four digits
    assert study["provenance"]["wall_time_s"] > 0
