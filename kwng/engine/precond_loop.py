"""The training loop around :meth:`kwng.KWNGPreconditioner.step`: what a loop hands the
preconditioner and what the step leaves in ``p.grad``.

* **Parameters and their groups** (:func:`resolve_params`): the metric is built on the
  parameters given as ``params=`` (by default every trainable parameter of the model);
  pass the optimizer's ``optimizer.param_groups`` so that the preconditioner solves with
  the metric of exactly the parameters the optimizer moves. Each group's ``"lr"``
  enters the ε rule (:func:`predicted_decrease`).
* **What is already in** ``p.grad`` (:class:`GradWriter`): a gradient the loop put
  there before the step (an auxiliary loss's ``backward()``) is added to the KWNG
  direction, never dropped; the direction the previous step wrote is replaced. Two
  steps without an optimizer step between them are refused: the estimator needs the
  whole batch at once (the basis, the bandwidth and ``C`` are batch-wide); gradient
  accumulation is the preconditioner's ``accumulation_steps``, which keeps the
  micro-batches until the last one.
* **The tensors in** ``p.grad`` are views of one flat buffer (one copy per step). A
  view the loop keeps after ``optimizer.zero_grad()`` is never overwritten: the next
  step writes into a new buffer.
* **A scaled loss** (``torch.amp.GradScaler``, :func:`scale_of`): the step unscales
  ``g`` before the solve and the clip (``T`` is built from unscaled cotangents) and
  writes the direction scaled back, so that ``scaler.step(optimizer)`` unscales it and
  skips a step whose gradient overflowed, as for SGD (:func:`overflowed_step`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from kwng._checks import check_positive

__all__ = ["GradWriter", "backward_hint", "check_grad_scaler", "check_lr",
           "check_model", "check_not_loss_gradient", "check_step_inputs",
           "euclidean_direction", "group_lrs_missing", "group_params", "is_compiled",
           "overflowed_step", "predicted_decrease", "resolve_params", "scale_of"]

_SECOND_BACKWARD = "backward through the graph a second time"


def resolve_params(model: nn.Module, params: Iterable[Any] | None
                   ) -> tuple[list[torch.Tensor], list[dict[str, Any]] | None]:
    """The parameters the metric may cover and, if ``params`` held groups (dicts with a
    ``"params"`` entry, as ``optimizer.param_groups``), those groups themselves (read
    again at every step, so a schedule that changes a group's ``"lr"`` is seen, and
    the parameters of a group added by ``optimizer.add_param_group`` join).

    Frozen parameters (``requires_grad=False``) are kept: each step covers the ones
    that require a gradient at that step, so a parameter unfrozen later (gradual
    unfreezing) is trained from then on, as ``torch.optim`` trains it. At least one
    must require a gradient now."""
    if params is None:
        chosen = list(model.parameters())
        if not any(p.requires_grad for p in chosen):
            raise ValueError("model has no parameter with requires_grad=True")
        return chosen, None
    if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
        raise ValueError("params must be an iterable of parameters or of parameter "
                         "groups (e.g. optimizer.param_groups), got "
                         f"{type(params).__name__}")
    items = list(params)
    groups = None
    if items and all(isinstance(x, dict) for x in items):
        groups = params if isinstance(params, list) else items  # add_param_group seen
        items = [p for grp in groups for p in group_params(grp)]
    owned = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    for p in items:
        if not isinstance(p, nn.Parameter) or id(p) not in owned:
            raise ValueError("params must hold parameters of model (or groups of them, "
                             "as optimizer.param_groups); got a "
                             f"{type(p).__name__} that model does not own")
        if id(p) in seen:
            raise ValueError("params lists a parameter twice")
        seen.add(id(p))
    if not any(p.requires_grad for p in items):
        raise ValueError("params holds no parameter with requires_grad=True")
    return items, groups


def group_params(group: dict[str, Any]) -> list[Any]:
    """The parameters of one parameter group (its ``"params"`` entry as a list)."""
    if "params" not in group:
        raise ValueError("a parameter group of params must have a 'params' entry, got "
                         f"keys {sorted(group)}")
    ps = group["params"]
    return [ps] if isinstance(ps, torch.Tensor) else list(ps)


def group_lrs_missing(groups: list[dict[str, Any]] | None) -> bool:
    """Whether some group has no ``"lr"`` (the ε rule then needs ``lr=``)."""
    return groups is None or any("lr" not in g for g in groups)


def predicted_decrease(groups: list[dict[str, Any]] | None, params: list[torch.Tensor],
                       g: torch.Tensor, direction: torch.Tensor, dot: torch.Tensor,
                       lr: Callable[[], float]) -> tuple[float, torch.Tensor]:
    """``(step, dot)`` for the ε rule's predicted decrease ``step · dot``: ``(lr(),
    ⟨g, ĝ⟩)`` when every parameter takes the same step, else ``(1, Σ_k lr_k ⟨g_k,
    ĝ_k⟩)`` over the groups (each group's current ``"lr"``, ``lr()`` where it has
    none)."""
    if groups is None:
        return lr(), dot
    steps = [float(grp["lr"]) if "lr" in grp else lr() for grp in groups]
    if len(set(steps)) == 1:
        return steps[0], dot
    step_of = {id(p): s for grp, s in zip(groups, steps) for p in group_params(grp)}
    total, offset = torch.zeros((), dtype=dot.dtype, device=dot.device), 0
    for p in params:
        n = p.numel()
        part = torch.dot(g[offset:offset + n], direction[offset:offset + n].to(g.dtype))
        total = total + step_of[id(p)] * part.to(total.dtype)
        offset += n
    return 1.0, total


class GradWriter:
    """The flat buffer whose views the step writes into ``p.grad``, and what the loop
    left in ``p.grad`` before a step (see the module docstring).

    :meth:`take` runs before the step's backward passes and returns the gradients to
    add; :meth:`views` gives the buffer to write the direction into (its views already
    set as ``p.grad``); :meth:`finish` adds the taken gradients and remembers what was
    written."""

    def __init__(self, adds_prefilled: bool) -> None:
        self.adds_prefilled = adds_prefilled
        self.buffer: torch.Tensor | None = None
        self._views: dict[int, weakref.ref] = {}   # id(p) -> the view set as p.grad
        self._written: dict[int, int] = {}          # id(p) -> version of its view
        self._versions: dict[int, int] = {}         # id(p) -> p's version after a step

    def _ours(self, p: torch.Tensor) -> bool:
        ref = self._views.get(id(p))
        return p.grad is not None and ref is not None and ref() is p.grad

    def release(self, frozen: Iterable[torch.Tensor]) -> None:
        """Parameters frozen since the last step lose the buffer's view."""
        for p in frozen:
            if p.grad is not None and self._ours(p):
                p.grad = None

    def take(self, params: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """The gradients the loop put into ``p.grad`` since the last step (copied where
        they live in the buffer); refuses a second step without an optimizer step."""
        stale = [p for p in params if p.grad is not None and self._ours(p)
                 and p.grad._version == self._written.get(id(p))]
        if stale and self._versions and all(
                self._versions.get(id(p)) == p._version for p in params):
            raise ValueError(
                "step() was called again before the optimizer used the direction of "
                "the previous step (p.grad still holds it and no parameter moved): "
                "the estimator needs the whole batch at once (basis, bandwidth and C "
                "are batch-wide). For gradient accumulation over n micro-batches build "
                "the preconditioner with accumulation_steps=n; else call step once per "
                "optimizer step")
        taken = {}
        for p in params:
            if p.grad is None or any(p is q for q in stale):
                continue
            taken[id(p)] = p.grad.detach().clone() if self._ours(p) else p.grad.detach()
        if taken and not self.adds_prefilled:
            raise ValueError("p.grad holds a gradient from before the step (a "
                             "backward() or a missing optimizer.zero_grad()): this "
                             "preconditioner does not add it; call "
                             "optimizer.zero_grad() before step")
        return taken

    def views(self, q: int, params: list[torch.Tensor]) -> torch.Tensor:
        """The flat buffer (``q`` numbers) whose views are the parameters' ``.grad``; a
        new one when the loop still holds a view it took out of ``p.grad``."""
        dtype, device = params[0].dtype, params[0].device
        kept = any(ref() is not None and ref() is not p.grad
                   for p in params if (ref := self._views.get(id(p))) is not None)
        buf = self.buffer
        if kept or buf is None or buf.numel() != q or buf.device != device \
                or buf.dtype != dtype:
            buf = self.buffer = torch.empty(q, dtype=dtype, device=device)
            self._views = {}
        offset = 0
        for p in params:
            n = p.numel()
            if not self._ours(p) or p.grad.data_ptr() != buf[offset:].data_ptr():
                view = buf[offset:offset + n].view_as(p)
                p.grad = view  # one copy per step for all parameters
                self._views[id(p)] = weakref.ref(view)
            offset += n
        return buf

    def finish(self, params: list[torch.Tensor], taken: dict[int, torch.Tensor]
               ) -> None:
        """Add the taken gradients; remember the versions of what was written."""
        for p in params:
            if id(p) in taken:
                p.grad.add_(taken[id(p)])
        self._written = {id(p): p.grad._version for p in params}
        self._versions = {id(p): p._version for p in params}


def check_not_loss_gradient(taken: dict[int, torch.Tensor], g: torch.Tensor,
                            params: list[torch.Tensor]) -> None:
    """Refuse a ``p.grad`` filled by ``loss.backward(retain_graph=True)`` of the step's
    own loss (it would count ``g`` twice): every taken gradient equal to its part of
    ``g``."""
    if not taken:
        return
    offset, same, nonzero = 0, True, False
    for p in params:
        n = p.numel()
        if id(p) in taken:
            t = taken[id(p)].reshape(-1).to(g.dtype)
            nonzero = nonzero or bool(t.any())
            same = same and torch.allclose(t, g[offset:offset + n], rtol=1e-4, atol=0)
        offset += n
    if same and nonzero:
        raise ValueError("p.grad already holds the gradient of the loss passed to step "
                         "(loss.backward() before precond.step): step(loss, X) runs "
                         "the backward passes itself, drop the loss.backward() call")


def overflowed_step(out: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """A step whose scaled gradient overflowed (``GradScaler``, reference mode): ``g``
    itself goes into ``out``, so that ``grad_scaler.step(optimizer)`` finds the
    infinities and skips the step, as it does for SGD; the step counts as a fallback."""
    out.copy_(g)
    zero = torch.zeros((), dtype=torch.long, device=g.device)
    norm = torch.linalg.vector_norm(g)
    return {"rank": zero, "ill_conditioned": zero.bool(), "damping_floored": zero,
            "floored_share": zero.double(), "loss_only": zero,
            "dot": torch.full((), float("nan"), device=g.device),
            "fallback": ~zero.bool(), "clipped": zero.bool(), "grad_norm": norm,
            "direction_norm": norm}


def euclidean_direction(out: torch.Tensor, g: torch.Tensor, clip_norm: float | None
                        ) -> dict[str, torch.Tensor]:
    """A step that takes the Euclidean gradient ``g`` (clipped to ``clip_norm``) into
    ``out``: the info of :data:`kwng.engine.step_direction.INFO_KEYS`, counted as a
    fallback."""
    from kwng.solve import safeguard

    safe = safeguard(g, g, clip_norm)
    out.copy_(safe.direction)
    zero = torch.zeros((), dtype=torch.long, device=g.device)
    return {"rank": zero, "ill_conditioned": zero.bool(), "damping_floored": zero,
            "floored_share": zero.double(), "loss_only": zero, "dot": safe.dot,
            "fallback": ~zero.bool(), "clipped": safe.clipped,
            "grad_norm": safe.grad_norm, "direction_norm": safe.direction_norm}


def scale_of(grad_scaler: Any, loss: torch.Tensor) -> torch.Tensor | None:
    """The loss scale of ``grad_scaler`` (a 0-dim tensor), checking that ``loss`` is
    ``grad_scaler.scale(...)`` of this scaler; ``None`` without a scaler or when it
    is disabled."""
    if grad_scaler is None or not grad_scaler.is_enabled():
        return None
    scale = getattr(grad_scaler, "_scale", None)
    saved = getattr(loss.grad_fn, "_saved_other", None)
    if scale is None or not isinstance(saved, torch.Tensor) \
            or saved.data_ptr() != scale.data_ptr():
        raise ValueError("with grad_scaler=, pass the scaled loss: "
                         "precond.step(grad_scaler.scale(loss), X) (the step unscales "
                         "g and T before the solve and the clip)")
    return grad_scaler._get_scale_async().detach()


def check_grad_scaler(grad_scaler: Any) -> Any:
    """``grad_scaler`` as given: ``None`` or a ``torch.amp.GradScaler``."""
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise ValueError("grad_scaler must be a torch.amp.GradScaler or None, got "
                         f"{type(grad_scaler).__name__}")
    return grad_scaler


def backward_hint(err: RuntimeError, compiled: bool, mode: str) -> RuntimeError:
    """A message for the loop for an autograd error raised in the step's backward
    passes (``err`` unchanged when there is nothing to add)."""
    if _SECOND_BACKWARD in str(err):
        return RuntimeError(
            "KWNGPreconditioner.step(loss, X) runs the backward pass(es) itself: do "
            "not call loss.backward() before it (the order of kfac-pytorch). A "
            "gradient of another loss term that you backward() first is added to the "
            "direction.")
    if compiled and mode == "reference":
        return RuntimeError(
            "mode='reference' differentiates one graph M + 1 times "
            f"(retain_graph=True), which this torch.compile'd model does not support "
            f"({err}); use "
            "mode='fast', or the uncompiled model")
    return err


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` runs through ``torch.compile`` (a compiled wrapper, or
    ``model.compile()`` in place)."""
    return type(model).__name__ == "OptimizedModule" or \
        getattr(model, "_compiled_call_impl", None) is not None


def check_model(model: Any) -> None:
    """``model`` must be a bare ``nn.Module`` (not a ``DistributedDataParallel``
    wrapper)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError(
            "model is wrapped in DistributedDataParallel, whose gradient reduction the "
            "preconditioner's own backward passes bypass (the replicas would drift "
            "apart): use kwng.DistributedKWNG(model.module, ...), which replaces DDP "
            "and writes the direction of the global batch on every rank")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def check_lr(lr: Any, required: bool) -> float | Callable[[], float] | None:
    """``lr`` as given: a number > 0, a callable, or ``None`` where no ε rule needs
    it."""
    if lr is None:
        if required:
            raise ValueError(
                "lr is required with an eps_schedule (the step size enters the "
                "reduction ratio r): pass lr=0.1, lr=lambda: "
                "optimizer.param_groups[0]['lr'] or params=optimizer.param_groups; "
                "or set eps_schedule=None for a fixed ε")
        return None
    if callable(lr):
        return lr
    return check_positive(lr, "lr")


def check_step_inputs(loss: Any, outputs: Any, num_basis: int) -> None:
    """The arguments of :meth:`kwng.KWNGPreconditioner.step`: a scalar loss with a graph
    and the ``(batch, d)`` outputs, at least ``num_basis`` of them."""
    if not isinstance(outputs, torch.Tensor) or outputs.dim() != 2:
        shape = (tuple(outputs.shape) if isinstance(outputs, torch.Tensor)
                 else type(outputs).__name__)
        raise ValueError(
            "outputs must be the model outputs X = h_θ(z) as a (batch, d) tensor, got "
            f"{shape}; flatten them (outputs.flatten(1)) or pick the tensor that the "
            "loss is built on")
    if not outputs.is_floating_point() or outputs.grad_fn is None:
        raise ValueError(
            "outputs must be a floating-point tensor with an autograd graph to the "
            "parameters (call step(loss, outputs) with the outputs of model(z), not "
            "detached ones)")
    if outputs.shape[0] < num_basis:
        raise ValueError(f"the batch has {outputs.shape[0]} samples but num_basis = "
                         f"{num_basis}; num_basis must be <= batch size")
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or loss.grad_fn is None:
        raise ValueError("loss must be a scalar tensor with an autograd graph (e.g. "
                         "loss_fn(outputs, y))")
