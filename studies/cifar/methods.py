"""The CIFAR study's methods and their settings (book chapter :ref:`experiments-cifar`).

The method table (:data:`METHODS`, validated against :data:`OPTIMIZERS` and
:data:`PRECONDITIONERS` whenever a :class:`~studies.cifar.config.RunConfig` is
built), the plans' method lists, the step-size grid and schedules, the authors' ε
(converted by :func:`kwng.engine.config.eps_from_authors`) and the optimizers. Each
method's model, optimizer and step are built by :mod:`studies.cifar.steps`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from studies.cifar.modern import muon_adamw, shampoo, soap
from studies.kit import paths

CONDITIONINGS = ("well", "ill")
#: the step sizes the selection runs try, as in the paper
LR_GRID = (10.0, 1.0, 0.1, 0.01, 0.001, 0.0001)
#: ``max U / min U`` of the ill-conditioned network
#: (:class:`~studies.cifar.nets.DiagonalConditioning`)
CONDITION_NUMBER = 1e7
#: every method's update is clipped to this norm
CLIP_NORM = 1.0
BATCH_SIZE = 128

# ε of the authors' code (configs/cifar10_KWNG.yml and kwng.py of MichaelArbel/KWNG): ε0
# and its bounds
EPS_AUTHORS = 1e-5
EPS_BOUNDS_AUTHORS = (1e-10, 1e5)


@dataclass(frozen=True)
class Method:
    """One training method of the study, every fact about it in one record (no
    defaults: a record lacking a fact does not build).

    ``optimizer`` names an entry of :data:`OPTIMIZERS`; ``settings`` the rest of the
    method's spec (``precond`` one of :data:`PRECONDITIONERS`, ``momentum``, ...;
    ``lr_from``: the method whose selected step size it uses; ``estimator_input``: the
    KWNG samples, ``"scaled"`` = U h as the authors' code, ``"logits"`` = h as the
    paper's text; ``eps_convention``: ``"authors"``,
    :func:`kwng.engine.config.eps_from_authors`). ``color`` and ``style`` draw it in
    every figure, ``label`` names it in a legend, ``order`` places it in a figure;
    ``rel_cost`` is the cost of a step relative to SGD (H200, batch 128,
    results/cifar/timing/timing.json; it spreads a plan's runs over the GPUs when no
    timing file is given), ``timing_lr`` the step size of its timed runs (those of the
    plan ``authors100``), ``not_capturable`` why its step cannot be recorded in a CUDA
    graph (``None``: it can)."""

    optimizer: str
    settings: dict[str, Any]
    color: str
    style: str
    label: str
    order: int
    rel_cost: float
    timing_lr: float
    not_capturable: str | None

    @property
    def spec(self) -> dict[str, Any]:
        """The settings a run records as its ``method_spec`` (part of its identity)."""
        return {"optimizer": self.optimizer, **self.settings}


_KWNG = {"precond": "kwng", "num_basis": 5, "damping": "T_tilde", "kernel": "gaussian",
         "diagonal_only": False, "estimator_input": "scaled",
         "eps_convention": "authors"}
# KFAC and EKFAC are capturable: their steps between refreshes apply the cached factors
# (EKFAC: the eigenbasis, with scalings re-estimated from the step's own forward) with
# plain torch ops and are replayed, their refresh steps (every 100) run eagerly


def _m(opt: str, settings: dict, color: str, style: str, label: str, order: int,
       cost: float, timing_lr: float) -> Method:
    return Method(opt, settings, color, style, label, order, cost, timing_lr, None)


_T = {"lr_from": "kwng"}
# pytorch-optimizer's SOAP and Shampoo count their steps on the host and branch on the
# count (SOAP: its first step, the refresh every 10 steps, the bias correction)
_HOST_STEPS = ("pytorch-optimizer counts the steps in a Python integer and branches "
               "on it, which a CUDA graph cannot replay")
#: the training methods, name -> :class:`Method`
METHODS: dict[str, Method] = {
    # the claim suite
    "sgd": _m("sgd", {}, "#1f77b4", "-", "SGD", 2, 1.0, 0.1),
    "sgd_momentum": _m("sgd", {"momentum": 0.9}, "#17becf", "--", "SGD + momentum", 5,
                       1.0, 0.1),
    "adam": _m("adam", {}, "#2ca02c", "-", "Adam", 3, 1.4, 1e-4),
    "kfac": _m("sgd", {"precond": "kfac"}, "#9467bd", "-", "KFAC", 4, 1.7, 1.0),
    "kwng": _m("sgd", {**_KWNG}, "#d62728", "-", "KWNG", 0, 5.4, 10.0),
    "kwng_samples_before_U": _m("sgd", {**_KWNG, "estimator_input": "logits"},
                                "#ff9896", "--", "KWNG, samples before U", 6, 5.4, 0.1),
    "diag_Ttilde": _m("sgd", {**_KWNG, "diagonal_only": True}, "#393b79", ":",
                      "diagonal T̃", 1, 5.4, 10.0),
    "kwng_lm_same_batch": _m("sgd", {**_KWNG, "lm_rule": "same_batch", **_T},
                             "#b15928", "-.", "KWNG, LM rule on the same batch", 7,
                             5.8, 0.1),
    # the Fig. 3 protocol's other baselines
    "sgd_momentum_wd": _m("sgd", {"momentum": 0.9, "weight_decay": 5e-4}, "#bcbd22",
                          ":", "SGD + momentum + wd", 8, 1.05, 0.1),
    "ekfac": _m("sgd", {"precond": "ekfac"}, "#ff7f0e", "--", "EKFAC", 9, 11.0, 0.1),
    # the authors'-horizon study: the claim suite's KWNG with M = 20 (the paper's brown
    # line in Fig. 3)
    "kwng_basis20": _m("sgd", {**_KWNG, "num_basis": 20, **_T}, "#5e3c99", "-",
                       "KWNG, M = 20", 18, 16.7, 10.0),
    # the Fig. 3 protocol's KWNG + momentum and ablations, on today's KWNG
    "kwng_mom": _m("sgd", {**_KWNG, "momentum": 0.9}, "#525252", "-",
                   "KWNG + momentum", 19, 5.4, 0.1),
    "kwng_D_identity": _m("sgd", {**_KWNG, "damping": "identity", **_T}, "#6baed6",
                          "-", "KWNG, D = 1", 20, 5.4, 0.1),
    "kwng_D_T": _m("sgd", {**_KWNG, "damping": "T", **_T}, "#31a354", "-",
                   "KWNG, D = ‖T‖", 21, 5.4, 0.1),
    "kwng_diag_T": _m("sgd", {**_KWNG, "damping": "T", "diagonal_only": True, **_T},
                      "#843c39", "-", "diagonal T", 22, 5.4, 0.1),
    "kwng_kernel_rq": _m("sgd", {**_KWNG, "kernel": "rq", **_T}, "#e6ab02", "-",
                         "KWNG, RQ kernel", 23, 5.4, 0.1),
    # the amortized step: the kernel system rebuilt every k steps
    "kwng_k5": _m("sgd", {**_KWNG, "refresh_every": 5}, "#b8860b", "--",
                  "KWNG, k = 5", 24, 2.8, 10.0),
    "kwng_k20": _m("sgd", {**_KWNG, "refresh_every": 20}, "#8c564b", "-.",
                   "KWNG, k = 20", 25, 2.3, 10.0),
    "kwng_k100": _m("sgd", {**_KWNG, "refresh_every": 100}, "#e7298a", "-",
                    "KWNG, k = 100", 26, 2.1, 10.0),
    "diag_k20": _m("sgd", {**_KWNG, "diagonal_only": True, "refresh_every": 20},
                   "#807dba", ":", "diagonal, k = 20", 27, 2.3, 10.0),
    # k = 100 with the refresh guard: also a refresh two steps after a rank-deficient
    # system or a fallback to g
    "kwng_k100_guard": _m("sgd", {**_KWNG, "refresh_every": 100, "refresh_guard": True},
                          "#fd8d3c", "-", "KWNG, k = 100, guarded", 29, 2.1, 10.0),
    # the same, and a direction that fails the descent test takes no step instead of
    # the Euclidean gradient (KWNGConfig.fallback="skip"): the traced k = 100 run's
    # first fallback, an SGD step at KWNG's step size, took the loss from 2.2 to 107
    "kwng_k100_skip": _m("sgd", {**_KWNG, "refresh_every": 100, "refresh_guard": True,
                                 "fallback": "skip"},
                         "#a63603", "-", "KWNG, k = 100, guarded, skip", 34, 2.1, 10.0),
    # EKFAC with its scalings re-estimated every 10 steps (the Fig. 3 protocol's
    # amendment: every step costs about 9 captured KFAC steps); the planning weight
    # assumes a tenth of that re-estimate per step
    "ekfac_s10": _m("sgd", {"precond": "ekfac", "diag_freq": 10}, "#d95f02", "--",
                    "EKFAC (scalings every 10 steps)", 28, 3.0, 0.1),
    # today's preconditioned optimizers (studies.cifar.modern), each at its library's
    # defaults but the step size; rel_cost is a planning guess until a GPU timing,
    # timing_lr the library's default step
    "muon": _m("muon", {}, "#e377c2", "-", "Muon", 30, 1.5, 1e-3),
    "soap": Method("soap", {}, "#7f7f7f", "-", "SOAP", 31, 3.0, 3e-3, _HOST_STEPS),
    "shampoo": Method("shampoo", {}, "#8c6d31", "-", "Shampoo", 32, 6.0, 1e-3,
                      _HOST_STEPS + "; the inverse roots are SVDs every step"),
    # the transformer default (the ViT study): Adam with decoupled weight decay 0.05
    "adamw": _m("adamw", {"weight_decay": 0.05}, "#98df8a", "--", "AdamW", 33, 1.4,
                1e-3),
}
#: the methods of the claim suite, each in both conditionings
CLAIM_METHODS = ("sgd", "sgd_momentum", "adam", "kfac", "kwng", "kwng_samples_before_U",
                 "diag_Ttilde")
#: the methods of the claim suite run with a second seed
CLAIM_TWO_SEEDS = ("sgd", "kwng")
#: run after the suite when the preconditioner supports them (not required by
#: :func:`studies.claim_suite.records.check_claim`)
CLAIM_ABLATIONS = ("kwng_lm_same_batch",)
#: every method of the claim suite, its ablation included (the order of its tables)
CLAIM_ALL = CLAIM_METHODS + CLAIM_ABLATIONS
#: the step-size schedules, "claim" ×0.1 for the last ~15 % (one milestone, like the
#: paper's first), "constant" (selection runs), "authors" (:data:`AUTHORS_MILESTONES`),
#: "half" (×0.1 after half the epochs: the authors' shape at a shorter horizon, the
#: ViT study's)
SCHEDULES = ("claim", "constant", "authors", "half")
#: The authors' milestones, from configs/cifar10_KWNG.yml of MichaelArbel/KWNG. The step
#: is multiplied by 0.1 after each of these epochs that comes before the last one
#: (schedule ``authors``).
AUTHORS_MILESTONES = (50, 100, 200, 300)
#: The precisions of the network's forward and backward, ``fp32`` (TF32 matrix
#: products on CUDA), ``bf16`` (autocast) or ``fp64`` (parameters and images in
#: float64: a reference whose numbers agree across CPUs to round-off, as the
#: reproduction fixture of ``tests/repro_tiny.py`` needs). The KWNG algebra runs in
#: float32 or float64 in every case.
PRECISIONS = ("fp32", "bf16", "fp64")
#: the dtype of the parameters and of the normalised images under each precision
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.float32, "fp64": torch.float64}
#: the precisions the timing studies compare (fp64 is a CPU reference, never timed)
TIMED_PRECISIONS = ("fp32", "bf16")


@contextlib.contextmanager
def drawn_in(precision: str) -> Iterator[None]:
    """Inside the block, new parameters are drawn in ``precision``'s dtype
    (:data:`PARAM_DTYPES`, through ``torch.set_default_dtype``): a float32 draw differs
    in its last bit between CPU code paths, a float64 draw by float64 round-off only."""
    if precision not in PARAM_DTYPES:
        raise ValueError(f"precision must be one of {tuple(PARAM_DTYPES)}, "
                         f"got {precision!r}")
    before = torch.get_default_dtype()
    torch.set_default_dtype(PARAM_DTYPES[precision])
    try:
        yield
    finally:
        torch.set_default_dtype(before)
#: the diagnostics read from the KWNG step's ``info`` (when present), recorded as
#: epoch mean and last value
INFO_KEYS = ("eps", "reduction_ratio", "clipped", "fallback", "floored_columns",
             "floored_share")


RESULTS = paths.RESULTS / "cifar"
SELECTION = RESULTS / "selection"
CLAIM = RESULTS / "claim"
CLAIM_SELECTION = CLAIM / "selection"
CHECKPOINTS = paths.CHECKPOINTS
AUTHORS100 = RESULTS / "authors100"



def check_method_spec(name: str, spec: dict[str, Any]) -> None:
    """Raise if the method ``name``'s settings name an optimizer or a preconditioner
    that the study does not build (with the accepted names)."""
    if spec.get("optimizer") not in OPTIMIZERS:
        raise ValueError(f"method {name!r}: optimizer must be one of "
                         f"{sorted(OPTIMIZERS)}, "
                         f"got {spec.get('optimizer')!r}")
    if spec.get("precond", None) not in (None, *PRECONDITIONERS):
        raise ValueError(f"method {name!r}: precond must be absent or one of "
                         f"{PRECONDITIONERS}, got {spec.get('precond')!r}")
    freq = spec.get("diag_freq", 1)
    if freq != 1 and (spec.get("precond") != "ekfac" or isinstance(freq, bool)
                      or not isinstance(freq, int) or freq < 1):
        raise ValueError(f"method {name!r}: diag_freq (EKFAC's steps between "
                         f"re-estimates of its scalings) must be an integer >= 1 and "
                         f"only EKFAC takes one, got {freq!r}")
    if spec.get("precond") == "kwng" and spec.get("eps_convention") != "authors":
        raise ValueError(f"method {name!r}: a KWNG method takes the authors' ε "
                         f"(eps_convention 'authors'), got "
                         f"{spec.get('eps_convention')!r}")


def milestones_for(epochs: int, schedule: str) -> list[int]:
    """Epochs after which the step size is multiplied by 0.1: ``claim`` — one
    milestone so that the last ``max(1, round(0.15 E))`` epochs run at 0.1× (for
    ``E ≥ 2``); ``authors`` — :data:`AUTHORS_MILESTONES` before the last epoch;
    ``half`` — one milestone after ``E // 2`` epochs; ``constant`` — none."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be an integer >= 1, got {epochs!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "constant" or epochs == 1:
        return []
    if schedule == "authors":
        return [m for m in AUTHORS_MILESTONES if m < epochs]
    if schedule == "half":
        return [epochs // 2]
    return [epochs - max(1, round(0.15 * epochs))]


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


def _sgd(model: nn.Module, lr: float, spec: dict) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr,
                           momentum=spec.get("momentum", 0.0),
                           weight_decay=spec.get("weight_decay", 0.0))


def _adam(model: nn.Module, lr: float, spec: dict) -> torch.optim.Optimizer:
    # capturable on CUDA (the step counter on the device) in eager runs too, so that an
    # eager and a graph-captured run compute the same thing
    cuda = next(model.parameters()).device.type == "cuda"
    return torch.optim.Adam(model.parameters(), lr=lr, capturable=cuda)


def _adamw(model: nn.Module, lr: float, spec: dict) -> torch.optim.Optimizer:
    # decoupled weight decay (each step multiplies the weights by 1 - lr * wd), on
    # every parameter, as Adam above capturable on CUDA
    cuda = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(model.parameters(), lr=lr,
                             weight_decay=spec["weight_decay"], capturable=cuda)


#: the optimizers a method's ``"optimizer"`` names: name -> ``(model, lr, spec) ->
#: torch.optim.Optimizer`` (Muon, SOAP and Shampoo: :mod:`studies.cifar.modern`)
OPTIMIZERS = {"sgd": _sgd, "adam": _adam, "adamw": _adamw, "muon": muon_adamw,
              "soap": soap, "shampoo": shampoo}
#: the preconditioners a method's ``"precond"`` names (absent: the optimizer alone)
PRECONDITIONERS = ("kfac", "ekfac", "kwng")
