"""The autograd functions of the replicated-batch engine (:mod:`kwng.engine.replicate`).

``_Conv``, ``_Linear`` and ``_BatchNorm`` run a layer's forward once on the first copy
of the batch and its backward on all ``R`` stacked cotangents; ``_State`` is what they
read during one replicated forward. Moved out of :mod:`kwng.engine.replicate` (which
re-exports every name) to keep each module short; see that module's docstring for the
algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kwng.engine import triton_ops


@dataclass
class _State:
    """What the patched layers need to know during one replicated forward."""

    copies: int = 1
    batch: int = 0
    active: bool = False
    # the memory format of the convolutions' 4-D outputs (and so of every activation
    # after them); None: the format the model's own tensors have
    layout: torch.memory_format | None = None
    grads: dict[int, torch.Tensor] = field(
        default_factory=dict
    )  # id(param) -> (R, *shape)
    # a batch norm's input gradient already laid out for the stacked weight gradient of
    # the convolution before it: data_ptr -> (gradient, its version, stacked layout)
    handoff: dict[int, tuple] = field(default_factory=dict)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return x.dtype


def _format(t: torch.Tensor) -> torch.memory_format:
    return (
        torch.channels_last
        if t.dim() == 4
        and t.is_contiguous(memory_format=torch.channels_last)
        and not t.is_contiguous()
        else torch.contiguous_format
    )


def _repeat(y0: torch.Tensor, R: int) -> torch.Tensor:
    """``R`` copies of ``y0`` stacked along dim 0, memory format kept (on the GPU one
    Triton kernel that reads ``y0`` once; ``torch.cat`` elsewhere)."""
    fmt = _format(y0)
    if triton_ops.available(y0) and y0.is_contiguous(memory_format=fmt):
        return triton_ops.repeat(y0, R, fmt)
    return torch.cat([y0] * R)


def _first_copy(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, st: _State
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The first copy of the input, and the parameters, in the autocast dtype (and, for
    a convolution, in the engine's layout)."""
    dt = _compute_dtype(x)
    conv = st.layout is not None and weight.dim() == 4
    fmt = st.layout if conv else torch.preserve_format
    x0 = x[: st.batch].to(dt, memory_format=fmt)
    w = weight.to(dt, memory_format=fmt)
    return x0, w, None if bias is None else bias.to(dt)


#: On the GPU, the per-copy weight gradients of a convolution come from one call with
#: the copies stacked along the output channels (``dy`` laid out by the batch norm after
#: the convolution, or by one relayout);
#: elsewhere, and when False, from ``R`` calls on slices of ``dy``. Summed over
#: ResNet-18's convolutions on an H200 (``kwng/experiments/bench/engine_parts.py``, N = 128, R = 6,
#: channels_last): 7.6 ms stacked against 9.5 ms in ``R`` calls in fp32 (6.6 ms for one
#: call at batch ``R·N``), 3.1 against 4.4 ms in bf16 (2.2 ms).
STACKED_WGRAD = True


def _wgrad_loop(dy, x0, w, R, args, st=None) -> torch.Tensor:
    """``(R, *w.shape)``: ``R`` weight-gradient calls on contiguous slices of ``dy``."""
    conv_bwd = torch.ops.aten.convolution_backward
    return torch.stack(
        [
            conv_bwd(d, x0, w, None, *args, [False, True, False])[1]
            for d in _split(dy, R)
        ]
    )


def _handed_off(dy: torch.Tensor, st: _State | None) -> torch.Tensor | None:
    """The stacked layout of ``dy`` if the batch norm after this convolution made it
    (same memory, shape, strides and an unchanged version), else None."""
    entry = None if st is None else st.handoff.pop(dy.data_ptr(), None)
    if entry is None:
        return None
    src, version, stacked = entry
    same = src.shape == dy.shape and src.stride() == dy.stride()
    return stacked if same and src._version == version == dy._version else None


def _stacked(dy: torch.Tensor, R: int, st: _State | None) -> torch.Tensor:
    """``dy`` ``(R·N, C, H, W)`` as ``(N, R·C, H, W)``: the batch norm's hand-off, else
    one relayout (a Triton kernel where it runs)."""
    ds = _handed_off(dy, st)
    if ds is not None:
        return ds
    fmt = _format(dy)
    if triton_ops.available(dy) and dy.is_contiguous(memory_format=fmt):
        return triton_ops.interleave(dy, R, fmt)
    RN, C, H, W = dy.shape
    N = RN // R
    ds = torch.empty(
        (N, R * C, H, W), dtype=dy.dtype, device=dy.device, memory_format=fmt
    )
    ds.view(N, R, C, H, W).copy_(dy.view(R, N, C, H, W).transpose(0, 1))
    return ds


def _wgrad_stacked(dy, x0, w, R, args, st=None) -> torch.Tensor:
    """``(R, *w.shape)``: copy ``r``'s output gradient becomes output channels
    ``r·C … (r+1)·C − 1`` of one batch-``N`` gradient, so one call gives all ``R``."""
    ds = _stacked(dy, R, st)
    C = dy.shape[1]
    shell = torch.empty(  # the weight's shape for the call (its values are not read)
        (R * C,) + tuple(w.shape[1:]),
        dtype=w.dtype,
        device=w.device,
        memory_format=_format(w),
    )
    gw = torch.ops.aten.convolution_backward(
        ds, x0, shell, None, *args, [False, True, False]
    )[1]
    return gw.view((R,) + tuple(w.shape))


class _Conv(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        mod: nn.Conv2d,
        st: _State,
    ) -> torch.Tensor:
        R = st.copies
        x0, w, b = _first_copy(x, weight, bias, st)
        with torch.autocast(x.device.type, enabled=False):
            y0 = F.conv2d(x0, w, b, mod.stride, mod.padding, mod.dilation, 1)
        ctx.save_for_backward(x0, w)
        ctx.meta = (
            mod.stride,
            mod.padding,
            mod.dilation,
            x.shape,
            x.dtype,
            bias is not None,
            st,
            weight,
            bias,
        )
        return _repeat(y0, R)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        x0, w = ctx.saved_tensors
        stride, padding, dilation, xshape, xdtype, has_bias, st, weight, bias = ctx.meta
        R = st.copies
        dy = dy.to(w.dtype)
        fmt = _format(dy)
        conv_bwd = torch.ops.aten.convolution_backward
        args = (stride, padding, dilation, False, [0, 0], 1)
        dx = gw = db = None
        if ctx.needs_input_grad[0]:
            shell = torch.empty(
                xshape, dtype=w.dtype, device=w.device, memory_format=fmt
            )  # shape only
            dx = conv_bwd(dy, shell, w, None, *args, [True, False, False])[0].to(xdtype)
        if ctx.needs_input_grad[1]:
            stacked = STACKED_WGRAD and (dy.is_cuda or triton_ops.available(dy))
            wgrad = _wgrad_stacked if stacked else _wgrad_loop
            G = wgrad(dy, x0, w, R, args, st)  # cast when copied into T (one pass)
            st.grads[id(weight)] = G
            gw = G[0].to(weight.dtype)
        if has_bias and ctx.needs_input_grad[2]:
            gb = (
                _split(dy, R)
                .sum([1, 3, 4], dtype=torch.promote_types(dy.dtype, torch.float32))
                .to(bias.dtype)
            )
            st.grads[id(bias)] = gb
            db = gb[0]
        return dx, gw, db, None, None


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        st: _State,
    ) -> torch.Tensor:
        R = st.copies
        x0, w, b = _first_copy(x, weight, bias, st)
        with torch.autocast(x.device.type, enabled=False):
            y0 = F.linear(x0, w, b)
        ctx.save_for_backward(x0, w)
        ctx.meta = (x.dtype, st, weight, bias)
        return _repeat(y0, R)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        x0, w = ctx.saved_tensors
        xdtype, st, weight, bias = ctx.meta
        R = st.copies
        dy = dy.to(w.dtype)
        dx = (dy @ w).to(xdtype) if ctx.needs_input_grad[0] else None
        dyr = dy.reshape(R, -1, w.shape[0])  # (R, N·…, out)
        gw = db = None
        if ctx.needs_input_grad[1]:
            # (R, out, in), cast when copied into T
            G = torch.matmul(dyr.transpose(1, 2), x0.reshape(-1, w.shape[1]))
            st.grads[id(weight)] = G
            gw = G[0].to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            gb = dyr.sum(1, dtype=torch.promote_types(dy.dtype, torch.float32)).to(
                bias.dtype
            )
            st.grads[id(bias)] = gb
            db = gb[0]
        return dx, gw, db, None


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
    :func:`kwng.engine.triton_ops.bn_backward` (channels contiguous, rows of stride ``C``)."""
    if d.dim() != 3:
        return False
    R, S, C = d.shape
    return d.stride() == (S * C, C, 1) and x.stride()[1:] == (C, 1)


def _split(t: torch.Tensor, R: int) -> torch.Tensor:
    """``(R·N, …)`` → ``(R, N, …)``: a view for any memory format (only dim 0 is
    split)."""
    return t.view((R, t.shape[0] // R) + tuple(t.shape[1:]))


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
        R, N = st.copies, st.batch
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
        return _repeat(y0.to(x.dtype), R)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):
        x0, mean, invstd = ctx.saved_tensors
        use_batch, st, weight, bias, xdtype = ctx.meta
        R = st.copies
        acc = mean.dtype  # float32 (float64 for float64 models)
        dt = dy.dtype  # the big passes run in the activations' dtype
        d, unview = _rows(dy, R)  # (R, S, C) or (R, N, C, L): channels in dim 2
        x, _ = _rows(x0, 1)
        inner = _channels_inner(d, x)
        nchw = d.dim() == 4 and d.is_contiguous() and x.is_contiguous()
        if triton_ops.available(d) and (inner or nchw):  # two Triton passes
            scale = invstd if weight is None else invstd * weight.to(acc)
            # after a convolution, also write dx in the layout of its stacked weight
            # gradient (saves that convolution a relayout pass)
            hand = ctx.after_conv and STACKED_WGRAD and dy.dim() == 4 and dt == xdtype
            kernel = triton_ops.bn_backward if inner else triton_ops.bn_backward_nchw
            dx, dgamma, dbeta, dxi = kernel(
                d, x[0], mean, invstd, scale, use_batch, interleaved=hand
            )
            out = unview(dx).to(xdtype)
            if dxi is not None:
                N, C, H, W = x0.shape
                stacked = (
                    dxi.view(N, H, W, R * C).permute(0, 3, 1, 2)
                    if inner
                    else dxi.view(N, R * C, H, W)
                )
                st.handoff[out.data_ptr()] = (out, out._version, stacked)
            return _BatchNorm._finish(ctx, out, dgamma, dbeta)
        cshape = (1, 1, -1) + (1,) * (d.dim() - 3)
        red = [1] + list(range(3, d.dim()))
        xh = ((x.to(acc) - mean.view(cshape)) * invstd.view(cshape)).to(
            dt
        )  # one copy's x̂
        dbeta = d.sum(red, dtype=acc)  # (R, C) = Σ dy per copy
        dgamma = (d * xh).sum(red, dtype=acc)  # (R, C) = Σ dy·x̂ per copy
        dx = None
        if ctx.needs_input_grad[0]:
            scale = invstd if weight is None else invstd * weight.to(acc)  # γ / σ
            rc = (R, 1, -1) + (1,) * (d.dim() - 3)
            if (
                use_batch
            ):  # dx = γ/σ · (dy − mean(dy) − x̂ · mean(dy·x̂)), means over one copy
                S = x0.numel() // x0.shape[1]
                dx = torch.addcmul(
                    (-(scale * dbeta) / S).to(dt).view(rc), d, scale.to(dt).view(cshape)
                )
                dx.addcmul_(xh, ((scale * dgamma) / S).to(dt).view(rc), value=-1)
            else:
                dx = d * scale.to(dt).view(cshape)
            dx = unview(dx).to(xdtype)
        return _BatchNorm._finish(ctx, dx, dgamma, dbeta)

    @staticmethod
    def _finish(ctx: Any, dx, dgamma: torch.Tensor, dbeta: torch.Tensor):
        """Record the per-copy ``(R, C)`` gradients of γ and β; autograd gets copy 0."""
        _, st, weight, bias, _ = ctx.meta
        if not ctx.needs_input_grad[0]:
            dx = None
        gw = gb = None
        if weight is not None and ctx.needs_input_grad[1]:
            st.grads[id(weight)] = dgamma.to(weight.dtype)
            gw = st.grads[id(weight)][0]
        if bias is not None and ctx.needs_input_grad[2]:
            st.grads[id(bias)] = dbeta.to(bias.dtype)
            gb = st.grads[id(bias)][0]
        return dx, gw, gb, None, None
