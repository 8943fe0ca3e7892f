"""The fast step's direction in four passes over ``T``: Triton kernels for the end of
a KWNG step on the GPU (:meth:`kwng.KWNGPreconditioner.step`, fast mode).

After the backward pass, the step needs, from ``T`` (``M × q``, ``q`` the parameter
count) and ``g`` (``q``), the direction of Prop. 6 with the whitening ``W`` of
:func:`kwng.solve.cholesky_whitening`::

    T̃ = W T,   D_i = max(‖T̃_{·,i}‖, f · max_j ‖T̃_{·,j}‖),
    w = (T̃ D⁻¹ T̃ᵀ + λε W K Wᵀ + (ε/N) I)⁻¹ T̃ D⁻¹ g,   ĝ = (D⁻¹ g − D⁻¹ T̃ᵀ w) / ε,

then the treatment of degenerate columns (:func:`kwng.solve.loss_only_columns`), the
safeguard (the Euclidean gradient where ``⟨g, ĝ⟩ ≤ 0`` or ``ĝ`` is not finite) and the
clipping to ``clip_norm`` (``f`` is ``kwng.solve.DAMPING_FLOOR``), and it writes
``ĝ`` into the parameters' gradient buffer.
Written with PyTorch operations (:func:`kwng.solve.kwng_direction`, then the
preconditioner's safeguard) that is about thirty passes over ``q``-vectors and seven
over ``M × q`` matrices. Here it is four kernels, and no ``T̃`` is stored (each pass
recomputes its columns from ``T``, the ``M × M`` matrix ``W`` held in registers). At
``q ≈ 11 M`` (the paper's ResNet-18) and ``M = 5`` on an H100: 3.8 ms against 1.6 ms
per direction, run eagerly (``kwng/experiments/bench/engine_parts.py``). The kernels:

1. the column norms of ``T̃`` (or ``T``) and their maximum;
2. the ``M × M`` system and right-hand side (float32 sums per tile, added in float64);
3. ``ĝ`` before the treatment of degenerate columns, and every sum the rest needs:
   ``‖ĝ_rest‖²``, ``‖g_rest‖²``, ``⟨g, ĝ⟩`` and ``‖ĝ‖²`` split by column kind, counts;
4. the final, clipped direction, written in the parameters' dtype.

The scalars in between (the ``M × M`` Cholesky solve, the scale of the degenerate
columns, ``⟨g, ĝ⟩``, the fallback and the clipping) are a handful of 0-dim tensors: no
host synchronisation. The results equal those of the PyTorch operations up to float32
rounding (``tests/triton_interpret_checks.py``). One deliberate difference: a failed
Cholesky factorisation of the system counts as a fallback here (the PyTorch path relies
on its output not being finite).
"""

from __future__ import annotations

import torch

from kwng import solve
from kwng.engine.triton_ops import GRAM_MAX_M, available, triton

if triton is not None:
    import triton.language as tl

    from kwng.engine.triton_ops import _wt_tile

__all__ = ["fused_available", "fused_direction"]

_F64 = torch.float64
_NSUMS = 11  # the sums of pass 3 (see _SUMS)
_SUMS = (
    "rest_d2",
    "rest_g2",
    "hit_g2",
    "gd",
    "d2",
    "low_d2",
    "g2",
    "nonfinite",
    "low",
    "hit",
    "zero",
)


def fused_available(T: torch.Tensor, g: torch.Tensor, damping: str) -> bool:
    """Whether :func:`fused_direction` takes ``T`` and ``g``: contiguous float32, ``T``
    of ``M ≤ GRAM_MAX_M`` rows, where the Triton kernels run."""
    return (
        triton is not None
        and damping in solve.DAMPINGS
        and T.dim() == 2
        and T.shape[0] <= GRAM_MAX_M
        and T.dtype == g.dtype == torch.float32
        and T.is_contiguous()
        and g.is_contiguous()
        and g.shape == T.shape[1:]
        and available(T)
    )


if triton is not None:

    @triton.jit
    def _scaling(n_ptr, thr_ptr, cols, cm, IDENT: tl.constexpr):
        # D⁻¹ and the floored ("low") columns; identity damping: D = 1, nothing floored
        if IDENT:
            dinv = tl.full(cols.shape, 1.0, tl.float32)
            low = cols < 0
        else:
            n = tl.load(n_ptr + cols, mask=cm, other=0.0)
            thr = tl.load(thr_ptr)
            dinv = 1.0 / tl.maximum(n, thr)
            low = (n < thr) & cm
        return dinv, low

    @triton.jit
    def _chunk(
        w_ptr,
        t_ptr,
        n_ptr,
        thr_ptr,
        g_ptr,
        pid,
        c,
        rows,
        rm,
        q,
        M: tl.constexpr,
        MP: tl.constexpr,
        BQ: tl.constexpr,
        CHUNKS: tl.constexpr,
        IDENT: tl.constexpr,
    ):
        """Chunk ``c`` of program ``pid``: its columns and mask, the ``T̃`` tile,
        ``D⁻¹``, the floored columns and ``g``."""
        cols = (pid.to(tl.int64) * CHUNKS + c) * BQ + tl.arange(0, BQ)
        cm = cols < q
        tt = _wt_tile(w_ptr, t_ptr, cols, cm, rows, rm, q, M, MP, BQ)
        dinv, low = _scaling(n_ptr, thr_ptr, cols, cm, IDENT)
        g = tl.load(g_ptr + cols, mask=cm, other=0.0)
        return cols, cm, tt, dinv, low, g

    @triton.jit
    def _norms_kernel(
        w_ptr,
        t_ptr,
        n_ptr,
        max_ptr,
        q,
        M: tl.constexpr,
        MP: tl.constexpr,
        BQ: tl.constexpr,
        TILDE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        cols = pid.to(tl.int64) * BQ + tl.arange(0, BQ)
        cm = cols < q
        rows = tl.arange(0, MP)
        rm = rows < M
        if TILDE:
            tile = _wt_tile(w_ptr, t_ptr, cols, cm, rows, rm, q, M, MP, BQ)
        else:
            ptrs = t_ptr + rows.to(tl.int64)[:, None] * q + cols[None, :]
            tile = tl.load(ptrs, mask=rm[:, None] & cm[None, :], other=0.0)
        n = tl.sqrt(tl.sum(tile * tile, axis=0))
        tl.store(n_ptr + cols, n, mask=cm)
        tl.store(max_ptr + pid, tl.max(n, axis=0))

    @triton.jit
    def _system_kernel(
        w_ptr,
        t_ptr,
        n_ptr,
        thr_ptr,
        g_ptr,
        a_ptr,
        v_ptr,
        q,
        M: tl.constexpr,
        MP: tl.constexpr,
        BQ: tl.constexpr,
        CHUNKS: tl.constexpr,
        IDENT: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = tl.arange(0, MP)
        rm = rows < M
        a = tl.zeros([MP, MP], dtype=tl.float32)
        v = tl.zeros([MP], dtype=tl.float32)
        for c in range(CHUNKS):
            _, _, tt, dinv, _, g = _chunk(w_ptr, t_ptr, n_ptr, thr_ptr, g_ptr, pid, c,
                                          rows, rm, q, M, MP, BQ, CHUNKS, IDENT)
            ttd = tt * dinv[None, :]
            for j in tl.static_range(M):  # column j of the system: Σ T̃ D⁻¹ T̃_j
                tj = tl.sum(tl.where(rows[:, None] == j, tt, 0.0), axis=0)
                aj = tl.sum(ttd * tj[None, :], axis=1)
                a += tl.where(rows[None, :] == j, aj[:, None], 0.0)
            v += tl.sum(ttd * g[None, :], axis=1)
        tl.store(a_ptr + pid * MP * MP + rows[:, None] * MP + rows[None, :], a)
        tl.store(v_ptr + pid * MP + rows, v)

    @triton.jit
    def _raw_kernel(
        w_ptr,
        t_ptr,
        n_ptr,
        thr_ptr,
        g_ptr,
        sol_ptr,
        eps_ptr,
        d_ptr,
        s_ptr,
        q,
        M: tl.constexpr,
        MP: tl.constexpr,
        BQ: tl.constexpr,
        CHUNKS: tl.constexpr,
        IDENT: tl.constexpr,
        NS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = tl.arange(0, MP)
        rm = rows < M
        sol = tl.load(sol_ptr + rows, mask=rm, other=0.0)
        eps = tl.load(eps_ptr)
        zero = tl.zeros([BQ], dtype=tl.float32)
        rest_d2, rest_g2, hit_g2, gd = zero, zero, zero, zero
        d2, low_d2, g2 = zero, zero, zero
        nonfinite, nlow, nhit, nzero = zero, zero, zero, zero
        for c in range(CHUNKS):
            cols, cm, tt, dinv, low, g = _chunk(w_ptr, t_ptr, n_ptr, thr_ptr, g_ptr,
                                                pid, c, rows, rm, q, M, MP, BQ,
                                                CHUNKS, IDENT)
            corr = tl.sum(tt * sol[:, None], axis=0)
            d = (dinv * g - dinv * corr) / eps  # as kwng.solve.combine
            tl.store(d_ptr + cols, d, mask=cm)
            hit = low & (g != 0)
            rest = cm & (low == 0)
            keep = cm & (hit == 0)
            gg = g * g
            dd = d * d
            rest_d2 += tl.where(rest, dd, 0.0)
            rest_g2 += tl.where(rest, gg, 0.0)
            hit_g2 += tl.where(hit, gg, 0.0)
            gd += tl.where(keep, g * d, 0.0)
            d2 += tl.where(keep, dd, 0.0)
            low_d2 += tl.where(low & keep, dd, 0.0)
            g2 += gg
            x = tl.where(hit, g, d)
            finite = (x - x) == 0  # NaN for inf and NaN
            nonfinite += tl.where(cm & (finite == 0), 1.0, 0.0)
            nlow += tl.where(low, 1.0, 0.0)
            nhit += tl.where(hit, 1.0, 0.0)
            if not IDENT:
                n = tl.load(n_ptr + cols, mask=cm, other=1.0)
                nzero += tl.where(cm & (n == 0) & (g != 0), 1.0, 0.0)
        out = s_ptr + pid * NS
        tl.store(out + 0, tl.sum(rest_d2, axis=0))
        tl.store(out + 1, tl.sum(rest_g2, axis=0))
        tl.store(out + 2, tl.sum(hit_g2, axis=0))
        tl.store(out + 3, tl.sum(gd, axis=0))
        tl.store(out + 4, tl.sum(d2, axis=0))
        tl.store(out + 5, tl.sum(low_d2, axis=0))
        tl.store(out + 6, tl.sum(g2, axis=0))
        tl.store(out + 7, tl.sum(nonfinite, axis=0))
        tl.store(out + 8, tl.sum(nlow, axis=0))
        tl.store(out + 9, tl.sum(nhit, axis=0))
        tl.store(out + 10, tl.sum(nzero, axis=0))

    @triton.jit
    def _write_kernel(
        d_ptr,
        g_ptr,
        n_ptr,
        thr_ptr,
        coef_ptr,
        out_ptr,
        q,
        BQ: tl.constexpr,
        IDENT: tl.constexpr,
    ):
        cols = tl.program_id(0).to(tl.int64) * BQ + tl.arange(0, BQ)
        cm = cols < q
        _, low = _scaling(n_ptr, thr_ptr, cols, cm, IDENT)
        g = tl.load(g_ptr + cols, mask=cm, other=0.0)
        d = tl.load(d_ptr + cols, mask=cm, other=0.0)
        scale = tl.load(coef_ptr)
        ratio = tl.load(coef_ptr + 1)
        bad = tl.load(coef_ptr + 2) != 0
        x = tl.where(low & (g != 0), g * ratio, d)
        x = tl.where(bad, g, x) * scale
        tl.store(out_ptr + cols, x.to(out_ptr.dtype.element_ty), mask=cm)


def _tiles(M: int) -> tuple[int, int]:
    """Rows padded to a power of two, and the column tile (``MP × BQ`` ≤ 4096)."""
    MP = max(2, triton.next_power_of_2(M))
    return MP, max(128, 4096 // MP)


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
    damping_floor: float = solve.DAMPING_FLOOR,
) -> dict[str, torch.Tensor]:
    """The clipped KWNG direction written into ``out`` (``q``, any float dtype), and
    0-dim tensors describing the step: ``rank``, ``ill_conditioned``,
    ``damping_floored``, ``floored_share``, ``loss_only``, ``dot``, ``fallback``,
    ``clipped``, ``grad_norm``, ``direction_norm`` (see the module docstring; the same
    values as :func:`kwng.nystrom_solve_nosync` followed by the preconditioner's
    safeguard). Needs :func:`fused_available`; ``eps`` is a 0-dim tensor."""
    if not fused_available(T, g, damping):
        raise ValueError(
            "fused_direction needs contiguous float32 T (M <= "
            f"{GRAM_MAX_M} rows) and g where the Triton kernels run"
        )
    if out.shape != g.shape or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of shape {tuple(g.shape)}")
    M, q = T.shape
    dev = T.device
    rcond = solve.default_rcond(M, CCt.dtype) if rcond is None else rcond
    W, ok, rank = solve.cholesky_whitening(CCt, rcond)
    W32 = W.to(torch.float32).contiguous()
    MP, BQ = _tiles(M)
    ident = damping == "identity"
    norms = torch.empty(q if not ident else 1, dtype=torch.float32, device=dev)
    thr = torch.ones((), dtype=torch.float32, device=dev)
    if not ident:
        progs = triton.cdiv(q, BQ)
        bmax = torch.empty(progs, dtype=torch.float32, device=dev)
        _norms_kernel[(progs,)](
            W32, T, norms, bmax, q, M=M, MP=MP, BQ=BQ, TILDE=damping == "T_tilde"
        )
        low = damping_floor * bmax.amax()
        thr = torch.where(low > 0, low, torch.ones_like(low))  # all columns zero: D = 1
    chunks = 16
    progs = triton.cdiv(q, BQ * chunks)
    a_part = torch.empty((progs, MP, MP), dtype=torch.float32, device=dev)
    v_part = torch.empty((progs, MP), dtype=torch.float32, device=dev)
    _system_kernel[(progs,)](
        W32,
        T,
        norms,
        thr,
        g,
        a_part,
        v_part,
        q,
        M=M,
        MP=MP,
        BQ=BQ,
        CHUNKS=chunks,
        IDENT=ident,
    )
    eps64 = eps.to(_F64)
    A = a_part.sum(0, dtype=_F64)[:M, :M] + (eps64 / N) * torch.eye(
        M, dtype=_F64, device=dev
    )
    if lam > 0:
        A = A + lam * eps64 * (W @ K.to(_F64) @ W.mT)
    L, info = torch.linalg.cholesky_ex(A)
    sol = torch.cholesky_solve(v_part.sum(0, dtype=_F64)[:M, None], L)[:, 0]
    d = torch.empty(q, dtype=torch.float32, device=dev)
    chunks = 4
    progs = triton.cdiv(q, BQ * chunks)
    parts = torch.empty((progs, _NSUMS), dtype=torch.float32, device=dev)
    _raw_kernel[(progs,)](
        W32,
        T,
        norms,
        thr,
        g,
        sol.to(torch.float32),
        eps.to(torch.float32),
        d,
        parts,
        q,
        M=M,
        MP=MP,
        BQ=BQ,
        CHUNKS=chunks,
        IDENT=ident,
        NS=_NSUMS,
    )
    s = dict(zip(_SUMS, parts.sum(0, dtype=_F64).unbind()))
    info_out, coef = _epilogue(s, info != 0, clip_norm)
    BW = 2048
    _write_kernel[(triton.cdiv(q, BW),)](
        d, g, norms, thr, coef, out, q, BQ=BW, IDENT=ident
    )
    info_out.update(rank=rank, ill_conditioned=~ok)
    return info_out


def _epilogue(
    s: dict[str, torch.Tensor], failed: torch.Tensor, clip_norm: float | None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """From the sums of pass 3: the scale of the degenerate columns (``‖ĝ_rest‖ /
    ‖g_rest‖``), ``⟨g, ĝ⟩``, the fallback, the clipping; and ``(scale, ratio, bad)`` for
    pass 4. 0-dim tensors only."""
    tiny32 = torch.finfo(torch.float32).tiny
    ratio = s["rest_d2"].sqrt() / s["rest_g2"].sqrt().clamp(min=tiny32)
    ratio = ratio.to(torch.float32).to(_F64)  # the float32 factor pass 4 applies
    r2 = ratio * ratio * s["hit_g2"]
    sq = s["d2"] + r2
    share = (s["low_d2"] + r2) / sq.clamp(min=torch.finfo(_F64).tiny)
    dot = s["gd"] + ratio * s["hit_g2"]
    bad = ~(dot > 0) | (s["nonfinite"] > 0) | failed
    bad = bad | ((s["hit"] > 0) & ~torch.isfinite(ratio))
    dot = torch.where(bad, s["g2"], dot)
    grad_norm = s["g2"].sqrt()
    norm = torch.where(bad, grad_norm, sq.sqrt())
    clipped = torch.zeros((), dtype=torch.bool, device=dot.device)
    scale = torch.ones_like(norm)
    if clip_norm is not None:
        clipped = norm > clip_norm
        scale = torch.where(clipped, clip_norm / norm.clamp(min=1e-30), scale)
    coef = torch.stack([scale, ratio, bad.to(_F64)]).to(torch.float32)
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
