"""The run identity is complete: every setting that changes what a CIFAR run computes
is compared on every rerun and resume, and the committed records stay valid.

Before, ``precision`` and ``channels_last`` were compared only when both records held
them and ``schedule``, ``capture`` never: a finished fp32 run was returned for a bf16
request ("complete: skipped"), a run stopped under one schedule resumed under another.
Everything runs on the CPU at tiny sizes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from studies.cifar import runtime, train
from studies.cifar.config import SETTINGS, RunConfig
from studies.kit import guard

ROOT = Path(__file__).resolve().parent.parent


def _cfg(**kw) -> dict:
    """A tiny run with folders relative to the working directory (a copied folder
    keeps its checkpoint paths)."""
    base = {"source": "sample", "model": "tiny", "batch_size": 100, "epochs": 2,
            "lr": 0.1, "device": "cpu", "out": "res", "checkpoint_dir": "ck",
            "train_subset": 200, "method": "sgd", "schedule": "constant"}
    return {**base, **kw}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A finished 2-epoch run (``done/``) and one stopped after epoch 1
    (``half/``, checkpointed)."""
    tmp = tmp_path_factory.mktemp("ident")
    with pytest.MonkeyPatch.context() as mp:
        (tmp / "done").mkdir()
        mp.chdir(tmp / "done")
        assert train.run(_cfg(), progress=False)["complete"]
        (tmp / "half").mkdir()
        mp.chdir(tmp / "half")
        rec = train.run(_cfg(stop_after_epoch=1), progress=False)
    assert not rec["complete"] and len(rec["epochs"]) == 1
    return tmp


@pytest.fixture
def copy(runs, tmp_path, monkeypatch):
    """Copy ``done`` or ``half`` into ``tmp_path`` and work there."""
    def make(which: str) -> Path:
        shutil.copytree(runs / which, tmp_path / which)
        monkeypatch.chdir(tmp_path / which)
        return tmp_path / which
    return make


CHANGES = [{"precision": "bf16"}, {"channels_last": True}, {"schedule": "claim"},
           {"schedule": "authors"}, {"capture": True}]


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: next(iter(c)))
def test_a_finished_run_is_not_returned_for_another_setting(copy, change):
    copy("done")
    with pytest.raises(guard.ConfigMismatchError, match=next(iter(change))):
        train.run(_cfg(**change), progress=False)


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: next(iter(c)))
def test_a_stopped_run_does_not_resume_under_another_setting(copy, change):
    copy("half")
    with pytest.raises(guard.ConfigMismatchError, match=next(iter(change))):
        train.run(_cfg(**change), progress=False)


def test_the_same_settings_still_skip_and_resume(copy, monkeypatch):
    done = copy("done")
    mp = done / runtime.run_dir_for(_cfg()) / "metrics.json"
    before = mp.read_bytes()
    assert train.run(_cfg(), progress=False)["complete"]
    assert mp.read_bytes() == before
    copy("half")
    rec = train.run(_cfg(), progress=False)
    assert rec["complete"] and [r["epoch"] for r in rec["epochs"]] == [1, 2]


def test_the_identity_always_holds_every_setting():
    ident = guard.run_identity({"dataset": "cifar10"}, 0.1, 128, {}, None)
    for k, default in guard.IDENTITY_DEFAULTS.items():
        assert k in ident and ident[k] == default


def test_a_stored_identity_lacking_a_setting_reads_the_records_config():
    rec = {"identity": {k: None for k in guard.RUN_IDENTITY_KEYS}
           | {"lr": 0.1, "batch_size": 128, "method_spec": {}},
           "config": {"schedule": "claim"}}
    ident = guard.record_identity(rec)
    assert ident["schedule"] == "claim" and ident["precision"] == "fp32"
    del rec["config"]["schedule"]
    assert guard.record_identity(rec)["schedule"] == "study6"


def _committed_records():
    return sorted((ROOT / "results" / "cifar").glob("**/seed*/metrics.json"))


def test_every_committed_record_matches_its_own_configuration():
    """Rebuilding the identity from each committed record's configuration gives the
    identity the record is read with: a rerun of a committed run is recognised as the
    same run (skipped), never refused for a key the record predates. The earlier
    6-epoch study's records (they predate ``schedule``) are frozen: its methods and
    schedule have left the code, so no live run can be one of them."""
    paths = _committed_records()
    assert len(paths) > 250
    frozen = [ROOT / "results" / "cifar" / d for d in ("cifar10", "selection")]
    for mp in paths:
        rec = json.loads(mp.read_text())
        stored = guard.record_identity(rec, mp)
        c = {k: v for k, v in rec["config"].items() if k in SETTINGS}
        if "schedule" not in c:
            assert any(mp.is_relative_to(d) for d in frozen), mp
            continue
        cfg = RunConfig(**c)
        fresh = guard.run_identity(cfg.to_dict(), rec["lr"],
                                   rec.get("batch_size", cfg.batch),
                                   rec.get("method_spec", cfg.spec), None)
        stored.pop("data", None)
        assert guard.diff_keys(stored, fresh) == [], mp


# ---------------------------------------------- cifar check reads what it checks
A100_RUN = ("lr10", "cifar10", "ill", "kwng", "seed1")


def _edit(path: Path, change) -> None:
    rec = json.loads(path.read_text())
    change(rec)
    path.write_text(json.dumps(rec))


CHECK_BREAKS = {
    "truncated provenance": lambda d: (d / "provenance.json").write_text('{"co'),
    "empty provenance": lambda d: (d / "provenance.json").write_text(""),
    "another run's provenance": lambda d: _edit(
        d / "provenance.json", lambda r: r["config"].update(seed=0)),
    "NaN training loss": lambda d: _edit(
        d / "metrics.json", lambda r: r["epochs"][3].update(train_loss=float("nan"))),
    "a list": lambda d: (d / "metrics.json").write_text("[]"),
    "no epochs": lambda d: _edit(d / "metrics.json", lambda r: r.pop("epochs")),
}


@pytest.mark.parametrize("how", list(CHECK_BREAKS))
def test_check_authors100_names_each_broken_file(tmp_path, how):
    from studies.authors100.records import check_authors100

    src = ROOT / "results" / "cifar" / "authors100"
    shutil.copytree(src, tmp_path / "a100")
    d = tmp_path / "a100" / Path(*A100_RUN)
    name = "lr10/ill/kwng/seed1"
    assert name in check_authors100(tmp_path / "a100", tiers=(3,))["ok"]
    CHECK_BREAKS[how](d)
    res = check_authors100(tmp_path / "a100", tiers=(3,))
    assert name not in res["ok"]
    [entry] = [e for e in res["incomplete"] if e.startswith(name)]
    assert str(d) in entry


def test_check_refuses_unknown_tiers():
    from studies.authors100.records import check_authors100
    from studies.cifar.cli import main

    with pytest.raises(ValueError, match="tiers"):
        check_authors100(tiers=(9,))
    with pytest.raises(SystemExit) as exc:
        main(["check", "--suite", "authors100", "--tiers", "9"])
    assert exc.value.code == 2


# ------------------------------------------------------------ dampings fail loudly
def test_an_unknown_damping_is_refused_not_computed_as_another(monkeypatch):
    """``solve.damping_diagonal`` raises for a name without its own branch (even one
    added to ``DAMPINGS``), never computes it as ``T_tilde``; the fused path's check
    says ``False`` for any damping without a kernel, leaving it to the compiled path."""
    import torch

    from kwng import solve
    from kwng.engine.triton_solve import fused_available

    T = torch.randn(3, 7)
    with pytest.raises(ValueError, match="damping must be one of"):
        solve.damping_diagonal("T_tyld", T, T)
    with pytest.raises(ValueError, match="needs T_tilde"):
        solve.damping_diagonal("T_tilde", T, None)
    for kind in solve.DAMPINGS:
        D, low, zero = solve.damping_diagonal(kind, T, T)
        assert D.shape == (7,) and bool((D > 0).all())
    monkeypatch.setattr(solve, "DAMPINGS", (*solve.DAMPINGS, "T_new"))
    with pytest.raises(ValueError, match="no definition"):
        solve.damping_diagonal("T_new", T, T)
    assert fused_available(T, torch.randn(7), "T_tyld") is False
    assert fused_available(T, torch.randn(7), "T_new") is False
    assert fused_available(T, torch.randn(7), "T") in (True, False)
