"""The fast step's direction in four passes over ``T``: Triton kernels for the end of
a KWNG step on the GPU (:func:`kwng.engine.precond.device_direction`, where
:func:`kwng.engine.gpu_paths.use_kernels` selects them).

After the backward pass, the step needs, from ``T`` (``M × q``, ``q`` the parameter
count) and ``g`` (``q``), the direction of Prop. 6 with the whitening ``W`` of
:func:`kwng.solve.cholesky_whitening`::

    T̃ = W T,   D_i = max(‖T̃_{·,i}‖, f · max_j ‖T̃_{·,j}‖),
    w = (T̃ D⁻¹ T̃ᵀ + λε W K Wᵀ + (ε/N) I)⁻¹ T̃ D⁻¹ g,   ĝ = (D⁻¹ g − D⁻¹ T̃ᵀ w) / ε,

then the treatment of degenerate columns (:func:`kwng.solve.loss_only_columns`), the
safeguard and the clipping of :func:`kwng.solve.safeguard` (``f`` is
``kwng.solve.DAMPING_FLOOR``), and it writes ``ĝ`` into the parameters' gradient
buffer. The one definition is :func:`kwng.engine.precond.direction_into` (those
PyTorch functions; eagerly about thirty passes over ``q``-vectors and seven over
``M × q`` matrices; the timings, compiled too, are the ``direction`` part of the record
``results/benchmarks/engine_parts.json``). Here it is four
kernels (:mod:`kwng.engine.triton_solve_kernels`):

1. the column norms of ``T̃`` (or ``T``) and their maximum;
2. the ``M × M`` system and right-hand side (float32 sums per tile, added in float64);
3. ``ĝ`` before the treatment of degenerate columns, and every sum the rest needs:
   ``‖ĝ_rest‖²``, ``‖g_rest‖²``, ``⟨g, ĝ⟩`` and ``‖ĝ‖²`` split by column kind, counts;
4. the final, clipped direction, written in the parameters' dtype.

The scalars in between (the ``M × M`` Cholesky solve, the scale of the degenerate
columns, ``⟨g, ĝ⟩``, the fallback and the clipping) are a handful of 0-dim tensors: no
host synchronisation. The kernels implement the dampings :data:`FUSED_DAMPINGS` and
refuse any other (:func:`fused_available` raises), and they follow the fallback rule of
the PyTorch path: a failed Cholesky factorisation of the system gives the Euclidean
gradient, or no step with ``fallback="skip"``. The results equal those of the PyTorch
path up to float32 rounding, for every damping of ``kwng.solve.DAMPINGS``
(``tests/triton_interpret_checks.py``).
"""

from __future__ import annotations

import torch

from kwng import solve
from kwng.engine.triton_solve_kernels import SUMS
from kwng.engine.triton_support import available, triton

if triton is not None:
    from kwng.engine.triton_solve_kernels import (
        _norms_kernel,
        _raw_kernel,
        _system_kernel,
        _write_kernel,
    )

__all__ = ["FUSED_DAMPINGS", "FUSED_MAX_M", "fused_available", "fused_direction"]

_F64 = torch.float64
#: The dampings (``kwng.solve.DAMPINGS``) the kernels implement.
FUSED_DAMPINGS = ("identity", "T", "T_tilde")
#: The largest ``M`` the kernels take (they unroll loops over the ``M`` rows).
FUSED_MAX_M = 24


def fused_available(T: torch.Tensor, g: torch.Tensor, damping: str) -> bool:
    """Whether :func:`fused_direction` takes ``T`` and ``g``: a damping of
    :data:`FUSED_DAMPINGS`, contiguous float32, ``T`` of ``M ≤ FUSED_MAX_M`` rows, where
    the Triton kernels run. Any other damping gives ``False``: the compiled PyTorch
    path computes it, or raises for a name it does not define
    (:func:`kwng.solve.damping_diagonal`)."""
    return (
        damping in FUSED_DAMPINGS
        and triton is not None
        and T.dim() == 2
        and T.shape[0] <= FUSED_MAX_M
        and T.dtype == g.dtype == torch.float32
        and T.is_contiguous()
        and g.is_contiguous()
        and g.shape == T.shape[1:]
        and available(T)
    )


def _tiles(M: int) -> tuple[int, int]:
    """Rows padded to a power of two, and the column tile (``MP × BQ`` ≤ 4096)."""
    MP = max(2, triton.next_power_of_2(M))
    return MP, max(128, 4096 // MP)


def _norms(W32, T, damping):
    """Pass 1: the column norms of ``T̃`` (``T`` for ``"T"``) and the floor below
    which a column is degenerate (``identity``: no norms, ``D = 1``)."""
    (M, q), dev = T.shape, T.device
    thr = torch.ones((), dtype=torch.float32, device=dev)
    if damping == "identity":
        return torch.empty(1, dtype=torch.float32, device=dev), thr
    MP, BQ = _tiles(M)
    norms = torch.empty(q, dtype=torch.float32, device=dev)
    progs = triton.cdiv(q, BQ)
    bmax = torch.empty(progs, dtype=torch.float32, device=dev)
    _norms_kernel[(progs,)](W32, T, norms, bmax, q, M=M, MP=MP, BQ=BQ,
                            TILDE=damping == "T_tilde")
    low = solve.DAMPING_FLOOR * bmax.amax()
    return norms, torch.where(low > 0, low, thr)  # all columns zero: D = 1


def _solution(W, W32, T, K, g, norms, thr, eps64, N, lam, ident):
    """Pass 2 and the ``M × M`` Cholesky solve: ``w`` (float64) and whether the
    factorisation failed."""
    (M, q), dev = T.shape, T.device
    MP, BQ = _tiles(M)
    chunks = 16
    progs = triton.cdiv(q, BQ * chunks)
    a_part = torch.empty((progs, MP, MP), dtype=torch.float32, device=dev)
    v_part = torch.empty((progs, MP), dtype=torch.float32, device=dev)
    _system_kernel[(progs,)](W32, T, norms, thr, g, a_part, v_part, q, M=M, MP=MP,
                             BQ=BQ, CHUNKS=chunks, IDENT=ident)
    eye = torch.eye(M, dtype=_F64, device=dev)
    A = a_part.sum(0, dtype=_F64)[:M, :M] + (eps64 / N) * eye
    if lam > 0:
        A = A + lam * eps64 * (W @ K.to(_F64) @ W.mT)
    L, info = torch.linalg.cholesky_ex(A)
    sol = torch.cholesky_solve(v_part.sum(0, dtype=_F64)[:M, None], L)[:, 0]
    return sol, info != 0


def _raw(W32, T, g, norms, thr, sol, eps, ident):
    """Pass 3: ``ĝ`` before the degenerate columns, and the sums ``SUMS``."""
    (M, q), dev = T.shape, T.device
    MP, BQ = _tiles(M)
    d = torch.empty(q, dtype=torch.float32, device=dev)
    chunks = 4
    progs = triton.cdiv(q, BQ * chunks)
    parts = torch.empty((progs, len(SUMS)), dtype=torch.float32, device=dev)
    _raw_kernel[(progs,)](W32, T, norms, thr, g, sol.to(torch.float32),
                          eps.to(torch.float32), d, parts, q, M=M, MP=MP, BQ=BQ,
                          CHUNKS=chunks, IDENT=ident, NS=len(SUMS))
    return d, dict(zip(SUMS, parts.sum(0, dtype=_F64).unbind()))


def fused_direction(
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
    out: torch.Tensor,
    fallback: str = "gradient",
) -> dict[str, torch.Tensor]:
    """The clipped KWNG direction written into ``out`` (``q``, any float dtype), and
    the 0-dim tensors of :data:`kwng.engine.precond.INFO_KEYS` (the same
    values as :func:`kwng.engine.precond.direction_into`, see the module
    docstring; ``fallback`` as :func:`kwng.solve.safeguard`'s). Needs
    :func:`fused_available`; ``eps`` is a 0-dim tensor."""
    if fallback not in solve.FALLBACKS:
        raise ValueError(f"fallback must be one of {solve.FALLBACKS}, got {fallback!r}")
    if not fused_available(T, g, damping):
        raise ValueError(
            "fused_direction needs contiguous float32 T (M <= "
            f"{FUSED_MAX_M} rows) and g where the Triton kernels run"
        )
    if out.shape != g.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of shape {tuple(g.shape)}")
    M, q = T.shape
    rcond = solve.default_rcond(M, CCt.dtype) if rcond is None else rcond
    W, ok, rank = solve.cholesky_whitening(CCt, rcond)
    W32 = W.to(torch.float32).contiguous()
    ident = damping == "identity"
    norms, thr = _norms(W32, T, damping)
    sol, failed = _solution(W, W32, T, K, g, norms, thr, eps.to(_F64), N, lam, ident)
    d, sums = _raw(W32, T, g, norms, thr, sol, eps, ident)
    info_out, coef = _epilogue(sums, failed, clip_norm, fallback == "skip")
    BW = 2048
    _write_kernel[(triton.cdiv(q, BW),)](d, g, norms, thr, coef, out, q, BQ=BW,
                                         IDENT=ident)
    info_out.update(rank=rank, ill_conditioned=~ok)
    return info_out


def _epilogue(
    s: dict[str, torch.Tensor], failed: torch.Tensor, clip_norm: float | None,
    skip: bool = False,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """From the sums of pass 3: the scale of the degenerate columns (``‖ĝ_rest‖ /
    ‖g_rest‖``), ``⟨g, ĝ⟩``, the fallback, the clipping; and ``(scale, ratio,
    code)`` for pass 4 (``code``: 0 the direction, 1 ``g``, 2 zero, a failed direction
    with ``skip``). 0-dim tensors only."""
    tiny32 = torch.finfo(torch.float32).tiny
    ratio = s["rest_d2"].sqrt() / s["rest_g2"].sqrt().clamp(min=tiny32)
    ratio = ratio.to(torch.float32).to(_F64)  # the float32 factor pass 4 applies
    r2 = ratio * ratio * s["hit_g2"]
    sq = s["d2"] + r2
    share = (s["low_d2"] + r2) / sq.clamp(min=torch.finfo(_F64).tiny)
    dot = s["gd"] + ratio * s["hit_g2"]
    bad = ~(dot > 0) | (s["nonfinite"] > 0) | failed
    bad = bad | ((s["hit"] > 0) & ~torch.isfinite(ratio))
    grad_norm = s["g2"].sqrt()
    dot = torch.where(bad, torch.zeros_like(dot) if skip else s["g2"], dot)
    norm = torch.where(bad, torch.zeros_like(grad_norm) if skip else grad_norm,
                       sq.sqrt())
    clipped = torch.zeros((), dtype=torch.bool, device=dot.device)
    scale = torch.ones_like(norm)
    if clip_norm is not None:
        clipped = norm > clip_norm
        scale = torch.where(clipped, clip_norm / norm.clamp(min=1e-30), scale)
    coef = torch.stack([scale, ratio, bad.to(_F64) * (2 if skip else 1)]
                       ).to(torch.float32)
    info = {
        "damping_floored": s["low"].long(),
        "floored_share": share,
        "loss_only": s["zero"].long(),
        "dot": dot * scale,
        "fallback": bad,
        "clipped": clipped,
        "grad_norm": grad_norm.to(torch.float32),
        "direction_norm": (norm * scale).to(torch.float32),
    }
    return info, coef
