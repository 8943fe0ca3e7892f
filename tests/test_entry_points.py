"""Every entry point of the estimator × every analytic problem: one table.

Each entry point computes the KWNG direction on the same samples, basis and bandwidth
(:mod:`tests.conftest`). They must agree with each other to round-off (tight) and, in
the accurate setting, with the exact WNG of the model (loose: the estimator's own
error).
"""

from __future__ import annotations

import pytest
import torch

import kwng
from kwng import solve
from kwng.jacobians import jacobian_from_sampler
from kwng.nosync import nystrom_solve_nosync
from studies.toy.batched import batched_kwng


def _matrices(p):
    X = p.sampler(p.theta)
    C, K, CCt = kwng.kernel_matrices(X, p.basis_idx, p.basis_coords, p.kernel())
    return jacobian_from_sampler(p.sampler, p.theta, C), CCt, K


def _kw(p, **extra):
    return dict(
        num_basis=p.num_basis,
        eps=p.eps,
        kernel=p.kernel(),
        basis_idx=p.basis_idx,
        basis_coords=p.basis_coords,
        **extra,
    )


def kwng_gradient(p, method):
    return kwng.kwng_gradient(
        p.sampler, p.theta, p.grad, **_kw(p, method=method)
    ).direction


def from_outputs(p, method):
    theta = p.theta.clone().requires_grad_(True)
    X = p.sampler(theta)
    return kwng.kwng_gradient_from_outputs(
        X, [theta], p.grad, **_kw(p, method=method)
    ).direction


def nystrom(p, method):
    T, CCt, K = _matrices(p)
    return kwng.nystrom_solve(
        T, CCt, K, p.grad, p.N, eps=p.eps, method=method
    ).direction


def nosync(p, method):
    T, CCt, K = _matrices(p)
    return nystrom_solve_nosync(T, CCt, K, p.grad, p.N, eps=p.eps)[0]


def batched(p, method):
    D, sigma, _ = batched_kwng(
        p.model,
        p.theta[None],
        p.grad[None],
        p.Z[None],
        p.basis_idx[None],
        p.basis_coords[None],
        eps=p.eps,
        bandwidth=p.bandwidth,
    )
    assert float(sigma[0]) == p.bandwidth
    return D[0]


def core_batch(p, method):
    """kwng.solve on a batch of two copies: both rows equal the single solve."""
    T, CCt, K = _matrices(p)
    out = solve.kwng_direction(
        torch.stack([T, T]),
        torch.stack([CCt, CCt]),
        torch.stack([K, K]),
        torch.stack([p.grad, p.grad]),
        p.N,
        eps=p.eps,
        method=method,
    )
    assert kwng.relative_error(out.direction[0], out.direction[1]) < 1e-10
    return out.direction[0]


STABLE = [kwng_gradient, from_outputs, nystrom, nosync, batched, core_batch]
PLAIN = [kwng_gradient, from_outputs, nystrom, core_batch]
ENTRIES = [(f, "stable") for f in STABLE] + [(f, "plain") for f in PLAIN]
IDS = [f"{f.__name__}-{m}" for f, m in ENTRIES]


@pytest.mark.parametrize("entry,method", ENTRIES, ids=IDS)
def test_entry_points_agree_when_well_conditioned(conditioned_problem, entry, method):
    p = conditioned_problem
    reference = kwng_gradient(p, "stable")
    assert kwng.relative_error(entry(p, method), reference) < 1e-8


@pytest.mark.parametrize("entry", STABLE, ids=[f.__name__ for f in STABLE])
def test_stable_entry_points_match_the_exact_wng(accurate_problem, entry):
    """Loose against the exact WNG (measured 0.6–6 %), tight against each other. The
    Cholesky whitening of the sync-free path agrees to 1e-5 only: at cond(CCᵀ) ~ 1e12
    (log-normal) its round-off differs from the eigen form's."""
    p = accurate_problem
    direction = entry(p, "stable")
    assert kwng.relative_error(direction, p.exact()) < 0.15
    tight = 1e-5 if entry is nosync else 1e-8
    assert kwng.relative_error(direction, kwng_gradient(p, "stable")) < tight


def test_scale_argument_resolves_in_one_place(monkeypatch):
    """Every experiment's ``scale=`` goes through :func:`kwng.scale_switch.resolve`: an
    explicit value is checked, ``None`` reads ``$KWNG_SCALE``."""
    from kwng import scale_switch as config
    from studies.fisher import cli as fisher
    from studies.toy import setup as synthetic_setup

    monkeypatch.setenv("KWNG_SCALE", "full")
    assert config.resolve(None) == "full" and config.resolve("small") == "small"
    assert synthetic_setup.relerr_config()["scale"] == "full"
    assert synthetic_setup.relerr_config("small")["scale"] == "small"
    for bad in ("medium", "FULL"):
        with pytest.raises(ValueError, match="scale must be one of"):
            config.resolve(bad)
        with pytest.raises(ValueError, match="scale must be one of"):
            fisher.sweep_config(bad)
