"""KWNG as a drop-in preconditioner for any PyTorch model (book chapter :ref:`deep-learning`).

A classifier ``z ↦ X = h_θ(z) ∈ R^d`` is an implicit model: its outputs on a mini-batch are ``N``
samples ``X_n`` of a distribution ``ρ_θ`` (Arbel et al., 2020, §4.2). The preconditioner replaces
the Euclidean gradient ``g = ∇_θ L`` by the kernelized Wasserstein natural gradient of Prop. 6,
then any ``torch.optim`` optimizer takes the step::

    precond = KWNGPreconditioner(model, lr=0.1, num_basis=5, eps=1e-5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for z, y in loader:
        optimizer.zero_grad()
        X = model(z)                      # (N, d): the samples
        loss = loss_fn(X, y)
        info = precond.step(loss, X)      # backward pass(es) + KWNG direction into p.grad
        optimizer.step()

Algorithm (one call of :meth:`KWNGPreconditioner.step`; symbols ↔ arguments)::

    draw M = num_basis indices Y_m = X_{b_m} and coordinates i_m              (draw_basis)
    σ ← σ0 · mean ‖X_n − Y_m‖²   (bandwidth="mean_sq", sigma0)                 (§3.3)
    C, K, CCᵀ of Prop. 5 from X and the kernel                                  (kernel_matrices)
    g ← ∇_θ L,  T_m ← (C_m / N)ᵀ ∂X/∂θ   (m = 1..M)                             (the backward passes)
    ĝ ← (1/ε)[D⁻¹ − D⁻¹T̃ᵀ(T̃D⁻¹T̃ᵀ + (ε/N) I)⁻¹T̃D⁻¹] g,  D = diag ‖T̃_{·,i}‖  (Prop. 6, damping)
        (diagonal_only: ĝ ← D⁻¹ g, the paper's "diagonal conditioning" ablation)
    if ⟨g, ĝ⟩ ≤ 0 or ĝ not finite:  ĝ ← g                                       (counted fallback)
    if ‖ĝ‖ > clip_norm:  ĝ ← clip_norm · ĝ / ‖ĝ‖                                 (clip_norm)
    p.grad ← ĝ
    Levenberg-Marquardt (App. D.2, eps_schedule = LMSchedule(interval, omega, low, high, eps_min,
    eps_max): every interval steps, with r the largest reduction ratio
    r_t = 2 (L_{t-1} − L_t) / (lr ⟨g, ĝ⟩_{t-1}) seen since the last update):
        ε ← omega · ε if r > high;   ε ← ε / omega if r < low;   ε ∈ [eps_min, eps_max]

Two ways to get ``g`` and ``T`` (``mode``):

* ``"fast"`` (default) — one backward pass for all ``M + 1`` cotangents
  (:mod:`kwng.engine.replicate`): the model's training forward runs on ``M + 1`` stacked copies of the
  batch (matrix work on one copy only; batch norm per copy, so ``X``, the running statistics and
  the Jacobian are the model's own), the backward pass takes the stacked cotangent
  ``(∂L/∂X, C_1/N, …, C_M/N)``, and every layer forms the ``M + 1`` weight gradients in one call.
  ``outputs`` must be the tensor the model returned, or computed from it without parameters
  (e.g. ``U · model(z)`` with a fixed ``U``: the cotangents are pulled back through that map).
  The direction is :func:`kwng.engine.step_direction.step_direction` (Prop. 6 through
  :func:`kwng.solve.kwng_direction`, then :func:`kwng.solve.safeguard`, compiled on CUDA) and all
  bookkeeping (ε, r, counters, fallbacks, clipping) stays in device tensors: no host
  synchronisation in a step. The replicated pass runs in the model's memory format: on a GPU, make
  a convolutional model channels_last (``model.to(memory_format=torch.channels_last)`` and inputs
  ``z.contiguous(memory_format=torch.channels_last)``), which cuDNN runs without conversions
  (``results/benchmarks/step_cost.json``: 21.9 ms a captured fp32 ResNet-18 step, M = 5, H100). A model with parameters outside
  ``Conv2d``/``Linear``/``BatchNorm`` (:func:`kwng.engine.replicate.unsupported_reason`), or a step whose
  ``outputs`` are not the model's own output, uses the serial passes below (logged once);
* ``"reference"`` — as the authors' code: ``M + 1`` serial backward passes (``retain_graph``), the
  float64 eigendecomposition solve of :func:`kwng.nystrom_solve` and :func:`kwng.solve.safeguard`,
  bookkeeping on the host.

Under ``torch.autocast`` the network runs in the autocast dtype; ``g`` and ``T`` are returned in the
parameters' dtype and the kernel algebra runs in float32/float64 as in full precision.

ε convention: ``eps`` enters as ``(ε/N) I`` next to the whitened ``T̃ D⁻¹ T̃ᵀ`` (Prop. 6). The
authors' code whitens with ``(CCᵀ/N)^{-1/2}`` and adds ``ε_a I``; with the paper's damping
``T_tilde`` the two regularisers agree when ``ε = √N · ε_a`` (:func:`kwng.engine.config.eps_from_authors`), bounds
included; with ``identity`` or ``T`` damping they agree when ``ε = ε_a``.

Counters (:meth:`KWNGPreconditioner.counters`): ``fallbacks`` (steps where the natural direction
was replaced by ``g``), ``ill_conditioned`` (``CCᵀ`` regularised), ``rank_sum`` (sum over steps
of the rank kept by the stable solve), ``damping_floored``, ``clipped``, ``eps_up``/``eps_down``.
In fast mode fallbacks are counted on the device and logged by :meth:`counters` (a host sync).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kwng.engine.config import KWNGConfig, resolve_mode
from kwng.engine.grads import replicated_gradients
from kwng.engine.graph import derived_from
from kwng.engine.lm import LevenbergMarquardt, LMSchedule
from kwng.engine.precond_loop import (
    GradWriter,
    backward_hint,
    check_grad_scaler,
    check_lr,
    check_model,
    check_not_loss_gradient,
    check_step_inputs,
    group_lrs_missing,
    is_compiled,
    overflowed_step,
    predicted_decrease,
    resolve_params,
    scale_of,
)
from kwng.engine.precond_state import (
    COUNTERS,
    generator_state,
    load_generator_state,
    load_preconditioner_state,
)
from kwng.engine.replicate import ReplicatedEngine, unsupported_reason
from kwng.engine.step_direction import reference_direction_into, step_direction
from kwng.estimator import (
    draw_basis,
    jacobian_from_outputs,
    kernel_matrices,
    with_bandwidth,
)
from kwng.nosync import kernel_matrices_nosync

__all__ = ["KWNGPreconditioner"]

log = logging.getLogger(__name__)


class KWNGPreconditioner:
    """Replace the gradients of ``model``'s parameters by the KWNG direction (Prop. 6).

    Arguments: ``model`` — any ``nn.Module``; its trainable parameters are ``θ`` (``q``
    numbers). A parameter frozen later (``requires_grad=False``) is left alone from then on. In
    fast mode the replicated forward runs when ``model`` itself is called (``model(z)``); attach
    the preconditioner to the network that the training loop calls. ``config`` — a
    :class:`kwng.KWNGConfig` with the hyperparameters (``num_basis``, ``eps``, ``lam``,
    ``kernel``, ``bandwidth``, ``sigma0``, ``damping``, ``eps_schedule``, ``clip_norm``,
    ``mode``, ``diagonal_only``, ``rcond``; see there); keyword arguments of the same names
    build it (or override fields of ``config``). ``lr`` — the optimizer's step size, a number
    or a callable of no arguments that returns the current one (e.g.
    ``lambda: optimizer.param_groups[0]["lr"]`` under a learning-rate schedule); it enters the
    reduction ratio ``r`` of the ε rule, so it is required unless ``eps_schedule=None``.
    ``generator`` — a ``torch.Generator`` for the basis draw (reproducible runs and tests;
    its state is part of :meth:`state_dict`; without one the basis comes from torch's global
    stream, which a checkpoint saves with ``torch.get_rng_state()``).

    The loop (:mod:`kwng.engine.precond_loop`): ``params`` — the parameters whose metric is
    built, by default every trainable one; pass ``optimizer.param_groups`` when the
    optimizer holds a subset, or groups with different step sizes (each group's ``"lr"``
    then enters the ε rule, and ``lr`` is needed only for groups without one).
    ``grad_scaler`` — the ``torch.amp.GradScaler`` of an fp16 loop: pass
    ``grad_scaler.scale(loss)`` to :meth:`step`, which unscales ``g`` before the
    solve and the clip, then ``grad_scaler.step(optimizer)``. A gradient already in ``p.grad``
    (another loss term's ``backward()``) is added to the direction; two steps without an
    optimizer step between them (gradient accumulation) are refused, as is a
    ``DistributedDataParallel`` model (use :class:`kwng.DistributedKWNG`). The fast mode
    patches the model's layers: a pickled model (``torch.save(model)``) carries neither
    the patch nor the preconditioner, and :meth:`remove_hooks` detaches it.
    """

    #: a gradient already in ``p.grad`` is added to the direction
    adds_prefilled_grads = True

    def __init__(self, model: nn.Module, config: KWNGConfig | None = None, *,
                 lr: float | Callable[[], float] | None = None,
                 generator: torch.Generator | None = None, params: Any = None,
                 grad_scaler: Any = None, **hyperparameters: Any) -> None:
        if "optimizer" in hyperparameters:
            raise ValueError("optimizer= is no longer taken: pass lr= (a number, or a callable such as "
                             "lambda: optimizer.param_groups[0]['lr'])")
        unknown = set(hyperparameters) - set(KWNGConfig.fields())
        if unknown:
            raise ValueError(f"unknown hyperparameter(s) {sorted(unknown)}; accepted: "
                             f"{', '.join(KWNGConfig.fields())}")
        if config is not None and not isinstance(config, KWNGConfig):
            raise ValueError(f"config must be a kwng.KWNGConfig or None, got {type(config).__name__}")
        cfg = self.config = (config or KWNGConfig()).replace(**hyperparameters)
        check_model(model)
        self.model = model
        self.params, self.groups = resolve_params(model, params)
        self._lr = check_lr(lr, cfg.eps_schedule is not None and group_lrs_missing(self.groups))
        self.grad_scaler = check_grad_scaler(grad_scaler)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        self.generator = generator
        dev = self.params[0].device
        # a fixed ε is a schedule whose bounds cannot move it (and it is never updated)
        self.lm = LevenbergMarquardt(cfg.eps, cfg.eps_schedule or LMSchedule(eps_min=cfg.eps, eps_max=cfg.eps),
                                     device=dev)
        self._step_count = torch.zeros((), dtype=torch.long, device=dev)
        self._warned: set[str] = set()
        self._engine: ReplicatedEngine | None = None
        self.mode = resolve_mode(cfg.mode, dev, model)  # "auto": by device and model kind
        if self.mode == "fast":
            reason = unsupported_reason(model, self.params)
            if reason is not None and "already carries" in reason:
                raise ValueError(f"model: {reason}")
            if reason is None:
                self._engine = ReplicatedEngine(model, cfg.num_basis + 1)
            else:
                self._warn_once("unsupported", "KWNG fast mode: %s; this model uses serial backward passes", reason)
        self._grads = GradWriter(self.adds_prefilled_grads)
        self._counters = {k: torch.zeros((), dtype=torch.long, device=dev) for k in COUNTERS}

    # --- state ------------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        """Steps taken (counted on the device, so CUDA-graph replays count; a host sync)."""
        return int(self._step_count)

    @property
    def eps(self) -> float:
        """The current ``ε`` (a host sync on GPU)."""
        return float(self.lm.eps)

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def counters(self) -> dict[str, int]:
        """Counters since construction, as Python ints (a host sync); logs fallbacks if any."""
        out = {k: int(v) for k, v in self._counters.items()}
        out["eps_up"], out["eps_down"] = int(self.lm.ups), int(self.lm.downs)
        out["steps"] = steps = self.num_steps
        if out["fallbacks"]:
            log.info("KWNG fell back to the Euclidean gradient in %d of %d steps", out["fallbacks"], steps)
        if out["ill_conditioned"]:
            log.info("C Cᵀ was rank deficient in %d of %d steps", out["ill_conditioned"], steps)
        if out["loss_only"]:
            self._warn_once("loss_only", "KWNG: parameters that move the loss but not the samples (zero column "
                            "of T) took the Euclidean gradient scaled like the rest (%d components over %d "
                            "steps)", out["loss_only"], steps)
        return out

    def hyperparameters(self) -> dict[str, Any]:
        """The configuration as plain values (the kernel as its repr, the schedule as a dict)."""
        cfg = self.config
        hp = {k: getattr(cfg, k) for k in KWNGConfig.fields()}
        hp["kernel"] = repr(cfg.kernel)
        hp["eps_schedule"] = None if cfg.eps_schedule is None else cfg.eps_schedule.as_dict()
        return hp

    def state_dict(self) -> dict[str, Any]:
        """The Levenberg-Marquardt state (``lm``, with the current ``ε``), the counters, the
        basis generator's state (``None`` without a generator) and the hyperparameters (for
        checking): a run resumed from it draws the same bases."""
        return {"lm": self.lm.state_dict(), "num_steps": self.num_steps,
                "counters": {k: int(v) for k, v in self._counters.items()},
                "generator": generator_state(self.generator),
                "hyperparameters": self.hyperparameters()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (also one saved before ``eps_schedule`` replaced the
        ``lm_*``/``adapt_eps``/``eps_min``/``eps_max`` fields); warns if the hyperparameters differ."""
        self._step_count, self._counters = load_preconditioner_state(state, self.lm, self.hyperparameters())
        load_generator_state(state, self.generator)

    def __repr__(self) -> str:
        hp = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        q = sum(p.numel() for p in self.params)
        return f"KWNGPreconditioner(q={q}, {hp})"

    def remove_hooks(self) -> None:
        """Give the model its own forward back (fast mode patches Conv2d/Linear/BatchNorm)."""
        if self._engine is not None:
            self._engine.remove()
            self._engine = None

    # --- the step ---------------------------------------------------------------------------
    def _check_inputs(self, loss: torch.Tensor, outputs: torch.Tensor) -> None:
        """The arguments of :meth:`step` (:func:`kwng.engine.precond_loop.check_step_inputs`)."""
        check_step_inputs(loss, outputs, self.config.num_basis)

    def _current_lr(self) -> float:
        """The step size of the reduction ratio (1 with a fixed ε, where nothing reads it)."""
        if self._lr is None:
            return 1.0
        return float(self._lr()) if callable(self._lr) else self._lr

    def observe_loss_after_step(self, loss_after: torch.Tensor) -> None:
        """``eps_schedule.rule == "same_batch"``: the loss of the step's mini-batch after
        ``optimizer.step()``."""
        if not isinstance(loss_after, torch.Tensor) or loss_after.dim() != 0:
            raise ValueError("loss_after must be a scalar tensor (the same batch's loss after the step)")
        self.lm.observe(loss_after)

    def _gradients(self, loss: torch.Tensor, X: torch.Tensor, C: torch.Tensor, params: list[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """``g`` (``q``) and ``T`` (``M × q``) of the active parameters, from the graph of ``loss``, ``X``."""
        eng = self._engine
        X0 = None if eng is None else eng.first
        if X0 is not None and (X is X0 or (X.shape == X0.shape and derived_from(X, X0, params))):
            return replicated_gradients(loss, X, X0, C, params, eng, self._warn_once)
        if self.mode == "fast":
            self._warn_once("serial", "KWNG fast mode: outputs are not the output of the model's last training "
                            "forward (or the model is unsupported): serial backward passes are used")
            self._counters["serial_steps"] += 1
        g_parts = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True, materialize_grads=True)
        g = torch.cat([gp.reshape(-1) for gp in g_parts])
        T = jacobian_from_outputs(X, params, C.to(X.dtype), retain_graph=False)
        return g, T

    def step(self, loss: torch.Tensor, outputs: torch.Tensor) -> dict[str, Any]:
        """Backward pass(es), KWNG direction, fallback, clipping; the result is written into ``p.grad``.

        ``outputs`` is the ``(N, d)`` batch ``X = h_θ(z)`` and ``loss`` a scalar built from it
        (it may also depend on the parameters directly, e.g. an L2 term: ``g`` is its full
        gradient). Returns a dict with ``eps`` (used in this step), ``reduction_ratio`` (the
        latest ``r`` of the ε rule), ``fallback`` (the Euclidean gradient was used), ``clipped``,
        ``rank``, ``floored_columns`` (entries of ``D`` raised to the relative floor),
        ``floored_share`` (their share of ``‖ĝ‖²``), ``loss_only`` (components of parameters the
        samples do not depend on, :func:`kwng.solve.loss_only_columns`), ``dot``
        (``⟨g, ĝ⟩`` after clipping), ``grad_norm``, ``direction_norm``, ``bandwidth`` — 0-dim
        tensors on the outputs' device in both modes (``"fast"`` never syncs with the host).
        """
        self._check_inputs(loss, outputs)
        scale = scale_of(self.grad_scaler, loss)
        with torch.autocast(outputs.device.type, enabled=False):  # the kernel algebra in ≥ float32
            return self._step(loss, outputs, scale)

    def _active_params(self, device: torch.device) -> list[torch.Tensor]:
        """The parameters that still require a gradient (frozen ones lose the buffer's view),
        with the state moved to ``device``."""
        if device != self.lm.eps.device:
            self.lm.to(device)
            self._counters = {k: v.to(device) for k, v in self._counters.items()}
            self._step_count = self._step_count.to(device)
        self._grads.release(p for p in self.params if not p.requires_grad)
        params = [p for p in self.params if p.requires_grad]
        if not params:
            raise ValueError("every parameter of the model is frozen (requires_grad=False): nothing to update")
        return params

    def _share(self, Xk: torch.Tensor, loss: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The samples, basis and loss the step's estimator sees: here this process's own
        (:class:`kwng.engine.distributed.DistributedKWNG` gathers every rank's)."""
        N, d = Xk.shape
        idx, coords = draw_basis(N, d, self.config.num_basis, self.generator, Xk.device)
        return Xk, idx, coords, loss

    def _reduce(self, g: torch.Tensor, T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``g`` and ``T`` as the solve sees them: here unchanged (the distributed
        preconditioner sums the ranks' shares)."""
        return g, T

    def _backward(self, loss: torch.Tensor, X: torch.Tensor, C: torch.Tensor, params: list[torch.Tensor],
                  taken: dict[int, torch.Tensor], scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``g`` and ``T`` of :meth:`_gradients`, ``g`` unscaled (``scale``: the loss scale of a
        ``GradScaler``; the cotangents of ``T`` are not scaled); a loop's mistake is named."""
        try:
            g, T = self._gradients(loss, X, C, params)
        except RuntimeError as err:
            hint = backward_hint(err, is_compiled(self.model), self.mode)
            if hint is err:
                raise
            raise hint from err
        check_not_loss_gradient(taken, g, params)
        return (g, T) if scale is None else (g / scale, T)

    def _step(self, loss: torch.Tensor, outputs: torch.Tensor, scale: torch.Tensor | None) -> dict[str, Any]:
        cfg, X = self.config, outputs
        params = self._active_params(X.device)
        taken = self._grads.take(params)
        self._step_count += 1
        Xk = X.detach().to(torch.promote_types(X.dtype, torch.float32))
        Xk, idx, coords, loss_all = self._share(Xk, loss if scale is None else loss.detach() / scale)
        N = Xk.shape[0]
        eps = self.lm.update(loss_all) if cfg.eps_schedule is not None else self.lm.eps
        reference = self.mode == "reference"
        if reference:
            kern = with_bandwidth(cfg.kernel, Xk, idx, cfg.bandwidth, cfg.sigma0)
            C, K, CCt = kernel_matrices(Xk, idx, coords, kern)
            sigma = torch.tensor(kern.bandwidth)
        else:
            C, K, CCt, sigma = kernel_matrices_nosync(Xk, idx, coords, cfg.kernel, cfg.bandwidth, cfg.sigma0)
        g, T = self._backward(loss, X, C, params, taken, scale)
        g = g.to(Xk.dtype) if g.dtype not in (torch.float32, torch.float64) else g
        g, T = self._reduce(g, T.to(g.dtype))
        out = self._grads.views(g.numel(), params)
        if scale is not None and reference and not bool(torch.isfinite(g).all()):
            f = overflowed_step(out, g)
        elif reference and not cfg.diagonal_only:
            f = reference_direction_into(out, T, CCt, K, g, N, eps=float(eps), lam=cfg.lam,
                                         damping=cfg.damping, rcond=cfg.rcond, clip_norm=cfg.clip_norm)
        else:
            f = step_direction(out, T, CCt, K, g, N, eps=torch.as_tensor(eps, device=T.device), lam=cfg.lam,
                               damping=cfg.damping, rcond=cfg.rcond, clip_norm=cfg.clip_norm,
                               diagonal_only=cfg.diagonal_only)
        self.lm.record(*predicted_decrease(self.groups, params, g, out, f["dot"], self._current_lr))
        if scale is not None:
            out.mul_(scale)  # GradScaler.step(optimizer) divides it again
        self._grads.finish(params, taken)
        return self._account(f, eps, sigma, X.device, reference)

    def _account(self, f: dict, eps, sigma, device: torch.device, reference: bool) -> dict[str, Any]:
        """Add the step to the counters; the step's info (0-dim tensors on ``device``)."""
        c = self._counters
        for key, name in (("fallbacks", "fallback"), ("ill_conditioned", "ill_conditioned"),
                          ("rank_sum", "rank"), ("damping_floored", "damping_floored"),
                          ("clipped", "clipped"), ("loss_only", "loss_only")):
            c[key] += f[name].long()
        info = {"eps": eps, "reduction_ratio": self.lm.ratio.clone(), "fallback": f["fallback"],
                "clipped": f["clipped"], "rank": f["rank"], "floored_columns": f["damping_floored"].long(),
                "floored_share": f["floored_share"], "loss_only": f["loss_only"], "dot": f["dot"],
                "grad_norm": f["grad_norm"], "direction_norm": f["direction_norm"], "bandwidth": sigma}
        info = {k: torch.as_tensor(v, device=device) for k, v in info.items()}
        if reference and bool(info["fallback"]):  # the reference mode syncs anyway
            log.info("step %d: ⟨g, ĝ⟩ ≤ 0 or ĝ not finite: Euclidean gradient used", self.num_steps)
        return info
