"""The claims ledger's rules (kwng.experiments.claims) on made-up numbers, and its
reading of the committed records."""

from __future__ import annotations

from kwng.experiments import claims

WORDS = {"holds", "fails", "partly"}


def test_mixed_verdict_and_flat():
    assert claims.mixed_verdict({"a": True, "b": True}) == "holds"
    assert claims.mixed_verdict({"a": False, "b": False}) == "fails"
    assert claims.mixed_verdict({"a": True, "b": False}) == "partly"
    assert claims.flat({"x": {"y": 1, "z": [1]}, "w": 2}, "p") == {"p_x_y": 1,
                                                                  "p_w": 2}


def test_synthetic_verdicts_follow_their_stated_rules():
    sph = {"falls": True, "median_dmax": 0.01, "median_dmin": 0.006, "thr_lo": 30,
           "thr_hi": 1000, "M_max": 1000}
    relerr = {"models": {"sphere": sph, "normal": {"falls": True, "mean": 0.2},
                         "lognormal": {"falls": False, "mean": 1.8}}}
    flow = {"methods": {"wng": {"loss": 0.1}, "eg": {"loss": 0.8},
                        "v1": {"diverged": False}, "v2": {"diverged": True}},
            "variants": ["v1", "v2"]}
    v = claims.synthetic_verdicts(relerr, {"verdict": "partly"}, flow)
    assert v == {"fig1_N": "holds", "fig1_d": "holds", "fig1_M": "partly",
                 "fig4": "partly", "fig5": "partly", "fig2_wng": "holds",
                 "fig2_kwng": "partly"}


def test_the_ledger_reads_the_committed_records():
    v = claims.synthetic_verdicts(claims.relerr_numbers(),
                                  claims.bandwidth_numbers(), claims.flow_numbers())
    assert set(v.values()) <= WORDS
    fig3 = claims.cifar_fig3_verdict()
    assert fig3["verdict"] == "pending" or not fig3["counts"].get("pending")
    assert set(fig3["queue"]) == {"grid", "seeds", "ablation"}
    from kwng.experiments.cifar.methods import METHODS

    for m, v in fig3["per_baseline"].items():
        assert f"{v['verdict']} against" in fig3["by_baseline"]
        assert METHODS[m].label in fig3["by_baseline"]
