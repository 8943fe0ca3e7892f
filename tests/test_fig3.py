"""The Fig. 3 protocol: its committed file, its early-stop rule, the grid's selection
and extension logic, the checker of its records, and the committed records."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from datetime import datetime
from pathlib import Path

import pytest
import torch

from studies.cifar import runtime, train
from studies.cifar.methods import LR_GRID, METHODS
from studies.fig3 import plan as plans
from studies.fig3 import protocol as fig3
from studies.fig3.amortized import plan as amortized_plans
from studies.kit.provenance import ResultFileError

ROOT = Path(__file__).resolve().parent.parent
FIG3 = ROOT / "results" / "cifar" / "fig3"
P = fig3.load_protocol(FIG3 / "protocol.json")


# --------------------------------------------------------------------- the protocol
def test_the_protocol_windows_follow_its_rule_from_the_committed_selections():
    for key, src in P["window_sources"].items():
        cond, m = key.split("/")
        if "default_lr" in src:  # an added method: centred on its library's default
            assert src["default_lr"] == _library_default_lr(m), key
            assert P["windows"][key] == fig3.window_for(src["default_lr"] / 10), key
            continue
        path, _, alias = src["from"].partition(" (")
        sel = json.loads((ROOT / path).read_text())["selected"]
        name = alias.rstrip(")") or m
        assert sel[f"cifar10/{cond}/{name}"]["lr"] == src["short_lr"], key
        assert P["windows"][key] == fig3.window_for(src["short_lr"]), key
    assert set(P["windows"]) == {f"{c}/{m}" for c in P["conditionings"]
                                 for m in fig3._methods(P, c)}


def _library_default_lr(method: str) -> float:
    """The ``lr`` default in the signature of the library optimizer ``method`` uses."""
    import inspect

    import pytorch_optimizer

    cls = {"muon": torch.optim.Muon, "soap": pytorch_optimizer.SOAP,
           "shampoo": pytorch_optimizer.Shampoo}[method]
    return inspect.signature(cls).parameters["lr"].default


def test_window_rule():
    assert fig3.window_for(0.1) == [10.0, 1.0, 0.1]
    assert fig3.window_for(1.0) == [10.0, 1.0, 0.1]  # 10 · 1 is the grid's top
    assert fig3.window_for(1e-4) == [0.01, 0.001, 0.0001]
    assert fig3.window_for(1e-5) == [0.01, 0.001, 0.0001]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_every_run_started_after_the_protocol_was_committed():
    """Each run records the protocol's commit; that commit holds the protocol file
    and is older than the run's provenance date."""
    provs = sorted(FIG3.glob("*/lr*/cifar10/*/*/seed*/provenance.json"))
    assert provs, "no committed Fig. 3 run"
    commits = {json.loads(p.read_text())["config"]["protocol"] for p in provs}
    for c in commits:
        try:
            when = datetime.fromisoformat(_git("show", "-s", "--format=%cI", c))
        except (OSError, subprocess.CalledProcessError):
            if _git("rev-parse", "--is-shallow-repository") == "true":
                pytest.skip("a shallow clone lacks the protocol's commit")
            raise
        assert "results/cifar/fig3/protocol.json" in _git(
            "ls-tree", "-r", "--name-only", c, "results/cifar/fig3")
        for p in provs:
            prov = json.loads(p.read_text())
            if prov["config"]["protocol"] == c:
                assert datetime.fromisoformat(prov["date"]) > when, p


def test_amendments_are_applied_and_committed_before_the_runs_they_change():
    """Each amendment's substitution is in the loaded protocol, names its reason and
    evidence, and was committed (the oldest commit whose amendments file names the new
    method) before the first run of the method it brings in."""
    amendments = json.loads((FIG3 / "amendments.json").read_text())["amendments"]
    assert amendments == P["amendments"]
    for a in amendments:
        assert a["why"] and (ROOT / a["evidence"]).exists()
        for old, new in a.get("substitute", {}).items():
            assert old not in P["order"] and new in P["order"]
            try:
                dates = _git("log", "--format=%cI", "-S", f'"{new}"', "--",
                             "results/cifar/fig3/amendments.json").split()
            except (OSError, subprocess.CalledProcessError):
                pytest.skip("no git history")
            if not dates:
                if _git("rev-parse", "--is-shallow-repository") == "true":
                    pytest.skip("a shallow clone lacks the amendment's commit")
                continue  # not committed yet: no run may exist
            when = datetime.fromisoformat(dates[-1])
            for prov in FIG3.glob(f"*/lr*/cifar10/*/{new}/seed*/provenance.json"):
                date = json.loads(prov.read_text())["date"]
                assert datetime.fromisoformat(date) > when, prov


def test_an_amendment_substitutes_only_a_method_of_the_protocol(tmp_path):
    shutil.copy(FIG3 / "protocol.json", tmp_path / "protocol.json")
    for sub, ok in (({"ekfac": "ekfac_s10"}, True), ({"nope": "ekfac_s10"}, False),
                    ({"ekfac": "kfac"}, False)):
        (tmp_path / "amendments.json").write_text(json.dumps(
            {"amendments": [{"substitute": sub, "why": "w", "evidence": "e"}]}))
        if ok:
            p = fig3.load_protocol(tmp_path / "protocol.json")
            assert p["windows"]["ill/ekfac_s10"] == P["windows"]["ill/ekfac_s10"]
            assert "ekfac" not in p["methods"]["both"]
        else:
            with pytest.raises(ResultFileError, match="amendment"):
                fig3.load_protocol(tmp_path / "protocol.json")


ADDED = ("muon", "soap", "shampoo")


def test_the_added_methods_run_by_the_protocols_rules():
    a = [a for a in P["amendments"] if "add" in a]
    assert [x["add"] for x in a] == [{"both": list(ADDED)}]
    assert all(m in P["methods"]["both"] and m in P["order"] for m in ADDED)
    base = json.loads((FIG3 / "protocol.json").read_text())
    for k in ("grid", "settings", "split", "extension_rule", "selection_rule",
              "early_stop", "early_stop_rule", "seeds", "verdict_rule", "ablations"):
        assert P[k] == base[k], k


@pytest.mark.parametrize("bad", ["an old method", "no window", "both kinds"])
def test_an_amendment_adds_only_new_methods_with_their_windows(tmp_path, bad):
    shutil.copy(FIG3 / "protocol.json", tmp_path / "protocol.json")
    w = {"ill/muon": [0.01], "well/muon": [0.01]}
    a = {"add": {"both": ["muon"]}, "windows": w, "window_sources": w}
    if bad == "an old method":
        a["add"] = {"both": ["sgd"]}
    elif bad == "no window":
        a["windows"] = {"ill/muon": [0.01]}
    else:
        a["substitute"] = {"ekfac": "ekfac_s10"}
    (tmp_path / "amendments.json").write_text(json.dumps({"amendments": [a]}))
    with pytest.raises(ResultFileError, match="amendment"):
        fig3.load_protocol(tmp_path / "protocol.json")


def test_the_plan_queues_the_added_methods_runs_and_nothing_else(tmp_path):
    """On the committed records, the protocol without the addition queues nothing
    beyond what it queued before; with it, the plan adds only the added methods' runs:
    every first-window grid step not yet recorded (seed 0, early stop on), and the
    other seeds at a final selection, whatever part of the grid has run."""
    shutil.copy(FIG3 / "protocol.json", tmp_path / "protocol.json")
    before = [a for a in P["amendments"] if "add" not in a]
    (tmp_path / "amendments.json").write_text(json.dumps({"amendments": before}))
    old = plans.fig3_plan({}, fig3.load_protocol(tmp_path / "protocol.json"), FIG3,
                          commit="c")
    new = plans.fig3_plan({}, P, FIG3, commit="c")
    added = [j for j in new if j not in old]
    assert len(new) == len(old) + len(added)
    assert {j["method"] for j in added} <= set(ADDED)
    state = fig3.grid_state(P, FIG3)
    grid = {(j["conditioning"], j["method"], j["lr"]) for j in added
            if Path(j["out"]).parent.name == "grid"}
    done = {(k.split("/")[0], k.split("/")[1], lr) for k, st in state.items()
            if k.split("/")[1] in ADDED for lr, how in st["runs"].items()
            if how != "missing"}
    windows = {(c, m, lr) for c in P["conditionings"] for m in ADDED
               for lr in P["windows"][f"{c}/{m}"]}
    assert len(windows) == 18 and windows <= grid | done and not grid & done
    assert all(j["seed"] == 0 and j["early_stop"] == "fig3" for j in added
               if Path(j["out"]).parent.name == "grid")
    for j in (j for j in added if Path(j["out"]).parent.name == "seeds"):
        st = state[f"{j['conditioning']}/{j['method']}"]
        assert st["final"] and j["lr"] == st["selected"] and j["seed"] > 0
    assert plans.queue_left(P, FIG3)["grid"] >= len(grid)


def _records_before(root: Path, methods: tuple[str, ...], added: str) -> list[str]:
    """The records of ``methods`` under ``root`` whose protocol commit is not
    ``added`` or a descendant of it (an unknown commit counts as one before)."""
    bad = []
    for m in methods:
        for prov in sorted(root.glob(f"*/lr*/cifar10/*/{m}/seed*/provenance.json")):
            c = json.loads(prov.read_text())["config"].get("protocol") or "none"
            git = ["git", "merge-base", "--is-ancestor", added, c]
            if subprocess.run(git, cwd=ROOT, capture_output=True).returncode != 0:
                bad.append(str(prov))
    return bad


def test_the_addition_precedes_every_record_of_its_methods(tmp_path):
    """Every record of an added method names a protocol commit at or after the commit
    that added it to the amendments (``protocol_commit`` counts the amendments file);
    a record naming the protocol's first commit is caught."""
    try:
        first = {m: _git("log", "--format=%H", "-S", f'"{m}"', "--",
                         "results/cifar/fig3/amendments.json").split() for m in ADDED}
        protocol0 = _git("log", "--format=%H", "--",
                         "results/cifar/fig3/protocol.json").split()[-1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        pytest.skip("no git history")
    for m, commits in first.items():
        if not commits:  # not committed yet: no run may exist
            assert not list(FIG3.glob(f"*/lr*/cifar10/*/{m}/seed*/provenance.json"))
        else:
            assert _records_before(FIG3, (m,), commits[-1]) == [], m
    added = first["muon"][-1] if first["muon"] else _git("rev-parse", "HEAD")
    for commit, caught in ((protocol0, True), (added, False)):
        d = tmp_path / commit / "grid" / "lr0.01" / "cifar10" / "ill" / "muon" / "seed0"
        d.mkdir(parents=True)
        (d / "provenance.json").write_text(json.dumps({"config": {"protocol": commit}}))
        assert bool(_records_before(tmp_path / commit, ("muon",), added)) == caught


# ------------------------------------------------------------------ the stop rule
def _row(e, acc, loss=1.0):
    return {"epoch": e, "val_acc": acc, "train_loss": loss}


def test_stop_rule_reasons_and_their_thresholds():
    stop = fig3.stop_reason
    assert stop(_row(3, 0.5, math.nan), {}, 10)["reason"] == "non-finite loss"
    assert stop(_row(9, 0.10), {}, 10) is None
    assert stop(_row(10, 0.119), {}, 10)["reason"] == "at chance"
    assert stop(_row(10, 0.121), {}, 10) is None
    sib = {"lr1": [_row(e, 0.80) for e in range(1, 40)]}
    assert stop(_row(29, 0.40), sib, 10) is None  # before epoch 30
    assert stop(_row(30, 0.56), sib, 10) is None  # 24 points behind
    got = stop(_row(30, 0.55), sib, 10)
    assert got["reason"] == "behind" and got["sibling"] == "lr1"
    assert stop(_row(45, 0.10 + 0.3), sib, 10) is None  # sibling not at epoch 45
    with pytest.raises(ValueError, match="num_classes"):
        stop(_row(30, 0.5), {}, 1)


def test_the_protocol_states_the_codes_rule():
    assert P["early_stop"] == fig3.RULE


# --------------------------------------------------------- selection and extension
def _fake(root: Path, cond: str, m: str, lr: float, acc: float | None,
          stop: str | None = None, epochs: int = 100) -> None:
    d = root / "grid" / f"lr{lr:g}" / "cifar10" / cond / m / "seed0"
    d.mkdir(parents=True)
    n = epochs if stop is None else 10
    rec = {"epochs": [{"epoch": e, "val_acc": acc or 0.1, "train_loss": 1.0}
                      for e in range(1, n + 1)], "complete": True,
           "early_stop": {"reason": stop, "epoch": n} if stop else None}
    (d / "metrics.json").write_text(json.dumps(rec))


def _one(tmp_path: Path, window: list[float]) -> dict:
    return {**P, "conditionings": ["ill"], "methods": {"both": ["sgd"]},
            "windows": {"ill/sgd": window}}


def test_best_at_an_inner_edge_runs_the_next_grid_value(tmp_path):
    p = _one(tmp_path, [1.0, 0.1, 0.01])
    for lr, acc in ((1.0, 0.5), (0.1, 0.6), (0.01, 0.7)):
        _fake(tmp_path, "ill", "sgd", lr, acc)
    st = fig3.grid_state(p, tmp_path)["ill/sgd"]
    assert st["next"] == [0.001] and not st["final"] and st["selected"] == 0.01
    _fake(tmp_path, "ill", "sgd", 0.001, 0.65)
    st = fig3.grid_state(p, tmp_path)["ill/sgd"]
    assert st["final"] and st["selected"] == 0.01 and st["next"] == []


def test_best_at_the_grids_end_is_final_and_all_stopped_runs_the_rest(tmp_path):
    p = _one(tmp_path, [10.0, 1.0, 0.1])
    _fake(tmp_path, "ill", "sgd", 10.0, 0.9)
    _fake(tmp_path, "ill", "sgd", 1.0, None, stop="at chance")
    st = fig3.grid_state(p, tmp_path)["ill/sgd"]
    assert st["next"] == [0.1] and st["runs"][1.0] == "stopped"
    _fake(tmp_path, "ill", "sgd", 0.1, 0.5)
    st = fig3.grid_state(p, tmp_path)["ill/sgd"]
    assert st["final"] and st["selected"] == 10.0
    q = _one(tmp_path / "b", [10.0, 1.0, 0.1])
    for lr in (10.0, 1.0, 0.1):
        _fake(tmp_path / "b", "ill", "sgd", lr, None, stop="at chance")
    st = fig3.grid_state(q, tmp_path / "b")["ill/sgd"]
    assert st["next"] == [0.01, 0.001, 0.0001] and not st["final"]


def test_the_plan_puts_grid_runs_first_then_seeds(tmp_path):
    p = _one(tmp_path, [10.0, 1.0, 0.1])
    for lr, acc in ((10.0, 0.9), (1.0, 0.8), (0.1, 0.7)):
        _fake(tmp_path, "ill", "sgd", lr, acc)
    jobs = plans.fig3_plan({"data_root": None}, p, tmp_path, commit="abc")
    assert [(j["seed"], j["lr"]) for j in jobs] == [(1, 10.0), (2, 10.0)]
    assert all(j["early_stop"] is None and j["protocol"] == "abc" for j in jobs)
    assert jobs[0]["out"] == str(tmp_path / "seeds" / "lr10")


# ------------------------------------------------------------------- the checker
def test_committed_records_pass_the_check():
    res = fig3.check_fig3(FIG3, P)
    assert res["bad"] == [] and res["incomplete"] == []
    assert len(res["ok"]) + len(res["stopped"]) >= 28
    for name in res["ok"] + res["stopped"]:
        part, lr = name.split("/")[:2]
        assert part in ("grid", "seeds", "ablation") and float(lr[2:]) in LR_GRID


BREAKS = {
    "no provenance": lambda d: (d / "provenance.json").unlink(),
    "provenance of another run": lambda d: _edit(d / "provenance.json",
                                                 lambda r: r["config"].update(seed=7)),
    "nan accuracy": lambda d: _edit(d / "metrics.json",
                                    lambda r: r["epochs"][5].update(val_acc=math.nan)),
    "other settings": lambda d: _edit(d / "metrics.json",
                                      lambda r: r["config"].update(epochs=30)),
    "a list": lambda d: (d / "metrics.json").write_text("[1, 2]"),
    "truncated": lambda d: (d / "metrics.json").write_text('{"epochs": [1'),
}


def _edit(path: Path, change) -> None:
    rec = json.loads(path.read_text())
    change(rec)
    path.write_text(json.dumps(rec))


@pytest.mark.parametrize("how", list(BREAKS))
def test_the_check_names_a_broken_record(tmp_path, how):
    src = FIG3 / "grid" / "lr10" / "cifar10" / "ill" / "kwng" / "seed0"
    dst = tmp_path / "grid" / "lr10" / "cifar10" / "ill" / "kwng" / "seed0"
    shutil.copytree(src, dst)
    assert fig3.check_fig3(tmp_path, P)["ok"] == ["grid/lr10/ill/kwng/seed0"]
    BREAKS[how](dst)
    res = fig3.check_fig3(tmp_path, P)
    assert res["ok"] == [] and len(res["bad"]) == 1
    assert str(dst / "metrics.json") in res["bad"][0][1]


def test_the_trainer_records_an_early_stop(tmp_path, monkeypatch):
    """A tiny grid run with a sibling far ahead stops by the rule, keeps its record
    with the reason, and counts as finished."""
    monkeypatch.chdir(tmp_path)
    sib = tmp_path / "g" / "lr1" / "cifar10" / "ill" / "sgd" / "seed0"
    sib.mkdir(parents=True)
    (sib / "metrics.json").write_text(json.dumps(
        {"epochs": [_row(e, 1.0) for e in range(1, 40)]}))
    cfg = {"source": "sample", "model": "tiny", "batch_size": 100, "epochs": 31,
           "lr": 0.1, "device": "cpu", "out": "g/lr0.1", "checkpoint_dir": "ck",
           "method": "sgd", "val_size": 200, "eval_test": True, "early_stop": "fig3",
           "schedule": "authors"}
    rec = train.run(cfg, progress=False)
    stop = rec["early_stop"]
    assert rec["complete"] and stop["reason"] in ("at chance", "behind")
    assert stop["epoch"] == len(rec["epochs"]) >= 10
    assert all("val_acc" in r and "test_acc" in r for r in rec["epochs"])


def test_a_worker_does_not_start_a_run_that_cannot_finish(tmp_path, monkeypatch):
    """``--finish-by-s``: a job whose estimated duration ends after the bound is
    skipped (no record, no checkpoint); a job that fits runs."""
    import time

    from studies.cifar import sweep

    monkeypatch.chdir(tmp_path)
    job = {"source": "sample", "model": "tiny", "batch_size": 100, "epochs": 1,
           "lr": 0.1, "device": "cpu", "method": "sgd", "train_subset": 200,
           "checkpoint_dir": "ck"}
    late = {**job, "out": "late", "est_s": 3600}
    fits = {**job, "out": "fits", "est_s": 1}
    assert sweep.worker([late, fits], "s1", None, finish_by=time.time() + 600) == []
    assert not (tmp_path / "late").exists()
    assert list((tmp_path / "fits").rglob("metrics.json"))


def test_two_workers_of_a_session_never_share_a_finished_run(tmp_path, monkeypatch):
    """Workers of one sweep session walk the same job list: a run another worker
    finished is claimed (and re-checked) by one worker only, and the others pass it
    by without touching its lock (the queue logged a false failure before)."""
    from studies.cifar import sweep
    from studies.cifar.config import RunConfig
    from studies.cifar.runtime import checkpoint_path_for
    from studies.kit.run_lock import run_lock

    monkeypatch.chdir(tmp_path)
    job = {"source": "sample", "model": "tiny", "batch_size": 100, "epochs": 1,
           "lr": 0.1, "device": "cpu", "method": "sgd", "train_subset": 200,
           "checkpoint_dir": "ck", "out": "res"}
    assert sweep.worker([job], "s1", None) == []  # worker A trains it
    cfg = RunConfig.from_dict(job)
    # worker B, same session, while a third process holds the run's lock
    with run_lock(checkpoint_path_for(cfg).parent / "run.lock", "other"):
        assert sweep.worker([job], "s1", None) == []
    assert sweep.worker([job], "s2", None) == []  # a new session checks it again


def test_a_run_estimate_comes_from_the_method_or_its_family():
    """A method's own fastest run; a KWNG variant at most KWNG's; a first-order or
    modern optimizer without runs SGD's times its planning weight; else the longest
    estimate (twice for KFAC/EKFAC)."""
    times = {"kwng": 600.0, "sgd": 200.0, "diag_Ttilde": 1200.0}
    assert runtime.estimate_seconds(times, "sgd") == 200.0
    assert runtime.estimate_seconds(times, "diag_Ttilde") == 600.0
    assert runtime.estimate_seconds(times, "kwng_kernel_rq") == 600.0
    assert runtime.estimate_seconds(times, "adam") == pytest.approx(200.0 * 1.4)
    assert runtime.estimate_seconds(times, "shampoo") == pytest.approx(
        200.0 * METHODS["shampoo"].rel_cost)
    assert runtime.estimate_seconds({"kwng": 600.0}, "soap") == 600.0
    assert runtime.estimate_seconds(times, "kfac") == 2400.0
    assert runtime.estimate_seconds({}, "sgd") is None
    # the refresh guard adds refreshes, not steps: the unguarded twin's time
    assert runtime.estimate_seconds({"kwng": 600.0, "kwng_k100": 250.0},
                           "kwng_k100_guard") == 250.0


def test_every_record_belongs_to_one_round_of_the_ledger():
    """``rounds.json`` lists every GPU round; each committed record's provenance names
    the commit of exactly one, and the rounds' record counts add up."""
    from studies.kit.provenance import read_json

    rounds = fig3.rounds(FIG3)
    counts = dict.fromkeys((r["round"] for r in rounds), 0)
    for prov in FIG3.glob("*/lr*/*/*/*/seed*/provenance.json"):
        rd = fig3.round_of(read_json(prov), rounds)
        assert rd is not None, prov
        counts[rd["round"]] += 1
    assert counts == {r["round"]: r["records"] for r in rounds}


def test_seconds_to_accuracy_counts_training_time_to_the_first_epoch_there(tmp_path):
    """A run alone reaching 80 % at epoch 2 and 85 % never; a run that shared its GPU
    is left out."""
    from studies.fig3 import clocks as fig3_time

    rows = [{"epoch": e, "test_acc": a, "time_train": 2.0 * e, "val_acc": a,
             "train_acc": a, "train_loss": 1.0}
            for e, a in ((1, 0.5), (2, 0.81), (3, 0.84))]
    assert fig3_time._seconds_to(rows, 0.8) == 4.0
    assert fig3_time._seconds_to(rows, 0.85) is None
    with pytest.raises(ValueError, match="targets"):
        fig3_time.seconds_to_accuracy({}, tmp_path, targets=(80,), runs={})
    rounds = [{"round": 1, "git_commit": "abc123", "alone": False},
              {"round": 2, "git_commit": "def456", "alone": True}]
    assert fig3.round_of({"git_commit": "def4567890"}, rounds)["round"] == 2
    assert fig3.round_of({"git_commit": "abc"}, rounds)["round"] == 1
    assert fig3.round_of({"git_commit": "fff"}, rounds) is None
    assert fig3.round_of({}, rounds) is None


def test_the_throughput_window_is_where_every_run_trains():
    """queue_throughput counts only the time all runs train at once: two runs of 100
    steps an epoch, the second starting 10 s late, overlap from 10 s to 30 s."""
    from studies.bench.queue_throughput import PROTOCOL_STEPS, _overlap

    a = [{"time_unix": 10.0 * e, "steps": 100 * e} for e in range(1, 4)]
    b = [{"time_unix": 10.0 * e + 10, "steps": 100 * e} for e in range(1, 4)]
    got = _overlap([a, b])
    assert got["window_s"] == 10.0  # from b's first epoch end (20) to a's last (30)
    assert got["ms_per_step"] == 1e3 * 10 / 200  # each run did 100 steps in it
    assert got["runs_per_hour"] == 3600e3 / (got["ms_per_step"] * PROTOCOL_STEPS)
    with pytest.raises(RuntimeError, match="never trained at the same time"):
        _overlap([a, [{"time_unix": 40.0 + e, "steps": 100 * e} for e in (1, 2)]])


def test_the_amortized_plan_runs_at_kwngs_selected_steps(tmp_path, monkeypatch):
    """Each amortized method once per conditioning, at KWNG's final Fig. 3 step; a
    tiny run of one of them trains (its preconditioner rebuilds every k steps)."""
    from studies.fig3.amortized.seed_study import AMORTIZED_METHODS

    state = fig3.grid_state(P, FIG3)
    jobs = amortized_plans.amortized_plan({}, P, FIG3, out=tmp_path / "am")
    assert {(j["conditioning"], j["method"]) for j in jobs} == {
        (c, m) for c in ("ill", "well") for m in AMORTIZED_METHODS}
    assert all(j["lr"] == state[f"{j['conditioning']}/kwng"]["selected"] for j in jobs)
    monkeypatch.chdir(tmp_path)
    rec = train.run({"source": "sample", "model": "tiny", "batch_size": 50, "epochs": 1,
                     "lr": 0.1, "device": "cpu", "method": "kwng_k5",
                     "train_subset": 200, "checkpoint_dir": "ck", "out": "res"},
                    progress=False)
    assert rec["complete"] and rec["method_spec"]["refresh_every"] == 5


def test_ablation_runs_are_finished_ablations_beside_kwng_at_its_selected_step():
    """The ablation figure's runs: the protocol's variants and KWNG itself, all in the
    ablation conditioning, at KWNG's selected step there, every one finished."""
    from studies.fig3 import verdicts

    p = fig3.load_protocol()
    ab = p["ablations"]
    runs = verdicts.ablation_runs(p)
    extra = verdicts.ablation_seeds(p, fig3.FIG3.parent / "amortized_seeds")
    lr = fig3.grid_state(p)[f"{ab['conditioning']}/{ab['lr_of']}"]["selected"]
    assert any(m == ab["lr_of"] for _, m, _ in runs)
    for (cond, m, s), rec in runs.items():
        assert cond == ab["conditioning"]
        assert m == ab["lr_of"] or s < ab["runs"][m] or s in extra[m]
        assert float(rec["lr"]) == lr
        assert len(rec["epochs"]) == p["settings"]["epochs"]
    alone = verdicts.ablation_runs(p, seeds_root=False)
    assert all(m == ab["lr_of"] or s < ab["runs"][m] for _, m, s in alone)
    assert set(alone) <= set(runs)


def test_the_seed_studys_ablation_seeds_join_the_protocols_runs(tmp_path):
    """A variant's seeds from the seed study's plan (groups and amendments at KWNG's
    step in the ablation conditioning) count in ``wanted`` and, once finished, in the
    rows; seeds the protocol already runs are not counted twice."""
    import json

    from studies.fig3 import verdicts

    p = fig3.load_protocol()
    ab = p["ablations"]
    m = next(iter(ab["runs"]))
    plan = {"groups": [{"conditioning": ab["conditioning"], "lr_of": ab["lr_of"],
                        "methods": [m, "adam"], "seeds": [0, 5]}],
            "amendments": [{"conditioning": "well", "lr_of": ab["lr_of"],
                            "methods": [m], "seeds": [7]}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert verdicts.ablation_seeds(p, tmp_path) == {m: [0, 5]}
    assert verdicts.ablation_seeds(p, tmp_path / "none") == {}
    rows = {r["method"]: r for r in verdicts.ablation_rows(p, seeds_root=tmp_path)}
    # seed 5 counts; seed 0 is the protocol's own
    assert rows[m]["wanted"] == int(ab["runs"][m]) + 1
    assert len(rows[m]["finals"]) == rows[m]["runs"]


def test_an_eager_run_does_not_time_a_method_with_captured_runs(monkeypatch):
    """alone_runs keeps, of a method with a captured run, only captured runs; a method
    without any keeps its eager ones."""
    from studies.fig3 import verdicts

    fake = {("ill", "kfac", 0): {"capture": False},
            ("ill", "kfac", 1): {"capture": True},
            ("ill", "sgd", 0): {"capture": False}}
    monkeypatch.setattr(verdicts, "selected_runs", lambda p, root: fake)
    monkeypatch.setattr(verdicts, "grid_state",
                        lambda p, root: {"ill/kfac": {"selected": 10.0},
                                         "ill/sgd": {"selected": 1.0}})
    monkeypatch.setattr(verdicts, "rounds", lambda root: [])
    monkeypatch.setattr(verdicts, "read_json", lambda path: {})
    monkeypatch.setattr(verdicts, "round_of", lambda prov, rs: {"alone": True})
    runs = verdicts.alone_runs({"dataset": "cifar10"}, "unused")
    assert set(runs) == {("ill", "kfac", 1), ("ill", "sgd", 0)}


def test_the_time_table_marks_unfinished_selections_and_never_reached_targets():
    """fig3_tables: a selection that is not final says so, a target never reached reads
    "never", and the glued names follow the conditioning and method."""
    from studies.fig3 import tables as fig3_tables

    tta = {"ill/sgd": {"lr": 1.0, "final": False, "runs": 2, "s_per_epoch": 1.2,
                       "to": {0.8: None, 0.85: None}, "epoch_to": {0.85: None}},
           "well/adam": {"lr": 0.01, "final": True, "runs": 1, "s_per_epoch": 1.43,
                         "to": {0.8: 14.2, 0.85: 33.4}, "epoch_to": {0.85: 23.0}}}
    table = fig3_tables.tta_table(tta)
    assert "| ill | sgd | never | never | never | 1.20 | 1 (not final) | 2 |" in table
    assert "| well | adam | 33 | 23.0 | 14 | 1.43 | 0.01 | 1 |" in table
    v = fig3_tables.tta_values(tta)
    assert v["tta_well_adam_85"] == "33" and v["tta_ill_sgd_80"] == "never"
    assert v["tta_ep_well_adam"] == "23.0" and v["tta_spe_ill_sgd"] == "1.20"
    assert v["tta_never80_ill"] == "SGD" and v["tta_never80_well"] == "none"
    with pytest.raises(TypeError, match="tta"):
        fig3_tables.tta_table([])


def _timing(*rows) -> dict:
    return {"device": "NVIDIA H100 80GB HBM3", "config": {"methods": ["sgd", "kfac"]},
            "rows": [{"method": m, "precision": "bf16", "mode": mode,
                      "steady_ms_per_step": ms} for m, mode, ms in rows]}


def test_one_trainer_timing_puts_every_seed_on_one_clock(monkeypatch, tmp_path):
    """step_ms prefers a method's captured row; timed_runs re-times every selected run
    of a timed method (epoch e ends at steps(e) x ms) and leaves the others out;
    time_runs falls back to the runs alone until the record exists."""
    from studies.fig3 import clocks as fig3_time

    timing = _timing(("sgd", "eager", 11.0), ("sgd", "captured", 3.5),
                     ("kfac", "eager", 18.0), ("kfac", "eager", 19.0))
    assert fig3_time.step_ms(timing) == {"sgd": 3.5, "kfac": 18.0}
    with pytest.raises(ValueError, match="precision"):
        fig3_time.step_ms(timing, "fp32")
    ep = [{"epoch": e, "steps": 352 * e, "test_acc": 0.5, "time_train": 99.0}
          for e in (1, 2)]
    fake = {("ill", "sgd", 0): {"epochs": ep}, ("ill", "sgd", 1): {"epochs": ep},
            ("ill", "adam", 0): {"epochs": ep}}
    monkeypatch.setattr(fig3_time, "selected_runs", lambda p, root: fake)
    p = {"settings": {"precision": "bf16"}}
    runs = fig3_time.timed_runs(p, tmp_path, timing)
    assert set(runs) == {("ill", "sgd", 0), ("ill", "sgd", 1)}
    times = [e["time_train"] for e in runs[("ill", "sgd", 1)]["epochs"]]
    assert times == pytest.approx([1.232, 2.464])
    assert ep[0]["time_train"] == 99.0  # the records themselves are not touched
    monkeypatch.setattr(fig3_time, "alone_runs", lambda p, root: {"alone": 1})
    assert fig3_time.time_runs(p, tmp_path) == ({"alone": 1}, {"kind": "alone"})
    (tmp_path / "timing").mkdir()
    (tmp_path / "timing" / "trainer_timing.json").write_text(json.dumps(timing))
    runs, source = fig3_time.time_runs(p, tmp_path)
    assert source["kind"] == "trainer-timing" and source["methods"] == ["kfac", "sgd"]
    assert len(runs) == 2


def test_queue_phrase_counts_and_rejects():
    """The queue in words: empty, one part, several parts; a malformed count refused."""
    assert plans.queue_phrase({"grid": 0, "seeds": 0, "ablation": 0}) == (
        "Every run the protocol asks for is in.")
    assert plans.queue_phrase({"grid": 0, "seeds": 1, "ablation": 0}) == (
        "Still to run: 1 seed run.")
    assert plans.queue_phrase({"grid": 2, "seeds": 1, "ablation": 3}) == (
        "Still to run: 2 grid runs, 1 seed run and 3 ablation runs.")
    for bad in ({"grid": -1, "seeds": 0, "ablation": 0}, {"grid": 1},
                {"grid": True, "seeds": 0, "ablation": 0}):
        with pytest.raises(ValueError, match="left must map"):
            plans.queue_phrase(bad)


def test_committed_trainer_timing_covers_every_method_captured():
    """The study's clock (round 9): every method of the protocol and of the amortized
    study timed eagerly and captured in bf16 on one GPU, with provenance; the exact
    methods' captured losses equal the eager ones over the traced steps."""
    d = json.loads((FIG3 / "timing" / "trainer_timing.json").read_text())
    rows = {(r["method"], r["asked_capture"]): r for r in d["rows"]}
    methods = set(d["config"]["methods"])
    assert {"sgd", "adam", "kfac", "ekfac_s10", "kwng", "kwng_mom",
            "kwng_k100"} <= methods
    for m in methods:
        assert rows[(m, False)]["mode"] == "eager"
        cap = rows[(m, True)]
        assert cap["mode"] == "captured" and cap["captures"] >= 1
        assert cap["steady_ms_per_step"] > 0
    exact = {t["method"]: t for t in d["loss_match"] if "_k" not in t["method"]}
    assert {"sgd", "adam", "kwng"} <= set(exact)
    assert all(t["max_rel_diff_captured_vs_eager"] == 0 for t in exact.values())
    assert d["provenance"]["git_commit"] and d["device"].startswith("NVIDIA")


def test_committed_warm_up_loss_match_of_the_amortized_step():
    """After the warm-up fix (capture.warmup_kind) the captured amortized loops take
    the eager loop's steps: equal losses over 24 steps for k = 5 and k = 100."""
    path = ROOT / "results" / "benchmarks" / "warmup_loss_match"
    d = json.loads((path / "h100_bf16_kwng_k5_k100.json").read_text())
    got = {t["method"]: t for t in d["loss_match"]}
    assert set(got) == {"kwng_k5", "kwng_k100"}
    for t in got.values():
        assert t["steps"] >= 24 and len(t["loss_captured"]) == t["steps"]
        assert t["max_rel_diff_captured_vs_eager"] == 0
    assert d["provenance"]["git_commit"].startswith("054ba6f")
