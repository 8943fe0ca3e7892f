"""The kernel estimator of the Fisher–Rao natural gradient, next to the Wasserstein one.

Beyond the paper. Arbel, Gretton, Li & Montúfar (ICLR 2020) give Legendre duals for both
the Fisher–Rao (Prop. 2) and the Wasserstein (Prop. 3) information matrices, and build
their kernel estimator only on the Wasserstein dual. Restricting the Fisher dual to the
Nyström subspace ``H_M = span{k(Y_m, ·)}`` and handling its zero-mean constraint by
centring (the book's chapter "The Fisher–Rao natural gradient, estimated the same way"
derives this) gives the *same* closed form as Props. 5/6 with other matrices:

=====================  =================================================================
paper / book           here
=====================  =================================================================
``M``                  ``num_basis`` (basis points ``Y_m = X_{basis_idx[m]}``, drawn by
                       :func:`kwng.draw_basis`; its coordinates are not used: no
                       derivative)
``C`` (``M × N``)      centred kernel values ``k(Y_m, X_n) - (1/N) Σ_n' k(Y_m, X_n')``
``K`` (``M × M``)      Gram ``k(Y_m, Y_m')`` (RKHS norm of ``Σ α_m k(Y_m, ·)``)
``T`` (``M × q``)      ``∇_θ (1/N) Σ_n k(Y_m, h_θ(Z_n))`` (``jacobian="reparam"``, any
                       sampler) or ``C S / N`` with ``S`` the scores
                       ``∇_θ log ρ_θ(X_n)`` (``jacobian="score"``)
``ε, λ, D(θ)``         ``eps``, ``lam``, ``damping`` exactly as in
                       :func:`kwng.kwng_gradient`
=====================  =================================================================

Plain form::

    ĝ_F = (1/ε) [D⁻¹ - D⁻¹Tᵀ (T D⁻¹ Tᵀ + λεK + (ε/N) CCᵀ)† T D⁻¹] ∇L

and its stable form with ``CCᵀ = U S Uᵀ``, ``W = S^{-1/2} Uᵀ``, ``T̃ = W T``. The linear
algebra is :func:`kwng.nystrom_solve`, imported unchanged: only ``C``, ``K`` and ``T``
differ from the Wasserstein estimator. The exact Fisher natural gradients of the normal
(full covariance) and log-normal models, a Monte Carlo Fisher matrix from scores, and an
independent brute-force solve of the restricted dual (for tests) complete the module.
The hyper-sphere has no density: :func:`~kwng.fisher_exact.fisher_matrix` refuses it,
the estimator still returns a number (see the chapter).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from kwng._checks import check_choice, check_int, check_points, check_positive
from kwng.estimator import KWNGResult, draw_basis, nystrom_solve, with_bandwidth
from kwng.estimator_checks import (
    check_basis,
    check_grad,
    check_samples,
    report_degenerate,
)
from kwng.jacobians import jacobian_from_sampler
from kwng.kernels import Kernel
from kwng.solve import default_rcond

__all__ = [
    "FISHER_JACOBIANS",
    "fisher_kernel_matrices",
    "fisher_jacobian_from_scores",
    "kfng_gradient",
    "kernel_fisher_metric",
    "fisher_brute_force",
]

log = logging.getLogger(__name__)

FISHER_JACOBIANS = ("reparam", "score")
Sampler = Callable[[torch.Tensor], torch.Tensor]


# --------------------------------------------------------------------------------------
# The estimator
# --------------------------------------------------------------------------------------
def fisher_kernel_matrices(
    X: torch.Tensor, basis_idx: torch.Tensor, kernel: Kernel
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The matrices of the kernel Fisher estimator at the samples ``X`` (``N × d``).

    Returns ``C`` (``M × N``, centred kernel values ``k(Y_m, X_n) - mean_n k(Y_m,
    X_n)``), ``K`` (``M × M`` Gram ``k(Y_m, Y_m')``), ``CCᵀ`` (without the ``1/N``) and
    ``Gx`` (``M × N × d``, ``∂_{x_j} k(Y_m, X_n)``, the ingredient of the reparametrised
    ``T``). ``X`` is detached and promoted to float64 (at least), as in
    :func:`kwng.kernel_matrices`: the four come back in float64, so float32 samples lose
    nothing more than their own rounding.
    """
    X = check_points(X, "X").detach()
    X = X.to(torch.promote_types(X.dtype, torch.float64))
    idx = torch.as_tensor(basis_idx).to(X.device)
    Y = X[idx]
    values = kernel(Y, X)
    C = values - values.mean(1, keepdim=True)
    K = kernel(Y, Y)
    K = 0.5 * (K + K.T)
    Gx = -kernel.grad(
        Y, X
    )  # kernel.grad differentiates in the first argument; r = y - x
    return C, K, C @ C.T, Gx


def fisher_jacobian_from_scores(C: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """``T = C S / N`` from the centred kernel values ``C`` (``M × N``) and the scores
    ``S`` (``N × q``, ``S[n] = ∇_θ log ρ_θ(X_n)``): the score-function form of
    ``∇_θ E k(Y_m, X)``.

    With this ``T`` the range of ``T`` lies in the range of ``C`` exactly, which makes
    the stable form equal to the plain one even when ``CCᵀ`` is singular (the chapter's
    Proposition)."""
    if C.dim() != 2 or S.dim() != 2 or C.shape[1] != S.shape[0]:
        raise ValueError(
            f"C must be (M, N) and S (N, q) with the same N, got {tuple(C.shape)} "
            f"and {tuple(S.shape)}"
        )
    return C @ S.to(C.dtype) / C.shape[1]


def _check_kfng_args(theta, grad, eps, lam, jacobian, kernel, score_fn) -> None:
    """The argument checks of :func:`kfng_gradient` that need no samples."""
    if not isinstance(theta, torch.Tensor) or theta.dim() != 1:
        raise ValueError("theta must be a 1-d torch.Tensor (the flat parameter vector)")
    check_grad(grad, theta.numel())
    check_positive(eps, "eps")
    check_positive(lam, "lam", allow_zero=True)
    check_choice(jacobian, "jacobian", FISHER_JACOBIANS)
    if not isinstance(kernel, Kernel):
        raise ValueError(f"kernel must be a kwng.Kernel, got {type(kernel).__name__}")
    if jacobian == "score" and score_fn is None:
        raise ValueError("jacobian='score' needs score_fn(theta, X) -> (N, q) scores")


def _fisher_jacobian(jacobian, sampler, score_fn, theta, X, C, Gx) -> torch.Tensor:
    """``T = ∇_θ τ(θ)`` of :func:`kfng_gradient`, by ``jacobian`` (reparam or score)."""
    N = X.shape[0]
    if jacobian == "reparam":
        T = jacobian_from_sampler(sampler, theta.detach(), Gx)
    else:
        S = score_fn(theta.detach(), X.detach())
        if not isinstance(S, torch.Tensor) or S.shape != (N, theta.numel()):
            raise ValueError(
                f"score_fn must return a tensor of shape ({N}, {theta.numel()})"
            )
        T = fisher_jacobian_from_scores(C, S)
    return T


def kfng_gradient(
    sampler: Sampler,
    theta: torch.Tensor,
    grad: torch.Tensor,
    *,
    num_basis: int,
    eps: float,
    lam: float = 0.0,
    kernel: Kernel,
    damping: str = "T_tilde",
    method: str = "stable",
    jacobian: str = "reparam",
    score_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    generator: torch.Generator | None = None,
    basis_idx: torch.Tensor | None = None,
    rcond: float | None = None,
    bandwidth: float | str | None = None,
    sigma0: float = 1.0,
) -> KWNGResult:
    """Kernel estimate of the Fisher–Rao natural gradient ``G_F(θ)⁻¹ ∇L(θ)`` (beyond the
    paper).

    Same call as :func:`kwng.kwng_gradient`: ``sampler`` maps ``theta`` (``(q,)``) to
    samples ``X = h_θ(Z)`` (``N × d``), ``grad`` is the Euclidean gradient,
    ``num_basis`` = ``M``, ``eps`` = ``ε > 0``, ``lam`` = ``λ >= 0``, ``damping`` =
    ``D(θ)``, ``method`` plain or stable, ``bandwidth``/``sigma0`` the bandwidth rule.
    The basis points come from :func:`kwng.draw_basis` with the same ``generator``
    stream as the Wasserstein estimator (so both use the same ``Y_m``), or from
    ``basis_idx``.

    ``jacobian`` picks how ``T = ∇_θ τ(θ)``, ``τ_m = (1/N) Σ_n k(Y_m, X_n)``, is
    computed: ``"reparam"`` differentiates through the sampler (any implicit model, as
    in the paper's eq. (14)); ``"score"`` uses ``T = C S / N`` with
    ``S = score_fn(theta, X)`` (``N × q``), which needs a density. ``diagnostics`` holds
    what :func:`kwng.nystrom_solve` reports plus ``range_residual``:
    ``‖(I - P_C) T‖_F / ‖T‖_F``, the part of ``T`` outside the range of ``C`` (0 for
    ``"score"``; small for a model with a density; large where there is none).
    """
    _check_kfng_args(theta, grad, eps, lam, jacobian, kernel, score_fn)
    with torch.no_grad():
        X = sampler(theta.detach())
    X, resolution = check_samples(X)  # the rules of kwng_gradient
    N, d = X.shape
    basis_idx, _ = check_basis(basis_idx, None, N, d, num_basis,
                               lambda: draw_basis(N, d, num_basis, generator),
                               with_coords=False)
    kernel = with_bandwidth(kernel, X, basis_idx, bandwidth, sigma0)
    C, K, CCt, Gx = fisher_kernel_matrices(X, basis_idx, kernel)  # float64
    T = _fisher_jacobian(jacobian, sampler, score_fn, theta, X, C, Gx)
    res = nystrom_solve(T, CCt, K, grad.to(T.dtype), N, eps=eps, lam=lam,
                        damping=damping, method=method, rcond=rcond)
    res.direction = res.direction.to(grad.dtype)
    res.diagnostics.update(
        d=d, bandwidth=kernel.bandwidth, kernel=repr(kernel), basis_idx=basis_idx,
        jacobian=jacobian, range_residual=_range_residual(T, CCt, rcond),
        sample_resolution=resolution,
    )
    report_degenerate(res.diagnostics, res.direction, grad, "kfng_gradient")
    return res


def _range_residual(T: torch.Tensor, CCt: torch.Tensor, rcond: float | None) -> float:
    """``‖(I - P)T‖_F / ‖T‖_F`` with ``P`` the projector on the eigenvectors of ``CCᵀ``
    kept by the stable solve (eigenvalues above ``rcond · max``)."""
    M = CCt.shape[0]
    rcond = default_rcond(M, CCt.dtype) if rcond is None else rcond
    S, U = torch.linalg.eigh(CCt.to(torch.float64))
    Ur = U[:, S > rcond * S.max().clamp(min=0)]
    T64 = T.to(torch.float64)
    nT = float(torch.linalg.matrix_norm(T64))
    if nT == 0:
        return 0.0
    return float(torch.linalg.matrix_norm(T64 - Ur @ (Ur.T @ T64))) / nT


def kernel_fisher_metric(
    T: torch.Tensor, CCt: torch.Tensor, K: torch.Tensor, N: int, *, lam: float = 0.0
) -> torch.Tensor:
    """The kernel Fisher information ``Ĝ_F = Tᵀ (CCᵀ/N + λK)† T`` (``q × q``).

    The value of the restricted dual with the sup over ``f`` taken first: ``½ uᵀĜ_F u =
    max_α αᵀT u - ½ αᵀ(CCᵀ/N + λK)α``. The estimator equals ``(εD + Ĝ_F)⁻¹ ∇L`` when
    ``CCᵀ/N + λK`` is invertible (the saddle problem solved in the other order)."""
    N = check_int(N, "N", 1)
    lam = check_positive(lam, "lam", allow_zero=True)
    A = CCt.to(torch.float64) / N + lam * K.to(torch.float64)
    T64 = T.to(torch.float64)
    return T64.T @ torch.linalg.pinv(A, hermitian=True) @ T64


def _basis_features(Y: torch.Tensor, kernel: Kernel):
    """The feature map of :func:`fisher_brute_force`: row ``x`` to ``(k(Y_m, x))_m``."""
    from kwng.kernels import GaussianKernel

    def features(Xs: torch.Tensor) -> torch.Tensor:  # (n, M): k(Y_m, x) for each row x
        sq = ((Xs[:, None, :] - Y[None, :, :]) ** 2).sum(-1)
        if isinstance(kernel, GaussianKernel):
            return torch.exp(-sq / (2.0 * kernel.bandwidth))
        return kernel(Y, Xs).T

    return features


def fisher_brute_force(
    sampler: Sampler,
    theta: torch.Tensor,
    grad: torch.Tensor,
    basis_idx: torch.Tensor,
    *,
    eps: float,
    lam: float,
    kernel: Kernel,
    damping: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The restricted Fisher dual solved by brute force, independently of
    :func:`kfng_gradient`.

    The function ``f_α = Σ_m α_m k(Y_m, ·)`` is evaluated explicitly
    (``exp(-‖y - x‖²/(2σ))`` for a :class:`kwng.GaussianKernel`, else the kernel's own
    values), ``τ(θ) = mean_n f_α(h_θ(Z_n))`` is differentiated with
    ``torch.func.jacfwd``, the empirical objective

        ``Ĵ(α) = Var_N f_α + λ‖f_α‖²_H + (1/ε)(∇L + Tᵀα)ᵀD⁻¹(∇L + Tᵀα)``

    is minimised by a least-squares solve of its normal equations, and the direction is
    ``(1/ε) D⁻¹(∇L + Tᵀα*)`` (the minimax exchange). A second route solves the saddle
    problem in the other order: ``(εD + Ĝ_F)⁻¹ ∇L`` with ``Ĝ_F`` from
    :func:`kernel_fisher_metric`. Returns both directions. ``damping`` is the diagonal
    of ``D`` (default ``1``).
    """
    eps = check_positive(eps, "eps")
    lam = check_positive(lam, "lam", allow_zero=True)
    theta = theta.detach().to(torch.float64)
    g = grad.detach().to(torch.float64)
    q = theta.numel()
    Dv = (
        torch.ones(q, dtype=torch.float64)
        if damping is None
        else damping.to(torch.float64)
    )
    with torch.no_grad():
        X = sampler(theta).to(torch.float64)
    N = X.shape[0]
    Y = X[torch.as_tensor(basis_idx)]
    features = _basis_features(Y, kernel)
    tau = lambda t: features(sampler(t).to(torch.float64)).mean(0)  # noqa: E731
    T = torch.func.jacfwd(tau)(theta)  # (M, q)
    F = features(X)  # (N, M)
    Fc = F - F.mean(0, keepdim=True)
    V = Fc.T @ Fc / N  # Var_N f_α = αᵀVα
    K = features(Y)
    K = 0.5 * (K + K.T)
    H = V + lam * K + (T / Dv) @ T.T / eps
    rhs = -(T / Dv) @ g / eps
    alpha = torch.linalg.lstsq(H, rhs[:, None], driver="gelsd").solution[:, 0]
    direction_dual = (g + T.T @ alpha) / (eps * Dv)
    G = kernel_fisher_metric(T, Fc.T @ Fc, K, N, lam=lam)
    direction_metric = torch.linalg.solve(eps * torch.diag(Dv) + G, g)
    return direction_dual, direction_metric


