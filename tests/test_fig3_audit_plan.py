"""The Fig. 3 audit's own runs (results/cifar/fig3_audit/plan.json): the plan is
validated, turned into jobs with the right rule, and its readings (the grid's edge, the
reruns at the current code) come out right on records built from committed ones."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from studies.cifar.methods import LR_GRID
from studies.fig3 import audit as fig3_audit
from studies.fig3 import protocol as fig3
from studies.fig3.plan import audit_plan

ROOT = Path(__file__).resolve().parent.parent
FIG3 = ROOT / "results" / "cifar" / "fig3"
PLAN = ROOT / "results" / "cifar" / "fig3_audit" / "plan.json"
P = fig3.load_protocol(FIG3 / "protocol.json")
GOOD = {"conditioning": "ill", "methods": ["kwng"], "seeds": [0]}


@pytest.mark.parametrize("group, word", [
    ({**GOOD, "part": "extend", "lrs": [30]}, "part"),
    ({**GOOD, "part": "grid", "conditioning": "bad", "lrs": [30]}, "conditioning"),
    ({**GOOD, "part": "grid", "methods": ["nope"], "lrs": [30]}, "methods"),
    ({**GOOD, "part": "grid", "methods": [], "lrs": [30]}, "methods"),
    ({**GOOD, "part": "grid", "seeds": [0, 0], "lrs": [30]}, "seeds"),
    ({**GOOD, "part": "grid", "seeds": [True], "lrs": [30]}, "seeds"),
    ({**GOOD, "part": "grid", "lrs": [10]}, "outside the paper's grid"),
    ({**GOOD, "part": "grid", "lrs": [-3]}, "lrs"),
    ({**GOOD, "part": "repro", "lr_of": "nope"}, "lr_of"),
])
def test_a_bad_group_is_refused_by_name(group, word):
    with pytest.raises(ValueError, match=word):
        fig3_audit.audit_groups({"groups": [group]})
    with pytest.raises(ValueError, match="groups"):
        fig3_audit.audit_groups({"runs": []})


def test_the_committed_plan_gives_its_runs_with_the_rule_only_on_the_edge(tmp_path):
    spec = json.loads(PLAN.read_text())
    groups = fig3_audit.audit_groups(spec)
    (tmp_path / "plan.json").write_text(json.dumps(spec))
    common = {"epochs": 100}
    jobs = audit_plan(common, P, root=FIG3, out=tmp_path, spec=spec)
    want = sum(len(g["methods"]) * len(g["seeds"]) * len(g.get("lrs") or [0])
               for g in groups)
    assert len(jobs) == want
    for j in jobs:
        part = "grid" if "/grid/" in str(j["out"]) else "repro"
        assert (j["early_stop"] is not None) == (part == "grid"), j
        if part == "grid":
            assert float(j["lr"]) not in LR_GRID
        else:
            assert float(j["lr"]) in LR_GRID


def _copy(src: Path, dst: Path, edit=None) -> None:
    dst.mkdir(parents=True)
    rec = json.loads((src / "metrics.json").read_text())
    if edit:
        rec = edit(copy.deepcopy(rec))
    (dst / "metrics.json").write_text(json.dumps(rec))
    shutil.copy(src / "provenance.json", dst / "provenance.json")


def test_edge_runs_condemns_a_step_far_behind_its_siblings_and_spares_an_equal_one(
        tmp_path):
    src = FIG3 / "grid" / "lr10" / "cifar10" / "ill" / "kwng" / "seed0"

    def behind(rec):
        for r in rec["epochs"]:
            r["val_acc"] = r["test_acc"] = 0.35
        return rec
    _copy(src, tmp_path / "grid" / "lr30" / "cifar10" / "ill" / "kwng" / "seed0",
          behind)
    _copy(src, tmp_path / "grid" / "lr100" / "cifar10" / "ill" / "kwng" / "seed0")
    runs = {r["lr"]: r for r in fig3_audit.edge_runs(P, root=tmp_path, fig3_root=FIG3)}
    assert set(runs) == {30.0, 100.0}
    assert runs[30.0]["posthoc"]["reason"] == "behind"
    assert runs[30.0]["final"] == pytest.approx(0.35)
    # a copy of the selected run is behind nobody
    assert runs[100.0]["posthoc"] is None
    assert runs[100.0]["selected"] == 10.0
    assert runs[100.0]["best_val"] == pytest.approx(runs[100.0]["selected_val"])


def test_repro_runs_places_a_rerun_against_the_committed_spread(tmp_path):
    seeds = FIG3 / "seeds" / "lr10" / "cifar10" / "ill" / "kwng"
    dst = tmp_path / "repro" / "lr10" / "cifar10" / "ill" / "kwng"
    _copy(seeds / "seed1", dst / "seed0")

    def low(rec):
        rec["epochs"][-1]["test_acc"] = 0.5
        return rec
    _copy(seeds / "seed2", dst / "seed1", low)
    runs = {r["seed"]: r for r in fig3_audit.repro_runs(P, root=tmp_path,
                                                         fig3_root=FIG3,
                                                         seeds_root=None)}
    committed = [json.loads((FIG3 / d / "lr10/cifar10/ill/kwng" / s / "metrics.json")
                            .read_text())["epochs"][-1]["test_acc"]
                 for d, s in (("grid", "seed0"), ("seeds", "seed1"),
                              ("seeds", "seed2"))]
    assert runs[0]["spread"] == sorted(committed)
    assert runs[0]["committed"] == pytest.approx(committed[0])
    assert runs[0]["complete"] and runs[0]["within"] is True
    assert runs[1]["within"] is False


def test_check_audit_refuses_a_record_outside_the_plan(tmp_path):
    shutil.copy(PLAN, tmp_path / "plan.json")
    src = FIG3 / "seeds" / "lr10" / "cifar10" / "ill" / "kwng" / "seed1"
    _copy(src, tmp_path / "repro" / "lr10" / "cifar10" / "ill" / "kwng" / "seed7")
    res = fig3_audit.check_audit(tmp_path, P)
    assert [name for name, _ in res["bad"]] == ["repro/lr10/ill/kwng/seed7"]
    assert not res["ok"]


def test_the_phrases_say_whether_an_edge_step_beats_the_selection(tmp_path):
    src = FIG3 / "grid" / "lr10" / "cifar10" / "ill" / "kwng" / "seed0"

    def better(rec):
        for r in rec["epochs"]:
            r["val_acc"] = 0.95
        return rec
    _copy(src, tmp_path / "grid" / "lr30" / "cifar10" / "ill" / "kwng" / "seed0",
          better)
    runs = fig3_audit.edge_runs(P, root=tmp_path, fig3_root=FIG3)
    assert "lower bound and the verdict must be read" in fig3_audit.edge_phrase(runs)
    assert fig3_audit.edge_short(runs).endswith("the selection is a lower bound")
    assert fig3_audit.edge_short([]) == "not run yet"


def test_the_committed_edge_runs_leave_the_selections_standing():
    """The audit's round (results/cifar/fig3_audit): KWNG and KFAC at steps 30 and 100
    in IC; none beats its selected step 10, the step-100 runs stopped at chance (KWNG,
    live) or diverged (KFAC: its factor inverse failed in epoch 4)."""
    runs = {(r["method"], r["lr"]): r for r in fig3_audit.edge_runs(P)}
    assert set(runs) == {("kwng", 30.0), ("kwng", 100.0), ("kfac", 30.0),
                         ("kfac", 100.0)}
    assert runs[("kwng", 100.0)]["live"]["reason"] == "at chance"
    assert runs[("kfac", 100.0)]["diverged"] and runs[("kfac", 100.0)][
        "failed_epoch"] == 4
    assert all(r["best_val"] < r["selected_val"] for r in runs.values())
    assert fig3_audit.edge_short(list(runs.values())).endswith("the selections stand")
    rows = fig3_audit.repro_runs(P)
    kwng = [r for r in rows if r["method"] == "kwng"]
    assert len(kwng) == 1 and kwng[0]["within"] is True and kwng[0]["complete"]
    pending = fig3_audit.repro_pending()
    assert set(pending) <= {"ill/kwng_D_T/seed0"}  # the one rerun not yet run
    phrase = fig3_audit.repro_phrase(rows, pending)
    assert ("not yet run: ill/kwng_D_T/seed0" in phrase) == bool(pending)
    d_t = [r for r in rows if r["method"] == "kwng_D_T"]
    if d_t:  # its committed seed 0 ended at 64.25 %; the rerun 24 points higher
        assert d_t[0]["committed"] == 0.6425 and d_t[0]["final"] > 0.85
        said = "above" if d_t[0]["within"] is False else "inside"
        assert f"points {said}" in phrase or said == "inside"


def test_a_rerun_outside_the_committed_runs_says_by_how_much():
    row = {"cond": "ill", "method": "kwng", "lr": 10.0, "seed": 0, "final": 0.90,
           "complete": True, "committed": 0.80, "spread": [0.80, 0.85],
           "within": False}
    phrase = fig3_audit.repro_phrase([row], [])
    assert "5.00 points above the committed runs' 80.00–85.00 %" in phrase
    assert "its own seed's committed run: 80.00 %" in phrase
    low = {**row, "final": 0.70}
    assert "10.00 points below" in fig3_audit.repro_phrase([low], [])
