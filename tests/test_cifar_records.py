"""Audits of the committed CIFAR records that the CIFAR chapter and its 6-epoch
appendix read.

The chapters glue the numbers of these records into their prose and show them as
tables; the checks that the records are complete, carry their provenance and still say
what the text was written against live here (moved out of the chapters, where they
were cell asserts).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from studies.cifar import methods, records
from studies.cifar import results as results_
from studies.claim_suite import records as claim_records
from studies.claim_suite import verdict as verdicts
from studies.study6 import records as study6_records

ROOT = Path(__file__).resolve().parents[1] / "results" / "cifar"
CLAIM = ROOT / "claim"
PARTIAL = ROOT / "claim_partial"


# --- the claim suite (book/experiments_cifar.md) ---


@pytest.fixture(scope="module")
def claim():
    results = results_.load_results(CLAIM, "cifar10")
    E = min(len(r["epochs"]) for r in results.values())
    at_E = records.at_epoch(results, E)
    return results, E, at_E


def test_claim_suite_complete(claim):
    results, E, _ = claim
    status = claim_records.check_claim(CLAIM, min_epochs=30)
    assert E == 30 and not any(status[k] for k in ("missing", "incomplete", "diverged"))
    assert len(results) == 18
    for key in results:
        cond, method, seed = key
        prov = json.loads(
            (
                CLAIM / "cifar10" / cond / method / f"seed{seed}" / "provenance.json"
            ).read_text()
        )
        assert prov["git_commit"] and prov["device"] and prov["date"], key


def test_claim_selection_grid():
    sel = json.loads((CLAIM / "selection" / "selected.json").read_text())
    assert sel["grid"] == list(methods.LR_GRID)


def test_claim_verdict_numbers(claim):
    _, _, at_E = claim
    v = verdicts.claim_verdict(at_E)
    pct = {k: round(100 * v[k], 1) for k in ("kwng_well", "kwng_ill", "sgd_ill")}
    assert pct == {"kwng_well": 86.0, "kwng_ill": 70.2, "sgd_ill": 44.3}, pct
    assert not v["a_within"] and v["b_above_sgd"] and not v["c_small_classes"]
    assert v["holds"] is False
    assert max(v["per_class_ill"][:2]) < 0.01 and min(v["per_class_well"][:2]) > 0.9
    table = records.final_accuracy_table(at_E, methods=methods.CLAIM_ALL)
    ill = {m: round(100 * table[m]["ill"]["mean"], 1) for m in table}
    assert (ill["diag_Ttilde"], ill["adam"], ill["kfac"]) == (70.1, 60.6, 63.3), ill
    drops = {m: round(100 * d, 1) for m, d in v["drops"].items() if d is not None}
    assert drops == {
        "sgd": 43.4,
        "sgd_momentum": 42.6,
        "adam": 28.2,
        "kfac": 26.9,
        "kwng": 15.8,
        "kwng_samples_before_U": 47.0,
        "diag_Ttilde": 19.2,
    }, drops


def test_claim_wc_kwng_and_samples_before_u_are_one_algorithm(claim):
    results, _, at_E = claim
    # with U = I the samples before and after U are the same: only the step differs
    lr = {m: results[("well", m, 0)]["lr"] for m in ("kwng", "kwng_samples_before_U")}
    assert lr == {"kwng": 0.1, "kwng_samples_before_U": 1.0}, lr
    table = records.final_accuracy_table(at_E, methods=methods.CLAIM_ALL)
    assert round(100 * table["kwng_samples_before_U"]["well"]["mean"], 1) == 88.4


def test_claim_eps_dynamics_records(claim):
    results, _, _ = claim
    for (cond, m, seed), r in results.items():
        if m != "kwng":
            continue
        ratio = records.diag_series(r, "reduction_ratio")[1:]
        assert -0.35 < ratio.min() and ratio.max() < 0.15, (cond, seed)
        assert records.diag_series(r, "clipped").min() == 1.0
        if cond == "well":
            assert (ratio < 0).all()
    pilot = results_.load_results(PARTIAL, "cifar10")
    for cond in ("ill", "well"):
        r = pilot[(cond, "kwng_lm_same_batch", 0)]
        ratio = records.diag_series(r, "reduction_ratio")[:5]
        assert len(r["epochs"]) == 5 and 1.0 < ratio.min() and ratio.max() < 1.6


# --- the earlier 6-epoch study (book/cifar_6epoch.md) ---


STUDY6 = study6_records.study6_table()


@pytest.fixture(scope="module")
def six():
    results = results_.load_results(ROOT, "cifar10")
    table = records.final_accuracy_table(
        results, STUDY6["main_methods"] + STUDY6["ablations"]
    )
    return results, table


def _final(table, cond, method):
    return table[method][cond]["mean"]


def test_six_epoch_records_complete(six):
    results, _ = six
    status = study6_records.check_results(ROOT, "cifar10")
    sched = json.loads((ROOT / "schedule.json").read_text())
    assert len(results) == len(STUDY6["runs"]) == 38
    assert (
        not status["missing"] and not status["incomplete"] and len(status["ok"]) == 36
    )
    assert sorted(status["cut"]) == sorted(study6_records.BUDGET_CUT)
    assert set(study6_records.BUDGET_CUT.values()) == {3}
    E = sched["epochs"]
    assert E == 6 and {tuple(r["milestones"]) for r in results.values()} == {(3, 4)}
    assert {r["clip_norm"] for r in results.values()} == {1.0}
    batch = {m: r["batch_size"] for (_, m, _), r in results.items()}
    assert {m for m, b in batch.items() if b != 128} == {"kwng_bigbatch"}
    assert batch["kwng_bigbatch"] == 512
    assert all(r["config"]["epochs"] == E for r in results.values())
    for c, m, s in results:
        prov = json.loads(
            (ROOT / "cifar10" / c / m / f"seed{s}" / "provenance.json").read_text()
        )
        assert re.search(r"--offset (\d+)", prov["command"]), (c, m, s)


def test_six_epoch_step_sizes(six):
    results, _ = six
    sel = json.loads((ROOT / "selection" / "selected.json").read_text())
    for (c, m, _), r in results.items():
        # the recorded lr is the value after the epoch's scheduler step
        lrs = [row["lr"] for row in r["epochs"]]
        assert np.allclose(
            lrs, [r["lr"] * f for f in (1, 1, 0.1, 0.01, 0.01, 0.01)][: len(lrs)]
        )
        src = sel["inherit"].get(m, m)
        assert r["lr"] == sel["selected"][f"cifar10/{c}/{src}"]["lr"], (c, m)
    best_ill = max(v["val_acc"] for k, v in sel["selected"].items() if "/ill/" in k)
    assert best_ill < 0.3
    assert all(
        sel["selected"][f"cifar10/{c}/adam"]["lr"] == min(sel["grid"])
        for c in ("ill", "well")
    )


def test_six_epoch_final_table(six):
    results, table = six
    seeded = ("sgd", "adam", "kwng")
    assert all(table[m][c]["n"] == 3 for m in seeded for c in ("ill", "well"))
    assert all(
        e["n"] == 1 for m, row in table.items() if m not in seeded for e in row.values()
    )
    assert {
        m for m, row in table.items() if any(not e["complete"] for e in row.values())
    } == {"kwng_m20"}
    assert not any(e["diverged"] for row in table.values() for e in row.values())
    assert all(
        r["epochs"][-1]["fallbacks"] == 0
        for r in results.values()
        if "fallbacks" in r["epochs"][-1]
    )
    assert max(e["std"] for m in seeded for e in table[m].values()) < 0.01


def test_six_epoch_timing(six):
    results, _ = six
    timing = json.loads((ROOT / "timing" / "timing.json").read_text())
    assert {r.split("/")[1] for r in STUDY6["runs"]} <= set(timing["methods"])
    slow = []
    for m, t in timing["methods"].items():
        shared = [
            r["epochs"][-1]["time_train"] / r["epochs"][-1]["steps"]
            for (_, mm, _), r in results.items()
            if mm == m
        ]
        slow.append(np.mean(shared) / t["sec_per_step"])
    assert min(slow) > 2
    sec = {m: t["sec_per_step"] for m, t in timing["methods"].items()}
    assert (
        4.5 < sec["kwng"] / sec["sgd"] < 6.5
        and 2.5 < sec["kwng_m20"] / sec["kwng"] < 3.5
    )


def test_six_epoch_ablation(six):
    _, table = six
    k_ill = _final(table, "ill", "kwng")
    abl = {m: _final(table, "ill", m) for m in STUDY6["ablations"]}
    assert all(abs(a - k_ill) < 0.03 for a in abl.values())
    assert max(abl, key=abl.get) == "kwng_damping_identity"
    assert abl["kwng_damping_identity"] - k_ill > 0.01
    assert all(
        abs(abl[m] - k_ill) < 0.01
        for m in (
            "diag_T",
            "diag_Ttilde",
            "kwng_damping_T",
            "kwng_rq",
            "kwng_scaled_logits",
        )
    )


def test_six_epoch_eps_floor_and_clipping(six):
    results, _ = six
    first_floor = {}
    for k, r in results.items():
        if "eps" in r["epochs"][0]:
            at = [
                i + 1
                for i, row in enumerate(r["epochs"])
                if row["eps"] <= 1e-10 * (1 + 1e-6)
            ]
            first_floor[k] = at[0] if at else None
    b128 = {
        k: v
        for k, v in first_floor.items()
        if results[k]["batch_size"] == 128 and k[1] != "kwng_m20"
    }
    assert all(v is not None and v <= 5 for v in b128.values())
    assert sum(v <= 4 for v in b128.values()) >= len(b128) // 2
    assert all(
        v is None
        for k, v in first_floor.items()
        if k[1] in ("kwng_bigbatch", "kwng_m20")
    )
    assert all(
        results[k]["epochs"][-1]["eps"] < 1e-8
        for k in first_floor
        if k[1] != "kwng_m20"
    )
    assert all(
        results[k]["epochs"][0]["eps"] < 1e-9
        for k in first_floor
        if k[1] == "kwng_momentum"
    )
    assert all(
        row["clipped"] == row["steps"]
        for k in first_floor
        for row in results[k]["epochs"]
    )


def test_six_epoch_claims(six):
    results, table = six
    full = [m for m in STUDY6["main_methods"] if m != "kwng_m20"]
    euclid = ["sgd", "sgd_momentum", "sgd_momentum_wd", "adam"]
    well = {m: _final(table, "well", m) for m in full}
    ill = {m: _final(table, "ill", m) for m in full}
    drop = {m: well[m] - ill[m] for m in full}
    # (i) not similar; (ii) holds; (iii) does not hold; (v) KFAC drops, stays best
    assert max(well.values()) - min(well.values()) > 0.10
    assert max(well.values()) - well["kwng"] > 0.10
    assert all(drop[m] > 0.30 for m in euclid)
    assert all(abs(drop["kwng"] - drop[m]) < 0.05 for m in euclid)
    assert ill["kwng"] / well["kwng"] < 0.5
    assert table["kwng"]["ill"]["max"] < table["sgd"]["ill"]["min"]
    assert drop["kfac"] > 0.30
    assert max(well, key=well.get) == max(ill, key=ill.get) == "kfac"
    assert all(0.25 < a < 0.5 for a in ill.values())
    assert drop["kwng_momentum"] == max(drop.values()) < 0.55
    assert min(drop.values()) > 0.30
    assert (
        max(("kwng", "kwng_momentum", "kwng_bigbatch"), key=well.get) == "kwng_momentum"
    )
    assert all(
        abs(r["epochs"][5]["test_acc"] - r["epochs"][4]["test_acc"]) < 0.01
        for r in results.values()
        if r["complete"]
    )
    # (iv) M = 20 within two points of the M = 5 seeds after epoch 3
    for c in ("ill", "well"):
        m20 = results[(c, "kwng_m20", 0)]["epochs"][2]["test_acc"]
        k5 = [results[(c, "kwng", s)]["epochs"][2]["test_acc"] for s in range(3)]
        assert min(k5) - 0.02 < m20 < max(k5) + 0.02
