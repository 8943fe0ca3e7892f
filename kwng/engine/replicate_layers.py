"""The autograd functions of the replicated-batch engine (:mod:`kwng.engine.replicate`).

``_Conv`` and ``_Linear`` run a layer's forward once on the first copy of the batch and
its backward on all ``R`` stacked cotangents (``_BatchNorm`` is in
:mod:`kwng.engine.replicate_bn`); ``_State`` is what they read during one replicated
forward; :func:`repeat_copies` and :func:`stack_copies` are the repeat and the relayout
of the copies (compiled on CUDA: :mod:`kwng.engine.gpu_paths`). See
:mod:`kwng.engine.replicate` for the algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kwng.engine.gpu_paths import compile_on_cuda, use_kernels

__all__ = ["repeat_copies", "stack_copies", "stacked_wgrad"]


@dataclass
class _State:
    """What the patched layers need to know during one replicated forward."""

    copies: int = 1
    batch: int = 0
    gpu_solve: str = "auto"  # kwng.KWNGConfig.gpu_solve: compiled functions or kernels
    active: bool = False
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


def repeat_copies(y0: torch.Tensor, R: int) -> torch.Tensor:
    """``R`` copies of ``y0`` stacked along dim 0, memory format kept (``torch.cat([y0]
    * R)``, written as one broadcast copy so that a compiled form keeps the format)."""
    out = torch.empty((R * y0.shape[0],) + tuple(y0.shape[1:]), dtype=y0.dtype,
                      device=y0.device, memory_format=_format(y0))
    out.view((R,) + tuple(y0.shape)).copy_(y0.expand((R,) + tuple(y0.shape)))
    return out


_repeat_copies_compiled = compile_on_cuda(repeat_copies)


def _repeat(y0: torch.Tensor, st: _State) -> torch.Tensor:
    """:func:`repeat_copies` (``st.copies`` of them), compiled on the GPU (one pass)."""
    return _repeat_copies_compiled(y0, st.copies, gpu_solve=st.gpu_solve)


def _first_copy(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, st: _State
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The first copy of the input, and the parameters, in the autocast dtype."""
    dt = _compute_dtype(x)
    x0 = x[: st.batch].to(dt)
    return x0, weight.to(dt), None if bias is None else bias.to(dt)


def stacked_wgrad(dy: torch.Tensor, gpu_solve: str = "auto") -> bool:
    """Whether a convolution's ``R`` weight gradients come from one call with the
    copies stacked along the output channels (on the GPU, and wherever the kernels
    run) rather than ``R`` calls on slices of ``dy``: faster summed over ResNet-18's
    convolutions in fp32 and bf16 (the ``wgrad`` parts of the record
    ``results/benchmarks/engine_parts.json``)."""
    return dy.is_cuda or use_kernels(dy, gpu_solve)


def _wgrad_loop(dy, x0, w, R, args, st=None) -> torch.Tensor:
    """``(R, *w.shape)``: ``R`` weight-gradient calls on contiguous slices of ``dy``."""
    conv_bwd = torch.ops.aten.convolution_backward
    return torch.stack(
        [
            conv_bwd(d, x0, w, None, *args, [False, True, False])[1]
            for d in _split(dy, R)
        ]
    )


def _split(t: torch.Tensor, R: int) -> torch.Tensor:
    """``(R·N, …)`` → ``(R, N, …)``: a view for any memory format (only dim 0 is
    split)."""
    return t.view((R, t.shape[0] // R) + tuple(t.shape[1:]))


def _handed_off(dy: torch.Tensor, st: _State | None) -> torch.Tensor | None:
    """The stacked layout of ``dy`` if the batch norm after this convolution made it
    (same memory, shape, strides and an unchanged version), else None."""
    entry = None if st is None else st.handoff.pop(dy.data_ptr(), None)
    if entry is None:
        return None
    src, version, stacked = entry
    same = src.shape == dy.shape and src.stride() == dy.stride()
    return stacked if same and src._version == version == dy._version else None


def stack_copies(dy: torch.Tensor, R: int) -> torch.Tensor:
    """``dy`` ``(R·N, C, H, W)`` as ``(N, R·C, H, W)`` in ``dy``'s memory format: copy
    ``r`` becomes channels ``r·C … (r+1)·C − 1``."""
    RN, C, H, W = dy.shape
    N = RN // R
    ds = torch.empty(
        (N, R * C, H, W), dtype=dy.dtype, device=dy.device, memory_format=_format(dy)
    )
    ds.view(N, R, C, H, W).copy_(dy.view(R, N, C, H, W).transpose(0, 1))
    return ds


_stack_copies_compiled = compile_on_cuda(stack_copies)


def _stacked(dy: torch.Tensor, R: int, st: _State | None) -> torch.Tensor:
    """:func:`stack_copies` of ``dy``: the batch norm's hand-off, else one relayout
    (compiled on the GPU)."""
    ds = _handed_off(dy, st)
    if ds is not None:
        return ds
    path = "auto" if st is None else st.gpu_solve
    return _stack_copies_compiled(dy, R, gpu_solve=path)


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
        return _repeat(y0, st)

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
            wgrad = _wgrad_stacked if stacked_wgrad(dy, st.gpu_solve) else _wgrad_loop
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
        x0, w, b = _first_copy(x, weight, bias, st)
        with torch.autocast(x.device.type, enabled=False):
            y0 = F.linear(x0, w, b)
        ctx.save_for_backward(x0, w)
        ctx.meta = (x.dtype, st, weight, bias)
        return _repeat(y0, st)

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


