"""Checks of the Triton kernels (:mod:`kwng.engine.triton_support`,
:mod:`kwng.engine.triton_bn`, :mod:`kwng.engine.triton_solve`) under Triton's
interpreter, run by ``tests/test_triton_ops.py`` in a subprocess with
``TRITON_INTERPRET=1`` (the variable must be set before Triton is imported, so these
cannot run in the main test process).

Every kernel is compared with the PyTorch function that defines it, and the fast KWNG
path, which then goes through the kernels on CPU tensors, with serial autograd passes.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from torch import nn

import kwng.engine.triton_solve
import studies.cifar.nets
from kwng import solve
from kwng.engine import replicate_layers, triton_bn, triton_support
from kwng.engine.precond import KWNGPreconditioner, direction_into
from kwng.engine.replicate_bn import bn_backward_torch
from kwng.jacobians import jacobian_from_outputs

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or triton_support.triton is None,
    reason="needs Triton and TRITON_INTERPRET=1 (run through tests/test_triton_ops.py)",
)
CL = torch.channels_last


def _bn_reference(d, x, mean, invstd, scale, use_batch):
    """The one definition (:func:`kwng.engine.replicate_bn.bn_backward_torch`) in
    float64."""
    dx, dg, db, _ = bn_backward_torch(d.double(), x.double()[None], mean.double(),
                                      invstd.double(), scale.double(), use_batch)
    return dx, dg, db


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_batch", [True, False])
@pytest.mark.parametrize("shape", [(3, 50, 7), (2, 300, 130)])
def test_bn_backward_equals_the_formulas(dtype, use_batch, shape):
    R, S, C = shape
    g = torch.Generator().manual_seed(0)
    d = torch.randn(R, S, C, generator=g).to(dtype)
    x = torch.randn(S, C, generator=g).to(dtype)
    mean = x.float().mean(0)
    invstd = torch.rsqrt(x.float().var(0, unbiased=False) + 1e-5)
    scale = invstd * torch.randn(C, generator=g)
    dx, dg, db, dxi = triton_bn.bn_backward(
        d, x, mean, invstd, scale, use_batch, interleaved=True
    )
    assert torch.equal(dxi, dx.transpose(0, 1))  # the (S, R, C) layout, same values
    rdx, rdg, rdb = _bn_reference(d, x, mean, invstd, scale, use_batch)
    assert dx.dtype == dtype and dx.shape == d.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for got, ref in ((dx, rdx), (dg, rdg), (db, rdb)):
        assert float((got.double() - ref).abs().max()) <= tol * float(ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_batch", [True, False])
@pytest.mark.parametrize("shape", [(3, 5, 7, 9), (2, 40, 3, 1100)])
def test_bn_backward_nchw_equals_the_formulas(dtype, use_batch, shape):
    R, N, C, L = shape
    g = torch.Generator().manual_seed(0)
    d = torch.randn(R, N, C, L, generator=g).to(dtype)
    x = torch.randn(N, C, L, generator=g).to(dtype)
    mean = x.float().mean((0, 2))
    invstd = torch.rsqrt(x.float().var((0, 2), unbiased=False) + 1e-5)
    scale = invstd * torch.randn(C, generator=g)
    dx, dg, db, dxi = triton_bn.bn_backward_nchw(
        d, x, mean, invstd, scale, use_batch, interleaved=True
    )
    assert torch.equal(dxi, dx.transpose(0, 1))  # the (N, R, C, L) layout
    # the channels-last formulas on the same numbers: (R, N·L, C) and (N·L, C)
    d_cl = d.permute(0, 1, 3, 2).reshape(R, N * L, C)
    x_cl = x.permute(0, 2, 1).reshape(N * L, C)
    rdx, rdg, rdb = _bn_reference(d_cl, x_cl, mean, invstd, scale, use_batch)
    rdx = rdx.reshape(R, N, L, C).permute(0, 1, 3, 2)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for got, ref in ((dx, rdx), (dg, rdg), (db, rdb)):
        assert float((got.double() - ref).abs().max()) <= tol * float(ref.abs().max())


def _model(seed=0, fmt=CL):
    torch.manual_seed(seed)
    net = studies.cifar.nets.ResNet18(10, widths=(4, 8, 8, 8))
    return net.to(memory_format=fmt)


def _batch(N=12, fmt=CL):
    g = torch.Generator().manual_seed(3)
    z = torch.randn(N, 3, 8, 8, generator=g).contiguous(memory_format=fmt)
    return z, torch.randint(0, 10, (N,), generator=g)


def _calls(monkeypatch):
    """Count the kernel calls made through the engine (and the compiled repeats and
    relayouts, whose kernels the rule deleted)."""
    seen = {"bn": 0, "bn_nchw": 0, "repeat": 0, "interleave": 0, "handed_off": 0}
    for mod, name, key in (
        (triton_bn, "bn_backward", "bn"),
        (triton_bn, "bn_backward_nchw", "bn_nchw"),
        (replicate_layers, "_repeat_copies_compiled", "repeat"),
        (replicate_layers, "_stack_copies_compiled", "interleave"),
    ):
        fn = getattr(mod, name)

        def counted(*a, _fn=fn, _key=key, **k):
            seen[_key] += 1
            return _fn(*a, **k)

        monkeypatch.setattr(mod, name, counted)
    handed = replicate_layers._handed_off

    def counted_handoff(dy, st):
        out = handed(dy, st)
        seen["handed_off"] += out is not None
        return out

    monkeypatch.setattr(replicate_layers, "_handed_off", counted_handoff)
    return seen


def _g_and_T(model, z, y, C):
    """g and T of the fast path and of serial autograd VJPs on a copy of ``model``."""
    plain = copy.deepcopy(model)
    X = plain(z)
    params = list(plain.parameters())
    loss = nn.functional.cross_entropy(X, y)
    grads = torch.autograd.grad(loss, params, retain_graph=True)
    g_ref = torch.cat([t.reshape(-1) for t in grads])
    T_ref = jacobian_from_outputs(X, params, C, retain_graph=False)
    pc = KWNGPreconditioner(model, num_basis=C.shape[0], eps_schedule=None)
    X = model(z)
    g, T = pc._gradients(nn.functional.cross_entropy(X, y), X, C, pc.params)
    return (g, g_ref), (T, T_ref)


@pytest.mark.parametrize("fmt", [CL, torch.contiguous_format])
def test_fast_path_through_the_kernels_equals_serial_vjps(monkeypatch, fmt):
    """fp32 BN ResNet in train mode, both memory formats: g and T of the replicated
    backward (batch norm, repeats and the stacked weight gradients through the kernels,
    as on a GPU; every convolution takes the layout its batch norm wrote) agree with
    serial autograd VJPs as closely as fp32 allows (1e-4)."""
    seen = _calls(monkeypatch)
    z, y = _batch(fmt=fmt)
    C = torch.randn(4, 12, 10, generator=torch.Generator().manual_seed(1))
    pairs = _g_and_T(_model(fmt=fmt), z, y, C)
    nchw = fmt == torch.contiguous_format
    assert seen["bn_nchw" if nchw else "bn"] > 0 and seen["repeat"] > 0
    assert nchw or seen["bn_nchw"] == 0  # channels_last all through
    assert seen["handed_off"] == 20 and seen["interleave"] == 0  # 20 conv → BN pairs
    for got, ref in pairs:
        assert float((got - ref).norm() / ref.norm()) < 1e-4


class _SharedConvOutput(nn.Module):
    """A convolution whose output feeds a batch norm and, directly, a sum: its gradient
    is the sum of two, so the batch norm's layout must not be used."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, z):
        h = self.conv(z)
        h = torch.relu(self.bn(h) + 0.5 * h)
        return self.head(h.mean((2, 3)))


def test_a_summed_gradient_does_not_take_the_batch_norm_layout(monkeypatch):
    seen = _calls(monkeypatch)
    z, y = _batch()
    torch.manual_seed(0)
    model = _SharedConvOutput().to(memory_format=CL)
    C = torch.randn(3, 12, 10, generator=torch.Generator().manual_seed(2))
    pairs = _g_and_T(model, z, y, C)
    assert seen["handed_off"] == 0 and seen["interleave"] == 1
    for got, ref in pairs:
        assert float((got - ref).norm() / ref.norm()) < 1e-4


def test_fast_direction_with_unused_and_frozen_parameters_equals_reference(monkeypatch):
    """The whole fast step through the kernels (the replicated backward, then the
    fused direction of kwng.engine.triton_solve) on a model with an unused and a
    frozen parameter equals the reference direction."""
    seen = _calls(monkeypatch)
    fused = kwng.engine.triton_solve.fused_direction

    def counted_fused(*a, **k):
        seen["fused"] = seen.get("fused", 0) + 1
        return fused(*a, **k)

    monkeypatch.setattr(kwng.engine.triton_solve, "fused_direction", counted_fused)
    z, y = _batch()
    dirs = {}
    for mode in ("fast", "reference"):
        model = _model()
        model.unused = nn.Linear(3, 3)
        pc = KWNGPreconditioner(
            model,
            lr=0.1,
            num_basis=4,
            eps=1e-3,
            clip_norm=None,
            mode=mode,
            generator=torch.Generator().manual_seed(5),
        )
        model.layers[0].conv1.weight.requires_grad_(False)
        X = model(z)
        pc.step(nn.functional.cross_entropy(X, y), X)
        assert model.layers[0].conv1.weight.grad is None
        dirs[mode] = torch.cat(
            [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
        )
    assert seen["bn"] > 0 and seen["fused"] == 1
    rel = float((dirs["fast"] - dirs["reference"]).norm() / dirs["reference"].norm())
    assert rel < 1e-4


def _fused_case(damping, case):
    gen = torch.Generator().manual_seed(0)
    M, q, N = 5, 5000, 32
    T, g = torch.randn(M, q, generator=gen), torch.randn(q, generator=gen)
    C = torch.randn(M, 40, generator=gen, dtype=torch.float64)
    K = C @ C.T / 40
    if case == "degenerate":  # zero columns (g ≠ 0 and g = 0), columns below the floor
        T[:, :10] = 0
        T[:, 10:20] *= 1e-12
        g[5:10] = 0
        g[15:20] = 0
    eps = {"nan_eps": float("nan"), "failed": -1e12}.get(case, 1e-2)
    lam = 0.3 if case == "lam" else 0.0
    clip = None if case == "noclip" else 1.0
    return T, g, C @ C.T, K, N, torch.tensor(eps, dtype=torch.float64), lam, clip


@pytest.mark.parametrize("fallback", solve.FALLBACKS)
@pytest.mark.parametrize("damping", solve.DAMPINGS)
@pytest.mark.parametrize(
    "case", ["plain", "degenerate", "lam", "nan_eps", "failed", "noclip"]
)
def test_fused_direction_equals_the_pytorch_path(damping, case, fallback):
    """The four kernels of kwng.engine.triton_solve against their one definition,
    kwng.engine.precond.direction_into (nystrom_solve_nosync, then
    solve.safeguard), for every damping of solve.DAMPINGS (a new one must be
    implemented or refused by the kernels): same direction (float32 rounding), same
    diagnostics. A non-finite direction (ε = NaN) and a failed Cholesky factorisation
    of the system (ε < 0) fall back to the clipped g on both paths, or to no step
    with ``fallback="skip"``."""
    from kwng.engine.triton_solve import (
        FUSED_DAMPINGS,
        fused_available,
        fused_direction,
    )

    T, g, CCt, K, N, eps, lam, clip = _fused_case(damping, case)
    if damping not in FUSED_DAMPINGS:  # left to the compiled PyTorch path
        assert not fused_available(T, g, damping)
        return
    assert fused_available(T, g, damping)
    kw = dict(eps=eps, lam=lam, damping=damping, rcond=None, clip_norm=clip,
              fallback=fallback)
    d, out = torch.empty_like(g), torch.empty_like(g)
    ref = direction_into(d, T, CCt, K, g, N, **kw)
    f = fused_direction(T, CCt, K, g, N, out=out, **kw)
    if fallback == "skip" and case in ("nan_eps", "failed"):  # no step on both paths
        assert bool(f["fallback"]) and bool(ref["fallback"])
        assert torch.equal(out, torch.zeros_like(g)) and torch.equal(d, out)
        assert float(f["dot"]) == 0.0 and float(f["direction_norm"]) == 0.0
        return
    assert float((out - d).norm() / d.norm()) < 1e-5
    if case == "failed":  # only the fallback's values: the solve's sums are meaningless
        assert bool(f["fallback"]) and bool(ref["fallback"])
        assert torch.allclose(out, g * (1.0 / g.norm()), rtol=1e-5)
        return
    for key in ("dot", "grad_norm", "direction_norm", "floored_share"):
        got, want = float(f[key]), float(ref[key])
        same_nan = math.isnan(got) and math.isnan(want)  # the share of a NaN direction
        assert same_nan or abs(got - want) <= 1e-5 * abs(want) + 1e-12, key
    for key in ("fallback", "clipped", "rank", "damping_floored", "loss_only",
                "ill_conditioned"):
        assert int(f[key]) == int(ref[key]), key
    assert bool(f["fallback"]) == (case == "nan_eps")
    if case == "degenerate" and damping != "identity":
        assert int(f["loss_only"]) == 5 and int(f["damping_floored"]) == 20
