"""The matrix ``T`` of the estimator (§3.2): the kernel derivatives at the basis points
times the Jacobian of the samples with respect to the parameters, from a sampler
(:func:`jacobian_from_sampler`, forward-mode autograd) or from outputs that carry an
autograd graph (:func:`jacobian_from_outputs`, one vector-Jacobian product per basis
point). :mod:`kwng.estimator` builds its estimate on them.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["jacobian_from_sampler", "jacobian_from_outputs"]


def jacobian_from_sampler(sampler: Callable[[torch.Tensor], torch.Tensor],
                          theta: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """``T = ∇_θ τ(θ)`` for a sampler ``θ ↦ X = h_θ(Z)`` with a flat parameter vector.

    ``τ_m(θ) = (1/N) Σ_n ∂_{i_m} k(Y_m, h_θ(Z_n))`` depends on ``θ`` only through ``X``,
    and ``∂τ_m/∂X_{n,j} = C[m, n, j] / N``. The Jacobian ``B = ∂X/∂θ`` (``N × d × q``)
    is computed with forward-mode autograd, then ``T = C B / N`` (shape ``M × q``).
    """
    B = torch.autograd.functional.jacobian(
        sampler, theta, vectorize=True, strategy="forward-mode"
    )
    N = B.shape[0]
    # a float64 C keeps the contraction in float64
    dt = torch.promote_types(C.dtype, B.dtype)
    return torch.einsum("mnj,njq->mq", C.to(dt), B.to(dt)) / N


def jacobian_from_outputs(X: torch.Tensor, params: Sequence[torch.Tensor],
                          C: torch.Tensor, retain_graph: bool = True) -> torch.Tensor:
    """``T`` for outputs ``X`` that carry an autograd graph to ``params`` (reference
    mode).

    One vector-Jacobian product per basis point: ``T_m = (C_m / N)ᵀ ∂X/∂θ``. Returns
    ``(M, q)`` with parameters flattened in the order of ``params``.
    """
    N = X.shape[0]
    rows = []
    for m in range(C.shape[0]):
        keep = retain_graph or m < C.shape[0] - 1
        grads = torch.autograd.grad(X, params, grad_outputs=C[m].to(X.dtype) / N,
                                    retain_graph=keep, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1)
                               for g, p in zip(grads, params)]))
    return torch.stack(rows)
