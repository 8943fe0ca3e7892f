"""The CIFAR study's methods and run settings (book chapter :ref:`experiments-cifar`).

The method table (:data:`METHODS`), the plans' method lists, the step-size grid, the
authors' ε (converted by :func:`kwng.precond_config.eps_from_authors`), the
configuration of one run (:class:`RunConfig`) and the construction of each method's
model, optimizer and preconditioner. Every method takes its step through one protocol,
:class:`MethodStep` (``step(loss, outputs, hidden=..., batch=...)``): one adapter per
family (plain ``torch.optim`` step, KFAC/EKFAC, KWNG), built once by :func:`make_step`;
the training loop and ``cifar timing`` call it and nothing else.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..data import DATASETS, NUM_CLASSES

CONDITIONINGS = ("well", "ill")
LR_GRID = (10.0, 1.0, 0.1, 0.01, 0.001, 0.0001)
CONDITION_NUMBER = 1e7
#: every method's update is clipped to this norm
CLIP_NORM = 1.0
BATCH_SIZE = 128

# ε of the authors' code (configs/cifar10_KWNG.yml and kwng.py of MichaelArbel/KWNG): ε0
# and its bounds
EPS_AUTHORS = 1e-5
EPS_BOUNDS_AUTHORS = (1e-10, 1e5)


# method -> settings. "lr_from": the method whose selected step size it uses.
# "estimator_input": the KWNG samples, "scaled" = U h (the network's outputs, as the
# authors' code), "logits" = h (before U, as the paper's text). "eps_convention":
# "authors" (kwng.precond_config.eps_from_authors) or "ours" (ε0 = 1e-5).
_KWNG = {"precond": "kwng", "num_basis": 5, "damping": "T_tilde", "kernel": "gaussian",
         "diagonal_only": False, "estimator_input": "scaled",
         "eps_convention": "authors"}
# the KWNG of the earlier 6-epoch study: samples before U, ε0 = 1e-5 in our convention
# (no "eps_convention" key: "ours" is the default, and the committed records predate it)
_KWNG6 = {k: v for k, v in {**_KWNG, "estimator_input": "logits"}.items()
          if k != "eps_convention"}
_SGD = {"optimizer": "sgd"}
#: the training methods, name -> settings (keys explained above)
METHODS: dict[str, dict[str, Any]] = {
    # the claim suite
    "sgd": {**_SGD},
    "sgd_momentum": {**_SGD, "momentum": 0.9},
    "adam": {"optimizer": "adam"},
    "kfac": {**_SGD, "precond": "kfac"},
    "kwng": {**_SGD, **_KWNG},
    "kwng_samples_before_U": {**_SGD, **_KWNG, "estimator_input": "logits"},
    "diag_Ttilde": {**_SGD, **_KWNG, "diagonal_only": True},
    "kwng_lm_same_batch": {**_SGD, **_KWNG, "lm_rule": "same_batch", "lr_from": "kwng"},
    # methods of the earlier 6-epoch study only (their records carry their own
    # "method_spec")
    "sgd_momentum_wd": {**_SGD, "momentum": 0.9, "weight_decay": 5e-4},
    "ekfac": {**_SGD, "precond": "ekfac"},
    "kwng_m20": {**_SGD, **_KWNG6, "num_basis": 20, "lr_from": "kwng"},
    "kwng_momentum": {**_SGD, "momentum": 0.9, **_KWNG6},
    "kwng_bigbatch": {**_SGD, **_KWNG6, "batch_size": 512, "lr_from": "kwng"},
    "kwng_damping_identity": {**_SGD, **_KWNG6, "damping": "identity",
                              "lr_from": "kwng"},
    "kwng_damping_T": {**_SGD, **_KWNG6, "damping": "T", "lr_from": "kwng"},
    "diag_T": {**_SGD, **_KWNG6, "damping": "T", "diagonal_only": True,
               "lr_from": "kwng"},
    "kwng_rq": {**_SGD, **_KWNG6, "kernel": "rq", "lr_from": "kwng"},
    "kwng_scaled_logits": {**_SGD, **_KWNG6, "estimator_input": "scaled",
                           "lr_from": "kwng"},
    # the authors'-horizon study: the claim suite's KWNG with M = 20 (the paper's brown
    # line in Fig. 3)
    "kwng_basis20": {**_SGD, **_KWNG, "num_basis": 20, "lr_from": "kwng"},
}
#: the methods of the claim suite (issue 10), each in both conditionings
CLAIM_METHODS = ("sgd", "sgd_momentum", "adam", "kfac", "kwng", "kwng_samples_before_U",
                 "diag_Ttilde")
#: the methods of the claim suite run with a second seed
CLAIM_TWO_SEEDS = ("sgd", "kwng")
#: run after the suite when the preconditioner supports them (not required by
#: :func:`kwng.experiments.cifar_results.check_claim`)
CLAIM_ABLATIONS = ("kwng_lm_same_batch",)
#: the earlier study's method lists (its records were made with the definitions of that
#: time: "kwng" and "diag_Ttilde" then took their samples before U with ε0 = 1e-5 in our
#: convention)
SELECT_METHODS = ("sgd", "sgd_momentum", "sgd_momentum_wd", "adam", "kfac", "ekfac",
                  "kwng", "kwng_momentum")
MAIN_SEEDED = ("sgd", "adam", "kwng")
ONE_SEED_BOTH = ("sgd_momentum", "sgd_momentum_wd", "kfac", "ekfac", "kwng_m20",
                 "kwng_momentum", "kwng_bigbatch")
ABLATIONS = ("kwng_damping_identity", "kwng_damping_T", "diag_T", "diag_Ttilde",
             "kwng_rq", "kwng_scaled_logits")
#: the step-size schedules, "study6" ×0.1 after 50 % and 75 % of the epochs (the
#: earlier study), "claim" ×0.1 for the last ~15 % (one milestone, like the paper's
#: first), "constant" (selection runs)
SCHEDULES = ("claim", "constant", "study6", "authors")
#: The authors' milestones, from configs/cifar10_KWNG.yml of MichaelArbel/KWNG. The step
#: is multiplied by 0.1 after each of these epochs that comes before the last one
#: (schedule ``authors``).
AUTHORS_MILESTONES = (50, 100, 200, 300)
#: The precisions of the network's forward and backward, ``fp32`` (TF32 matrix
#: products on CUDA) or ``bf16`` (autocast). The KWNG algebra runs in float32 or
#: float64 in every case.
PRECISIONS = ("fp32", "bf16")
#: the diagnostics read from the KWNG step's ``info`` (when present), recorded as
#: epoch mean and last value
INFO_KEYS = ("eps", "reduction_ratio", "clipped", "fallback", "floored_columns",
             "floored_share")
MODELS = ("resnet18", "tiny")

RESULTS = Path("results") / "cifar"
SELECTION = RESULTS / "selection"
CLAIM = RESULTS / "claim"
CLAIM_SELECTION = CLAIM / "selection"
CHECKPOINTS = Path("checkpoints")
AUTHORS100 = RESULTS / "authors100"

#: The authors'-horizon study (plan ``authors100``), 100 epochs of the authors' schedule
#: (``authors``, ×0.1 after epoch 50), batch 128, clip 1, bf16 forward/backward in
#: channels_last, every capturable step replayed from a CUDA graph. Entries: (tier,
#: method, conditioning, step size, seed, epochs, extra settings). Tier 1 is the issue's
#: first list, tier 2 the Euclidean baselines at 10× their selected step, tier 3 a
#: second seed and an fp32 control of the first 30 epochs, tier 4 (not in the plan by
#: default: it did not fit the GPU budget of the session that ran the others) M = 20.
#: The Euclidean step sizes are the claim suite's selection
#: (results/cifar/claim/selection/selected.json: sgd 0.1, adam 1e-4, kfac 1).
AUTHORS100_RUNS: tuple[tuple[int, str, str, float, int, int, dict], ...] = (
    (1, "kwng", "ill", 10.0, 0, 100, {}),
    (1, "kwng", "well", 10.0, 0, 100, {}),
    (1, "kwng", "ill", 1.0, 0, 100, {}),
    (1, "diag_Ttilde", "ill", 10.0, 0, 100, {}),
    (1, "kfac", "ill", 1.0, 0, 100, {}),
    (1, "sgd", "ill", 0.1, 0, 100, {}),
    (1, "sgd", "well", 0.1, 0, 100, {}),
    (1, "adam", "ill", 1e-4, 0, 100, {}),
    (2, "kfac", "ill", 10.0, 0, 100, {}),
    (2, "sgd", "ill", 1.0, 0, 100, {}),
    (2, "adam", "ill", 1e-3, 0, 100, {}),
    (3, "kwng", "ill", 10.0, 1, 100, {}),
    (3, "kwng", "ill", 10.0, 0, 30, {"precision": "fp32", "channels_last": False}),
    (4, "kwng_basis20", "ill", 10.0, 0, 30, {}),
)
#: the settings every run of the plan ``authors100`` shares
AUTHORS100_SETTINGS = {"schedule": "authors", "precision": "bf16",
                       "channels_last": True, "capture": True}


class RunConfig(dict):
    """The configuration of one run (a plain dict with defaults and validation)."""

    DEFAULTS: dict[str, Any] = {
        "dataset": "cifar10", "conditioning": "ill", "method": "kwng", "seed": 0,
        "epochs": 6, "lr": "selected", "data_root": None, "source": "auto",
        "device": None, "out": str(RESULTS), "checkpoint_dir": str(CHECKPOINTS),
        "train_subset": None, "val_size": 0, "max_steps": None, "model": "resnet18",
        "batch_size": None, "eval_batch_size": 1000, "stop_after_epoch": None,
        "deadline": None, "selection_file": None, "download": False,
        "schedule": "claim", "capture": False, "precision": "fp32",
        "channels_last": False,
    }
    _CHOICES = (("dataset", DATASETS), ("conditioning", CONDITIONINGS),
                ("method", tuple(METHODS)), ("schedule", SCHEDULES), ("model", MODELS),
                ("precision", PRECISIONS))

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(self.DEFAULTS)
        if unknown:
            raise ValueError(f"unknown run settings {sorted(unknown)}; "
                             f"accepted: {sorted(self.DEFAULTS)}")
        super().__init__({**self.DEFAULTS, **kwargs})
        for k, choices in self._CHOICES:
            if self[k] not in choices:
                raise ValueError(f"{k} must be one of {choices}, got {self[k]!r}")
        for k, lo in (("seed", 0), ("epochs", 1), ("eval_batch_size", 1),
                      ("val_size", 0)):
            if not isinstance(self[k], int) or self[k] < lo:
                raise ValueError(f"{k} must be an integer >= {lo}, got {self[k]!r}")
        for k in ("train_subset", "max_steps", "batch_size", "stop_after_epoch"):
            if self[k] is not None and (not isinstance(self[k], int) or self[k] < 1):
                raise ValueError(f"{k} must be None or an integer >= 1, "
                                 f"got {self[k]!r}")
        for k in ("capture", "channels_last"):
            if not isinstance(self[k], bool):
                raise ValueError(f"{k} must be True or False, got {self[k]!r}")
        if self["lr"] != "selected":
            lr = float(self["lr"])
            if not (math.isfinite(lr) and lr > 0):
                raise ValueError(f"lr must be a positive number or 'selected', "
                                 f"got {self['lr']!r}")
            self["lr"] = lr

    @property
    def spec(self) -> dict[str, Any]:
        return METHODS[self["method"]]

    @property
    def batch(self) -> int:
        return int(self["batch_size"] or self.spec.get("batch_size", BATCH_SIZE))


def milestones_for(epochs: int, schedule: str) -> list[int]:
    """Epochs after which the step size is multiplied by 0.1: ``claim`` — one
    milestone so that the last ``max(1, round(0.15 E))`` epochs run at 0.1× (for
    ``E ≥ 2``); ``study6`` — after ``round(0.5 E)`` and ``round(0.75 E)`` epochs;
    ``constant`` — none."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be an integer >= 1, got {epochs!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "constant" or epochs == 1:
        return []
    if schedule == "authors":
        return [m for m in AUTHORS_MILESTONES if m < epochs]
    if schedule == "claim":
        return [epochs - max(1, round(0.15 * epochs))]
    half, three_quarters = max(1, round(0.5 * epochs)), max(1, round(0.75 * epochs))
    return sorted({half, three_quarters} - {epochs})


def movement_budget(lr: float, epochs: int, schedule: str, steps_per_epoch: int = 391,
                    gamma: float = 0.1) -> list[float]:
    """Per epoch, the largest distance the parameters can move under a schedule whose
    every update is clipped to norm :data:`CLIP_NORM`: ``lr_e × steps_per_epoch`` with
    ``lr_e`` the step of epoch ``e`` (``lr`` times ``gamma`` per milestone passed,
    :func:`milestones_for`). A KWNG step is clipped on almost every step, so for it the
    budget is nearly the distance travelled."""
    if not (isinstance(lr, (int, float)) and not isinstance(lr, bool)
            and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) \
            or steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be an integer >= 1, "
                         f"got {steps_per_epoch!r}")
    marks = milestones_for(epochs, schedule)
    return [CLIP_NORM * lr * gamma ** sum(e >= m for m in marks) * steps_per_epoch
            for e in range(epochs)]


# ------------------------------------------------------------------------ construction
def device_for(name: str | None) -> torch.device:
    """``name``, or CUDA when available, else CPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_model(cfg: RunConfig) -> nn.Module:
    """``z ↦ U h_θ(z)`` (:class:`kwng.nets.ConditionedNetwork`): ``U`` inside the
    network (the identity for ``well``)."""
    from ..nets import ConditionedNetwork, DiagonalConditioning, resnet18, tiny_cnn

    k = NUM_CLASSES[cfg["dataset"]]
    body = resnet18(k) if cfg["model"] == "resnet18" else tiny_cnn(k)
    cond = (None if cfg["conditioning"] == "well"
            else DiagonalConditioning(k, CONDITION_NUMBER))
    return ConditionedNetwork(body, cond)


def build_optimizer(cfg: RunConfig, model: nn.Module,
                    lr: float) -> torch.optim.Optimizer:
    """The method's ``torch.optim`` optimizer (SGD with its momentum and weight decay,
    or Adam)."""
    spec = cfg.spec
    if spec["optimizer"] == "adam":
        # capturable on CUDA (the step counter on the device) in eager runs too, so that
        # an eager and a graph-captured run compute the same thing
        cuda = next(model.parameters()).device.type == "cuda"
        return torch.optim.Adam(model.parameters(), lr=lr, capturable=cuda)
    return torch.optim.SGD(model.parameters(), lr=lr,
                           momentum=spec.get("momentum", 0.0),
                           weight_decay=spec.get("weight_decay", 0.0))


def _kwng_preconditioner(cfg: RunConfig, model: nn.Module, optimizer):
    from ..lm import LMSchedule
    from ..nets import ConditionedNetwork
    from ..precond import KWNGPreconditioner
    from ..precond_config import eps_from_authors

    spec = cfg.spec
    eps, bounds = 1e-5, {}
    if spec.get("eps_convention", "ours") == "authors":
        n = cfg.batch
        eps = eps_from_authors(EPS_AUTHORS, n)
        bounds = {"eps_min": eps_from_authors(EPS_BOUNDS_AUTHORS[0], n),
                  "eps_max": eps_from_authors(EPS_BOUNDS_AUTHORS[1], n)}
    schedule = LMSchedule(interval=5, omega=0.85, low=0.25, high=0.75,
                          rule=spec.get("lm_rule", "authors"), **bounds)
    # the fast path replicates the forward of the module the loop calls through
    # __call__: the body h (ConditionedNetwork.forward_both calls it; U·h is then pulled
    # back to it, U has no parameters)
    net = model.body if isinstance(model, ConditionedNetwork) else model
    return KWNGPreconditioner(
        net, lr=lambda: optimizer.param_groups[0]["lr"], num_basis=spec["num_basis"],
        eps=eps, lam=0.0, kernel=spec["kernel"], bandwidth="mean_sq", sigma0=1.0,
        damping=spec["damping"], eps_schedule=schedule, clip_norm=CLIP_NORM,
        mode="fast", diagonal_only=spec["diagonal_only"])


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
    #: (:class:`~kwng.experiments.cifar_capture.StepRunner`)
    capturable = True

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def __repr__(self) -> str:
        return f"{type(self).__name__}(optimizer={type(self.optimizer).__name__})"

    def direction(self, loss: torch.Tensor, outputs: torch.Tensor,
                  hidden: torch.Tensor | None, batch: tuple | None) -> dict:
        from ..baselines import clip_grad_norm

        loss.backward()
        clip_grad_norm(self.model.parameters(), CLIP_NORM)
        return {}

    def step(self, loss: torch.Tensor, outputs: torch.Tensor, *,
             hidden: torch.Tensor | None = None, batch: tuple | None = None) -> dict:
        info = self.direction(loss, outputs, hidden, batch)
        self.optimizer.step()
        return info

    def track(self, info: dict, stats) -> None:
        """Accumulate the step's diagnostics ``info`` for the epoch's record."""

    def epoch_fields(self, rows: list[dict]) -> dict:
        """Fields added to the epoch's row (``rows``: the rows recorded so far)."""
        return {}


class KFACStep(MethodStep):
    """KFAC or EKFAC (:class:`kwng.baselines.KFACPreconditioner`): needs ``batch``.
    Not capturable (:data:`kwng.experiments.cifar_capture.NOT_CAPTURABLE` says why)."""

    capturable = False

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 precond) -> None:
        super().__init__(model, optimizer)
        self.precond, self._fallbacks = precond, 0

    def direction(self, loss, outputs, hidden, batch) -> dict:
        if batch is None:
            raise ValueError("batch must be the mini-batch (z, y) for KFAC/EKFAC")
        return self.precond.step(loss, outputs, inputs=batch[0])

    def track(self, info: dict, stats) -> None:
        self._fallbacks += info["fallback"]

    def epoch_fields(self, rows: list[dict]) -> dict:
        prev = rows[-1]["fallbacks"] if rows else 0
        out, self._fallbacks = {"fallbacks": prev + int(self._fallbacks)}, 0
        return out


class KWNGStep(MethodStep):
    """KWNG (:class:`kwng.precond.KWNGPreconditioner`) on the samples ``U h``
    (``samples="scaled"``) or ``h`` (``"logits"``). With the ε rule ``"same_batch"`` the
    loss of the same mini-batch after the step (no grad, BatchNorm running statistics
    restored) goes to the preconditioner: this needs ``batch``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, precond,
                 samples: str = "scaled") -> None:
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
            from ..baselines import bn_state, restore_bn_state

            if batch is None:
                raise ValueError("batch must be the mini-batch (z, y) for the ε rule "
                                 "'same_batch'")
            saved = bn_state(self.model)
            with torch.no_grad():
                loss_after = F.cross_entropy(self.model(batch[0]), batch[1])
            restore_bn_state(self.model, saved)
            self.precond.observe_loss_after_step(loss_after)
        return info

    def track(self, info: dict, stats) -> None:
        stats.add_info(info)

    def epoch_fields(self, rows: list[dict]) -> dict:
        c = self.precond.counters()
        return {"eps": self.precond.eps, "fallbacks": c["fallbacks"],
                "clipped": c["clipped"], "ill_conditioned": c["ill_conditioned"],
                "damping_floored": c["damping_floored"]}


def make_step(cfg: RunConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
              device: torch.device) -> MethodStep:
    """The :class:`MethodStep` of ``cfg``'s method (the one place that dispatches on the
    method's family)."""
    kind = cfg.spec.get("precond")
    if kind is None:
        return MethodStep(model, optimizer)
    if kind in ("kfac", "ekfac"):
        from ..baselines import KFACPreconditioner

        # U is inside the model (ConditionedNetwork): the Fisher's predictive logits are
        # the outputs
        pc = KFACPreconditioner(model, kind=kind, damping=1e-3, update_freq=100,
                                diag_freq=1, output_fn=None, clip_norm=CLIP_NORM,
                                device=device)
        return KFACStep(model, optimizer, pc)
    pc = _kwng_preconditioner(cfg, model, optimizer)
    return KWNGStep(model, optimizer, pc, cfg.spec["estimator_input"])
