"""KWNG as a drop-in preconditioner for any PyTorch model (book chapter :ref:`deep-learning`).

A classifier ``z ↦ X = h_θ(z) ∈ R^d`` is an implicit model: its outputs on a mini-batch are ``N``
samples ``X_n`` of a distribution ``ρ_θ`` (Arbel et al., 2020, §4.2). The preconditioner replaces
the Euclidean gradient ``g = ∇_θ L`` by the kernelized Wasserstein natural gradient of Prop. 6,
then any ``torch.optim`` optimizer takes the step::

    precond = KWNGPreconditioner(model, optimizer=optimizer, num_basis=5, eps=1e-5)
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
    Levenberg-Marquardt (App. D.2, every lm_interval steps, with r the largest reduction ratio
    r_t = 2 (L_{t-1} − L_t) / (lr ⟨g, ĝ⟩_{t-1}) seen since the last update):
        ε ← lm_omega · ε if r > lm_high;   ε ← ε / lm_omega if r < lm_low;   ε ∈ [eps_min, eps_max]

Two ways to get ``g`` and ``T`` (``mode``):

* ``"fast"`` (default) — one backward pass for all ``M + 1`` cotangents
  (:mod:`kwng.replicate`): the model's training forward runs on ``M + 1`` stacked copies of the
  batch (matrix work on one copy only; batch norm per copy, so ``X``, the running statistics and
  the Jacobian are the model's own), the backward pass takes the stacked cotangent
  ``(∂L/∂X, C_1/N, …, C_M/N)``, and every layer forms the ``M + 1`` weight gradients in one call.
  ``outputs`` must be the tensor the model returned, or computed from it without parameters
  (e.g. ``U · model(z)`` with a fixed ``U``: the cotangents are pulled back through that map).
  The ``M × M`` algebra is
  :func:`kwng.nystrom_solve_nosync` and all bookkeeping (ε, r, counters, fallbacks, clipping) stays
  in device tensors: no host synchronisation in a step. A model with parameters outside
  ``Conv2d``/``Linear``/``BatchNorm`` (:func:`kwng.replicate.unsupported_reason`), or a step whose
  ``outputs`` are not the model's own output, uses the serial passes below (logged once);
* ``"reference"`` — as the authors' code: ``M + 1`` serial backward passes (``retain_graph``), the
  float64 eigendecomposition solve of :func:`kwng.nystrom_solve`, bookkeeping on the host.

Under ``torch.autocast`` the network runs in the autocast dtype; ``g`` and ``T`` are returned in the
parameters' dtype and the kernel algebra runs in float32/float64 as in full precision.

ε convention: ``eps`` enters as ``(ε/N) I`` next to the whitened ``T̃ D⁻¹ T̃ᵀ`` (Prop. 6). The
authors' code whitens with ``(CCᵀ/N)^{-1/2}`` and adds ``ε_a I``; with the paper's damping
``T_tilde`` the two regularisers agree when ``ε = √N · ε_a`` (:func:`eps_from_authors`), bounds
included; with ``identity`` or ``T`` damping they agree when ``ε = ε_a``.

Counters (:meth:`KWNGPreconditioner.counters`): ``fallbacks`` (steps where the natural direction
was replaced by ``g``), ``ill_conditioned`` (``CCᵀ`` regularised), ``rank_sum`` (sum over steps
of the rank kept by the stable solve), ``damping_floored``, ``clipped``, ``eps_up``/``eps_down``.
In fast mode fallbacks are counted on the device and logged by :meth:`counters` (a host sync).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ._checks import check_choice, check_int
from .estimator import (
    _with_bandwidth,
    draw_basis,
    jacobian_from_outputs,
    kernel_matrices,
    kernel_matrices_nosync,
    nystrom_solve,
    nystrom_solve_nosync,
)
from .graph import derived_from
from .lm import LevenbergMarquardt
from .precond_config import MODES, KWNGConfig, eps_from_authors
from .precond_grads import replicated_gradients
from .replicate import LAYOUTS, ReplicatedEngine, unsupported_reason
from .triton_solve import fused_available, fused_direction

__all__ = ["KWNGPreconditioner", "KWNGConfig", "MODES", "eps_from_authors"]

log = logging.getLogger(__name__)

_COUNTERS = ("fallbacks", "ill_conditioned", "rank_sum", "damping_floored", "clipped", "serial_steps",
             "loss_only")


class KWNGPreconditioner:
    """Replace the gradients of ``model``'s parameters by the KWNG direction (Prop. 6).

    Arguments: ``model`` — any ``nn.Module``; its trainable parameters are ``θ`` (``q``
    numbers). A parameter frozen later (``requires_grad=False``) is left alone from then on. In
    fast mode the replicated forward runs when ``model`` itself is called (``model(z)``); attach
    the preconditioner to the network that the training loop calls. ``optimizer`` — the
    ``torch.optim`` optimizer that takes the step; its ``param_groups[0]['lr']`` is the step
    size in the reduction ratio ``r``; required when ``adapt_eps`` is on. ``config`` — a
    :class:`kwng.KWNGConfig` with the hyperparameters (``num_basis``, ``eps``, ``lam``,
    ``kernel``, ``bandwidth``, ``sigma0``, ``damping``, the ``lm_*`` rule, ``clip_norm``,
    ``mode``, ``diagonal_only``, ``rcond``; see there); keyword arguments of the same names
    build it (or override fields of ``config``). ``generator`` — a ``torch.Generator`` for the
    basis draw (reproducible runs and tests). ``layout`` — the memory format of the fast
    path's replicated activations, one of ``"auto"`` (channels_last for 4-D inputs on the
    GPU when the model's forward allows it), ``"model"`` or ``"channels_last"``
    (:class:`kwng.replicate.ReplicatedEngine`); it changes the speed, not the values.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 config: KWNGConfig | None = None, *, generator: torch.Generator | None = None,
                 layout: str = "auto", **hyperparameters: Any) -> None:
        unknown = set(hyperparameters) - set(KWNGConfig.fields())
        if unknown:
            raise ValueError(f"unknown hyperparameter(s) {sorted(unknown)}; accepted: "
                             f"{', '.join(KWNGConfig.fields())}")
        if config is not None and not isinstance(config, KWNGConfig):
            raise ValueError(f"config must be a kwng.KWNGConfig or None, got {type(config).__name__}")
        cfg = (config or KWNGConfig()).replace(**hyperparameters)
        self.config = cfg
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        if not self.params:
            raise ValueError("model has no parameter with requires_grad=True")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        if cfg.adapt_eps and optimizer is None:
            raise ValueError("optimizer is required when adapt_eps=True (its lr enters the reduction ratio)")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        self.generator = generator
        # the hyperparameters read by the step, as attributes (the config is their one source)
        self.num_basis, self.lam, self.kernel = cfg.num_basis, cfg.lam, cfg.kernel
        self.bandwidth, self.sigma0, self.damping = cfg.bandwidth, cfg.sigma0, cfg.damping
        self.adapt_eps, self.clip_norm, self.mode = cfg.adapt_eps, cfg.clip_norm, cfg.mode
        self.diagonal_only, self.rcond = cfg.diagonal_only, cfg.rcond
        self.lm = LevenbergMarquardt(cfg.eps, eps_min=cfg.eps_min, eps_max=cfg.eps_max,
                                     omega=cfg.lm_omega, low=cfg.lm_low, high=cfg.lm_high,
                                     interval=cfg.lm_interval, rule=cfg.lm_rule,
                                     device=self.params[0].device)
        self._step_count = torch.zeros((), dtype=torch.long, device=self.params[0].device)
        self._warned: set[str] = set()
        self._engine: ReplicatedEngine | None = None
        check_choice(layout, "layout", LAYOUTS)
        if self.mode == "fast":
            reason = unsupported_reason(model, self.params)
            if reason is not None and "already carries" in reason:
                raise ValueError(f"model: {reason}")
            if reason is None:
                self._engine = ReplicatedEngine(model, self.num_basis + 1, layout)
            else:
                self._warn_once("unsupported", "KWNG fast mode: %s; this model uses serial backward passes", reason)
        self._buffer: torch.Tensor | None = None
        self._counters = {k: torch.zeros((), dtype=torch.long, device=self.params[0].device) for k in _COUNTERS}

    # --- state ------------------------------------------------------------------------------
    @property
    def lm_rule(self) -> str:
        return self.lm.rule

    @property
    def num_steps(self) -> int:
        """Steps taken (counted on the device, so CUDA-graph replays count; a host sync)."""
        return int(self._step_count)

    @property
    def eps(self) -> float:
        """The current ``ε`` (a host sync on GPU)."""
        return float(self.lm.eps)

    @property
    def engine_layout(self) -> str | None:
        """The layout of the fast path's replicated activations once its first forward
        has chosen it: ``"channels_last"`` or ``"model"``; ``None`` before, and without
        the fast path."""
        return None if self._engine is None else self._engine.chosen_layout

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
        lm = self.lm
        return {"num_basis": self.num_basis, "eps": lm.eps_init, "lam": self.lam, "kernel": repr(self.kernel),
                "bandwidth": self.bandwidth, "sigma0": self.sigma0, "damping": self.damping,
                "lm_interval": lm.interval, "lm_omega": lm.omega, "lm_low": lm.low, "lm_high": lm.high,
                "adapt_eps": self.adapt_eps, "clip_norm": self.clip_norm, "mode": self.mode,
                "diagonal_only": self.diagonal_only, "eps_min": lm.eps_min, "eps_max": lm.eps_max,
                "rcond": self.rcond, "lm_rule": lm.rule}

    def state_dict(self) -> dict[str, Any]:
        """The Levenberg-Marquardt state (``lm``, with the current ``ε``), the counters and the
        hyperparameters (for checking)."""
        return {"lm": self.lm.state_dict(), "num_steps": self.num_steps,
                "counters": {k: int(v) for k, v in self._counters.items()},
                "hyperparameters": self.hyperparameters()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"lm", "num_steps", "counters"} - set(state)
        if missing:
            raise ValueError(f"state_dict is missing {sorted(missing)}")
        self.lm.load_state_dict(state["lm"])
        dev = self.lm.eps.device
        self._step_count = torch.tensor(check_int(state["num_steps"], "num_steps", 0), dtype=torch.long,
                                        device=dev)
        for k in _COUNTERS:
            self._counters[k] = torch.tensor(int(state["counters"].get(k, 0)), dtype=torch.long, device=dev)
        hp = state.get("hyperparameters")
        if hp is not None and hp != self.hyperparameters():
            log.warning("load_state_dict: hyperparameters differ from the saved ones: %s", hp)

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
        if not isinstance(outputs, torch.Tensor) or outputs.dim() != 2:
            shape = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
            raise ValueError(f"outputs must be the model outputs X = h_θ(z) as a (batch, d) tensor, got {shape}; "
                             "flatten them (outputs.flatten(1)) or pick the tensor that the loss is built on")
        if not outputs.is_floating_point() or outputs.grad_fn is None:
            raise ValueError("outputs must be a floating-point tensor with an autograd graph to the parameters "
                             "(call step(loss, outputs) with the outputs of model(z), not detached ones)")
        if outputs.shape[0] < self.num_basis:
            raise ValueError(f"the batch has {outputs.shape[0]} samples but num_basis = {self.num_basis}; "
                             "num_basis must be <= batch size")
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or loss.grad_fn is None:
            raise ValueError("loss must be a scalar tensor with an autograd graph (e.g. loss_fn(outputs, y))")

    def _lr(self) -> float:
        if self.optimizer is None:
            return 1.0
        return float(self.optimizer.param_groups[0]["lr"])

    def observe_loss_after_step(self, loss_after: torch.Tensor) -> None:
        """``lm_rule="same_batch"``: the loss of the step's mini-batch after ``optimizer.step()``."""
        if not isinstance(loss_after, torch.Tensor) or loss_after.dim() != 0:
            raise ValueError("loss_after must be a scalar tensor (the same batch's loss after the step)")
        self.lm.observe(loss_after)

    def _draw_basis(self, N: int, d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # without a generator: drawn on the outputs' device (no host-to-device copy, no sync)
        return draw_basis(N, d, self.num_basis, self.generator, device)

    def _share(self, Xk: torch.Tensor, loss: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The samples, basis and loss the step's estimator sees: here this process's own
        (:class:`kwng.distributed.DistributedKWNG` gathers those of every rank)."""
        idx, coords = self._draw_basis(Xk.shape[0], Xk.shape[1], Xk.device)
        return Xk, idx, coords, loss

    def _reduce(self, g: torch.Tensor, T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``g`` and ``T`` as the solve sees them: here unchanged (the distributed
        preconditioner sums the ranks' shares)."""
        return g, T

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

    def _grad_buffer(self, q: int, params: list[torch.Tensor]) -> torch.Tensor:
        """The flat buffer whose views are the parameters' ``.grad`` (kept across steps)."""
        dtype, device = params[0].dtype, params[0].device
        if self._buffer is None or self._buffer.numel() != q or self._buffer.device != device \
                or self._buffer.dtype != dtype:
            self._buffer = torch.empty(q, dtype=dtype, device=device)
        return self._buffer

    def _write_grads(self, direction: torch.Tensor | None, params: list[torch.Tensor]) -> None:
        """Copy ``direction`` into the buffer (``None``: already written there) and make its
        views the parameters' gradients."""
        if direction is not None:
            self._grad_buffer(direction.numel(), params).copy_(direction)
        offset = 0
        for p in params:
            n = p.numel()
            view = self._buffer[offset:offset + n].view_as(p)
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view  # a view of the shared flat buffer: one copy per step instead of one per tensor
            offset += n

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
        with torch.autocast(outputs.device.type, enabled=False):  # the kernel algebra in ≥ float32
            return self._step(loss, outputs)

    def _solve(self, T, CCt, K, g, N, eps, reference):
        """Prop. 6 through the reference (host diagnostics) or the sync-free path."""
        if reference and not self.diagonal_only:
            res = nystrom_solve(T, CCt, K, g, N, eps=float(eps), lam=self.lam,
                                damping=self.damping, method="stable", rcond=self.rcond)
            dg, dev = res.diagnostics, T.device
            rank = dg["rank"]
            return (res.direction, torch.tensor(rank, device=dev),
                    torch.tensor(rank < self.num_basis, device=dev),
                    torch.tensor(dg["damping_floored"], device=dev),
                    torch.tensor(dg["loss_only"], device=dev),
                    torch.tensor(dg["floored_share"], device=dev))
        direction, dg = nystrom_solve_nosync(T, CCt, K, g, N, eps=eps, lam=self.lam,
                                             damping=self.damping, rcond=self.rcond,
                                             diagonal_only=self.diagonal_only)
        return (direction, dg["rank"], dg["ill_conditioned"], dg["damping_floored"],
                dg["loss_only"], dg["floored_share"])

    def _safeguard(self, g, direction):
        """The Euclidean gradient where ``⟨g, ĝ⟩ ≤ 0`` or ``ĝ`` is not finite, then the
        clipping to ``clip_norm``; no host sync."""
        dot = torch.dot(g.to(torch.float64), direction.to(torch.float64))
        bad = ~(dot > 0) | ~torch.isfinite(direction).all()
        direction = torch.where(bad, g, direction)
        dot = torch.where(bad, torch.dot(g.to(torch.float64), g.to(torch.float64)), dot)
        grad_norm = torch.linalg.vector_norm(g)
        norm = torch.linalg.vector_norm(direction)
        clipped = torch.zeros((), dtype=torch.bool, device=g.device)
        if self.clip_norm is not None:
            clipped = norm > self.clip_norm
            scale = torch.where(clipped, self.clip_norm / norm.clamp(min=1e-30),
                                torch.ones_like(norm))
            direction = direction * scale
            dot = dot * scale.to(dot.dtype)
            norm = norm * scale
        return direction, dot, bad, clipped, grad_norm, norm

    def _step(self, loss: torch.Tensor, outputs: torch.Tensor) -> dict[str, Any]:
        X = outputs
        if X.device != self.lm.eps.device:
            self.lm.to(X.device)
            self._counters = {k: v.to(X.device) for k, v in self._counters.items()}
            self._step_count = self._step_count.to(X.device)
        params = [p for p in self.params if p.requires_grad]
        for p in self.params:
            if not p.requires_grad and p.grad is not None and self._buffer is not None \
                    and p.grad.untyped_storage().data_ptr() == self._buffer.untyped_storage().data_ptr():
                p.grad = None  # frozen since the last step: leave it alone
        if not params:
            raise ValueError("every parameter of the model is frozen (requires_grad=False): nothing to update")
        self._step_count += 1
        Xk = X.detach().to(torch.promote_types(X.dtype, torch.float32))
        Xk, idx, coords, loss_all = self._share(Xk, loss)
        N = Xk.shape[0]
        eps = self.lm.update(loss_all) if self.adapt_eps else self.lm.eps
        reference = self.mode == "reference"
        if reference:
            kern = _with_bandwidth(self.kernel, Xk, idx, self.bandwidth, self.sigma0)
            C, K, CCt = kernel_matrices(Xk, idx, coords, kern)
            sigma = torch.tensor(kern.bandwidth)
        else:
            C, K, CCt, sigma = kernel_matrices_nosync(Xk, idx, coords, self.kernel, self.bandwidth, self.sigma0)
        g, T = self._gradients(loss, X, C, params)
        g = g.to(Xk.dtype) if g.dtype not in (torch.float32, torch.float64) else g
        g, T = self._reduce(g, T.to(g.dtype))

        if not reference and not self.diagonal_only and fused_available(T, g, self.damping):
            # the direction, safeguard and clipping in four kernels, written straight into
            # the gradient buffer (kwng.triton_solve)
            f = fused_direction(T, CCt, K, g, N, eps=torch.as_tensor(eps, device=T.device),
                                lam=self.lam, damping=self.damping, rcond=self.rcond,
                                clip_norm=self.clip_norm, out=self._grad_buffer(g.numel(), params))
            rank_t, ill_t, n_floor_t = f["rank"], f["ill_conditioned"], f["damping_floored"]
            loss_only_t, share_t, dot, bad = f["loss_only"], f["floored_share"], f["dot"], f["fallback"]
            clipped, grad_norm, norm = f["clipped"], f["grad_norm"], f["direction_norm"]
            direction = None
        else:
            direction, rank_t, ill_t, n_floor_t, loss_only_t, share_t = self._solve(
                T, CCt, K, g, N, eps, reference)
            direction, dot, bad, clipped, grad_norm, norm = self._safeguard(g, direction)
        self._write_grads(direction, params)
        self.lm.record(self._lr(), dot)
        c = self._counters
        c["fallbacks"] += bad.long()
        c["ill_conditioned"] += ill_t.long()
        c["rank_sum"] += rank_t.long()
        n_floor_t = torch.as_tensor(n_floor_t, device=X.device).long()
        c["damping_floored"] += n_floor_t
        c["clipped"] += clipped.long()
        c["loss_only"] += loss_only_t.long()
        info = {"eps": eps, "reduction_ratio": self.lm.ratio.clone(), "fallback": bad, "clipped": clipped,
                "rank": rank_t, "floored_columns": n_floor_t, "floored_share": share_t,
                "loss_only": loss_only_t, "dot": dot, "grad_norm": grad_norm, "direction_norm": norm,
                "bandwidth": sigma}
        info = {k: torch.as_tensor(v, device=X.device) for k, v in info.items()}
        if reference and bool(info["fallback"]):  # the reference mode syncs anyway
            log.info("step %d: ⟨g, ĝ⟩ ≤ 0 or ĝ not finite: Euclidean gradient used", self.num_steps)
        return info
