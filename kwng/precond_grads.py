"""The gradient ``g`` and the rows of ``T`` from one replicated backward pass
(:class:`kwng.KWNGPreconditioner`, fast path).

Moved out of :mod:`kwng.precond` to keep that module short; the algorithm is described in
its docstring and in :mod:`kwng.replicate`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .graph import direct_params
from .replicate import ReplicatedEngine


def replicated_gradients(
    loss: torch.Tensor,
    X: torch.Tensor,
    X0: torch.Tensor,
    C: torch.Tensor,
    params: list[torch.Tensor],
    eng: ReplicatedEngine,
    warn_once: Callable[..., None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g`` (``q``) and ``T`` (``M × q``) of ``params`` from the replicated forward whose
    model output is ``X0`` (``X`` is ``X0`` or computed from it); ``warn_once`` is the
    preconditioner's one-time warning."""
    N, M = X.shape[0], C.shape[0]
    direct = direct_params(loss, X0, params)
    g_direct = {}
    if direct:  # the loss also depends on parameters directly: one extra backward pass
        warn_once("direct", "KWNG: the loss depends on %d parameter tensor(s) directly (not "
                  "only through the outputs): one extra backward pass per step", len(direct))
        grads = torch.autograd.grad(loss, direct, retain_graph=True)
        g_direct = {id(p): gr for p, gr in zip(direct, grads)}
    Vc = (C / N).to(X.dtype)
    if X is not X0:  # samples computed from the model's output: pull the cotangents back to it
        Vc = torch.autograd.grad(X, X0, Vc, is_grads_batched=True, retain_graph=True)[0]
    (gX,) = torch.autograd.grad(loss, X0, retain_graph=bool(direct))
    V = torch.cat([gX.detach()[None], Vc.to(gX.dtype)], 0).reshape(-1, X0.shape[1])
    G = eng.backward(V, params)
    rows = []
    for p in params:
        Gp = G.get(id(p))
        if Gp is None:  # a parameter the forward did not use
            Gp = torch.zeros((M + 1,) + tuple(p.shape), dtype=p.dtype, device=p.device)
        if id(p) in g_direct:
            Gp = torch.cat([g_direct[id(p)][None].to(Gp.dtype), Gp[1:]], 0)
        rows.append(Gp.reshape(M + 1, -1))
    Gall = torch.cat(rows, 1)
    return Gall[0], Gall[1:]
