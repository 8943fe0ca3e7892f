"""Fault cases: one validation and precision path for the two
estimators (``kwng.kwng_gradient`` and ``kwng.kfng_gradient``, through
:mod:`kwng.estimator_checks`)."""

from __future__ import annotations

import warnings

import pytest
import torch

import kwng

D, N, M = 3, 300, 20


def _problem(dtype=torch.float64, scale=1.0):
    model = kwng.make_model("normal", D)
    theta = model.params_near_reference(torch.Generator().manual_seed(0), 0.1)
    grad = torch.randn(model.num_params, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(1))
    Z = model.sample_latent(N, torch.Generator().manual_seed(2)).to(dtype)
    return theta.to(dtype), grad.to(dtype), (lambda t: scale * model.sample(t, Z))


def _fisher(theta, grad, sampler, **kw):
    args = dict(num_basis=M, eps=1e-5, kernel=kwng.GaussianKernel(1.0),
                basis_idx=torch.arange(M), bandwidth="mean_sq")
    args.update(kw)
    return kwng.kfng_gradient(sampler, theta, grad, **args)


def _wasserstein(theta, grad, sampler, **kw):
    args = dict(num_basis=M, eps=1e-5, kernel=kwng.GaussianKernel(1.0),
                basis_idx=torch.arange(M), basis_coords=torch.arange(M) % D,
                bandwidth="mean_sq")
    args.update(kw)
    return kwng.kwng_gradient(sampler, theta, grad, **args)


ESTIMATORS = {"kfng": _fisher, "kwng": _wasserstein}


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_float32_samples_give_the_float64_estimate(name):
    # before: kfng_gradient in float32 was 60 % away from its float64 result (rank 16
    # of 20); the kernel matrices are now built in float64 for both estimators
    est = ESTIMATORS[name]
    ref = est(*_problem(torch.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # float32 at unit scale: fine
        low = est(*_problem(torch.float32))
    assert low.direction.dtype == torch.float32
    assert low.diagnostics["rank"] == ref.diagnostics["rank"]
    assert kwng.relative_error(low.direction.double(), ref.direction) < 1e-4


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_coarse_samples_warn_in_both_estimators(name):
    theta, grad, sampler = _problem(torch.float16)
    shifted = lambda t: sampler(t) + 300.0  # noqa: E731  (float16 at ~300: 1 % steps
    with pytest.warns(RuntimeWarning, match="rounded"):
        res = ESTIMATORS[name](theta, grad, shifted)
    assert res.diagnostics["sample_resolution"] > kwng.samples.RESOLUTION_WARN


def test_all_degenerate_columns_warn_instead_of_a_silent_zero():
    # samples ×1e6 with σ = 1: every kernel derivative underflows, T = 0; before, the
    # direction was exactly zero with no warning
    theta, grad, sampler = _problem(scale=1e6)
    with pytest.warns(RuntimeWarning, match="loss-only"):
        res = _fisher(theta, grad, sampler, bandwidth=1.0)
    assert res.diagnostics["all_loss_only"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        ok = _fisher(*_problem())
    assert not ok.diagnostics["all_loss_only"]


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_repeated_basis_is_refused(name):
    theta, grad, sampler = _problem()
    idx = torch.arange(M)
    idx[1] = 0
    kw = {"basis_idx": idx}
    if name == "kwng":
        kw["basis_coords"] = torch.zeros(M, dtype=torch.long)
    with pytest.raises(ValueError, match="repeated"):
        ESTIMATORS[name](theta, grad, sampler, **kw)


def test_same_point_with_another_coordinate_is_a_distinct_basis_function():
    theta, grad, sampler = _problem()
    idx = torch.arange(M) // 2  # each point twice, with coordinates 0 and 1
    coords = torch.arange(M) % 2
    res = _wasserstein(theta, grad, sampler, basis_idx=idx, basis_coords=coords)
    assert res.diagnostics["rank"] == M


@pytest.mark.parametrize("name", list(ESTIMATORS))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_integer_gradient_is_refused(name, dtype):
    theta, grad, sampler = _problem()
    with pytest.raises(ValueError, match=f"grad must be a floating-point.*{dtype}"):
        ESTIMATORS[name](theta, (grad * 10).to(dtype), sampler)


@pytest.mark.parametrize("name", list(ESTIMATORS))
@pytest.mark.parametrize("bad, match", [
    (lambda idx: idx.double(), "basis_idx must hold integers"),
    (lambda idx: idx[:-1], r"basis_idx must have shape \(20,\)"),
    (lambda idx: idx + N, r"basis_idx must lie in \[0, 299\]"),
])
def test_bad_basis_indices_are_named(name, bad, match):
    theta, grad, sampler = _problem()
    kw = {"basis_idx": bad(torch.arange(M))}
    if name == "kwng":
        kw["basis_coords"] = torch.zeros(kw["basis_idx"].shape[0], dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        ESTIMATORS[name](theta, grad, sampler, **kw)
