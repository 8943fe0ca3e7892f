"""The amortized-step study's committed records (results/cifar/amortized) and their
reading as time to accuracy (studies.fig3.amortized.readings)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from studies.cifar.methods import METHODS
from studies.fig3 import clocks as fig3_time
from studies.fig3 import protocol as fig3
from studies.fig3 import verdicts
from studies.fig3.amortized import fallbacks, seed_study
from studies.fig3.amortized import readings as amortized
from studies.fig3.amortized.seed_study import AMORTIZED_METHODS
from studies.kit.provenance import ResultFileError

ROOT = Path(__file__).resolve().parent.parent
FIG3 = ROOT / "results" / "cifar" / "fig3"
AM = ROOT / "results" / "cifar" / "amortized"
P = fig3.load_protocol(FIG3 / "protocol.json")


def test_every_record_keeps_the_protocol_at_kwngs_selected_step_from_one_round():
    runs = seed_study.amortized_runs(P, AM)
    assert runs, "no amortized record committed"
    state = fig3.grid_state(P, FIG3)
    rounds = fig3.rounds(FIG3)
    for (cond, m, seed), rec in runs.items():
        assert m in AMORTIZED_METHODS and seed == 0
        assert rec["lr"] == state[f"{cond}/kwng"]["selected"], (cond, m)
        spec = rec["method_spec"]
        assert spec["refresh_every"] == METHODS[m].settings["refresh_every"] > 1
        prov = json.loads((AM / f"lr{rec['lr']:g}" / "cifar10" / cond / m / "seed0"
                           / "provenance.json").read_text())
        rd = fig3.round_of(prov, rounds)
        assert rd is not None and rd["alone"], (cond, m)
        assert [e["epoch"] for e in rec["epochs"]] == list(
            range(1, len(rec["epochs"]) + 1))
        assert rec["complete"] == (len(rec["epochs"]) == P["settings"]["epochs"])


@pytest.mark.parametrize("clock", ["auto", "own"])
def test_time_rows_agree_with_the_records_they_read(clock):
    """On the runs' own clock a row's seconds are the records' ``time_train``; on the
    trainer timing's (committed, so ``"auto"`` picks it) they are the steps taken
    times the method's step time in that record."""
    runs = seed_study.amortized_runs(P, AM)
    rows = amortized.time_rows(P, FIG3, AM, clock=clock)
    assert {r["clock"] for r in rows} == {
        "auto": {"trainer-timing"}, "own": {"alone"}}[clock]
    ms = fig3_time.step_ms(json.loads(fig3_time.TIMING.read_text()))
    by = {(r["cond"], r["method"]): r for r in rows}
    for (cond, m, _), rec in runs.items():
        r, e = by[(cond, m)], rec["epochs"]
        assert r["k"] == METHODS[m].settings["refresh_every"]
        assert r["epochs"] == len(e) and r["complete"] == rec["complete"]
        hit = next((x for x in e if x["test_acc"] >= 0.85), None)
        want = None if hit is None else (
            hit["time_train"] if clock == "own" else hit["steps"] * ms[m] / 1e3)
        assert r["s_to_85"] == pytest.approx(want)
        if hit is not None and clock == "own":
            assert r["steady_s_to_85"] == pytest.approx(
                hit["time_train"] - e[0]["time_train"] + r["s_per_epoch"])
        assert (r["final"] is None) == (not rec["complete"])
        assert r["last"] == e[-1]["test_acc"]
    # the reference rows: exact KWNG (k = 1) and Adam, selections final, runs alone
    for cond in ("ill", "well"):
        assert by[(cond, "kwng")]["k"] == 1 and by[(cond, "adam")]["runs"] >= 1
    state = fig3.grid_state(P, FIG3)
    assert all(state[f"{r['cond']}/{r['method']}"]["final"] for r in rows
               if r["method"] not in AMORTIZED_METHODS)
    assert len(amortized.time_table(rows)[0]) == len(amortized.TIME_HEADER)


def test_the_goal_needs_both_halves():
    rows = amortized.time_rows(P, FIG3, AM)
    goal = amortized.amortized_goal(P, rows, FIG3)
    exact = verdicts.seed_summary(P, FIG3)["ill/kwng"]
    assert goal["floor"] == pytest.approx(exact["mean"] - exact["range"])
    by = {r["method"]: r for r in rows if r["cond"] == "ill"}
    for m, v in goal["methods"].items():
        assert v["faster"] == (by[m]["s_to_85"] is not None
                               and by[m]["s_to_85"] < goal["adam_s"])
        assert v["met"] == bool(v["faster"] and v["within"])
    # the same rows with every amortized run slower than Adam: nothing meets it
    slow = [{**r, "s_to_85": goal["adam_s"] + 1} if r["method"] in AMORTIZED_METHODS
            else r for r in rows]
    assert amortized.amortized_goal(P, slow, FIG3)["met"] == []
    # and with every final below the floor
    low = [{**r, "final": goal["floor"] - 1e-3} if r["method"] in AMORTIZED_METHODS
           and r["final"] is not None else r for r in rows]
    assert amortized.amortized_goal(P, low, FIG3)["met"] == []


def test_the_goal_refuses_an_unknown_conditioning_and_rows_without_adam():
    with pytest.raises(ValueError, match="clock must be"):
        amortized.time_rows(P, FIG3, AM, clock="wall")
    rows = amortized.time_rows(P, FIG3, AM)
    with pytest.raises(ValueError, match="cond must be"):
        amortized.amortized_goal(P, rows, FIG3, cond="bad")
    with pytest.raises(ValueError, match="no Adam run"):
        amortized.amortized_goal(P, [r for r in rows if r["method"] != "adam"], FIG3)


def test_a_record_in_the_wrong_step_folder_is_named(tmp_path):
    src = next(AM.glob("lr10/cifar10/ill/*/seed0"))
    dst = tmp_path / "lr1" / "cifar10" / "ill" / src.parent.name / "seed0"
    shutil.copytree(src, dst)
    with pytest.raises(ResultFileError, match="metrics.json: step 10"):
        seed_study.amortized_runs(P, tmp_path)


def test_the_seed_study_plan_runs_every_group_at_its_selected_step(tmp_path):
    """The committed seed-study plan: each group's methods × seeds once, at the Fig. 3
    step of its ``lr_of`` method in its conditioning, in the plan's order; a finished
    record leaves the plan; a malformed group is refused by name."""
    from studies.fig3 import protocol as fig3
    from studies.fig3.amortized import plan as plans
    from studies.fig3.amortized import seed_study

    p = fig3.load_protocol(ROOT / "results" / "cifar" / "fig3" / "protocol.json")
    fig3_root = ROOT / "results" / "cifar" / "fig3"
    spec = json.loads((ROOT / "results" / "cifar" / "amortized_seeds" / "plan.json")
                      .read_text())
    state = fig3.grid_state(p, fig3_root)
    jobs = plans.amortized_seeds_plan({}, p, fig3_root, out=tmp_path, spec=spec)
    want = [(g["conditioning"], m, s) for g in seed_study.seed_study_groups(spec)
            for s in g["seeds"] for m in g["methods"]]
    assert [(j["conditioning"], j["method"], j["seed"]) for j in jobs] == want
    lr_of = {(g["conditioning"], m): g["lr_of"]
             for g in seed_study.seed_study_groups(spec) for m in g["methods"]}
    for j in jobs:
        key = f"{j['conditioning']}/{lr_of[j['conditioning'], j['method']]}"
        assert j["lr"] == state[key]["selected"]
    first = jobs[0]
    rdir = (tmp_path / f"lr{first['lr']:g}" / "cifar10" / first["conditioning"]
            / first["method"] / f"seed{first['seed']}")
    rdir.mkdir(parents=True)
    (rdir / "metrics.json").write_text(json.dumps(
        {"complete": True, "epochs": [{"epoch": e} for e in range(1, 101)]}))
    again = plans.amortized_seeds_plan({}, p, fig3_root, out=tmp_path, spec=spec)
    assert len(again) == len(jobs) - 1
    bad = {"groups": [{**spec["groups"][0], "seeds": [0, 0]}]}
    with pytest.raises(ValueError, match="seeds must be distinct"):
        seed_study.seed_study_groups(bad)
    with pytest.raises(ValueError, match="methods must be names"):
        seed_study.seed_study_groups(
            {"groups": [{**spec["groups"][0], "methods": ["x"]}]})


def _run_row(cond, method, seed, final, s85, clock="trainer-timing", complete=True):
    return {"cond": cond, "method": method, "seed": seed, "final": final,
            "complete": complete, "stalled": complete and final < 0.8,
            "s_to_85": s85, "clock": clock}


def test_the_recommendation_bar_needs_every_run_and_names_what_failed():
    """``seed_bar``: 5 ill- and 3 well-conditioned runs with no stall, every
    ill-conditioned run at 87.5 % or more and at 85 % before Adam's median (72 s
    here); one stall, one slow run, one low final or one run on another clock fails
    it; fewer runs leave it undecided."""
    adam = [_run_row("ill", "adam", s, 0.875, t) for s, t in enumerate((70, 72, 75))]
    good = ([_run_row("ill", "kwng_k20", s, 0.88, 50 + s) for s in range(5)]
            + [_run_row("well", "kwng_k20", s, 0.88, 30) for s in range(3)])
    bar = seed_study.seed_bar(adam + good)["kwng_k20"]
    assert bar["met"] is True and bar["adam_median_s"] == 72 and not bar["failed"]
    assert seed_study.seed_bar(adam + good[:4] + good[5:])["kwng_k20"]["met"] is None
    for i, change, why in ((2, {"final": 0.3, "stalled": True}, "stalled"),
                           (1, {"s_to_85": 72}, "after Adam's median"),
                           (0, {"final": 0.874}, "below 87.5%"),
                           (3, {"clock": "own"}, "another clock")):
        runs = adam + [{**r, **change} if j == i else r for j, r in enumerate(good)]
        bar = seed_study.seed_bar(runs)["kwng_k20"]
        assert bar["met"] is False and any(why in f for f in bar["failed"]), bar
    assert "adam" not in seed_study.seed_bar(adam + good)


def test_a_traced_run_takes_the_untraced_runs_steps_and_traces_every_step(tmp_path,
                                                                          monkeypatch):
    """``stale_trace``: 2 epochs of the tiny CNN with k = 3; the traced run's epoch
    rows equal an untraced run's bit for bit (the twin's forward passes, basis draws
    and gradients leave the run alone); one row a step, the fresh-direction cosines
    on the steps between refreshes only, every cosine in [-1, 1]; a second trace into
    the same folder is refused."""
    import csv
    import math

    from studies.cifar import train
    from studies.fig3.amortized import stale_trace

    monkeypatch.chdir(tmp_path)
    settings = {"source": "sample", "model": "tiny", "batch_size": 50, "epochs": 2,
                "lr": 0.1, "device": "cpu", "method": "kwng_k5", "train_subset": 200,
                "val_size": 50, "eval_test": True, "schedule": "authors", "seed": 1}
    tr = stale_trace.trace_run(settings, tmp_path / "traced")
    plain = train.run({**settings, "out": "plain", "checkpoint_dir": "ck"},
                      progress=False)
    timing = ("time_train", "time_eval", "time_unix")
    traced = json.loads(next((tmp_path / "traced" / "run").glob(
        "**/metrics.json")).read_text())
    for a, b in zip(traced["epochs"], plain["epochs"], strict=True):
        assert {k: v for k, v in a.items() if k not in timing} == {
            k: v for k, v in b.items() if k not in timing}
    rows = list(csv.DictReader((tmp_path / "traced" / "trace.csv").open()))
    assert len(rows) == len(tr.rows) == plain["epochs"][-1]["steps"] == 8
    assert [int(r["refresh"]) for r in rows] == [1, 0, 0, 0, 0, 1, 0, 0]
    for r in rows:
        fresh = [float(r[k]) for k in ("cos_fresh", "cos_g_fresh", "cos_fresh_pair")]
        if r["refresh"] == "1":
            assert all(math.isnan(v) for v in fresh)
        else:
            assert all(-1 - 1e-9 <= v <= 1 + 1e-9 for v in fresh)
    assert (tmp_path / "traced" / "provenance.json").exists()
    with pytest.raises(FileExistsError, match="never overwritten"):
        stale_trace.trace_run(settings, tmp_path / "traced")
    # the reader, the summary by the system's age and the figure
    read = stale_trace.read_trace(tmp_path / "traced" / "trace.csv")
    assert [r["refresh"] for r in read] == [1, 0, 0, 0, 0, 1, 0, 0]
    ages = stale_trace.by_age(read)
    assert [(a["age"], a["steps"]) for a in ages] == [(1, 2), (2, 2), (3, 1), (4, 1)]
    assert all(-1 - 1e-9 <= a["cos_fresh"] <= 1 + 1e-9 for a in ages)
    from studies.fig3.amortized.figures import fig_trace

    fig = fig_trace(read, ages, title="tiny CNN, k = 5")
    assert len(fig.axes) == 3
    (tmp_path / "bad.csv").write_text("step,loss\n0,1.0\n")
    with pytest.raises(ValueError, match="lacks the trace columns"):
        stale_trace.read_trace(tmp_path / "bad.csv")


def test_the_committed_seed_study_records_follow_its_plan_and_name_their_round():
    """``cifar check --suite amortized_seeds`` on the committed records: none bad or
    unfinished; each names a round of ``rounds.json`` (its git commit), whose record
    count matches; the plan was committed before the first record started."""
    import subprocess
    from datetime import datetime

    root = ROOT / "results" / "cifar" / "amortized_seeds"
    res = seed_study.check_seed_study(root)
    assert not res["bad"] and not res["incomplete"] and res["ok"]
    rounds = json.loads((root / "rounds.json").read_text())["rounds"]
    provs = [json.loads(f.read_text())
             for f in root.glob("lr*/cifar10/*/*/seed*/provenance.json")]
    assert len(provs) == len(res["ok"]) == sum(r["records"] for r in rounds)
    for r in rounds:
        mine = [p for p in provs if p["git_commit"].startswith(r["git_commit"][:7])]
        assert len(mine) == r["records"], r["round"]
    try:
        dates = subprocess.run(
            ["git", "log", "--format=%cI", "--",
             "results/cifar/amortized_seeds/plan.json"],
            capture_output=True, text=True, check=True, cwd=ROOT).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git history")
    if not dates:
        pytest.skip("a shallow clone lacks the plan's commit")
    first = datetime.fromisoformat(dates[-1])
    assert all(datetime.fromisoformat(p["date"]) > first for p in provs)


def test_summary_values_print_one_number_for_one_run_and_a_range_for_more():
    ss = seed_study
    row = {"cond": "ill", "method": "kwng_k5", "runs": 1, "stalls": 0, "min": 0.8863,
           "max": 0.8863, "median_s_to_85": 54.0, "worst_s_to_85": 54.0}
    two = {**row, "method": "kwng_k20", "runs": 2, "max": 0.889,
           "worst_s_to_85": 60.0}
    v = ss.summary_values([row, two], [])
    assert v["ill_kwng_k5_range"] == "88.6"
    assert v["ill_kwng_k5_s85"] == ss.seconds_text(54.0)
    assert v["ill_kwng_k20_range"] == "88.6–88.9"
    assert v["ill_kwng_k20_s85"] == f"{ss.seconds_text(54.0)} / {ss.seconds_text(60.0)}"


def test_a_setting_that_stalled_in_ic_loses_its_wc_runs(tmp_path):
    """The issue's rule: WC seeds only for the settings still in the running. A
    finished ill-conditioned run below the plan's stall bar takes its method's
    well-conditioned runs out of the plan, and no other run."""
    from studies.fig3 import protocol as fig3
    from studies.fig3.amortized import plan as plans

    p = fig3.load_protocol(ROOT / "results" / "cifar" / "fig3" / "protocol.json")
    fig3_root = ROOT / "results" / "cifar" / "fig3"
    spec = json.loads((ROOT / "results" / "cifar" / "amortized_seeds" / "plan.json")
                      .read_text())
    before = plans.amortized_seeds_plan({}, p, fig3_root, out=tmp_path, spec=spec)
    rdir = tmp_path / "lr10" / "cifar10" / "ill" / "kwng_k5" / "seed4"
    rdir.mkdir(parents=True)
    rows = [{"epoch": e, "test_acc": 0.3} for e in range(1, 101)]
    (rdir / "metrics.json").write_text(json.dumps({"complete": True, "epochs": rows}))
    assert plans.out_of_running(spec, tmp_path, 100) == {"kwng_k5"}
    after = plans.amortized_seeds_plan({}, p, fig3_root, out=tmp_path, spec=spec)
    gone = {(j["conditioning"], j["method"], j["seed"]) for j in before} - {
        (j["conditioning"], j["method"], j["seed"]) for j in after}
    assert gone == {("ill", "kwng_k5", 4)} | {("well", "kwng_k5", s) for s in (0, 1, 2)}


def _row(step: int, refresh: int, loss: float, fallback: int, cos: float) -> dict:
    return {"step": step, "refresh": refresh, "loss": loss, "eps": 1e-3 / (step + 1),
            "ratio": 0.5, "fallback": fallback, "clipped": 1, "rank": 5, "cos_g": 0.1,
            "cos_fresh": float("nan") if refresh else cos, "cos_g_fresh": 0.2,
            "cos_fresh_pair": float("nan") if refresh else 0.5}


def test_a_trace_reads_by_epoch_and_counts_loss_jumps_after_fallbacks():
    from studies.fig3.amortized import stale_trace

    rows = [_row(0, 1, 2.0, 0, 0.0), _row(1, 0, 2.0, 1, 0.1), _row(2, 0, 5.0, 0, 0.3),
            _row(3, 1, 5.0, 0, 0.0), _row(4, 0, 6.0, 1, 0.2), _row(5, 0, 1.0, 0, 0.4)]
    ep = stale_trace.by_epoch(rows, 2)
    assert [(e["epoch"], e["steps"], e["fallbacks"]) for e in ep] == [(1, 3, 1),
                                                                       (2, 3, 1)]
    assert ep[0]["loss"] == 2.0 and ep[1]["loss"] == 5.0
    assert ep[0]["cos_fresh"] == pytest.approx(0.2) and ep[1]["eps"] == rows[5]["eps"]
    header, table = stale_trace.trace_table(ep)
    assert header == stale_trace.TRACE_HEADER and table[0][:3] == ("1", "2.00", "1")
    # 2.0 -> 5.0 after a fallback; 5.0 -> 5.0, 5.0 -> 6.0 and 2.0 -> 2.0 not jumps;
    # 6.0 -> 1.0 after a fallback is a fall
    assert stale_trace.loss_jumps(rows) == {"after_fallback": 1, "fallback_steps": 2,
                                            "after_other": 0, "other_steps": 3}
    with pytest.raises(ValueError, match="epochs must be >= 1 and divide the 6 rows"):
        stale_trace.by_epoch(rows, 4)
    with pytest.raises(ValueError, match="factor must be > 1"):
        stale_trace.loss_jumps(rows, 1.0)
    first = stale_trace.first_fallbacks(rows, 5)
    assert [(f["step"], f["loss"], f["next_loss"]) for f in first] == [(1, 2.0, 5.0),
                                                                        (4, 6.0, 1.0)]
    assert first[0]["clipped"] is True
    with pytest.raises(ValueError, match="n must be >= 1"):
        stale_trace.first_fallbacks(rows, 0)


def test_the_committed_trace_is_a_stalling_k100_run_read_by_the_chapter():
    """results/cifar/amortized_seeds/trace: kwng_k100 seed 2 (a seed that stalled in the
    study), 4 epochs; the chapter's reading holds: the loss stays near chance (ln 10)
    in epochs 1-2 and rises after, the fallbacks grow, and the reused direction's
    cosine with a fresh one lies far below two fresh ones' at every epoch."""
    import math

    from studies.fig3.amortized import stale_trace

    tr = ROOT / "results" / "cifar" / "amortized_seeds" / "trace" / "kwng_k100_seed2"
    prov = json.loads((tr / "provenance.json").read_text())
    assert prov["config"]["method"] == "kwng_k100" and prov["config"]["seed"] == 2
    n = prov["config"]["stop_after_epoch"]
    ep = stale_trace.by_epoch(stale_trace.read_trace(tr / "trace.csv"), n)
    assert abs(ep[0]["loss"] - math.log(10)) < 0.2
    assert ep[-1]["loss"] > 2 * ep[0]["loss"]
    assert ep[-1]["fallbacks"] > ep[0]["fallbacks"]
    assert all(e["cos_fresh"] < e["cos_fresh_pair"] / 4 for e in ep)
    # the first fallback, an unclipped Euclidean step, multiplies the next loss by 40+
    first = stale_trace.first_fallbacks(stale_trace.read_trace(tr / "trace.csv"), 1)[0]
    assert not first["clipped"] and first["next_loss"] > 40 * first["loss"]


def test_guard_values_put_each_guarded_seed_beside_its_unguarded_run():
    """``guard_values``: which seeds stalled with and without the guard, the fallback
    counters of a stalled seed, the skip runs, their failed directions, and which skip
    runs took the unguarded run's steps (the same losses in every epoch)."""
    def rec(final: float, fallbacks: int) -> dict:
        return {"epochs": [{"epoch": e, "test_acc": final, "fallbacks": fallbacks * e,
                            "train_loss": 1 / e + final, "test_loss": 2 - final}
                           for e in range(1, 7)]}

    runs = {("ill", "kwng_k100", 0): rec(0.88, 0),
            ("ill", "kwng_k100", 2): rec(0.2, 40),
            ("ill", "kwng_k100_guard", 0): rec(0.88, 0),
            ("ill", "kwng_k100_guard", 2): rec(0.1, 5)}
    v = amortized.guard_values(runs, 0.8)
    assert v["guard_seeds"] == ("Without the guard seed 2 stalled (of seeds 0 and 2); "
                                "with it seed 2 (of seeds 0 and 2).")
    assert v["guard_fall"] == "30 (seed 2)" and v["unguarded_fall"] == "240 (seed 2)"
    assert v["skip_runs"] == "none of its runs is among the records yet"
    runs[("ill", "kwng_k100_skip", 2)] = rec(0.881, 1)
    v = amortized.guard_values(runs, 0.8)
    assert v["skip_runs"] == "1 run, 0 stalled (final accuracies 88.1 %)"
    assert v["skip_fall"] == "6 (seed 2)"  # the counter at the last epoch
    assert v["skip_same"] == (
        "no pair of runs took the same steps; at seed 2 the pair's losses differ from "
        "the first epoch on: those pairs did not take the same steps, fallback or not")
    runs[("ill", "kwng_k100", 0)] = runs[("ill", "kwng_k100_skip", 0)] = rec(0.88, 0)
    assert amortized.guard_values(runs, 0.8)["skip_same"].startswith(
        "at seed 0 the skip run and the unguarded run have the same losses in all 6 "
        "epochs, to the last digit; at seed 2")
    healthy = {k: rec(0.88, 0) for k in runs}
    assert amortized.guard_values(healthy)["guard_fall"] == "–"


def test_the_readmes_recommendation_counts_the_seed_studys_runs():
    """The root README's one line on the amortized step gives the run and stall counts
    of the seed study's records (k = 20 and the diagonal metric at k = 20 in both
    conditionings; k = 5, k = 100 unguarded, guarded and skipping, ill-conditioned):
    a new record that changes them fails here until the README says the same."""
    import re

    runs = seed_study.seed_study_runs(P, FIG3, ROOT / "results" / "cifar"
                                      / "amortized_seeds")

    def count(method, conds=("ill",)):
        rs = [r for r in runs if r["method"] == method and r["cond"] in conds
              and r["complete"]]
        return sum(r["stalled"] for r in rs), len(rs)

    readme = " ".join((ROOT / "README.md").read_text().split())
    line = re.search(r"\*\*The amortized step\*\*: (.*?)`studies/", readme).group(1)
    k20, k100, guard, skip = (count("kwng_k20", ("ill", "well")), count("kwng_k100"),
                              count("kwng_k100_guard"), count("kwng_k100_skip"))
    k5, diag = count("kwng_k5"), count("diag_k20", ("ill", "well"))
    assert f"{k20[0]} of {k20[1]} runs stalled" in line
    assert f"`k = 5`: {k5[0]} of {k5[1]};" in line
    assert f"`refresh_every=20`: {diag[0]} of {diag[1]}," in line
    assert f"`k = 100`: {k100[0]} of {k100[1]}," in line
    assert f"guarded {guard[0]} of {guard[1]}," in line
    assert f'guarded with `fallback="skip"` {skip[0]} of {skip[1]};' in line


def test_fallback_values_split_the_runs_by_stall_and_read_every_kwng_record(tmp_path):
    """``fallback_records`` keeps the complete step-10 ill-conditioned runs of the KWNG
    family (not KFAC, not a cut run); ``fallback_values`` lists each stalled run with
    its fallback count, the fewest of them, and the most of a healthy run."""
    def put(method, seed, final, fb, epochs=3, complete=True):
        d = tmp_path / "st" / "lr10" / "cifar10" / "ill" / method / f"seed{seed}"
        d.mkdir(parents=True)
        (d / "metrics.json").write_text(json.dumps({
            "complete": complete, "config": {"epochs": 3},
            "epochs": [{"epoch": e, "test_acc": final, "fallbacks": fb}
                       for e in range(1, epochs + 1)]}))

    put("kwng", 0, 0.88, 0)
    put("kwng_k100_skip", 2, 0.88, 1)
    put("kwng_k100", 2, 0.2, 2239)
    put("kwng_D_T", 0, 0.64, 1690)
    put("kwng_diag_T", 1, 0.54, 0)
    put("kfac", 0, 0.70, 0)
    put("kwng", 1, 0.5, 0, epochs=2, complete=False)
    recs = fallbacks.fallback_records([tmp_path / "st"])
    assert sorted(label for label, _ in recs) == [
        "st/kwng seed0", "st/kwng_D_T seed0", "st/kwng_diag_T seed1",
        "st/kwng_k100 seed2", "st/kwng_k100_skip seed2"]
    v = fallbacks.fallback_values(recs, 0.8)
    assert v == {"fb_runs": "5", "fb_stalls": "3", "fb_fell": "2",
                 "fb_stalled": "KWNG, k = 100, seed 2 (st): 2,239; "
                 "KWNG, D = ‖T‖, seed 0 (st): 1,690", "fb_stalled_min": "1,690",
                 "fb_quiet": "diagonal T, seed 1 (st): 0",
                 "fb_healthy": "2", "fb_healthy_max": "1"}
    empty = fallbacks.fallback_values([])
    assert empty["fb_stalled"] == empty["fb_quiet"] == "none"
    assert fallbacks.method_fallbacks(recs, "kwng_D_T") == (
        "seed 0 (st): 64.0 %, 1,690 fallbacks")
    assert fallbacks.method_fallbacks(recs, "kwng_D_identity") == "none"


def test_quiet_stall_values_read_the_classes_a_stalled_run_never_learned():
    """The first stalled run of a method beside its first healthy one: the classes
    it ended below 10 % recall, their output scales (and whether they are the
    smallest), their row norms in both runs and both final training losses."""
    def rec(final, recall, rows, loss):
        return {"U": [1.0, 1e-6, 0.1, 1e-5], "epochs": [{
            "test_acc": final, "test_acc_per_class": recall,
            "last_layer_row_norms": rows, "train_loss": loss}]}

    runs = {("ill", "kwng_diag_T", 1): rec(0.5, [0.9, 0.0, 0.8, 0.05],
                                           [1.0, 3.0, 2.0, 4.4], 1.321),
            ("ill", "kwng_diag_T", 2): rec(0.89, [0.9, 0.9, 0.9, 0.9],
                                           [1.0, 28286.1, 2.0, 11731.9], 0.0123),
            ("well", "kwng_diag_T", 0): rec(0.1, [0.0] * 4, [0.0] * 4, 9.0)}
    v = fallbacks.quiet_stall_values(runs, "kwng_diag_T")
    assert v == {"dq_seed": "1", "dq_dead": "1 and 3", "dq_scales": "1e-06 and 1e-05",
                 "dq_smallest": "the 2 smallest of the 4", "dq_recall": "0 % and 5 %",
                 "dq_rows": "3 and 4", "dq_rows_ok": "28,286 and 11,732",
                 "dq_loss": "1.32", "dq_loss_ok": "0.012"}
    runs[("ill", "kwng_diag_T", 1)]["U"] = [1e-6, 1.0, 1e-5, 0.1]
    assert fallbacks.quiet_stall_values(runs, "kwng_diag_T")["dq_smallest"] == (
        "not the 2 smallest of the 4")
    assert set(fallbacks.quiet_stall_values(runs, "kwng_D_T").values()) == {"–"}


def test_own_step_ms_leaves_out_the_first_epoch():
    """A run's own steady clock: the median seconds per step after the first epoch,
    so a cold start (compiling, capturing) does not count; one epoch is refused."""
    rec = {"epochs": [{"steps": 100, "time_train": 40.0},
                      {"steps": 200, "time_train": 41.6},
                      {"steps": 300, "time_train": 43.3},
                      {"steps": 400, "time_train": 44.9}]}
    assert seed_study.own_step_ms(rec) == pytest.approx(16.0)
    with pytest.raises(ValueError, match="at least 2 epochs"):
        seed_study.own_step_ms({"epochs": rec["epochs"][:1]})


def test_the_fallback_figure_draws_one_panel_per_variant_and_refuses_an_empty_one():
    from studies.fig3.amortized.figures import fig_fallback_variants

    def rec(final, fb):
        return {"epochs": [{"epoch": e, "test_acc": final, "fallbacks": fb}
                           for e in (1, 2)]}

    fig = fig_fallback_variants({"a": {0: rec(0.9, 0), 2: rec(0.2, 40)},
                                 "b": {0: rec(0.9, 1)}}, 0.8)
    assert [ax.get_title() for ax in fig.axes] == ["a", "b"]
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["seed 0: 0 failed", "seed 2: 40 failed"]
    with pytest.raises(ValueError, match="each with a run"):
        fig_fallback_variants({"a": {}}, 0.8)


def test_the_stall_threshold_of_the_readings_is_the_plans():
    """Every reading that counts stalls defaults to ``STALL_BELOW``, and the committed
    plan (written before the first run) fixes the threshold: the two agree."""
    plan = json.loads((ROOT / "results" / "cifar" / "amortized_seeds" / "plan.json")
                      .read_text())
    assert seed_study.STALL_BELOW == plan["stall_below"]
