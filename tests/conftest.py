"""Shared fixtures: the analytic problems of the paper's synthetic study (§4.1).

Each :class:`Problem` is a model of :mod:`kwng.models` with a closed-form Wasserstein
natural gradient (normal, log-normal, hyper-sphere), a parameter ``theta``, a Euclidean
gradient ``grad``, latent draws ``Z`` and one Nyström basis, so that every entry point
of the estimator can be run on *the same* samples and basis.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import kwng
import studies
from kwng.models import MODELS

# every study registers its plans, checks and early-stop rule with the CIFAR kit
studies.load_all()

PROBLEMS = tuple(MODELS)  # the registry: normal, lognormal, sphere


@dataclass
class Problem:
    name: str
    model: kwng.ImplicitModel
    theta: torch.Tensor
    grad: torch.Tensor
    Z: torch.Tensor
    basis_idx: torch.Tensor
    basis_coords: torch.Tensor
    bandwidth: float
    eps: float

    @property
    def N(self) -> int:
        return self.Z.shape[0]

    @property
    def num_basis(self) -> int:
        return self.basis_idx.shape[0]

    def sampler(self, theta: torch.Tensor) -> torch.Tensor:
        return self.model.sample(theta, self.Z)

    def kernel(self) -> kwng.Kernel:
        return kwng.GaussianKernel(self.bandwidth)

    def exact(self) -> torch.Tensor:
        """The exact WNG ``G_W(θ)⁻¹ ∇L`` of the model."""
        return self.model.wng(self.theta, self.grad)


def make_problem(name: str, *, d: int = 2, N: int, num_basis: int, eps: float,
                 seed: int = 0) -> Problem:
    """A problem with the paper's bandwidths: ``σ = 1`` on the sphere, the heuristic
    ``0.5 · mean ‖X_n - Y_m‖²`` otherwise (as the committed sweeps)."""
    model = kwng.make_model(name, d)
    g = torch.Generator().manual_seed(seed)
    theta = model.params_near_reference(g)
    grad = 0.1 ** 0.5 * torch.randn(model.num_params, generator=g, dtype=torch.float64)
    Z = model.sample_latent(N, g)
    idx, coords = kwng.draw_basis(N, d, num_basis, g)
    X = model.sample(theta, Z)
    bandwidth = 1.0 if name == "sphere" else kwng.mean_sq_bandwidth(X, X[idx], 0.5)
    return Problem(name, model, theta, grad, Z, idx, coords, bandwidth, eps)


@pytest.fixture(params=PROBLEMS)
def accurate_problem(request) -> Problem:
    """Large enough for the estimate to be near the exact WNG (``N = 2000, M = 20``,
    ``ε = 1e-4``)."""
    return make_problem(request.param, N=2000, num_basis=20, eps=1e-4)


@pytest.fixture(params=PROBLEMS)
def conditioned_problem(request) -> Problem:
    """Well conditioned (``N = 300, M = 5``, ``ε = 0.1``): cond(CCᵀ) ≤ 1e5, so even the
    plain form of Prop. 5 agrees with the stable one to round-off."""
    return make_problem(request.param, N=300, num_basis=5, eps=0.1)
