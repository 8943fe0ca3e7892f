"""Capture a training step in a CUDA graph and replay it.

A KWNG step on the fast path never waits for the GPU (ε, the fallbacks and the clipping
stay in device tensors), so the whole step — forward, replicated backward, solve,
optimizer update — can be recorded once and replayed: no Python and no kernel launches
per step (the eager and captured rows ``kwng_fast`` and ``kwng_fast_graph`` of the
record ``results/benchmarks/step_cost.json``). Usage (the examples need a CUDA device,
hence ``+SKIP``; ``model``, ``opt``, ``precond``, ``loss_fn`` and ``loader`` are the
training loop's):

>>> z0, y0 = next(iter(loader))                                   # doctest: +SKIP
>>> static_z, static_y = z0.clone(), y0.clone()                   # doctest: +SKIP
>>> def step():                                                   # doctest: +SKIP
...     opt.zero_grad(set_to_none=True)
...     with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
...         X = model(static_z)
...         loss = loss_fn(X.float(), static_y)
...     precond.step(loss, X)
...     opt.step()
>>> replay = capture_step(step, preconditioner=precond)           # doctest: +SKIP
>>> for z, y in loader:                                           # doctest: +SKIP
...     static_z.copy_(z)
...     static_y.copy_(y)
...     replay()

What a replay cannot change: the inputs' addresses and shapes (copy each batch into
the same tensors), and every Python number the step read at capture (the learning rate
of a plain ``torch.optim`` optimizer, for example). Autocast must not cache weight
casts (``cache_enabled=False``), or the replay reads memory freed after the capture.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from kwng._checks import check_int

__all__ = ["amortized_replay", "capture_step", "record_graph", "warmup_kind",
           "warmup_steps"]


def record_graph(step: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """Record one call of ``step`` in a new CUDA graph (the call is recorded, not
    run: the caller replays the graph to run it). cuDNN's benchmark search is off
    while recording, so no trial runs or search workspaces enter the graph; the
    caller has warmed ``step`` up on a side stream first."""
    graph = torch.cuda.CUDAGraph()
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = False
    try:
        with torch.cuda.graph(graph):
            step()
    finally:
        torch.backends.cudnn.benchmark = benchmark
    return graph


def capture_step(step: Callable[[], None], warmup: int = 3,
                 preconditioner: Any = None) -> Callable[[], bool | None]:
    """Run ``step`` ``warmup`` times on a side stream, record one call in a CUDA graph
    and return the graph's replay (a function of no arguments).

    The warm-up lets lazily created state (optimizer buffers, cuDNN's algorithm choices,
    compiled kernels) exist before the capture. During the capture cuDNN's benchmark
    search is switched off, so no trial runs or search workspaces enter the graph.
    Do not call ``torch.cuda.empty_cache()`` while the graph is in use: in the step-cost
    benchmark a replay after it hit an illegal memory access on an H200 (the cache gave
    back memory the graph still uses, most likely the cuBLAS workspace).

    ``preconditioner``: the preconditioner that ``step`` calls, when its ``cache``
    refreshes every ``k > 1`` steps (:class:`kwng.KWNGPreconditioner` with
    ``refresh_every = k``, :class:`kwng.engine.precond.SystemCache`; KFAC,
    :mod:`studies.cifar.kfac_factors`). Its kinds of step are programs of their
    own: at least :func:`warmup_steps` warm-up steps are taken, the steps between
    refreshes are recorded and each replay runs the kind that the cache's host-side
    counter names (:func:`amortized_replay`). A refresh step that can be captured (KWNG)
    is recorded too, the warm-up running each kind first (:func:`warmup_kind`); one
    that cannot ((E)KFAC) runs ``step`` eagerly and the warm-up follows the schedule
    (EKFAC with ``diag_freq > 1`` records two programs between refreshes: a step that
    re-estimates the scalings and one that does not).
    """
    if not callable(step):
        raise ValueError(
            f"step must be a callable of no arguments, got {type(step).__name__}"
        )
    warmup = check_int(warmup, "warmup", 1)
    if not torch.cuda.is_available():
        raise ValueError(
            "capture_step needs a CUDA device (torch.cuda.is_available() is False)"
        )
    cache = getattr(preconditioner, "cache", None)
    two = cache is not None and cache.every > 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(max(warmup, warmup_steps(cache)) if two else warmup):
            with warmup_kind(cache if two else None, i):
                step()
    torch.cuda.current_stream().wait_stream(side)
    if not two:
        return record_graph(step).replay
    return amortized_replay(cache, lambda: record_graph(step), eager=step)


def warmup_steps(cache: Any) -> int:
    """The fewest warm-up steps of a captured loop with the refresh ``cache``: one of
    each recorded program when refreshes are recorded too (KWNG); else two, the first
    an eager refresh ((E)KFAC: a refresh step runs every part of the steps between
    refreshes, EKFAC's re-estimate of the scalings included)."""
    return len(cache.kinds) if cache.refresh_capturable else 2


def warmup_kind(cache: Any, i: int) -> contextlib.AbstractContextManager:
    """The kind of the ``i``-th warm-up step of a captured loop with the refresh
    ``cache`` (``None``: a single program). Every program must run before it is
    recorded: when the cache's refresh step is recorded too (KWNG), the first warm-up
    steps take the recorded kinds in turn (a refresh, then a step between refreshes),
    forced only where the schedule names the other kind, and the later ones follow the
    schedule. A loop from step 0 is thus the eager loop's; a loop resumed between
    refreshes takes one refresh more, at its first step. A cache whose refresh step
    is not recorded ((E)KFAC) follows the schedule throughout (a refresh first, as no
    factors exist yet)."""
    i = check_int(i, "i", 0)
    if cache is None or not cache.refresh_capturable:
        return contextlib.nullcontext()
    kinds = tuple(cache.kinds)
    if i >= len(kinds) or cache.kind == kinds[i]:
        return contextlib.nullcontext()
    return cache.forced(kinds[i])


def amortized_replay(cache: Any, record: Callable[[], Any],
                     eager: Callable[[], None] | None = None) -> Callable[[], bool]:
    """Record each program of ``cache.kinds`` with ``record`` (a function that records
    the step and returns an object with ``replay()``), each under ``cache.forced``
    (:class:`kwng.engine.precond.SystemCache`: a refresh step and a step between
    refreshes); returns the replay that runs, at each call, the graph of the kind
    ``cache.kind`` names, then counts the step. The recordings run no step: the counter
    is left where the warm-up put it.

    A cache whose refresh step cannot be captured (``cache.refresh_capturable`` false,
    :class:`studies.cifar.kfac_factors.FactorSchedule`) lists only the steps
    between refreshes in ``kinds``; a due refresh step (``cache.kind`` is ``None``)
    runs ``eager`` (the step itself, on the same static inputs, outside any graph; it
    counts itself on the cache). The replay returns whether a graph ran."""
    if not cache.refresh_capturable and not callable(eager):
        raise ValueError("eager must be the step (a callable of no arguments) when "
                         "the cache's refresh step cannot be captured, got "
                         f"{type(eager).__name__}")
    steps = cache.steps
    graphs = {}
    for kind in cache.kinds:
        with cache.forced(kind):
            graphs[kind] = record()
    cache.steps = steps
    cache.notify()

    def replay() -> bool:
        kind = cache.kind
        if kind not in graphs:  # a refresh step that runs eagerly
            eager()
            return False
        graphs[kind].replay()
        cache.advance()
        return True

    return replay
