"""Where the engine's Triton kernels (:mod:`kwng.engine.triton_bn`,
:mod:`kwng.engine.triton_solve`) run: :func:`available` holds for CUDA tensors when
Triton imports, and for CPU tensors under ``TRITON_INTERPRET=1`` (Triton's interpreter,
how the test-suite checks the kernels against the PyTorch functions).
:func:`kwng.engine.gpu_paths.use_kernels` decides whether they are used; ``import kwng``
does not import this module.

The replicated engine's repeat and relayout had kernels too; measured against their
compiled PyTorch functions on one H100 in one run (the ``repeat`` and ``relayout``
parts of the record ``results/benchmarks/engine_parts.json``) they saved less than the
rule's allowance (the larger of 0.3 ms and 5 % of the captured step), so they were
deleted.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

log = logging.getLogger(__name__)

try:  # optional: without Triton (or on the CPU) the engine uses PyTorch operations
    import triton
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

__all__ = ["available", "triton"]

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
        "KWNG fast mode on CUDA without Triton: the per-copy batch norm and the "
        "direction use the compiled PyTorch functions"
    )
