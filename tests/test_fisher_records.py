"""Audits of the committed Fisher–Rao study (``results/fisher/``) that
``book/fisher_rao.md`` reads: what its prose says about the records (moved out of the
chapter's cells)."""

from __future__ import annotations

from pathlib import Path

from kwng.theory.nystrom import loglog_slope
from studies.fisher import figures as P
from studies.fisher import flow as fisher_flow
from studies.fisher import sweep as fisher_sweep
from studies.kit.provenance import read_json

RESULTS = Path(__file__).resolve().parents[1] / "results" / "fisher"
NS = [250, 500, 1000, 2000, 4000]


def test_accuracy_next_to_kwng():
    rows = fisher_sweep.load_sweep(RESULTS / "sweep.csv")
    dens = [r for r in rows if r["panel"] == "N" and r["model"] != "sphere"]
    at, sl = {}, {}
    for col in P.ESTIMATORS:
        med = P.median_by(dens, col, ("model", "d", "N"))
        for m in ("normal", "lognormal"):
            for d in (2, 4):
                ys = [med[(m, d, N)][0] for N in NS]
                at[col, m, d], sl[col, m, d] = ys[-1], loglog_slope(NS, ys)
    for m in ("normal", "lognormal"):
        for d in (2, 4):
            assert at["err_fng", m, d] > 2 * at["err_wng", m, d]
            for col in ("err_fng_lam", "err_fng_score"):
                assert at[col, m, d] < 0.1 and sl[col, m, d] < -0.4
    # the M panel: the λ = 0 estimator gets worse as M grows (normal, d = 2)
    med = P.median_by(
        [r for r in rows if r["panel"] == "M"], "err_fng", ("model", "d", "M")
    )
    assert med[("normal", 2, 300)][0] > 2 * med[("normal", 2, 30)][0]


def test_flows_each_geometry_wins_on_its_divergence():
    flow = fisher_flow.load_flow(RESULTS / "flow.csv")
    fin = {loss: {m: v[-1] for m, v in c.items()} for loss, c in flow.items()}
    w2, kl = fin["w2"], fin["kl"]
    assert w2["wng"] < 1e-3 * w2["fng"] and w2["kwng"] < w2["kfng"]
    assert kl["fng"] < 1e-3 * kl["wng"] and kl["kfng"] < kl["kwng"]


def test_provenance_of_both_runs():
    for name in ("fisher-sweep", "fisher-flow"):
        prov = read_json(RESULTS / f"{name}.provenance.json")
        assert prov["git_commit"] and prov["device"] and prov["wall_time_total_s"] > 0
