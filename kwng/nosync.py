"""Sync-free variants of the estimator for training loops on GPU
(``kwng.engine.precond``, ``mode="fast"``).

:func:`kwng.kernel_matrices` and :func:`kwng.nystrom_solve` validate their inputs and
return Python numbers (rank, condition numbers), which forces the host to wait for the
GPU. The functions below compute the same quantities with tensors only, through the same
formulas (:func:`kwng.kernels.coord_matrices`, :func:`kwng.solve.kwng_direction`), so a
training step can be queued without a host sync.
"""

from __future__ import annotations

import torch

from kwng import solve
from kwng._checks import check_choice, check_positive
from kwng.kernels import BANDWIDTH_RULES, Kernel, coord_matrices
from kwng.solve import DAMPING_FLOOR, DAMPINGS

__all__ = ["kernel_matrices_nosync", "nystrom_solve_nosync"]


def kernel_matrices_nosync(
    X: torch.Tensor,
    basis_idx: torch.Tensor,
    basis_coords: torch.Tensor,
    kernel: Kernel,
    bandwidth: float | str | None = None,
    sigma0: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``C``, ``K``, ``CCᵀ`` of Prop. 5 exactly as :func:`kernel_matrices`, without host
    syncs.

    ``basis_idx`` and ``basis_coords`` must already be valid (no range checks here) and
    may live on the device. ``bandwidth``: a rule of
    :func:`kwng.kernels.bandwidth_from_rule` (with ``sigma0``), a number ``> 0`` or
    ``None`` (the kernel's own).
    Returns ``(C, K, CCt, sigma)`` with ``sigma`` the bandwidth used, a 0-dim tensor;
    ``C`` comes from :meth:`Kernel.mixed_coord_from_differences` (the formula of
    :meth:`Kernel.mixed_coord`) with that tensor bandwidth.

    Samples that all sit at one point carry no metric to estimate (the validated
    :func:`kwng.kwng_gradient` refuses them). A rule then gives ``σ = 0``, a fixed
    bandwidth (which would give a finite, meaningless direction of enormous norm) gives
    ``sigma`` = NaN: either way the matrices are not finite, and the preconditioner's
    step falls back to the Euclidean gradient, counted in its ``fallbacks``.
    """
    X = X.detach()
    idx = basis_idx.to(X.device, non_blocking=True)
    coords = basis_coords.to(X.device, non_blocking=True)
    if isinstance(bandwidth, str):
        check_choice(bandwidth, "bandwidth", BANDWIDTH_RULES)
    else:
        fixed = kernel.bandwidth if bandwidth is None else bandwidth
        fixed = torch.as_tensor(check_positive(fixed, "bandwidth"), dtype=X.dtype,
                                device=X.device)
        one_point = (X == X[:1]).all()  # a device flag: no host sync
        bandwidth = torch.where(one_point, torch.nan, fixed)
    C, K, sigma = coord_matrices(kernel, X, idx, coords, bandwidth, sigma0)
    Cf = C.reshape(C.shape[0], -1)
    return C, K, Cf @ Cf.T, sigma


def nystrom_solve_nosync(T: torch.Tensor, CCt: torch.Tensor, K: torch.Tensor,
                         grad: torch.Tensor, N: int, *, eps: float | torch.Tensor,
                         lam: float = 0.0, damping: str = "T_tilde",
                         rcond: float | None = None,
                         damping_floor: float = DAMPING_FLOOR,
                         diagonal_only: bool = False
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The stable estimator of Prop. 6 with tensors only (no host sync, no
    data-dependent branch): :func:`kwng.solve.kwng_direction` with the Cholesky
    whitening.

    Same estimator as :func:`nystrom_solve` with ``method="stable"``; two differences in
    *how*:

    * the whitening ``W`` with ``W CCᵀ Wᵀ = I`` is ``L⁻¹`` from the Cholesky factor
      ``CCᵀ = L Lᵀ`` instead of ``S^{-1/2} Uᵀ`` (:func:`kwng.solve.cholesky_whitening`);
    * a nearly singular ``CCᵀ`` is regularised instead of truncated;
      ``info["ill_conditioned"]`` flags it and ``info["rank"]`` counts the pivots above
      the threshold. ``T̃`` and the combination stay in ``T``'s dtype; the systems are
      float64.

    ``eps`` may be a 0-dim tensor (the Levenberg-Marquardt ``ε`` kept on the device).
    ``diagonal_only=True`` returns ``D⁻¹ ∇L`` (the paper's "diagonal conditioning"
    ablation).
    Returns the direction (dtype of ``grad``) and a dict of 0-dim tensors: ``rank``,
    ``ill_conditioned``, ``solve_failed`` (the ``r × r`` Cholesky failed: the direction
    is not finite and the caller must fall back), ``damping_floored`` (entries of ``D``
    at the relative floor), ``floored_share`` (their share of ``‖ĝ‖²``) and
    ``loss_only`` (components treated by :func:`kwng.solve.loss_only_columns`).
    """
    check_choice(damping, "damping", DAMPINGS)
    lam = check_positive(lam, "lam", allow_zero=True)
    if not isinstance(eps, torch.Tensor):
        eps = torch.as_tensor(check_positive(eps, "eps"), dtype=torch.float64)
    eps = eps.to(torch.float64).to(T.device)
    out = solve.kwng_direction(T, CCt, K, grad.to(T.dtype), N, eps=eps, lam=lam,
                               damping=damping, whitening="cholesky", rcond=rcond,
                               damping_floor=damping_floor, diagonal_only=diagonal_only,
                               fallback=False)
    return out.direction.to(grad.dtype), {
        "rank": out.rank,
        "ill_conditioned": ~out.whitening_ok,
        "solve_failed": out.failed,
        "damping_floored": out.floored,
        "floored_share": out.floored_share,
        "loss_only": out.loss_only,
    }
