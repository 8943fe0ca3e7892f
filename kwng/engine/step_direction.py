"""The direction of a fast KWNG step, written into the gradient buffer without a host
sync (:meth:`kwng.KWNGPreconditioner.step`, ``mode="fast"``).

The one definition is :func:`direction_into`: the sync-free solve of Prop. 6
(:func:`kwng.nosync.nystrom_solve_nosync`, i.e. :func:`kwng.solve.kwng_direction` with
the Cholesky whitening), the safeguard and clipping of :func:`kwng.solve.safeguard`,
and the copy into ``out``. :func:`step_direction` runs it

* on CUDA, compiled by ``torch.compile`` (:func:`kwng.engine.gpu_paths.compile_on_cuda`:
  inductor fuses the column norms, the weighted Gram matrix, the combination and the
  reductions of the safeguard into a few passes over ``T``), or through the four Triton
  kernels of :mod:`kwng.engine.triton_solve` where
  :func:`kwng.engine.gpu_paths.use_kernels` and
  :func:`kwng.engine.triton_solve.fused_available` say so (the same values up to float32
  rounding, checked in ``tests/triton_interpret_checks.py``);
* on the CPU, eagerly (no compilation: see :mod:`kwng.engine.gpu_paths`).
"""

from __future__ import annotations

from typing import Any

import torch

from kwng import solve
from kwng.engine.gpu_paths import compile_on_cuda, use_kernels
from kwng.estimator import nystrom_solve
from kwng.nosync import nystrom_solve_nosync

__all__ = ["INFO_KEYS", "direction_into", "reference_direction_into", "step_direction"]

#: The 0-dim tensors that describe a step's direction (both paths return them).
INFO_KEYS = ("rank", "ill_conditioned", "damping_floored", "floored_share", "loss_only",
             "dot", "fallback", "clipped", "grad_norm", "direction_norm")


def direction_into(
    out: torch.Tensor,
    T: torch.Tensor,
    CCt: torch.Tensor,
    K: torch.Tensor | None,
    g: torch.Tensor,
    N: int,
    *,
    eps: torch.Tensor,
    lam: float,
    damping: str,
    rcond: float | None,
    clip_norm: float | None,
    diagonal_only: bool = False,
) -> dict[str, torch.Tensor]:
    """The step's direction ``ĝ`` (Prop. 6, then :func:`kwng.solve.safeguard` with
    ``clip_norm``) from ``T`` (``M × q``), ``CCᵀ``, ``K`` and ``g`` (``q``), written
    into ``out`` (``q``, any float dtype); returns the 0-dim tensors of
    :data:`INFO_KEYS`. ``eps`` is a 0-dim tensor (the device-side ``ε``);
    ``diagonal_only=True`` gives ``D⁻¹ g`` before the safeguard (App. D.3)."""
    direction, dg = nystrom_solve_nosync(T, CCt, K, g, N, eps=eps, lam=lam,
                                         damping=damping, rcond=rcond,
                                         diagonal_only=diagonal_only)
    safe = solve.safeguard(g, direction, clip_norm)
    out.copy_(safe.direction)
    return {"rank": dg["rank"], "ill_conditioned": dg["ill_conditioned"],
            "damping_floored": dg["damping_floored"],
            "floored_share": dg["floored_share"], "loss_only": dg["loss_only"],
            "dot": safe.dot, "fallback": safe.fallback, "clipped": safe.clipped,
            "grad_norm": safe.grad_norm, "direction_norm": safe.direction_norm}


_direction_into_compiled = compile_on_cuda(direction_into)


def step_direction(out: torch.Tensor, T: torch.Tensor, CCt: torch.Tensor,
                   K: torch.Tensor | None, g: torch.Tensor, N: int, *,
                   diagonal_only: bool = False,
                   **settings: Any) -> dict[str, torch.Tensor]:
    """:func:`direction_into` on the fastest path for these tensors (see the module
    docstring): the same arguments (``settings``: its keyword arguments ``eps``,
    ``lam``, ``damping``, ``rcond``, ``clip_norm``) and results."""
    if not diagonal_only and use_kernels(T):
        from kwng.engine.triton_solve import fused_available, fused_direction

        if fused_available(T, g, settings["damping"]):
            return fused_direction(T, CCt, K, g, N, out=out, **settings)
    return _direction_into_compiled(out, T, CCt, K, g, N, diagonal_only=diagonal_only,
                                    **settings)


def reference_direction_into(out: torch.Tensor, T: torch.Tensor, CCt: torch.Tensor,
                             K: torch.Tensor | None, g: torch.Tensor, N: int, *,
                             eps: float, lam: float, damping: str, rcond: float | None,
                             clip_norm: float | None) -> dict[str, torch.Tensor]:
    """The direction of a ``mode="reference"`` step: Prop. 6 through the validated
    float64 solve :func:`kwng.nystrom_solve` (host diagnostics), then
    :func:`kwng.solve.safeguard`, written into ``out``; the :data:`INFO_KEYS` as 0-dim
    tensors on ``T``'s device."""
    res = nystrom_solve(T, CCt, K, g, N, eps=eps, lam=lam, damping=damping,
                        method="stable", rcond=rcond)
    safe = solve.safeguard(g, res.direction, clip_norm)
    out.copy_(safe.direction)
    diag = res.diagnostics
    info = {"rank": diag["rank"], "ill_conditioned": diag["rank"] < T.shape[0],
            "damping_floored": diag["damping_floored"], "loss_only": diag["loss_only"],
            "floored_share": diag["floored_share"]}
    info = {k: torch.tensor(v, device=T.device) for k, v in info.items()}
    return {**info, **{k: v for k, v in safe._asdict().items() if k != "direction"}}
