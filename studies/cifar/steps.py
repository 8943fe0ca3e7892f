"""What a CIFAR run builds from its configuration: the model (:func:`build_model`),
the optimizer (:func:`build_optimizer`) and the step protocol. Every method takes its
step through :class:`MethodStep` (``step(loss, outputs, hidden=..., batch=...)``), one
adapter per family (a plain ``torch.optim`` step, KFAC/EKFAC, KWNG), built once by
:func:`make_step`; the training loop and ``cifar timing`` call it and nothing else.
:class:`StepRunner` runs a whole training step (forward, update, the epoch's
device-side sums) eagerly or, on CUDA with ``capture=True``, replayed from a CUDA graph
recorded once per batch shape and step size."""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kwng.engine.capture import (
    amortized_replay,
    record_graph,
    warmup_kind,
    warmup_steps,
)
from kwng.engine.config import eps_from_authors
from kwng.engine.lm import LMSchedule
from studies.cifar.config import RunConfig
from studies.cifar.data import NUM_CLASSES
from studies.cifar.methods import (
    CLIP_NORM,
    CONDITION_NUMBER,
    EPS_AUTHORS,
    EPS_BOUNDS_AUTHORS,
    METHODS,
    OPTIMIZERS,
    drawn_in,
)
from studies.cifar.metrics import UpdateShare, full_precision
from studies.cifar.nets import (
    NETWORKS,
    ConditionedNetwork,
    DiagonalConditioning,
)

log = logging.getLogger(__name__)


def build_model(cfg: RunConfig) -> nn.Module:
    """``z ↦ U h_θ(z)`` (:class:`studies.cifar.nets.ConditionedNetwork`): ``U``
    inside the network (the identity for ``well``), the parameters drawn in
    ``cfg.precision`` (:func:`~studies.cifar.methods.drawn_in`)."""
    k = NUM_CLASSES[cfg.dataset]
    with drawn_in(cfg.precision):
        body = NETWORKS[cfg.model](k)
    cond = (None if cfg.conditioning == "well"
            else DiagonalConditioning(k, CONDITION_NUMBER))
    return ConditionedNetwork(body, cond)


def build_optimizer(cfg: RunConfig, model: nn.Module,
                    lr: float) -> torch.optim.Optimizer:
    """The method's ``torch.optim`` optimizer, from
    :data:`~studies.cifar.methods.OPTIMIZERS`."""
    return OPTIMIZERS[cfg.spec["optimizer"]](model, lr, cfg.spec)


def _kwng_preconditioner(cfg: RunConfig, model: nn.Module, optimizer):
    """KWNG on one process, or :class:`kwng.engine.distributed.DistributedKWNG` when
    ``world_size > 1`` (the authors' ε, converted with the global batch)."""
    from kwng.engine.precond import KWNGPreconditioner

    spec, n = cfg.spec, cfg.batch * cfg.world_size
    eps = eps_from_authors(EPS_AUTHORS, n)
    bounds = {"eps_min": eps_from_authors(EPS_BOUNDS_AUTHORS[0], n),
              "eps_max": eps_from_authors(EPS_BOUNDS_AUTHORS[1], n)}
    # the rest of the ε rule, the kernel's bandwidth rule and λ = 0 are KWNGConfig's
    # defaults (App. D.2's values)
    schedule = LMSchedule(rule=spec.get("lm_rule", "authors"), **bounds)
    # the fast path replicates the forward of the module the loop calls through
    # __call__: the body h (ConditionedNetwork.forward_both calls it; U·h is then pulled
    # back to it, U has no parameters)
    net = model.body if isinstance(model, ConditionedNetwork) else model
    settings = dict(lr=lambda: optimizer.param_groups[0]["lr"],
                    num_basis=spec["num_basis"], eps=eps, kernel=spec["kernel"],
                    damping=spec["damping"], eps_schedule=schedule, clip_norm=CLIP_NORM,
                    diagonal_only=spec["diagonal_only"],
                    refresh_every=spec.get("refresh_every", 1),
                    refresh_guard=spec.get("refresh_guard", False),
                    fallback=spec.get("fallback", "gradient"))
    if cfg.world_size == 1:
        return KWNGPreconditioner(net, **settings)
    from kwng.engine.distributed import DistributedKWNG

    return DistributedKWNG(net, batch_sizes=cfg.batch, **settings)


# ------------------------------------------------------------------- the step protocol
class MethodStep:
    """One training step's update for a method, given the loss of the mini-batch.

    ``step(loss, outputs, hidden=h, batch=(z, y))`` computes the direction (clipped to
    :data:`CLIP_NORM`), calls ``optimizer.step()`` and returns the step's diagnostics.
    ``outputs`` are the network's outputs ``U h``, ``hidden`` the body's outputs ``h``,
    ``batch`` the mini-batch. This base class is the plain ``torch.optim`` step (SGD,
    SGD with momentum, Adam).
    """

    precond = None
    #: whether the step can be recorded in a CUDA graph
    #: (:class:`StepRunner`)
    capturable = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def __repr__(self) -> str:
        return f"{type(self).__name__}(optimizer={type(self.optimizer).__name__})"

    def direction(self, loss: torch.Tensor, outputs: torch.Tensor,
                  hidden: torch.Tensor | None, batch: tuple | None) -> dict:
        from studies.cifar.baselines import clip_grad_norm

        loss.backward()
        clip_grad_norm(self.model.parameters(), CLIP_NORM)
        return {}

    def step(
        self,
        loss: torch.Tensor,
        outputs: torch.Tensor,
        *,
        hidden: torch.Tensor | None = None,
        batch: tuple | None = None,
    ) -> dict:
        info = self.direction(loss, outputs, hidden, batch)
        self.optimizer.step()
        return info

    def track(self, info: dict, stats) -> None:
        """Accumulate the step's diagnostics ``info`` for the epoch's record."""

    def epoch_fields(self, rows: list[dict]) -> dict:
        """Fields added to the epoch's row (``rows``: the rows recorded so far)."""
        return {}


class KFACStep(MethodStep):
    """KFAC or EKFAC (:class:`studies.cifar.baselines.KFACPreconditioner`):
    needs ``batch``. Capturable when the preconditioner has a refresh schedule
    (``precond.cache``: ``update_freq > 1``; its refresh steps run eagerly). The
    fallbacks are summed on the device, read once an epoch."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, precond
    ) -> None:
        super().__init__(model, optimizer)
        self.precond, self.capturable = precond, precond.cache is not None
        self._fallbacks = torch.zeros((), dtype=torch.int64, device=precond.device)

    def direction(self, loss, outputs, hidden, batch) -> dict:
        if batch is None:
            raise ValueError("batch must be the mini-batch (z, y) for KFAC/EKFAC")
        return self.precond.step(loss, outputs, inputs=batch[0])

    def track(self, info: dict, stats) -> None:
        self._fallbacks.add_(info["fallback"])  # in place: a replay repeats it

    def epoch_fields(self, rows: list[dict]) -> dict:
        prev, n = rows[-1]["fallbacks"] if rows else 0, int(self._fallbacks)
        if n:
            log.warning("%s: the direction was non-finite on %d steps of the epoch: "
                        "they took the plain gradient", self.precond.kind, n)
        self._fallbacks.zero_()
        return {"fallbacks": prev + n}


class KWNGStep(MethodStep):
    """KWNG (:class:`kwng.engine.precond.KWNGPreconditioner`) on the samples ``U h``
    (``samples="scaled"``) or ``h`` (``"logits"``). With the ε rule ``"same_batch"`` the
    loss of the same mini-batch after the step (no grad, BatchNorm running statistics
    restored) goes to the preconditioner: this needs ``batch``."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        precond,
        samples: str = "scaled",
    ) -> None:
        if samples not in ("scaled", "logits"):
            raise ValueError(f"samples must be 'scaled' or 'logits', got {samples!r}")
        super().__init__(model, optimizer)
        self.precond, self.samples = precond, samples

    def direction(self, loss, outputs, hidden, batch) -> dict:
        if self.samples == "logits" and hidden is None:
            raise ValueError("hidden must be the body's outputs h for samples='logits'")
        return self.precond.step(loss, outputs if self.samples == "scaled" else hidden)

    def step(self, loss, outputs, *, hidden=None, batch=None) -> dict:
        info = super().step(loss, outputs, hidden=hidden, batch=batch)
        schedule = self.precond.config.eps_schedule
        if schedule is not None and schedule.rule == "same_batch":
            from studies.cifar.baselines import bn_state, restore_bn_state

            if batch is None:
                raise ValueError(
                    "batch must be the mini-batch (z, y) for the ε rule 'same_batch'"
                )
            saved = bn_state(self.model)
            with torch.no_grad():
                loss_after = F.cross_entropy(self.model(batch[0]), batch[1])
            restore_bn_state(self.model, saved)
            self.precond.observe_loss_after_step(loss_after)
        return info

    def track(self, info: dict, stats) -> None:
        stats.add_info(info)

    def epoch_fields(self, rows: list[dict]) -> dict:
        c, cache = self.precond.counters(), self.precond.cache
        guard = {"guard_refreshes": cache.guard_refreshes} if cache.guard else {}
        return {"eps": self.precond.eps, "fallbacks": c["fallbacks"],
                "clipped": c["clipped"], "ill_conditioned": c["ill_conditioned"],
                "damping_floored": c["damping_floored"], **guard}


def make_step(
    cfg: RunConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
) -> MethodStep:
    """The :class:`MethodStep` of ``cfg``'s method (the one place that dispatches on the
    method's family)."""
    kind = cfg.spec.get("precond")
    if kind is None:
        step = MethodStep(model, optimizer)
        step.capturable = METHODS[cfg.method].not_capturable is None
        return step
    if kind in ("kfac", "ekfac"):
        from studies.cifar.baselines import KFACPreconditioner

        # U is inside the model (ConditionedNetwork): the Fisher's predictive logits are
        # the outputs
        pc = KFACPreconditioner(model, kind=kind, damping=1e-3, update_freq=100,
                                diag_freq=cfg.spec.get("diag_freq", 1), output_fn=None,
                                clip_norm=CLIP_NORM, device=device)
        return KFACStep(model, optimizer, pc)
    pc = _kwng_preconditioner(cfg, model, optimizer)
    return KWNGStep(model, optimizer, pc, cfg.spec["estimator_input"])


# ------------------------------------------------------------------------ one step
def autocast_for(device: torch.device, precision: str):
    """The forward's autocast context: bf16 without a weight-cast cache (a CUDA graph
    would replay freed memory), or none for fp32."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)
    return contextlib.nullcontext()


def train_step(
    method: MethodStep,
    model: nn.Module,
    z: torch.Tensor,
    yb: torch.Tensor,
    share: UpdateShare | None = None,
    precision: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor, dict, torch.Tensor | None]:
    """One training step of any method: forward (in ``precision``), then
    ``method.step`` (direction clipped to
    :data:`~studies.cifar.methods.CLIP_NORM`, ``optimizer.step()``). Returns
    ``(loss, outputs, info, last-layer share)``; the share is measured around the
    whole update (the direction leaves the parameters unchanged). Never waits for the
    device, so a CUDA graph can record it."""
    method.optimizer.zero_grad(set_to_none=True)
    with autocast_for(z.device, precision):
        h, outputs = model.forward_both(z)
        loss = F.cross_entropy(full_precision(outputs), yb)
    if share is not None:
        share.before()
    info = method.step(loss, outputs, hidden=h, batch=(z, yb))
    frac = share.after() if share is not None else None
    return loss, outputs, info, frac


# ------------------------------------------------------------ replayed from a graph
class StepRunner:
    """Calls ``step_fn(z, y)`` for each batch, eagerly or replayed from a CUDA graph.

    ``lr_fn`` returns the current step size (a change records the graph again);
    ``capture`` is honoured only on a CUDA ``device`` (elsewhere the steps run eagerly,
    with a warning, and ``capture`` reads ``False``). The attributes ``captures``,
    ``replays`` and ``eager`` count the recordings, the replayed steps and the eager
    ones. ``cache``: the amortized preconditioner's system cache, or ``None``.

    The step function must leave every piece of state that outlives a step in tensors
    updated in place (the Levenberg–Marquardt rule of :mod:`kwng.engine.lm`, the
    preconditioner's counters, the sums of
    :class:`~studies.cifar.metrics.EpochStats`) and must never wait for the
    device: a replay runs the recorded kernels only, no Python. The life of one batch
    shape, at one step size: the first ``warmup`` steps run eagerly on a side stream,
    on the static input buffers the graph will read (optimizer state, cuDNN's choices
    and the fast path's buffers come into existence); the next step is recorded
    (:func:`kwng.engine.capture.record_graph`) and replayed (recording runs nothing, so
    the replay is that step); every later step copies its batch into the buffers and
    replays. A step size is a constant of the recorded kernels (``torch.optim`` and the
    ε rule read ``lr`` on the host), so a milestone records the graph again; each batch
    shape has its own graph. With an amortized ``cache`` (every ``k > 1`` steps), each
    step takes the kind the cache's host-side counter names
    (:func:`kwng.engine.capture.amortized_replay`): KWNG's two programs are both
    recorded (each warmed up first, :func:`~kwng.engine.capture.warmup_kind`); (E)KFAC's
    refresh step (``cache.refresh_capturable`` false) runs eagerly on the static
    inputs, outside any graph, and counts as eager, its other steps are replayed (EKFAC
    with ``diag_freq > 1``: two graphs, with and without the scalings' re-estimate)."""

    def __init__(self, step_fn: Callable[[torch.Tensor, torch.Tensor], None],
                 device: torch.device, capture: bool, lr_fn: Callable[[], float],
                 warmup: int = 3, cache=None) -> None:
        if not callable(step_fn) or not callable(lr_fn):
            raise ValueError("step_fn and lr_fn must be callables")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup must be an integer >= 1, got {warmup!r}")
        self.step_fn, self.lr_fn, self.warmup = step_fn, lr_fn, warmup
        self.cache = cache if cache is not None and cache.every > 1 else None
        if self.cache is not None:
            self.warmup = max(warmup, warmup_steps(self.cache))  # one of each kind
        self.device = torch.device(device)
        self.capture = bool(capture) and self.device.type == "cuda"
        if capture and not self.capture:
            log.warning("capture needs a CUDA device: the steps run eagerly on %s",
                        self.device)
        self._static: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._warm: dict[tuple, int] = {}
        self._graphs: dict[tuple, tuple[float, Callable[[], None]]] = {}
        self.captures = self.replays = self.eager = 0

    def __repr__(self) -> str:
        return (f"StepRunner(capture={self.capture}, captures={self.captures}, "
                f"replays={self.replays}, eager={self.eager})")

    def __call__(self, z: torch.Tensor, y: torch.Tensor) -> None:
        if not self.capture:
            self.step_fn(z, y)
            self.eager += 1
            return
        shape = (tuple(z.shape), z.dtype, tuple(y.shape))
        if shape not in self._static:
            fmt = (torch.channels_last if z.dim() == 4 and not z.is_contiguous()
                   and z.is_contiguous(memory_format=torch.channels_last)
                   else torch.contiguous_format)
            self._static[shape] = (torch.empty_like(z, memory_format=fmt),
                                   torch.empty_like(y))
            self._warm[shape] = 0
        sz, sy = self._static[shape]
        sz.copy_(z)
        sy.copy_(y)
        lr = float(self.lr_fn())
        held = self._graphs.get(shape)
        if held is not None and held[0] == lr:
            self._replay(held[1])
            return
        if self._warm[shape] < self.warmup:  # eager warm-up on a side stream
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), warmup_kind(self.cache, self._warm[shape]):
                self.step_fn(sz, sy)
            torch.cuda.current_stream(self.device).wait_stream(side)
            self._warm[shape] += 1
            self.eager += 1
            return
        if held is not None:  # the step size changed: drop the old graph first
            del self._graphs[shape]
            del held
        torch.cuda.synchronize(self.device)
        if self.cache is not None:
            def record():
                return record_graph(lambda: self.step_fn(sz, sy))

            replay = amortized_replay(self.cache, record,
                                      eager=lambda: self.step_fn(sz, sy))
        else:
            replay = record_graph(lambda: self.step_fn(sz, sy)).replay
        self._graphs[shape] = (lr, replay)
        self.captures += 1
        log.info("recorded the training step in a CUDA graph (batch %s, lr %g)",
                 shape[0], lr)
        self._replay(replay)  # recording ran nothing: this is the step of this batch

    def _replay(self, replay: Callable[[], bool | None]) -> None:
        """Run ``replay``; count a replay, or an eager step when an amortized replay
        ran a refresh step eagerly (it returns ``False`` then)."""
        if replay() is False:
            self.eager += 1
        else:
            self.replays += 1
