"""The linear algebra of Props. 5 and 6, once, on tensors with optional batch
dimensions.

Arbel, Gretton, Li & Montúfar (ICLR 2020), §3.2–3.3. Every caller of the estimator goes
through this module: the validated :func:`kwng.nystrom_solve` (host-side diagnostics),
the sync-free :func:`kwng.estimator.nystrom_solve_nosync` of the preconditioner, the
batched synthetic sweeps of the studies (``studies/toy/batched.py``) and the Fisher–Rao
estimator of ``kwng.fisher``. The functions here do not validate their inputs (the
callers do) and never wait for the device, except where a function says so.

Shapes: ``T`` is ``(..., M, q)``, ``CCt`` and ``K`` are ``(..., M, M)``, ``grad`` is
``(..., q)``; the leading dimensions ``...`` (runs of a sweep) may be empty. Symbols:
``M`` = ``num_basis``, ``ε`` = ``eps``, ``λ`` = ``lam``, ``D(θ)`` = the damping vector.

The steps of :func:`kwng_direction`:

1. whitening ``W`` with ``W CCᵀ Wᵀ = I`` on the kept subspace
   (:func:`eig_whitening`, the form of Prop. 6, or :func:`cholesky_whitening`, equal up
   to an orthogonal factor);
2. the damping vector ``D`` with a relative floor (:func:`damping_diagonal`; its
   validated public form is :func:`kwng.estimator.damping_vector`);
3. the plain (Prop. 5, :func:`plain_solve`) or stable (Prop. 6, :func:`stable_solve`)
   system, whose solution gives the correction ``T̃ᵀ w``;
4. the combination ``ĝ = (D⁻¹∇L - D⁻¹ T̃ᵀ w) / ε`` (:func:`combine`) and the
   treatment of degenerate columns (:func:`loss_only_columns`).

A training step then applies :func:`safeguard` (the Euclidean gradient where ``ĝ`` is
not a descent direction, then the clipping): :func:`kwng_direction` followed by
:func:`safeguard` is the one definition of the step's direction, which every fast path
(compiled or hand-written kernels) must reproduce.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

__all__ = ["DAMPINGS", "SOLVE_METHODS", "WHITENINGS", "DAMPING_FLOOR", "default_rcond",
           "eig_whitening", "cholesky_whitening", "damping_diagonal", "stable_solve",
           "plain_solve", "combine", "loss_only_columns", "kwng_direction", "Direction",
           "safeguard", "Safeguarded", "FALLBACKS"]

log = logging.getLogger(__name__)

DAMPINGS = ("identity", "T", "T_tilde")
#: the ``method`` of :func:`kwng.estimator.nystrom_solve`: the stable form of Prop. 6 or
#: the plain form of Prop. 5
SOLVE_METHODS = ("stable", "plain")
#: ``"eig"``: ``S^{-1/2}Uᵀ`` with dropped eigenvalues as zero rows (any batch shape);
#: ``"eig_truncate"``: the same with the dropped rows removed (one problem, smaller
#: system); ``"cholesky"``: ``L⁻¹`` with a regularised ``CCᵀ`` (no host sync).
WHITENINGS = ("eig", "eig_truncate", "cholesky")
#: a failed direction in :func:`safeguard`: ``g`` (the authors' code) or no step
FALLBACKS = ("gradient", "skip")
DAMPING_FLOOR = (
    1e-12  # relative: columns below this fraction of the largest are degenerate
)
_F64 = torch.float64


def default_rcond(M: int, dtype: torch.dtype) -> float:
    """``M ·`` the machine epsilon of ``dtype``: the default relative eigenvalue
    threshold."""
    return M * torch.finfo(dtype).eps


def _mv(A: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``A x`` over batch dimensions (a plain matrix-vector product when unbatched)."""
    return A @ x if A.dim() == 2 else (A @ x[..., None])[..., 0]


def eig_whitening(
    CCt: torch.Tensor, rcond: float, truncate: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``W = S^{-1/2} Uᵀ`` from ``CCᵀ = U S Uᵀ`` (float64), the whitening of Prop. 6.

    Eigenvalues at most ``rcond`` times the largest are dropped: their rows of ``W`` are
    zero (the reduced system of Prop. 6 then sits in a block of the ``M × M`` one whose
    other block is ``(ε/N) I`` with a zero right-hand side, so the solution is the
    same), or, with ``truncate=True`` (unbatched ``CCt`` only; syncs with the host),
    removed. Returns ``(W, keep, S)`` with ``keep`` the mask of kept eigenvalues and
    ``S`` all of them.
    """
    S, U = torch.linalg.eigh(CCt.to(_F64))
    keep = S > rcond * S.max(-1, keepdim=True).values.clamp(min=0)
    if truncate:
        if CCt.dim() != 2:
            raise ValueError(
                "eig_whitening: truncate=True needs one CCt matrix, not a batch"
            )
        return (U[:, keep] / S[keep].sqrt()).T, keep, S
    inv_sqrt = torch.where(
        keep, S.clamp(min=torch.finfo(_F64).tiny).rsqrt(), torch.zeros_like(S)
    )
    return (U * inv_sqrt[..., None, :]).mT, keep, S


def cholesky_whitening(
    CCt: torch.Tensor, rcond: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``W = L⁻¹`` from ``CCᵀ = L Lᵀ`` (float64, no host sync).

    ``L⁻¹ = Q S^{-1/2} Uᵀ`` for an orthogonal ``Q``, and the estimator and the column
    norms of ``T̃`` are invariant under ``T̃ → Q T̃``, so this is the whitening of Prop.
    6. A nearly singular ``CCᵀ`` (a pivot at most ``rcond`` times the largest, or a
    failed factorisation) is regularised to ``CCᵀ + μ I`` with ``μ = rcond · max diag
    CCᵀ`` instead of truncated.
    Returns ``(W, ok, rank)``: ``ok`` is False where the regularisation was used,
    ``rank`` counts the pivots above the threshold.
    """
    A0 = CCt.to(_F64)
    eye = torch.eye(A0.shape[-1], dtype=_F64, device=A0.device)
    L, info = torch.linalg.cholesky_ex(A0)
    diag_max = A0.diagonal(dim1=-2, dim2=-1).amax(-1)
    mu = rcond * diag_max.clamp(min=torch.finfo(_F64).tiny)
    Lj, _ = torch.linalg.cholesky_ex(A0 + mu[..., None, None] * eye)
    piv = L.diagonal(dim1=-2, dim2=-1) ** 2
    ok = (
        (info == 0)
        & torch.isfinite(piv).all(-1)
        & (piv.amin(-1) > rcond * piv.amax(-1))
    )
    L = torch.where(ok[..., None, None], L, Lj)
    piv_used = L.diagonal(dim1=-2, dim2=-1) ** 2
    rank = (piv_used > rcond * piv_used.amax(-1, keepdim=True)).sum(-1)
    W = torch.linalg.solve_triangular(L, eye.expand_as(L), upper=False)
    return W, ok, rank


def damping_diagonal(
    kind: str,
    T: torch.Tensor,
    T_tilde: torch.Tensor | None = None,
    floor: float = DAMPING_FLOOR,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Diagonal ``D(θ)`` of §3.3: ``1``, ``‖T_{·,i}‖`` or ``‖T̃_{·,i}‖`` (no host sync).

    Each norm is raised to at least ``floor`` times the largest one of its problem (a
    relative floor, ``DAMPING_FLOOR``); if every column is zero, ``D = 1``. Returns
    ``(D, low, zero)``: ``low`` marks the floored (degenerate) columns, treated by
    :func:`loss_only_columns` so the floor value never sets a component of the
    direction, and ``zero`` the exactly-zero columns (parameters the samples do not
    depend on).
    """
    if kind not in DAMPINGS:
        raise ValueError(f"damping must be one of {DAMPINGS}, got {kind!r}")
    if kind == "identity":
        shape = T.shape[:-2] + T.shape[-1:]
        none = torch.zeros(shape, dtype=torch.bool, device=T.device)
        return torch.ones(shape, dtype=T.dtype, device=T.device), none, none
    if kind == "T":
        src = T
    elif kind == "T_tilde":
        if T_tilde is None:
            raise ValueError("damping 'T_tilde' needs T_tilde (the whitened block)")
        src = T_tilde
    else:  # a name of DAMPINGS without its branch here is never computed as another
        raise ValueError(f"damping {kind!r} has no definition in damping_diagonal")
    # Two reductions of the same norm, kept so that the committed results reproduce bit
    # for bit on the same device (the sweeps at ε = 1e-10 amplify one ulp to a few per
    # cent): one problem as the estimator always did (an einsum here becomes q tiny gemv
    # calls), batches as the synthetic sweeps did.
    if src.dim() == 2:
        norms = (src * src).sum(-2).sqrt()
    else:
        norms = torch.linalg.vector_norm(src, dim=-2)
    low = floor * norms.amax(-1, keepdim=True)
    low = torch.where(low > 0, low, torch.ones_like(low))  # all columns zero: D = 1
    return torch.maximum(norms, low), norms < low, norms == 0


def stable_solve(
    Tt: torch.Tensor,
    Dinv: torch.Tensor,
    Dg: torch.Tensor,
    eps: float | torch.Tensor,
    N: int,
    *,
    lam: float = 0.0,
    W: torch.Tensor | None = None,
    K: torch.Tensor | None = None,
    fallback: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prop. 6: ``w = (T̃ D⁻¹ T̃ᵀ + λε W K Wᵀ + (ε/N) I)⁻¹ T̃ D⁻¹ ∇L``; returns ``T̃ᵀ
    w``.

    ``Tt = W T`` (``(..., r, q)``), ``Dinv = D⁻¹`` and ``Dg = D⁻¹∇L`` (``(..., q)``).
    The ``r × r`` system is assembled and solved in float64 by Cholesky. It is positive
    definite in exact arithmetic (``ε > 0``); if round-off breaks that and ``fallback``
    is True, the system is solved by least squares (logged; syncs with the host to find
    out); with ``fallback=False`` (no host sync) a failed factorisation gives no
    solution: its correction is NaN, so the direction is not finite and
    :func:`safeguard` replaces it by the Euclidean gradient. Returns the correction
    (dtype of ``Tt``), the system ``A`` and a mask of failed factorisations.
    """
    eye = torch.eye(Tt.shape[-2], dtype=_F64, device=Tt.device)
    A = ((Tt * Dinv[..., None, :]) @ Tt.mT).to(_F64) + (eps / N) * eye
    if lam > 0:
        A = A + lam * eps * (W @ K.to(_F64) @ W.mT)
    v = _mv(Tt, Dg).to(_F64)
    L, info = torch.linalg.cholesky_ex(A)
    failed = info != 0
    if fallback and bool(failed.any()):
        log.warning("stable KWNG system not positive definite in float64; using lstsq")
        w = torch.linalg.lstsq(A, v[..., None]).solution
    else:
        w = torch.cholesky_solve(v[..., None], L)
        if not fallback:  # a failed factor's "solution" is not one: mark it NaN
            w = torch.where(failed[..., None, None], torch.nan, w)
    w = w.to(Tt.dtype)  # (..., r, 1); the product below keeps its layout (bit-stable)
    correction = Tt.T @ w[:, 0] if Tt.dim() == 2 else (Tt.mT @ w)[..., 0]
    return correction, A, failed


def plain_solve(
    T: torch.Tensor,
    Dinv: torch.Tensor,
    Dg: torch.Tensor,
    CCt: torch.Tensor,
    K: torch.Tensor,
    eps: float,
    N: int,
    lam: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prop. 5: ``w = (T D⁻¹ Tᵀ + λεK + (ε/N) CCᵀ)† T D⁻¹ ∇L`` (pseudo-inverse,
    float64); returns the correction ``Tᵀ w`` and the system."""
    T64 = T.to(_F64)
    A = (
        (T64 * Dinv[..., None, :]) @ T64.mT
        + lam * eps * K.to(_F64)
        + (eps / N) * CCt.to(_F64)
    )
    w = _mv(torch.linalg.pinv(A, hermitian=True), _mv(T64, Dg))
    return _mv(T64.mT, w), A


def combine(
    Dg: torch.Tensor,
    Dinv: torch.Tensor,
    correction: torch.Tensor,
    eps: float | torch.Tensor,
) -> torch.Tensor:
    """``ĝ = (D⁻¹∇L - D⁻¹ T̃ᵀ w) / ε``, the closing line of Props. 5 and 6.

    The two terms nearly cancel (their difference is ``ε`` times smaller than each):
    pass them in float64 unless the caller accepts the rounding of a narrower dtype."""
    if isinstance(eps, torch.Tensor):
        eps = eps.to(Dg.dtype)
    return (Dg - Dinv * correction) / eps


def loss_only_columns(
    direction: torch.Tensor, grad: torch.Tensor, degenerate: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Treatment of the columns where the estimated metric is degenerate: parameters
    that move the loss but not the samples (a zero column of ``T``), and columns whose
    norm is below the relative floor (``DAMPING_FLOOR`` of the largest).

    There the natural-gradient component is unbounded, and ``(D⁻¹ g)_i / ε`` with a
    floored ``D_i`` would be set by the floor constant, not by the data. The component
    is instead the Euclidean gradient scaled like the rest of the direction, ``ĝ_i = g_i
    · ‖ĝ_rest‖ / ‖g_rest‖``, so no constant can dominate the update. Returns the
    direction and how many components were replaced per problem (components with a zero
    gradient stay at zero).
    """
    hit = degenerate & (grad != 0)
    rest = ~degenerate
    tiny = torch.finfo(grad.dtype).tiny
    num = torch.linalg.vector_norm(
        torch.where(rest, direction, 0), dim=-1, keepdim=True
    )
    den = torch.linalg.vector_norm(torch.where(rest, grad, 0), dim=-1, keepdim=True)
    return torch.where(hit, grad * (num / den.clamp(min=tiny)), direction), hit.sum(-1)


class Direction(NamedTuple):
    """What :func:`kwng_direction` returns: the direction and tensors describing the
    solve."""

    direction: torch.Tensor
    rank: torch.Tensor
    system: torch.Tensor | None
    failed: torch.Tensor
    floored: torch.Tensor
    floored_share: torch.Tensor
    loss_only: torch.Tensor
    whitening_ok: torch.Tensor
    eigenvalues: torch.Tensor | None


def _whiten(CCt: torch.Tensor, whitening: str, rcond: float):
    if whitening == "cholesky":
        W, ok, rank = cholesky_whitening(CCt, rcond)
        return W, ok, rank, None
    W, keep, S = eig_whitening(CCt, rcond, truncate=whitening == "eig_truncate")
    S_kept = torch.where(keep, S, torch.zeros_like(S))
    return W, keep.sum(-1) == keep.shape[-1], keep.sum(-1), S_kept


def kwng_direction(
    T: torch.Tensor,
    CCt: torch.Tensor,
    K: torch.Tensor | None,
    grad: torch.Tensor,
    N: int,
    *,
    eps: float | torch.Tensor,
    lam: float = 0.0,
    damping: str = "T_tilde",
    method: str = "stable",
    whitening: str = "eig",
    rcond: float | None = None,
    damping_floor: float = DAMPING_FLOOR,
    diagonal_only: bool = False,
    fallback: bool = True,
) -> Direction:
    """The KWNG direction of Props. 5/6 from ``T``, ``CCᵀ``, ``K`` and ``∇L``
    (``grad``).

    Runs in the dtype of ``T`` (pass float64 for the reference precision: the
    combination cancels to ``ε`` relative; the systems are float64 in any case) with
    ``grad`` in that dtype. ``whitening`` is one of :data:`WHITENINGS`; ``rcond`` the
    relative eigenvalue or pivot threshold (default :func:`default_rcond`);
    ``diagonal_only=True`` returns ``D⁻¹∇L`` (the "diagonal conditioning" ablation). No
    host sync unless ``whitening`` is ``"eig_truncate"`` or ``fallback`` is True.
    """
    M = T.shape[-2]
    rcond = default_rcond(M, CCt.dtype) if rcond is None else rcond
    W, ok, rank, S = _whiten(CCt, whitening, rcond)  # also the rank for plain + "T"
    Tt = W.to(T.dtype) @ T if method == "stable" or damping == "T_tilde" else None
    Dvec, low, zero = damping_diagonal(damping, T, Tt, damping_floor)
    Dinv = 1.0 / Dvec
    Dg = Dinv * grad
    failed = torch.zeros(T.shape[:-2], dtype=torch.bool, device=T.device)
    A = None
    if diagonal_only:
        direction = Dg
    elif method == "stable":
        corr, A, failed = stable_solve(
            Tt, Dinv, Dg, eps, N, lam=lam, W=W, K=K, fallback=fallback
        )
        direction = combine(Dg, Dinv, corr, eps)
    else:
        corr, A = plain_solve(T, Dinv, Dg, CCt, K, eps, N, lam)
        direction = combine(Dg, Dinv, corr.to(Dg.dtype), eps)
    direction, _ = loss_only_columns(direction, grad, low)
    sq = direction * direction
    tiny = torch.finfo(_F64).tiny
    share = torch.where(low, sq, 0).sum(-1, dtype=_F64)
    share = share / sq.sum(-1, dtype=_F64).clamp(min=tiny)
    n_loss_only = (zero & (grad != 0)).sum(-1)
    return Direction(direction, rank, A, failed, low.sum(-1), share, n_loss_only, ok, S)


class Safeguarded(NamedTuple):
    """What :func:`safeguard` returns (0-dim tensors besides ``direction``)."""

    direction: torch.Tensor
    dot: torch.Tensor
    fallback: torch.Tensor
    clipped: torch.Tensor
    grad_norm: torch.Tensor
    direction_norm: torch.Tensor


def safeguard(
    g: torch.Tensor, direction: torch.Tensor, clip_norm: float | None,
    fallback: str = "gradient",
) -> Safeguarded:
    """The step's direction from the KWNG direction ``ĝ`` (``direction``) and the
    Euclidean gradient ``g`` (both ``(q,)``): where ``⟨g, ĝ⟩ ≤ 0`` or ``ĝ`` is not
    finite (a failed solve of :func:`kwng_direction` without fallback is NaN), ``g``
    (``fallback="gradient"``) or zero (``"skip"``: no step, :data:`FALLBACKS`); then
    scaled down to norm ``clip_norm`` if longer (``None``: no clipping). No host sync.

    Returns the direction, ``⟨g, ĝ⟩`` after both (float64; 0 if skipped), whether the
    fallback (either kind) and the clipping happened, ``‖g‖``, the final ``‖ĝ‖``."""
    if fallback not in FALLBACKS:
        raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
    dot = torch.dot(g.to(_F64), direction.to(_F64))
    bad = ~(dot > 0) | ~torch.isfinite(direction).all()
    if fallback == "skip":
        direction = torch.where(bad, torch.zeros_like(direction), direction)
        dot = torch.where(bad, torch.zeros_like(dot), dot)
    else:
        direction = torch.where(bad, g, direction)
        dot = torch.where(bad, torch.dot(g.to(_F64), g.to(_F64)), dot)
    grad_norm = torch.linalg.vector_norm(g)
    norm = torch.linalg.vector_norm(direction)
    clipped = torch.zeros((), dtype=torch.bool, device=g.device)
    if clip_norm is not None:
        clipped = norm > clip_norm
        scale = torch.where(clipped, clip_norm / norm.clamp(min=1e-30),
                            torch.ones_like(norm))
        direction = direction * scale
        dot = dot * scale.to(dot.dtype)
        norm = norm * scale
    return Safeguarded(direction, dot, bad, clipped, grad_norm, norm)
