"""How one step of :class:`kwng.KWNGPreconditioner` is computed: its base class
:class:`PreconditionerStep`.

A step takes the parameters that require a gradient at that step, checks the batch
(``_degenerate``: non-finite outputs or loss are refused; a refresh step whose batch is
shorter than ``num_basis`` or whose samples coincide takes the Euclidean gradient,
logged and counted in ``euclidean_steps``), builds the step's system
``(g, T, CCᵀ, K, N, σ, ε)`` — afresh on a refresh step (basis draw, kernel matrices,
the backward pass(es) of :func:`kwng.engine.grads.step_gradients`), else ``g`` from one
plain backward pass with the cached rest (:mod:`kwng.engine.amortized`) — and writes the
direction into ``p.grad``: :func:`kwng.engine.step_direction.step_direction`, or in the
reference mode :func:`kwng.engine.step_direction.reference_direction_into`. The ε rule
then records the step's predicted decrease and the counters its outcome
(:func:`kwng.engine.precond_state.count_step`).

Six hooks see this process's share of the batch alone: ``_degenerate`` (the checks
above), ``_share`` (samples, basis and loss), ``_gradients`` (``g`` and ``T``),
``_reduce`` (both as the solve sees them), ``_plain_gradient`` and
``_reduce_gradient`` (a step between refreshes, or a Euclidean one).
:class:`kwng.DistributedKWNG` overrides them to gather and sum every rank's share (and
to take the same kind of step on every rank).
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable
from typing import Any

import torch

from kwng.engine.grads import step_gradients
from kwng.engine.precond_loop import (
    backward_hint,
    check_not_loss_gradient,
    check_step_inputs,
    euclidean_direction,
    group_params,
    is_compiled,
    overflowed_step,
    predicted_decrease,
    resolve_params,
)
from kwng.engine.precond_state import count_step
from kwng.engine.step_direction import reference_direction_into, step_direction
from kwng.estimator import draw_basis, kernel_matrices, with_bandwidth
from kwng.nosync import kernel_matrices_nosync

__all__ = ["PreconditionerStep"]

log = logging.getLogger(__name__)


class PreconditionerStep:
    """The step of :class:`kwng.KWNGPreconditioner`, which derives from it and sets up
    what it reads: the attributes ``config``, ``model``, ``mode``, ``params``,
    ``groups``, ``generator``, ``lm``, ``cache``, ``_lr``, ``_engine``, ``_grads``,
    ``_counters`` and ``_step_count``, and ``num_steps`` and ``_warn_once``."""

    def _check_inputs(self, loss: torch.Tensor, outputs: torch.Tensor) -> None:
        """The arguments of :meth:`kwng.KWNGPreconditioner.step`
        (:func:`kwng.engine.precond_loop.check_step_inputs`)."""
        check_step_inputs(loss, outputs, 1)

    def _current_lr(self) -> float:
        """The step size of the reduction ratio (1 with a fixed ε, where nothing reads
        it); a callable ``lr`` is called and its value checked at every step."""
        if self._lr is None:
            return 1.0
        if not callable(self._lr):
            return self._lr
        value = self._lr()
        scalar = (isinstance(value, numbers.Real) and not isinstance(value, bool)) or (
            isinstance(value, torch.Tensor) and value.numel() == 1)
        number = float(value) if scalar else None
        if number is None or not math.isfinite(number) or number <= 0:
            raise ValueError(f"lr() returned {value!r}: the step size must be a number "
                             "in (0, inf) (it enters the reduction ratio of the ε "
                             "rule)")
        return number

    def _degenerate(self, loss: torch.Tensor, X: torch.Tensor, refresh: bool,
                    check_finite: bool) -> str | None:
        """Host checks of a step (one sync; none while a CUDA graph is recorded):
        refuse non-finite outputs (``check_finite``: no ``GradScaler``, whose skipped
        steps handle an overflow), and on a refresh step name why no kernel system can
        be built from ``X``: fewer samples than ``num_basis`` (a short last batch), or
        samples that all coincide (a zero-initialised output layer: bandwidth 0).
        ``None``: the exact step can run."""
        if X.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        N, M = X.shape[0], self.config.num_basis
        flags = [torch.isfinite(X).all() & torch.isfinite(loss.detach()).all()
                 if check_finite else X.new_ones((), dtype=torch.bool)]
        if refresh and N >= M:
            flags.append((X != X[:1]).any())
        ok = torch.stack(flags).tolist()
        if not ok[0]:
            raise ValueError("the outputs X or the loss hold NaN or inf values (a "
                             "non-finite batch or parameters): the step is refused "
                             "and nothing is written into p.grad")
        if refresh and N < M:
            return (f"the batch has {N} samples, fewer than num_basis = {M} (a short "
                    "last batch)")
        if refresh and not ok[1]:
            return ("the samples X all coincide (a zero-initialised output layer?): "
                    "they carry no metric to estimate")
        return None

    def _gradients(self, loss: torch.Tensor, X: torch.Tensor, C: torch.Tensor,
                   params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``g`` (``q``) and ``T`` (``M × q``) of the active parameters, from the graph
        of ``loss``, ``X`` (:func:`kwng.engine.grads.step_gradients`)."""
        return step_gradients(loss, X, C, params, self._engine, self.mode == "fast",
                              self._warn_once, self._counters)

    def _active_params(self, device: torch.device) -> list[torch.Tensor]:
        """The parameters that require a gradient at this step (frozen ones lose the
        buffer's view; ones unfrozen since construction join), with the state moved to
        ``device``."""
        if device != self.lm.eps.device:
            self.lm.to(device)
            self._counters = {k: v.to(device) for k, v in self._counters.items()}
            self._step_count = self._step_count.to(device)
        if self.groups is not None and sum(
                len(group_params(grp)) for grp in self.groups) != len(self.params):
            # a group added since (optimizer.add_param_group): its parameters join
            self.params, _ = resolve_params(self.model, self.groups)
        self._grads.release(p for p in self.params if not p.requires_grad)
        params = [p for p in self.params if p.requires_grad]
        if not params:
            raise ValueError("every parameter of the model is frozen "
                             "(requires_grad=False): nothing to update")
        if self._engine is not None:
            owned = self._engine.owned()
            stray = [p for p in params if id(p) not in owned]
            if stray:
                raise ValueError(
                    f"a parameter of shape {tuple(stray[0].shape)} was unfrozen after "
                    "the preconditioner was built and lives in a layer that "
                    "mode='fast' does not batch (only Conv2d, Linear, BatchNorm): "
                    "build the preconditioner with mode='reference'")
        return params

    def _share(self, Xk: torch.Tensor, loss: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The samples, basis and loss the step's estimator sees: here this process's
        own (:class:`kwng.engine.distributed.DistributedKWNG` gathers every rank's)."""
        N, d = Xk.shape
        idx, coords = draw_basis(N, d, self.config.num_basis, self.generator, Xk.device)
        return Xk, idx, coords, loss

    def _reduce(self, g: torch.Tensor, T: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``g`` and ``T`` as the solve sees them: here unchanged (the distributed
        preconditioner sums the ranks' shares)."""
        return g, T

    def _backward(self, gradients: Callable[[], tuple], params: list[torch.Tensor],
                  taken: dict[int, torch.Tensor], scale: torch.Tensor | None
                  ) -> tuple[torch.Tensor, Any]:
        """``gradients()`` (``g`` and ``T`` or ``None``), ``g`` unscaled (``scale``: the
        loss scale of a ``GradScaler``; the cotangents of ``T`` are not scaled); a
        loop's mistake is named."""
        try:
            g, T = gradients()
        except RuntimeError as err:
            hint = backward_hint(err, is_compiled(self.model), self.mode)
            if hint is err:
                raise
            raise hint from err
        check_not_loss_gradient(taken, g, params)
        return (g, T) if scale is None else (g / scale, T)

    def _refresh(self, loss: torch.Tensor, X: torch.Tensor, params: list[torch.Tensor],
                 taken: dict[int, torch.Tensor], scale: torch.Tensor | None) -> tuple:
        """The exact step's system: ``(g, T, CCᵀ, K, N, σ, ε)`` (kept by the cache when
        ``k > 1``)."""
        cfg = self.config
        Xk = X.detach().to(torch.promote_types(X.dtype, torch.float32))
        Xk, idx, coords, loss_all = self._share(
            Xk, loss if scale is None else loss.detach() / scale)
        N = Xk.shape[0]
        eps = self.lm.update(loss_all) if cfg.eps_schedule is not None else self.lm.eps
        if self.mode == "reference":
            kern = with_bandwidth(cfg.kernel, Xk, idx, cfg.bandwidth, cfg.sigma0)
            C, K, CCt = kernel_matrices(Xk, idx, coords, kern)
            sigma = torch.tensor(kern.bandwidth)
        else:
            C, K, CCt, sigma = kernel_matrices_nosync(Xk, idx, coords, cfg.kernel,
                                                      cfg.bandwidth, cfg.sigma0)
        g, T = self._backward(lambda: self._gradients(loss, X, C, params), params,
                              taken, scale)
        g = g.to(Xk.dtype) if g.dtype not in (torch.float32, torch.float64) else g
        g, T = self._reduce(g, T.to(g.dtype))
        self.cache.store(T, CCt, K, N, sigma)
        return g, T, CCt, K, N, sigma, eps

    def _cached(self, loss: torch.Tensor, X: torch.Tensor, params: list[torch.Tensor],
                taken: dict[int, torch.Tensor], scale: torch.Tensor | None) -> tuple:
        """A step between refreshes (:mod:`kwng.engine.amortized`): the fresh ``g``
        with the cached system."""
        c = self.cache
        g, _ = self._backward(lambda: (self._plain_gradient(loss, X, params), None),
                              params, taken, scale)
        g = g.to(c.T.dtype) if g.dtype not in (torch.float32, torch.float64) else g
        g, loss_all = self._reduce_gradient(
            g, loss if scale is None else loss.detach() / scale)
        eps = (self.lm.update(loss_all) if self.config.eps_schedule is not None
               else self.lm.eps)
        return g, c.T, c.CCt, c.K, c.N, c.sigma, eps

    def _euclidean(self, loss: torch.Tensor, X: torch.Tensor,
                   params: list[torch.Tensor], taken: dict[int, torch.Tensor],
                   scale: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
        """``g`` and ``ε`` of a step that takes the Euclidean gradient (no kernel
        system can be built from its batch); nothing is cached, so the next step
        refreshes."""
        g, _ = self._backward(lambda: (self._plain_gradient(loss, X, params), None),
                              params, taken, scale)
        g = g.to(torch.float32) if g.dtype not in (torch.float32, torch.float64) else g
        g, loss_all = self._reduce_gradient(
            g, loss if scale is None else loss.detach() / scale)
        eps = (self.lm.update(loss_all) if self.config.eps_schedule is not None
               else self.lm.eps)
        return g, eps

    def _plain_gradient(self, loss: torch.Tensor, X: torch.Tensor,
                        params: list[torch.Tensor]) -> torch.Tensor:
        """``g`` alone, from one ordinary backward pass (``X``: the step's outputs)."""
        parts = torch.autograd.grad(loss, params, allow_unused=True,
                                    materialize_grads=True)
        if self._engine is not None:  # a replicated forward's graph is not kept
            self._engine.outputs = self._engine.first = None
        return torch.cat([gp.reshape(-1) for gp in parts])

    def _reduce_gradient(self, g: torch.Tensor, loss: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """``g`` and the loss of a step between refreshes as the solve and the ε rule
        see them: here unchanged (the distributed preconditioner sums the ranks'
        shares)."""
        return g, loss

    def _direction(self, out: torch.Tensor, g: torch.Tensor, T: torch.Tensor,
                   CCt: torch.Tensor, K: torch.Tensor, N: int, eps: Any,
                   scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The direction written into ``out`` and its info: the reference solve on the
        host, else the device path (also for ``diagonal_only``); a scaled reference
        step whose ``g`` overflowed is skipped."""
        cfg, reference = self.config, self.mode == "reference"
        if scale is not None and reference and not bool(torch.isfinite(g).all()):
            return overflowed_step(out, g)
        if reference and not cfg.diagonal_only:
            return reference_direction_into(out, T, CCt, K, g, N, eps=float(eps),
                                            lam=cfg.lam, damping=cfg.damping,
                                            rcond=cfg.rcond, clip_norm=cfg.clip_norm)
        return step_direction(out, T, CCt, K, g, N,
                              eps=torch.as_tensor(eps, device=T.device), lam=cfg.lam,
                              damping=cfg.damping, rcond=cfg.rcond,
                              clip_norm=cfg.clip_norm, diagonal_only=cfg.diagonal_only)

    def _step(self, loss: torch.Tensor, outputs: torch.Tensor,
              scale: torch.Tensor | None) -> dict[str, Any]:
        X = outputs
        params = self._active_params(X.device)
        refresh = self.cache.refresh_now(sum(p.numel() for p in params), X.device)
        reason = self._degenerate(loss, X, refresh, scale is None)
        taken = self._grads.take(params)
        self._step_count += 1
        if reason is not None:
            g, eps = self._euclidean(loss, X, params, taken, scale)
            sigma = torch.full((), float("nan"), device=X.device)  # no kernel built
        else:
            g, T, CCt, K, N, sigma, eps = (self._refresh if refresh else self._cached)(
                loss, X, params, taken, scale)
        capturing = g.is_cuda and torch.cuda.is_current_stream_capturing()
        if scale is None and not capturing and not bool(torch.isfinite(g).all()):
            raise ValueError("the gradient g of this step holds NaN or inf values: the "
                             "step is refused (check the loss and the parameters)")
        out = self._grads.views(g.numel(), params)
        if reason is not None:
            f = euclidean_direction(out, g, self.config.clip_norm)
            self._counters["euclidean_steps"] += 1
            self._warn_once(f"euclidean:{reason[:20]}", "KWNG step %d: %s; this step "
                            "takes the Euclidean gradient (counted in "
                            "euclidean_steps)", self.num_steps, reason)
        else:
            f = self._direction(out, g, T, CCt, K, N, eps, scale)
            self.cache.observe(f)
        self.lm.record(*predicted_decrease(self.groups, params, g, out, f["dot"],
                                           self._current_lr))
        if scale is not None:
            out.mul_(scale)  # GradScaler.step(optimizer) divides it again
        self._grads.finish(params, taken)
        self.cache.advance()
        info = count_step(self._counters, f,
                          {"eps": eps, "reduction_ratio": self.lm.ratio.clone(),
                           "bandwidth": sigma}, X.device)
        if self.mode == "reference" and bool(info["fallback"]):  # it syncs anyway
            log.info("step %d: ⟨g, ĝ⟩ ≤ 0 or ĝ not finite: Euclidean gradient used",
                     self.num_steps)
        return info
