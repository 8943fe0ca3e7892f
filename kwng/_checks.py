"""Input validation shared by the public functions: every error names the argument and
the accepted range."""

from __future__ import annotations

import math
from numbers import Real

import torch


def check_positive(value, name: str, *, allow_zero: bool = False) -> float:
    """Return ``float(value)`` if it is a finite number ``> 0`` (``>= 0`` with
    ``allow_zero``)."""
    if isinstance(value, bool) or not isinstance(value, (Real, torch.Tensor)):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__}")
    if isinstance(value, torch.Tensor) and (value.numel() != 1 or value.is_complex()):
        raise ValueError(f"{name} must be a real number (a scalar), got a tensor of "
                         f"shape {tuple(value.shape)} and dtype {value.dtype}")
    v = float(value)
    ok = math.isfinite(v) and (v >= 0 if allow_zero else v > 0)
    if not ok:
        rng = "[0, inf)" if allow_zero else "(0, inf)"
        raise ValueError(f"{name} must be a finite number in {rng}, got {value!r}")
    return v


def check_int(value, name: str, low: int, high: int | None = None) -> int:
    """Return ``int(value)`` if it is an integer in ``[low, high]``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int,))
        and not (
            isinstance(value, torch.Tensor)
            and value.numel() == 1
            and not value.is_floating_point()
        )
    ):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    v = int(value)
    if v < low or (high is not None and v > high):
        hi = "inf" if high is None else str(high)
        raise ValueError(f"{name} must be an integer in [{low}, {hi}], got {v}")
    return v


def check_choice(value, name: str, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_points(X, name: str) -> torch.Tensor:
    """A floating tensor of shape ``(n, d)`` with ``d >= 1``."""
    if not isinstance(X, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape (n, d), got "
                         f"{type(X).__name__}")
    if X.dim() != 2 or X.shape[1] < 1:
        raise ValueError(f"{name} must have shape (n, d) with d >= 1, got "
                         f"{tuple(X.shape)}")
    if not X.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {X.dtype}")
    return X


def check_finite(t: torch.Tensor, name: str) -> torch.Tensor:
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} must contain only finite values (found NaN or inf)")
    return t
