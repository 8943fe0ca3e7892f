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
    Levenberg-Marquardt (App. E, every lm_interval steps, with r the largest reduction ratio
    r_t = 2 (L_{t-1} − L_t) / (lr ⟨g, ĝ⟩_{t-1}) seen since the last update):
        ε ← lm_omega · ε if r > lm_high;   ε ← ε / lm_omega if r < lm_low;   ε ∈ [eps_min, eps_max]

Two ways to get ``g`` and ``T`` (``mode``):

* ``"reference"`` — as the authors' code: ``M + 1`` serial backward passes (``retain_graph``), the
  float64 eigendecomposition solve of :func:`kwng.nystrom_solve`, bookkeeping on the host;
* ``"fast"`` — one backward pass with ``M + 1`` stacked cotangents (``is_grads_batched``: the loss
  gets cotangent ``e_0``, the outputs ``X`` get ``(0, C_1/N, …, C_M/N)``), so every layer back-
  propagates a batch of ``(M+1)·N`` signals in one kernel and, for the weights, one reduction per
  copy. The graph is the model's own, so ``T`` is the exact Jacobian even with batch norm in train
  mode (which couples the samples). The algebra is :func:`kwng.nystrom_solve_nosync` and all
  bookkeeping (ε, r, counters) stays in device tensors: no host sync in the step;
* ``"loop"`` — the fast algebra with the serial backward passes (to measure what batching buys);
* ``"ensemble"`` — the model's forward pass is re-run once as an ensemble of ``M + 1`` identical
  copies of the parameters (``torch.func.functional_call`` under ``vmap``: convolutions become one
  grouped convolution, batch norm one wider batch norm, linear layers one batched matmul), and a
  single ordinary backward pass with cotangent ``(∂L/∂X, C_1/N, …, C_M/N)`` gives ``g`` and the
  ``M`` rows of ``T`` as the gradients of the ``M + 1`` copies. Each copy sees the same batch and
  the same parameters, so its batch-norm statistics, outputs and Jacobian are those of the model:
  ``T`` is exact. The inputs of the last forward call are captured by a forward pre-hook.
  Requirements: ``loss`` depends on the parameters only through ``outputs`` (put weight decay in
  the optimizer), and the forward is deterministic (a dropout mask would be redrawn).

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

from ._checks import check_choice, check_int, check_positive
from .estimator import (
    BANDWIDTH_RULES,
    DAMPINGS,
    _with_bandwidth,
    draw_basis,
    jacobian_from_outputs,
    kernel_matrices,
    kernel_matrices_nosync,
    nystrom_solve,
    nystrom_solve_nosync,
)
from .kernels import Kernel, make_kernel

__all__ = ["KWNGPreconditioner", "MODES"]

log = logging.getLogger(__name__)

MODES = ("fast", "reference", "loop", "ensemble")
_COUNTERS = ("fallbacks", "ill_conditioned", "rank_sum", "damping_floored", "clipped", "eps_up", "eps_down")


class KWNGPreconditioner:
    """Replace the gradients of ``model``'s parameters by the KWNG direction (Prop. 6).

    Arguments (paper symbol in brackets):

    * ``model`` — any ``nn.Module``; its trainable parameters are ``θ`` (``q`` numbers).
    * ``optimizer`` — the ``torch.optim`` optimizer that takes the step; its
      ``param_groups[0]['lr']`` is the step size in the reduction ratio ``r``. Required when
      ``adapt_eps`` is on.
    * ``num_basis`` [``M``] ≥ 1; ``eps`` [``ε``] > 0, the initial damping; ``lam`` [``λ``] ≥ 0,
      the RKHS regularisation (``0`` in the paper's experiments; ``λ > 0`` adds ``λε W K Wᵀ`` to
      the stable system, which keeps it equal to Prop. 5).
    * ``kernel`` — ``"gaussian"``, ``"rq"`` or a :class:`kwng.Kernel`; ``bandwidth`` —
      ``"mean_sq"`` (``σ = σ0 · mean ‖X_n − Y_m‖²``), ``"median"`` or a positive number;
      ``sigma0`` [``σ0``] > 0.
    * ``damping`` [``D``] — ``"identity"``, ``"T"`` (``‖T_{·,i}‖``) or ``"T_tilde"`` (``‖T̃_{·,i}‖``).
    * Levenberg-Marquardt (App. E): ``lm_interval`` ≥ 1 steps between updates, ``lm_omega``
      [``ω``] in (0, 1), thresholds ``0 ≤ lm_low < lm_high``; ``adapt_eps`` switches it on;
      ``eps_min ≤ ε ≤ eps_max`` (the authors' bounds ``1e-10``, ``1e5``).
    * ``clip_norm`` > 0 or ``None`` — clip the final direction to this norm.
    * ``mode`` — ``"fast"``, ``"reference"``, ``"loop"`` or ``"ensemble"`` (module docstring).
    * ``generator`` — a ``torch.Generator`` for the basis draw (reproducible runs and tests).
    * ``diagonal_only`` — use ``D⁻¹ g`` (no kernel correction; needs ``damping`` ``"T"`` or
      ``"T_tilde"``).
    * ``rcond`` — relative eigenvalue (pivot) threshold of the stable solve (default
      ``M · float-eps``).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, num_basis: int = 5,
                 eps: float = 1e-5, lam: float = 0.0, kernel: str | Kernel = "gaussian",
                 bandwidth: str | float = "mean_sq", sigma0: float = 1.0, damping: str = "T_tilde",
                 lm_interval: int = 5, lm_omega: float = 0.85, lm_low: float = 0.25, lm_high: float = 0.75,
                 adapt_eps: bool = True, clip_norm: float | None = 1.0, mode: str = "fast",
                 generator: torch.Generator | None = None, diagonal_only: bool = False,
                 eps_min: float = 1e-10, eps_max: float = 1e5, rcond: float | None = None) -> None:
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
        self.num_basis = check_int(num_basis, "num_basis", 1)
        self.eps_init = check_positive(eps, "eps")
        self.lam = check_positive(lam, "lam", allow_zero=True)
        if isinstance(kernel, str):
            kernel = make_kernel(kernel)  # raises on an unknown name
        elif not isinstance(kernel, Kernel):
            raise ValueError(f"kernel must be 'gaussian', 'rq' or a kwng.Kernel, got {type(kernel).__name__}")
        self.kernel = kernel
        if isinstance(bandwidth, str):
            check_choice(bandwidth, "bandwidth", BANDWIDTH_RULES)
        else:
            bandwidth = check_positive(bandwidth, "bandwidth")
        self.bandwidth = bandwidth
        self.sigma0 = check_positive(sigma0, "sigma0")
        self.damping = check_choice(damping, "damping", DAMPINGS)
        self.lm_interval = check_int(lm_interval, "lm_interval", 1)
        self.lm_omega = check_positive(lm_omega, "lm_omega")
        if not self.lm_omega < 1:
            raise ValueError(f"lm_omega must lie in (0, 1), got {lm_omega}")
        self.lm_low = check_positive(lm_low, "lm_low", allow_zero=True)
        self.lm_high = check_positive(lm_high, "lm_high", allow_zero=True)
        if not self.lm_low < self.lm_high:
            raise ValueError(f"lm_low must be < lm_high, got lm_low={lm_low}, lm_high={lm_high}")
        if not isinstance(adapt_eps, bool):
            raise ValueError(f"adapt_eps must be a bool, got {type(adapt_eps).__name__}")
        self.adapt_eps = adapt_eps
        if adapt_eps and optimizer is None:
            raise ValueError("optimizer is required when adapt_eps=True (its lr enters the reduction ratio)")
        self.clip_norm = None if clip_norm is None else check_positive(clip_norm, "clip_norm")
        self.mode = check_choice(mode, "mode", MODES)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        self.generator = generator
        if not isinstance(diagonal_only, bool):
            raise ValueError(f"diagonal_only must be a bool, got {type(diagonal_only).__name__}")
        if diagonal_only and damping == "identity":
            raise ValueError("diagonal_only=True needs damping 'T' or 'T_tilde' (with 'identity' it is plain SGD)")
        self.diagonal_only = diagonal_only
        self.eps_min = check_positive(eps_min, "eps_min")
        self.eps_max = check_positive(eps_max, "eps_max")
        if not self.eps_min <= self.eps_init <= self.eps_max:
            raise ValueError(f"eps must lie in [eps_min, eps_max] = [{eps_min}, {eps_max}], got {eps}")
        self.rcond = None if rcond is None else check_positive(rcond, "rcond")
        self.num_steps = 0
        self._inputs: tuple[tuple, dict] | None = None
        self._hook = None
        if self.mode == "ensemble":
            self._hook = model.register_forward_pre_hook(self._capture_inputs, with_kwargs=True)
        self._device: torch.device | None = None
        self._buffer: torch.Tensor | None = None
        self._reset_state(self.params[0].device)

    # --- state ------------------------------------------------------------------------------
    def _reset_state(self, device: torch.device) -> None:
        self._device = device
        f64 = torch.float64
        self._eps = torch.tensor(self.eps_init, dtype=f64, device=device)
        self._prev_loss = torch.zeros((), dtype=f64, device=device)
        self._prev_dot = torch.zeros((), dtype=f64, device=device)
        self._r_max = torch.zeros((), dtype=f64, device=device)
        self._has_prev = False
        self._counters = {k: torch.zeros((), dtype=torch.long, device=device) for k in _COUNTERS}

    @property
    def eps(self) -> float:
        """The current ``ε`` (a host sync on GPU)."""
        return float(self._eps)

    def counters(self) -> dict[str, int]:
        """Counters since construction, as Python ints (a host sync); logs fallbacks if any."""
        out = {k: int(v) for k, v in self._counters.items()}
        out["steps"] = self.num_steps
        if out["fallbacks"]:
            log.info("KWNG fell back to the Euclidean gradient in %d of %d steps", out["fallbacks"], self.num_steps)
        if out["ill_conditioned"]:
            log.info("C Cᵀ was rank deficient in %d of %d steps", out["ill_conditioned"], self.num_steps)
        return out

    def hyperparameters(self) -> dict[str, Any]:
        return {"num_basis": self.num_basis, "eps": self.eps_init, "lam": self.lam, "kernel": repr(self.kernel),
                "bandwidth": self.bandwidth, "sigma0": self.sigma0, "damping": self.damping,
                "lm_interval": self.lm_interval, "lm_omega": self.lm_omega, "lm_low": self.lm_low,
                "lm_high": self.lm_high, "adapt_eps": self.adapt_eps, "clip_norm": self.clip_norm,
                "mode": self.mode, "diagonal_only": self.diagonal_only, "eps_min": self.eps_min,
                "eps_max": self.eps_max, "rcond": self.rcond}

    def state_dict(self) -> dict[str, Any]:
        """ε, the Levenberg-Marquardt memory, the counters and the hyperparameters (for checking)."""
        return {"eps": float(self._eps), "num_steps": self.num_steps, "has_prev": self._has_prev,
                "prev_loss": float(self._prev_loss), "prev_dot": float(self._prev_dot),
                "r_max": float(self._r_max), "counters": {k: int(v) for k, v in self._counters.items()},
                "hyperparameters": self.hyperparameters()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"eps", "num_steps", "has_prev", "prev_loss", "prev_dot", "r_max", "counters"} - set(state)
        if missing:
            raise ValueError(f"state_dict is missing {sorted(missing)}")
        dev, f64 = self._device, torch.float64
        self._eps = torch.tensor(check_positive(state["eps"], "eps"), dtype=f64, device=dev)
        self.num_steps = check_int(state["num_steps"], "num_steps", 0)
        self._has_prev = bool(state["has_prev"])
        self._prev_loss = torch.tensor(float(state["prev_loss"]), dtype=f64, device=dev)
        self._prev_dot = torch.tensor(float(state["prev_dot"]), dtype=f64, device=dev)
        self._r_max = torch.tensor(float(state["r_max"]), dtype=f64, device=dev)
        for k in _COUNTERS:
            self._counters[k] = torch.tensor(int(state["counters"].get(k, 0)), dtype=torch.long, device=dev)
        hp = state.get("hyperparameters")
        if hp is not None and hp != self.hyperparameters():
            log.warning("load_state_dict: hyperparameters differ from the saved ones: %s", hp)

    def __repr__(self) -> str:
        hp = ", ".join(f"{k}={v!r}" for k, v in self.hyperparameters().items())
        q = sum(p.numel() for p in self.params)
        return f"KWNGPreconditioner(q={q}, {hp})"

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

    def _levenberg_marquardt(self, loss: torch.Tensor) -> None:
        """App. E: track ``r = max_t 2(L_{t-1} − L_t)/(lr ⟨g,ĝ⟩_{t-1})``, adapt ``ε`` every ``lm_interval``."""
        cur = loss.detach().to(torch.float64)
        if self._has_prev:
            denom = self._lr() * self._prev_dot
            r = torch.where(denom > 0, 2.0 * (self._prev_loss - cur) / denom.clamp(min=1e-300),
                            torch.zeros_like(denom))
            self._r_max = torch.maximum(self._r_max, r)
        if self._has_prev and self.num_steps % self.lm_interval == 0:
            up = (self._r_max < self.lm_low) & (self._eps < self.eps_max)
            down = (self._r_max > self.lm_high) & (self._eps > self.eps_min)
            new = torch.where(up, self._eps / self.lm_omega, torch.where(down, self._eps * self.lm_omega, self._eps))
            self._eps = new.clamp(self.eps_min, self.eps_max)
            self._counters["eps_up"] += up.long()
            self._counters["eps_down"] += down.long()
            self._r_max = torch.zeros_like(self._r_max)
            if self.mode == "reference":
                log.debug("step %d: eps = %.3e", self.num_steps, float(self._eps))

    def _draw_basis(self, N: int, d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.generator is not None:
            return draw_basis(N, d, self.num_basis, self.generator)
        # drawn on the outputs' device: no host-to-device copy, no sync
        idx = torch.randperm(N, device=device)[: self.num_basis]
        coords = torch.randint(0, d, (self.num_basis,), device=device)
        return idx, coords

    def _capture_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook (``mode="ensemble"``): remember the inputs of the latest forward call."""
        if torch.is_grad_enabled():
            self._inputs = (args, kwargs)

    def remove_hooks(self) -> None:
        """Detach the forward pre-hook installed by ``mode="ensemble"``."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _ensemble_gradients(self, loss: torch.Tensor, X: torch.Tensor, C: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """``g`` and ``T`` from one backward pass through an ``(M+1)``-copy ensemble forward."""
        from torch.func import functional_call, vmap

        if self._inputs is None:
            raise ValueError("mode='ensemble' needs the model's forward to run (with grad enabled) before step()")
        args, kwargs = self._inputs
        N, M = X.shape[0], C.shape[0]
        R = M + 1
        (gX,) = torch.autograd.grad(loss, X)  # ∂L/∂X: only the small graph between X and the loss
        names = self._param_names
        stacked = {n: p.detach().unsqueeze(0).expand(R, *p.shape).clone().requires_grad_(True)
                   for n, p in zip(names, self.params)}
        buffers = {n: b.detach().unsqueeze(0).expand(R, *b.shape).clone()  # copies: running stats untouched
                   for n, b in self.model.named_buffers()}

        def forward(p: dict, b: dict) -> torch.Tensor:
            return functional_call(self.model, (p, b), args, kwargs)

        Xs = vmap(forward, in_dims=(0, 0), randomness="same")(stacked, buffers)
        if Xs.shape != (R,) + tuple(X.shape):
            raise ValueError(f"the ensemble forward returned shape {tuple(Xs.shape)}, expected {(R,) + tuple(X.shape)}"
                             "; outputs must be the model's own (N, d) output of the last forward call")
        V = torch.cat([gX.detach()[None].to(Xs.dtype), (C / N).to(Xs.dtype)], 0)
        grads = torch.autograd.grad(Xs, list(stacked.values()), V)
        G = torch.cat([gr.reshape(R, -1) for gr in grads], 1)
        return G[0], G[1:]

    def _gradients(self, loss: torch.Tensor, X: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``g`` (``q``) and ``T`` (``M × q``) from the graph of ``loss`` and ``X``."""
        N, M = X.shape[0], C.shape[0]
        if self.mode == "ensemble":
            return self._ensemble_gradients(loss, X, C)
        if self.mode == "fast":
            R = M + 1
            e0 = torch.zeros(R, dtype=loss.dtype, device=loss.device)
            e0[0] = 1.0
            V = torch.cat([torch.zeros_like(X)[None], (C / N).to(X.dtype)], 0)
            grads = torch.autograd.grad([loss, X], self.params, grad_outputs=[e0, V], is_grads_batched=True,
                                        allow_unused=True, materialize_grads=True)
            G = torch.cat([gr.reshape(R, -1) for gr in grads], 1)
            return G[0], G[1:]
        g_parts = torch.autograd.grad(loss, self.params, retain_graph=True, allow_unused=True,
                                      materialize_grads=True)
        g = torch.cat([gp.reshape(-1) for gp in g_parts])
        T = jacobian_from_outputs(X, self.params, C.to(X.dtype), retain_graph=False)
        return g, T

    def _write_grads(self, direction: torch.Tensor) -> None:
        q = direction.numel()
        if self._buffer is None or self._buffer.numel() != q or self._buffer.device != direction.device \
                or self._buffer.dtype != self.params[0].dtype:
            self._buffer = torch.empty(q, dtype=self.params[0].dtype, device=direction.device)
        self._buffer.copy_(direction)
        offset = 0
        for p in self.params:
            n = p.numel()
            view = self._buffer[offset:offset + n].view_as(p)
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view  # a view of the shared flat buffer: one copy per step instead of one per tensor
            offset += n

    def step(self, loss: torch.Tensor, outputs: torch.Tensor) -> dict[str, Any]:
        """Backward pass(es), KWNG direction, fallback, clipping; the result is written into ``p.grad``.

        ``outputs`` is the ``(N, d)`` batch ``X = h_θ(z)`` and ``loss`` a scalar built from it
        (it may also depend on the parameters directly, e.g. an L2 term: ``g`` is its full
        gradient). Returns a dict with ``eps`` (used in this step), ``fallback`` (the Euclidean
        gradient was used), ``rank``, ``dot`` (``⟨g, ĝ⟩`` after clipping), ``grad_norm``,
        ``direction_norm``, ``bandwidth`` — 0-dim tensors in ``"fast"``/``"loop"`` mode (no host
        sync), Python numbers in ``"reference"`` mode.
        """
        self._check_inputs(loss, outputs)
        X = outputs
        N, d = X.shape
        if X.device != self._device:
            state = self.state_dict()
            self._reset_state(X.device)
            self.load_state_dict(state)
        self.num_steps += 1
        if self.adapt_eps:
            self._levenberg_marquardt(loss)
        eps = self._eps
        idx, coords = self._draw_basis(N, d, X.device)
        reference = self.mode == "reference"
        if reference:
            kern = _with_bandwidth(self.kernel, X.detach(), idx, self.bandwidth, self.sigma0)
            C, K, CCt = kernel_matrices(X, idx, coords, kern)
            sigma = torch.tensor(kern.bandwidth)
        else:
            C, K, CCt, sigma = kernel_matrices_nosync(X, idx, coords, self.kernel, self.bandwidth, self.sigma0)
        g, T = self._gradients(loss, X, C)

        if reference and not self.diagonal_only:
            res = nystrom_solve(T, CCt, K, g, N, eps=float(eps), lam=self.lam,
                                damping=self.damping, method="stable", rcond=self.rcond)
            direction, rank = res.direction, res.diagnostics["rank"]
            rank_t = torch.tensor(rank, device=X.device)
            ill_t = torch.tensor(rank < self.num_basis, device=X.device)
            n_floor_t = torch.tensor(res.diagnostics["damping_floored"], device=X.device)
        else:
            direction, diag = nystrom_solve_nosync(T, CCt, K, g, N, eps=eps, lam=self.lam, damping=self.damping,
                                                   rcond=self.rcond, diagonal_only=self.diagonal_only)
            rank_t, ill_t, n_floor_t = diag["rank"], diag["ill_conditioned"], diag["damping_floored"]

        dot = torch.dot(g.to(torch.float64), direction.to(torch.float64))
        bad = ~(dot > 0) | ~torch.isfinite(direction).all()
        direction = torch.where(bad, g, direction)
        dot = torch.where(bad, torch.dot(g.to(torch.float64), g.to(torch.float64)), dot)
        grad_norm = torch.linalg.vector_norm(g)
        norm = torch.linalg.vector_norm(direction)
        clipped = torch.zeros((), dtype=torch.bool, device=X.device)
        if self.clip_norm is not None:
            clipped = norm > self.clip_norm
            scale = torch.where(clipped, self.clip_norm / norm.clamp(min=1e-30), torch.ones_like(norm))
            direction = direction * scale
            dot = dot * scale.to(dot.dtype)
            norm = norm * scale
        self._write_grads(direction)

        self._prev_loss = loss.detach().to(torch.float64)
        self._prev_dot = dot
        self._has_prev = True
        c = self._counters
        c["fallbacks"] += bad.long()
        c["ill_conditioned"] += ill_t.long()
        c["rank_sum"] += rank_t.long()
        c["damping_floored"] += torch.as_tensor(n_floor_t, device=X.device).long()
        c["clipped"] += clipped.long()
        info = {"eps": eps, "fallback": bad, "rank": rank_t, "dot": dot, "grad_norm": grad_norm,
                "direction_norm": norm, "bandwidth": sigma}
        if reference:
            info = {k: v.item() for k, v in info.items()}
            if info["fallback"]:
                log.info("step %d: ⟨g, ĝ⟩ ≤ 0 or ĝ not finite: Euclidean gradient used", self.num_steps)
        return info

