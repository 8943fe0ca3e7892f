"""The amortized KWNG step: ``refresh_every = k`` (:class:`kwng.KWNGConfig`) builds the
kernel system every ``k`` steps and applies it to every step's fresh gradient.

The schedule. Steps are counted from 0 on the host (``SystemCache.steps``, equal to
the preconditioner's ``num_steps``). Step ``s`` is a *refresh* step when ``s % k == 0``,
when nothing is cached yet, or when the cached system does not fit the active parameters
(one frozen since): it is the exact step (basis draw, bandwidth, ``C``, ``K``,
``CCᵀ``, the backward pass(es) for ``g`` and ``T``, the solve), and it stores ``T``,
``CCᵀ``, ``K``, ``N`` and the bandwidth ``σ`` here. Each other step takes one
ordinary backward pass for the fresh ``g`` and applies Prop. 6 to it with the cached
system::

    ĝ = (1/ε)[D⁻¹ − D⁻¹T̃ᵀ(T̃D⁻¹T̃ᵀ + (ε/N) I)⁻¹T̃D⁻¹] g   (T̃ = W T, D from the cached T)

then the safeguard and the clipping, as on every step (``diagonal_only``: ``D⁻¹ g`` with
the cached ``D``). ``k = 1`` stores nothing and is the exact step bit for bit.

The damping ``ε``. The Levenberg–Marquardt rule (App. D.2) runs on every step,
refresh or not: it reads each step's loss and ``⟨g, ĝ⟩``. ``ε`` enters the direction
only through the ``M × M`` system ``T̃D⁻¹T̃ᵀ + (ε/N) I`` and the factor ``1/ε``, so no
factorisation that depends on ``ε`` is cached: only ``T``, ``CCᵀ`` and ``K``, which do
not depend on it. The whitening ``W``, the damping ``D``, the system and its Cholesky
factor are formed again from them on every step (the solve of an exact step: a few
passes over the ``M × q`` block and an ``M × M`` factorisation), so a step between
refreshes is exactly Prop. 6 with the cached system at *this* step's ``ε``
(``tests/test_amortized.py`` checks it in float64) and costs a plain forward and
backward pass plus that solve.

Why it stays a descent direction. By the Woodbury identity the operator above is
``(1/ε)(D + (N/ε) T̃ᵀT̃)⁻¹``, positive definite for any ``T̃`` and any ``D > 0``: a
stale ``T`` changes the metric, never the sign of ``⟨g, ĝ⟩`` (and the safeguard falls
back to ``g`` if round-off does).

The guard (``refresh_guard=True`` of :class:`kwng.KWNGConfig`). A cached system must
not outlive a failure. Two events mark one, both counted by every step already: the
refresh built a rank-deficient ``C Cᵀ`` (``ill_conditioned``: the basis draw or the
network's features have collapsed, so the solve is near singular), or a step's
direction failed and the safeguard fell back to ``g`` (``fallback``). With the guard,
either event raises a flag on the device (inside the step, so a CUDA graph records
it); the host reads the flag of step ``s`` at the end of step ``s + 1`` (without
stalling the device: by then step ``s`` has usually finished), and step ``s + 2``
refreshes. A healthy run raises no flag and takes the unguarded steps bit for bit;
:attr:`SystemCache.guard_refreshes` counts the refreshes the guard caused (each is
logged). The same rule holds eagerly, captured and resumed from a checkpoint. On the
ill-conditioned CIFAR-10 ResNet-18 the runs of ``k = 100`` that stalled showed both
events from their first epochs, and the runs that did not showed neither
(:ref:`cifar-amortized`).

Where it runs.

* ``mode="fast"``: the replicated forward is needed on refresh steps only. The cache
  tells the engine (:class:`kwng.engine.replicate.ReplicatedEngine`) before each step's
  forward whether to replicate (its ``enabled`` flag follows :attr:`SystemCache.due`);
  between refreshes the model runs its own forward. A refresh that the cache forces
  because a parameter was frozen meets an unreplicated forward and takes the serial
  passes once (``serial_steps``).
* ``mode="reference"``: the same schedule; a cached step's direction goes through the
  float64 solve of the reference path. It syncs with the host and is never captured.
* Captured (:func:`kwng.engine.capture.capture_step` with ``preconditioner=``): the two
  kinds of step are two programs, so two CUDA graphs are recorded
  (:meth:`SystemCache.forced` picks the kind while recording) and each replay runs the
  one that :attr:`SystemCache.due` names — a host counter, no sync. The cached tensors
  are updated in place, so both graphs read and write the same memory.
* :class:`kwng.DistributedKWNG`: the ``(M + 1)·q`` all-reduce of ``[g; T]`` happens on
  refresh steps only; the other steps all-reduce ``q + 1`` values (``g`` and the shard's
  loss, for the ε rule), as DistributedDataParallel reduces ``g``.

State: :meth:`kwng.KWNGPreconditioner.state_dict` holds the cache (``None`` when nothing
is cached); with the basis generator's state and the ε rule's, a resumed run takes the
same directions as the uninterrupted one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["SystemCache"]

log = logging.getLogger(__name__)

_TENSORS = ("T", "CCt", "K", "sigma")


class SystemCache:
    """The system of the last refresh step (``T``, ``CCᵀ``, ``K``, ``N``, ``σ``) and the
    host-side step counter that says when to refresh (see the module docstring).

    ``every`` is ``k`` (``refresh_every``); ``on_due`` is called with :attr:`due`
    whenever it may have changed (the preconditioner switches its replicated forward
    with it); ``guard`` (``refresh_guard``) also refreshes after a rank-deficient
    system or a fallback (the module docstring)."""

    #: a refresh step is a program of its own that a CUDA graph records
    refresh_capturable = True
    #: the programs a captured loop records, a refresh step and a step between
    #: refreshes (keys of :attr:`kind`)
    kinds = (True, False)

    def __init__(self, every: int,
                 on_due: Callable[[bool], None] | None = None,
                 guard: bool = False) -> None:
        if not isinstance(guard, bool):
            raise ValueError("refresh_guard must be True or False, got "
                             f"{guard!r}")
        if guard and every == 1:
            raise ValueError("refresh_guard needs refresh_every > 1 (with 1 every "
                             "step refreshes)")
        self.every = every
        self.guard = guard
        #: refreshes the guard caused (steps that the counter did not make refreshes)
        self.guard_refreshes = 0
        self._stale = False  # the guard asks the next step to refresh
        self._last_refresh = -1  # the step index of the last refresh step
        self._took: bool | None = None  # the kind of the step under way (eager)
        self._flag: torch.Tensor | None = None  # this step's flag (device)
        self._host: torch.Tensor | None = None  # the last step's flag, on the host
        self._event: Any = None  # when that copy has landed (CUDA)
        self._pending = False  # whether _host holds a flag still to read
        self.steps = 0
        self.T: torch.Tensor | None = None
        self.CCt: torch.Tensor | None = None
        self.K: torch.Tensor | None = None
        self.sigma: torch.Tensor | None = None
        self.N = 0
        self._forced: bool | None = None
        self._on_due = on_due

    @property
    def due(self) -> bool:
        """Whether the next step refreshes the system (builds ``T``, ``C``, ``K``)."""
        if self._forced is not None:
            return self._forced
        return (self.every == 1 or self.T is None or self.steps % self.every == 0
                or self._stale)

    @property
    def kind(self) -> bool:
        """The program the next step runs, which is :attr:`due`."""
        return self.due

    def refresh_now(self, q: int, device: torch.device) -> bool:
        """Whether the step about to run refreshes: :attr:`due`, or no cached system
        fits ``q`` parameters on ``device``."""
        if (self.every > 1 and self._forced is None and device.type == "cuda"
                and torch.cuda.is_current_stream_capturing()):
            raise ValueError("a step with refresh_every > 1 is being captured without "
                             "choosing its kind: use kwng.capture_step(step, "
                             "preconditioner=precond), which records both graphs")
        if self.due:
            self._took = True
            return True
        if self.T is not None and self.T.shape[-1] == q and self.T.device == device:
            self._took = False
            return False
        if self._forced is False:
            raise ValueError("a step between refreshes was forced, but no cached "
                             f"system fits these {q} parameters: run a refresh step "
                             "first")
        self._took = True
        return True

    def observe(self, info: dict[str, torch.Tensor]) -> None:
        """The guard's device-side part, inside the step (so a CUDA graph records it):
        raise the flag when this step's system is rank deficient (``info``'s
        ``ill_conditioned``) or its direction fell back to ``g`` (``fallback``).
        Nothing without a guard."""
        if not self.guard:
            return
        bad = info["fallback"].bool() | info["ill_conditioned"].bool()
        if self._flag is None or self._flag.device != bad.device:
            self._flag = torch.zeros((), dtype=torch.bool, device=bad.device)
        self._flag.copy_(bad)

    def _read_flag(self) -> None:
        """The host's part of the guard at the end of a step: read the flag of the
        step before (its copy has landed or is waited for), then start the copy of
        this step's flag; a raised flag of a step after the last refresh makes the
        next step refresh."""
        if self._pending and self.steps - 1 >= self._last_refresh:
            if self._event is not None:
                self._event.synchronize()
            if bool(self._host) and not self._stale:
                self._stale = True
                self.guard_refreshes += 1
                log.info("step %d: the cached system was rank deficient or a "
                         "direction fell back to g; step %d refreshes (refresh "
                         "guard)", self.steps - 1, self.steps + 1)
        self._pending = False
        if self._flag is None:
            return
        if self._host is None:
            pin = self._flag.device.type == "cuda"
            self._host = torch.zeros((), dtype=torch.bool, pin_memory=pin)
        self._host.copy_(self._flag, non_blocking=True)
        self._event = None
        if self._flag.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        self._pending = True

    def store(self, T: torch.Tensor, CCt: torch.Tensor, K: torch.Tensor, N: int,
              sigma: torch.Tensor) -> None:
        """Keep the system of a refresh step (in place where the shapes match, so that
        captured graphs share it); nothing with ``every == 1``."""
        if self.every == 1:
            return
        new = (T, CCt, K, torch.as_tensor(sigma))
        old = tuple(getattr(self, k) for k in _TENSORS)
        if all(o is not None and o.shape == n.shape and o.dtype == n.dtype
               and o.device == n.device for o, n in zip(old, new)):
            for o, n in zip(old, new):
                o.copy_(n.detach())
        else:
            for k, n in zip(_TENSORS, new):
                setattr(self, k, n.detach().clone())
        self.N = int(N)

    def advance(self) -> None:
        """Count a step taken (eagerly or by a graph replay) and run the host's part
        of the guard (not while a graph is recorded)."""
        refreshed = self.due if self._took is None else self._took
        self._took = None
        if refreshed:
            self._last_refresh = self.steps
            self._stale = False
        if self.guard and self._forced is None:
            self._read_flag()
        self.steps += 1
        self.notify()

    def notify(self) -> None:
        """Hand :attr:`due` to the listener."""
        if self._on_due is not None:
            self._on_due(self.due)

    @contextlib.contextmanager
    def forced(self, refresh: bool) -> Iterator[None]:
        """Steps inside the block refresh (``True``) or apply the cached system
        (``False``) whatever the counter says: the recording of the two CUDA graphs."""
        if not isinstance(refresh, bool):
            raise ValueError(f"refresh must be True or False, got {refresh!r}")
        if not refresh and self.every == 1:
            raise ValueError("refresh_every = 1: every step refreshes, none can be "
                             "forced to reuse a cached system")
        old, self._forced = self._forced, refresh
        self.notify()
        try:
            yield
        finally:
            self._forced = old
            self.notify()

    def state_dict(self) -> dict[str, Any] | None:
        """The cached system (tensors on their device, ``N`` an int); ``None`` if
        nothing is cached."""
        if self.T is None:
            return None
        out = {**{k: getattr(self, k).clone() for k in _TENSORS}, "N": self.N}
        if self.guard:
            out["guard"] = self._guard_state()
        return out

    def _guard_state(self) -> dict[str, Any]:
        """The guard's state (a host sync: the last step's flag is read now)."""
        if self._event is not None:
            self._event.synchronize()
        return {"stale": self._stale, "last_refresh": self._last_refresh,
                "pending": bool(self._pending and bool(self._host)),
                "guard_refreshes": self.guard_refreshes}

    def _load_guard(self, state: dict[str, Any] | None, device: torch.device) -> None:
        """Restore :meth:`_guard_state` (``None``: a fresh guard)."""
        state = state or {}
        self._stale = bool(state.get("stale", False))
        self._last_refresh = int(state.get("last_refresh", -1))
        self.guard_refreshes = int(state.get("guard_refreshes", 0))
        self._took, self._event = None, None
        self._flag = torch.zeros((), dtype=torch.bool, device=device)
        self._host = torch.tensor(bool(state.get("pending", False)))
        self._pending = bool(state.get("pending", False))

    def load_state_dict(self, state: dict[str, Any] | None, steps: int,
                        device: torch.device) -> None:
        """Restore a :meth:`state_dict` (moved to ``device``) at step ``steps``."""
        self.steps = steps
        if state is None:
            for k in _TENSORS:
                setattr(self, k, None)
        else:
            if not isinstance(state, dict) or {*_TENSORS, "N"} - set(state):
                raise ValueError("state['cache'] must be None or a dict with the keys "
                                 f"{[*_TENSORS, 'N']}, got {state!r:.200}")
            T, CCt, K, sigma = (torch.as_tensor(state[k]).to(device) for k in _TENSORS)
            self.store(T, CCt, K, state["N"], sigma)
        if self.guard:
            self._load_guard(None if state is None else state.get("guard"), device)
        self.notify()
