"""Reference computations of the chapters on the RKHS saddle problem, the Nyström
estimator and consistency (companion of :mod:`kwng.theory.wng`).

The kernelized WNG in the full span of ``∂_i k(X_n, ·)`` (Prop. 4, §3.1), the
full-derivative subspace (22) of Sutherland et al., Prop. 6 (27) as printed, and the
cost model and rates of §3.3 and App. C.3. The map from the paper to the code is in
:mod:`kwng.theory.wng`'s docstring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kwng._checks import check_choice, check_int, check_points, check_positive
from kwng.estimator import KWNGResult, kernel_matrices, nystrom_solve
from kwng.jacobians import jacobian_from_sampler
from kwng.kernels import Kernel
from kwng.theory.wng import Sampler, sampler_jacobian


# --------------------------------------------------------------------------------------
# Chapter "The RKHS saddle problem" (§3.1)
# --------------------------------------------------------------------------------------
@dataclass
class BruteForceKWNG:
    """Three computations of the kernelized WNG in the *full* span of ``∂_i k(X_n, ·)``.

    * ``direction_dual``: Prop. 4, eq. (19)–(21): ``(1/ε) Û(f*)`` with ``f*`` the
      minimiser of the empirical objective ``Ĵ`` (eq. (21)), from the ``Nd × Nd`` normal
      equations for ``α``;
    * ``direction_closed``: the closed form of Prop. 5, eq. (25) (or its stable form
      (27)), with ``C = K`` the full ``Nd × Nd`` Gram of kernel derivatives (no Nyström
      subspace);
    * ``direction_metric``: the saddle problem (18) solved in the other order (sup over
      ``f`` first): ``(εI + Ĝ)⁻¹ ∇L`` with the kernel metric ``Ĝ = (1/N) Bᵀ V diag(s/(s
      + Nλ)) Vᵀ B`` where ``K = V diag(s) Vᵀ`` and ``B`` is the sampler Jacobian (eq.
      (41) with ``M = Nd``).

    ``alpha`` holds the coefficients of ``f*`` (shape ``(N, d)``), ``metric`` is ``Ĝ``.
    """

    direction_dual: torch.Tensor
    direction_closed: torch.Tensor
    direction_metric: torch.Tensor
    metric: torch.Tensor
    alpha: torch.Tensor


def rkhs_brute_force(sampler: Sampler, theta: torch.Tensor, grad: torch.Tensor, *,
                     eps: float, lam: float, kernel: Kernel, method: str = "stable",
                     rcond: float = 1e-13) -> BruteForceKWNG:
    """Solve the regularised RKHS problem of §3.1 with the full basis ``{∂_i k(X_n,
    ·)}``, ``n ≤ N``, ``i ≤ d`` (``Nd`` functions, no Nyström), in three independent
    ways (see :class:`BruteForceKWNG`).

    ``eps`` = ``ε > 0``, ``lam`` = ``λ >= 0``, ``grad`` the Euclidean gradient, ``D(θ) =
    I``; ``method`` picks the plain (Prop. 5) or stable (Prop. 6) form of the
    closed-form route. Cost ``O((Nd)³)``: keep ``N d`` below a few hundred.
    ``rcond`` drops eigenvalues of the Gram below ``rcond · max`` in the metric route.
    """
    eps = check_positive(eps, "eps")
    lam = check_positive(lam, "lam", allow_zero=True)
    if not isinstance(kernel, Kernel):
        raise ValueError(f"kernel must be a kwng.Kernel, got {type(kernel).__name__}")
    B = sampler_jacobian(sampler, theta).to(torch.float64)  # (N, d, q)
    N, d, q = B.shape
    if grad.shape != (q,):
        raise ValueError(f"grad must have shape ({q},), got {tuple(grad.shape)}")
    with torch.no_grad():
        X = sampler(theta.detach()).to(torch.float64)
    check_choice(method, "method", ("stable", "plain"))
    Dv = torch.ones(q, dtype=torch.float64)
    g = grad.to(torch.float64)
    # Gram of the basis: K[(n,i),(n',j)] = ∂_i ∂_{j+d} k(X_n, X_n') = <∂_i k(X_n,·), ∂_j
    # k(X_n',·)>_H
    K = kernel.mixed(X, X).permute(0, 2, 1, 3).reshape(N * d, N * d)
    K = 0.5 * (K + K.T)
    Bf = B.reshape(N * d, q)
    T = K @ Bf / N  # R(f) = Tᵀα: eq. (21)'s (1/N) Σ_n ∇h(Z_n)ᵀ ∇f(X_n)
    # (1) Prop. 4: minimise Ĵ(α) = (1/N)αᵀK²α + (1/ε)(g + Tᵀα)ᵀD⁻¹(g + Tᵀα) + λαᵀKα
    H = K @ K / N + lam * K + (T / Dv) @ T.T / eps
    rhs = -(T / Dv) @ g / eps
    alpha = torch.linalg.lstsq(H, rhs[:, None], rcond=None,
                               driver="gelsd").solution[:, 0]
    direction_dual = (g + T.T @ alpha) / (eps * Dv)
    # (2) Props. 5/6 closed form with C = K (all Nd functions), via the library's solver
    closed = nystrom_solve(T, K @ K, K, g, N, eps=eps, lam=lam, damping="identity",
                           method=method, diagnostics=False).direction
    # (3) sup over f first: the kernel metric Ĝ, then the q × q system
    s, V = torch.linalg.eigh(K)
    keep = s > rcond * s.max()
    s, V = s[keep], V[:, keep]
    VB = V.T @ Bf
    Ghat = (VB.T * (s / (s + N * lam))) @ VB / N
    direction_metric = torch.linalg.solve(eps * torch.diag(Dv) + Ghat, g)
    return BruteForceKWNG(
        direction_dual, closed, direction_metric, Ghat, alpha.reshape(N, d)
    )


# --------------------------------------------------------------------------------------
# Chapter "The Nyström estimator" (§3.2–3.3)
# --------------------------------------------------------------------------------------
def full_derivative_basis(
    basis_idx: torch.Tensor, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Index pairs of the subspace (22) of Sutherland et al.: every coordinate ``i =
    0..d-1`` of every basis point ``Y_m = X_{basis_idx[m]}`` (``M d`` functions ``∂_i
    k(Y_m, ·)``).

    Returns ``(idx, coords)`` of length ``M d`` usable by :func:`kwng.kernel_matrices`.
    """
    d = check_int(d, "d", 1)
    basis_idx = torch.as_tensor(basis_idx)
    if basis_idx.dim() != 1 or basis_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError("basis_idx must be a 1-d integer tensor")
    M = basis_idx.shape[0]
    return basis_idx.repeat_interleave(d), torch.arange(d).repeat(M)


def sutherland_kwng_gradient(sampler: Sampler, theta: torch.Tensor, grad: torch.Tensor,
                             *, num_points: int, eps: float, lam: float = 0.0,
                             kernel: Kernel, damping: str = "T_tilde",
                             method: str = "stable",
                             generator: torch.Generator | None = None,
                             basis_idx: torch.Tensor | None = None,
                             rcond: float | None = None) -> KWNGResult:
    """KWNG restricted to the full-derivative Nyström subspace (22) of Sutherland et al.
    (2018): ``M = num_points`` basis points, all ``d`` partial derivatives each (``M d``
    basis functions).

    Same algebra as Props. 5/6 (:func:`kwng.nystrom_solve`) with the rows of ``C``,
    ``K``, ``T`` indexed by pairs ``(m, i)``. With ``num_points = N`` this is the
    brute-force RKHS solution (:func:`rkhs_brute_force`). Its cost is ``O(d³NM² + qd²M²
    + d³M³)``: the one-coordinate subspace of the paper with ``M' = M d`` basis points
    has the same system size.
    """
    if not isinstance(theta, torch.Tensor) or theta.dim() != 1:
        raise ValueError("theta must be a 1-d torch.Tensor (the flat parameter vector)")
    if grad.shape != theta.shape:
        raise ValueError(
            f"grad must have the shape of theta {tuple(theta.shape)}, got "
            f"{tuple(grad.shape)}"
        )
    if not isinstance(kernel, Kernel):
        raise ValueError(f"kernel must be a kwng.Kernel, got {type(kernel).__name__}")
    with torch.no_grad():
        X = check_points(sampler(theta), "sampler(theta)")
    N, d = X.shape
    num_points = check_int(num_points, "num_points", 1, N)
    if basis_idx is None:
        basis_idx = torch.randperm(N, generator=generator)[:num_points]
    basis_idx = torch.as_tensor(basis_idx)
    if basis_idx.shape != (num_points,):
        raise ValueError(
            f"basis_idx must have shape ({num_points},) = (num_points,), got "
            f"{tuple(basis_idx.shape)}"
        )
    idx, coords = full_derivative_basis(basis_idx, d)
    C, K, CCt = kernel_matrices(X, idx, coords, kernel)
    T = jacobian_from_sampler(sampler, theta.detach(), C)
    res = nystrom_solve(
        T,
        CCt,
        K,
        grad.to(T.dtype),
        N,
        eps=eps,
        lam=lam,
        damping=damping,
        method=method,
        rcond=rcond,
    )
    res.diagnostics.update(d=d, basis_idx=basis_idx, num_functions=num_points * d)
    return res


def stable_as_printed(T: torch.Tensor, CCt: torch.Tensor, grad: torch.Tensor, N: int, *,
                      eps: float, rcond: float = 1e-12) -> torch.Tensor:
    """Prop. 6, eq. (27), *as printed* in the paper, with ``D = I`` and ``λ = 0``:
    ``T̃ = S†UᵀT`` and ``P = S†S`` where ``CCᵀ = USUᵀ``.

    Kept to show (book chapter "The Nyström estimator") that this differs from Prop. 5
    in general; the equality needs ``T̃ = S^{-1/2}UᵀT`` (what :func:`kwng.nystrom_solve`
    does).
    """
    eps = check_positive(eps, "eps")
    N = check_int(N, "N", 1)
    S, U = torch.linalg.eigh(CCt.to(torch.float64))
    Sd = torch.where(S > rcond * S.max(), 1.0 / S, torch.zeros_like(S))
    Tt = (Sd[:, None] * U.T) @ T.to(torch.float64)
    P = torch.diag(Sd * S)
    A = Tt @ Tt.T + (eps / N) * P
    g = grad.to(torch.float64)
    return (g - Tt.T @ (torch.linalg.pinv(A, hermitian=True) @ (Tt @ g))) / eps


def predicted_cost(N: int, M: int, d: int, q: int) -> float:
    """Leading flop count ``d N M² + q M² + M³`` of the estimator (§3.3)."""
    return float(d * N * M * M + q * M * M + M ** 3)


def loglog_slope(x, y) -> float:
    """Least-squares slope of ``log y`` against ``log x`` (both positive)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or x.size < 2:
        raise ValueError("x and y must be 1-d arrays of the same length >= 2")
    if not (np.all(x > 0) and np.all(y > 0)):
        raise ValueError("x and y must be positive for a log-log slope")
    return float(np.polyfit(np.log(x), np.log(y), 1)[0])


# --------------------------------------------------------------------------------------
# Chapter "Consistency" (§3.4, App. C.3)
# --------------------------------------------------------------------------------------
def well_specified_b(alpha: float) -> float:
    """``b = min(1, α + ½)`` of the well-specified theorem (App. C.3), ``α >= 0`` the
    smoothness."""
    return min(1.0, check_positive(alpha, "alpha", allow_zero=True) + 0.5)


def misspecified_b(c: float) -> float:
    """``b = 1/(2 + c)`` of Theorem 7, ``c >= 0`` the approximation-complexity exponent
    (eq. (28))."""
    return 1.0 / (2.0 + check_positive(c, "c", allow_zero=True))


def predicted_rate(b: float) -> float:
    """Exponent ``r`` of ``‖ĝ − ∇^W L‖ = O(N^{-r})``: ``r = b/(2b + 1)`` (App. C.3,
    Prop. on consistency).

    The theorems state the squared norm, ``O(N^{-2b/(2b+1)})``; the norm decays at half
    that rate.
    """
    b = check_positive(b, "b")
    if b > 1:
        raise ValueError(f"b must be in (0, 1], got {b}")
    return b / (2 * b + 1)


def theory_schedule(N: int, d: int, b: float, *, c_M: float = 1.0, c_lam: float = 1.0,
                    c_eps: float = 1.0) -> dict:
    """Hyper-parameters of the consistency theorems for ``N`` samples in dimension
    ``d``: ``M = ⌈c_M d N^{1/(2b+1)} log N⌉`` (capped at ``N``), ``λ = c_lam
    N^{-1/(2b+1)}`` and ``ε = c_eps N^{-b/(2b+1)}``. Returns ``{"num_basis", "lam",
    "eps"}``.
    """
    N = check_int(N, "N", 2)
    d = check_int(d, "d", 1)
    b = check_positive(b, "b")
    e = 1.0 / (2 * b + 1)
    M = min(N, int(math.ceil(check_positive(c_M, "c_M") * d * N ** e * math.log(N))))
    return {
        "num_basis": M,
        "lam": check_positive(c_lam, "c_lam", allow_zero=True) * N ** (-e),
        "eps": check_positive(c_eps, "c_eps") * N ** (-b * e),
    }
