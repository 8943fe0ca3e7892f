"""The per-copy layer norm of the replicated-batch engine
(:mod:`kwng.engine.replicate`).

``_LayerNorm`` normalises one copy of the batch (a layer norm couples the entries of one
sample, never two samples, so every copy of the ``R``-fold batch would give the same
result) and repeats it; in the backward pass every copy ``r`` gets its own gradients of
γ and β. With ``x̂ = (x − μ) σ⁻¹`` the normalised input of the one forward copy (``μ``,
``σ`` over the normalised dimensions of each sample) and ``g = dy · γ``::

    dβ[r] = Σ_s dy[r, s],     dγ[r] = Σ_s dy[r, s] · x̂[s],
    dx[r, s] = σ⁻¹[s] · (g[r, s] − mean(g[r, s]) − x̂[s] · mean(g[r, s] · x̂[s])),

``s`` running over the samples of a copy (and any dimension between the batch and the
normalised ones: the tokens of a transformer), the means over the normalised dimensions.
:func:`ln_backward_torch` is the one definition (compiled on CUDA).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kwng.engine.gpu_paths import compile_on_cuda
from kwng.engine.replicate_bn import record_affine_grads
from kwng.engine.replicate_layers import _repeat, _State

__all__ = ["ln_backward_torch"]


def ln_backward_torch(
    d: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    ndim: int,
    need_dx: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(dx, dγ, dβ)`` of ``R`` copies (the formulas of the module docstring): ``d`` is
    ``(R, N, …)`` in the accumulation dtype (float32, or float64), ``x`` one copy
    ``(1, N, …)``, ``mean`` and ``rstd`` as ``torch.native_layer_norm`` returns them for
    that copy (size 1 in the ``ndim`` normalised dimensions) with a leading ``1``,
    ``weight`` γ (or ``None``) in the accumulation dtype. Returns ``dx`` like ``d``
    (``None`` unless ``need_dx``), ``dγ`` and ``dβ`` ``(R, *normalised shape)``."""
    xh = (x - mean) * rstd  # one copy's x̂
    red = list(range(1, d.dim() - ndim))  # the samples (and tokens) of a copy
    dbeta = d.sum(red)
    dgamma = (d * xh).sum(red)
    if not need_dx:
        return None, dgamma, dbeta
    norm = list(range(d.dim() - ndim, d.dim()))
    g = d if weight is None else d * weight
    dx = g - g.mean(norm, keepdim=True) - xh * (g * xh).mean(norm, keepdim=True)
    return dx * rstd, dgamma, dbeta


_ln_backward_compiled = compile_on_cuda(ln_backward_torch)


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of ``F.layer_norm(x, …)`` in the plain model: float32 for a bf16/fp16
    input under CUDA autocast (an fp32 operation there), else the input's."""
    low = x.dtype in (torch.float16, torch.bfloat16)
    return torch.float32 if low and x.is_cuda and torch.is_autocast_enabled(
        "cuda") else x.dtype


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        mod: nn.LayerNorm,
        st: _State,
    ) -> torch.Tensor:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        x0 = x[: st.batch].to(acc)
        shape = tuple(mod.normalized_shape)
        with torch.autocast(x.device.type, enabled=False):
            y0, mean, rstd = torch.native_layer_norm(
                x0, shape,
                None if weight is None else weight.to(acc),
                None if bias is None else bias.to(acc), mod.eps)
        ctx.save_for_backward(x0, mean, rstd)
        ctx.meta = (len(shape), st, weight, bias, x.dtype)
        return _repeat(y0.to(_out_dtype(x)), st)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        x0, mean, rstd = ctx.saved_tensors
        ndim, st, weight, bias, xdtype = ctx.meta
        R = st.copies
        d = dy.to(x0.dtype).view((R,) + tuple(x0.shape))
        dx, dgamma, dbeta = _ln_backward_compiled(
            d, x0[None], mean[None], rstd[None],
            None if weight is None else weight.to(x0.dtype), ndim,
            ctx.needs_input_grad[0], gpu_solve=st.gpu_solve)
        if dx is not None:
            dx = dx.reshape(dy.shape).to(xdtype)
        return (dx, *record_affine_grads(st, ctx.needs_input_grad, weight, bias,
                                         dgamma, dbeta), None, None)
