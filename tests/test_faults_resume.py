"""Fault cases: no result is credited to a run that
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

from studies.cifar import cli as cifar
from studies.cifar import runtime, train
from studies.cifar import sweep as cifar_sweep
from studies.fisher import flow as fisher_flow
from studies.fisher import sweep as fisher_sweep
from studies.kit import guard
from studies.kit.provenance import ResultFileError
from studies.toy import setup as synthetic_setup

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
    rec = train.run(_run_cfg(tmp), progress=False)
    assert rec["complete"]
    return tmp


def _copy_finished(finished_run: Path, tmp_path: Path) -> Path:
    import shutil

    for name in ("res", "ck"):
        if (finished_run / name).exists():
            shutil.copytree(finished_run / name, tmp_path / name)
    return runtime.run_dir_for(_run_cfg(tmp_path))


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
    assert cifar_sweep.is_complete(_run_cfg(tmp_path))
    # a record that claims completion for another configuration is not complete
    with pytest.raises(guard.ConfigMismatchError, match="differing keys: epochs"):
        cifar_sweep.is_complete(_run_cfg(tmp_path, epochs=3))
    assert (rdir / "metrics.json").is_file()


def test_sweep_force_backs_up_the_other_configuration(finished_run, tmp_path):
    rdir = _copy_finished(finished_run, tmp_path)
    old = (rdir / "metrics.json").read_bytes()
    assert not cifar_sweep.is_complete(_run_cfg(tmp_path, lr=0.5), force=True)
    assert not rdir.exists()
    backups = list(rdir.parent.glob("seed0.backup-*"))
    assert len(backups) == 1 and (backups[0] / "metrics.json").read_bytes() == old


def test_sweep_cli_refuses_with_rc_2_naming_the_run(finished_run, tmp_path, caplog,
                                                    monkeypatch):
    rdir = _copy_finished(finished_run, tmp_path)
    monkeypatch.setattr("studies.cifar.methods.CHECKPOINTS",
                        tmp_path / "ckroot")
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
        train.run(_run_cfg(tmp_path), progress=False)  # single-run path
    assert not cifar_sweep.is_complete(_run_cfg(tmp_path))  # never skipped
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


# ------------------------------------------- 3. the Fisher sweep resume checks each row
def _tiny_fisher():
    from studies.fisher import cli as E

    cfg = E.sweep_config("small")
    cfg.update(models=["normal", "sphere"], dims=[2], N_values=[200], M_values=[10],
               N_fixed=200, runs=2)
    return cfg


_TIMES = ("time_wng_s", "time_fng_s")


def _values(rows: list[dict]) -> list[tuple]:
    """Rows without their timings, NaN as a string (so that NaN == NaN)."""
    return sorted(tuple(str(v) for k, v in sorted(r.items()) if k not in _TIMES)
                  for r in rows)


@pytest.fixture(scope="module")
def fisher_done(tmp_path_factory) -> Path:

    out = tmp_path_factory.mktemp("fisher") / "out"
    fisher_sweep.run_sweep(_tiny_fisher(), out, progress=False)
    return out


def _damage(lines: list[str], how: str) -> list[str]:
    if how == "truncated":
        return lines[:-1] + [lines[-1][: len(lines[-1]) // 2]]  # cut, no line end
    if how == "nan":
        f = lines[3].split(",")
        f[7] = "nan"  # err_wng of a normal row
        return lines[:3] + [",".join(f)] + lines[4:]
    if how == "duplicated":
        f = lines[2].split(",")
        f[7] = "0.5"  # same key, another value: which one is right is unknown
        return lines + [",".join(f) + "\n"]
    if how == "unparsable":
        return lines[:2] + ["abc\n"] + lines[2:]
    raise ValueError(how)


@pytest.mark.parametrize("how", ["truncated", "nan", "duplicated", "unparsable"])
def test_fisher_resume_removes_and_recomputes_damaged_rows(fisher_done, tmp_path, how,
                                                           caplog):
    import shutil


    out = tmp_path / "out"
    shutil.copytree(fisher_done, out)
    path = out / "sweep.csv"
    good = fisher_sweep.load_sweep(path)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(_damage(lines, how)))
    with pytest.raises(ResultFileError, match=str(path)):
        fisher_sweep.load_sweep(path)
    with caplog.at_level(logging.WARNING):
        fisher_sweep.run_sweep(_tiny_fisher(), out, progress=False)
    assert f"{path}:" in caplog.text and "recomputed" in caplog.text
    rows, problems, _ = fisher_sweep.checked_sweep_rows(path)
    assert problems == []
    assert _values(rows) == _values(good)  # the same draws, recomputed


def test_fisher_unreadable_sweep_csv_refused_or_backed_up_with_force(fisher_done,
                                                                     tmp_path):
    import shutil


    out = tmp_path / "out"
    shutil.copytree(fisher_done, out)
    path = out / "sweep.csv"
    good = fisher_sweep.load_sweep(path)
    path.write_text("abc\n")
    with pytest.raises(ResultFileError, match=f"{path}.*header.*--force"):
        fisher_sweep.run_sweep(_tiny_fisher(), out, progress=False)
    assert path.read_text() == "abc\n"
    fisher_sweep.run_sweep(_tiny_fisher(), out, progress=False, force=True)
    assert _values(fisher_sweep.load_sweep(path)) == _values(good)
    assert [p.read_text() for p in out.glob("sweep.csv.backup-*")] == ["abc\n"]


def test_fisher_cli_refuses_another_configuration_and_has_force(fisher_done, tmp_path,
                                                               caplog):
    import shutil

    from studies.fisher import cli as E

    out = tmp_path / "out"
    shutil.copytree(fisher_done, out)
    before = _snapshot(out)
    with caplog.at_level(logging.ERROR):
        rc = E.main(["fisher", "--part", "sweep", "--scale", "small", "--out",
                     str(out), "--no-progress"])
    assert rc == 2 and "fisher-sweep.config.json" in caplog.text
    assert "differing keys" in caplog.text and _snapshot(out) == before
    # --force moves this part's files only, to dated backups (checked on the tiny grid)
    other = dict(_tiny_fisher(), runs=1)
    fisher_sweep.run_sweep(other, out, progress=False, force=True)
    assert len(fisher_sweep.load_sweep(out / "sweep.csv")) == 2 * 2 * 1
    olds = list(out.glob("sweep.csv.backup-*"))
    assert len(olds) == 1 and olds[0].read_bytes() == before["sweep.csv"]
    assert _has_force_option()


def _has_force_option() -> bool:
    import contextlib
    import io

    from studies.fisher import cli as E

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        E.main(["fisher", "--help"])
    return "--force" in buf.getvalue()


# --------------------------------------------------------- 4. the other resume holes
def _tiny_relerr() -> dict:

    cfg = synthetic_setup.relerr_config("small")
    cfg.update(models=["sphere"], dims=[1, 2], N_values=[60, 120], N_fixed=120,
               M_values=[5], runs=2)
    return cfg


@pytest.mark.parametrize("copy_changed", [False, True])
def test_relerr_duplicated_row_is_actually_removed(tmp_path, caplog, copy_changed):
    from studies.synthetic import sweep as syn

    out = tmp_path / "relerr"
    syn.run_sweep(_tiny_relerr(), out, progress=False)
    path = out / "sphere.csv"
    good = path.read_text()
    lines = good.splitlines(keepends=True)
    dup = lines[3]
    if copy_changed:  # same run, another error: which copy is right is unknown
        f = dup.rstrip("\n").split(",")
        f[-1] = "0.123"
        dup = ",".join(f) + "\n"
    path.write_text("".join(lines + [dup]))
    with pytest.raises(ResultFileError, match="duplicate"):
        synthetic_setup.load_rows(path)
    with caplog.at_level(logging.WARNING):
        syn.run_sweep(_tiny_relerr(), out, progress=False)
    assert "removed" in caplog.text
    assert sorted(path.read_text().splitlines()) == sorted(good.splitlines())
    assert len(synthetic_setup.load_rows(path)) == len(lines) - 1


def _tiny_flow() -> dict:

    cfg = synthetic_setup.flow_config("small")
    cfg.update(d=2, iterations=3, kwng_variants={"kwng": {"N": 40, "M": 10}},
               steps={"wng": 0.1, "kwng": 0.1, "eg": 1e-2})
    return cfg


@pytest.fixture(scope="module")
def flow_done(tmp_path_factory) -> Path:
    from studies.toy import flow as synflow

    out = tmp_path_factory.mktemp("flow") / "flow"
    synflow.run_flow(_tiny_flow(), out, progress=False)
    return out


@pytest.mark.parametrize("cut", ["half", "one_row"])
def test_flow_rerun_with_truncated_loss_csv_recomputes(flow_done, tmp_path, caplog,
                                                       cut):
    import shutil

    from studies.toy import flow as synflow

    out = tmp_path / "flow"
    shutil.copytree(flow_done, out)
    good = (out / "loss.csv").read_text()
    text = good[: len(good) // 2] if cut == "half" else good.rsplit("\n", 2)[0] + "\n"
    (out / "loss.csv").write_text(text)
    with caplog.at_level(logging.WARNING):
        synflow.run_flow(_tiny_flow(), out, progress=False)
    assert "recomputed" in caplog.text and str(out) in caplog.text
    assert (out / "loss.csv").read_text() == good


def test_nan_inside_a_flow_curve_fails_the_completeness_check(flow_done, tmp_path):
    import shutil

    from studies.synthetic import sweep as syn

    res = tmp_path / "results"
    shutil.copytree(flow_done, res / "flow")
    prov = json.loads((res / "flow" / "provenance.json").read_text())
    assert syn.check_results_complete("flow", res) == []
    path = res / "flow" / "loss.csv"
    lines = path.read_text().splitlines(keepends=True)
    i = next(k for k, ln in enumerate(lines) if ln.startswith("2,wng,"))
    lines[i] = "2,wng,nan\n"  # a hole in a run that never stopped
    path.write_text("".join(lines))
    problems = syn.check_results_complete("flow", res)
    assert any("method wng: iteration 2" in p and "never stopped" in p
               for p in problems), problems
    # a stopped method: NaN from the iteration after its stop on is data, not damage
    prov["diverged_at"] = {"wng": 1}
    j = next(k for k, ln in enumerate(lines) if ln.startswith("3,wng,"))
    lines[j] = "3,wng,nan\n"
    path.write_text("".join(lines))
    assert synthetic_setup.flow_problems(res / "flow", prov) == []


def test_cifar_val_size_not_below_the_training_set_is_refused(tmp_path, caplog):
    args = ["--source", "sample", "--model", "tiny", "--epochs", "1", "--lr", "0.1",
            "--device", "cpu", "--method", "sgd", "--out", str(tmp_path / "res"),
            "--checkpoint-dir", str(tmp_path / "ck"), "--no-progress"]
    with caplog.at_level(logging.ERROR):
        rc = cifar.main(args + ["--val-size", "100000"])
    assert rc == 2 and "val_size must be smaller than the training set" in caplog.text
    assert not list(tmp_path.rglob("metrics.json"))


def test_cifar_select_with_a_mistyped_root_is_refused(tmp_path, caplog):
    typo = tmp_path / "selectoin"
    with caplog.at_level(logging.ERROR):
        rc = cifar.main(["select", "--root", str(typo)])
    assert rc == 2 and str(typo) in caplog.text and "no selection runs" in caplog.text
    assert not typo.exists()


@pytest.mark.parametrize("command", ["relerr", "flow", "fisher"])
def test_empty_out_is_refused(command, capsys):
    from studies.fisher import cli as E
    from studies.synthetic import sweep as syn

    main = E.main if command == "fisher" else syn.main
    with pytest.raises(SystemExit) as exc:
        main([command, "--out", "", "--no-progress"])
    assert exc.value.code == 2
    assert "--out" in capsys.readouterr().err


def test_fisher_flow_rerun_with_truncated_flow_csv_recomputes(tmp_path, caplog):
    from studies.fisher import cli as E

    cfg = E.flow_config("small")
    cfg.update(iterations=3, N=60, M=10)
    out = tmp_path / "fisher"
    fisher_flow.run_flow(cfg, out, progress=False)
    path = out / "flow.csv"
    good = path.read_text()
    path.write_text(good[: len(good) // 2])
    with caplog.at_level(logging.WARNING):
        fisher_flow.run_flow(cfg, out, progress=False)
    assert "recomputed" in caplog.text and str(path) in caplog.text
    assert path.read_text() == good
