"""CIFAR study: loaders, augmentation, runner (exact resume), KFAC/EKFAC wrapper, result completeness."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kwng import data as kdata


def _fake(n: int, classes: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, classes, n)


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
    # the sample has the layout of the offline npz: the JPEG loader reads it and caches the decode
    gx, gy = kdata.load_jpeg_npz(kdata.SAMPLE_PATH, "test", cache_dir=tmp_path)
    np.testing.assert_array_equal(gx, xt)
    assert (tmp_path / "cifar10_sample_test_x.npy").is_file()
    gx2, _ = kdata.load_jpeg_npz(kdata.SAMPLE_PATH, "test", cache_dir=tmp_path)
    np.testing.assert_array_equal(gx2, xt)
    # JPEG quality 75 of natural images: channel means near the CIFAR-10 ones
    assert np.allclose(x.mean((0, 1, 2)) / 255, kdata.CIFAR_MEAN["cifar10"], atol=0.03)


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
    out = kdata.augment_batch(x, g)
    assert out.shape == x.shape
    # every output is a crop of the padded image, possibly flipped: check against a direct computation
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
    d = kdata.GPUAugmentedData(x, y)
    a = [z for z, _ in d.batches(64, torch.Generator().manual_seed(3))]
    b = [z for z, _ in d.batches(64, torch.Generator().manual_seed(3))]
    c = [z for z, _ in d.batches(64, torch.Generator().manual_seed(4))]
    assert len(a) == 4 and a[0].shape == (64, 3, 32, 32) and a[-1].shape == (8, 3, 32, 32)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not torch.equal(a[0], c[0])
    z = torch.cat([z for z, _ in d.eval_batches(100)])
    assert abs(float(z.mean())) < 0.15 and abs(float(z.std()) - 1) < 0.15
    with pytest.raises(ValueError, match="x must be uint8"):
        kdata.GPUAugmentedData(x.astype(np.float32), y)


def _run_cfg(tmp_path, **kw):
    base = {"source": "sample", "model": "tiny", "batch_size": 100, "epochs": 2, "lr": 0.1, "device": "cpu",
            "out": str(tmp_path / "res"), "checkpoint_dir": str(tmp_path / "ck"), "train_subset": 200}
    base.update(kw)
    return base


@pytest.mark.parametrize("method", ["sgd_momentum", "kwng"])
def test_runner_exact_resume(tmp_path, method):
    pytest.importorskip("kwng.precond")
    from kwng.experiments import cifar

    full = cifar.run(_run_cfg(tmp_path / "a", method=method), progress=False)
    part = cifar.run(_run_cfg(tmp_path / "b", method=method, stop_after_epoch=1), progress=False)
    assert len(part["epochs"]) == 1 and not part["complete"]
    cfg_b = _run_cfg(tmp_path / "b", method=method)
    assert cifar.checkpoint_path_for(cfg_b).is_file()
    resumed = cifar.run(cfg_b, progress=False)
    assert resumed["complete"] and len(resumed["epochs"]) == 2
    assert not cifar.checkpoint_path_for(cfg_b).is_file()  # removed once complete
    keys = ["steps", "lr", "train_loss", "train_acc", "test_loss", "test_acc"]
    if method == "kwng":
        keys += ["eps", "fallbacks"]
    for ra, rb in zip(full["epochs"], resumed["epochs"]):
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}
    rdir = cifar.run_dir_for(cfg_b)
    assert (rdir / "metrics.json").is_file() and (rdir / "provenance.json").is_file()
    again = cifar.run(cfg_b, progress=False)  # finished runs are skipped
    assert again["epochs"] == resumed["epochs"]


def test_selection_rule(tmp_path):
    from kwng.experiments import cifar
    from kwng.provenance import atomic_write_json

    root = tmp_path / "sel"
    for lr, acc, loss in ((1.0, 0.3, 1.5), (0.1, 0.4, 1.2), (0.01, 0.4, 1.1), (10.0, 0.1, float("nan"))):
        rec = {"config": {"dataset": "cifar10", "conditioning": "ill", "method": "sgd"}, "lr": lr, "complete": True,
               "diverged": loss != loss, "epochs": [{"test_acc": acc, "train_loss": loss, "steps": 5}]}
        atomic_write_json(root / f"lr{lr:g}" / "cifar10" / "ill" / "sgd" / "seed0" / "metrics.json", rec)
    out = cifar.select_lrs(root)
    assert out["selected"]["cifar10/ill/sgd"]["lr"] == 0.01  # tie on accuracy -> lower training loss
    assert (root / "selected.json").is_file()


def test_plans_cover_the_study():
    from kwng.experiments import cifar

    main = cifar.build_plan("main", epochs=5)
    names = {(j["conditioning"], j["method"], j["seed"]) for j in main}
    for m in ("sgd", "adam", "kwng"):
        for c in ("ill", "well"):
            assert {(c, m, s) for s in (0, 1, 2)} <= names
    assert len(main) == len(names) == 18 + 14 + 6
    sel = cifar.build_plan("select")
    assert len(sel) == len(cifar.SELECT_METHODS) * 2 * len(cifar.LR_GRID)


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_kfac_wrapper_step_keeps_bn_stats(kind):
    pytest.importorskip("nngeometry")
    from kwng.baselines import KFACPreconditioner, bn_state
    from kwng.nets import DiagonalConditioning, tiny_cnn

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
        bn_before = bn_state(model)  # the forward pass of the step has already updated the BN stats
        grads_bn = None
        info = pc.step(loss, out, inputs=z)
        for k, v in bn_state(model).items():
            assert torch.equal(v, bn_before[k]), k  # the extra Fisher passes left no trace
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
    from kwng.baselines import KFACPreconditioner
    from kwng.nets import tiny_cnn

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


def test_committed_results_complete():
    """Every run of the main plan is committed under results/cifar/ with provenance and all its epochs,
    except the runs the GPU budget cut short (``cifar.BUDGET_CUT``), which must have exactly the number
    of epochs documented there."""
    import json
    from pathlib import Path

    from kwng.experiments import cifar

    root = Path(__file__).resolve().parent.parent / "results" / "cifar"
    assert (root / "cifar10").is_dir() and (root / "selection" / "selected.json").is_file()
    res = cifar.check_results(root, "cifar10")
    assert not res["missing"] and not res["incomplete"], res
    assert sorted(res["cut"]) == sorted(cifar.BUDGET_CUT), res["cut"]
    assert len(res["ok"]) + len(res["cut"]) == len(cifar.build_plan("main"))
    epochs = json.loads((root / "schedule.json").read_text())["epochs"]
    recs = cifar.load_results(root, "cifar10")
    for (c, m, s), rec in recs.items():
        name = f"{c}/{m}/seed{s}"
        prov = json.loads((root / "cifar10" / c / m / f"seed{s}" / "provenance.json").read_text())
        assert prov["config"]["method"] == m and prov["config"]["seed"] == s and prov["device"], name
        assert rec["config"]["epochs"] == epochs, name
        want = cifar.BUDGET_CUT.get(name, epochs)
        assert len(rec["epochs"]) == want and rec["complete"] == (name not in cifar.BUDGET_CUT), name
        assert [r["epoch"] for r in rec["epochs"]] == list(range(1, want + 1)), name


def test_check_results_budget_cut(tmp_path):
    """The allow-list accepts a cut run only with its documented epoch count."""
    from kwng.experiments import cifar
    from kwng.provenance import atomic_write_json

    plan = cifar.build_plan("main", epochs=6)
    cut = "ill/kwng_m20/seed0"
    for j in plan:
        name = f"{j['conditioning']}/{j['method']}/seed{j['seed']}"
        n = 3 if name == cut else 6
        d = tmp_path / "cifar10" / j["conditioning"] / j["method"] / f"seed{j['seed']}"
        rows = [{"epoch": k + 1, "test_acc": 0.5} for k in range(n)]
        atomic_write_json(d / "metrics.json", {"config": {"epochs": 6}, "complete": n == 6, "epochs": rows})
        atomic_write_json(d / "provenance.json", {})
    res = cifar.check_results(tmp_path, "cifar10", allow_cut={cut: 3})
    assert res["cut"] == [cut] and not res["incomplete"] and not res["missing"]
    assert cifar.check_results(tmp_path, "cifar10", allow_cut={cut: 4})["incomplete"] == [cut]
    assert cifar.check_results(tmp_path, "cifar10", allow_cut={})["incomplete"] == [cut]
    (tmp_path / "cifar10" / "well" / "sgd" / "seed1" / "provenance.json").unlink()
    assert cifar.check_results(tmp_path, "cifar10", allow_cut={cut: 3})["missing"] == ["well/sgd/seed1"]
