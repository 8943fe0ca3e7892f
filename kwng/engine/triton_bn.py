"""Triton kernels of the per-copy batch-norm backward of the replicated engine
(:mod:`kwng.engine.replicate_bn`, whose
:func:`~kwng.engine.replicate_bn.bn_backward_torch` is the one definition of the
formulas).

For ``R`` stacked cotangents ``dy`` of one layer, for every copy ``r`` and channel
``c``: ``dβ[r, c] = Σ_s dy[r, s, c]``, ``dγ[r, c] = Σ_s dy[r, s, c] · x̂[s, c]`` and
``dx[r, s, c] = a[c] · dy[r, s, c] + b[r, c] + k[r, c] · x̂[s, c]``. With eager PyTorch
operations this is seven passes over the ``R``-fold tensor; here it is two: a reduction
reading ``dy`` once (``x`` once per copy, mostly from L2) and writing per-split partial
sums, then an elementwise pass. Sums accumulate in float32. :func:`bn_backward` takes
channels innermost (channels_last, 2-D), :func:`bn_backward_nchw` the NCHW layout.
"""

from __future__ import annotations

import functools

import torch

from kwng.engine.triton_support import triton

if triton is not None:
    import triton.language as tl

__all__ = ["bn_backward", "bn_backward_nchw"]

if triton is not None:

    @triton.jit
    def _channel_block(
        mean_ptr, invstd_ptr, C, BC: tl.constexpr, axis: tl.constexpr = 0
    ):
        """The channel block of program axis ``axis``: its indices, mask, μ and σ⁻¹."""
        cols = tl.program_id(axis) * BC + tl.arange(0, BC)
        cmask = cols < C
        mean = tl.load(mean_ptr + cols, mask=cmask, other=0.0)
        return cols, cmask, mean, tl.load(invstd_ptr + cols, mask=cmask, other=0.0)

    @triton.jit
    def _bn_tile(d_ptr, x_ptr, mean, invstd, rows, cols, cmask, base, S, C):
        """One ``(rows, cols)`` tile of copy ``base``: ``dy`` and ``x̂`` in float32,
        the offsets of the tile in a ``(S, C)`` matrix, and its mask."""
        m = (rows < S)[:, None] & cmask[None, :]
        off = rows.to(tl.int64)[:, None] * C + cols[None, :]
        dv = tl.load(d_ptr + base + off, mask=m, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
        return dv, (xv - mean[None, :]) * invstd[None, :], off, m

    @triton.jit
    def _reduce_kernel(
        d_ptr,
        x_ptr,
        mean_ptr,
        invstd_ptr,
        part_ptr,
        S,
        C,
        R,
        TILES: tl.constexpr,
        BS: tl.constexpr,
        BC: tl.constexpr,
    ):
        ps = tl.program_id(1)
        r = tl.program_id(2)
        cols, cmask, mean, invstd = _channel_block(mean_ptr, invstd_ptr, C, BC)
        base = r.to(tl.int64) * S * C
        acc_b = tl.zeros([BS, BC], dtype=tl.float32)
        acc_g = tl.zeros([BS, BC], dtype=tl.float32)
        start = ps * (TILES * BS)
        for i in range(TILES):  # a constexpr trip count (the interpreter needs one)
            rows = start + i * BS + tl.arange(0, BS)
            dv, xh, _, _ = _bn_tile(
                d_ptr, x_ptr, mean, invstd, rows, cols, cmask, base, S, C
            )
            acc_b += dv
            acc_g += dv * xh
        out = part_ptr + (ps * R + r).to(tl.int64) * 2 * C
        tl.store(out + cols, tl.sum(acc_b, 0), mask=cmask)
        tl.store(out + C + cols, tl.sum(acc_g, 0), mask=cmask)

    @triton.jit
    def _dx_kernel(
        d_ptr,
        x_ptr,
        dx_ptr,
        mean_ptr,
        invstd_ptr,
        a_ptr,
        b_ptr,
        k_ptr,
        dxi_ptr,
        S,
        C,
        R,
        BS: tl.constexpr,
        BC: tl.constexpr,
        INTERLEAVED: tl.constexpr,
    ):
        pss = tl.program_id(0)
        r = tl.program_id(2)
        cols, cmask, mean, invstd = _channel_block(mean_ptr, invstd_ptr, C, BC, axis=1)
        rows = pss * BS + tl.arange(0, BS)
        a = tl.load(a_ptr + cols, mask=cmask, other=0.0)
        b = tl.load(b_ptr + r * C + cols, mask=cmask, other=0.0)
        k = tl.load(k_ptr + r * C + cols, mask=cmask, other=0.0)
        base = r.to(tl.int64) * S * C
        dv, xh, off, m = _bn_tile(
            d_ptr, x_ptr, mean, invstd, rows, cols, cmask, base, S, C
        )
        dx = (a[None, :] * dv + b[None, :] + k[None, :] * xh).to(
            dx_ptr.dtype.element_ty
        )
        tl.store(dx_ptr + base + off, dx, mask=m)
        if INTERLEAVED:  # also as (S, R, C): row s of copy r at (s·R + r)·C
            ioff = (rows.to(tl.int64)[:, None] * R + r) * C + cols[None, :]
            tl.store(dxi_ptr + ioff, dx, mask=m)

    @triton.jit
    def _nchw_tile(d_ptr, x_ptr, mean, invstd, n, ls, c, r, N, C, L):
        """Rows ``n`` × pixels ``ls`` of channel ``c`` of copy ``r`` (NCHW): ``dy`` and
        ``x̂`` in float32, the tile's offsets in one copy, and its mask."""
        m = (n < N)[:, None] & (ls < L)[None, :]
        off = (n.to(tl.int64)[:, None] * C + c) * L + ls[None, :]
        base = r.to(tl.int64) * N * C * L
        dv = tl.load(d_ptr + base + off, mask=m, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + off, mask=m, other=0.0).to(tl.float32)
        return dv, (xv - mean) * invstd, off, m

    @triton.jit
    def _reduce_nchw_kernel(
        d_ptr,
        x_ptr,
        mean_ptr,
        invstd_ptr,
        part_ptr,
        N,
        C,
        L,
        R,
        NT: tl.constexpr,
        LT: tl.constexpr,
        BN: tl.constexpr,
        BL: tl.constexpr,
    ):
        c = tl.program_id(0)
        ps = tl.program_id(1)
        r = tl.program_id(2)
        mean = tl.load(mean_ptr + c)
        invstd = tl.load(invstd_ptr + c)
        acc_b = tl.zeros([BN, BL], dtype=tl.float32)
        acc_g = tl.zeros([BN, BL], dtype=tl.float32)
        for i in range(NT):  # constexpr trip counts (the interpreter needs them)
            n = (ps * NT + i) * BN + tl.arange(0, BN)
            for j in range(LT):
                ls = j * BL + tl.arange(0, BL)
                dv, xh, _, _ = _nchw_tile(
                    d_ptr, x_ptr, mean, invstd, n, ls, c, r, N, C, L
                )
                acc_b += dv
                acc_g += dv * xh
        out = part_ptr + (ps * R + r).to(tl.int64) * 2 * C
        tl.store(out + c, tl.sum(tl.sum(acc_b, 1), 0))
        tl.store(out + C + c, tl.sum(tl.sum(acc_g, 1), 0))

    @triton.jit
    def _dx_nchw_kernel(
        d_ptr,
        x_ptr,
        dx_ptr,
        mean_ptr,
        invstd_ptr,
        a_ptr,
        b_ptr,
        k_ptr,
        dxi_ptr,
        N,
        C,
        L,
        R,
        LT: tl.constexpr,
        BN: tl.constexpr,
        BL: tl.constexpr,
        INTERLEAVED: tl.constexpr,
    ):
        pn = tl.program_id(0)
        c = tl.program_id(1)
        r = tl.program_id(2)
        mean = tl.load(mean_ptr + c)
        invstd = tl.load(invstd_ptr + c)
        a = tl.load(a_ptr + c)
        b = tl.load(b_ptr + r * C + c)
        k = tl.load(k_ptr + r * C + c)
        n = pn * BN + tl.arange(0, BN)
        base = r.to(tl.int64) * N * C * L
        for j in range(LT):
            ls = j * BL + tl.arange(0, BL)
            dv, xh, off, m = _nchw_tile(
                d_ptr, x_ptr, mean, invstd, n, ls, c, r, N, C, L
            )
            dx = (a * dv + b + k * xh).to(dx_ptr.dtype.element_ty)
            tl.store(dx_ptr + base + off, dx, mask=m)
            if INTERLEAVED:  # also as (N, R, C, L): copy r of sample n at (n·R + r)·C
                ioff = ((n.to(tl.int64)[:, None] * R + r) * C + c) * L + ls[None, :]
                tl.store(dxi_ptr + ioff, dx, mask=m)


def _coefficients(part: torch.Tensor, scale: torch.Tensor, S: int, use_batch: bool):
    """``dγ``, ``dβ`` ``(R, C)`` from the per-split partial sums ``(split, R, 2, C)``,
    and the coefficients ``b = −a dβ / S``, ``k = −a dγ / S`` of the ``dx`` pass."""
    sums = part.sum(0)
    dbeta, dgamma = sums[:, 0], sums[:, 1]
    if not use_batch:
        return dgamma, dbeta, torch.zeros_like(dbeta), torch.zeros_like(dbeta)
    return dgamma, dbeta, -(scale * dbeta) / S, -(scale * dgamma) / S


def _outputs(d: torch.Tensor, stacked_shape: tuple, interleaved: bool):
    """``dx`` like ``d``, and the stacked copy (or ``dx`` again as a placeholder)."""
    dx = torch.empty_like(d)
    if not interleaved:
        return dx, dx
    return dx, torch.empty(stacked_shape, dtype=d.dtype, device=d.device)


def bn_backward_nchw(
    d: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    scale: torch.Tensor,
    use_batch: bool,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`bn_backward` for the NCHW layout: ``d`` is a contiguous ``(R, N, C, L)``
    (``L`` pixels a channel) and ``x`` a contiguous ``(N, C, L)``; the optional second
    output is ``dx`` laid out as ``(N, R, C, L)``."""
    R, N, C, L = d.shape
    if x.shape != (N, C, L) or not (d.is_contiguous() and x.is_contiguous()):
        raise ValueError(
            f"bn_backward_nchw needs contiguous d (R, N, C, L) and x (N, C, L), got "
            f"{tuple(d.shape)} and {tuple(x.shape)}"
        )
    BL = min(1024, triton.next_power_of_2(L))
    BN = max(1, 4096 // BL)
    LT = triton.cdiv(L, BL)
    n_tiles = triton.cdiv(N, BN)
    # about 4 programs a multiprocessor, each at least one tile of samples
    split = max(1, min(n_tiles, triton.cdiv(4 * _multiprocessors(d.device), C * R)))
    NT = triton.cdiv(n_tiles, split)
    split = triton.cdiv(n_tiles, NT)
    f32 = torch.float32
    part = torch.empty((split, R, 2, C), dtype=f32, device=d.device)
    _reduce_nchw_kernel[(C, split, R)](
        d, x, mean, invstd, part, N, C, L, R, NT=NT, LT=LT, BN=BN, BL=BL
    )
    dgamma, dbeta, b, k = _coefficients(part, scale, N * L, use_batch)
    dx, dxi = _outputs(d, (N, R, C, L), interleaved)
    _dx_nchw_kernel[(n_tiles, C, R)](
        d,
        x,
        dx,
        mean,
        invstd,
        scale,
        b,
        k,
        dxi,
        N,
        C,
        L,
        R,
        LT=LT,
        BN=BN,
        BL=BL,
        INTERLEAVED=interleaved,
    )
    return dx, dgamma, dbeta, dxi if interleaved else None


def _blocks(C: int) -> tuple[int, int]:
    BC = min(64, triton.next_power_of_2(C))
    return max(16, 4096 // BC), BC  # about 4096 elements a tile


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def bn_backward(
    d: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    scale: torch.Tensor,
    use_batch: bool,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dx, dγ, dβ)`` of ``R`` copies: ``d`` is ``(R, S, C)`` and ``x`` ``(S, C)``,
    both with unit channel stride and rows of stride ``C``; ``mean``, ``invstd`` and
    ``scale`` (``a = γ σ⁻¹``) are float32 ``(C,)``. ``use_batch=False`` (running
    statistics) drops ``b`` and ``k``. Returns ``dx`` shaped like ``d`` in ``d``'s
    dtype, ``dγ`` and ``dβ`` as float32 ``(R, C)``, and with ``interleaved=True``
    also ``dx`` laid out as ``(S, R, C)`` (the stacked layout of
    :func:`kwng.engine.replicate_layers.stack_copies`; else None)."""
    R, S, C = d.shape
    if x.shape != (S, C) or d.stride() != (S * C, C, 1) or x.stride() != (C, 1):
        raise ValueError(
            f"bn_backward needs d (R, S, C) and x (S, C) with contiguous "
            f"channels, got {tuple(d.shape)} strides {d.stride()} and "
            f"{tuple(x.shape)} strides {x.stride()}"
        )
    BS, BC = _blocks(C)
    nc = triton.cdiv(C, BC)
    # about 4 programs a multiprocessor (16 measured slower on an H200), each >= a tile
    target = 4 * _multiprocessors(d.device)
    split = max(1, min(triton.cdiv(S, BS), triton.cdiv(target, nc * R)))
    rows_per_split = triton.cdiv(triton.cdiv(S, split), BS) * BS
    split = triton.cdiv(S, rows_per_split)
    f32 = torch.float32
    part = torch.empty((split, R, 2, C), dtype=f32, device=d.device)
    _reduce_kernel[(nc, split, R)](
        d, x, mean, invstd, part, S, C, R, TILES=rows_per_split // BS, BS=BS, BC=BC
    )
    dgamma, dbeta, b, k = _coefficients(part, scale, S, use_batch)
    dx, dxi = _outputs(d, (S, R, C), interleaved)
    BSX = 2 * BS  # 8192-element tiles: measured a little faster than 4096 here
    _dx_kernel[(triton.cdiv(S, BSX), nc, R)](
        d,
        x,
        dx,
        mean,
        invstd,
        scale,
        b,
        k,
        dxi,
        S,
        C,
        R,
        BS=BSX,
        BC=BC,
        INTERLEAVED=interleaved,
    )
    return dx, dgamma, dbeta, dxi if interleaved else None
