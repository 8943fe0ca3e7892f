"""The hyperparameters of :class:`kwng.KWNGPreconditioner` in one validated, frozen
object.

Symbols of Arbel et al. (2020) in brackets; App. D.2 gives the Levenberg-Marquardt rule.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from kwng._checks import check_choice, check_int, check_positive
from kwng.engine.gpu_paths import GPU_SOLVES
from kwng.engine.lm import LMSchedule
from kwng.kernels import BANDWIDTH_RULES, Kernel, make_kernel
from kwng.solve import DAMPINGS, FALLBACKS

__all__ = ["AUTO_MODES", "FIXED_FIELDS", "KWNGConfig", "MODES", "auto_mode",
           "authors_eps_factor", "config_with", "eps_from_authors", "live_changes",
           "resolve_mode"]

MODES = ("fast", "reference", "auto")

#: The exact path ``mode="auto"`` takes, by device type and model kind (``"conv"``: the
#: model has a ``Conv2d``; ``"dense"``: it has none): the faster one measured by
#: ``python -m studies.bench.mode_choice`` (the records
#: ``results/benchmarks/mode_choice/<device type>.json``, checked against this table
#: in ``tests/test_precond_loop.py``). On the CPU the replicated convolutions of the
#: fast path cost more than the reference path's serial backward passes, while a dense
#: network with many parameters gains from the fast path's sync-free solve. A device
#: type not listed takes ``fast``.
#:
#: :meta hide-value:
AUTO_MODES = {"cpu": {"conv": "reference", "dense": "fast"},
              "cuda": {"conv": "fast", "dense": "fast"}}


def resolve_mode(mode: str, device: torch.device, model: torch.nn.Module) -> str:
    """The path a preconditioner takes: ``mode`` itself, or for ``"auto"`` the choice
    of :func:`auto_mode`."""
    check_choice(mode, "mode", MODES)
    return mode if mode != "auto" else auto_mode(device, model)[0]


def auto_mode(device: torch.device, model: torch.nn.Module) -> tuple[str, str]:
    """``mode="auto"``'s path for ``model`` on ``device`` and why: the entry of
    :data:`AUTO_MODES` for the device type and the model's kind, except that a model
    with a dropout layer (``p > 0``) takes ``"reference"``: the fast path's replicated
    forward would draw one mask per copy of the batch and refuses it."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    dropout = [type(m).__name__ for m in model.modules()
               if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]
    if dropout:
        return "reference", (f"the model has {dropout[0]}, which the fast path's "
                             "replicated forward cannot run")
    kind = "conv" if any(isinstance(m, torch.nn.Conv2d) for m in model.modules()) \
        else "dense"
    dev = torch.device(device).type
    return (AUTO_MODES.get(dev, {}).get(kind, "fast"),
            f"the faster path for a {kind} model on {dev} (AUTO_MODES)")


def authors_eps_factor(batch_size: int) -> float:
    """``√N``: the factor between this package's ``ε`` and the authors' ``ε_a`` under
    the damping ``D = diag ‖T̃_{·,i}‖`` (``damping="T_tilde"``, the paper's), ``ε = √N ·
    ε_a`` (``N`` = ``batch_size``); the one home of the conversion
    (:func:`eps_from_authors`, and the plots that show ``ε`` in the authors' units).

    The authors whiten ``T`` with ``(CCᵀ/N)^{-1/2}`` and add ``ε_a I``;
    :func:`kwng.nystrom_solve` whitens with ``(CCᵀ)^{-1/2}`` and adds ``(ε/N) I``. Their
    ``T̃`` is ``√N`` times ours, and so is the damping built from it, so their ``T̃ D⁻¹
    T̃ᵀ`` is ``√N`` times ours and the two regularisers coincide for ``ε = √N ε_a`` (the
    same factor converts the bounds ``[1e-10, 1e5]`` of App. D.2; derivation in the book
    chapter :ref:`experiments-cifar`, checked against the authors' formulas in
    ``tests/test_cifar.py``). The conversion holds for this damping only: with
    ``damping="identity"`` their ``T̃ D⁻¹ T̃ᵀ`` is ``N`` times ours and the two ``ε``
    are equal (checked against the authors' class in float64); the same algebra gives
    equal ``ε`` for ``"T"``, whose ``D`` does not depend on the whitening. Do not
    convert then.
    """
    return math.sqrt(check_int(batch_size, "batch_size", 1))


def eps_from_authors(eps: float, batch_size: int) -> float:
    """``ε`` in this package's convention for the authors' ``ε_a``: ``ε = √N · ε_a``
    (:func:`authors_eps_factor`, damping ``"T_tilde"`` only)."""
    return check_positive(eps, "eps") * authors_eps_factor(batch_size)


@dataclass(frozen=True)
class KWNGConfig:
    """Hyperparameters of the preconditioner, validated on construction (paper
    symbol in brackets).

    * ``num_basis`` [``M``] ≥ 1; ``eps`` [``ε``] > 0, the (initial) damping (this
      package's convention; :func:`eps_from_authors` converts the authors'); ``lam``
      [``λ``] ≥ 0, the RKHS regularisation (``0`` in the paper's experiments).
    * ``kernel`` — ``"gaussian"``, ``"rq"`` or a :class:`kwng.Kernel` (a name is
      turned into the kernel); ``bandwidth`` — ``"mean_sq"``
      (``σ = σ0 · mean ‖X_n − Y_m‖²``), ``"median"`` or a positive number;
      ``sigma0`` [``σ0``] > 0.
    * ``damping`` [``D``] — one of ``kwng.solve.DAMPINGS``.
    * ``eps_schedule`` — how ``ε`` moves during training: a
      :class:`kwng.engine.lm.LMSchedule` (the Levenberg-Marquardt rule of App. D.2, the
      default; ``eps`` must lie within its bounds) or ``None`` (``ε`` fixed).
    * ``clip_norm`` > 0 or ``None``; ``mode`` ``"fast"``, ``"reference"`` (both
      exact) or ``"auto"`` (the faster of the two for the model's kind on the
      parameters' device at construction, :data:`AUTO_MODES`; ``"reference"`` for a
      model with dropout, :func:`resolve_mode`);
      ``diagonal_only`` — ``D⁻¹ g`` only (needs ``damping`` ``"T"`` or
      ``"T_tilde"``); ``rcond`` > 0 — relative pivot threshold of the stable solve
      (``None``: ``M · float-eps``).
    * ``refresh_every`` [``k``] ≥ 1 — build ``T``, ``C``, ``K`` afresh every ``k`` steps
      and apply the cached system to each step's fresh gradient in between
      (:class:`kwng.engine.precond.SystemCache`); ``1`` (the default) is the exact
      step of every step.
    * ``fallback`` — what a step does when its direction fails the descent test
      (``⟨g, ĝ⟩ ≤ 0``) or is not finite, one of :data:`kwng.solve.FALLBACKS`:
      ``"gradient"`` (the default, the authors' code) takes the Euclidean gradient,
      ``"skip"`` takes no step (a zero direction; the ε rule then sees no decrease and
      raises ``ε``). Counted in ``counters()["fallbacks"]`` either way. With an
      ill-conditioned model the Euclidean gradient at KWNG's step size can be the step
      that ruins a run (:ref:`cifar-amortized`, the traced run).
    * ``refresh_guard`` — with ``refresh_every > 1``, also refresh two steps after a
      step whose system was rank deficient or whose direction fell back to ``g``
      (:class:`kwng.engine.precond.SystemCache`, "The guard"); ``False`` (the default):
      the counter alone. Alone it does not make a ``k`` too large for a network safe:
      on the book's CIFAR-10 study guarded ``k = 100`` runs stalled too; with
      ``fallback="skip"`` none of five did (:ref:`cifar-amortized`).
    * ``gpu_solve`` — which implementation runs the fast step's solve and per-copy
      batch-norm backward on CUDA, one of :data:`kwng.engine.gpu_paths.GPU_SOLVES`:
      ``"auto"`` (the default: the Triton kernels where they run, else the compiled
      functions), ``"triton"``, ``"compile"`` or ``"eager"``. The CPU runs eagerly.

    >>> KWNGConfig(num_basis=3).replace(gpu_solve="eager").gpu_solve
    'eager'
    """

    num_basis: int = 5
    eps: float = 1e-5
    lam: float = 0.0
    kernel: str | Kernel = "gaussian"
    bandwidth: str | float = "mean_sq"
    sigma0: float = 1.0
    damping: str = "T_tilde"
    eps_schedule: LMSchedule | None = LMSchedule()
    clip_norm: float | None = 1.0
    mode: str = "fast"
    diagonal_only: bool = False
    rcond: float | None = None
    refresh_every: int = 1
    refresh_guard: bool = False
    gpu_solve: str = "auto"
    fallback: str = "gradient"

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("num_basis", check_int(self.num_basis, "num_basis", 1))
        put("eps", check_positive(self.eps, "eps"))
        put("lam", check_positive(self.lam, "lam", allow_zero=True))
        if isinstance(self.kernel, str):
            put("kernel", make_kernel(self.kernel))  # raises on an unknown name
        elif not isinstance(self.kernel, Kernel):
            raise ValueError("kernel must be 'gaussian', 'rq' or a kwng.Kernel, got "
                             f"{type(self.kernel).__name__}")
        if isinstance(self.bandwidth, str):
            check_choice(self.bandwidth, "bandwidth", BANDWIDTH_RULES)
        else:
            put("bandwidth", check_positive(self.bandwidth, "bandwidth"))
        put("sigma0", check_positive(self.sigma0, "sigma0"))
        check_choice(self.damping, "damping", DAMPINGS)
        if self.eps_schedule is not None:
            if not isinstance(self.eps_schedule, LMSchedule):
                raise ValueError("eps_schedule must be a kwng.engine.lm.LMSchedule or "
                                 "None, "
                                 f"got {type(self.eps_schedule).__name__}")
            self.eps_schedule.check_eps(self.eps)
        if self.clip_norm is not None:
            put("clip_norm", check_positive(self.clip_norm, "clip_norm"))
        check_choice(self.mode, "mode", MODES)
        if not isinstance(self.diagonal_only, bool):
            raise ValueError("diagonal_only must be True or False, got "
                             f"{type(self.diagonal_only).__name__}")
        if self.diagonal_only and self.damping == "identity":
            raise ValueError("diagonal_only=True needs damping 'T' or 'T_tilde' (with "
                             "'identity' it is plain SGD)")
        if self.rcond is not None:
            put("rcond", check_positive(self.rcond, "rcond"))
        k = self.refresh_every
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError("refresh_every must be an integer in [1, inf) (steps "
                             "between refreshes of T, C, K; 1: the exact step), got "
                             f"{k!r}")
        if not isinstance(self.refresh_guard, bool):
            raise ValueError("refresh_guard must be True or False, got "
                             f"{self.refresh_guard!r}")
        if self.refresh_guard and k == 1:
            raise ValueError("refresh_guard=True needs refresh_every > 1 (with "
                             "refresh_every = 1 every step refreshes)")
        check_choice(self.gpu_solve, "gpu_solve", GPU_SOLVES)
        check_choice(self.fallback, "fallback", FALLBACKS)

    def replace(self, **changes: Any) -> KWNGConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The names of the hyperparameters."""
        return tuple(f.name for f in dataclasses.fields(cls))


#: the settings fixed when a preconditioner is built (:func:`live_changes`)
FIXED_FIELDS = ("mode", "eps", "eps_schedule")


def live_changes(old: KWNGConfig, new: Any) -> list[str]:
    """The fields in which ``new`` differs from ``old``, the configuration of a live
    preconditioner; refuses a ``new`` that is not a :class:`KWNGConfig` or that
    changes one of :data:`FIXED_FIELDS` (the path and the ε rule's state depend on
    them)."""
    if not isinstance(new, KWNGConfig):
        raise ValueError("config must be a kwng.KWNGConfig (e.g. "
                         f"precond.config.replace(...)), got {type(new).__name__}")
    changed = [k for k in KWNGConfig.fields() if getattr(old, k) != getattr(new, k)]
    fixed = [k for k in changed if k in FIXED_FIELDS]
    if fixed:
        raise ValueError(
            f"{', '.join(fixed)} cannot change on a live preconditioner (the path and "
            "the ε rule's state depend on them): build a new KWNGPreconditioner "
            "(load_state_dict carries the counters over)")
    return changed


def config_with(config: KWNGConfig | None,
                hyperparameters: dict[str, Any]) -> KWNGConfig:
    """``config`` (default :class:`KWNGConfig`) with the keyword ``hyperparameters``
    of a preconditioner's constructor applied; names a stray or unknown keyword."""
    if "optimizer" in hyperparameters:
        raise ValueError("optimizer= is no longer taken: pass lr= (a number, or a "
                         "callable such as lambda: optimizer.param_groups[0]['lr'])")
    unknown = set(hyperparameters) - set(KWNGConfig.fields())
    if unknown:
        raise ValueError(f"unknown hyperparameter(s) {sorted(unknown)}; accepted: "
                         f"{', '.join(KWNGConfig.fields())}")
    if config is not None and not isinstance(config, KWNGConfig):
        raise ValueError("config must be a kwng.KWNGConfig or None, got "
                         f"{type(config).__name__}")
    return (config or KWNGConfig()).replace(**hyperparameters)
