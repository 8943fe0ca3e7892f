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
from kwng.kernels import BANDWIDTH_RULES, Kernel, bandwidth_from_rule, coord_matrices
from kwng.solve import DAMPING_FLOOR, DAMPINGS

__all__ = ["bandwidth_tensor", "kernel_matrices_nosync", "nystrom_solve_nosync"]


def bandwidth_tensor(
    sq_dists: torch.Tensor, bandwidth: float | str, sigma0: float = 1.0
) -> torch.Tensor:
    """The kernel bandwidth as a 0-dim tensor (no host sync) from the ``M × N`` squared
    distances: a rule of :func:`kwng.kernels.bandwidth_from_rule` or a number."""
    if isinstance(bandwidth, str):
        check_choice(bandwidth, "bandwidth", BANDWIDTH_RULES)
        return bandwidth_from_rule(sq_dists, bandwidth, sigma0)
    return torch.as_tensor(
        float(bandwidth), dtype=sq_dists.dtype, device=sq_dists.device
    )


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
    may live on the device. ``bandwidth`` as in :func:`bandwidth_tensor` (``None`` keeps
    the kernel's own).
    Returns ``(C, K, CCt, sigma)`` with ``sigma`` the bandwidth used, a 0-dim tensor;
    ``C`` comes from :meth:`Kernel.mixed_coord_from_differences` (the formula of
    :meth:`Kernel.mixed_coord`) with that tensor bandwidth.
    """
    X = X.detach()
    idx = basis_idx.to(X.device, non_blocking=True)
    coords = basis_coords.to(X.device, non_blocking=True)
    if not isinstance(bandwidth, str) and bandwidth is not None:
        bandwidth = float(bandwidth)
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
