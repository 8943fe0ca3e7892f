"""Numerical companions of the theory chapters (paper §2–3 and Apps. B–D).

Every function here implements one equation or proposition of Arbel, Gretton, Li &
Montúfar (ICLR 2020) in a form that can be *checked* against an independent computation.
Equation numbers ``(n)`` follow the paper's LaTeX source (main text and appendices
numbered consecutively); the LaTeX label is given too, so that a reader can find the
equation whichever numbering they hold.

Where each part of the paper lives:

* (2), (4), (5), Prop. 1 (6): :func:`integrate_flow`, :func:`pullback_wng`
* Def. 2 (G_W), gradient velocity fields: :func:`pullback_metric`
* Def. 1 (G_F) for the normal: :func:`kwng.fisher_exact.normal_fisher_matrix`
* (10), (14), the distributional gradient: :func:`distributional_gradient`
* Prop. 2 (11), Prop. 3 (15): :func:`dual_objective`, :func:`dual_optimum`
* App. B.3 (50)–(52), the Dirac family: :func:`negative_sobolev_objective`
* Prop. 4 (18)–(21), the minimax exchange:
  :func:`~kwng.theory.nystrom.rkhs_brute_force`,
  :class:`~kwng.theory.nystrom.BruteForceKWNG`
* (22), the full-derivative Nyström subspace:
  :func:`~kwng.theory.nystrom.full_derivative_basis`,
  :func:`~kwng.theory.nystrom.sutherland_kwng_gradient`
* Prop. 6 (27) as printed: :func:`~kwng.theory.nystrom.stable_as_printed`
* Thm. 7, the well-specified theorem: :func:`~kwng.theory.nystrom.theory_schedule`,
  :func:`~kwng.theory.nystrom.predicted_rate`
* §3.3, the cost model: :func:`~kwng.theory.nystrom.predicted_cost`,
  :func:`~kwng.theory.nystrom.loglog_slope`

Symbols ↔ argument names: ``N`` = number of samples, ``M`` = ``num_basis`` /
``num_points``, ``ε`` = ``eps``, ``λ`` = ``lam``, ``D(θ)`` = ``damping``, ``∇L(θ)`` =
``grad``, ``h_θ`` = ``sampler``, ``ν``-samples ``Z`` with quadrature ``weights``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from kwng._checks import check_choice, check_int, check_points, check_positive

__all__ = [
    "gauss_hermite_latent",
    "circle_latent",
    "pullback_metric",
    "pullback_wng",
    "integrate_flow",
    "sampler_jacobian",
    "distributional_gradient",
    "dual_objective",
    "dual_optimum",
    "polynomial_features",
    "rbf_features",
    "negative_sobolev_objective",
]

Sampler = Callable[[torch.Tensor], torch.Tensor]
Features = Callable[[torch.Tensor], torch.Tensor]


def sampler_jacobian(sampler: Sampler, theta: torch.Tensor) -> torch.Tensor:
    """``∇_θ h_θ(Z_n)`` for all latent draws: shape ``(N, d, q)``."""
    if not isinstance(theta, torch.Tensor) or theta.dim() != 1:
        raise ValueError("theta must be a 1-d torch.Tensor (the flat parameter vector)")
    B = torch.autograd.functional.jacobian(
        sampler, theta.detach(), vectorize=True, strategy="forward-mode"
    )
    if B.dim() != 3:
        raise ValueError(
            "sampler must return samples of shape (N, d), got Jacobian shape "
            f"{tuple(B.shape)}"
        )
    return B


# --------------------------------------------------------------------------------------
# Latent quadratures: exact expectations under ν for the small models of the book
# --------------------------------------------------------------------------------------
def gauss_hermite_latent(
    d: int, num_nodes: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensor Gauss–Hermite rule for ``ν = N(0, I_d)``: nodes ``Z`` (``num_nodes^d ×
    d``) and weights summing to 1. Exact for polynomials of degree ``< 2 num_nodes`` in
    each coordinate."""
    d = check_int(d, "d", 1, 4)
    n = check_int(num_nodes, "num_nodes", 1, 64)
    x, w = np.polynomial.hermite_e.hermegauss(n)
    w = w / w.sum()
    grids = np.meshgrid(*([x] * d), indexing="ij")
    wgrids = np.meshgrid(*([w] * d), indexing="ij")
    Z = np.stack([g.ravel() for g in grids], axis=1)
    W = np.prod(np.stack([g.ravel() for g in wgrids], axis=1), axis=1)
    return torch.from_numpy(Z), torch.from_numpy(W)


def circle_latent(num_nodes: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Equispaced points on the unit circle with equal weights: for the hyper-sphere
    model in ``d = 2`` (its sampler only uses ``Z/‖Z‖``) this is exact for trigonometric
    polynomials of degree ``< num_nodes``."""
    n = check_int(num_nodes, "num_nodes", 3)
    t = 2 * math.pi * torch.arange(n, dtype=torch.float64) / n
    return torch.stack([t.cos(), t.sin()], 1), torch.full(
        (n,), 1.0 / n, dtype=torch.float64
    )


def _weights(Z: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    if weights is None:
        return torch.full((Z.shape[0],), 1.0 / Z.shape[0], dtype=torch.float64)
    weights = torch.as_tensor(weights, dtype=torch.float64)
    if weights.shape != (Z.shape[0],):
        raise ValueError(
            f"weights must have shape ({Z.shape[0]},) to match Z, got "
            f"{tuple(weights.shape)}"
        )
    if not bool((weights >= 0).all()) or abs(float(weights.sum()) - 1.0) > 1e-8:
        raise ValueError("weights must be non-negative and sum to 1")
    return weights


# --------------------------------------------------------------------------------------
# Chapter "Natural gradient descent" (§2.1–2.2)
# --------------------------------------------------------------------------------------
def pullback_metric(
    sampler: Sampler, theta: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """``E_ν[∇_θh_θ(Z)ᵀ ∇_θh_θ(Z)]`` (``q × q``), the Wasserstein information matrix of
    Def. 2 when the velocity fields ``x ↦ ∂_i h_θ(h_θ⁻¹(x))`` are gradients.

    ``sampler`` maps ``theta`` to ``h_θ(Z_n)`` for a fixed set of latent draws ``Z_n``
    with quadrature ``weights`` (uniform when omitted). The fields are gradients for
    every model in ``d = 1``, for the hyper-sphere and for the log-normal model; then
    Def. 2's ``φ_i`` is the field itself and ``G_W = E[∂hᵀ∂h]``. In general this matrix
    is an upper bound of ``G_W`` (``G_W`` keeps only the gradient part of each field).
    The point of this function is that it works in *any* parametrisation: it is computed
    from the sampler alone.
    """
    B = sampler_jacobian(sampler, theta)
    w = _weights(B, weights).to(B.dtype)
    return torch.einsum("n,ndq,ndr->qr", w, B, B)


def pullback_wng(
    sampler: Sampler,
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    theta: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``G(θ)⁻¹ ∇L(θ)`` (eq. (4)–(5), the generalized natural gradient) with ``G`` from
    :func:`pullback_metric` and ``∇L`` by autograd of ``loss_fn``."""
    G = pullback_metric(sampler, theta, weights)
    t = theta.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(loss_fn(t), t)
    return torch.linalg.solve(G, g.to(G.dtype))


def integrate_flow(
    velocity: Callable[[torch.Tensor], torch.Tensor],
    x0: torch.Tensor,
    *,
    step: float,
    t_end: float,
    method: str = "euler",
) -> torch.Tensor:
    """Integrate ``ẋ = velocity(x)`` from ``x0`` to time ``t_end`` with a fixed
    ``step``.

    With ``velocity = -(natural gradient)`` and ``method="euler"`` each step is one
    update of natural gradient descent, eq. (5), with ``γ = step``; as ``step → 0`` the
    iterates follow the continuous flow (6) of Prop. 1. ``method="rk4"`` is the
    classical fourth-order rule. Returns the trajectory, shape ``(num_steps + 1, q)``.
    """
    step = check_positive(step, "step")
    t_end = check_positive(t_end, "t_end")
    check_choice(method, "method", ("euler", "rk4"))
    n = int(round(t_end / step))
    if n < 1 or abs(n * step - t_end) > 1e-9 * t_end:
        raise ValueError(
            f"t_end / step must be a positive integer, got {t_end} / {step}"
        )
    x = x0.detach().clone()
    out = [x]
    for _ in range(n):
        if method == "euler":
            x = x + step * velocity(x)
        else:
            k1 = velocity(x)
            k2 = velocity(x + 0.5 * step * k1)
            k3 = velocity(x + 0.5 * step * k2)
            k4 = velocity(x + step * k3)
            x = x + step / 6.0 * (k1 + 2 * k2 + 2 * k3 + k4)
        out.append(x.detach())
    return torch.stack(out)




# --------------------------------------------------------------------------------------
# Chapter "Legendre duality for metrics" (§2.3, App. B)
# --------------------------------------------------------------------------------------
def _feature_grads(
    features: Features, X: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Values ``(n, K)`` and gradients ``(n, K, d)`` of the feature map at the rows of
    ``X``."""
    X = check_points(X, "X").detach()
    vals = features(X)
    if vals.dim() != 2 or vals.shape[0] != X.shape[0]:
        raise ValueError(f"features must map (n, d) to (n, K), got {tuple(vals.shape)}")
    one = lambda x: features(x[None])[0]  # noqa: E731
    grads = torch.func.vmap(torch.func.jacrev(one))(X)
    return vals, grads


def distributional_gradient(
    sampler: Sampler,
    theta: torch.Tensor,
    u: torch.Tensor,
    features: Features,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``∇ρ_θ(ψ_k)ᵀu`` for each feature ``ψ_k`` (eq. (10)) by the re-parametrisation
    trick, eq. (14): ``E_ν[∇ψ_k(h_θ(Z))ᵀ ∇_θh_θ(Z) u]``. Returns a vector of length
    ``K``."""
    if u.shape != theta.shape:
        raise ValueError(
            f"u must have the shape of theta {tuple(theta.shape)}, got {tuple(u.shape)}"
        )
    X, dX = torch.func.jvp(sampler, (theta.detach(),), (u.to(theta.dtype),))
    w = _weights(X, weights).to(X.dtype)
    _, grads = _feature_grads(features, X)
    return torch.einsum("n,nkj,nj->k", w, grads, dX)


def dual_objective(
    sampler: Sampler,
    theta: torch.Tensor,
    u: torch.Tensor,
    f: Features,
    *,
    metric: str = "wasserstein",
    weights: torch.Tensor | None = None,
) -> float:
    """Objective of the dual problems at one test function ``f`` (a map ``(n, d) → (n,
    1)``).

    * ``metric="wasserstein"``: ``∇ρ_θ(f)ᵀu − ½ E_ρ‖∇f‖²``, the objective of Prop. 3,
      eq. (15);
    * ``metric="fisher"``: ``∇ρ_θ(f)ᵀu − ½ E_ρ[(f − E_ρ f)²]``, the objective of Prop.
      2, eq. (11) (``f`` is centred, which changes neither ``∇ρ_θ(f)`` nor the
      constraint's intent).

    The supremum over ``f`` is ``½uᵀGu``; on a model without density the Fisher one is
    infinite.
    """
    check_choice(metric, "metric", ("wasserstein", "fisher"))
    lin = float(distributional_gradient(sampler, theta, u, f, weights)[0])
    with torch.no_grad():
        X = sampler(theta.detach())
    w = _weights(X, weights).to(X.dtype)
    vals, grads = _feature_grads(f, X)
    if metric == "wasserstein":
        quad = float(torch.einsum("n,nj->", w, grads[:, 0] ** 2))
    else:
        v = vals[:, 0]
        quad = float(w @ (v - w @ v) ** 2)
    return lin - 0.5 * quad


@dataclass
class DualOptimum:
    """Result of :func:`dual_optimum`: the maximal value, the coefficients ``β`` of the
    optimal test function ``f = Σ_k β_k ψ_k`` and the linear and quadratic terms ``b``,
    ``Q``."""

    value: float
    beta: torch.Tensor
    b: torch.Tensor
    Q: torch.Tensor


def dual_optimum(
    sampler: Sampler,
    theta: torch.Tensor,
    u: torch.Tensor,
    features: Features,
    *,
    metric: str = "wasserstein",
    weights: torch.Tensor | None = None,
    ridge: float = 0.0,
) -> DualOptimum:
    """Maximise the dual objective of Prop. 3 (eq. (15), ``metric="wasserstein"``) or
    Prop. 2 (eq. (11), ``metric="fisher"``) over the span of a feature map ``ψ: (n, d) →
    (n, K)``.

    With ``f = Σ β_k ψ_k`` the objective is ``βᵀb − ½βᵀQβ`` where ``b_k = ∇ρ_θ(ψ_k)ᵀu``
    and ``Q = E[∇ψ ∇ψᵀ]`` (Wasserstein) or ``Cov(ψ)`` (Fisher); the maximum is ``½
    bᵀQ†b`` (``Q + ridge·I`` when ``ridge > 0``). It equals ``½uᵀGu`` exactly when the
    span contains the optimal ``f``.
    """
    check_choice(metric, "metric", ("wasserstein", "fisher"))
    ridge = check_positive(ridge, "ridge", allow_zero=True)
    b = distributional_gradient(sampler, theta, u, features, weights)
    with torch.no_grad():
        X = sampler(theta.detach())
    w = _weights(X, weights).to(X.dtype)
    vals, grads = _feature_grads(features, X)
    if metric == "wasserstein":
        Q = torch.einsum("n,nkj,nlj->kl", w, grads, grads)
    else:
        c = vals - w @ vals
        Q = torch.einsum("n,nk,nl->kl", w, c, c)
    Q = Q + ridge * torch.eye(Q.shape[0], dtype=Q.dtype)
    beta = torch.linalg.pinv(Q, hermitian=True, rtol=1e-12) @ b
    return DualOptimum(float(0.5 * b @ beta), beta, b, Q)


def polynomial_features(d: int, degree: int = 2) -> Features:
    """All monomials ``x^a`` with ``1 ≤ |a| ≤ degree`` in ``d`` variables (constants are
    useless: the dual objectives only see ``∇f`` or the centred ``f``). Returns a
    feature map."""
    d = check_int(d, "d", 1)
    degree = check_int(degree, "degree", 1, 6)
    import itertools

    exps = [
        a
        for a in itertools.product(range(degree + 1), repeat=d)
        if 1 <= sum(a) <= degree
    ]
    E = torch.tensor(exps, dtype=torch.float64)  # (K, d)

    def features(X: torch.Tensor) -> torch.Tensor:
        return torch.prod(X[:, None, :] ** E.to(X.dtype), dim=-1)

    return features


def rbf_features(centres: torch.Tensor, bandwidth: float) -> Features:
    """Gaussian bumps ``ψ_k(x) = exp(−‖x − c_k‖² / (2σ))``, ``σ = bandwidth`` (the
    kernel sections ``k(c_k, ·)`` of :class:`~kwng.GaussianKernel`): an RKHS-flavoured
    rich function class."""
    centres = check_points(centres, "centres").detach()
    sigma = check_positive(bandwidth, "bandwidth")

    def features(X: torch.Tensor) -> torch.Tensor:
        r = X[:, None, :] - centres.to(X.dtype)[None]
        return torch.exp(-(r ** 2).sum(-1) / (2 * sigma))

    return features


def negative_sobolev_objective(f: Features, X: torch.Tensor, X_prime: torch.Tensor,
                               weights: torch.Tensor | None = None,
                               weights_prime: torch.Tensor | None = None) -> float:
    """Dual objective of the negative Sobolev distance, App. B.3 eq. (50):
    ``E_ρ f − E_ρ' f − ½ E_ρ‖∇f‖²``, with ``ρ`` and ``ρ'`` given by weighted samples
    ``X``, ``X_prime``.

    For Dirac masses ``ρ = δ_θ``, ``ρ' = δ_{θ+εu}`` (eq. (51), divided by ``ε``) this is
    unbounded over ``f`` while the metric's dual (52) stays at ``½‖u‖²``.
    """
    w = _weights(check_points(X, "X"), weights).to(X.dtype)
    wp = _weights(check_points(X_prime, "X_prime"), weights_prime).to(X.dtype)
    vals, grads = _feature_grads(f, X)
    with torch.no_grad():
        vp = f(X_prime.detach())
    return float(w @ vals[:, 0] - wp @ vp[:, 0] - 0.5 * w @ (grads[:, 0] ** 2).sum(-1))
