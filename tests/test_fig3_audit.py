"""The Fig. 3 record audited: the early-stop rule evaluated as written, live (a
sibling's later epochs count once they exist) and post hoc over the committed
records."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from studies.cifar import records, train
from studies.fig3 import clocks as fig3_time
from studies.fig3 import protocol as fig3
from studies.fig3 import verdicts
from studies.kit.wording import fixed, pct

ROOT = Path(__file__).resolve().parent.parent
FIG3 = ROOT / "results" / "cifar" / "fig3"
P = fig3.load_protocol(FIG3 / "protocol.json")


def _row(e: int, acc: float) -> dict:
    return {"epoch": e, "train_loss": 1.0, "val_acc": acc}


def test_live_rule_reads_a_slower_siblings_later_epochs():
    """A run 30 points behind at epoch 30 that trains faster than its sibling: when its
    epoch 35 ends the sibling has reached epoch 31 only. The latest-row comparison
    sees nothing; the run's earlier epochs against the sibling's rows stop it."""
    rows = [_row(e, 0.30) for e in range(1, 36)]
    sib = {"lr1": [_row(e, 0.60) for e in range(1, 32)]}
    assert fig3.stop_reason(rows[-1], sib, 10) is None
    got = fig3.stop_reason(rows[-1], sib, 10, rows=rows)
    assert got["reason"] == "behind" and got["epoch"] == 35
    assert got["compared_at"] == 30 and got["sibling"] == "lr1"
    # 24 points behind at every shared epoch: it goes on
    close = {"lr1": [_row(e, 0.54) for e in range(1, 32)]}
    assert fig3.stop_reason(rows[-1], close, 10, rows=rows) is None
    # epochs before 30 never count, however far behind
    early = {"lr1": [_row(e, 0.99) for e in range(1, 30)]}
    assert fig3.stop_reason(rows[-1], early, 10, rows=rows) is None


def test_posthoc_rule_condemns_the_three_runs_that_ran_on():
    post = verdicts.posthoc_stops(P, FIG3)
    ran_on = {k: v["posthoc"] for k, v in post.items()
              if v["posthoc"] and not v["live"]}
    assert {k: (v["reason"], v["epoch"], v["sibling"]) for k, v in ran_on.items()} == {
        "ill/sgd/lr10": ("behind", 40, "lr1"),
        "ill/sgd_momentum/lr1": ("behind", 31, "lr0.1"),
        "ill/ekfac_s10/lr10": ("behind", 30, "lr1")}
    for v in ran_on.values():
        assert v["sibling_val_acc"] - v["val_acc"] >= fig3.GAP
    # every run stopped live is condemned post hoc, for the same reason
    live = {k: v for k, v in post.items() if v["live"]}
    assert len(live) == 3
    for v in live.values():
        assert v["posthoc"] and v["posthoc"]["reason"] == v["live"]["reason"]
        assert v["posthoc"]["epoch"] <= v["live"]["epoch"]


def test_no_run_the_rule_condemns_is_a_selected_step():
    state = fig3.grid_state(P, FIG3)
    for k, v in verdicts.posthoc_stops(P, FIG3).items():
        cond, m, lr = k.split("/")
        if v["posthoc"]:
            assert f"lr{state[f'{cond}/{m}']['selected']:g}" != lr, k


# ------------------------------------------------------ identity against execution
def test_a_refused_capture_is_named_and_reported(tmp_path):
    """On a CPU a ``capture=True`` run executes eagerly: the record names the
    difference under ``ran_differs``; without that name the checker calls the record
    bad, with it the checker reports it."""
    if torch.cuda.is_available():
        pytest.skip("the case is about a machine without CUDA")
    cfg = {"source": "sample", "model": "tiny", "batch_size": 100, "epochs": 1,
           "lr": 0.1, "device": "cpu", "out": str(tmp_path / "res"),
           "checkpoint_dir": str(tmp_path / "ck"), "train_subset": 200,
           "method": "sgd", "capture": True}
    rec = train.run(cfg, progress=False)
    assert rec["capture"] is False and rec["identity"]["capture"] is True
    assert rec["ran_differs"] == {"capture": {"asked": True, "ran": False}}
    assert records.execution_differences(rec) == rec["ran_differs"]
    problem, note = records.execution_problem(rec)
    assert problem is None and note == "capture asked True ran False"
    unnamed = {k: v for k, v in rec.items() if k != "ran_differs"}
    problem, note = records.execution_problem(unnamed)
    assert note is None and "unnamed: capture asked True ran False" in problem
    same = train.run({**cfg, "capture": False, "out": str(tmp_path / "res2")},
                     progress=False)
    assert same["ran_differs"] == {} and records.execution_problem(same) == (None,
                                                                              None)


KFAC_CORRECTED = ("grid/lr10/cifar10/ill/kfac/seed0", "grid/lr1/cifar10/ill/kfac/seed0")


def test_the_two_kfac_records_name_their_eager_nchw_run_and_keep_their_numbers():
    res = fig3.check_fig3(FIG3, P)
    assert res["bad"] == []
    assert sorted(n for n, _ in res["differs"]) == ["grid/lr1/ill/kfac/seed0",
                                                    "grid/lr10/ill/kfac/seed0"]
    for run in KFAC_CORRECTED:
        rec = json.loads((FIG3 / run / "metrics.json").read_text())
        (fix,) = rec["corrections"]
        assert fix["fields"] == ["ran_differs"] and fix["date"] and fix["reason"]
        digest = hashlib.sha256(json.dumps(rec["epochs"], sort_keys=True).encode())
        assert digest.hexdigest() == fix["epochs_sha256"]
        assert rec["ran_differs"] == {k: {"asked": True, "ran": False}
                                      for k in ("capture", "channels_last")}
        assert rec["identity"]["capture"] is True and rec["capture"] is False


def test_the_kfac_correction_changed_only_its_named_fields():
    """Against the record as first committed: every field but ``ran_differs`` and
    ``corrections`` is equal (the accuracy numbers among them)."""
    if not (ROOT / ".git").exists():
        pytest.skip("no git history in this copy")
    for run in KFAC_CORRECTED:
        path = f"results/cifar/fig3/{run}/metrics.json"
        first = subprocess.run(
            ["git", "log", "--diff-filter=A", "--format=%H", "--", path], cwd=ROOT,
            capture_output=True, text=True, check=True).stdout.split()
        if not first:
            pytest.skip("a shallow clone lacks the record's first commit")
        old = json.loads(subprocess.run(
            ["git", "show", f"{first[-1]}:{path}"], cwd=ROOT, capture_output=True,
            text=True, check=True).stdout)
        new = json.loads((ROOT / path).read_text())
        assert {k: v for k, v in new.items()
                if k not in ("ran_differs", "corrections")} == old


# ------------------------------------------------------------ time to every threshold
def test_threshold_winners_on_a_known_curve():
    curve = {"thresholds": [70, 71, 72, 73, 74],
             "seconds": {"kwng": [5.0, 6.0, 9.0, 12.0, None],
                         "adam": [4.0, 7.0, 8.0, None, None]}}
    assert fig3_time.threshold_winners(curve, "kwng", "adam") == [
        ("adam", False, 70, 70), ("kwng", False, 71, 71), ("adam", False, 72, 72),
        ("kwng", True, 73, 73), (None, False, 74, 74)]


def test_time_curve_from_70_to_the_best_final_accuracy_on_one_clock():
    timed, _ = fig3_time.time_runs(P, FIG3)
    curve = fig3_time.time_to_thresholds(P, FIG3, runs=timed)
    assert curve["thresholds"] == list(range(70, 89)) and 88 < curve["best"] < 89
    # the ledger's 85 % is one point of the curve, on the same clock
    tta = fig3_time.seconds_to_accuracy(P, FIG3, runs=timed)
    for m in ("kwng", "adam"):
        assert curve["seconds"][m][85 - 70] == tta[f"ill/{m}"]["to"][0.85]
    assert fig3_time.threshold_winners(curve, "kwng", "adam") == [
        ("adam", False, 70, 87), ("kwng", True, 88, 88)]
    assert fig3_time.threshold_winners(curve, "kwng", "kfac") == [
        ("kwng", False, 70, 70), ("kwng", True, 71, 88)]


# ------------------------------------------------------------------ one rounding
def test_fixed_rounds_half_to_even_on_the_stated_value():
    assert [fixed(x) for x in (61.65, 61.75, 64.25, 64.35, -0.04)] == [
        "61.6", "61.8", "64.2", "64.4", "0.0"]
    assert fixed(2.675, 2) == "2.68" != f"{2.675:.2f}"  # the float lies below the tie
    assert fixed(230.5, 0) == "230" and fixed(231.5, 0) == "232"
    assert pct(0.6165) == "61.6" and pct(None) == "–" and pct(0.6165, 2) == "61.65"
    with pytest.raises(ValueError, match="digits"):
        fixed(1.0, -1)


def test_the_audited_ties_print_by_the_rule():
    summ = verdicts.seed_summary(P, FIG3)
    assert pct(summ["ill/ekfac_s10"]["mean"]) == "61.6"
    ab = {r["method"]: r for r in verdicts.ablation_rows(P, FIG3, seeds_root=False)}
    assert pct(ab["kwng_D_T"]["test"]) == "64.2"  # the protocol's one run
    assert pct(summ["ill/ekfac_s10"]["mean"], 2) == "61.65"


def test_the_two_chapters_print_record_numbers_through_one_helper():
    """No format spec rounds a number of the Fig. 3 chapter's cells or of the
    ledger's CIFAR section: they go through ``wording.fixed``."""
    fig3_page = (ROOT / "book" / "cifar_fig3.md").read_text()
    ledger = (ROOT / "book" / "claims.md").read_text()
    cifar = ledger[ledger.index("## CIFAR-10"):]
    assert not re.search(r":\.\d+f[}`]", fig3_page)
    assert not re.search(r":[+]?\.\d+f`", cifar)
