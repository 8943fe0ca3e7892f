"""The per-copy batch norm of the replicated-batch engine
(:mod:`kwng.engine.replicate`).

``_BatchNorm`` normalises the ``R`` copies of a batch with the statistics of one copy
(those the un-replicated model sees) and, in the backward pass, reduces over each copy
separately: for every copy ``r`` and channel ``c``::

    dβ[r, c] = Σ_s dy[r, s, c],     dγ[r, c] = Σ_s dy[r, s, c] · x̂[s, c],
    dx[r, s, c] = a[c] · dy[r, s, c] + b[r, c] + k[r, c] · x̂[s, c],

with ``x̂ = (x − μ) σ⁻¹`` the normalised input of the one forward copy, ``a = γ σ⁻¹``,
``b = −a dβ / S`` and ``k = −a dγ / S`` (``S`` = samples × pixels of a copy).
:func:`bn_backward_torch` is the one definition (seven passes over the ``R``-fold tensor
eagerly; compiled on CUDA), the Triton kernels of :mod:`kwng.engine.triton_bn` its
two-pass form (:mod:`kwng.engine.gpu_paths` says which runs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kwng.engine.gpu_paths import compile_on_cuda, use_kernels
from kwng.engine.replicate_layers import _Conv, _format, _repeat, _State, stacked_wgrad

__all__ = ["bn_backward_torch"]


def _rows(t: torch.Tensor, R: int):
    """``(R·N, C, …)`` as ``(R, S, C)`` (channels-last or 2-D: a view, channels
    innermost) or ``(R, N, C, L)`` (NCHW: a view); and the function that maps such a
    tensor back to ``t``'s shape."""
    RN, C = t.shape[:2]
    if t.dim() == 2 or (
        t.dim() == 4 and t.shape[2] * t.shape[3] == 1 and t.is_contiguous()
    ):
        # 2-D, or 1 × 1 maps (the same memory in both formats): a view, channels inner
        return t.view(R, RN // R, C), lambda v: v.reshape(t.shape)
    if _format(t) == torch.channels_last:
        sp = tuple(t.shape[2:])
        return t.permute(0, 2, 3, 1).view(R, -1, C), lambda v: v.view(
            (RN,) + sp + (C,)
        ).permute(0, 3, 1, 2)
    return t.reshape(R, RN // R, C, -1), lambda v: v.reshape(t.shape)


def _channels_inner(d: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``d`` ``(R, S, C)`` and ``x`` ``(1, S, C)`` have the layout of
    :func:`kwng.engine.triton_bn.bn_backward` (channels contiguous, rows of stride
    ``C``)."""
    if d.dim() != 3:
        return False
    R, S, C = d.shape
    return d.stride() == (S * C, C, 1) and x.stride()[1:] == (C, 1)


def bn_backward_torch(
    d: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    scale: torch.Tensor,
    use_batch: bool,
    need_dx: bool = True,
    interleaved: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dx, dγ, dβ, dx_stacked)`` of ``R`` copies (the formulas of the module
    docstring): ``d`` is ``(R, S, C)`` or ``(R, N, C, L)`` (channels in dim 2), ``x``
    one copy as ``(1, S, C)`` or ``(1, N, C, L)``; ``mean``, ``invstd`` and ``scale``
    (``a = γ σ⁻¹``) are ``(C,)`` in the accumulation dtype (float32, or float64).
    ``use_batch=False`` (running statistics) drops ``b`` and ``k``. Returns ``dx`` like
    ``d`` in ``d``'s dtype (``None`` unless ``need_dx``), ``dγ`` and ``dβ`` ``(R, C)``
    in the accumulation dtype, and with ``interleaved=True`` ``dx`` with its first two
    dimensions swapped, contiguous (the layout of a stacked weight gradient)."""
    acc, dt = mean.dtype, d.dtype
    cshape = (1, 1, -1) + (1,) * (d.dim() - 3)
    red = [1] + list(range(3, d.dim()))
    xh = ((x.to(acc) - mean.view(cshape)) * invstd.view(cshape)).to(dt)  # one copy's x̂
    dbeta = d.sum(red, dtype=acc)  # (R, C) = Σ dy per copy
    dgamma = (d * xh).sum(red, dtype=acc)  # (R, C) = Σ dy·x̂ per copy
    if not need_dx:
        return None, dgamma, dbeta, None
    if use_batch:  # dx = γ/σ · (dy − mean(dy) − x̂ · mean(dy·x̂)), means over one copy
        S = x.numel() // x.shape[2]
        rc = (d.shape[0], 1, -1) + (1,) * (d.dim() - 3)
        dx = torch.addcmul(
            (-(scale * dbeta) / S).to(dt).view(rc), d, scale.to(dt).view(cshape)
        )
        dx.addcmul_(xh, ((scale * dgamma) / S).to(dt).view(rc), value=-1)
    else:
        dx = d * scale.to(dt).view(cshape)
    return dx, dgamma, dbeta, dx.transpose(0, 1).contiguous() if interleaved else None


_bn_backward_compiled = compile_on_cuda(bn_backward_torch)


class _BatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        mod: nn.modules.batchnorm._BatchNorm,
        st: _State,
    ) -> torch.Tensor:
        N = st.batch
        x0 = x[:N]
        use_batch = mod.training or mod.running_mean is None
        factor = 0.0 if mod.momentum is None else mod.momentum
        if (
            mod.training
            and mod.track_running_stats
            and mod.num_batches_tracked is not None
        ):
            mod.num_batches_tracked.add_(1)
            factor = (
                1.0 / float(mod.num_batches_tracked)
                if mod.momentum is None
                else mod.momentum
            )
        acc = (
            torch.float64 if x.dtype == torch.float64 else torch.float32
        )  # statistics in ≥ fp32
        with torch.autocast(x.device.type, enabled=False):
            # CUDA normalises bf16/fp16 inputs with float32 statistics and parameters
            # itself, as the plain model under autocast does; elsewhere cast first
            x32 = x0 if x0.is_cuda else x0.to(acc)
            rm = (
                mod.running_mean
                if (not mod.training or mod.track_running_stats)
                else None
            )
            rv = (
                mod.running_var
                if (not mod.training or mod.track_running_stats)
                else None
            )
            w32 = None if weight is None else weight.to(acc)
            b32 = None if bias is None else bias.to(acc)
            if (
                use_batch
            ):  # the batch statistics of one copy = those the plain model sees
                y0, mean, invstd = torch.native_batch_norm(
                    x32, w32, b32, rm, rv, True, factor, mod.eps
                )
            else:
                y0 = F.batch_norm(x32, rm, rv, w32, b32, False, factor, mod.eps)
                mean = mod.running_mean.to(acc)
                invstd = torch.rsqrt(mod.running_var.to(acc) + mod.eps)
        ctx.save_for_backward(x0, mean, invstd)
        ctx.meta = (use_batch, st, weight, bias, x.dtype)
        ctx.after_conv = isinstance(x.grad_fn, _Conv._backward_cls)
        return _repeat(y0.to(x.dtype), st)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        x0, mean, invstd = ctx.saved_tensors
        use_batch, st, weight, bias, xdtype = ctx.meta
        R = st.copies
        acc = mean.dtype  # float32 (float64 for float64 models)
        d, unview = _rows(dy, R)  # (R, S, C) or (R, N, C, L): channels in dim 2
        x, _ = _rows(x0, 1)
        inner = _channels_inner(d, x)
        nchw = d.dim() == 4 and d.is_contiguous() and x.is_contiguous()
        scale = invstd if weight is None else invstd * weight.to(acc)  # γ / σ
        # after a convolution, also write dx in the layout of its stacked weight
        # gradient (saves that convolution a relayout pass)
        hand = (ctx.after_conv and dy.dim() == 4 and dy.dtype == xdtype
                and (inner or nchw) and ctx.needs_input_grad[0]
                and stacked_wgrad(dy, st.gpu_solve))
        if use_kernels(d, st.gpu_solve) and (inner or nchw):  # two Triton passes
            from kwng.engine import triton_bn

            kernel = triton_bn.bn_backward if inner else triton_bn.bn_backward_nchw
            dx, dgamma, dbeta, dxi = kernel(
                d, x[0], mean, invstd, scale, use_batch, interleaved=hand
            )
        else:
            dx, dgamma, dbeta, dxi = _bn_backward_compiled(
                d, x, mean, invstd, scale, use_batch, ctx.needs_input_grad[0], hand,
                gpu_solve=st.gpu_solve)
        out = None if dx is None else unview(dx).to(xdtype)
        if dxi is not None:
            N, C, H, W = x0.shape
            stacked = (
                dxi.view(N, H, W, R * C).permute(0, 3, 1, 2)
                if inner
                else dxi.view(N, R * C, H, W)
            )
            st.handoff[out.data_ptr()] = (out, out._version, stacked)
        return _BatchNorm._finish(ctx, out, dgamma, dbeta)

    @staticmethod
    def _finish(ctx: Any, dx, dgamma: torch.Tensor, dbeta: torch.Tensor):
        """Record the per-copy ``(R, C)`` gradients of γ and β; autograd gets copy 0."""
        _, st, weight, bias, _ = ctx.meta
        if not ctx.needs_input_grad[0]:
            dx = None
        return (dx, *record_affine_grads(st, ctx.needs_input_grad, weight, bias,
                                         dgamma, dbeta), None, None)


def record_affine_grads(st: Any, needs: tuple, weight, bias, dgamma: torch.Tensor,
                        dbeta: torch.Tensor) -> tuple:
    """Record a normalisation layer's per-copy ``(R, …)`` gradients of its scale and
    shift in ``st.grads`` (where ``needs``, autograd's ``needs_input_grad``, asks for
    them); return what autograd gets for each: copy 0, or ``None``."""
    gw = gb = None
    if weight is not None and needs[1]:
        st.grads[id(weight)] = dgamma.to(weight.dtype)
        gw = st.grads[id(weight)][0]
    if bias is not None and needs[2]:
        st.grads[id(bias)] = dbeta.to(bias.dtype)
        gb = st.grads[id(bias)][0]
    return gw, gb
