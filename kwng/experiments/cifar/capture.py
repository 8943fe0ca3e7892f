"""The CIFAR training step replayed from a CUDA graph (book chapter
:ref:`experiments-cifar`).

:class:`StepRunner` runs one training step of a run (forward, the method's update, the
epoch's device-side sums) either eagerly or, on CUDA with ``capture=True``, from a CUDA
graph recorded once per batch shape and step size. The step function must leave every
piece of state that outlives a step in tensors updated in place (the Levenberg–Marquardt
rule of :mod:`kwng.engine.lm`, the preconditioner's counters, the sums of
:class:`~kwng.experiments.cifar.metrics.EpochStats`) and must never wait for the device:
a replay runs the recorded kernels only, no Python.

The life of one batch shape, at one step size:

1. the first ``warmup`` steps run eagerly on a side stream, on the same static input
   buffers the graph will read (optimizer state, cuDNN's algorithm choices and the
   fast path's buffers come into existence);
2. the next step is recorded (:func:`kwng.engine.capture.record_graph`) and then
   replayed: recording runs nothing, so the replay is that step;
3. every later step copies its batch into the static buffers and replays.

A step size is a Python number the recorded kernels hold as a constant (``torch.optim``
reads ``lr`` on the host, and so does the ε rule's predicted decrease), so a change of
the step size (the schedule's milestones) records the graph again. Each batch shape has
its own graph (an epoch whose last batch is smaller has two).

A preconditioner that rebuilds its kernel system every ``k > 1`` steps (``cache``, its
:class:`kwng.engine.amortized.SystemCache`) runs two programs: the warm-up alternates
them and two graphs are recorded per batch shape and step size, the replay taking the
one the cache's host-side counter names (:func:`kwng.engine.capture.amortized_replay`).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

__all__ = ["StepRunner"]

log = logging.getLogger(__name__)

class StepRunner:
    """Calls ``step_fn(z, y)`` for each batch, eagerly or replayed from a CUDA graph.

    ``lr_fn`` returns the current step size (a change records the graph again);
    ``capture`` is honoured only on a CUDA ``device`` (elsewhere the steps run eagerly,
    with a warning, and ``capture`` reads ``False``). The attributes ``captures``,
    ``replays`` and ``eager`` count the recordings, the replayed steps and the eager
    ones. ``cache``: the amortized preconditioner's system cache, or ``None``."""

    def __init__(self, step_fn: Callable[[torch.Tensor, torch.Tensor], None],
                 device: torch.device, capture: bool, lr_fn: Callable[[], float],
                 warmup: int = 3, cache=None) -> None:
        if not callable(step_fn) or not callable(lr_fn):
            raise ValueError("step_fn and lr_fn must be callables")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be an integer >= 1, got {warmup!r}")
        self.step_fn, self.lr_fn, self.warmup = step_fn, lr_fn, warmup
        self.cache = cache if cache is not None and cache.every > 1 else None
        if self.cache is not None:
            self.warmup = max(warmup, 2)  # at least one step of each kind
        self.device = torch.device(device)
        self.capture = bool(capture) and self.device.type == "cuda"
        if capture and not self.capture:
            log.warning("capture needs a CUDA device: the steps run eagerly on %s",
                        self.device)
        self._static: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._warm: dict[tuple, int] = {}
        self._graphs: dict[tuple, tuple[float, Callable[[], None]]] = {}
        self.captures = self.replays = self.eager = 0

    def __repr__(self) -> str:
        return (f"StepRunner(capture={self.capture}, captures={self.captures}, "
                f"replays={self.replays}, eager={self.eager})")

    def __call__(self, z: torch.Tensor, y: torch.Tensor) -> None:
        if not self.capture:
            self.step_fn(z, y)
            self.eager += 1
            return
        shape = (tuple(z.shape), z.dtype, tuple(y.shape))
        if shape not in self._static:
            fmt = (torch.channels_last if z.dim() == 4 and not z.is_contiguous()
                   and z.is_contiguous(memory_format=torch.channels_last)
                   else torch.contiguous_format)
            self._static[shape] = (torch.empty_like(z, memory_format=fmt),
                                   torch.empty_like(y))
            self._warm[shape] = 0
        sz, sy = self._static[shape]
        sz.copy_(z)
        sy.copy_(y)
        lr = float(self.lr_fn())
        held = self._graphs.get(shape)
        if held is not None and held[0] == lr:
            held[1]()
            self.replays += 1
            return
        if self._warm[shape] < self.warmup:  # eager warm-up on a side stream
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                if self.cache is not None:
                    with self.cache.forced(self._warm[shape] % 2 == 0):
                        self.step_fn(sz, sy)
                else:
                    self.step_fn(sz, sy)
            torch.cuda.current_stream(self.device).wait_stream(side)
            self._warm[shape] += 1
            self.eager += 1
            return
        if held is not None:  # the step size changed: drop the old graph first
            del self._graphs[shape]
            del held
        from kwng.engine.capture import amortized_replay, record_graph

        torch.cuda.synchronize(self.device)
        if self.cache is not None:
            def record():
                return record_graph(lambda: self.step_fn(sz, sy))

            replay = amortized_replay(self.cache, record)
        else:
            replay = record_graph(lambda: self.step_fn(sz, sy)).replay
        self._graphs[shape] = (lr, replay)
        self.captures += 1
        log.info("recorded the training step in a CUDA graph (batch %s, lr %g)",
                 shape[0], lr)
        replay()  # recording ran nothing: this is the step of this batch
        self.replays += 1
