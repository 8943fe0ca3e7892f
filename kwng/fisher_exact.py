"""Exact Fisher–Rao quantities of the small models: log-densities, scores, the Fisher
information matrix (closed form and Monte Carlo) and the exact Fisher natural gradient,
the references the kernel estimator of :mod:`kwng.fisher` is checked against.
"""

from __future__ import annotations

import math

import torch

from kwng._checks import check_finite, check_int, check_points
from kwng.models import HyperSphereModel, ImplicitModel, LogNormalModel, NormalModel

__all__ = ["normal_fisher_matrix", "log_density", "scores", "fisher_matrix",
           "fisher_natural_gradient", "fisher_matrix_mc"]


# --------------------------------------------------------------------------------------
# Exact Fisher information and natural gradient (Def. 1), Monte Carlo Fisher from scores
# --------------------------------------------------------------------------------------
def normal_fisher_matrix(model: NormalModel, theta: torch.Tensor) -> torch.Tensor:
    """Fisher information matrix (Def. 1) of ``N(μ, LLᵀ)`` in the coordinates
    ``θ = (μ, vech L)`` of :class:`~kwng.NormalModel`:
    ``G_F = diag(Σ⁻¹, [½ tr(Σ⁻¹ ∂_aΣ Σ⁻¹ ∂_bΣ)]_{a,b})`` with
    ``∂_aΣ = E_a Lᵀ + L E_aᵀ``."""
    if not isinstance(model, NormalModel):
        raise ValueError(
            f"model must be a kwng.NormalModel, got {type(model).__name__}")
    _, L = model.split(theta)
    L = L.detach().to(torch.float64)
    Sigma = L @ L.T
    Sinv = torch.linalg.inv(Sigma)
    d = model.d
    rows, cols = torch.tril_indices(d, d)
    dS = []
    for i, j in zip(rows.tolist(), cols.tolist()):
        E = torch.zeros(d, d, dtype=torch.float64)
        E[i, j] = 1.0
        dS.append(E @ L.T + L @ E.T)
    n = len(dS)
    G = torch.zeros(d + n, d + n, dtype=torch.float64)
    G[:d, :d] = Sinv
    for a in range(n):
        for b in range(n):
            G[d + a, d + b] = 0.5 * torch.trace(Sinv @ dS[a] @ Sinv @ dS[b])
    return G


def _check_density_model(model: ImplicitModel) -> None:
    if isinstance(model, HyperSphereModel):
        raise ValueError(
            "the hyper-sphere model has no density: its Fisher information is not "
            "defined (use a NormalModel or a LogNormalModel)"
        )
    if not isinstance(model, (NormalModel, LogNormalModel)):
        raise ValueError(
            "model must be a kwng.NormalModel or kwng.LogNormalModel, "
            f"got {type(model).__name__}"
        )


def log_density(
    model: ImplicitModel, theta: torch.Tensor, X: torch.Tensor
) -> torch.Tensor:
    """``log ρ_θ(X_n)`` for each row of ``X`` (``(N,)``), differentiable in ``theta``.

    Normal ``N(μ, LLᵀ)``: the Gaussian log-density. Log-normal ``X = exp(μ + s ⊙ Z)``:
    the log-density of ``Y = log X`` under ``N(μ, diag s²)`` minus ``Σ_k log X_k``
    (Jacobian of ``exp``). Rejects the hyper-sphere (no density)."""
    _check_density_model(model)
    theta = model.check_theta(theta)
    X = check_points(X, "X").to(theta.dtype)
    if X.shape[1] != model.d:
        raise ValueError(f"X must have d = {model.d} columns, got {X.shape[1]}")
    d = model.d
    if isinstance(model, NormalModel):
        mu, L = model.split(theta)
        R = torch.linalg.solve_triangular(L, (X - mu).T, upper=False)  # L⁻¹(x - μ)
        logdet = torch.log(torch.abs(torch.diagonal(L))).sum()
        return -0.5 * (R * R).sum(0) - logdet - 0.5 * d * math.log(2 * math.pi)
    if bool((X <= 0).any()):
        raise ValueError("X must be positive for the log-normal model")
    mu, s = theta[:d], theta[d:]
    Ylog = torch.log(X)
    z = (Ylog - mu) / s
    return (
        -0.5 * z * z - torch.log(torch.abs(s)) - 0.5 * math.log(2 * math.pi) - Ylog
    ).sum(1)


def scores(model: ImplicitModel, theta: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """Scores ``∇_θ log ρ_θ(X_n)`` (``N × q``) by automatic differentiation of
    :func:`log_density`."""
    _check_density_model(model)
    theta = model.check_theta(theta).detach()
    return torch.func.jacfwd(lambda t: log_density(model, t, X))(theta)


def fisher_matrix(model: ImplicitModel, theta: torch.Tensor) -> torch.Tensor:
    """Exact Fisher information ``G_F(θ)`` (Def. 1) of the normal or log-normal model.

    Normal: :func:`kwng.fisher_exact.normal_fisher_matrix` (``θ = (μ, vech L)``, full
    covariance). Log-normal (``θ = (μ, s)``, ``X = exp(μ + s ⊙ Z)``): the Fisher
    information is invariant under the diffeomorphism ``exp``, so it is that of
    ``N(μ, diag s²)``: ``diag(1/s², 2/s²)``. The hyper-sphere is rejected: it has no
    density."""
    _check_density_model(model)
    theta = model.check_theta(theta).detach().to(torch.float64)
    if isinstance(model, NormalModel):
        return normal_fisher_matrix(model, theta)
    s2 = theta[model.d :] ** 2
    if bool((s2 == 0).any()):
        raise ValueError(
            "the log-normal scales s must be non-zero "
            "(the Fisher information is singular)"
        )
    return torch.diag(torch.cat([1.0 / s2, 2.0 / s2]))


def fisher_natural_gradient(
    model: ImplicitModel, theta: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    """The exact Fisher–Rao natural gradient ``G_F(θ)⁻¹ ∇L(θ)`` of the normal or
    log-normal model."""
    G = fisher_matrix(model, theta)
    if not isinstance(grad, torch.Tensor) or grad.shape != (G.shape[0],):
        raise ValueError(f"grad must be a tensor of shape ({G.shape[0]},)")
    check_finite(grad, "grad")
    return torch.linalg.solve(G, grad.to(torch.float64))


def fisher_matrix_mc(
    model: ImplicitModel,
    theta: torch.Tensor,
    N: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Monte Carlo Fisher information ``(1/N) Σ_n s_n s_nᵀ`` from ``N`` samples and the
    scores ``s_n`` of :func:`scores`, assembled entry by entry, with the standard error
    of each entry.

    Returns ``(G_mc, stderr)``, both ``q × q``. Independent of :func:`fisher_matrix`: it
    uses only the log-density and automatic differentiation."""
    N = check_int(N, "N", 2)
    Z = model.sample_latent(N, generator)
    theta = model.check_theta(theta).detach().to(torch.float64)
    with torch.no_grad():
        X = model.sample(theta, Z)
    S = scores(model, theta, X)
    prod = S[:, :, None] * S[:, None, :]  # (N, q, q)
    return prod.mean(0), prod.std(0) / math.sqrt(N)
