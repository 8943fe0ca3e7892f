"""KWNG as a drop-in preconditioner for any PyTorch model (book chapter
:ref:`deep-learning`): the class, its state and its step in one file.

Map of this file, top-down:

1. :class:`KWNGPreconditioner` — construction, state (``config``, counters,
   ``state_dict``), the step, and the hooks :class:`kwng.DistributedKWNG` overrides
   (``_check_inputs``, ``_degenerate``, ``_share``, ``_gradients``, ``_reduce``,
   ``_plain_gradient``, ``_reduce_gradient``).
2. The two paths, chosen once from ``config.mode``: :class:`FastPath` and
   :class:`ReferencePath`, each with ``kernels``, ``gradients`` and ``direction``; the
   direction functions they call (:func:`device_direction`,
   :func:`reference_direction`) and the gradients (:func:`replicated_gradients`,
   :func:`serial_gradients`).
3. The refresh schedule (``refresh_every = k``): the contract :class:`RefreshSchedule`
   and its implementation :class:`SystemCache`.
4. The training loop around the step: the parameters and their groups
   (:func:`resolve_params`, :func:`predicted_decrease`), what ``p.grad`` holds
   (:class:`GradWriter`), a ``GradScaler`` (:func:`scale_of`), the argument checks.
5. The saved state: :data:`COUNTERS`, :func:`upgrade_hyperparameters` and the loading
   of a ``state_dict``.

A classifier ``z ↦ X = h_θ(z) ∈ R^d`` is an implicit model: its outputs on a mini-batch
are ``N`` samples ``X_n`` of a distribution ``ρ_θ`` (Arbel et al., 2020, §4.2). The
preconditioner replaces the Euclidean gradient ``g = ∇_θ L`` by the kernelized
Wasserstein natural gradient of Prop. 6, then any ``torch.optim`` optimizer steps:

>>> import torch
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
>>> precond = KWNGPreconditioner(model, lr=0.1, num_basis=2,
...                              generator=torch.Generator().manual_seed(0))
>>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
>>> z, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
>>> for _ in range(2):
...     optimizer.zero_grad()
...     X = model(z)                                  # (N, d): the samples
...     loss = nn.functional.cross_entropy(X, y)
...     info = precond.step(loss, X)                 # into p.grad
...     optimizer.step()
>>> precond.num_steps, sorted(info)[:3]
(2, ['bandwidth', 'clipped', 'direction_norm'])

Algorithm (one call of :meth:`KWNGPreconditioner.step`; symbols ↔ arguments)::

    draw M = num_basis samples Y_m = X_{b_m}, coords i_m  (draw_basis)
    σ ← σ0 · mean ‖X_n − Y_m‖²  (bandwidth="mean_sq", sigma0; §3.3)
    C, K, CCᵀ of Prop. 5 from X and the kernel           (path.kernels)
    g ← ∇_θ L,  T_m ← (C_m / N)ᵀ ∂X/∂θ  (m = 1..M)       (path.gradients)
    ĝ ← (1/ε)[D⁻¹ − D⁻¹T̃ᵀ(T̃D⁻¹T̃ᵀ + (ε/N) I)⁻¹T̃D⁻¹] g
        with D = diag ‖T̃_{·,i}‖                     (path.direction)
        (diagonal_only: ĝ ← D⁻¹ g, "diagonal conditioning")
    (refresh_every = k > 1: the lines above only every k steps; in
     between, g from one plain backward pass and ĝ from the cached
     T, CCᵀ, K at this step's ε: SystemCache)
    if ⟨g, ĝ⟩ ≤ 0 or ĝ not finite:  ĝ ← g       (counted fallback)
    if ‖ĝ‖ > clip_norm:  ĝ ← clip_norm · ĝ / ‖ĝ‖         (clip_norm)
    p.grad ← ĝ
    Levenberg-Marquardt (App. D.2; eps_schedule = LMSchedule(interval,
    omega, low, high, eps_min, eps_max)): every interval steps, with r
    the largest reduction ratio seen since the last update,
        r_t = 2 (L_{t-1} − L_t) / (lr ⟨g, ĝ⟩_{t-1}),
        ε ← omega · ε if r > high;  ε ← ε / omega if r < low;
        ε ∈ [eps_min, eps_max]

The two paths (``mode``) give the same directions:

* ``"fast"`` (:class:`FastPath`, the default) — one backward pass for all ``M + 1``
  cotangents (:mod:`kwng.engine.replicate`: the training forward runs on ``M + 1``
  stacked copies of the batch, matrix work on one copy only, batch norm per copy) and
  the sync-free solve; all bookkeeping (ε, r, counters, fallbacks, clipping) stays in
  device tensors, and the one host synchronisation of a step is the check that the
  outputs, the loss and ``g`` are finite (skipped while a CUDA graph is recorded).
  ``outputs`` must be the tensor the model returned, or computed from it without
  parameters (e.g. ``U · model(z)`` with a fixed ``U``). On a GPU make a
  convolutional model and its inputs channels_last (the record
  ``results/benchmarks/step_cost.json``). A model with parameters outside
  ``Conv2d``/``Linear``/``BatchNorm``/``LayerNorm``/``ExpandedParameter``
  (:func:`kwng.engine.replicate.unsupported_reason`: a ``UserWarning`` at
  construction names the modules) or a step whose ``outputs`` are not the model's own
  output takes serial passes (logged once, counted in ``serial_steps``).
* ``"reference"`` (:class:`ReferencePath`) — as the authors' code: ``M + 1`` serial
  backward passes (``retain_graph``), the float64 eigendecomposition solve of
  :func:`kwng.nystrom_solve` and :func:`kwng.solve.safeguard`, bookkeeping on the host.

Under ``torch.autocast`` the network runs in the autocast dtype; the kernel algebra
in float32/float64. ``eps`` enters as ``(ε/N) I`` next to the whitened ``T̃ D⁻¹ T̃ᵀ``
(Prop. 6; the authors' ``ε_a``: :func:`kwng.engine.config.eps_from_authors`).

Batches the estimator cannot use: non-finite outputs or loss are refused before the
step changes any state, a non-finite ``g`` before anything is written into ``p.grad``
(a ``GradScaler``'s overflow excepted: the scaler skips that step). On a refresh step,
a batch with fewer samples than ``num_basis`` or whose samples all coincide (bandwidth
0) takes the Euclidean gradient, clipped, logged once and counted in
``euclidean_steps`` (and ``fallbacks``); nothing is cached, so the next step refreshes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import numbers
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from kwng import solve
from kwng._checks import check_int, check_positive
from kwng.engine.config import (
    KWNGConfig,
    auto_mode,
    config_with,
    live_changes,
    resolve_mode,
)
from kwng.engine.gpu_paths import compile_on_cuda, use_kernels
from kwng.engine.graph import derived_from, direct_params
from kwng.engine.lm import LevenbergMarquardt, LMSchedule
from kwng.engine.replicate import ReplicatedEngine, unsupported_reason
from kwng.estimator import draw_basis, kernel_matrices, nystrom_solve, with_bandwidth
from kwng.jacobians import jacobian_from_outputs
from kwng.nosync import kernel_matrices_nosync, nystrom_solve_nosync

__all__ = ["COUNTERS", "FastPath", "GradWriter", "INFO_KEYS", "KWNGPreconditioner",
           "ReferencePath", "RefreshSchedule", "SystemCache", "backward_hint",
           "device_direction", "direction_into", "is_compiled", "predicted_decrease",
           "reference_direction", "replicated_gradients", "resolve_params",
           "serial_gradients", "upgrade_hyperparameters"]

log = logging.getLogger(__name__)

_FLOATS = (torch.float32, torch.float64)


# ==== 1. The preconditioner ===========================================================
class KWNGPreconditioner:
    """Replace the gradients of ``model``'s parameters by the KWNG direction (Prop. 6).

    Arguments: ``model`` — any ``nn.Module``; its parameters that require a gradient
    at a step are ``θ`` (``q`` numbers; gradual unfreezing works as in
    ``torch.optim``). In fast mode the replicated forward runs when ``model`` itself is
    called: attach the preconditioner to the network that the training loop calls.
    ``config`` — a :class:`kwng.KWNGConfig`; keyword arguments of its field names
    build it (or override fields of ``config``). ``lr`` — the optimizer's step size, a
    number or a callable of no arguments returning the current one (e.g. ``lambda:
    optimizer.param_groups[0]["lr"]``); it enters the reduction ratio ``r`` of the ε
    rule, so it is required unless ``eps_schedule=None``. ``generator`` — a
    ``torch.Generator`` for the basis draw (part of :meth:`state_dict`; without one the
    basis comes from torch's global stream).

    ``params`` — the parameters whose metric is built, by default every trainable one;
    pass ``optimizer.param_groups`` when the optimizer holds a subset or groups with
    different step sizes (each group's ``"lr"`` then enters the ε rule).
    ``grad_scaler`` — the ``torch.amp.GradScaler`` of an fp16 loop: pass
    ``grad_scaler.scale(loss)`` to :meth:`step`, which unscales ``g`` before the solve
    and the clip and writes the direction scaled back, then
    ``grad_scaler.step(optimizer)``. A gradient already in ``p.grad`` (another loss
    term's ``backward()``) is added to the direction; two steps without an optimizer
    step between them are refused, as is a ``DistributedDataParallel`` model (use
    :class:`kwng.DistributedKWNG`). The tensors in ``p.grad`` are views of one flat
    buffer (:class:`GradWriter`).

    ``accumulation_steps`` — ``n ≥ 1`` micro-batches per optimizer step: call
    :meth:`step` on each with its share of the loss (``loss_fn(X_i, y_i) / n``, without
    ``backward()``) and ``optimizer.step()`` after every ``n``-th; the direction is
    exactly that of the whole batch (basis, bandwidth and ``C`` drawn over it), whose
    graphs are kept until the ``n``-th (fast mode: serial passes). ``output_fn`` — for
    a model that returns several outputs (a tuple, a dict such as a Hugging Face
    ``ModelOutput``): the function that picks the ``(N, d)`` samples from it
    (``lambda out: out[0]``); pass :meth:`step` the same tensor. The fast mode patches
    the model's layers (:meth:`remove_hooks` detaches it).
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
        self._lr = check_lr(lr, cfg.eps_schedule is not None and (
            self.groups is None or any("lr" not in grp for grp in self.groups)))
        if grad_scaler is not None and not isinstance(grad_scaler,
                                                      torch.amp.GradScaler):
            raise ValueError("grad_scaler must be a torch.amp.GradScaler or None, got "
                             f"{type(grad_scaler).__name__}")
        self.grad_scaler = grad_scaler
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
        self.mode = resolve_mode(cfg.mode, dev, model)  # "auto": by device, model kind
        if cfg.mode == "auto":
            log.info("KWNG mode='auto': %s, %s", *auto_mode(dev, model))
        self.path = self._new_path(cfg)
        self._grads = GradWriter(self.adds_prefilled_grads)
        self.cache: RefreshSchedule = SystemCache(cfg.refresh_every,
                                                  self._follow_schedule,
                                                  cfg.refresh_guard)
        self._counters = {k: torch.zeros((), dtype=torch.long, device=dev)
                          for k in COUNTERS}

    def _new_path(self, cfg: KWNGConfig) -> FastPath | ReferencePath:
        """The path of ``self.mode``: the fast one replicates the forward where the
        model allows it (else serial passes, with a ``UserWarning`` naming the modules
        the engine cannot batch, also logged)."""
        if self.mode == "reference":
            return ReferencePath(None, cfg.gpu_solve)
        if self.accumulation_steps > 1:
            self._warned.add("serial")
            log.info("KWNG fast mode with accumulation_steps = %d: the whole batch's "
                     "T comes from serial backward passes (the replicated forward "
                     "covers one micro-batch)", self.accumulation_steps)
            return FastPath(None, cfg.gpu_solve)
        reason = unsupported_reason(self.model,
                                    [p for p in self.params if p.requires_grad])
        if reason is not None and "already carries" in reason:
            raise ValueError(f"model: {reason}")
        if reason is not None:
            msg = (f"KWNG fast mode: {reason}; this model uses M + 1 = "
                   f"{cfg.num_basis + 1} serial backward passes a step")
            warnings.warn(msg, UserWarning, stacklevel=3)
            self._warn_once("unsupported", "%s", msg)
            return FastPath(None, cfg.gpu_solve)
        return FastPath(ReplicatedEngine(self.model, cfg.num_basis + 1, self.output_fn,
                                         cfg.gpu_solve), cfg.gpu_solve)

    # --- state ------------------------------------------------------------------------
    @property
    def config(self) -> KWNGConfig:
        """The hyperparameters. Assigning a new :class:`kwng.KWNGConfig` (e.g.
        ``precond.config = precond.config.replace(refresh_every=4)``) takes effect at
        the next step, which builds the kernel system afresh; ``mode``, ``eps`` and
        ``eps_schedule`` are fixed at construction, and changing them is refused."""
        return self._config

    @config.setter
    def config(self, new: KWNGConfig) -> None:
        changed = live_changes(self._config, new)
        if not changed:
            return
        self._config = new
        if {"num_basis", "gpu_solve"} & set(changed):
            if self._engine is not None:
                self._engine.remove()
                self.path = FastPath(ReplicatedEngine(self.model, new.num_basis + 1,
                                                      self.output_fn, new.gpu_solve),
                                     new.gpu_solve)
            else:
                self.path = type(self.path)(None, new.gpu_solve)
        # the next step builds the system afresh, with the new settings
        self.cache.every, self.cache.guard = new.refresh_every, new.refresh_guard
        self.cache.load_state_dict(None, self.cache.steps, self.params[0].device)
        log.info("KWNG: settings changed (%s), effective from the next step",
                 ", ".join(f"{k}={getattr(new, k)!r}" for k in changed))

    @property
    def _engine(self) -> ReplicatedEngine | None:
        """The replicated-batch engine of the fast path (``None``: serial passes)."""
        return self.path.engine

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
        """The replicated forward runs before refresh steps only."""
        if self._engine is not None:
            self._engine.enabled = due

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def counters(self) -> dict[str, int]:
        """Counters since construction, as Python ints (a host sync): ``fallbacks``
        (steps whose natural direction was replaced by ``g``), ``ill_conditioned``
        (``CCᵀ`` regularised), ``rank_sum`` (the ranks kept by the stable solve),
        ``damping_floored``, ``clipped``, ``serial_steps``, ``loss_only``,
        ``euclidean_steps``, ``eps_up``/``eps_down`` and ``steps``; logs fallbacks and
        rank deficiencies if any."""
        out = {k: int(v) for k, v in self._counters.items()}
        out["eps_up"], out["eps_down"] = int(self.lm.ups), int(self.lm.downs)
        steps = out["steps"] = self.num_steps
        if out["fallbacks"]:
            log.info("KWNG fell back to the Euclidean gradient in %d of %d steps",
                     out["fallbacks"], steps)
        if out["ill_conditioned"]:
            log.info("C Cᵀ was rank deficient in %d of %d steps",
                     out["ill_conditioned"], steps)
        if out["loss_only"]:
            self._warn_once("loss_only", "KWNG: parameters that move the loss but not "
                            "the samples (zero column of T) took the Euclidean "
                            "gradient scaled like the rest (%d components over %d "
                            "steps)", out["loss_only"], steps)
        return out

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
        the basis generator's state as bytes (``None`` without a generator), the cached
        system of ``refresh_every > 1`` (``cache``: :meth:`SystemCache.state_dict`) and
        the hyperparameters (for checking): a run resumed from it takes the same
        directions."""
        gen = self.generator
        return {"lm": self.lm.state_dict(), "num_steps": self.num_steps,
                "counters": {k: int(v) for k, v in self._counters.items()},
                "generator": None if gen is None else bytes(gen.get_state().numpy()),
                "cache": self.cache.state_dict(),
                "hyperparameters": self.hyperparameters()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (also an older one:
        :func:`upgrade_hyperparameters`); warns if the hyperparameters differ."""
        self._step_count, self._counters = load_preconditioner_state(
            state, self.lm, self.hyperparameters())
        saved = state.get("generator")
        if saved is not None and not isinstance(saved, bytes):
            raise ValueError("state['generator'] must be bytes (a generator's state), "
                             f"got {type(saved).__name__}")
        if saved is not None and self.generator is None:
            log.warning("load_state_dict: the state holds a basis generator's state "
                        "but this preconditioner has none (its bases come from "
                        "torch's global stream); pass generator=torch.Generator() to "
                        "resume the same draws")
        elif saved is not None:
            self.generator.set_state(torch.frombuffer(bytearray(saved),
                                                      dtype=torch.uint8))
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
            self.path.engine = None

    # --- the step ---------------------------------------------------------------------
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

    def _step(self, loss: torch.Tensor, X: torch.Tensor,
              scale: torch.Tensor | None) -> dict[str, Any]:
        """One step: the system ``(g, T, CCᵀ, K, N, σ, ε)`` afresh on a refresh step,
        else ``g`` with the cached rest, or ``g`` alone for a batch with no kernel
        system; the direction into ``p.grad``; the ε rule and the counters."""
        params = self._active_params(X.device)
        refresh = self.cache.refresh_now(sum(p.numel() for p in params), X.device)
        reason = self._degenerate(loss, X, refresh, scale is None)
        taken = self._grads.take(params)
        self._step_count += 1
        if reason is not None:
            g, eps = self._plain(loss, X, params, taken, scale, torch.float32)
            sigma = torch.full((), float("nan"), device=X.device)  # no kernel built
        elif refresh:
            g, T, CCt, K, N, sigma, eps = self._refresh(loss, X, params, taken, scale)
        else:
            T, CCt, K, N, sigma = self.cache.system()
            g, eps = self._plain(loss, X, params, taken, scale, T.dtype)
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
            f = self.path.direction(out, g, T, CCt, K, N, eps, self.config, scale)
            self.cache.observe(f)
        self.lm.record(*predicted_decrease(self.groups, params, g, out, f["dot"],
                                           self._current_lr))
        if scale is not None:
            out.mul_(scale)  # GradScaler.step(optimizer) divides it again
        self._grads.finish(params, taken)
        self.cache.advance()
        return self._count(f, eps, sigma, X.device)

    def _count(self, f: dict[str, torch.Tensor], eps: Any, sigma: torch.Tensor,
               device: torch.device) -> dict[str, torch.Tensor]:
        """Add a step's direction info ``f`` (:data:`INFO_KEYS`) to the counters; the
        step's info as 0-dim tensors on ``device``."""
        for key, name in _COUNTED.items():
            self._counters[key] += f[name].long()
        info = {"eps": eps, "reduction_ratio": self.lm.ratio.clone(),
                "fallback": f["fallback"], "clipped": f["clipped"], "rank": f["rank"],
                "floored_columns": f["damping_floored"].long(),
                "floored_share": f["floored_share"], "loss_only": f["loss_only"],
                "dot": f["dot"], "grad_norm": f["grad_norm"],
                "direction_norm": f["direction_norm"], "bandwidth": sigma}
        return {k: torch.as_tensor(v, device=device) for k, v in info.items()}

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

    def _eps(self, loss: torch.Tensor) -> Any:
        """This step's ``ε``: the ε rule updated with the (global) loss, or the fixed
        one."""
        return self.lm.update(loss) if self.config.eps_schedule is not None \
            else self.lm.eps

    def _refresh(self, loss: torch.Tensor, X: torch.Tensor, params: list[torch.Tensor],
                 taken: dict[int, torch.Tensor], scale: torch.Tensor | None) -> tuple:
        """The exact step's system ``(g, T, CCᵀ, K, N, σ, ε)``, stored in the cache."""
        cfg = self.config
        Xk = X.detach().to(torch.promote_types(X.dtype, torch.float32))
        Xk, idx, coords, loss_all = self._share(
            Xk, loss if scale is None else loss.detach() / scale)
        N = Xk.shape[0]
        eps = self._eps(loss_all)
        C, K, CCt, sigma = self.path.kernels(Xk, idx, coords, cfg)
        g, T = self._backward(lambda: self._gradients(loss, X, C, params), params,
                              taken, scale)
        g = g.to(Xk.dtype) if g.dtype not in _FLOATS else g
        g, T = self._reduce(g, T.to(g.dtype))
        self.cache.store(T, CCt, K, N, sigma)
        return g, T, CCt, K, N, sigma, eps

    def _plain(self, loss: torch.Tensor, X: torch.Tensor, params: list[torch.Tensor],
               taken: dict[int, torch.Tensor], scale: torch.Tensor | None,
               dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        """``g`` (in at least ``dtype``) and ``ε`` of a step from one plain backward
        pass: a step between refreshes, or one that takes the Euclidean gradient."""
        g, _ = self._backward(lambda: (self._plain_gradient(loss, X, params), None),
                              params, taken, scale)
        g = g.to(dtype) if g.dtype not in _FLOATS else g
        g, loss_all = self._reduce_gradient(
            g, loss if scale is None else loss.detach() / scale)
        return g, self._eps(loss_all)

    # --- the hooks that see this process's share (DistributedKWNG overrides them) -----
    def _check_inputs(self, loss: Any, outputs: Any) -> None:
        """The arguments of :meth:`step`: a scalar loss with a graph and the
        ``(batch, d)`` outputs with a graph."""
        if not isinstance(outputs, torch.Tensor) or outputs.dim() != 2:
            shape = (tuple(outputs.shape) if isinstance(outputs, torch.Tensor)
                     else type(outputs).__name__)
            raise ValueError(
                "outputs must be the model outputs X = h_θ(z) as a (batch, d) tensor, "
                f"got {shape}; flatten them (outputs.flatten(1)) or pick the tensor "
                "that the loss is built on")
        if not outputs.is_floating_point() or outputs.grad_fn is None:
            raise ValueError(
                "outputs must be a floating-point tensor with an autograd graph to the "
                "parameters (call step(loss, outputs) with the outputs of model(z), "
                "not detached ones)")
        if outputs.shape[0] < 1:
            raise ValueError("the batch has 0 samples")
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 \
                or loss.grad_fn is None:
            raise ValueError("loss must be a scalar tensor with an autograd graph "
                             "(e.g. loss_fn(outputs, y))")

    def _degenerate(self, loss: torch.Tensor, X: torch.Tensor, refresh: bool,
                    check_finite: bool) -> str | None:
        """Host checks of a step (one sync; none while a CUDA graph is recorded):
        refuse non-finite outputs (``check_finite``: no ``GradScaler``, whose skipped
        steps handle an overflow), and on a refresh step name why no kernel system can
        be built from ``X``: fewer samples than ``num_basis``, or samples that all
        coincide. ``None``: the exact step can run."""
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

    def _share(self, Xk: torch.Tensor, loss: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The samples, basis and loss the step's estimator sees: here this process's
        own (:class:`kwng.DistributedKWNG` gathers every rank's)."""
        N, d = Xk.shape
        idx, coords = draw_basis(N, d, self.config.num_basis, self.generator, Xk.device)
        return Xk, idx, coords, loss

    def _gradients(self, loss: torch.Tensor, X: torch.Tensor, C: torch.Tensor,
                   params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``g`` (``q``) and ``T`` (``M × q``) of the active parameters, from the graph
        of ``loss``, ``X`` (the path's ``gradients``; a serial step is counted)."""
        g, T, serial = self.path.gradients(loss, X, C, params, self._warn_once)
        if serial:
            self._counters["serial_steps"] += 1
        return g, T

    def _reduce(self, g: torch.Tensor, T: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``g`` and ``T`` as the solve sees them: here unchanged (the distributed
        preconditioner sums the ranks' shares)."""
        return g, T

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
        """``g`` and the loss of a plain step as the solve and the ε rule see them:
        here unchanged (the distributed preconditioner sums the ranks' shares)."""
        return g, loss


# ==== 2. The two paths: the kernel matrices, g and T, the direction ===================
#: The 0-dim tensors that describe a step's direction (both paths return them).
INFO_KEYS = ("rank", "ill_conditioned", "damping_floored", "floored_share", "loss_only",
             "dot", "fallback", "clipped", "grad_norm", "direction_norm")


class FastPath:
    """``mode="fast"``: the replicated backward pass of ``engine``
    (:class:`kwng.engine.replicate.ReplicatedEngine`; ``None``: serial passes), the
    sync-free kernel matrices and solve, on CUDA through ``gpu_solve``
    (:data:`kwng.engine.gpu_paths.GPU_SOLVES`)."""

    def __init__(self, engine: ReplicatedEngine | None, gpu_solve: str) -> None:
        self.engine, self.gpu_solve = engine, gpu_solve

    def kernels(self, Xk: torch.Tensor, idx: torch.Tensor, coords: torch.Tensor,
                cfg: KWNGConfig) -> tuple[torch.Tensor, ...]:
        """``C``, ``K``, ``CCᵀ`` and the bandwidth ``σ`` (a device tensor)."""
        return kernel_matrices_nosync(Xk, idx, coords, cfg.kernel, cfg.bandwidth,
                                      cfg.sigma0)

    def gradients(self, loss: torch.Tensor, X: torch.Tensor, C: torch.Tensor,
                  params: list[torch.Tensor], warn_once: Callable[..., None]
                  ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``g``, ``T`` and whether they came from serial passes: one replicated
        backward pass where ``X`` is (computed from) the output of the engine's last
        forward, else ``M + 1`` serial passes (logged once)."""
        X0 = None if self.engine is None else self.engine.first
        if X0 is not None and (
                X is X0 or (X.shape == X0.shape and derived_from(X, X0, params))):
            return (*replicated_gradients(loss, X, X0, C, params, self.engine,
                                          warn_once), False)
        warn_once("serial", "KWNG fast mode: outputs are not the output of the "
                  "model's last training forward (or the model is unsupported): "
                  "serial backward passes are used")
        return (*serial_gradients(loss, X, C, params), True)

    def direction(self, out: torch.Tensor, g: torch.Tensor, T: torch.Tensor,
                  CCt: torch.Tensor, K: torch.Tensor, N: int, eps: Any,
                  cfg: KWNGConfig, scale: torch.Tensor | None
                  ) -> dict[str, torch.Tensor]:
        """:func:`device_direction` into ``out``, without a host sync."""
        return device_direction(out, T, CCt, K, g, N,
                                eps=torch.as_tensor(eps, device=T.device),
                                lam=cfg.lam, damping=cfg.damping, rcond=cfg.rcond,
                                clip_norm=cfg.clip_norm, fallback=cfg.fallback,
                                diagonal_only=cfg.diagonal_only,
                                gpu_solve=self.gpu_solve)


class ReferencePath(FastPath):
    """``mode="reference"``: serial backward passes, the kernel matrices and the
    float64 solve of the estimator (:func:`reference_direction`), bookkeeping on the
    host (``diagonal_only`` takes :func:`device_direction`); its engine is ``None``."""

    def kernels(self, Xk: torch.Tensor, idx: torch.Tensor, coords: torch.Tensor,
                cfg: KWNGConfig) -> tuple[torch.Tensor, ...]:
        """``C``, ``K``, ``CCᵀ`` and ``σ`` through :func:`kwng.kernel_matrices`."""
        kern = with_bandwidth(cfg.kernel, Xk, idx, cfg.bandwidth, cfg.sigma0)
        C, K, CCt = kernel_matrices(Xk, idx, coords, kern)
        return C, K, CCt, torch.tensor(kern.bandwidth)

    def gradients(self, loss: torch.Tensor, X: torch.Tensor, C: torch.Tensor,
                  params: list[torch.Tensor], warn_once: Callable[..., None]
                  ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``g``, ``T`` from ``M + 1`` serial passes (not counted: this path's own)."""
        return (*serial_gradients(loss, X, C, params), False)

    def direction(self, out: torch.Tensor, g: torch.Tensor, T: torch.Tensor,
                  CCt: torch.Tensor, K: torch.Tensor, N: int, eps: Any,
                  cfg: KWNGConfig, scale: torch.Tensor | None
                  ) -> dict[str, torch.Tensor]:
        """:func:`reference_direction` into ``out``; a scaled step whose ``g``
        overflowed is skipped (:func:`overflowed_step`); a fallback is logged."""
        if scale is not None and not bool(torch.isfinite(g).all()):
            f = overflowed_step(out, g)
        elif cfg.diagonal_only:
            f = super().direction(out, g, T, CCt, K, N, eps, cfg, scale)
        else:
            f = reference_direction(out, T, CCt, K, g, N, eps=float(eps), lam=cfg.lam,
                                    damping=cfg.damping, rcond=cfg.rcond,
                                    clip_norm=cfg.clip_norm, fallback=cfg.fallback)
        if bool(f["fallback"]):  # it syncs anyway
            log.info("KWNG: ⟨g, ĝ⟩ ≤ 0 or ĝ not finite: %s", "step skipped"
                     if cfg.fallback == "skip" else "Euclidean gradient used")
        return f


def direction_into(out: torch.Tensor, T: torch.Tensor, CCt: torch.Tensor,
                    K: torch.Tensor | None, g: torch.Tensor, N: int, *,
                    eps: torch.Tensor, lam: float, damping: str, rcond: float | None,
                    clip_norm: float | None, diagonal_only: bool = False,
                    fallback: str = "gradient") -> dict[str, torch.Tensor]:
    """:func:`device_direction`'s one definition, eager (what CUDA compiles and the
    Triton kernels of :mod:`kwng.engine.triton_solve` are checked against)."""
    direction, dg = nystrom_solve_nosync(T, CCt, K, g, N, eps=eps, lam=lam,
                                         damping=damping, rcond=rcond,
                                         diagonal_only=diagonal_only)
    safe = solve.safeguard(g, direction, clip_norm, fallback)
    out.copy_(safe.direction)
    return {"rank": dg["rank"], "ill_conditioned": dg["ill_conditioned"],
            "damping_floored": dg["damping_floored"],
            "floored_share": dg["floored_share"], "loss_only": dg["loss_only"],
            "dot": safe.dot, "fallback": safe.fallback, "clipped": safe.clipped,
            "grad_norm": safe.grad_norm, "direction_norm": safe.direction_norm}


_COMPILED_DIRECTION = compile_on_cuda(direction_into)


def device_direction(out: torch.Tensor, T: torch.Tensor, CCt: torch.Tensor,
                     K: torch.Tensor | None, g: torch.Tensor, N: int, *,
                     diagonal_only: bool = False, gpu_solve: str = "auto",
                     **settings: Any) -> dict[str, torch.Tensor]:
    """The step's direction ``ĝ`` without a host sync: Prop. 6 through the Cholesky
    solve :func:`kwng.nystrom_solve_nosync` (``diagonal_only``: ``D⁻¹ g``), then
    :func:`kwng.solve.safeguard` with ``clip_norm``, written into ``out`` (``q``, any
    float dtype); returns the 0-dim tensors of :data:`INFO_KEYS`. ``settings``: ``eps``
    (a 0-dim tensor), ``lam``, ``damping``, ``rcond``, ``clip_norm``, optionally
    ``fallback`` (:data:`kwng.solve.FALLBACKS`, default ``"gradient"``). On CUDA it runs
    compiled, or as the Triton kernels of :mod:`kwng.engine.triton_solve` (the same
    values up to float32 rounding) where ``gpu_solve`` lets them; eagerly on the CPU.

    >>> T, g, out = torch.randn(2, 5), torch.randn(5), torch.empty(5)
    >>> CCt = torch.eye(2) + 0.1
    >>> info = device_direction(out, T, CCt, None, g, 8,
    ...                         eps=torch.tensor(1e-3), lam=0.0,
    ...                         damping="T_tilde", rcond=None,
    ...                         clip_norm=None)
    >>> bool(info["dot"] > 0), sorted(info) == sorted(INFO_KEYS)
    (True, True)
    """
    if not diagonal_only and use_kernels(T, gpu_solve):
        from kwng.engine.triton_solve import fused_available, fused_direction

        if fused_available(T, g, settings["damping"]):
            return fused_direction(T, CCt, K, g, N, out=out, **settings)
    return _COMPILED_DIRECTION(out, T, CCt, K, g, N, diagonal_only=diagonal_only,
                                    gpu_solve=gpu_solve, **settings)


def reference_direction(out: torch.Tensor, T: torch.Tensor, CCt: torch.Tensor,
                        K: torch.Tensor | None, g: torch.Tensor, N: int, *,
                        eps: float, lam: float, damping: str, rcond: float | None,
                        clip_norm: float | None, fallback: str = "gradient"
                        ) -> dict[str, torch.Tensor]:
    """The direction of a ``mode="reference"`` step: Prop. 6 through the float64 solve
    :func:`kwng.nystrom_solve` (host diagnostics), then :func:`kwng.solve.safeguard`
    (``clip_norm``, ``fallback``), written into ``out``; the :data:`INFO_KEYS` as 0-dim
    tensors on ``T``'s device."""
    res = nystrom_solve(T, CCt, K, g, N, eps=eps, lam=lam, damping=damping,
                        method="stable", rcond=rcond)
    safe = solve.safeguard(g, res.direction, clip_norm, fallback)
    out.copy_(safe.direction)
    diag = res.diagnostics
    info = {"rank": diag["rank"], "ill_conditioned": diag["rank"] < T.shape[0],
            "damping_floored": diag["damping_floored"], "loss_only": diag["loss_only"],
            "floored_share": diag["floored_share"]}
    info = {k: torch.tensor(v, device=T.device) for k, v in info.items()}
    return {**info, **{k: v for k, v in safe._asdict().items() if k != "direction"}}


def _plain_info(out: torch.Tensor, direction: torch.Tensor, dot: torch.Tensor,
                clipped: torch.Tensor, grad_norm: torch.Tensor,
                direction_norm: torch.Tensor) -> dict[str, torch.Tensor]:
    """``direction`` into ``out`` and the :data:`INFO_KEYS` of a step that took no
    natural direction (counted as a fallback)."""
    out.copy_(direction)
    zero = torch.zeros((), dtype=torch.long, device=direction.device)
    return {"rank": zero, "ill_conditioned": zero.bool(), "damping_floored": zero,
            "floored_share": zero.double(), "loss_only": zero, "dot": dot,
            "fallback": ~zero.bool(), "clipped": clipped, "grad_norm": grad_norm,
            "direction_norm": direction_norm}


def overflowed_step(out: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """A reference step whose scaled gradient overflowed (``GradScaler``): ``g`` itself
    goes into ``out``, so that ``grad_scaler.step(optimizer)`` finds the infinities and
    skips the step, as it does for SGD."""
    norm = torch.linalg.vector_norm(g)
    return _plain_info(out, g, torch.full((), float("nan"), device=g.device),
                       torch.zeros((), dtype=torch.bool, device=g.device), norm, norm)


def euclidean_direction(out: torch.Tensor, g: torch.Tensor, clip_norm: float | None
                        ) -> dict[str, torch.Tensor]:
    """A step that takes the Euclidean gradient ``g`` (clipped to ``clip_norm``)."""
    safe = solve.safeguard(g, g, clip_norm)
    return _plain_info(out, safe.direction, safe.dot, safe.clipped, safe.grad_norm,
                       safe.direction_norm)


def serial_gradients(loss: torch.Tensor, X: torch.Tensor, C: torch.Tensor,
                     params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``g`` (``q``) and ``T`` (``M × q``) from ``M + 1`` serial backward passes."""
    g_parts = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True,
                                  materialize_grads=True)
    g = torch.cat([gp.reshape(-1) for gp in g_parts])
    return g, jacobian_from_outputs(X, params, C.to(X.dtype), retain_graph=False)


def replicated_gradients(loss: torch.Tensor, X: torch.Tensor, X0: torch.Tensor,
                         C: torch.Tensor, params: list[torch.Tensor],
                         eng: ReplicatedEngine, warn_once: Callable[..., None]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``g`` (``q``) and ``T`` (``M × q``) of ``params`` from one backward pass of the
    replicated forward whose model output is ``X0`` (``X`` is ``X0`` or computed from
    it); ``warn_once`` is the preconditioner's one-time warning."""
    N, M = X.shape[0], C.shape[0]
    direct = direct_params(loss, X0, params)
    g_direct = {}
    if direct:  # the loss also depends on parameters directly: one extra backward pass
        warn_once("direct", "KWNG: the loss depends on %d parameter tensor(s) directly "
                  "(not only through the outputs): one extra backward pass per step",
                  len(direct))
        grads = torch.autograd.grad(loss, direct, retain_graph=True)
        g_direct = {id(p): gr for p, gr in zip(direct, grads)}
    Vc = (C / N).to(X.dtype)
    # samples computed from the model's output: pull the cotangents back to it
    if X is not X0:
        Vc = torch.autograd.grad(X, X0, Vc, is_grads_batched=True, retain_graph=True)[0]
    (gX,) = torch.autograd.grad(loss, X0, retain_graph=bool(direct))
    V = torch.cat([gX.detach()[None], Vc.to(gX.dtype)], 0).reshape(-1, X0.shape[1])
    G = eng.backward(V, params)
    # every parameter's M + 1 gradients copied once into its columns (layout and dtype
    # in the same pass)
    dtype = functools.reduce(torch.promote_types, (p.dtype for p in params))
    q = sum(p.numel() for p in params)
    Gall = torch.empty((M + 1, q), dtype=dtype, device=params[0].device)
    offset = 0
    for p in params:
        n = p.numel()
        dst = Gall[:, offset:offset + n].view((M + 1,) + tuple(p.shape))
        offset += n
        Gp = G.get(id(p))
        if Gp is None:  # a parameter the forward did not use
            dst.zero_()
        else:
            dst.copy_(Gp)
        if id(p) in g_direct:
            dst[0].copy_(g_direct[id(p)])
    return Gall[0], Gall[1:]


# ==== 3. The refresh schedule (refresh_every = k) =====================================
@runtime_checkable
class RefreshSchedule(Protocol):
    """What :class:`KWNGPreconditioner` asks of its refresh schedule (``precond.cache``,
    a :class:`SystemCache` unless you assign your own) and what
    :func:`kwng.capture_step` reads of it to record one CUDA graph per kind of step.

    A step calls :meth:`refresh_now` (whether it builds the system afresh),
    :meth:`store` on a refresh step, :meth:`system` between refreshes, :meth:`observe`
    with its direction info (:data:`INFO_KEYS`) and :meth:`advance`; a checkpoint holds
    :meth:`state_dict`. A capture records each of ``kinds`` under :meth:`forced` and
    replays the one :attr:`kind` names (``refresh_capturable``: whether a refresh step
    is recorded too), reading ``every`` and ``steps`` and calling :meth:`notify`.

    >>> isinstance(SystemCache(3), RefreshSchedule)
    True
    """

    every: int
    steps: int
    guard: bool
    kinds: tuple
    refresh_capturable: bool

    @property
    def due(self) -> bool: ...
    @property
    def kind(self) -> Any: ...
    def refresh_now(self, q: int, device: torch.device) -> bool: ...
    def store(self, T: torch.Tensor, CCt: torch.Tensor, K: torch.Tensor, N: int,
              sigma: torch.Tensor) -> None: ...
    def system(self) -> tuple: ...
    def observe(self, info: dict[str, torch.Tensor]) -> None: ...
    def advance(self) -> None: ...
    def notify(self) -> None: ...
    def forced(self, refresh: Any) -> contextlib.AbstractContextManager: ...
    def state_dict(self) -> dict[str, Any] | None: ...
    def load_state_dict(self, state: dict[str, Any] | None, steps: int,
                        device: torch.device) -> None: ...


_TENSORS = ("T", "CCt", "K", "sigma")


class SystemCache:
    """The system of the last refresh step (``T``, ``CCᵀ``, ``K``, ``N``, ``σ``) and the
    host-side step counter that says when to refresh: the :class:`RefreshSchedule` of
    ``refresh_every = k`` (``every``).

    The schedule. Step ``s`` (counted from 0 in ``steps``) is a *refresh* step when
    ``s % k == 0``, when nothing is cached yet, or when the cached system does not fit
    the active parameters (one frozen since): the exact step, whose ``T``, ``CCᵀ``,
    ``K``, ``N`` and bandwidth are stored here. Each other step takes one ordinary
    backward pass for the fresh ``g`` and applies Prop. 6 with the cached system at
    *this* step's ``ε``: only ``T``, ``CCᵀ`` and ``K`` are cached, never a
    factorisation that depends on ``ε`` (``tests/test_amortized.py`` checks it in
    float64). ``k = 1`` stores nothing and is the exact step bit for bit. By the
    Woodbury identity the operator is ``(1/ε)(D + (N/ε) T̃ᵀT̃)⁻¹``, positive definite
    for any ``T̃``: a stale ``T`` changes the metric, never the sign of ``⟨g, ĝ⟩``.

    The guard (``guard``, ``refresh_guard`` of :class:`kwng.KWNGConfig`): a rank
    deficient ``CCᵀ`` (``ill_conditioned``) or a fallback raises a flag on the device
    (:meth:`observe`, inside the step, so a CUDA graph records it); the host reads the
    flag of step ``s`` at the end of step ``s + 1`` without stalling the device, and
    step ``s + 2`` refreshes. :attr:`guard_refreshes` counts these refreshes (each is
    logged); a healthy run takes the unguarded steps bit for bit (the runs that
    motivated it: :ref:`cifar-amortized`).

    ``on_due`` is called with :attr:`due` whenever it may have changed (the fast path
    replicates its forward before refresh steps only). A captured loop records the two
    kinds of step as two CUDA graphs (:meth:`forced`) sharing the cached tensors.

    >>> cache = SystemCache(2)
    >>> [cache.due, cache.refresh_now(4, torch.device("cpu"))]
    [True, True]
    >>> T, I3 = torch.ones(3, 4), torch.eye(3)
    >>> cache.store(T, I3, I3, 8, torch.tensor(1.))
    >>> cache.advance(); cache.due, cache.refresh_now(4, torch.device("cpu"))
    (False, False)
    """

    #: a refresh step is a program of its own that a CUDA graph records
    refresh_capturable = True
    #: the kinds of step a captured loop records as programs (a refresh step, a step
    #: between refreshes)
    kinds = (True, False)

    def __init__(self, every: int, on_due: Callable[[bool], None] | None = None,
                 guard: bool = False) -> None:
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

    def system(self) -> tuple:
        """The cached ``(T, CCᵀ, K, N, σ)``."""
        return self.T, self.CCt, self.K, self.N, self.sigma

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
        """The guard's device-side part: raise the flag when this step's system is
        rank deficient or its direction fell back to ``g``. Nothing without a guard."""
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
        """The cached system (tensors on their device, ``N`` an int) and the guard's
        state (a host sync); ``None`` if nothing is cached."""
        if self.T is None:
            return None
        out = {**{k: getattr(self, k).clone() for k in _TENSORS}, "N": self.N}
        if self.guard:
            if self._event is not None:
                self._event.synchronize()
            out["guard"] = {"stale": self._stale, "last_refresh": self._last_refresh,
                            "pending": bool(self._pending and bool(self._host)),
                            "guard_refreshes": self.guard_refreshes}
        return out

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
            guard = (None if state is None else state.get("guard")) or {}
            self._stale = bool(guard.get("stale", False))
            self._last_refresh = int(guard.get("last_refresh", -1))
            self.guard_refreshes = int(guard.get("guard_refreshes", 0))
            self._took, self._event = None, None
            self._flag = torch.zeros((), dtype=torch.bool, device=device)
            self._pending = bool(guard.get("pending", False))
            self._host = torch.tensor(self._pending)
        self.notify()


# ==== 4. The training loop around the step ============================================
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
    left in ``p.grad`` before a step: a gradient the loop put there (an auxiliary
    loss's ``backward()``) is added to the direction; a view the loop keeps after
    ``optimizer.zero_grad()`` is never overwritten (the next step takes a new buffer).

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


def backward_hint(err: RuntimeError, compiled: bool, mode: str) -> RuntimeError:
    """A message for the loop for an autograd error raised in the step's backward
    passes (``err`` unchanged when there is nothing to add)."""
    if "backward through the graph a second time" in str(err):
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


# ==== 5. The saved state ==============================================================
#: The counters of a preconditioner (device tensors, summed over its steps).
COUNTERS = ("fallbacks", "ill_conditioned", "rank_sum", "damping_floored", "clipped",
            "serial_steps", "loss_only", "euclidean_steps")
# the counters that sum an entry of every step's direction info: counter -> entry
_COUNTED = {"fallbacks": "fallback", "ill_conditioned": "ill_conditioned",
            "rank_sum": "rank", "damping_floored": "damping_floored",
            "clipped": "clipped", "loss_only": "loss_only"}

# the hyperparameters of a state saved before eps_schedule: old key -> LMSchedule field
_OLD_LM_KEYS = {"lm_interval": "interval", "lm_omega": "omega", "lm_low": "low",
                "lm_high": "high", "eps_min": "eps_min", "eps_max": "eps_max",
                "lm_rule": "rule"}
# the fields added since, with the value an older state had in effect
_ADDED = {"refresh_every": 1, "refresh_guard": False, "gpu_solve": "auto",
          "fallback": "gradient"}


def upgrade_hyperparameters(hp: dict[str, Any]) -> dict[str, Any]:
    """``hp`` in the current form: the ``lm_*``, ``eps_min``, ``eps_max`` and
    ``adapt_eps`` entries of an older state become ``eps_schedule`` (a dict, or ``None``
    for ``adapt_eps=False``), and a state saved before ``refresh_every``,
    ``refresh_guard``, ``gpu_solve`` or ``fallback`` gets their defaults; a current
    ``hp`` is returned unchanged.

    >>> hp = upgrade_hyperparameters({"num_basis": 5, "adapt_eps": False})
    >>> hp["refresh_every"], hp["gpu_solve"], hp["eps_schedule"]
    (1, 'auto', None)
    >>> hp["fallback"]
    'gradient'
    """
    hp = {**hp, **{k: v for k, v in _ADDED.items() if k not in hp}}
    if "eps_schedule" in hp or not any(k in hp for k in (*_OLD_LM_KEYS, "adapt_eps")):
        return hp
    new = {k: v for k, v in hp.items() if k not in _OLD_LM_KEYS and k != "adapt_eps"}
    sched = {field: hp[k] for k, field in _OLD_LM_KEYS.items() if k in hp}
    new["eps_schedule"] = sched if hp.get("adapt_eps", True) else None
    return new


def load_preconditioner_state(
    state: dict[str, Any], lm: LevenbergMarquardt, hyperparameters: dict[str, Any]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Load ``state`` into ``lm``; returns the step count and the counters as device
    tensors. Warns if the saved hyperparameters differ from ``hyperparameters``."""
    if not isinstance(state, dict):
        raise ValueError("state must be a dict (KWNGPreconditioner.state_dict()), got "
                         f"{type(state).__name__}")
    missing = {"lm", "num_steps", "counters"} - set(state)
    if missing:
        raise ValueError(f"state_dict is missing {sorted(missing)}")
    lm.load_state_dict(state["lm"])
    dev = lm.eps.device
    steps = torch.tensor(check_int(state["num_steps"], "num_steps", 0),
                         dtype=torch.long, device=dev)
    saved = state["counters"]
    counters = {k: torch.tensor(check_int(saved.get(k, 0), f"counters[{k!r}]", 0),
                                dtype=torch.long, device=dev) for k in COUNTERS}
    hp = state.get("hyperparameters")
    if hp is not None:
        hp = upgrade_hyperparameters(hp)
        diffs = [f"{k}: saved {hp.get(k, '(absent)')!r}, "
                 f"now {hyperparameters.get(k, '(absent)')!r}"
                 for k in sorted({*hp, *hyperparameters})
                 if hp.get(k) != hyperparameters.get(k)]
        if diffs:
            log.warning("load_state_dict: hyperparameters differ from the saved ones "
                        "(the loaded state is used with this preconditioner's): %s",
                        "; ".join(diffs))
    return steps, counters
