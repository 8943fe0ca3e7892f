"""Fault cases of issue 23, points 1, 3 and 4: no result is credited to a run that
never happened, and every resume repairs or refuses what it reads.

1. ``cifar sweep`` applies the single-run identity check to every run it would skip;
   a malformed ``identity`` is a refusal;
3. the Fisher sweep resume reads ``sweep.csv`` through the checked reader;
4. the other resume holes (relerr duplicates, flow ``loss.csv``, NaN in a flow curve,
   ``cifar --val-size``, ``cifar select --root``, ``relerr --out ""``).

Everything runs on the CPU at tiny sizes; committed results are only read (copied to
``tmp_path``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kwng.experiments import cifar, cifar_sweep, guard
from kwng.provenance import ResultFileError

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"


def _run_cfg(tmp_path: Path, **kw) -> dict:
    base = {"source": "sample", "model": "tiny", "batch_size": 100, "epochs": 2,
            "lr": 0.1, "device": "cpu", "out": str(tmp_path / "res"),
            "checkpoint_dir": str(tmp_path / "ck"), "train_subset": 200,
            "method": "sgd"}
    base.update(kw)
    return base


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------ 1. the sweep checks what it skips
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished tiny run (lr 0.1, 2 epochs); tests copy it."""
    tmp = tmp_path_factory.mktemp("finished")
    rec = cifar.run(_run_cfg(tmp), progress=False)
    assert rec["complete"]
    return tmp


def _copy_finished(finished_run: Path, tmp_path: Path) -> Path:
    import shutil

    for name in ("res", "ck"):
        if (finished_run / name).exists():
            shutil.copytree(finished_run / name, tmp_path / name)
    return cifar.run_dir_for(_run_cfg(tmp_path))


def test_sweep_refuses_to_skip_a_run_of_another_configuration(finished_run, tmp_path):
    rdir = _copy_finished(finished_run, tmp_path)
    before = _snapshot(tmp_path)
    plan = [_run_cfg(tmp_path, lr=0.5, epochs=5)]
    plan_file = tmp_path / "plans" / "p.json"
    with pytest.raises(guard.ConfigMismatchError) as err:
        cifar_sweep.sweep(plan, 0, 1, None, plan_file)
    msg = str(err.value)
    assert str(rdir) in msg and "epochs" in msg and "lr" in msg
    assert _snapshot(tmp_path) == before and not plan_file.exists()


def test_sweep_skips_a_finished_run_of_the_same_configuration(finished_run, tmp_path):
    rdir = _copy_finished(finished_run, tmp_path)
    assert cifar_sweep._is_complete(_run_cfg(tmp_path))
    # a record that claims completion for another configuration is not complete
    with pytest.raises(guard.ConfigMismatchError, match="differing keys: epochs"):
        cifar_sweep._is_complete(_run_cfg(tmp_path, epochs=3))
    assert (rdir / "metrics.json").is_file()


def test_sweep_force_backs_up_the_other_configuration(finished_run, tmp_path):
    rdir = _copy_finished(finished_run, tmp_path)
    old = (rdir / "metrics.json").read_bytes()
    assert not cifar_sweep._is_complete(_run_cfg(tmp_path, lr=0.5), force=True)
    assert not rdir.exists()
    backups = list(rdir.parent.glob("seed0.backup-*"))
    assert len(backups) == 1 and (backups[0] / "metrics.json").read_bytes() == old


def test_sweep_cli_refuses_with_rc_2_naming_the_run(finished_run, tmp_path, caplog,
                                                    monkeypatch):
    rdir = _copy_finished(finished_run, tmp_path)
    monkeypatch.setattr("kwng.experiments.cifar.CHECKPOINTS", tmp_path / "ckroot")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([_run_cfg(tmp_path, lr=0.5, epochs=5)]))
    with caplog.at_level(logging.ERROR):
        rc = cifar.main(["sweep", "--plan", str(plan), "--gpus", "0",
                         "--procs-per-gpu", "1"])
    assert rc == 2
    assert str(rdir) in caplog.text and "lr" in caplog.text


@pytest.mark.parametrize("identity", ["lr=0.1", None, [1, 2], {"lr": 0.1}])
def test_malformed_identity_is_a_refusal(finished_run, tmp_path, identity):
    rdir = _copy_finished(finished_run, tmp_path)
    mp = rdir / "metrics.json"
    rec = json.loads(mp.read_text())
    rec["identity"] = identity
    mp.write_text(json.dumps(rec))
    before = _snapshot(tmp_path)
    with pytest.raises(ResultFileError, match="identity"):
        cifar.run(_run_cfg(tmp_path), progress=False)  # single-run path
    assert not cifar_sweep._is_complete(_run_cfg(tmp_path))  # never skipped
    assert _snapshot(tmp_path) == before


def test_sweep_lists_a_run_with_a_malformed_identity_as_failed(finished_run, tmp_path,
                                                               caplog):
    rdir = _copy_finished(finished_run, tmp_path)
    mp = rdir / "metrics.json"
    rec = json.loads(mp.read_text())
    rec["identity"] = "lr=0.1"
    mp.write_text(json.dumps(rec))
    before = mp.read_bytes()
    rc = cifar_sweep.sweep([_run_cfg(tmp_path)], 0, 1, None, tmp_path / "p" / "p.json")
    assert rc == 1 and str(mp) in caplog.text and "'identity' is a str" in caplog.text
    assert mp.read_bytes() == before


def test_record_that_is_not_an_object_is_a_refusal(tmp_path):
    with pytest.raises(ResultFileError, match="metrics.json: the record is a list"):
        guard.record_identity([1], tmp_path / "metrics.json")
