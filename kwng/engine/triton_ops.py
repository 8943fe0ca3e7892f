"""Triton kernels of the replicated engine's repeat and relayout
(:mod:`kwng.engine.replicate`), and where the engine's kernels run.

* :func:`repeat` — the ``R``-fold copy of an activation in the replicated forward,
  reading it once (``torch.cat`` reads it ``R`` times): the kernel form of
  :func:`kwng.engine.replicate_layers.repeat_copies`.
* :func:`interleave` — the relayout that stacks the ``R`` copies of an output gradient
  along the channels, for one weight-gradient call per convolution (a convolution
  followed by a batch norm gets it from :func:`kwng.engine.triton_bn.bn_backward` instead,
  which can write its output in that layout too): the kernel form of
  :func:`kwng.engine.replicate_layers.stack_copies`.

:func:`available` says where the kernels (these, :mod:`kwng.engine.triton_bn`,
:mod:`kwng.engine.triton_solve`) run: CUDA tensors when Triton imports, and CPU tensors under
``TRITON_INTERPRET=1`` (Triton's interpreter, how the test-suite checks them against
the PyTorch functions). :func:`kwng.engine.gpu_paths.use_kernels` decides whether they are
used; ``import kwng`` does not import this module.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger(__name__)

try:  # optional: without Triton (or on the CPU) the engine uses PyTorch operations
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

__all__ = ["available", "repeat", "interleave"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

def available(dy: torch.Tensor) -> bool:
    """Whether the kernels run on ``dy``'s device (CUDA, or the Triton interpreter on
    the CPU) in ``dy``'s dtype. On CUDA without Triton it logs once that the slower
    PyTorch operations are used."""
    if dy.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if triton is None:
        if dy.is_cuda:
            _warn_no_triton()
        return False
    return dy.is_cuda or (_INTERPRET and dy.device.type == "cpu")


@functools.lru_cache(maxsize=None)
def _warn_no_triton() -> None:
    log.warning(
        "KWNG fast mode on CUDA without Triton: the per-copy batch norm, repeats, "
        "relayouts and the direction use the compiled PyTorch functions"
    )


if triton is not None:

    @triton.jit
    def _repeat_kernel(src_ptr, dst_ptr, numel, R: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < numel
        v = tl.load(src_ptr + offs, mask=m)
        for r in tl.static_range(R):
            tl.store(dst_ptr + r * numel + offs, v, mask=m)

    @triton.jit
    def _interleave_kernel(
        src_ptr, dst_ptr, P, L, R: tl.constexpr, BP: tl.constexpr, BL: tl.constexpr
    ):
        rows = tl.program_id(0).to(tl.int64) * BP + tl.arange(0, BP)
        cols = tl.program_id(1) * BL + tl.arange(0, BL)
        r = tl.program_id(2).to(tl.int64)
        m = (rows < P)[:, None] & (cols < L)[None, :]
        v = tl.load(src_ptr + (r * P + rows)[:, None] * L + cols[None, :], mask=m)
        tl.store(dst_ptr + (rows * R + r)[:, None] * L + cols[None, :], v, mask=m)


def repeat(
    y0: torch.Tensor, R: int, memory_format: torch.memory_format
) -> torch.Tensor:
    """``R`` copies of ``y0`` stacked along dim 0 in ``memory_format`` (which ``y0``
    must be dense in): ``y0`` read once, written ``R`` times (``torch.cat`` reads it
    ``R`` times)."""
    if not y0.is_contiguous(memory_format=memory_format):
        raise ValueError("repeat needs y0 dense in the given memory format")
    out = torch.empty(
        (R * y0.shape[0],) + tuple(y0.shape[1:]),
        dtype=y0.dtype,
        device=y0.device,
        memory_format=memory_format,
    )
    n = y0.numel()
    BLOCK = 2048
    _repeat_kernel[(triton.cdiv(n, BLOCK),)](y0, out, n, R=R, BLOCK=BLOCK)
    return out


def interleave(dy: torch.Tensor, R: int, fmt: torch.memory_format) -> torch.Tensor:
    """``(R·N, C, H, W)`` → ``(N, R·C, H, W)`` in memory format ``fmt`` (which ``dy``
    must be dense in): copy ``r`` becomes channels ``r·C … (r+1)·C − 1``. One pass,
    rows of ``C`` (channels_last) or ``C·H·W`` (NCHW) elements moved whole."""
    if not dy.is_contiguous(memory_format=fmt):
        raise ValueError("interleave needs dy dense in the given memory format")
    RN, C, H, W = dy.shape
    N = RN // R
    out = torch.empty(
        (N, R * C, H, W), dtype=dy.dtype, device=dy.device, memory_format=fmt
    )
    P, L = (N * H * W, C) if fmt == torch.channels_last else (N, C * H * W)
    BL = min(128, triton.next_power_of_2(L))
    BP = max(1, 4096 // BL)
    grid = (triton.cdiv(P, BP), triton.cdiv(L, BL), R)
    _interleave_kernel[grid](dy, out, P, L, R=R, BP=BP, BL=BL)
    return out
