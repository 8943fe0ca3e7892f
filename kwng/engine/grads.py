"""The gradient ``g`` and the rows of ``T`` from one replicated backward pass
(:class:`kwng.KWNGPreconditioner`, fast path).

Moved out of :mod:`kwng.engine.precond` to keep that module short; the algorithm is
described in its docstring and in :mod:`kwng.engine.replicate`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from kwng.engine.graph import derived_from, direct_params
from kwng.engine.replicate import ReplicatedEngine
from kwng.jacobians import jacobian_from_outputs


def replicated_gradients(
    loss: torch.Tensor,
    X: torch.Tensor,
    X0: torch.Tensor,
    C: torch.Tensor,
    params: list[torch.Tensor],
    eng: ReplicatedEngine,
    warn_once: Callable[..., None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g`` (``q``) and ``T`` (``M × q``) of ``params`` from the replicated forward
    whose model output is ``X0`` (``X`` is ``X0`` or computed from it); ``warn_once`` is
    the preconditioner's one-time warning."""
    N, M = X.shape[0], C.shape[0]
    direct = direct_params(loss, X0, params)
    g_direct = {}
    if direct:  # the loss also depends on parameters directly: one extra backward pass
        warn_once(
            "direct",
            "KWNG: the loss depends on %d parameter tensor(s) directly (not "
            "only through the outputs): one extra backward pass per step",
            len(direct),
        )
        grads = torch.autograd.grad(loss, direct, retain_graph=True)
        g_direct = {id(p): gr for p, gr in zip(direct, grads)}
    Vc = (C / N).to(X.dtype)
    # samples computed from the model's output: pull the cotangents back to it
    if X is not X0:
        Vc = torch.autograd.grad(X, X0, Vc, is_grads_batched=True, retain_graph=True)[0]
    (gX,) = torch.autograd.grad(loss, X0, retain_graph=bool(direct))
    V = torch.cat([gX.detach()[None], Vc.to(gX.dtype)], 0).reshape(-1, X0.shape[1])
    G = eng.backward(V, params)
    # every parameter's M + 1 gradients copied once into its columns (layout and dtype
    # in the same pass)
    dtype = functools.reduce(torch.promote_types, (p.dtype for p in params))
    q = sum(p.numel() for p in params)
    Gall = torch.empty((M + 1, q), dtype=dtype, device=params[0].device)
    offset = 0
    for p in params:
        n = p.numel()
        dst = Gall[:, offset:offset + n].view((M + 1,) + tuple(p.shape))
        offset += n
        Gp = G.get(id(p))
        if Gp is None:  # a parameter the forward did not use
            dst.zero_()
        else:
            dst.copy_(Gp)
        if id(p) in g_direct:
            dst[0].copy_(g_direct[id(p)])
    return Gall[0], Gall[1:]


def step_gradients(
    loss: torch.Tensor,
    X: torch.Tensor,
    C: torch.Tensor,
    params: list[torch.Tensor],
    eng: ReplicatedEngine | None,
    fast: bool,
    warn_once: Callable[..., None],
    counters: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g`` (``q``) and ``T`` (``M × q``) of a refresh step: one replicated backward
    pass where ``X`` is (computed from) the output of the engine's last forward, else
    ``M + 1`` serial passes (in fast mode logged once and counted in
    ``counters["serial_steps"]``)."""
    X0 = None if eng is None else eng.first
    if X0 is not None and (
        X is X0 or (X.shape == X0.shape and derived_from(X, X0, params))
    ):
        return replicated_gradients(loss, X, X0, C, params, eng, warn_once)
    if fast:
        warn_once(
            "serial",
            "KWNG fast mode: outputs are not the output of the model's last training "
            "forward (or the model is unsupported): serial backward passes are used",
        )
        counters["serial_steps"] += 1
    g_parts = torch.autograd.grad(
        loss, params, retain_graph=True, allow_unused=True, materialize_grads=True
    )
    g = torch.cat([gp.reshape(-1) for gp in g_parts])
    T = jacobian_from_outputs(X, params, C.to(X.dtype), retain_graph=False)
    return g, T
