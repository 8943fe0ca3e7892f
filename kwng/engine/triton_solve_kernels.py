"""The Triton kernels of :mod:`kwng.engine.triton_solve` (the fast step's direction in
four passes over ``T``); the host side, the algorithm and the checks are there.

* ``_norms_kernel`` — the column norms of ``T̃ = W T`` (or ``T``) and their maximum;
* ``_system_kernel`` — the ``M × M`` system ``T̃ D⁻¹ T̃ᵀ`` and right-hand side
  ``T̃ D⁻¹ g`` (float32 sums per tile);
* ``_raw_kernel`` — ``ĝ`` before the treatment of degenerate columns, and the sums
  ``SUMS`` the rest needs;
* ``_write_kernel`` — the final, clipped direction in the parameters' dtype.

No ``T̃`` is stored: each pass recomputes its columns from ``T`` (``_wt_tile``, the
``M × M`` matrix ``W`` held in registers).
"""

from __future__ import annotations

from kwng.engine.triton_support import triton

if triton is not None:
    import triton.language as tl

__all__ = ["SUMS"]

#: The sums of pass 3, in the order ``_raw_kernel`` writes them.
SUMS = ("rest_d2", "rest_g2", "hit_g2", "gd", "d2", "low_d2", "g2", "nonfinite", "low",
        "hit", "zero")

if triton is not None:

    @triton.jit
    def _wt_tile(
        w_ptr,
        t_ptr,
        cols,
        cm,
        rows,
        rm,
        q,
        M: tl.constexpr,
        MP: tl.constexpr,
        BQ: tl.constexpr,
    ):
        """The ``(MP, BQ)`` tile of ``W T`` (``W`` ``(M, M)``, ``T`` ``(M, q)``, both
        contiguous) for the columns ``cols``; rows ``≥ M`` are zero."""
        acc = tl.zeros([MP, BQ], dtype=tl.float32)
        tp = t_ptr + cols
        for k in tl.static_range(M):
            t = tl.load(tp, mask=cm, other=0.0)
            wk = tl.load(w_ptr + rows * M + k, mask=rm, other=0.0)
            acc += wk[:, None] * t[None, :]
            tp += q
        return acc

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
    def _store_sums(out, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10):
        """The eleven per-chunk sums of pass 3 at ``out``, in the order of ``SUMS``."""
        tl.store(out + 0, tl.sum(s0, axis=0))
        tl.store(out + 1, tl.sum(s1, axis=0))
        tl.store(out + 2, tl.sum(s2, axis=0))
        tl.store(out + 3, tl.sum(s3, axis=0))
        tl.store(out + 4, tl.sum(s4, axis=0))
        tl.store(out + 5, tl.sum(s5, axis=0))
        tl.store(out + 6, tl.sum(s6, axis=0))
        tl.store(out + 7, tl.sum(s7, axis=0))
        tl.store(out + 8, tl.sum(s8, axis=0))
        tl.store(out + 9, tl.sum(s9, axis=0))
        tl.store(out + 10, tl.sum(s10, axis=0))

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
        _store_sums(s_ptr + pid * NS, rest_d2, rest_g2, hit_g2, gd, d2, low_d2, g2,
                    nonfinite, nlow, nhit, nzero)

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
        code = tl.load(coef_ptr + 2)  # 0 the direction, 1 g, 2 zero (a skipped step)
        x = tl.where(low & (g != 0), g * ratio, d)
        x = tl.where(code == 1, g, x)
        x = tl.where(code == 2, 0.0, x) * scale
        tl.store(out_ptr + cols, x.to(out_ptr.dtype.element_ty), mask=cm)
