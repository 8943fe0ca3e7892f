"""KFAC's step between refreshes in plain torch ops, so that a CUDA graph can replay it.

:class:`~studies.cifar.baselines.KFACPreconditioner` refreshes its Kronecker
factors every ``update_freq`` steps through nngeometry's Monte-Carlo Fisher pass
(Python objects, a sampled label, host-side decisions: it always runs eagerly). Every
other step only applies the damped inverse factors of the last refresh to the fresh
gradient, and that is what this module does with its own tensor ops:

* :class:`InverseFactors` keeps, per ``Conv2d`` / ``Linear`` layer, the damped inverse
  factors ``A⁻¹`` and ``G⁻¹`` of ``PMatKFAC.inverse(regul=damping)`` in persistent
  buffers. A refresh copies the new factors into them in place, so a recorded graph,
  which reads fixed addresses, always sees the current ones.
  :meth:`InverseFactors.apply` replaces each layer's gradient ``∇W`` (reshaped to
  ``(out, in·k·k)``, the bias gradient appended as a last column) by
  ``G⁻¹ (∇W) A⁻¹``: nngeometry's ``PMatKFAC.mv`` on the inverse, the same products in
  the same order, so the same numbers. When any entry of the direction is non-finite,
  every layer keeps its plain gradient (one device-side choice, ``torch.where``, no
  host sync).
* :class:`FactorSchedule` is the host-side step counter that says which steps refresh
  (``s % update_freq == 0``, or no factors yet) and, for EKFAC, which steps between
  refreshes re-estimate the scalings (``s % diag_freq == 0``). It has the interface of
  :class:`kwng.engine.precond.RefreshSchedule` that
  :class:`~studies.cifar.steps.StepRunner` and
  :func:`kwng.engine.capture.capture_step` read, with ``refresh_capturable = False``:
  they record a graph of each kind of step between refreshes only (one, or two when the
  scalings are re-estimated every ``diag_freq > 1`` steps), and run a due refresh step
  eagerly on the same static inputs (:func:`kwng.engine.capture.amortized_replay`).

A gradient in ``channels_last`` is reshaped (a copy in the logical order), never viewed,
so the step is the same in either memory format.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from kwng._checks import check_int

__all__ = ["FactorSchedule", "InverseFactors"]


class FactorSchedule:
    """The host-side step counter of a preconditioner whose factors are refreshed every
    ``every`` steps by an eager pass, and whose cheaper state (EKFAC's scalings) is
    re-estimated every ``sub_every`` steps.

    Step ``s`` (counted from 0, ``steps``) refreshes when ``s % every == 0`` or when
    no factors exist yet (``ready`` is ``False``); a step that does not refresh
    re-estimates the scalings when ``s % sub_every == 0`` (:attr:`sub_due`).
    :meth:`forced` overrides the choice while a graph is recorded. The steps between
    refreshes are one program (``kinds == (False,)``) or, with ``sub_every > 1``, two:
    ``"scale"`` (re-estimate, then apply) and ``False`` (apply only); :attr:`kind`
    names the program of the next step, ``None`` for a refresh step (eager)."""

    #: whether a refresh step can be recorded in a CUDA graph; never here, so the
    #: runners run it eagerly
    refresh_capturable = False
    #: the key of the program that re-estimates the scalings between refreshes
    SCALE = "scale"

    def __init__(self, every: int, sub_every: int = 1) -> None:
        self.every = check_int(every, "every", 1)
        self.sub_every = check_int(sub_every, "sub_every", 1)
        self.steps = 0
        self.ready = False
        self._forced: bool | str | None = None

    def __repr__(self) -> str:
        return (f"FactorSchedule(every={self.every}, sub_every={self.sub_every}, "
                f"steps={self.steps}, ready={self.ready})")

    @property
    def kinds(self) -> tuple:
        """The programs of the steps between refreshes, in recording order."""
        return (self.SCALE, False) if self.sub_every > 1 else (False,)

    @property
    def due(self) -> bool:
        """Whether the next step refreshes the factors."""
        if self._forced is not None:
            return self._forced is True
        return not self.ready or self.steps % self.every == 0

    @property
    def sub_due(self) -> bool:
        """Whether the next step re-estimates the scalings (every step with
        ``sub_every = 1``, every refresh step)."""
        if self.sub_every == 1:
            return True
        if self._forced is not None:
            return self._forced is not False
        return self.due or self.steps % self.sub_every == 0

    @property
    def kind(self) -> bool | str | None:
        """The program the next step runs, ``None`` for a refresh (run eagerly), else
        a key of :attr:`kinds`."""
        if self.due:
            return None
        return self.SCALE if self.sub_every > 1 and self.sub_due else False

    def refresh_now(self) -> bool:
        """:attr:`due`, for the step about to run; raises when that step cannot run:
        a step between refreshes forced before any factors exist, or a refresh step
        inside a CUDA graph capture."""
        if self._forced is not None and self._forced is not True and not self.ready:
            raise ValueError("a step between refreshes was forced, but no factors "
                             "exist yet: run a refresh step first")
        if (self.due and torch.cuda.is_available()
                and torch.cuda.is_current_stream_capturing()):
            raise ValueError("a KFAC refresh step (nngeometry's Monte-Carlo Fisher "
                             "pass) cannot be captured: record the step between "
                             "refreshes under forced(False) and run refresh steps "
                             "eagerly (kwng.capture_step(step, preconditioner=...))")
        return self.due

    def advance(self) -> None:
        """Count a step taken (eagerly or by a graph replay)."""
        self.steps += 1

    def notify(self) -> None:
        """Nothing listens to :attr:`due` (the interface of ``SystemCache``)."""

    @contextlib.contextmanager
    def forced(self, refresh: bool | str) -> Iterator[None]:
        """Steps inside the block refresh (``True``), apply the last factors
        (``False``) or, with ``sub_every > 1``, re-estimate the scalings and apply
        (``"scale"``), whatever the counter says."""
        scale = self.sub_every > 1 and isinstance(refresh, str) \
            and refresh == self.SCALE
        if not (isinstance(refresh, bool) or scale):
            also = f" or {self.SCALE!r}" if self.sub_every > 1 else ""
            raise ValueError(f"refresh must be True or False{also}, got {refresh!r}")
        if refresh is not True and self.every == 1:
            raise ValueError("every = 1: every step refreshes, none can be forced to "
                             "reuse the factors")
        old, self._forced = self._forced, refresh
        try:
            yield
        finally:
            self._forced = old


def _weight_matrix(mod: nn.Module) -> torch.Tensor:
    """``∇W`` as an ``(out, in·k·k)`` matrix, the bias gradient as a last column."""
    w = mod.weight.grad
    v = w.reshape(w.shape[0], -1)
    if mod.bias is not None:
        v = torch.cat([v, mod.bias.grad.unsqueeze(1)], dim=1)
    return v


class InverseFactors:
    """Persistent buffers of the damped inverse Kronecker factors, one pair
    ``(A⁻¹, G⁻¹)`` per layer name, and their application to the gradients."""

    def __init__(self) -> None:
        self.buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def __repr__(self) -> str:
        return f"InverseFactors(layers={len(self.buffers)})"

    def store(self, data: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
              device: torch.device | None = None) -> None:
        """Keep ``data`` (layer name -> ``(A⁻¹, G⁻¹)``, nngeometry's ``PMatKFAC.data``
        of the inverse), moved to ``device`` if given: copied into the existing buffers
        in place where shapes, dtypes and devices match, so that a recorded graph
        reads the new factors."""
        if not isinstance(data, Mapping) or not all(
                isinstance(v, (tuple, list)) and len(v) == 2
                and all(isinstance(t, torch.Tensor) for t in v)
                for v in data.values()):
            raise ValueError("data must map each layer name to a pair of tensors "
                             f"(A_inv, G_inv), got {data!r:.200}")
        for name, pair in data.items():
            _store(self.buffers, name, pair, device)

    def state(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the buffers (layer name -> ``(A⁻¹, G⁻¹)``)."""
        return {k: (a.clone(), g.clone()) for k, (a, g) in self.buffers.items()}

    def apply(self, modules: Mapping[str, nn.Module]) -> torch.Tensor:
        """Replace the weight (and bias) gradient of every module of ``modules``
        (layer name -> ``Conv2d`` / ``Linear``) by ``G⁻¹ (∇W) A⁻¹``, or leave every
        gradient plain when any entry of the direction is non-finite. Returns 1 in
        that case, else 0, as a 0-dim int64 device tensor (no host sync)."""
        missing = [k for k in modules if k not in self.buffers]
        if missing:
            raise ValueError(f"modules must be layers with stored factors; none for "
                             f"{missing} (run a refresh step first)")
        dirs = []
        for name, mod in modules.items():
            a_inv, g_inv = self.buffers[name]
            dirs.append(torch.mm(torch.mm(g_inv, _weight_matrix(mod)), a_inv))
        return _write_back(modules, dirs)


def _write_back(modules: Mapping[str, nn.Module],
                dirs: list[torch.Tensor]) -> torch.Tensor:
    """Write each ``(out, in·k·k [+ 1])`` direction of ``dirs`` into the weight (and
    bias) gradient of its module, unless any entry of any direction is non-finite: then
    every gradient stays plain. Returns 1 in that case, else 0, as a 0-dim int64 device
    tensor (one device-side choice, no host sync)."""
    finite = torch.stack([torch.isfinite(d).all() for d in dirs]).all()
    for mod, d in zip(modules.values(), dirs):
        w = mod.weight.grad
        n = w[0].numel()
        w.copy_(torch.where(finite, d[:, :n].reshape(w.shape), w))
        if mod.bias is not None:
            mod.bias.grad.copy_(torch.where(finite, d[:, n], mod.bias.grad))
    return (~finite).to(torch.int64)


def _store(buffers: dict, name: str, tensors, device) -> None:
    """Put ``tensors`` (detached, on ``device`` when given) into ``buffers[name]``: in
    place when the buffers there have the same shapes, dtypes and device (a recorded
    graph reads their addresses), else as new copies."""
    new = tuple(t.detach() if device is None else t.detach().to(device)
                for t in tensors)
    old = buffers.get(name)
    if old is not None and all(o.shape == n.shape and o.dtype == n.dtype
                               and o.device == n.device for o, n in zip(old, new)):
        for o, n in zip(old, new):
            o.copy_(n)
    else:
        buffers[name] = tuple(n.clone() for n in new)
