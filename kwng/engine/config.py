"""The hyperparameters of :class:`kwng.KWNGPreconditioner` in one validated, frozen
object.

Symbols of Arbel et al. (2020) in brackets; App. D.2 gives the Levenberg-Marquardt rule.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from kwng._checks import check_choice, check_int, check_positive
from kwng.engine.lm import LM_RULES
from kwng.kernels import BANDWIDTH_RULES, Kernel, make_kernel
from kwng.solve import DAMPINGS

__all__ = ["KWNGConfig", "MODES", "eps_from_authors"]

MODES = ("fast", "reference")


def eps_from_authors(eps: float, batch_size: int) -> float:
    """``ε`` in this package's convention for the authors' ``ε_a`` under the damping
    ``D = diag ‖T̃_{·,i}‖`` (``damping="T_tilde"``, the paper's): ``ε = √N · ε_a``
    (``N`` = batch).

    The authors whiten ``T`` with ``(CCᵀ/N)^{-1/2}`` and add ``ε_a I``;
    :func:`kwng.nystrom_solve` whitens with ``(CCᵀ)^{-1/2}`` and adds ``(ε/N) I``. Their
    ``T̃`` is ``√N`` times ours, and so is the damping built from it, so their
    ``T̃ D⁻¹ T̃ᵀ`` is ``√N`` times ours and the two regularisers coincide for
    ``ε = √N ε_a`` (the same factor converts the bounds ``[1e-10, 1e5]`` of App. D.2).
    The conversion holds for this damping only: with ``damping="identity"`` their
    ``T̃ D⁻¹ T̃ᵀ`` is ``N`` times ours and the two ``ε`` are equal (checked against the
    authors' class in float64); the same algebra gives equal ``ε`` for ``"T"``, whose
    ``D`` does not depend on the whitening. Do not convert then.
    """
    return check_positive(eps, "eps") * math.sqrt(check_int(batch_size, "batch_size",
    1))


@dataclass(frozen=True)
class KWNGConfig:
    """Hyperparameters of the preconditioner, validated on construction (paper
    symbol in brackets).

    * ``num_basis`` [``M``] ≥ 1; ``eps`` [``ε``] > 0, the initial damping (this
      package's convention; :func:`eps_from_authors` converts the authors'); ``lam``
      [``λ``] ≥ 0, the RKHS regularisation (``0`` in the paper's experiments).
    * ``kernel`` — ``"gaussian"``, ``"rq"`` or a :class:`kwng.Kernel` (a name is
      turned into the kernel); ``bandwidth`` — ``"mean_sq"``
      (``σ = σ0 · mean ‖X_n − Y_m‖²``), ``"median"`` or a positive number;
      ``sigma0`` [``σ0``] > 0.
    * ``damping`` [``D``] — ``"identity"``, ``"T"`` or ``"T_tilde"``.
    * Levenberg-Marquardt (App. D.2, :class:`kwng.engine.lm.LevenbergMarquardt`):
      ``lm_interval`` ≥ 1, ``lm_omega`` [``ω``] in (0, 1), ``0 ≤ lm_low < lm_high``;
      ``adapt_eps`` switches it on; ``eps_min ≤ ε ≤ eps_max``; ``lm_rule``
      ``"authors"`` or ``"same_batch"``.
    * ``clip_norm`` > 0 or ``None``; ``mode`` ``"fast"`` or ``"reference"``;
      ``diagonal_only`` — ``D⁻¹ g`` only (needs ``damping`` ``"T"`` or
      ``"T_tilde"``); ``rcond`` — relative pivot threshold of the stable solve
      (default ``M · float-eps``).
    """

    num_basis: int = 5
    eps: float = 1e-5
    lam: float = 0.0
    kernel: str | Kernel = "gaussian"
    bandwidth: str | float = "mean_sq"
    sigma0: float = 1.0
    damping: str = "T_tilde"
    lm_interval: int = 5
    lm_omega: float = 0.85
    lm_low: float = 0.25
    lm_high: float = 0.75
    adapt_eps: bool = True
    clip_norm: float | None = 1.0
    mode: str = "fast"
    diagonal_only: bool = False
    eps_min: float = 1e-10
    eps_max: float = 1e5
    rcond: float | None = None
    lm_rule: str = "authors"

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        check_int(self.num_basis, "num_basis", 1)
        check_positive(self.eps, "eps")
        put("lam", check_positive(self.lam, "lam", allow_zero=True))
        if isinstance(self.kernel, str):
            put("kernel", make_kernel(self.kernel))  # raises on an unknown name
        elif not isinstance(self.kernel, Kernel):
            raise ValueError("kernel must be 'gaussian', 'rq' or a kwng.Kernel, got "
                             f"{type(self.kernel).__name__}")
        if isinstance(self.bandwidth, str):
            check_choice(self.bandwidth, "bandwidth", BANDWIDTH_RULES)
        else:
            put("bandwidth", check_positive(self.bandwidth, "bandwidth"))
        put("sigma0", check_positive(self.sigma0, "sigma0"))
        check_choice(self.damping, "damping", DAMPINGS)
        self._check_lm()
        if self.clip_norm is not None:
            put("clip_norm", check_positive(self.clip_norm, "clip_norm"))
        check_choice(self.mode, "mode", MODES)
        for flag in ("adapt_eps", "diagonal_only"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got "
                                 f"{type(getattr(self, flag)).__name__}")
        if self.diagonal_only and self.damping == "identity":
            raise ValueError("diagonal_only=True needs damping 'T' or 'T_tilde' (with "
                             "'identity' it is plain SGD)")
        if self.rcond is not None:
            put("rcond", check_positive(self.rcond, "rcond"))

    def _check_lm(self) -> None:
        check_int(self.lm_interval, "lm_interval", 1)
        if not 0 < check_positive(self.lm_omega, "lm_omega") < 1:
            raise ValueError(f"lm_omega must lie in (0, 1), got {self.lm_omega}")
        low = check_positive(self.lm_low, "lm_low", allow_zero=True)
        if not low < check_positive(self.lm_high, "lm_high", allow_zero=True):
            raise ValueError(f"lm_low must be < lm_high, got lm_low={self.lm_low}, "
                             f"lm_high={self.lm_high}")
        check_positive(self.eps_min, "eps_min")
        check_positive(self.eps_max, "eps_max")
        check_choice(self.lm_rule, "lm_rule", LM_RULES)

    def replace(self, **changes: Any) -> KWNGConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The names of the hyperparameters."""
        return tuple(f.name for f in dataclasses.fields(cls))
