"""The graph-capture-ready trainer (state updated in place, epoch draws, mechanism
records) and the committed authors'-horizon records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
A100 = ROOT / "results" / "cifar" / "authors100"


def test_lm_state_is_updated_in_place():
    from kwng.engine.lm import LevenbergMarquardt, LMSchedule

    lm = LevenbergMarquardt(1.0, LMSchedule(interval=1, omega=0.5))
    ids = {k: id(getattr(lm, k)) for k in ("eps", "ratio", "_r_max", "_loss", "_pred")}
    for loss in (3.0, 2.9, 2.95, 2.0):
        eps = lm.update(torch.tensor(loss))
        lm.record(0.1, torch.tensor(1.0))
        assert eps.data_ptr() != lm.eps.data_ptr()  # the step's value is a copy
    assert {k: id(getattr(lm, k)) for k in ids} == ids
    assert lm.steps == 4 and lm.state_dict()["steps"] == 4
    assert float(lm.eps) != 1.0  # the rule did adapt


def test_epoch_draws_equal_the_per_batch_draws():
    from studies.cifar.images import GPUAugmentedData, augment_batch, normalize

    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, (300, 32, 32, 3), dtype=np.uint8)
    d = GPUAugmentedData(x, rng.integers(0, 10, 300))
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    new = list(d.batches(128, g1))
    perm = torch.randperm(300, generator=g2)
    for k, (z, y) in enumerate(new):
        idx = perm[k * 128:(k + 1) * 128]
        assert torch.equal(z, normalize(augment_batch(d.x[idx], g2), d.mean, d.std))
        assert torch.equal(y, d.y[idx])
    assert len(new) == 3 and torch.equal(g1.get_state(), g2.get_state())


def test_epoch_stats_accumulate_in_place_and_reset():
    from studies.cifar.metrics import EpochStats

    s = EpochStats(torch.device("cpu"), num_classes=3)
    ptr = s.loss_sum.data_ptr()
    out = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    y = torch.tensor([0, 1])
    s.add_step(torch.tensor(1.5), out, y, torch.tensor(0.25), torch.tensor([1.0, 2, 3]))
    s.add_info({"eps": torch.tensor(2.0), "clipped": torch.tensor(float("nan"))})
    s.count(2)
    row = s.row()
    assert row["train_loss"] == 1.5 and row["train_acc"] == 0.5
    assert row["eps_mean"] == 2.0 and math.isnan(row["clipped_mean"])
    assert s.row_move.tolist() == [1.0, 2.0, 3.0]
    state = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
             for k, v in s.state_dict().items()}
    s.reset()
    assert s.loss_sum.data_ptr() == ptr and float(s.loss_sum) == 0 and s.seen == 0
    s.load_state_dict(state)
    assert s.loss_sum.data_ptr() == ptr and s.row()["train_loss"] == 1.5


def test_evaluate_full_confusion_recall_precision_and_feature_norm():
    from studies.cifar.images import GPUAugmentedData
    from studies.cifar.metrics import evaluate, evaluate_full
    from studies.cifar.nets import ConditionedNetwork, tiny_cnn

    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    data = GPUAugmentedData(rng.integers(0, 255, (60, 32, 32, 3), dtype=np.uint8),
                            rng.integers(0, 10, 60))
    model = ConditionedNetwork(tiny_cnn(10), None)
    ev = evaluate_full(model, data, 25, 10)
    cm = np.array(ev["confusion"])
    assert cm.sum() == 60 and np.trace(cm) / 60 == pytest.approx(ev["acc"])
    truth = np.bincount(data.y.numpy(), minlength=10)
    assert (cm.sum(1) == truth).all()
    for k in range(10):
        col = cm[:, k].sum()
        assert (ev["precision"][k] is None) == (col == 0)
        if col:
            assert ev["precision"][k] == pytest.approx(cm[k, k] / col)
    assert ev["feature_norm"] > 0
    loss, acc, per = evaluate(model, data, 25, 10)
    assert (loss, acc) == (ev["loss"], ev["acc"]) and per == ev["recall"]


def test_step_runner_is_eager_without_cuda():
    from studies.cifar.steps import StepRunner

    calls = []
    r = StepRunner(lambda z, y: calls.append(z.shape), torch.device("cpu"), True,
                   lambda: 0.1)
    r(torch.zeros(2, 3), torch.zeros(2))
    assert not r.capture and r.eager == 1 and calls == [(2, 3)]
    with pytest.raises(ValueError, match="warmup"):
        StepRunner(lambda z, y: None, torch.device("cpu"), True, lambda: 0.1, warmup=0)


def test_authors_schedule_milestones():
    from studies.cifar.methods import milestones_for

    assert milestones_for(100, "authors") == [50]
    assert milestones_for(350, "authors") == [50, 100, 200, 300]
    assert milestones_for(30, "authors") == []


def test_numeric_settings_enter_the_identity_only_when_not_default():
    from studies.kit import guard

    base = {"dataset": "cifar10", "method": "sgd"}
    a = guard.run_identity(base, 0.1, 128, {}, None)
    b = guard.run_identity({**base, "precision": "fp32", "channels_last": False},
                           0.1, 128, {}, None)
    c = guard.run_identity({**base, "precision": "bf16"}, 0.1, 128, {}, None)
    assert a == b and c != a and c["precision"] == "bf16"


# ------------------------------------------------------------- the committed records
def test_committed_authors100_records_are_complete():
    from studies.authors100.records import check_authors100

    res = check_authors100(A100, tiers=(1, 2, 3))
    assert res["missing"] == [] and res["incomplete"] == [] and len(res["ok"]) == 13
    for p in A100.glob("**/seed*/provenance.json"):
        prov = json.loads(p.read_text())
        assert len(prov["git_commit"]) >= 7
        assert "H100" in prov["device"] or "H200" in prov["device"]
        assert prov["seeds"]["seed"] in (0, 1)


def test_committed_authors100_records_carry_the_protocol():
    from studies.authors100.records import load_authors100

    recs = load_authors100(A100)
    for (tag, _cond, method, _seed), r in recs.items():
        assert r["milestones"] == ([50] if r["config"]["epochs"] == 100 else [])
        assert r["clip_norm"] == 1.0 and r["batch_size"] == 128
        assert r["lr"] == float(tag.split("lr")[-1])
        assert r["precision"] == ("fp32" if tag.startswith("fp32") else "bf16")
        assert r["capture"] == (method != "kfac")
        lrs = [e["lr"] for e in r["epochs"]]  # the step of the epoch itself
        assert lrs[0] == r["lr"] and all(x == pytest.approx(r["lr"] * 0.1)
                                         for x in lrs[50:])
        cum = np.array([e["cumulative_row_movement"] for e in r["epochs"]])
        assert (np.diff(cum, axis=0) >= 0).all()
        if method.startswith("kwng") or method == "diag_Ttilde":
            # every step clipped to norm <= 1: total movement <= lr x steps
            budget = sum(e["lr"] * 391 for e in r["epochs"])
            assert cum[-1].sum() <= budget * (1 + 1e-9)


def test_committed_trainer_timing():
    d = json.loads((A100 / "timing" / "trainer_timing.json").read_text())
    rows = {(r["method"], r["precision"], r["asked_capture"]): r for r in d["rows"]}
    for m in ("sgd", "adam", "kwng", "diag_Ttilde"):
        for p in ("bf16", "fp32"):
            assert rows[(m, p, True)]["mode"] == "captured"
            assert rows[(m, p, True)]["captures"] >= 1
            assert rows[(m, p, False)]["mode"] == "eager"
    assert rows[("kfac", "bf16", True)]["mode"] == "eager" and \
        "why_eager" in rows[("kfac", "bf16", True)]
    for t in d["loss_match"]:
        assert t["steps"] >= 200 and len(t["loss_captured"]) == t["steps"]
        assert all(math.isfinite(v) for v in t["loss_captured"])
    assert d["provenance"]["git_commit"] and d["device"]
