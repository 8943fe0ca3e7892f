"""One backward pass for ``M + 1`` cotangents: the replicated-batch engine of the
preconditioner.

A KWNG step needs the Euclidean gradient ``g = ∇_θ L`` and the ``M`` rows
``T_m = Σ_n (C_{m,n}/N)ᵀ ∂X_n/∂θ`` of Prop. 5: ``R = M + 1`` vector–Jacobian products of
the same network at the same batch. Serial backward passes (``mode="reference"``) launch
``R`` small backward passes; a ``vmap`` over the backward relays out every activation.
This module does it as **one** backward pass of an ``R·N`` batch:

* the model's forward (train mode, grad enabled) runs on the input repeated ``R`` times,
  so every activation has ``R`` identical copies stacked along the batch dimension;
* each ``Conv2d``/``Linear`` (its class swapped for a subclass that knows the engine)
  computes its output on the first copy only and repeats it (the copies are identical,
  so the forward costs one batch of matrix work, not ``R``);
* each ``BatchNorm`` normalises with the statistics of one copy (exactly the statistics
  the un-replicated model sees, so ``X`` and the running averages are the model's own)
  and, in the backward pass, reduces over each copy separately — batch norm couples the
  samples of a copy, never two copies;
* the backward pass receives the stacked cotangent ``(∂L/∂X, C_1/N, …, C_M/N)`` and
  every layer propagates all ``R·N`` signals at once; the weight gradient of copy ``r``
  is formed from the layer's input (one copy) and copy ``r``'s output gradient: ``R``
  calls per layer on contiguous slices of the output gradient (or, with
  ``KWNG_WGRAD=stacked``, one call with the copies stacked along the output channels,
  which needs a relayout of the output gradient and measured slower).

Copy ``0`` gives ``g`` (also returned to autograd, so a plain ``loss.backward()`` on a
replicated forward still leaves the true gradient in ``p.grad``), copies ``1..M`` give
``T``. Everything is exact: the test-suite compares it with serial
``torch.autograd.grad`` calls.

Supported: every trainable parameter must be the ``weight``/``bias`` of a ``Conv2d``
(``groups = 1``, zero padding), ``Linear`` or ``BatchNorm1d/2d``; other modules (ReLU,
pooling, residual additions, any parameter-free function) run unchanged at batch
``R·N``. Dropout in training mode would draw different masks per copy and is refused.
:func:`unsupported_reason` says why a model cannot use the engine; the preconditioner
then falls back to serial passes.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ReplicatedEngine", "unsupported_reason"]

log = logging.getLogger(__name__)

# "split" (default: measured faster on an H200, no relayout of dy) or "stacked" (one
# call per layer)
_WGRAD = os.environ.get("KWNG_WGRAD", "split")

_BN = (nn.BatchNorm1d, nn.BatchNorm2d)


def unsupported_reason(model: nn.Module, params: list[torch.Tensor]) -> str | None:
    """``None`` if every parameter of ``params`` lives in a layer the engine batches,
    else why not."""
    owned: set[int] = set()
    for name, mod in model.named_modules():
        own = list(mod.parameters(recurse=False))
        if type(mod) not in _SWAP:
            if own:
                return (
                    f"{name or 'model'}: parameters of a {type(mod).__name__} "
                    "(the engine batches the exact types Conv2d, Linear, BatchNorm1d "
                    "and BatchNorm2d)"
                )
            continue
        if isinstance(mod, nn.Conv2d) and (
            mod.groups != 1
            or mod.padding_mode != "zeros"
            or isinstance(mod.padding, str)
        ):
            return (
                f"{name}: Conv2d with groups={mod.groups}, "
                f"padding_mode={mod.padding_mode!r}, padding={mod.padding!r} "
                "(the engine takes groups=1 and numeric zero padding)"
            )
        owned.update(id(p) for p in own)
    for p in params:
        if id(p) not in owned:
            return "a trainable parameter that no Conv2d/Linear/BatchNorm owns"
    return None


@dataclass
class _State:
    """What the patched layers need to know during one replicated forward."""

    copies: int = 1
    batch: int = 0
    active: bool = False
    grads: dict[int, torch.Tensor] = field(
        default_factory=dict
    )  # id(param) -> (R, *shape)


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
    """``R`` copies of ``y0`` stacked along dim 0 (one batched copy kernel; memory
    format kept)."""
    return torch.cat([y0] * R)


def _per_copy_channels(dy: torch.Tensor, R: int) -> torch.Tensor:
    """``dy`` of shape ``(R·N, C, H, W)`` → ``(N, R·C, H, W)`` (copy ``r`` in channels
    ``r·C…``)."""
    RN, C, H, W = dy.shape
    N = RN // R
    if dy.is_contiguous(memory_format=torch.channels_last) and not dy.is_contiguous():
        nhwc = dy.permute(0, 2, 3, 1).reshape(R, N, H, W, C).permute(1, 2, 3, 0, 4)
        return nhwc.reshape(N, H, W, R * C).permute(
            0, 3, 1, 2
        )  # channels_last (N, R·C, H, W)
    return dy.reshape(R, N, C, H, W).transpose(0, 1).reshape(N, R * C, H, W)


def _first_copy(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, st: _State
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The first copy of the input, and the parameters, in the autocast dtype."""
    dt = _compute_dtype(x)
    return x[: st.batch].to(dt), weight.to(dt), None if bias is None else bias.to(dt)


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
        Co = w.shape[0]
        if ctx.needs_input_grad[1]:
            if _WGRAD == "split":  # R weight-gradient calls on contiguous slices of dy
                G = torch.stack(
                    [
                        conv_bwd(d, x0, w, None, *args, [False, True, False])[1]
                        for d in _split(dy, R)
                    ]
                ).to(weight.dtype)
            else:  # one call, the copies stacked along the output channels
                shell = torch.empty(
                    (R * Co,) + tuple(w.shape[1:]),
                    dtype=w.dtype,
                    device=w.device,
                    memory_format=_format(w),
                )
                dw = conv_bwd(
                    _per_copy_channels(dy, R),
                    x0,
                    shell,
                    None,
                    *args,
                    [False, True, False],
                )[1]
                G = dw.view((R,) + tuple(w.shape)).to(weight.dtype)
            st.grads[id(weight)] = G
            gw = G[0]
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
            G = torch.matmul(dyr.transpose(1, 2), x0.reshape(-1, w.shape[1])).to(
                weight.dtype
            )  # (R, out, in)
            st.grads[id(weight)] = G
            gw = G[0]
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
    if t.dim() == 2:
        return t.view(R, RN // R, C), lambda v: v.reshape(t.shape)
    if _format(t) == torch.channels_last:
        sp = tuple(t.shape[2:])
        return t.permute(0, 2, 3, 1).view(R, -1, C), lambda v: v.view(
            (RN,) + sp + (C,)
        ).permute(0, 3, 1, 2)
    return t.reshape(R, RN // R, C, -1), lambda v: v.reshape(t.shape)


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
            x32 = x0.to(acc)
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
        gw = gb = None
        if weight is not None and ctx.needs_input_grad[1]:
            st.grads[id(weight)] = dgamma.to(weight.dtype)
            gw = st.grads[id(weight)][0]
        if bias is not None and ctx.needs_input_grad[2]:
            st.grads[id(bias)] = dbeta.to(bias.dtype)
            gb = st.grads[id(bias)][0]
        return dx, gw, gb, None, None


class ReplicatedEngine:
    """Patch ``model`` so that a training forward runs on ``R`` copies of the batch.

    Use: ``engine = ReplicatedEngine(model, copies)``; while ``engine.enabled``, a
    forward call of ``model`` in train mode with grad enabled runs replicated and
    returns the first copy's output ``X`` (a view of the ``(R·N, d)`` output
    ``outputs``). :meth:`backward` then takes the ``(R·N, d)`` stacked cotangent and
    returns ``{id(p): (R, *p.shape)}``. :meth:`remove` restores the model's own forward
    methods.
    """

    def __init__(self, model: nn.Module, copies: int) -> None:
        self.model = model
        self.state = _State(copies=copies)
        self.outputs: torch.Tensor | None = None
        self.first: torch.Tensor | None = None
        self.enabled = True
        self._patched: list[nn.Module] = []
        for mod in model.modules():
            if type(mod) in _SWAP:
                mod.__class__ = _SWAP[type(mod)]
                mod._kwng_state = self.state
                self._patched.append(mod)
        self._pre = model.register_forward_pre_hook(self._pre_hook)
        self._post = model.register_forward_hook(self._post_hook)

    def _pre_hook(self, module: nn.Module, args: tuple):
        st = self.state
        st.active = bool(
            self.enabled
            and module.training
            and torch.is_grad_enabled()
            and args
            and isinstance(args[0], torch.Tensor)
        )
        if not st.active:
            return None
        for m in module.modules():
            if isinstance(m, nn.Dropout) and m.training and m.p > 0:
                raise ValueError(
                    f"{type(m).__name__}(p={m.p}) in training mode: the replicated "
                    "KWNG forward would draw a different mask per copy; "
                    "use mode='reference' or p=0"
                )
        st.batch = args[0].shape[0]
        R = st.copies
        new = tuple(
            a.repeat((R,) + (1,) * (a.dim() - 1))
            if isinstance(a, torch.Tensor) and a.dim() > 0 and a.shape[0] == st.batch
            else a
            for a in args
        )
        if (
            args[0].dim() == 4
            and args[0].is_contiguous(memory_format=torch.channels_last)
            and not args[0].is_contiguous()
        ):
            new = (new[0].contiguous(memory_format=torch.channels_last),) + new[1:]
        return new

    def _post_hook(self, module: nn.Module, args: tuple, output: Any):
        st = self.state
        if not st.active:
            return None
        st.active = False
        if (
            not isinstance(output, torch.Tensor)
            or output.shape[0] != st.copies * st.batch
        ):
            raise ValueError(
                "the replicated KWNG forward needs a model that returns one "
                "(batch, d) tensor"
            )
        self.outputs = output
        self.first = output[: st.batch]
        return self.first

    def __deepcopy__(self, memo: dict) -> ReplicatedEngine:
        """A deep copy of the model (hooks included) gets a disabled engine: its hooks
        do nothing."""
        new = object.__new__(ReplicatedEngine)
        new.model, new.state, new.outputs, new.first = None, _State(), None, None
        new.enabled, new._patched, new._pre, new._post = False, [], None, None
        memo[id(self)] = new
        return new

    def owns(self, outputs: torch.Tensor) -> bool:
        """Whether ``outputs`` is the first copy of the latest replicated forward."""
        return self.first is not None and outputs is self.first

    def backward(
        self, cotangent: torch.Tensor, params: list[torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        """One backward pass of the stacked ``(R·N, d)`` cotangent; per-copy parameter
        gradients."""
        st = self.state
        st.grads = {}
        Xs = self.outputs
        if Xs is None:
            raise ValueError(
                "no replicated forward to differentiate: "
                "call the model (train mode) first"
            )
        self.outputs = self.first = None
        torch.autograd.grad(Xs, params, cotangent.to(Xs.dtype), allow_unused=True)
        return st.grads

    def remove(self) -> None:
        """Give the layers their own classes back and remove the hooks."""
        for mod in self._patched:
            mod.__class__ = _ORIGINAL[type(mod)]
            del mod._kwng_state
        self._patched = []
        self._pre.remove()
        self._post.remove()


class _Swapped:
    """Mixin of the swapped layer classes: the replicated computation while the engine's
    forward is active, the layer's own otherwise; a deep copy is a plain layer of the
    original class."""

    def __deepcopy__(self, memo: dict) -> nn.Module:
        cls = _ORIGINAL[type(self)]
        new = cls.__new__(cls)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k != "_kwng_state":
                new.__dict__[k] = copy.deepcopy(v, memo)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        st = _active(self, x)
        return super().forward(x) if st is None else self._replicated(x, st)


def _active(mod: nn.Module, x: torch.Tensor) -> _State | None:
    st = mod._kwng_state
    return st if st.active and x.shape[0] == st.copies * st.batch else None


class _RConv2d(_Swapped, nn.Conv2d):
    """``Conv2d`` that runs replicated while its engine's forward is active (same state,
    same class otherwise: ``isinstance`` checks, ``state_dict`` and ``deepcopy`` see a
    ``Conv2d``)."""

    def _replicated(self, x: torch.Tensor, st: _State) -> torch.Tensor:
        return _Conv.apply(x, self.weight, self.bias, self, st)


class _RLinear(_Swapped, nn.Linear):
    def _replicated(self, x: torch.Tensor, st: _State) -> torch.Tensor:
        return _Linear.apply(x, self.weight, self.bias, st)


class _RBatchNorm1d(_Swapped, nn.BatchNorm1d):
    def _replicated(self, x: torch.Tensor, st: _State) -> torch.Tensor:
        return _BatchNorm.apply(x, self.weight, self.bias, self, st)


class _RBatchNorm2d(_Swapped, nn.BatchNorm2d):
    _replicated = _RBatchNorm1d._replicated


_SWAP = {
    nn.Conv2d: _RConv2d,
    nn.Linear: _RLinear,
    nn.BatchNorm1d: _RBatchNorm1d,
    nn.BatchNorm2d: _RBatchNorm2d,
}
_ORIGINAL = {v: k for k, v in _SWAP.items()}
