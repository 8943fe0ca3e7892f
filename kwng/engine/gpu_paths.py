"""Which implementation the fast KWNG step runs on CUDA where two exist: the PyTorch
functions compiled by ``torch.compile``, or the hand-written Triton kernels.

Two parts of the fast step have both: the direction at the end of the step
(:func:`kwng.engine.step_direction.step_direction`: :func:`kwng.solve.kwng_direction`
and :func:`kwng.solve.safeguard` against :mod:`kwng.engine.triton_solve`), the per-copy
batch-norm backward (:func:`kwng.engine.replicate_bn.bn_backward_torch` against
:mod:`kwng.engine.triton_bn`). The PyTorch function is the one definition in every pair;
a kernel is checked against it (``tests/triton_interpret_checks.py``) and stays only
where it is measurably faster on the same GPU in the same run
(:mod:`studies.bench.engine_parts`; ``python -m
studies.bench.step_cost --gpu-paths triton,compile`` for the whole step, which
is why this switch stays). On one H100 (``results/benchmarks/engine_parts.json``) both
kernels stayed; the repeat's and the relayout's were deleted.

:func:`compile_on_cuda` compiles a function for CUDA tensors only (``mode="default"``:
no CUDA graphs of inductor's own, so the step stays capturable by
:func:`kwng.engine.capture.capture_step`; the compilation happens at the first call,
i.e. in the eager warm-up before a capture). On the CPU (the test-suite, CI) the
function runs eagerly: compiling costs seconds per shape there and buys nothing the
tests need.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kwng._checks import check_choice

__all__ = ["GPU_PATHS", "gpu_path", "use_gpu_path", "use_kernels", "compile_on_cuda"]

#: ``"triton"``: the hand-written kernels where they run (else the compiled PyTorch
#: functions); ``"compile"``: the compiled PyTorch functions everywhere on CUDA;
#: ``"eager"``: the PyTorch functions uncompiled (no compiler dispatch per call, which
#: the host time of an eager step pays).
GPU_PATHS = ("triton", "compile", "eager")
_current = ["triton"]


def gpu_path() -> str:
    """The path in use (one of :data:`GPU_PATHS`)."""
    return _current[0]


@contextlib.contextmanager
def use_gpu_path(path: str) -> Iterator[None]:
    """Run the block with ``path`` (one of :data:`GPU_PATHS`), for side-by-side
    measurements."""
    check_choice(path, "gpu path", GPU_PATHS)
    old, _current[0] = _current[0], path
    try:
        yield
    finally:
        _current[0] = old


def use_kernels(t: torch.Tensor) -> bool:
    """Whether the hand-written kernels take ``t``: the path is ``"triton"`` and
    :func:`kwng.engine.triton_support.available` holds (a CUDA tensor, or a CPU
    tensor under ``TRITON_INTERPRET=1``). Triton is imported only then, never by
    ``import kwng``."""
    if _current[0] != "triton":
        return False
    interpret = os.environ.get("TRITON_INTERPRET") == "1" and t.device.type == "cpu"
    if not (t.is_cuda or interpret):
        return False
    from kwng.engine import triton_support

    return triton_support.available(t)


def compile_on_cuda(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` compiled with ``torch.compile`` when its first tensor argument lives on
    CUDA and the path is not ``"eager"``, ``fn`` itself otherwise (see the module
    docstring). The compiler is set up at
    the first CUDA call (``import kwng`` loads no compiler). Each function compiles
    into one graph (``tests/test_step_direction.py`` traces them with
    ``fullgraph=True``); it is not requested here, so a process that meets more shapes
    than dynamo's recompile limit runs the further ones eagerly (dynamo logs it)
    instead of failing."""
    compiled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        first = next(a for a in args if isinstance(a, torch.Tensor))
        if not first.is_cuda or _current[0] == "eager":
            return fn(*args, **kwargs)
        if not compiled:
            compiled.append(torch.compile(fn, mode="default"))
        return compiled[0](*args, **kwargs)

    return call
