"""Walks of an autograd graph used by the preconditioner (:mod:`kwng.engine.precond`).

They decide how a step obtains ``g`` and ``T``: which parameters the loss reaches
directly (not through the samples), and whether the samples are computed from the
model's output without touching a parameter on the way.
"""

from __future__ import annotations

import torch

__all__ = ["direct_params", "derived_from"]


def direct_params(loss: torch.Tensor, X: torch.Tensor, params: list[torch.Tensor]
                  ) -> list:
    """Parameters that ``loss`` reaches without passing through ``X`` (e.g. an L2
    term)."""
    wanted = {id(p): p for p in params}
    found, seen, stack = {}, set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn is X.grad_fn or id(fn) in seen:
            continue
        seen.add(id(fn))
        var = getattr(fn, "variable", None)
        if var is not None and id(var) in wanted:
            found[id(var)] = var
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return list(found.values())


def derived_from(X: torch.Tensor, X0: torch.Tensor, params: list[torch.Tensor]) -> bool:
    """Whether ``X`` is computed from ``X0`` without touching any of ``params`` on the
    way (e.g. ``X = U·X0`` with a fixed ``U``): then its cotangents map to ``X0``
    exactly."""
    wanted = {id(p) for p in params}
    found, seen, stack = False, set(), [X.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if fn is X0.grad_fn:
            found = True
            continue
        var = getattr(fn, "variable", None)
        if var is not None and id(var) in wanted:
            return False
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return found
