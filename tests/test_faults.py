"""Fault cases: nothing a user runs destroys results, bad input never gives
a silent wrong answer.

One section per numbered case of the issue:

1. commands never delete or overwrite results of another configuration (the committed
   ones included);
2. resume and skip compare the recorded configuration and refuse on a difference;
3. the decode cache follows the content of its source; a mistyped ``--data-root`` is an
   error;
4. low-precision inputs: the estimate is computed in float64 or flagged as meaningless;
5. NaN/Inf inputs are reported as such;
6. sweeps isolate failures, resume checks every CSV row, unreadable files are named.

Everything runs on the CPU at tiny sizes; committed results are only ever read (copied
to ``tmp_path``).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import kwng
from studies.cifar import cli as cifar
from studies.cifar import data as kdata
from studies.cifar import images as kimages
from studies.cifar import results, runtime, sweep, train
from studies.synthetic import sweep as syn
from studies.toy import flow as synflow
from studies.toy import setup as synthetic_setup

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"


def _tiny_relerr(runs: int = 2) -> dict:
    cfg = synthetic_setup.relerr_config("small")
    cfg.update(
        models=["sphere"],
        dims=[1, 2],
        N_values=[60, 120],
        N_fixed=120,
        M_values=[5],
        runs=runs,
    )
    return cfg


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _run_cfg(tmp_path: Path, **kw) -> dict:
    base = {
        "source": "sample",
        "model": "tiny",
        "batch_size": 100,
        "epochs": 2,
        "lr": 0.1,
        "device": "cpu",
        "out": str(tmp_path / "res"),
        "checkpoint_dir": str(tmp_path / "ck"),
        "train_subset": 200,
        "method": "sgd",
    }
    base.update(kw)
    return base


# ----------------------------------------------------- 1. results are never destroyed
def test_sweep_refuses_another_configuration_and_force_backs_up(tmp_path):
    out = tmp_path / "relerr"
    syn.run_sweep(_tiny_relerr(runs=2), out, progress=False)
    before = _snapshot(out)
    with pytest.raises(ValueError, match=r"(?s)relerr.*differing keys: runs"):
        syn.run_sweep(_tiny_relerr(runs=3), out, progress=False)
    assert _snapshot(out) == before  # nothing deleted, nothing rewritten
    syn.run_sweep(_tiny_relerr(runs=3), out, progress=False, force=True)
    backups = list(tmp_path.glob("relerr.backup-*"))
    assert (
        len(backups) == 1 and _snapshot(backups[0]) == before
    )  # the old results, moved whole
    rows = synthetic_setup.load_rows(out / "sphere.csv")
    assert {r["run"] for r in rows} == {0, 1, 2}


def test_small_command_leaves_full_scale_results_alone(tmp_path):
    """The README's ``relerr --scale small`` on a folder holding the committed
    full-scale results (a copy)."""
    out = tmp_path / "relerr"
    out.mkdir()
    for name in ("config.json", "provenance.json", "sphere.csv"):
        shutil.copy(RESULTS / "relerr" / name, out / name)
    before = _snapshot(out)
    rc = syn.main(
        [
            "relerr",
            "--scale",
            "small",
            "--model",
            "sphere",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 2
    assert _snapshot(out) == before


def test_flow_refuses_another_configuration(tmp_path):
    cfg = synthetic_setup.flow_config("small")
    cfg.update(
        d=2,
        iterations=2,
        kwng_variants={"kwng": {"N": 40, "M": 10}},
        steps={"wng": 0.1, "kwng": 0.1, "eg": 1e-2},
    )
    synflow.run_flow(cfg, tmp_path / "flow", progress=False)
    before = _snapshot(tmp_path / "flow")
    with pytest.raises(ValueError, match="differing keys: iterations"):
        synflow.run_flow({**cfg, "iterations": 3}, tmp_path / "flow", progress=False)
    assert _snapshot(tmp_path / "flow") == before


def _copy_cut_record(tmp_path: Path) -> Path:
    """A copy of a committed 6-epoch record (``ill/sgd/seed0``), cut after 3 epochs in
    the copy as the GPU budget cut the study's ``kwng_m20`` runs (a method that has
    left the code)."""
    src = RESULTS / "cifar" / "cifar10" / "ill" / "sgd" / "seed0"
    dst = tmp_path / "res" / "cifar10" / "ill" / "sgd" / "seed0"
    shutil.copytree(src, dst)
    rec = json.loads((dst / "metrics.json").read_text())
    # the record predates the key "schedule" (its identity reads it as the study's
    # "study6", a schedule that has left the code): the copy names a live one
    rec.update(complete=False, epochs=rec["epochs"][:3])
    rec["config"]["schedule"] = "claim"
    (dst / "metrics.json").write_text(json.dumps(rec))
    return dst


def test_cifar_run_never_overwrites_the_budget_cut_record(tmp_path):
    """A tiny run aimed at a committed record cut by the budget (a copy) is
    refused."""
    dst = _copy_cut_record(tmp_path)
    before = _snapshot(dst)
    cfg = _run_cfg(tmp_path, method="sgd", conditioning="ill", max_steps=2)
    with pytest.raises(ValueError, match=r"differing keys: .*epochs.*model"):
        train.run(cfg, progress=False)
    assert _snapshot(dst) == before


def test_cifar_run_same_configuration_without_checkpoint_is_refused(tmp_path):
    """Same settings as the cut record but its checkpoint is gone: starting over would
    overwrite it."""
    dst = _copy_cut_record(tmp_path)
    before = _snapshot(dst)
    rec = json.loads((dst / "metrics.json").read_text())
    c = rec["config"]
    # (a deadline in the past: were the run to start, it would stop at its first step)
    cfg = _run_cfg(
        tmp_path,
        method="sgd",
        conditioning="ill",
        model=c["model"],
        epochs=c["epochs"],
        lr=rec["lr"],
        batch_size=None,
        train_subset=None,
        deadline=1.0,
        schedule="claim",  # the schedule the copy names
    )
    with pytest.raises(ValueError, match="checkpoint .* is missing"):
        train.run(cfg, progress=False)
    assert _snapshot(dst) == before


def test_schedule_never_replaces_a_different_file(tmp_path, caplog):
    """``cifar schedule`` (and ``timing``, ``select``) refuse to replace a different
    output file (rc 2, the reason logged)."""
    out = tmp_path / "schedule.json"
    shutil.copy(RESULTS / "cifar" / "schedule.json", out)
    before = out.read_bytes()
    timing_file = str(RESULTS / "cifar" / "timing" / "timing.json")
    args = ["schedule", "--budget-s", "123", "--timing", timing_file, "--out", str(out)]
    assert cifar.main(args) == 2
    assert "differing keys: budget_s" in caplog.text
    assert out.read_bytes() == before
    assert cifar.main(args + ["--force"]) == 0
    assert json.loads(out.read_text())["budget_s"] == 123
    assert [b.read_bytes() for b in tmp_path.glob("schedule.json.backup-*")] == [before]


# ----------------------------------------------------- 2. reruns compare the settings
def test_resume_with_another_lr_is_refused(tmp_path):
    train.run(_run_cfg(tmp_path, stop_after_epoch=1), progress=False)
    rdir = runtime.run_dir_for(_run_cfg(tmp_path))
    before = _snapshot(rdir)
    with pytest.raises(ValueError, match="differing keys: lr"):
        train.run(_run_cfg(tmp_path, lr=0.01), progress=False)
    assert _snapshot(rdir) == before
    assert (
        cifar.main(
            [
                "--source",
                "sample",
                "--model",
                "tiny",
                "--batch-size",
                "100",
                "--epochs",
                "2",
                "--lr",
                "0.01",
                "--device",
                "cpu",
                "--out",
                str(tmp_path / "res"),
                "--checkpoint-dir",
                str(tmp_path / "ck"),
                "--train-subset",
                "200",
                "--method",
                "sgd",
                "--no-progress",
            ]
        )
        == 2
    )


def test_finished_run_asked_with_other_settings_is_refused(tmp_path):
    done = train.run(_run_cfg(tmp_path), progress=False)
    assert done["complete"]
    assert (
        train.run(_run_cfg(tmp_path), progress=False)["epochs"] == done["epochs"]
    )  # same settings: skipped
    with pytest.raises(ValueError, match="differing keys: epochs"):
        train.run(_run_cfg(tmp_path, epochs=3), progress=False)
    with pytest.raises(ValueError, match="differing keys: .*lr"):
        train.run(_run_cfg(tmp_path, lr=0.05), progress=False)
    # --force keeps the old run in a dated backup
    again = train.run(_run_cfg(tmp_path, epochs=3), progress=False, force=True)
    assert again["complete"] and len(again["epochs"]) == 3
    rdir = runtime.run_dir_for(_run_cfg(tmp_path))
    backups = list(rdir.parent.glob("seed0.backup-*"))
    assert (
        len(backups) == 1
        and json.loads((backups[0] / "metrics.json").read_text())["epochs"]
        == done["epochs"]
    )


# ----------------------------------------------------- 3. caches and data roots
def _npz_like_sample(path: Path, test_from_train: bool) -> None:
    z = dict(np.load(kdata.SAMPLE_PATH))
    if test_from_train:  # same number of test images (200), other images and labels
        off = z["train_offsets"][:201]
        z["test_jpeg"], z["test_offsets"], z["y_test"] = (
            z["train_jpeg"][: off[-1]],
            off,
            z["y_train"][:200],
        )
    np.savez(path, **z)


def test_decode_cache_follows_the_source_content(tmp_path):
    npz, cache = tmp_path / "cifar10_jpeg.npz", tmp_path / "cache"
    _npz_like_sample(npz, test_from_train=False)
    x1, y1 = kimages.load_jpeg_npz(npz, "test", cache_dir=cache)
    _npz_like_sample(
        npz, test_from_train=True
    )  # replaced: same image count, other images
    x2, y2 = kimages.load_jpeg_npz(npz, "test", cache_dir=cache)
    xt, yt = kdata.load_sample("train")
    np.testing.assert_array_equal(y2, yt[:200])
    np.testing.assert_array_equal(x2, xt[:200])  # decoded again, not the stale cache
    assert not np.array_equal(x1, x2)


def test_missing_data_root_is_an_error(tmp_path, monkeypatch):
    fallback = tmp_path / "fallback"
    fallback.mkdir()
    _npz_like_sample(fallback / "cifar10_jpeg.npz", test_from_train=False)
    monkeypatch.setenv(
        "KWNG_DATA", str(fallback)
    )  # data exists elsewhere: it must not be used
    with pytest.raises(FileNotFoundError, match="does not exist"):
        kdata.find_source("cifar10", tmp_path / "cifar10_jpg.npz")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        kdata.load_cifar("cifar10", "test", data_root=tmp_path / "typo")
    assert (
        kdata.find_source("cifar10")[1] == fallback / "cifar10_jpeg.npz"
    )  # no data_root: the search


# ----------------------------------------------------- 4. low precision
def _estimate(dtype: torch.dtype, shift: float):
    d, N, M = 3, 300, 30
    model = kwng.NormalModel(d=d)
    theta = model.random_params(torch.Generator().manual_seed(0))
    theta[:d] += shift  # outputs of magnitude ~shift, unit spread
    Z = model.sample_latent(N, torch.Generator().manual_seed(1))
    grad = torch.randn(
        model.num_params,
        dtype=torch.float64,
        generator=torch.Generator().manual_seed(2),
    )
    kw = dict(
        num_basis=M,
        eps=1e-5,
        kernel=kwng.GaussianKernel(1.0),
        bandwidth="mean_sq",
        basis_idx=torch.arange(M),
        basis_coords=torch.arange(M) % d,
    )
    ref = kwng.kwng_gradient(lambda t: model.sample(t, Z), theta, grad, **kw).direction
    Zl = Z.to(dtype)
    res = kwng.kwng_gradient(
        lambda t: model.sample(t, Zl), theta.to(dtype), grad.to(dtype), **kw
    )
    return res.direction.double(), ref


@pytest.mark.parametrize("shift", [1.0, 100.0])
def test_float32_estimate_matches_float64(shift):
    with warnings.catch_warnings():
        warnings.simplefilter(
            "error", RuntimeWarning
        )  # float32 at these magnitudes is not flagged
        d32, ref = _estimate(torch.float32, shift)
    assert kwng.relative_error(d32, ref) < 1e-4


def test_float16_small_outputs_accurate_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        d16, ref = _estimate(torch.float16, 1.0)
    assert kwng.relative_error(d16, ref) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_large_outputs_warn(dtype):
    with pytest.warns(RuntimeWarning, match="rounded to .* of their spread"):
        _estimate(dtype, 100.0)
    with pytest.raises(ValueError, match="samples X are equal"):
        _estimate(dtype, 1e4)


# ----------------------------------------------------- 5. NaN / Inf inputs
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_samples_are_reported_as_such(bad):
    X = torch.randn(
        40, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    X[3, 1] = bad
    word = "NaN" if bad != bad else "inf"
    with pytest.raises(
        ValueError, match=rf"1 {word}" if word == "NaN" else r"0 NaN and 1 inf"
    ):
        kwng.mean_sq_bandwidth(X, X[:5])
    with pytest.raises(ValueError, match="NaN"):
        kwng.median_bandwidth(X)
    net = torch.nn.Linear(3, 3).double()
    Xo = net(X)
    g = torch.zeros(sum(p.numel() for p in net.parameters()), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"X \(the samples\).*NaN"):
        kwng.kwng_gradient_from_outputs(
            Xo,
            list(net.parameters()),
            g,
            num_basis=5,
            eps=1e-3,
            kernel=kwng.GaussianKernel(1.0),
            bandwidth="mean_sq",
        )


# ----------------------------------------------------- 6. failures, bad rows, bad files
def test_corrupt_metrics_does_not_stop_the_worker(tmp_path):
    jobs = [_run_cfg(tmp_path, method="sgd", seed=s, epochs=1) for s in (0, 1)]
    bad = runtime.run_dir_for(jobs[0]) / "metrics.json"
    bad.parent.mkdir(parents=True)
    bad.write_text('{"config": {"epochs": 1}, "comple')  # truncated
    failures = sweep.worker(jobs, "test", None)
    assert json.loads((runtime.run_dir_for(jobs[1]) / "metrics.json").read_text())[
        "complete"
    ]
    assert len(failures) == 1 and str(bad) in failures[0]["error"]


def test_a_cut_run_is_refused_by_a_worker_and_run_again_with_force(tmp_path):
    """A run cut after its first epoch whose checkpoint is gone: a worker logs it as a
    failure and leaves it; with ``force`` the record moves to a dated backup beside it
    and the run trains to the end."""
    job = _run_cfg(tmp_path, method="sgd", epochs=2)
    train.run({**job, "stop_after_epoch": 1}, progress=False)
    rdir = runtime.run_dir_for(job)
    runtime.checkpoint_path_for(job).unlink()
    before = _snapshot(rdir)
    failures = sweep.worker([job], "cut", None)
    assert len(failures) == 1 and "checkpoint" in failures[0]["error"]
    assert _snapshot(rdir) == before
    assert sweep.worker([job], "cut-force", None, force=True) == []
    rec = json.loads((rdir / "metrics.json").read_text())
    assert rec["complete"] and len(rec["epochs"]) == 2
    (backup,) = rdir.parent.glob("seed0.backup-*")
    assert _snapshot(backup) == before


def test_sweep_exits_non_zero_listing_failures(tmp_path, caplog):
    jobs = [_run_cfg(tmp_path, method="sgd", seed=s, epochs=1) for s in (0, 1)]
    bad = runtime.run_dir_for(jobs[1]) / "metrics.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("not json")
    rc = sweep.sweep(jobs, 0, 1, None, tmp_path / "plans" / "p.json")
    assert rc == 1
    assert json.loads((runtime.run_dir_for(jobs[0]) / "metrics.json").read_text())[
        "complete"
    ]
    assert str(bad) in caplog.text


def test_resume_recomputes_bad_csv_rows(tmp_path):
    out = tmp_path / "relerr"
    syn.run_sweep(_tiny_relerr(), out, progress=False)
    path = out / "sphere.csv"
    good = path.read_text()
    lines = good.splitlines()
    header, rows = lines[0], lines[1:]
    nan_row = rows[2].rsplit(",", 1)[0] + ",nan"
    # a NaN error, a repeated row, and a last row cut in the middle of a number that
    # still parses (the file then ends without its line end, as an interrupted plain
    # write leaves it)
    broken = [header, rows[0], rows[1], nan_row, *rows[3:-1], rows[4], rows[-1][:-4]]
    path.write_text("\n".join(broken))
    assert syn.check_results_complete("relerr", tmp_path, runs=2) != []
    syn.run_sweep(_tiny_relerr(), out, progress=False)
    assert sorted(path.read_text().splitlines()) == sorted(
        good.splitlines()
    )  # recomputed bit for bit
    assert syn.check_results_complete("relerr", tmp_path, runs=2) == []


def test_unreadable_files_are_named(tmp_path):
    from studies.kit.provenance import read_json

    f = tmp_path / "metrics.json"
    f.write_text('{"epochs": [1, 2')
    with pytest.raises(ValueError, match=str(f)):
        read_json(f)
    rdir = tmp_path / "res" / "cifar10" / "ill" / "sgd" / "seed0"
    rdir.mkdir(parents=True)
    (rdir / "metrics.json").write_text("")
    with pytest.raises(ValueError, match=str(rdir / "metrics.json")):
        results.load_results(tmp_path / "res", "cifar10")
    csv_path = tmp_path / "sphere.csv"
    csv_path.write_text(
        ",".join(synthetic_setup.SWEEP_COLUMNS)
        + "\nsphere,N,1,100,10,1.0,zero,1.0,3,0.1\n"
    )
    with pytest.raises(ValueError, match=rf"{csv_path}:2.*'run'"):
        synthetic_setup.load_rows(csv_path)


def test_truncated_checkpoint_is_named(tmp_path):
    cfg = _run_cfg(tmp_path, stop_after_epoch=1)
    train.run(cfg, progress=False)
    ck = runtime.checkpoint_path_for(cfg)
    blob = ck.read_bytes()
    ck.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(Exception) as info:
        train.run(_run_cfg(tmp_path), progress=False)
    assert str(ck) in str(info.value)
    rdir = runtime.run_dir_for(cfg)
    partial = (rdir / "metrics.json").read_bytes()
    rec = train.run(
        _run_cfg(tmp_path), progress=False, force=True
    )  # restarts; the old files kept aside
    assert rec["complete"]
    assert [b.read_bytes() for b in ck.parent.glob("checkpoint.pt.backup-*")] == [
        blob[: len(blob) // 2]
    ]
    assert [
        (b / "metrics.json").read_bytes() for b in rdir.parent.glob("seed0.backup-*")
    ] == [partial]
