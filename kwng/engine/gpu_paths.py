"""Which implementation the fast KWNG step runs on CUDA where two exist: the PyTorch
functions compiled by ``torch.compile``, or the hand-written Triton kernels.

Two parts of the fast step have both: the direction at the end of the step
(:func:`kwng.engine.precond.device_direction` against
:mod:`kwng.engine.triton_solve`) and the per-copy batch-norm backward
(:func:`kwng.engine.replicate_bn.bn_backward_torch` against
:mod:`kwng.engine.triton_bn`).
The PyTorch function is the one definition in every pair; a kernel is checked against
it (``tests/triton_interpret_checks.py``) and stays only where it is measurably faster
(the record ``results/benchmarks/engine_parts.json``). The choice is the field
``gpu_solve`` of :class:`kwng.KWNGConfig` (one of :data:`GPU_SOLVES`), handed to the
functions below by the preconditioner that runs them: no process-wide switch.

:func:`compile_on_cuda` compiles a function for CUDA tensors only (``mode="default"``:
no CUDA graphs of inductor's own, so the step stays capturable by
:func:`kwng.engine.capture.capture_step`; the compilation happens at the first call,
i.e. in the eager warm-up before a capture). On the CPU (the test-suite, CI) the
function runs eagerly: compiling costs seconds per shape there and buys nothing.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["GPU_SOLVES", "compile_on_cuda", "use_kernels"]

#: ``"auto"`` (the default): the hand-written kernels where they run, else the compiled
#: PyTorch functions; ``"triton"``: the same, but a CUDA step without Triton is refused
#: instead of falling back; ``"compile"``: the compiled PyTorch functions everywhere on
#: CUDA; ``"eager"``: the PyTorch functions uncompiled (no compiler dispatch per call,
#: which the host time of an eager step pays).
GPU_SOLVES = ("auto", "triton", "compile", "eager")


def use_kernels(t: torch.Tensor, gpu_solve: str = "auto") -> bool:
    """Whether the hand-written kernels take ``t`` under ``gpu_solve``: it is
    ``"auto"`` or ``"triton"`` and :func:`kwng.engine.triton_support.available` holds
    (a CUDA tensor, or a CPU tensor under ``TRITON_INTERPRET=1``). Triton is imported
    only then, never by ``import kwng``.

    >>> use_kernels(torch.zeros(2)), use_kernels(torch.zeros(2), "compile")
    (False, False)
    """
    if gpu_solve not in ("auto", "triton"):
        return False
    interpret = os.environ.get("TRITON_INTERPRET") == "1" and t.device.type == "cpu"
    if not (t.is_cuda or interpret):
        return False
    from kwng.engine import triton_support

    if gpu_solve == "triton" and t.is_cuda and triton_support.triton is None:
        raise ValueError("gpu_solve='triton' but Triton does not import here: install "
                         "it, or use gpu_solve='auto' (the compiled functions then)")
    return triton_support.available(t)


def compile_on_cuda(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled with ``torch.compile`` when its first tensor argument lives on
    CUDA and the keyword ``gpu_solve`` (taken by the wrapper, default ``"auto"``) is
    not ``"eager"``; ``fn`` itself otherwise. The compiler is set up at the first CUDA
    call (``import kwng`` loads no compiler). Each function compiles into one graph
    (``tests/test_step_direction.py`` traces them with ``fullgraph=True``); it is not
    requested here, so a process that meets more shapes than dynamo's recompile limit
    runs the further ones eagerly (dynamo logs it) instead of failing.

    >>> plus_one = compile_on_cuda(lambda x: x + 1)
    >>> plus_one(torch.zeros(2), gpu_solve="compile")  # the CPU: eagerly
    tensor([1., 1.])
    """
    compiled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, gpu_solve: str = "auto", **kwargs: Any) -> Any:
        first = next(a for a in args if isinstance(a, torch.Tensor))
        if not first.is_cuda or gpu_solve == "eager":
            return fn(*args, **kwargs)
        if not compiled:
            compiled.append(torch.compile(fn, mode="default"))
        return compiled[0](*args, **kwargs)

    return call
