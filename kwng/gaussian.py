"""Closed forms for normal distributions, in float64 NumPy: the Lyapunov solve
(:func:`lyapunov`), ``W2²`` between normals (:func:`gaussian_w2_squared`) and the WNG
of the normal model in the paper's coordinates (:func:`normal_wng_sigma_coords`). The
normal model of :mod:`kwng.models` is built on them.
"""

from __future__ import annotations

import numpy as np
import scipy.linalg
import torch

__all__ = ["lyapunov", "gaussian_w2_squared", "normal_wng_sigma_coords"]


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def lyapunov(Sigma: np.ndarray, S: np.ndarray) -> np.ndarray:
    """The symmetric ``A`` with ``AΣ + ΣA = S`` (SciPy's continuous Lyapunov solver)."""
    A = scipy.linalg.solve_continuous_lyapunov(Sigma, S)
    return 0.5 * (A + A.T)


def _sqrtm_psd(A: np.ndarray) -> np.ndarray:
    w, V = np.linalg.eigh(0.5 * (A + A.T))
    return (V * np.sqrt(np.clip(w, 0.0, None))) @ V.T


def gaussian_w2_squared(mu_a, Sigma_a, mu_b, Sigma_b) -> float:
    """``W2²`` between normals: ``‖μa-μb‖² + tr(Σa + Σb - 2 (Σa^{1/2} Σb
    Σa^{1/2})^{1/2})``."""
    mu_a, mu_b, Sa, Sb = map(_np, (mu_a, mu_b, Sigma_a, Sigma_b))
    ra = _sqrtm_psd(Sa)
    cross = _sqrtm_psd(ra @ Sb @ ra)
    return float(np.sum((mu_a - mu_b) ** 2) + np.trace(Sa + Sb - 2.0 * cross))


def normal_wng_sigma_coords(Sigma: np.ndarray, grad_mu: np.ndarray, grad_s: np.ndarray
                            ) -> tuple[np.ndarray, np.ndarray]:
    """WNG of the normal model in the paper's coordinates ``θ = (μ, s)``, ``s`` = lower
    triangle of Σ.

    Paper App. D.1, eq. (true_nat_grad): with ``A`` the symmetric matrix holding ``∇_s
    L`` in both triangles, the WNG is ``(∇_μ L, tril(Σ(A + diag A) + (A + diag A)Σ))``.
    ``grad_s`` and the returned lower triangle follow ``numpy.tril_indices(d)`` order.
    """
    Sigma = _np(Sigma)
    d = Sigma.shape[0]
    il = np.tril_indices(d)
    A = np.zeros((d, d))
    A[il] = _np(grad_s)
    A = A + A.T - np.diag(np.diag(A))
    B = A + np.diag(np.diag(A))
    return _np(grad_mu).copy(), (Sigma @ B + B @ Sigma)[il]
