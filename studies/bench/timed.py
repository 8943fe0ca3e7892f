"""One training step, timed: the step every benchmark times (:func:`training_step`:
zero the gradients, forward, cross-entropy, backward or the preconditioner's step, the
optimizer's step) and the loop that times it (:func:`time_steps`: warm-up calls, then
wall times with the device synchronised after each call), used by
:mod:`studies.bench.step_cost`, :mod:`studies.bench.mode_choice` and
:mod:`studies.bench.ddp_scaling`.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["time_steps", "training_step"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(
    fn: Callable[[], None], device: torch.device, steps: int, warmup: int
) -> list[float]:
    """Wall times in ms of ``steps`` calls of ``fn`` after ``warmup`` calls,
    synchronising after each."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return times


class _Times(list):
    """Step times (ms) with the peak memory of the warm-up (``warm_peak``: first calls,
    compilation, cuDNN's algorithm search) and of the timed steps (``steady_peak``)."""

    warm_peak = steady_peak = 0


def _warm_then_time(fn: Callable[[], None], device: torch.device, steps: int,
                    warmup: int) -> _Times:
    """:func:`time_steps` with the peak memory of the warm-up and of the timed steps
    apart (the step's own footprint, without the first calls' one-off allocations)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    out = _Times()
    if device.type == "cuda":
        out.warm_peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    out.extend(time_steps(fn, device, steps, 0))
    if device.type == "cuda":
        out.steady_peak = torch.cuda.max_memory_allocated(device)
    return out


def training_step(net: nn.Module, opt: torch.optim.Optimizer, z: torch.Tensor,
                  y: torch.Tensor, precond=None, amp: torch.dtype | None = None,
                  optimizer_step: bool = True) -> Callable[[], None]:
    """The timed training step: zero the gradients, forward ``z`` (under autocast to
    ``amp`` when given, without the weight-cast cache, which a CUDA graph would replay
    freed), cross-entropy against ``y`` in float32, then ``loss.backward()`` or
    ``precond.step(loss, X)``, then ``opt.step()`` (skipped when not
    ``optimizer_step``: a forward and backward pass alone)."""
    def autocast():
        return (torch.autocast(z.device.type, dtype=amp, cache_enabled=False)
                if amp is not None else contextlib.nullcontext())

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast():
            X = net(z)
            loss = F.cross_entropy(X.float(), y)
        if precond is None:
            loss.backward()
        else:
            precond.step(loss, X)
        if optimizer_step:
            opt.step()

    return step
