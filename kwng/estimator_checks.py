"""One validation and precision path for the two kernel estimators.

:func:`kwng.kwng_gradient` (Wasserstein, Props. 5/6) and :func:`kwng.kfng_gradient`
(Fisher–Rao, beyond the paper) take the same inputs: samples ``X`` (``N × d``), a
Euclidean gradient ``grad`` (``q``) and a Nyström basis (``basis_idx``, for the
Wasserstein estimator also ``basis_coords``). Both go through the functions here, so
that the rules hold for both:

* ``grad`` is a 1-d floating tensor with finite entries: an integer or boolean
  gradient is refused (its direction would come back rounded to integers, i.e. zeros);
* ``X`` is a finite floating ``(N, d)`` tensor; its rounding relative to its spread is
  measured (:func:`kwng.samples.check_sample_resolution`, a ``RuntimeWarning`` above
  1 %); the kernel matrices are built in float64 whatever ``X``'s dtype;
* the basis indices lie in ``[0, N)`` and are distinct (for the Wasserstein estimator:
  distinct ``(index, coordinate)`` pairs): a repeated basis function makes ``CCᵀ``
  singular and the estimate meaningless;
* a direction in which every parameter is "loss-only" (the kernel terms do not depend
  on any parameter: all columns of ``T`` degenerate, e.g. a bandwidth far below the
  spread of the samples) is reported by a ``RuntimeWarning`` and the diagnostic
  ``all_loss_only``, never returned silently.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from kwng._checks import check_finite, check_int, check_points
from kwng.samples import _check_finite_counted, check_sample_resolution

__all__ = ["check_grad", "check_samples", "check_basis", "check_solve_inputs",
           "report_degenerate"]


def check_grad(grad, q: int | None = None, name: str = "grad") -> torch.Tensor:
    """``grad`` if it is a finite 1-d floating tensor (of length ``q`` when given)."""
    if not isinstance(grad, torch.Tensor):
        raise ValueError(f"{name} must be a 1-d torch.Tensor (the flattened Euclidean "
                         f"gradient), got {type(grad).__name__}")
    if grad.dim() != 1:
        raise ValueError(f"{name} must be a 1-d tensor (the flattened Euclidean "
                         f"gradient), got shape {tuple(grad.shape)}")
    if q is not None and grad.shape != (q,):
        raise ValueError(f"{name} must have shape ({q},) (one entry per parameter), "
                         f"got {tuple(grad.shape)}")
    if not grad.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor (float16 to "
                         f"float64), got {grad.dtype}: the direction is returned in "
                         "grad's dtype, so an integer gradient would come back "
                         f"rounded; pass {name}.double()")
    _check_finite_counted(grad, name)
    return grad


def check_samples(X, name: str = "X (the samples)") -> tuple[torch.Tensor, float]:
    """``X`` checked (finite floating ``(N, d)``, ``N >= 2``) and its relative
    resolution (:func:`kwng.samples.check_sample_resolution`, which warns when the
    dtype rounds the samples by more than 1 % of their spread)."""
    X = check_points(X, "X")
    if X.shape[0] < 2:
        raise ValueError(f"X must hold at least 2 samples (rows), got {X.shape[0]}")
    _check_finite_counted(X.detach(), name)
    return X, check_sample_resolution(X)


def _index_tensor(value, name: str, num_basis: int, low: int, high: int
                  ) -> torch.Tensor:
    t = torch.as_tensor(value)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise ValueError(f"{name} must hold integers, got {t.dtype}")
    if t.shape != (num_basis,):
        raise ValueError(f"{name} must have shape ({num_basis},) = (num_basis,), got "
                         f"{tuple(t.shape)}")
    if int(t.min()) < low or int(t.max()) > high:
        raise ValueError(f"{name} must lie in [{low}, {high}], got values in "
                         f"[{int(t.min())}, {int(t.max())}]")
    return t


def check_basis(basis_idx, basis_coords, N: int, d: int, num_basis: int,
                draw: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                with_coords: bool = True):
    """The Nyström basis ``(basis_idx, basis_coords)``: ``draw()`` (the caller's
    :func:`kwng.draw_basis`) when not given, else checked (integer, shape
    ``(num_basis,)``, in range, no basis function twice). ``with_coords=False`` (the
    Fisher estimator) ignores and returns no coordinates."""
    check_int(num_basis, "num_basis", 1, N)
    if basis_idx is None and (basis_coords is None or not with_coords):
        basis_idx, basis_coords = draw()
    elif with_coords and (basis_idx is None or basis_coords is None):
        raise ValueError("basis_idx and basis_coords must be given together")
    idx = _index_tensor(basis_idx, "basis_idx", num_basis, 0, N - 1)
    if not with_coords:
        if torch.unique(idx).numel() != num_basis:
            raise ValueError(f"basis_idx must hold {num_basis} distinct sample "
                             f"indices, got {num_basis - torch.unique(idx).numel()} "
                             "repeated: a "
                             "repeated basis point makes CCᵀ singular")
        return idx, None
    coords = _index_tensor(basis_coords, "basis_coords", num_basis, 0, d - 1)
    pairs = torch.stack([idx.cpu(), coords.to(idx.dtype).cpu()], 1)
    n_distinct = torch.unique(pairs, dim=0).shape[0]
    if n_distinct != num_basis:
        raise ValueError(f"the basis functions (basis_idx[m], basis_coords[m]) must be "
                         f"distinct, got {num_basis - n_distinct} repeated pair(s): a "
                         "repeated basis function makes CCᵀ singular")
    return idx, coords


def report_degenerate(diagnostics: dict, direction: torch.Tensor, grad: torch.Tensor,
                      who: str, stacklevel: int = 3) -> None:
    """Warn (``RuntimeWarning``) when every parameter of a nonzero gradient is
    loss-only, i.e. no column of ``T`` carries information (the kernel terms do not
    depend on the parameters at these samples), or when the direction is exactly zero
    for a nonzero gradient; sets ``diagnostics["all_loss_only"]``."""
    q = grad.numel()
    nonzero = bool((grad != 0).any())
    all_lo = nonzero and int(diagnostics.get("loss_only", 0)) >= int(
        (grad != 0).sum())
    diagnostics["all_loss_only"] = bool(all_lo)
    zero_dir = nonzero and not bool((direction != 0).any())
    if all_lo or zero_dir:
        what = "is exactly zero" if zero_dir else "carries no metric information"
        warnings.warn(
            f"{who}: the direction {what}: all {q} parameters are loss-only (every "
            "column of T is degenerate, the kernel terms do not vary with the "
            "parameters at these samples); the bandwidth is probably far from the "
            f"spread of the samples (bandwidth {diagnostics.get('bandwidth')!r})",
            RuntimeWarning, stacklevel=stacklevel)


def relative_error(estimate, exact) -> float:
    """``‖estimate - exact‖ / ‖exact‖`` (the error measure of the paper's Figs. 1,
    4, 5)."""
    e = torch.as_tensor(estimate, dtype=torch.float64).cpu()
    x = torch.as_tensor(exact, dtype=torch.float64).cpu()
    if e.shape != x.shape:
        raise ValueError("estimate and exact must have the same shape, got "
                         f"{tuple(e.shape)} and {tuple(x.shape)}")
    nx = float(torch.linalg.vector_norm(x))
    if nx == 0:
        raise ValueError("exact must be non-zero for a relative error")
    return float(torch.linalg.vector_norm(e - x)) / nx


def check_solve_inputs(T, CCt, K, grad) -> tuple[int, int]:
    """``(M, q)`` of the inputs of :func:`kwng.estimator.nystrom_solve`, checked: shapes
    that match, finite values (the error says where a non-finite value comes from)."""
    if T.dim() != 2:
        raise ValueError(f"T must be a matrix (M, q), got shape {tuple(T.shape)}")
    M, q = T.shape
    if grad.shape != (q,):
        raise ValueError(f"grad must have shape ({q},) to match the parameters, "
                         f"got {tuple(grad.shape)}")
    check_finite(grad, "grad")
    if not bool(torch.isfinite(T).all()):
        raise ValueError(
            "T must contain only finite values: the Jacobian of the samples with "
            f"respect to the parameters has {int(torch.isnan(T).sum())} NaN and "
            f"{int(torch.isinf(T).sum())} inf entries"
        )
    if not bool(torch.isfinite(CCt).all()) or not bool(torch.isfinite(K).all()):
        raise ValueError(
            "CCt and K must contain only finite values (NaN or inf found: "
            "non-finite samples, or a kernel that overflows in the input dtype)"
        )
    if CCt.shape != (M, M) or K.shape != (M, M):
        raise ValueError(f"CCt and K must be ({M}, {M}), got {tuple(CCt.shape)} and "
                         f"{tuple(K.shape)}")
    return M, q
