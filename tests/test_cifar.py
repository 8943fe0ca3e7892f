"""CIFAR study: loaders, augmentation, runner (exact resume), KFAC/EKFAC wrapper, result
completeness."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from studies.cifar import data as kdata
from studies.cifar import (
    images,
    methods,
    plans,
    results,
    runtime,
    steps,
    train,
)
from studies.cifar.config import SMALL_RUN, RunConfig
from studies.claim_suite import records as claim_records
from studies.study6 import records as study6_records


def _fake(n: int, classes: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), rng.integers(
        0, classes, n
    )


@pytest.mark.parametrize("dataset,classes", [("cifar10", 10), ("cifar100", 100)])
def test_official_format_roundtrip(tmp_path, dataset, classes):
    xtr, ytr = _fake(23, classes, 1)
    xte, yte = _fake(7, classes, 2)
    kdata.write_official_cifar(tmp_path, dataset, xtr, ytr, xte, yte)
    for split, (x, y) in {"train": (xtr, ytr), "test": (xte, yte)}.items():
        gx, gy = kdata.load_cifar(dataset, split, data_root=tmp_path)
        assert gx.dtype == np.uint8 and gx.shape == x.shape
        np.testing.assert_array_equal(gx, x)
        np.testing.assert_array_equal(gy, y)
    assert kdata.find_source(dataset, tmp_path)[0] == "official"


def test_official_missing_file_raises(tmp_path):
    xtr, ytr = _fake(5, 10)
    d = kdata.write_official_cifar(tmp_path, "cifar10", xtr, ytr, xtr, ytr)
    (d / "data_batch_3").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        kdata.read_official_cifar(tmp_path, "cifar10", "train")


def test_sample_and_jpeg_cache(tmp_path):
    x, y = kdata.load_sample("train")
    assert x.shape == (500, 32, 32, 3) and x.dtype == np.uint8
    assert np.bincount(y, minlength=10).tolist() == [50] * 10
    xt, yt = kdata.load_sample("test")
    assert xt.shape == (200, 32, 32, 3) and np.bincount(yt).tolist() == [20] * 10
    # the sample has the layout of the offline npz: the JPEG loader reads it and caches
    # the decode
    gx, gy = images.load_jpeg_npz(kdata.SAMPLE_PATH, "test", cache_dir=tmp_path)
    np.testing.assert_array_equal(gx, xt)
    assert (tmp_path / "cifar10_sample_test_x.npy").is_file()
    gx2, _ = images.load_jpeg_npz(kdata.SAMPLE_PATH, "test", cache_dir=tmp_path)
    np.testing.assert_array_equal(gx2, xt)
    # JPEG quality 75 of natural images: channel means near the CIFAR-10 ones
    assert np.allclose(x.mean((0, 1, 2)) / 255, images.CIFAR_MEAN["cifar10"], atol=0.03)


def test_bad_arguments():
    with pytest.raises(ValueError, match="dataset"):
        kdata.load_cifar("mnist", "train")
    with pytest.raises(ValueError, match="split"):
        kdata.load_sample("val")
    with pytest.raises(ValueError, match="sample"):
        kdata.load_cifar("cifar100", "train", source="sample")


def test_augmentation_shapes_and_semantics():
    g = torch.Generator().manual_seed(0)
    x = torch.arange(2 * 3 * 32 * 32, dtype=torch.float32).reshape(2, 3, 32, 32)
    out = images.augment_batch(x, g)
    assert out.shape == x.shape
    # every output is a crop of the padded image, possibly flipped: check against a
    # direct computation
    g = torch.Generator().manual_seed(0)
    ox = torch.randint(0, 9, (2,), generator=g)
    oy = torch.randint(0, 9, (2,), generator=g)
    flip = torch.rand(2, generator=g) < 0.5
    xp = torch.nn.functional.pad(x, (4, 4, 4, 4))
    for b in range(2):
        ref = xp[b, :, oy[b]:oy[b] + 32, ox[b]:ox[b] + 32]
        ref = ref.flip(-1) if flip[b] else ref
        assert torch.equal(out[b], ref)


def test_gpu_data_determinism_and_normalisation():
    x, y = kdata.load_sample("test")
    d = images.GPUAugmentedData(x, y)
    a = [z for z, _ in d.batches(64, torch.Generator().manual_seed(3))]
    b = [z for z, _ in d.batches(64, torch.Generator().manual_seed(3))]
    c = [z for z, _ in d.batches(64, torch.Generator().manual_seed(4))]
    assert (
        len(a) == 4 and a[0].shape == (64, 3, 32, 32) and a[-1].shape == (8, 3, 32, 32)
    )
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[0], c[0])
    z = torch.cat([z for z, _ in d.eval_batches(100)])
    assert abs(float(z.mean())) < 0.15 and abs(float(z.std()) - 1) < 0.15
    with pytest.raises(ValueError, match="x must be uint8"):
        images.GPUAugmentedData(x.astype(np.float32), y)


def test_gpu_data_in_float64_is_the_float32_data_to_float32_round_off():
    x, y = kdata.load_sample("test")
    d32 = images.GPUAugmentedData(x, y)
    d64 = images.GPUAugmentedData(x, y, dtype=torch.float64)
    z32 = next(d32.batches(64, torch.Generator().manual_seed(3)))[0]
    z64 = next(d64.batches(64, torch.Generator().manual_seed(3)))[0]
    assert z32.dtype == torch.float32 and z64.dtype == torch.float64
    err = float((z64 - z32.double()).abs().max())
    assert 0 < err < 4 * torch.finfo(torch.float32).eps * float(z64.abs().max())
    with pytest.raises(ValueError, match="floating torch dtype"):
        images.GPUAugmentedData(x, y, dtype=torch.int64)


def test_fp64_draws_the_network_in_float64_and_keeps_its_outputs_in_it():
    from studies.cifar.config import RunConfig
    from studies.cifar.methods import drawn_in
    from studies.cifar.metrics import full_precision
    from studies.cifar.steps import build_model

    before = torch.get_default_dtype()
    model = build_model(RunConfig(model="tiny", precision="fp64"))
    assert torch.get_default_dtype() == before
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert {p.dtype for p in build_model(RunConfig(model="tiny")).parameters()} == {
        torch.float32}
    t64, t16 = torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.bfloat16)
    assert full_precision(t64) is t64 and full_precision(t16).dtype == torch.float32
    with pytest.raises(ValueError, match="floating tensor"):
        full_precision(torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match="precision must be one of"), drawn_in("fp16"):
        pass
    with pytest.raises(ValueError, match="precision must be one of"):
        RunConfig(precision="fp16")


def _run_cfg(tmp_path, **kw):
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
    }
    base.update(kw)
    return base


@pytest.mark.parametrize("method", ["sgd_momentum", "kwng"])
def test_runner_exact_resume(tmp_path, method):
    full = train.run(_run_cfg(tmp_path / "a", method=method), progress=False)
    part = train.run(
        _run_cfg(tmp_path / "b", method=method, stop_after_epoch=1), progress=False
    )
    assert len(part["epochs"]) == 1 and not part["complete"]
    cfg_b = _run_cfg(tmp_path / "b", method=method)
    assert runtime.checkpoint_path_for(cfg_b).is_file()
    resumed = train.run(cfg_b, progress=False)
    assert resumed["complete"] and len(resumed["epochs"]) == 2
    assert not runtime.checkpoint_path_for(cfg_b).is_file()  # removed once complete
    keys = ["steps", "lr", "train_loss", "train_acc", "test_loss", "test_acc"]
    if method == "kwng":
        keys += ["eps", "fallbacks"]
    for ra, rb in zip(full["epochs"], resumed["epochs"]):
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}
    rdir = runtime.run_dir_for(cfg_b)
    assert (rdir / "metrics.json").is_file() and (rdir / "provenance.json").is_file()
    again = train.run(cfg_b, progress=False)  # finished runs are skipped
    assert again["epochs"] == resumed["epochs"]


def test_selection_rule(tmp_path):
    from studies.kit.provenance import atomic_write_json

    root = tmp_path / "sel"
    for lr, acc, loss in (
        (1.0, 0.3, 1.5),
        (0.1, 0.4, 1.2),
        (0.01, 0.4, 1.1),
        (10.0, 0.1, float("nan")),
    ):
        rec = {
            "config": {"dataset": "cifar10", "conditioning": "ill", "method": "sgd"},
            "lr": lr,
            "complete": True,
            "diverged": loss != loss,
            "epochs": [{"test_acc": acc, "train_loss": loss, "steps": 5}],
        }
        atomic_write_json(
            root / f"lr{lr:g}" / "cifar10" / "ill" / "sgd" / "seed0" / "metrics.json",
            rec,
        )
    out = results.select_lrs(root)
    # tie on accuracy -> lower training loss
    assert out["selected"]["cifar10/ill/sgd"]["lr"] == 0.01
    assert (root / "selected.json").is_file()


def test_selection_grows_by_method_but_refuses_a_change(tmp_path):
    from studies.kit.guard import ConfigMismatchError
    from studies.kit.provenance import atomic_write_json, read_json

    root = tmp_path / "sel"

    def short_run(method, lr, acc):
        rec = {
            "config": {"dataset": "cifar10", "conditioning": "ill", "method": method},
            "lr": lr,
            "complete": True,
            "diverged": False,
            "epochs": [{"test_acc": acc, "train_loss": 1.0, "steps": 5}],
        }
        path = (
            root / f"lr{lr:g}" / "cifar10" / "ill" / method / "seed0" / "metrics.json"
        )
        atomic_write_json(path, rec)
        return path

    short_run("sgd", 0.1, 0.4)
    short_run("sgd", 0.01, 0.3)
    results.select_lrs(root)
    short_run("kfac", 1.0, 0.5)  # a later part of the suite adds a method
    results.select_lrs(root)
    sel = read_json(root / "selected.json")["selected"]
    assert sel["cifar10/ill/sgd"]["lr"] == 0.1 and sel["cifar10/ill/kfac"]["lr"] == 1.0
    assert not list(root.glob("selected.json.backup-*"))  # nothing to back up
    short_run("sgd", 0.01, 0.9)  # a changed short run would change a selected step
    with pytest.raises(ConfigMismatchError, match="selected.json"):
        results.select_lrs(root)
    assert read_json(root / "selected.json")["selected"]["cifar10/ill/sgd"]["lr"] == 0.1


def _study6_jobs():
    """The earlier 6-epoch study's runs, from its frozen table."""
    out = []
    for name in study6_records.study6_table()["runs"]:
        c, m, s = name.split("/")
        out.append({"conditioning": c, "method": m, "seed": int(s[4:])})
    return out


def test_frozen_six_epoch_study_covers_its_runs():
    """The frozen run list of the 6-epoch study: three seeds of sgd/adam/kwng in both
    conditionings, one seed of the other methods in both, the ablations ill only; its
    methods have left the live table, and every one has a look for its figures."""
    table = study6_records.study6_table()
    names = {(j["conditioning"], j["method"], j["seed"]) for j in _study6_jobs()}
    for m in ("sgd", "adam", "kwng"):
        for c in ("ill", "well"):
            assert {(c, m, s) for s in (0, 1, 2)} <= names
    assert len(table["runs"]) == len(names) == 18 + 14 + 6
    assert {m for _, m, _ in names} == set(table["looks"])
    assert "kwng_m20" not in methods.METHODS and "study6" not in methods.SCHEDULES
    for plan in ("select", "main"):
        with pytest.raises(ValueError, match="plan must be one of"):
            plans.build_plan(plan)


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_kfac_wrapper_step_keeps_bn_stats(kind):
    pytest.importorskip("nngeometry")
    from studies.cifar.baselines import KFACPreconditioner, bn_state
    from studies.cifar.nets import DiagonalConditioning, tiny_cnn

    torch.manual_seed(0)
    model = tiny_cnn(10)
    U = DiagonalConditioning(10, 1e7)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pc = KFACPreconditioner(model, kind=kind, output_fn=U, update_freq=2)
    z, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    losses = []
    for _ in range(4):
        opt.zero_grad()
        out = model(z)
        loss = torch.nn.functional.cross_entropy(U(out), y)
        # the forward pass of the step has already updated the BN stats
        bn_before = bn_state(model)
        grads_bn = None
        info = pc.step(loss, out, inputs=z)
        for k, v in bn_state(model).items():
            # the extra Fisher passes left no trace
            assert torch.equal(v, bn_before[k]), k
        grads_bn = model[1].weight.grad.clone()
        norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()))
        assert float(norm) <= 1.0 + 1e-5 and info["fallback"] == 0
        opt.step()
        losses.append(float(loss))
    assert grads_bn is not None and losses[-1] < losses[0]
    # the BatchNorm gradient is the plain one: compare with a fresh backward
    with pytest.raises(ValueError, match="inputs"):
        pc.step(loss, out)
    state = pc.state_dict()
    pc2 = KFACPreconditioner(model, kind=kind, output_fn=U, update_freq=2)
    pc2.load_state_dict(state)
    assert pc2.steps == 4


def test_kfac_leaves_batchnorm_gradient_plain():
    pytest.importorskip("nngeometry")
    from studies.cifar.baselines import KFACPreconditioner
    from studies.cifar.nets import tiny_cnn

    torch.manual_seed(1)
    model = tiny_cnn(10)
    z, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    loss = torch.nn.functional.cross_entropy(model(z), y)
    ref = torch.autograd.grad(loss, [model[1].weight, model[-1].weight])
    pc = KFACPreconditioner(model, kind="kfac", clip_norm=None)
    out = model(z)
    pc.step(torch.nn.functional.cross_entropy(out, y), out, inputs=z)
    assert torch.allclose(model[1].weight.grad, ref[0], atol=1e-6)
    assert not torch.allclose(model[-1].weight.grad, ref[1], atol=1e-4)


def test_committed_claim_suite_complete():
    """The committed claim suite: every run of the ``claim`` plan (ablations aside), 30
    epochs, complete, with per-class accuracy every epoch and a provenance record naming
    its commit and device; its step sizes are those of the committed selection."""
    import json
    import re
    from pathlib import Path


    root = Path(__file__).resolve().parent.parent / "results" / "cifar" / "claim"
    status = claim_records.check_claim(root, min_epochs=30)
    assert not status["missing"] and not status["incomplete"] and not status["diverged"]
    plan = plans.build_plan("claim", epochs=30, with_ablations=False)
    assert len(status["ok"]) == len(plan) == 18
    sel = json.loads((root / "selection" / "selected.json").read_text())["selected"]
    for (c, m, s), rec in results.load_results(root, "cifar10").items():
        name = f"{c}/{m}/seed{s}"
        prov = json.loads((root / "cifar10" / c / m / f"seed{s}" / "provenance.json")
                          .read_text())
        assert prov["config"]["method"] == m and prov["device"], name
        # the commit it ran, passed in (KWNG_GIT_COMMIT): a clean hash, never "unknown"
        assert re.fullmatch(r"[0-9a-f]{7,40}", prov["git_commit"]), name
        assert [r["epoch"] for r in rec["epochs"]] == list(range(1, 31)), name
        assert all(len(r["test_acc_per_class"]) == 10 for r in rec["epochs"]), name
        assert rec["lr"] == sel[f"cifar10/{c}/{m}"]["lr"], name
    timing = json.loads((root / "timing" / "timing.json").read_text())["methods"]
    assert set(methods.CLAIM_METHODS) <= set(timing)


def test_committed_results_complete():
    """Every run of the main plan is committed under results/cifar/ with provenance and
    all its epochs, except the runs the GPU budget cut short (``cifar.BUDGET_CUT``),
    which must have exactly the number of epochs documented there."""
    import json
    from pathlib import Path


    root = Path(__file__).resolve().parent.parent / "results" / "cifar"
    assert (root / "cifar10").is_dir() and (
        root / "selection" / "selected.json"
    ).is_file()
    res = study6_records.check_results(root, "cifar10")
    assert not res["missing"] and not res["incomplete"], res
    assert sorted(res["cut"]) == sorted(study6_records.BUDGET_CUT), res["cut"]
    runs = study6_records.study6_table()["runs"]
    assert len(res["ok"]) + len(res["cut"]) == len(runs)
    epochs = json.loads((root / "schedule.json").read_text())["epochs"]
    recs = results.load_results(root, "cifar10")
    for (c, m, s), rec in recs.items():
        name = f"{c}/{m}/seed{s}"
        prov = json.loads(
            (root / "cifar10" / c / m / f"seed{s}" / "provenance.json").read_text()
        )
        assert (
            prov["config"]["method"] == m
            and prov["config"]["seed"] == s
            and prov["device"]
        ), name
        assert rec["config"]["epochs"] == epochs, name
        want = study6_records.BUDGET_CUT.get(name, epochs)
        assert len(rec["epochs"]) == want and rec["complete"] == (
            name not in study6_records.BUDGET_CUT
        ), name
        assert [r["epoch"] for r in rec["epochs"]] == list(range(1, want + 1)), name


def test_check_results_budget_cut(tmp_path):
    """The allow-list accepts a cut run only with its documented epoch count."""
    from studies.kit.provenance import atomic_write_json

    plan = _study6_jobs()
    cut = "ill/kwng_m20/seed0"
    for j in plan:
        name = f"{j['conditioning']}/{j['method']}/seed{j['seed']}"
        n = 3 if name == cut else 6
        d = tmp_path / "cifar10" / j["conditioning"] / j["method"] / f"seed{j['seed']}"
        rows = [{"epoch": k + 1, "test_acc": 0.5, "train_loss": 1.0} for k in range(n)]
        cfg = {"epochs": 6, "method": j["method"], "seed": j["seed"],
               "conditioning": j["conditioning"]}
        atomic_write_json(
            d / "metrics.json", {"config": cfg, "complete": n == 6, "epochs": rows}
        )
        atomic_write_json(d / "provenance.json", {"config": cfg, "git_commit": "abc",
                                                  "date": "2026-01-01T00:00:00+00:00"})
    res = study6_records.check_results(tmp_path, "cifar10", allow_cut={cut: 3})
    assert res["cut"] == [cut] and not res["incomplete"] and not res["missing"]
    assert study6_records.check_results(tmp_path, "cifar10", allow_cut={cut: 4})[
        "incomplete"
    ] == [cut]
    assert study6_records.check_results(
        tmp_path, "cifar10", allow_cut={})["incomplete"] == [
        cut
    ]
    (tmp_path / "cifar10" / "well" / "sgd" / "seed1" / "provenance.json").unlink()
    assert study6_records.check_results(tmp_path, "cifar10", allow_cut={cut: 3})[
        "missing"
    ] == ["well/sgd/seed1"]


# -----------------------------------------------------------------------------------
# the claim suite
def _two_networks(seed: int = 0, d: int = 5, condition: float = 1e4):
    """Network A: ``z ↦ U h(z)`` (U inside). Network B: the same body with the last
    layer's rows multiplied by ``U`` and no U: the same function, reparametrised.
    Float64 for exact comparisons."""
    from studies.cifar.nets import (
        ConditionedNetwork,
        DiagonalConditioning,
        mlp,
    )

    torch.manual_seed(seed)
    body = mlp(6, d, hidden=8, depth=1).double()
    U = DiagonalConditioning(d, condition).double()
    A = ConditionedNetwork(body, U)
    body_b = mlp(6, d, hidden=8, depth=1).double()
    body_b.load_state_dict(body.state_dict())
    with torch.no_grad():
        body_b[-1].weight.mul_(U.diag[:, None])
        body_b[-1].bias.mul_(U.diag)
    B = ConditionedNetwork(body_b, None)
    # a: dθ_B = a · dθ_A (1 on the body, U_k on row k of the last layer)
    a = torch.cat(
        [
            torch.ones(
                sum(p.numel() for p in body[:-1].parameters()), dtype=torch.float64
            ),
            U.diag[:, None].expand(d, 8).reshape(-1),
            U.diag,
        ]
    )
    return A, B, U, a


def _T_and_g(net, z, y, idx, coords, kernel, before_U=False):
    from kwng.estimator import kernel_matrices
    from kwng.jacobians import jacobian_from_outputs

    params = list(net.parameters())
    h, out = net.forward_both(z)
    X = h if before_U else out
    C, K, CCt = kernel_matrices(X, idx, coords, kernel)
    T = jacobian_from_outputs(X, params, C)
    loss = torch.nn.functional.cross_entropy(out, y)
    g = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params)])
    return X.detach(), T, g, CCt, K


def test_samples_after_U_reparametrise_the_last_layer():
    """With the samples U·h, U is a reparametrisation of the last layer: the estimated
    Wasserstein metric is covariant (T_A = T_B diag(a), g_A = a g_B), and a direction
    whose damping transforms like a metric (D_A = a² D_B) is invariant (a ĝ_A = ĝ_B).
    With the samples h (before U) the metric is not covariant. KWNG's damping D =
    ‖T̃_{·,i}‖ scales like a, not a², and breaks the invariance."""
    from kwng.estimator import draw_basis, nystrom_solve
    from kwng.kernels import make_kernel

    A, B, U, a = _two_networks()
    z, y = torch.randn(32, 6, dtype=torch.float64), torch.randint(0, 5, (32,))
    idx, coords = draw_basis(32, 5, 4, torch.Generator().manual_seed(1))
    kern = make_kernel("gaussian", 2.0)
    XA, TA, gA, CCtA, KA = _T_and_g(A, z, y, idx, coords, kern)
    XB, TB, gB, CCtB, KB = _T_and_g(B, z, y, idx, coords, kern)
    assert torch.allclose(XA, XB, atol=1e-12) and torch.allclose(CCtA, CCtB, rtol=1e-10)
    assert torch.allclose(TA, TB * a, rtol=1e-9, atol=1e-14) and torch.allclose(
        gA, gB * a, rtol=1e-9, atol=1e-14
    )
    _, Th, _, CCth, _ = _T_and_g(A, z, y, idx, coords, kern, before_U=True)
    delta_B = torch.randn(a.numel(), dtype=torch.float64)
    # any whitening: the metric is T̃ᵀT̃ = Tᵀ(CCᵀ)⁻¹T
    W = torch.linalg.inv(torch.linalg.cholesky(CCtA))
    Wh = torch.linalg.inv(torch.linalg.cholesky(CCth))
    m_B = (W @ TB @ delta_B).norm()
    # after U: covariant
    assert torch.isclose((W @ TA @ (delta_B / a)).norm(), m_B, rtol=1e-9)
    assert abs(float((Wh @ Th @ (delta_B / a)).norm() / m_B) - 1) > 0.1  # before U: not

    N, eps = 32, 1e-3

    def dense(T, CCt, g, Dvec):  # (N T̃ᵀT̃ + ε diag(D))⁻¹ g, T̃ᵀT̃ = Tᵀ(CCᵀ)⁻¹T
        return torch.linalg.solve(
            N * T.T @ torch.linalg.solve(CCt, T) + eps * torch.diag(Dvec), g
        )

    def col_norms(T, CCt):
        return (T * torch.linalg.solve(CCt, T)).sum(0).sqrt()  # ‖T̃_{·,i}‖

    # the Woodbury form of the package equals the dense form (T_tilde damping)
    ref = nystrom_solve(TA, CCtA, KA, gA, N, eps=eps, damping="T_tilde").direction
    assert torch.allclose(ref, dense(TA, CCtA, gA, col_norms(TA, CCtA)), rtol=1e-6)
    nA, nB = col_norms(TA, CCtA), col_norms(TB, CCtB)
    assert torch.allclose(nA, a * nB, rtol=1e-9)
    inv = a * dense(TA, CCtA, gA, nA ** 2)
    # damping like a metric: invariant
    assert torch.allclose(inv, dense(TB, CCtB, gB, nB ** 2), rtol=1e-6)
    kw = a * dense(TA, CCtA, gA, nA)
    kb = dense(TB, CCtB, gB, nB)
    assert (
        (kw - kb).norm() / kb.norm() > 1e-2
    )  # KWNG's damping: the direction depends on the parametrisation


def test_kwng_direction_on_Uh_batch_both_ways():
    """On the same U·h batch and basis, the directions with the samples after and before
    U are both descent directions and differ; the after-U one puts more of its squared
    norm on the last layer (whose rows U rescales) — the layer where the two metrics
    differ."""
    from kwng.estimator import draw_basis, nystrom_solve
    from kwng.kernels import make_kernel

    A, _, U, a = _two_networks(seed=3, condition=1e6)
    z, y = torch.randn(64, 6, dtype=torch.float64), torch.randint(0, 5, (64,))
    idx, coords = draw_basis(64, 5, 5, torch.Generator().manual_seed(2))
    dirs = {}
    for before in (False, True):
        X, T, g, CCt, K = _T_and_g(
            A, z, y, idx, coords, make_kernel("gaussian", 1.0), before_U=before
        )
        kern = make_kernel(
            "gaussian", float(((X[:, None] - X[idx][None]) ** 2).sum(-1).mean())
        )
        X, T, g, CCt, K = _T_and_g(A, z, y, idx, coords, kern, before_U=before)
        dirs[before] = nystrom_solve(
            T, CCt, K, g, 64, eps=1e-4, damping="T_tilde"
        ).direction
        assert float(g @ dirs[before]) > 0
    after, before = dirs[False], dirs[True]
    cos = float(after @ before / (after.norm() * before.norm()))
    assert cos < 0.99
    last = a != 1
    share = {k: float((v[last] ** 2).sum() / (v ** 2).sum()) for k, v in dirs.items()}
    assert share[False] != pytest.approx(share[True], rel=0.05)


def test_authors_eps_convention():
    from kwng.engine.config import eps_from_authors
    """ε_ours = √N ε_authors: the authors' direction (whitening by (CCᵀ/N)^{-1/2}, D =
    1/(‖T̃‖ + 1e-8), ε I in the M × M system), written out independently here, equals
    ours with the converted ε."""
    from kwng.estimator import draw_basis, nystrom_solve
    from kwng.kernels import make_kernel

    A, _, _, _ = _two_networks(seed=5)
    N = 48
    z, y = torch.randn(N, 6, dtype=torch.float64), torch.randint(0, 5, (N,))
    idx, coords = draw_basis(N, 5, 5, torch.Generator().manual_seed(4))
    X, T, g, CCt, K = _T_and_g(
        A, z, y, idx, coords, make_kernel("gaussian", 3.0), before_U=True
    )
    eps_a = 1e-3
    S, V = torch.linalg.eigh(CCt / N)
    Tt = (V / S.sqrt()).T @ T
    D = 1.0 / (Tt.norm(dim=0) + 1e-8)
    G = (Tt * D) @ Tt.T + eps_a * torch.eye(5, dtype=torch.float64)
    authors = D * (g - Tt.T @ torch.linalg.solve(G, Tt @ (D * g))) / eps_a
    ours = nystrom_solve(
        T, CCt, K, g, N, eps=eps_from_authors(eps_a, N), damping="T_tilde"
    ).direction
    err = float((ours - authors).norm() / authors.norm())
    assert err < 1e-6, err
    same_nominal = nystrom_solve(
        T, CCt, K, g, N, eps=eps_a, damping="T_tilde"
    ).direction
    assert (same_nominal - authors).norm() / authors.norm() > 0.1
    assert eps_from_authors(1e-5, 128) == pytest.approx(1e-5 * 128 ** 0.5)
    for bad in ((0.0, 128), (1e-5, 0), (float("nan"), 4), (1e-5, 2.5)):
        with pytest.raises(ValueError, match="eps|batch_size"):
            eps_from_authors(*bad)


def test_claim_protocol_plans_and_schedule():

    assert methods.milestones_for(30, "claim") == [26] and methods.milestones_for(
        60, "claim"
    ) == [51]
    assert methods.milestones_for(2, "constant") == []
    for E in range(2, 200):
        (m,) = methods.milestones_for(E, "claim")
        assert E - m == max(1, round(0.15 * E))  # the last ~15 % of the epochs at 0.1x
    with pytest.raises(ValueError, match="schedule"):
        methods.milestones_for(10, "cosine")
    claim = plans.build_plan("claim", epochs=30, with_ablations=False)
    names = {(j["conditioning"], j["method"], j["seed"]) for j in claim}
    assert (
        len(claim)
        == len(names)
        == 2 * len(methods.CLAIM_METHODS) + 2 * len(methods.CLAIM_TWO_SEEDS)
        == 18
    )
    assert all(
        j["schedule"] == "claim" and j["epochs"] == 30 and "claim" in j["out"]
        for j in claim
    )
    with_abl = plans.build_plan("claim", epochs=30, with_ablations=True)
    assert {j["method"] for j in with_abl} - {j["method"] for j in claim} == set(
        methods.CLAIM_ABLATIONS
    )
    sel = plans.build_plan("claim_select", select_epochs=2)
    assert len(sel) == len(methods.CLAIM_METHODS) * 2 * len(methods.LR_GRID)
    assert all(
        j["val_size"] > 0 and j["schedule"] == "constant" and j["epochs"] == 2
        for j in sel
    )
    spec = {m: r.spec for m, r in methods.METHODS.items()}
    assert (
        spec["kwng"]["estimator_input"] == "scaled"
        and spec["kwng_samples_before_U"]["estimator_input"] == "logits"
    )
    assert (
        spec["diag_Ttilde"]["estimator_input"] == "scaled"
        and spec["diag_Ttilde"]["diagonal_only"]
    )
    # balanced slots: every GPU gets a similar share of the expensive runs
    slotted = plans.assign_slots(claim, 4, 5)
    load = [0.0] * 4
    for j in slotted:
        load[j["slot"] // 5] += plans.job_cost(j)
    # one KWNG run (cost per epoch x epochs)
    assert (
        len({j["slot"] for j in slotted}) == len(claim)
        and max(load) - min(load) <= 5.4 * 30 + 1e-9
    )


def test_check_claim(tmp_path):
    from studies.kit.provenance import atomic_write_json

    plan = plans.build_plan("claim", epochs=30, with_ablations=False)
    for j in plan:
        d = tmp_path / "cifar10" / j["conditioning"] / j["method"] / f"seed{j['seed']}"
        rows = [
            {
                "epoch": k + 1,
                "test_acc": 0.5,
                "train_loss": 1.0,
                "test_acc_per_class": [0.5] * 10,
            }
            for k in range(30)
        ]
        cfg = {
            "epochs": 30,
            "schedule": "claim",
            "method": j["method"],
            "seed": j["seed"],
        }
        atomic_write_json(d / "metrics.json", {"config": cfg, "complete": True,
                                               "milestones": [26], "epochs": rows})
        atomic_write_json(d / "provenance.json", {"config": cfg, "git_commit": "abc",
                                                  "date": "2026-01-01T00:00:00+00:00"})
    res = claim_records.check_claim(tmp_path)
    assert len(res["ok"]) == 18 and not res["missing"] and not res["incomplete"]
    # shorter than asked
    assert claim_records.check_claim(tmp_path, min_epochs=31)["incomplete"]
    d = tmp_path / "cifar10" / "ill" / "kwng" / "seed1"
    rec = {
        "config": {"epochs": 30, "schedule": "claim", "method": "kwng", "seed": 1},
        "complete": False,
        "milestones": [26],
        "epochs": [
            {
                "epoch": 1,
                "test_acc": 0.5,
                "train_loss": 1.0,
                "test_acc_per_class": [0.5] * 10,
            }
        ],
    }
    atomic_write_json(d / "metrics.json", rec)
    assert claim_records.check_claim(tmp_path)["incomplete"] == ["ill/kwng/seed1"]
    rec.update(
        complete=True,
        epochs=[
            {
                "epoch": k + 1,
                "test_acc": 0.5,
                "train_loss": 1.0,
                "test_acc_per_class": [0.5] * 9,
            }
            for k in range(30)
        ],
    )
    atomic_write_json(d / "metrics.json", rec)
    # per-class accuracy missing
    assert claim_records.check_claim(tmp_path)["incomplete"] == ["ill/kwng/seed1"]
    (tmp_path / "cifar10" / "well" / "adam" / "seed0" / "provenance.json").unlink()
    assert claim_records.check_claim(tmp_path)["missing"] == ["well/adam/seed0"]


def test_runner_resumes_mid_epoch_exactly(tmp_path, monkeypatch):
    """A run stopped by its deadline in the middle of an epoch resumes from there to the
    same record, and the record has the claim suite's per-epoch metrics."""
    import itertools

    from studies.cifar import train as cifar_train

    full = train.run(
        _run_cfg(tmp_path / "a", method="kwng", batch_size=50), progress=False
    )
    calls = itertools.count()
    # the deadline test of the training loop lives in cifar_train (cifar.run is its run)
    monkeypatch.setattr(
        cifar_train, "past", lambda deadline: deadline is not None and next(calls) >= 6
    )
    part = train.run(
        _run_cfg(tmp_path / "b", method="kwng", batch_size=50, deadline=1.0),
        progress=False,
    )
    monkeypatch.undo()
    assert len(part["epochs"]) == 1 and part["stopped"] == "deadline"
    ck = torch.load(
        runtime.checkpoint_path_for(
            _run_cfg(tmp_path / "b", method="kwng", batch_size=50)
        ),
        weights_only=False,
    )
    assert ck["epoch"] == 1 and ck["partial"]["batches"] == 2
    resumed = train.run(
        _run_cfg(tmp_path / "b", method="kwng", batch_size=50), progress=False
    )

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith("time")} for r in rows]

    assert strip(full["epochs"]) == strip(resumed["epochs"]) and resumed["complete"]
    row = resumed["epochs"][-1]
    assert (
        len(row["test_acc_per_class"]) == 10 and len(row["last_layer_row_norms"]) == 10
    )
    assert 0 < row["last_layer_update_share"] < 1 and row["eps_mean"] > 0
    # the committed sample's test split has 20 images per class
    assert sum(a * 20 for a in row["test_acc_per_class"]) == pytest.approx(
        row["test_acc"] * 200
    )
    assert resumed["milestones"] == methods.milestones_for(2, "claim") == [1]


class _SameBatchProbe:
    """A stand-in preconditioner with the same-batch LM hook: records what the trainer
    passes."""

    def __init__(self):
        from kwng.engine.config import KWNGConfig
        from kwng.engine.lm import LMSchedule

        self.config = KWNGConfig(eps_schedule=LMSchedule(rule="same_batch"))
        self.seen = []

    def step(self, loss, outputs):
        loss.backward()
        return {"eps": torch.tensor(1.0), "reduction_ratio": torch.tensor(float("nan"))}

    def observe_loss_after_step(self, loss_after):
        self.seen.append(loss_after)


def test_same_batch_loss_after_step_keeps_batchnorm_stats():
    from studies.cifar.baselines import bn_state
    from studies.cifar.metrics import EpochStats
    from studies.cifar.steps import KWNGStep

    cfg = RunConfig(method="kwng", model="tiny", lr=0.1, device="cpu")
    torch.manual_seed(0)
    model = steps.build_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    probe = _SameBatchProbe()
    z, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    loss, out, info, _ = steps.train_step(KWNGStep(model, opt, probe), model, z, y)
    stats_after_step = bn_state(model)
    assert len(probe.seen) == 1
    for k, v in bn_state(model).items():
        assert torch.equal(v, stats_after_step[k])
    with torch.no_grad():
        # train mode: batch statistics, as the step
        ref = torch.nn.functional.cross_entropy(model(z), y)
    assert torch.allclose(probe.seen[0], ref)
    s = EpochStats(torch.device("cpu"))
    s.add_info(info)
    s.add_info({"eps": torch.tensor(3.0), "reduction_ratio": torch.tensor(0.5)})
    r = s.row()
    assert (
        r["eps_mean"] == 2.0
        and r["eps_last"] == 3.0
        and r["reduction_ratio_mean"] == 0.5
    )


def _fake_claim_results(kwng_ill: float, small_ill: float):
    """Records of the claim suite: 10 classes, per-class accuracy; KWNG IC has
    ``kwng_ill`` overall and ``small_ill`` on the four classes with the smallest U_k."""
    from studies.cifar.nets import DiagonalConditioning

    U = DiagonalConditioning(10, 1e7).diag.double().numpy()
    small = np.argsort(U)[:4]
    out = {}
    for cond in ("ill", "well"):
        for m, seeds in (("sgd", 2), ("kwng", 2), ("adam", 1)):
            for s in range(seeds):
                acc = {
                    "sgd": 0.3 if cond == "ill" else 0.8,
                    "kwng": kwng_ill if cond == "ill" else 0.8,
                    "adam": 0.7,
                }[m]
                pc = np.full(10, acc)
                if m == "kwng" and cond == "ill":
                    pc[small] = small_ill
                rows = [
                    {
                        "epoch": 1,
                        "test_acc": acc,
                        "train_acc": acc,
                        "test_acc_per_class": pc.tolist(),
                        "steps": 10,
                        "eps_mean": 1e-4,
                        "clipped": 10,
                        "time_train": 1.0,
                    }
                ]
                out[(cond, m, s)] = {
                    "epochs": rows,
                    "config": {"epochs": 1},
                    "complete": True,
                    "U": U.tolist(),
                    "batch_size": 128,
                    "method_spec": {"eps_convention": "authors"},
                }
    return out


def test_claim_verdict_rule():
    from studies.cifar import figures as pcf
    from studies.cifar.methods import CLAIM_METHODS
    from studies.claim_suite import verdict as verdicts

    holds = verdicts.claim_verdict(_fake_claim_results(0.78, 0.7))
    assert (
        holds["holds"]
        and holds["a_within"]
        and holds["b_above_sgd"]
        and holds["c_small_classes"]
    )
    assert (
        len(holds["small_classes"]) == 4 and max(holds["U_small"]) <= verdicts.SMALL_U
    )
    assert (
        holds["drops"]["sgd"] == pytest.approx(0.5) and holds["drops"]["kfac"] is None
    )
    far = verdicts.claim_verdict(_fake_claim_results(0.6, 0.7))
    assert (
        far["a_within"] is False
        and far["b_above_sgd"] is True
        and far["holds"] is False
    )
    # small-U classes at 0.3 < 0.5 * 0.8
    small = verdicts.claim_verdict(_fake_claim_results(0.78, 0.3))
    assert small["c_small_classes"] is False and small["holds"] is False
    assert verdicts.claim_verdict({})["holds"] is None
    fig = pcf.fig_per_class_vs_U(_fake_claim_results(0.78, 0.7), CLAIM_METHODS)
    fig2 = pcf.fig_kwng_diagnostics(_fake_claim_results(0.78, 0.7))
    assert fig.axes[0].get_xscale() == "log" and len(fig2.axes) == 6
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.mark.parametrize(
    "method,family",
    [
        ("sgd", "MethodStep"),
        ("adam", "MethodStep"),
        ("kfac", "KFACStep"),
        ("ekfac", "KFACStep"),
        ("kwng", "KWNGStep"),
        ("kwng_samples_before_U", "KWNGStep"),
    ],
)
def test_every_method_behind_one_step(method, family):
    """``make_step`` picks the family's adapter; its direction leaves the parameters
    alone (so the last-layer share may be measured around the whole step); a few steps
    on one batch lower that batch's loss."""
    from studies.cifar.metrics import UpdateShare

    if family == "KFACStep":
        pytest.importorskip("nngeometry")
    lr = 0.01 if method == "adam" else 0.05
    cfg = RunConfig(method=method, model="tiny", lr=lr, device="cpu")
    torch.manual_seed(0)
    model = steps.build_model(cfg)
    step = steps.make_step(
        cfg, model, steps.build_optimizer(cfg, model, lr), torch.device("cpu")
    )
    assert type(step).__name__ == family
    z, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    before = [p.detach().clone() for p in model.parameters()]
    h, out = model.forward_both(z)
    step.direction(torch.nn.functional.cross_entropy(out, y), out, h, (z, y))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    share = UpdateShare(model)
    losses = [
        float(steps.train_step(step, model, z, y, share)[0].detach()) for _ in range(8)
    ]
    assert losses[-1] < losses[0]


def test_scale_selects_the_small_run_settings(monkeypatch):
    """``KWNG_SCALE=small`` fills the single run's unset settings with ``SMALL_RUN``;
    ``full`` keeps the study's; explicit values always win."""
    from studies.cifar import cli as cifar

    def cfg(*argv):
        return cifar.run_config_from_args(cifar._run_parser().parse_args(list(argv)))

    monkeypatch.setenv("KWNG_SCALE", "small")
    small = cfg()
    assert {k: getattr(small, k) for k in SMALL_RUN} == SMALL_RUN
    assert small == RunConfig.small()
    assert cfg("--data-root", "/x").source == "auto"
    assert cfg("--model", "resnet18", "--epochs", "5").model == "resnet18"
    monkeypatch.setenv("KWNG_SCALE", "full")
    full = cfg()
    assert (full.model, full.source, full.epochs, full.out) == (
        "resnet18", "auto", 30, str(methods.RESULTS))


def test_a_new_optimizer_is_one_optimizers_entry_and_one_methods_entry(
    tmp_path, monkeypatch
):
    """Adding an optimizer touches two tables: OPTIMIZERS (how to build it) and METHODS
    (its record). The new method then trains (2 steps of the tiny model), is priced by
    the plans, timed at its own step and drawn in its own colour; a method without a
    record is refused by every table."""
    import dataclasses

    import matplotlib

    matplotlib.use("Agg")
    from studies.cifar import figures as pcf
    from studies.cifar.methods import Method

    def rmsprop(model, lr, spec):
        return torch.optim.RMSprop(model.parameters(), lr=lr, alpha=spec["alpha"])

    monkeypatch.setitem(methods.OPTIMIZERS, "rmsprop", rmsprop)
    record = Method("rmsprop", {"alpha": 0.9}, "#010203", "-", "RMSprop", 99, 1.2,
                    1e-3, None)
    monkeypatch.setitem(methods.METHODS, "rmsprop", record)
    assert record.spec == {"optimizer": "rmsprop", "alpha": 0.9}
    rec = train.run(_run_cfg(tmp_path, method="rmsprop", epochs=1, max_steps=2),
                    progress=False)
    assert rec["method_spec"] == record.spec and rec["epochs"][-1]["steps"] == 2
    assert math.isfinite(rec["epochs"][-1]["train_loss"])
    assert plans.job_cost({"method": "rmsprop", "epochs": 3}) == pytest.approx(3.6)
    assert pcf._look("rmsprop") == {"color": "#010203", "ls": "-"}
    with pytest.raises(TypeError):  # a record lacking a fact does not build
        Method("rmsprop", {}, "#010203", "-", "RMSprop", 99, 1.2, 1e-3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.color = "#000000"
    with pytest.raises(KeyError):
        plans.job_cost({"method": "nope"})
    with pytest.raises(ValueError, match="no method 'nope'"):
        pcf._look("nope")


def test_a_step_that_cannot_invert_its_factor_ends_the_run_as_diverged(tmp_path,
                                                                         monkeypatch):
    # KFAC at step 100 (the Fig. 3 audit's grid edge) raised LinAlgError from its
    # factor inverse in epoch 4, and the trainer of that commit left no finished
    # record; now the run ends as diverged, the failing step named
    real, calls = train.Run._step, {"n": 0}

    def step(self, z, yb):
        calls["n"] += 1
        if calls["n"] == 3:  # the first step of the second epoch
            raise torch.linalg.LinAlgError("linalg.inv: The diagonal element 1 is zero")
        return real(self, z, yb)

    monkeypatch.setattr(train.Run, "_step", step)
    rec = train.run(_run_cfg(tmp_path, method="sgd", epochs=3), progress=False)
    assert rec["complete"] and rec["diverged"] and len(rec["epochs"]) == 2
    fail = rec["failure"]
    assert (fail["epoch"], fail["step"]) == (2, 3)
    assert fail["error"].endswith("LinAlgError: linalg.inv: The diagonal element 1 is "
                                  "zero")
    assert rec["epochs"][1]["steps"] == 2  # the failed step is not counted
    cfg = _run_cfg(tmp_path, method="sgd", epochs=3)
    assert not runtime.checkpoint_path_for(cfg).is_file()


def test_a_run_killed_between_checkpoints_resumes_from_the_last_to_the_same_record(
        tmp_path, monkeypatch):
    """End-of-epoch checkpoints follow ``CheckpointClock``: the first epoch of a process
    checkpoints, later ones only after ``CHECKPOINT_EVERY_S`` (here never). A run killed
    after its third epoch's record was written holds a record of 3 epochs and the
    checkpoint of epoch 1; run again, it resumes from epoch 1 and ends with the
    uninterrupted run's record."""
    from studies.cifar import train as cifar_train

    cfg = dict(method="kwng", epochs=4, batch_size=50)
    full = train.run(_run_cfg(tmp_path / "a", **cfg), progress=False)
    monkeypatch.setattr(runtime, "CHECKPOINT_EVERY_S", 1e9)
    end_epoch = cifar_train.Run.end_epoch

    def end_then_die(self, epoch, total_steps):
        finished = end_epoch(self, epoch, total_steps)
        if epoch == 2:
            raise KeyboardInterrupt  # killed after the record of epoch 3
        return finished
    monkeypatch.setattr(cifar_train.Run, "end_epoch", end_then_die)
    with pytest.raises(KeyboardInterrupt):
        train.run(_run_cfg(tmp_path / "b", **cfg), progress=False)
    monkeypatch.setattr(cifar_train.Run, "end_epoch", end_epoch)
    b = _run_cfg(tmp_path / "b", **cfg)
    on_disk = json.loads((runtime.run_dir_for(b) / "metrics.json").read_text())
    ck = torch.load(runtime.checkpoint_path_for(b), weights_only=False)
    assert len(on_disk["epochs"]) == 3 and ck["epoch"] == 1
    resumed = train.run(b, progress=False)

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith("time")} for r in rows]

    assert resumed["complete"] and strip(resumed["epochs"]) == strip(full["epochs"])
    assert not runtime.checkpoint_path_for(b).is_file()
