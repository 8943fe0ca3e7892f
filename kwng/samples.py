"""Checks of the samples ``X`` the estimator sees: finite, resolved by their dtype."""

from __future__ import annotations

import warnings

import torch

__all__ = ["RESOLUTION_WARN", "check_sample_resolution"]

#: Relative resolution of the samples (``u · max|X| / spread``) above which the estimate
#: is flagged.
RESOLUTION_WARN = 0.01


def check_sample_resolution(X: torch.Tensor) -> float:
    """How coarsely the samples ``X`` are resolved by their dtype, relative to their
    spread.

    With ``u`` the unit round-off of ``X.dtype``, ``max|X|`` the largest magnitude and
    ``s`` the RMS distance of the samples to their mean, returns ``r = u · max|X| / s``:
    the rounding of each sample as a fraction of the distances the kernel sees.
    ``r > RESOLUTION_WARN`` (1 %) gives a ``RuntimeWarning`` (the estimate is dominated
    by rounding: compute the samples in a wider dtype); ``s = 0`` (every sample equal in
    this dtype) raises ``ValueError``. float16 and bfloat16 outputs of magnitude ~100
    with unit spread, or float32 ones of magnitude ~1e5, are flagged."""
    Xd = X.detach().to(torch.float64)
    u = torch.finfo(X.dtype).eps
    big = float(Xd.abs().max())
    spread = float(((Xd - Xd.mean(0)) ** 2).sum(1).mean().sqrt())
    if spread == 0.0:
        raise ValueError(
            f"all {X.shape[0]} samples X are equal in {X.dtype} (magnitude "
            f"{big:.3g}, resolution {u * big:.2g}): if they should differ, "
            "compute them in a wider dtype")
    r = u * big / spread
    if r > RESOLUTION_WARN and X.dtype != torch.float64:
        warnings.warn(
            f"KWNG inputs in {X.dtype} are rounded to {100 * r:.2g} % of their "
            f"spread (magnitude {big:.3g}, spread {spread:.3g}): the estimate is "
            "dominated by rounding; compute the samples in float32 or float64, "
            "or centre them", RuntimeWarning, stacklevel=3)
    return r


def _check_finite_counted(t: torch.Tensor, name: str) -> None:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(
            f"{name} must contain only finite values: found "
            f"{int(torch.isnan(t).sum())} NaN and "
            f"{int(torch.isinf(t).sum())} inf entries")
