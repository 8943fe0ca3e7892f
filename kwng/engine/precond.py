"""KWNG as a drop-in preconditioner for any PyTorch model (book chapter
:ref:`deep-learning`).

A classifier ``z ↦ X = h_θ(z) ∈ R^d`` is an implicit model: its outputs on a mini-batch
are ``N`` samples ``X_n`` of a distribution ``ρ_θ`` (Arbel et al., 2020, §4.2). The
preconditioner replaces the Euclidean gradient ``g = ∇_θ L`` by the kernelized
Wasserstein natural gradient of Prop. 6, then any ``torch.optim`` optimizer takes the
step::

    precond = KWNGPreconditioner(model, lr=0.1, num_basis=5, eps=1e-5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for z, y in loader:
        optimizer.zero_grad()
        X = model(z)                  # (N, d): the samples
        loss = loss_fn(X, y)
        info = precond.step(loss, X)  # backward pass(es), KWNG direction into p.grad
        optimizer.step()

Algorithm (one call of :meth:`KWNGPreconditioner.step`; symbols ↔ arguments)::

    draw M = num_basis indices Y_m = X_{b_m} and coordinates i_m     (draw_basis)
    σ ← σ0 · mean ‖X_n − Y_m‖²   (bandwidth="mean_sq", sigma0)        (§3.3)
    C, K, CCᵀ of Prop. 5 from X and the kernel                        (kernel_matrices)
    g ← ∇_θ L,  T_m ← (C_m / N)ᵀ ∂X/∂θ   (m = 1..M)                   (backward passes)
    ĝ ← (1/ε)[D⁻¹ − D⁻¹T̃ᵀ(T̃D⁻¹T̃ᵀ + (ε/N) I)⁻¹T̃D⁻¹] g,  D = diag ‖T̃_{·,i}‖
                                                                      (Prop. 6, damping)
        (diagonal_only: ĝ ← D⁻¹ g, the paper's "diagonal conditioning" ablation)
    (refresh_every = k > 1: the lines above only every k steps; in between, g from
     one plain backward pass and ĝ from the cached T, CCᵀ, K at this step's ε:
     kwng.engine.amortized)
    if ⟨g, ĝ⟩ ≤ 0 or ĝ not finite:  ĝ ← g                             (counted fallback)
    if ‖ĝ‖ > clip_norm:  ĝ ← clip_norm · ĝ / ‖ĝ‖                       (clip_norm)
    p.grad ← ĝ
    Levenberg-Marquardt (App. D.2, eps_schedule = LMSchedule(interval, omega, low,
    high, eps_min, eps_max): every interval steps, with r the largest reduction ratio
    r_t = 2 (L_{t-1} − L_t) / (lr ⟨g, ĝ⟩_{t-1}) seen since the last update):
        ε ← omega · ε if r > high;   ε ← ε / omega if r < low;   ε ∈ [eps_min, eps_max]

Two ways to get ``g`` and ``T`` (``mode``):

* ``"fast"`` (default) — one backward pass for all ``M + 1`` cotangents
  (:mod:`kwng.engine.replicate`): the model's training forward runs on ``M + 1``
  stacked copies of the batch (matrix work on one copy only; batch norm per copy, so
  ``X``, the running statistics and the Jacobian are the model's own), the backward
  pass takes the stacked cotangent ``(∂L/∂X, C_1/N, …, C_M/N)``, and every layer forms
  the ``M + 1`` weight gradients in one call. ``outputs`` must be the tensor the model
  returned, or computed from it without parameters (e.g. ``U · model(z)`` with a fixed
  ``U``: the cotangents are pulled back through that map). The direction is
  :func:`kwng.engine.step_direction.step_direction` (Prop. 6 through
  :func:`kwng.solve.kwng_direction`, then :func:`kwng.solve.safeguard`, compiled on
  CUDA) and all bookkeeping (ε, r, counters, fallbacks, clipping) stays in device
  tensors; the one host synchronisation of a step is the check that the outputs,
  the loss and ``g`` are finite (skipped while a CUDA graph is recorded). The
  replicated pass runs in the model's
  memory format: on a GPU, make a convolutional model channels_last
  (``model.to(memory_format=torch.channels_last)`` and inputs
  ``z.contiguous(memory_format=torch.channels_last)``), which cuDNN runs without
  conversions (``results/benchmarks/step_cost.json``: 21.9 ms a captured fp32
  ResNet-18 step, M = 5, H100). A model with parameters outside
  ``Conv2d``/``Linear``/``BatchNorm``
  (:func:`kwng.engine.replicate.unsupported_reason`), or a step whose ``outputs`` are
  not the model's own output, uses the serial passes below (logged once);
* ``"reference"`` — as the authors' code: ``M + 1`` serial backward passes
  (``retain_graph``), the float64 eigendecomposition solve of :func:`kwng.nystrom_solve`
  and :func:`kwng.solve.safeguard`, bookkeeping on the host.

How a step computes, and the hooks the distributed preconditioner overrides:
:mod:`kwng.engine.precond_step`. Under ``torch.autocast`` the network runs in the
autocast dtype; ``g`` and ``T`` are returned in the parameters' dtype and the kernel
algebra runs in float32/float64 as in full precision.

ε convention: ``eps`` enters as ``(ε/N) I`` next to the whitened ``T̃ D⁻¹ T̃ᵀ``
(Prop. 6). The authors' code whitens with ``(CCᵀ/N)^{-1/2}`` and adds ``ε_a I``; with
the paper's damping ``T_tilde`` the two regularisers agree when ``ε = √N · ε_a``
(:func:`kwng.engine.config.eps_from_authors`), bounds included; with ``identity`` or
``T`` damping they agree when ``ε = ε_a``.

Counters (:meth:`KWNGPreconditioner.counters`): ``fallbacks`` (steps where the natural
direction was replaced by ``g``), ``ill_conditioned`` (``CCᵀ`` regularised),
``rank_sum`` (sum over steps of the rank kept by the stable solve),
``damping_floored``, ``clipped``, ``eps_up``/``eps_down``, ``euclidean_steps``. In
fast mode fallbacks are counted on the device and logged by :meth:`counters` (a host
sync).

Batches the estimator cannot use (:mod:`kwng.engine.precond_step`): non-finite
outputs or loss are refused in every mode before the step changes any state, a
non-finite ``g`` before anything is written into ``p.grad`` (a ``GradScaler``'s
overflow excepted: the scaler skips that step). On a refresh step, a
batch with fewer samples than ``num_basis`` (a short last batch) or whose samples all
coincide (a zero-initialised output layer: bandwidth 0) takes the Euclidean gradient,
clipped, logged once and counted in ``euclidean_steps`` (and ``fallbacks``); nothing is
cached, so the next step refreshes. A step between refreshes applies the cached system
to any batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kwng._checks import check_int
from kwng.engine.amortized import SystemCache
from kwng.engine.config import (
    KWNGConfig,
    auto_mode,
    config_with,
    live_changes,
    resolve_mode,
)
from kwng.engine.lm import LevenbergMarquardt, LMSchedule
from kwng.engine.precond_loop import (
    GradWriter,
    check_grad_scaler,
    check_lr,
    check_model,
    group_lrs_missing,
    resolve_params,
    scale_of,
)
from kwng.engine.precond_state import (
    COUNTERS,
    counters_report,
    generator_state,
    load_generator_state,
    load_preconditioner_state,
)
from kwng.engine.precond_step import PreconditionerStep
from kwng.engine.replicate import ReplicatedEngine, unsupported_reason

__all__ = ["KWNGPreconditioner"]

log = logging.getLogger(__name__)


class KWNGPreconditioner(PreconditionerStep):
    """Replace the gradients of ``model``'s parameters by the KWNG direction (Prop. 6).

    Arguments: ``model`` — any ``nn.Module``; its trainable parameters are ``θ`` (``q``
    numbers at a step: those that require a gradient then). A parameter frozen later
    (``requires_grad=False``) is left alone from then on; one frozen at construction and
    unfrozen later (gradual unfreezing) is trained from the step it requires a gradient,
    as ``torch.optim`` trains it (in fast mode it must live in a Conv2d, Linear or
    BatchNorm layer). In fast mode the replicated forward runs when ``model`` itself is
    called (``model(z)``); attach the preconditioner to the network that the training
    loop calls. ``config`` — a :class:`kwng.KWNGConfig` with the hyperparameters
    (``num_basis``, ``eps``, ``lam``, ``kernel``, ``bandwidth``, ``sigma0``,
    ``damping``, ``eps_schedule``, ``clip_norm``, ``mode``, ``diagonal_only``,
    ``rcond``, ``refresh_every``; see there); keyword arguments of the same names build
    it (or override fields of ``config``). ``lr`` — the optimizer's step size, a number
    or a callable of no arguments that returns the current one (e.g.
    ``lambda: optimizer.param_groups[0]["lr"]`` under a learning-rate schedule); it
    enters the reduction ratio ``r`` of the ε rule, so it is required unless
    ``eps_schedule=None``. ``generator`` — a ``torch.Generator`` for the basis draw
    (reproducible runs and tests; its state is part of :meth:`state_dict`; without one
    the basis comes from torch's global stream, which a checkpoint saves with
    ``torch.get_rng_state()``).

    The loop (:mod:`kwng.engine.precond_loop`): ``params`` — the parameters whose metric
    is built, by default every trainable one; pass ``optimizer.param_groups`` when the
    optimizer holds a subset, or groups with different step sizes (each group's
    ``"lr"`` then enters the ε rule, and ``lr`` is needed only for groups without one).
    ``grad_scaler`` — the ``torch.amp.GradScaler`` of an fp16 loop: pass
    ``grad_scaler.scale(loss)`` to :meth:`step`, which unscales ``g`` before the solve
    and the clip, then ``grad_scaler.step(optimizer)``. A gradient already in
    ``p.grad`` (another loss term's ``backward()``) is added to the direction; two
    steps without an optimizer step between them are refused (for gradient
    accumulation pass ``accumulation_steps``), as is a ``DistributedDataParallel``
    model (use :class:`kwng.DistributedKWNG`).
    ``accumulation_steps`` — ``n ≥ 1`` micro-batches per optimizer step (gradient
    accumulation): call :meth:`step` on each micro-batch with its share of the loss
    (``loss_fn(X_i, y_i) / n``, as in a plain accumulation loop, but without
    ``backward()``) and ``optimizer.step()`` after every ``n``-th; the direction is the
    one of the batch of all ``n`` micro-batches with loss ``Σ loss_i``, exactly (basis,
    bandwidth and ``C`` are drawn over the whole batch). The price: the graphs of the
    ``n`` micro-batches are kept until the ``n``-th, so the memory is that of the whole
    batch (unlike kfac-pytorch's accumulation, which keeps running factors); in fast
    mode ``T`` then comes from serial backward passes. A checkpoint taken between
    micro-batches does not hold them.
    ``output_fn`` — for a model that returns several outputs (a tuple such as
    ``(logits, aux)``, a dict such as a Hugging Face ``ModelOutput``): the function
    that picks the ``(N, d)`` samples from it (``lambda out: out[0]``, ``lambda out:
    out["logits"]``); pass :meth:`step` the same tensor (``X = output_fn(model(z))``).
    The fast mode needs it to know which output carries the samples; the other
    outputs are returned for the batch as usual. The
    fast mode patches the model's layers: a pickled model (``torch.save(model)``)
    carries neither the patch nor the preconditioner, and :meth:`remove_hooks` detaches
    it.
    """

    #: a gradient already in ``p.grad`` is added to the direction
    adds_prefilled_grads = True

    def __init__(self, model: nn.Module, config: KWNGConfig | None = None, *,
                 lr: float | Callable[[], float] | None = None,
                 generator: torch.Generator | None = None, params: Any = None,
                 grad_scaler: Any = None,
                 output_fn: Callable[[Any], torch.Tensor] | None = None,
                 accumulation_steps: int = 1, **hyperparameters: Any) -> None:
        cfg = self._config = config_with(config, hyperparameters)
        check_model(model)
        self.model = model
        self.params, self.groups = resolve_params(model, params)
        self._lr = check_lr(lr, cfg.eps_schedule is not None
                            and group_lrs_missing(self.groups))
        self.grad_scaler = check_grad_scaler(grad_scaler)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError("generator must be a torch.Generator or None, got "
                             f"{type(generator).__name__}")
        self.generator = generator
        if output_fn is not None and not callable(output_fn):
            raise ValueError("output_fn must be None or a callable that picks the "
                             "(batch, d) samples from the model's output, got "
                             f"{type(output_fn).__name__}")
        self.output_fn = output_fn
        self.accumulation_steps = check_int(accumulation_steps, "accumulation_steps", 1)
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        dev = self.params[0].device
        # a fixed ε is a schedule whose bounds cannot move it (and it is never updated)
        fixed = LMSchedule(eps_min=cfg.eps, eps_max=cfg.eps)
        self.lm = LevenbergMarquardt(cfg.eps, cfg.eps_schedule or fixed, device=dev)
        self._step_count = torch.zeros((), dtype=torch.long, device=dev)
        self._warned: set[str] = set()
        self._engine: ReplicatedEngine | None = None
        self.mode = resolve_mode(cfg.mode, dev, model)  # "auto": by device, model kind
        if cfg.mode == "auto":
            log.info("KWNG mode='auto': %s, %s", *auto_mode(dev, model))
        if self.mode == "fast" and self.accumulation_steps > 1:
            self._warned.add("serial")
            log.info("KWNG fast mode with accumulation_steps = %d: the whole batch's "
                     "T comes from serial backward passes (the replicated forward "
                     "covers one micro-batch)", self.accumulation_steps)
        elif self.mode == "fast":
            reason = unsupported_reason(
                model, [p for p in self.params if p.requires_grad])
            if reason is not None and "already carries" in reason:
                raise ValueError(f"model: {reason}")
            if reason is None:
                self._engine = ReplicatedEngine(model, cfg.num_basis + 1, output_fn)
            else:
                self._warn_once("unsupported", "KWNG fast mode: %s; this model uses "
                                "serial backward passes", reason)
        self._grads = GradWriter(self.adds_prefilled_grads)
        # refresh_every > 1: the system between refreshes
        self.cache = SystemCache(cfg.refresh_every, self._follow_schedule,
                                 cfg.refresh_guard)
        self._counters = {k: torch.zeros((), dtype=torch.long, device=dev)
                          for k in COUNTERS}

    # --- state ------------------------------------------------------------------------
    @property
    def config(self) -> KWNGConfig:
        """The hyperparameters. Assigning a new :class:`kwng.KWNGConfig` (e.g.
        ``precond.config = precond.config.replace(refresh_every=4)``) takes effect at
        the next step, which builds the kernel system afresh; ``mode``, ``eps`` and
        ``eps_schedule`` are fixed at construction (the path and the ε rule's state
        depend on them), and changing them is refused."""
        return self._config

    @config.setter
    def config(self, new: KWNGConfig) -> None:
        changed = live_changes(self._config, new)
        if not changed:
            return
        self._config = new
        if "num_basis" in changed and self._engine is not None:
            self._engine.remove()
            self._engine = ReplicatedEngine(self.model, new.num_basis + 1,
                                            self.output_fn)
        # the next step builds the system afresh, with the new settings
        self.cache.every, self.cache.guard = new.refresh_every, new.refresh_guard
        self.cache.load_state_dict(None, self.cache.steps, self.params[0].device)
        log.info("KWNG: settings changed (%s), effective from the next step",
                 ", ".join(f"{k}={getattr(new, k)!r}" for k in changed))

    @property
    def num_steps(self) -> int:
        """Steps taken (counted on the device, so CUDA-graph replays count; a host
        sync)."""
        return int(self._step_count)

    @property
    def eps(self) -> float:
        """The current ``ε`` (a host sync on GPU)."""
        return float(self.lm.eps)

    def _follow_schedule(self, due: bool) -> None:
        """The replicated forward runs before refresh steps only
        (:mod:`kwng.engine.amortized`)."""
        if self._engine is not None:
            self._engine.enabled = due

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def counters(self) -> dict[str, int]:
        """Counters since construction, as Python ints (a host sync); logs fallbacks if
        any."""
        return counters_report(self._counters, self.lm, self.num_steps, self._warn_once)

    def hyperparameters(self) -> dict[str, Any]:
        """The configuration as plain values (the kernel as its repr, the schedule as a
        dict)."""
        cfg = self.config
        hp = {k: getattr(cfg, k) for k in KWNGConfig.fields()}
        hp["kernel"] = repr(cfg.kernel)
        hp["eps_schedule"] = (None if cfg.eps_schedule is None
                              else cfg.eps_schedule.as_dict())
        return hp

    def state_dict(self) -> dict[str, Any]:
        """The Levenberg-Marquardt state (``lm``, with the current ``ε``), the counters,
        the basis generator's state (``None`` without a generator), the cached system of
        ``refresh_every > 1`` (``cache``:
        :meth:`kwng.engine.amortized.SystemCache.state_dict`) and the hyperparameters
        (for checking): a run resumed from it takes the same directions."""
        return {"lm": self.lm.state_dict(), "num_steps": self.num_steps,
                "counters": {k: int(v) for k, v in self._counters.items()},
                "generator": generator_state(self.generator),
                "cache": self.cache.state_dict(),
                "hyperparameters": self.hyperparameters()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (also one saved before ``eps_schedule`` replaced
        the ``lm_*``/``adapt_eps``/``eps_min``/``eps_max`` fields); warns if the
        hyperparameters differ."""
        self._step_count, self._counters = load_preconditioner_state(
            state, self.lm, self.hyperparameters())
        load_generator_state(state, self.generator)
        self.cache.load_state_dict(state.get("cache"), int(self._step_count),
                                   self.params[0].device)

    def __repr__(self) -> str:
        hp = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        q = sum(p.numel() for p in self.params if p.requires_grad)
        return f"KWNGPreconditioner(q={q}, {hp})"

    def remove_hooks(self) -> None:
        """Give the model its own forward back (fast mode patches
        Conv2d/Linear/BatchNorm)."""
        if self._engine is not None:
            self._engine.remove()
            self._engine = None

    # --- the step (computed by PreconditionerStep) ------------------------------------
    def observe_loss_after_step(self, loss_after: torch.Tensor) -> None:
        """``eps_schedule.rule == "same_batch"``: the loss of the step's mini-batch
        after ``optimizer.step()``."""
        if not isinstance(loss_after, torch.Tensor) or loss_after.dim() != 0:
            raise ValueError("loss_after must be a scalar tensor (the same batch's "
                             "loss after the step)")
        self.lm.observe(loss_after)

    def step(self, loss: torch.Tensor, outputs: torch.Tensor) -> dict[str, Any]:
        """Backward pass(es), KWNG direction, fallback, clipping; the result is written
        into ``p.grad``.

        ``outputs`` is the ``(N, d)`` batch ``X = h_θ(z)`` and ``loss`` a scalar built
        from it (it may also depend on the parameters directly, e.g. an L2 term: ``g``
        is its full gradient). Returns a dict with ``eps`` (used in this step),
        ``reduction_ratio`` (the latest ``r`` of the ε rule), ``fallback`` (the
        Euclidean gradient was used), ``clipped``, ``rank``, ``floored_columns``
        (entries of ``D`` raised to the relative floor), ``floored_share`` (their share
        of ``‖ĝ‖²``), ``loss_only`` (components of parameters the samples do not depend
        on, :func:`kwng.solve.loss_only_columns`), ``dot`` (``⟨g, ĝ⟩`` after clipping),
        ``grad_norm``, ``direction_norm``, ``bandwidth`` — 0-dim tensors on the outputs'
        device in both modes (``"fast"`` syncs with the host once, for the finiteness
        check).

        With ``accumulation_steps = n > 1`` the first ``n − 1`` calls of an optimizer
        step only keep their micro-batch (returning ``{"micro_batches": i}``; ``p.grad``
        is left alone) and the ``n``-th computes the direction of the whole batch from
        ``Σ loss_i`` and the stacked outputs.
        """
        if not any(p.requires_grad for p in self.params):
            raise ValueError("every parameter the preconditioner covers is frozen "
                             "(requires_grad=False): there is nothing to train; "
                             "unfreeze some, or skip precond.step")
        self._check_inputs(loss, outputs)
        scale = scale_of(self.grad_scaler, loss)
        if self.accumulation_steps > 1:
            self._pending.append((loss, outputs))
            if len(self._pending) < self.accumulation_steps:
                return {"micro_batches": torch.tensor(len(self._pending),
                                                      device=outputs.device)}
            losses, parts = zip(*self._pending)
            self._pending = []
            loss, outputs = torch.stack(losses).sum(), torch.cat(parts)
        # the kernel algebra in at least float32
        with torch.autocast(outputs.device.type, enabled=False):
            return self._step(loss, outputs, scale)
