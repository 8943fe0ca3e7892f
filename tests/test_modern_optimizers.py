"""Muon, SOAP and Shampoo in the CIFAR kit (studies.cifar.modern): the Muon wrapper
against ``torch.optim.Muon`` on the flattened kernel, the libraries against the
algorithms' definitions, training the tiny model, exact resume."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from studies.bench import modern_optimizers as check
from studies.cifar import runtime, steps, train
from studies.cifar.config import RunConfig
from studies.cifar.methods import METHODS
from studies.cifar.modern import MuonAdamW, as_matrix, muon_groups
from studies.cifar.nets import tiny_cnn

NEW = ("muon", "soap", "shampoo")
pytest.importorskip("pytorch_optimizer")


def test_muon_takes_the_hidden_kernels_and_adamw_the_rest():
    model = tiny_cnn()
    matrices, rest = muon_groups(model)
    assert [tuple(p.shape) for p in matrices] == [(8, 3, 3, 3), (16, 8, 3, 3)]
    assert any(p is model[-1].weight for p in rest)  # the output layer
    assert len(matrices) + len(rest) == len(list(model.parameters()))


@pytest.mark.parametrize("channels_last", [False, True])
def test_muon_updates_a_kernel_as_torch_muon_updates_its_matrix(channels_last):
    torch.manual_seed(0)
    model = tiny_cnn().double()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    kernel = model[4].weight
    w0 = kernel.detach().reshape(16, -1).clone()
    ref = nn.Parameter(w0.clone())
    opt = MuonAdamW(model, lr=0.01)
    ref_opt = torch.optim.Muon([ref], lr=0.01, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(4, 3, 8, 8, dtype=torch.float64)).square().sum().backward()
        ref.grad = kernel.grad.reshape(16, -1).clone()
        opt.step()
        ref_opt.step()
    got, ref = kernel.detach().reshape(16, -1), ref.detach()
    # channels last: the matrix's columns in another order, which changes the bf16
    # Newton-Schulz products' summation order only
    tol = 2e-2 if channels_last else 0.0
    assert (got - ref).abs().max() <= tol * (ref - w0).abs().max()
    assert as_matrix(kernel.detach()).data_ptr() == kernel.data_ptr()  # a view


def test_libraries_match_the_algorithms_definitions():
    rows = check.check(steps=3)
    ours = [r for r in rows if r["library"] == "pytorch-optimizer"]
    assert {r["algorithm"] for r in ours} == {"SOAP", "Shampoo"}
    assert all(r["relative_error"] < 1e-10 for r in ours), ours


def test_the_references_follow_the_update_rules():
    """For a rank-one gradient ``s u vᵀ`` (unit ``u``, ``v``), one Shampoo step from
    ``ε I`` (ε → 0) is ``L^{-1/4} G R^{-1/4} = u vᵀ``, whatever ``s``; SOAP's second
    step on the first gradient is the sign-like Adam step in the eigenbasis, of unit
    size along the rank-one direction."""
    u, v = torch.tensor([0.6, 0.8, 0.0], dtype=torch.float64), torch.tensor(
        [1.0, 0.0], dtype=torch.float64)
    g = 5.0 * torch.outer(u, v)
    w = check.shampoo_reference(torch.zeros(3, 2, dtype=torch.float64), [g], 1.0,
                                1e-8)[0]
    assert torch.allclose(-w, torch.outer(u, v), atol=1e-6)
    w = check.soap_reference(torch.zeros(3, 2, dtype=torch.float64), [g, g], 1.0,
                             (0.9, 0.9), 0.9, 1e-8)[1]
    assert torch.allclose(-w, torch.outer(u, v), atol=1e-6)


@pytest.mark.parametrize("method", NEW)
@pytest.mark.parametrize("conditioning", ["well", "ill"])
def test_each_method_trains_the_tiny_model(method, conditioning):
    torch.manual_seed(0)
    cfg = RunConfig(method=method, model="tiny", conditioning=conditioning,
                    device="cpu")
    model = steps.build_model(cfg)
    opt = steps.build_optimizer(cfg, model, 0.01)
    step = steps.make_step(cfg, model, opt, torch.device("cpu"))
    assert step.capturable == (METHODS[method].not_capturable is None)
    z, y = torch.randn(64, 3, 16, 16), torch.randint(0, 10, (64,))
    losses = [float(steps.train_step(step, model, z, y)[0].detach())
              for _ in range(20)]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.02, losses


@pytest.mark.parametrize("method", NEW)
def test_a_run_resumes_exactly(tmp_path, method):
    def cfg(d, **kw):
        return {"source": "sample", "model": "tiny", "batch_size": 100, "epochs": 2,
                "lr": 0.01, "device": "cpu", "method": method,
                "out": str(tmp_path / d / "res"), "train_subset": 200,
                "checkpoint_dir": str(tmp_path / d / "ck"), **kw}

    full = train.run(cfg("a"), progress=False)
    part = train.run(cfg("b", stop_after_epoch=1), progress=False)
    assert len(part["epochs"]) == 1 and not part["complete"]
    assert runtime.checkpoint_path_for(cfg("b")).is_file()
    resumed = train.run(cfg("b"), progress=False)
    keys = ["steps", "lr", "train_loss", "train_acc", "test_loss", "test_acc"]
    assert resumed["complete"] and len(resumed["epochs"]) == 2
    for ra, rb in zip(full["epochs"], resumed["epochs"]):
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}
    assert all(math.isfinite(r["train_loss"]) for r in full["epochs"])


def test_the_muon_state_round_trips_and_rejects_another_optimizers():
    model = tiny_cnn()
    opt = MuonAdamW(model, lr=0.01)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    opt.step()
    state = opt.state_dict()
    other = MuonAdamW(tiny_cnn(), lr=0.5)
    other.load_state_dict(state)
    assert other.param_groups[0]["lr"] == 0.01 and other.param_groups[1]["lr"] == 0.01
    with pytest.raises(ValueError, match="MuonAdamW state_dict"):
        other.load_state_dict(torch.optim.SGD(model.parameters(), lr=1).state_dict())
