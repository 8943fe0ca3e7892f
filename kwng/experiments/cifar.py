"""The CIFAR classification study (paper §4.2, App. E; book chapter :ref:`experiments-cifar`).

Two studies share this runner:

* the **claim suite** (plans ``claim_select`` and ``claim``, results under ``results/cifar/claim/``):
  the methods of :data:`CLAIM_METHODS` with the network ``z ↦ U h_θ(z)``
  (:class:`kwng.nets.ConditionedNetwork`, ``U`` inside the network as in the authors' code, so the
  KWNG samples are ``U h_θ(z)``; ``kwng_samples_before_U`` is the ablation on ``h_θ(z)``), the
  authors' ε convention (:func:`authors_eps`), step sizes chosen from :data:`LR_GRID` by 2-epoch
  runs scored on a validation split of the training set, and one schedule for every method:
  constant step, ×0.1 for the last ~15 % of the epochs (:func:`milestones_for`);
* the **earlier 6-epoch study** (plans ``select`` and ``main``, results under ``results/cifar/cifar10``),
  kept readable: its methods keep their definitions (samples before ``U``, our ε convention).

Commands (``python -m kwng.experiments cifar ...``):

* ``cifar --conditioning ill --method kwng --seed 0 --epochs 30 --lr 1 --schedule claim`` — one run:
  batch 128, the paper's augmentation, the update clipped to norm 1 for every method. After every
  epoch (and at a deadline, mid-epoch) a checkpoint (``checkpoints/``: model, optimizer,
  preconditioner, every RNG state, the position in the epoch: exact resume) and the per-epoch record,
  written atomically to ``<out>/<dataset>/<conditioning>/<method>/seed<k>/metrics.json`` with
  ``provenance.json``. Per epoch: training loss/accuracy, test loss/accuracy, per-class test accuracy,
  last-layer row norms, the mean share of each update's squared norm on the last layer, and for KWNG
  the epoch mean and last value of the preconditioner's diagnostics (:data:`INFO_KEYS`).
* ``cifar sweep --plan claim_select|claim|select|main|<file.json> --gpus N --procs-per-gpu P
  [--deadline-s S]`` — runs the plan in ``N × P`` worker processes, one run per worker first
  (assigned so that the GPUs get similar loads), then any unfinished run; finished runs are
  skipped, interrupted ones resume from their checkpoint.
* ``cifar select [--root results/cifar/claim/selection]`` — applies the selection rule.
* ``cifar timing`` — seconds per step of every method, one at a time on an otherwise idle device.
* ``cifar schedule --plan claim --budget-s B --gpus N`` — the number of epochs that fits a budget.
* ``cifar check [--suite claim|study6]`` — completeness of the results (:func:`check_claim`,
  :func:`check_results`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data import DATASETS, NUM_CLASSES, GPUAugmentedData, load_cifar
from ..provenance import ResultFileError, atomic_write_json, read_json, write_provenance
from . import guard

__all__ = ["METHODS", "LR_GRID", "SELECT_METHODS", "CLAIM_METHODS", "CLAIM_TWO_SEEDS", "CLAIM_ABLATIONS",
           "CONDITIONINGS", "SCHEDULES", "INFO_KEYS", "RunConfig", "run", "run_dir_for", "authors_eps",
           "milestones_for", "evaluate", "build_plan", "select_lrs", "check_results", "check_claim",
           "load_results", "main", "BUDGET_CUT", "lm_same_batch_available"]

log = logging.getLogger(__name__)

CONDITIONINGS = ("well", "ill")
LR_GRID = (10.0, 1.0, 0.1, 0.01, 0.001, 0.0001)
CONDITION_NUMBER = 1e7
CLIP_NORM = 1.0
BATCH_SIZE = 128

# ε of the authors' code (configs/cifar10_KWNG.yml and kwng.py of MichaelArbel/KWNG): ε0 and its bounds
EPS_AUTHORS = 1e-5
EPS_BOUNDS_AUTHORS = (1e-10, 1e5)


def authors_eps(eps: float, batch_size: int) -> float:
    """Our ``ε`` equal to the authors' ``ε``: ``ε_ours = √N · ε_authors`` (``N`` = ``batch_size``).

    The authors whiten ``T`` with ``(CCᵀ/N)^{-1/2}`` and add ``ε I`` to the ``M × M`` system; we
    whiten with ``(CCᵀ)^{-1/2}`` and add ``(ε/N) I`` (Prop. 6). Our ``T̃`` and ``D`` are theirs
    divided by ``√N``, and the two directions coincide when ``ε_ours = √N ε_authors`` (derivation in
    the book chapter :ref:`experiments-cifar`; tested in ``tests/test_cifar.py``). The bounds of the
    Levenberg–Marquardt rule convert the same way.
    """
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    return math.sqrt(batch_size) * float(eps)


# method -> settings. "lr_from": the method whose selected step size it uses.
# "estimator_input": the KWNG samples, "scaled" = U h (the network's outputs, as the authors' code),
# "logits" = h (before U, as the paper's text). "eps_convention": "authors" (authors_eps) or "ours" (ε0 = 1e-5).
_KWNG = {"precond": "kwng", "num_basis": 5, "damping": "T_tilde", "kernel": "gaussian", "diagonal_only": False,
         "estimator_input": "scaled", "eps_convention": "authors"}
# the KWNG of the earlier 6-epoch study: samples before U, ε0 = 1e-5 in our convention
# (no "eps_convention" key: "ours" is the default, and the committed records predate the key)
_KWNG6 = {k: v for k, v in {**_KWNG, "estimator_input": "logits"}.items() if k != "eps_convention"}
METHODS: dict[str, dict[str, Any]] = {
    # the claim suite
    "sgd": {"optimizer": "sgd"},
    "sgd_momentum": {"optimizer": "sgd", "momentum": 0.9},
    "adam": {"optimizer": "adam"},
    "kfac": {"optimizer": "sgd", "precond": "kfac"},
    "kwng": {"optimizer": "sgd", **_KWNG},
    "kwng_samples_before_U": {"optimizer": "sgd", **_KWNG, "estimator_input": "logits"},
    "diag_Ttilde": {"optimizer": "sgd", **_KWNG, "diagonal_only": True},
    "kwng_lm_same_batch": {"optimizer": "sgd", **_KWNG, "lm_rule": "same_batch", "lr_from": "kwng"},
    # methods of the earlier 6-epoch study only (their records carry their own "method_spec")
    "sgd_momentum_wd": {"optimizer": "sgd", "momentum": 0.9, "weight_decay": 5e-4},
    "ekfac": {"optimizer": "sgd", "precond": "ekfac"},
    "kwng_m20": {"optimizer": "sgd", **_KWNG6, "num_basis": 20, "lr_from": "kwng"},
    "kwng_momentum": {"optimizer": "sgd", "momentum": 0.9, **_KWNG6},
    "kwng_bigbatch": {"optimizer": "sgd", **_KWNG6, "batch_size": 512, "lr_from": "kwng"},
    "kwng_damping_identity": {"optimizer": "sgd", **_KWNG6, "damping": "identity", "lr_from": "kwng"},
    "kwng_damping_T": {"optimizer": "sgd", **_KWNG6, "damping": "T", "lr_from": "kwng"},
    "diag_T": {"optimizer": "sgd", **_KWNG6, "damping": "T", "diagonal_only": True, "lr_from": "kwng"},
    "kwng_rq": {"optimizer": "sgd", **_KWNG6, "kernel": "rq", "lr_from": "kwng"},
    "kwng_scaled_logits": {"optimizer": "sgd", **_KWNG6, "estimator_input": "scaled", "lr_from": "kwng"},
}
#: the claim suite (issue 10): every method × {well, ill}; two seeds for the first two
CLAIM_METHODS = ("sgd", "sgd_momentum", "adam", "kfac", "kwng", "kwng_samples_before_U", "diag_Ttilde")
CLAIM_TWO_SEEDS = ("sgd", "kwng")
#: run after the suite when the preconditioner supports them (not required by :func:`check_claim`)
CLAIM_ABLATIONS = ("kwng_lm_same_batch",)
#: the earlier study's method lists (its records were made with the definitions of that time:
#: "kwng" and "diag_Ttilde" then took their samples before U with ε0 = 1e-5 in our convention)
SELECT_METHODS = ("sgd", "sgd_momentum", "sgd_momentum_wd", "adam", "kfac", "ekfac", "kwng", "kwng_momentum")
MAIN_SEEDED = ("sgd", "adam", "kwng")
ONE_SEED_BOTH = ("sgd_momentum", "sgd_momentum_wd", "kfac", "ekfac", "kwng_m20", "kwng_momentum", "kwng_bigbatch")
ABLATIONS = ("kwng_damping_identity", "kwng_damping_T", "diag_T", "diag_Ttilde", "kwng_rq", "kwng_scaled_logits")
#: step-size schedules: "study6" ×0.1 after 50 % and 75 % of the epochs (the earlier study);
#: "claim" ×0.1 for the last ~15 % (one milestone, like the paper's first); "constant" (selection runs)
SCHEDULES = ("claim", "constant", "study6")
#: diagnostics read from the KWNG step's ``info`` (when present): epoch mean and last value are recorded
INFO_KEYS = ("eps", "reduction_ratio", "clipped", "fallback", "floored_columns", "floored_share")

RESULTS = Path("results") / "cifar"
SELECTION = RESULTS / "selection"
CLAIM = RESULTS / "claim"
CLAIM_SELECTION = CLAIM / "selection"
CHECKPOINTS = Path("checkpoints")


# ------------------------------------------------------------------------------------------ config
class RunConfig(dict):
    """The configuration of one run (a plain dict with defaults and validation)."""

    DEFAULTS: dict[str, Any] = {
        "dataset": "cifar10", "conditioning": "ill", "method": "kwng", "seed": 0, "epochs": 6, "lr": "selected",
        "data_root": None, "source": "auto", "device": None, "out": str(RESULTS), "checkpoint_dir": str(CHECKPOINTS),
        "train_subset": None, "val_size": 0, "max_steps": None, "model": "resnet18", "batch_size": None,
        "eval_batch_size": 1000, "stop_after_epoch": None, "deadline": None, "selection_file": None,
        "download": False, "schedule": "claim",
    }

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(self.DEFAULTS)
        if unknown:
            raise ValueError(f"unknown run settings {sorted(unknown)}; accepted: {sorted(self.DEFAULTS)}")
        super().__init__({**self.DEFAULTS, **kwargs})
        if self["dataset"] not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self['dataset']!r}")
        if self["conditioning"] not in CONDITIONINGS:
            raise ValueError(f"conditioning must be one of {CONDITIONINGS}, got {self['conditioning']!r}")
        if self["method"] not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {self['method']!r}")
        if self["schedule"] not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self['schedule']!r}")
        if self["model"] not in ("resnet18", "tiny"):
            raise ValueError(f"model must be 'resnet18' or 'tiny', got {self['model']!r}")
        for k, lo in (("seed", 0), ("epochs", 1), ("eval_batch_size", 1), ("val_size", 0)):
            if not isinstance(self[k], int) or self[k] < lo:
                raise ValueError(f"{k} must be an integer >= {lo}, got {self[k]!r}")
        for k in ("train_subset", "max_steps", "batch_size", "stop_after_epoch"):
            if self[k] is not None and (not isinstance(self[k], int) or self[k] < 1):
                raise ValueError(f"{k} must be None or an integer >= 1, got {self[k]!r}")
        if self["lr"] != "selected":
            lr = float(self["lr"])
            if not (math.isfinite(lr) and lr > 0):
                raise ValueError(f"lr must be a positive number or 'selected', got {self['lr']!r}")
            self["lr"] = lr

    @property
    def spec(self) -> dict[str, Any]:
        return METHODS[self["method"]]

    @property
    def batch(self) -> int:
        return int(self["batch_size"] or self.spec.get("batch_size", BATCH_SIZE))


def run_dir_for(cfg: dict) -> Path:
    cfg = cfg if isinstance(cfg, RunConfig) else RunConfig(**cfg)
    return Path(cfg["out"]) / cfg["dataset"] / cfg["conditioning"] / cfg["method"] / f"seed{cfg['seed']}"


def checkpoint_path_for(cfg: dict) -> Path:
    cfg = cfg if isinstance(cfg, RunConfig) else RunConfig(**cfg)
    rd = run_dir_for(cfg)
    if rd.is_absolute():
        rd = Path("abs") / hashlib.sha1(str(rd).encode()).hexdigest()[:16]
    return Path(cfg["checkpoint_dir"]) / rd / "checkpoint.pt"


def resolve_lr(cfg: RunConfig) -> float:
    """The step size: a number, or the one chosen by ``select`` for the method (or its ``lr_from``)."""
    if cfg["lr"] != "selected":
        return float(cfg["lr"])
    path = Path(cfg["selection_file"] or SELECTION / "selected.json")
    if not path.is_file():
        raise FileNotFoundError(f"lr='selected' needs {path} (run `cifar select` first) or pass --lr")
    table = read_json(path)["selected"]
    base = cfg.spec.get("lr_from", cfg["method"])
    key = f"{cfg['dataset']}/{cfg['conditioning']}/{base}"
    if key not in table:
        raise KeyError(f"no selected step size for {key} in {path}")
    return float(table[key]["lr"])


# ------------------------------------------------------------------------------------------- setup
def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _build_model(cfg: RunConfig) -> nn.Module:
    """``z ↦ U h_θ(z)`` (:class:`kwng.nets.ConditionedNetwork`): ``U`` inside the network."""
    from ..nets import ConditionedNetwork, resnet18, tiny_cnn

    k = NUM_CLASSES[cfg["dataset"]]
    return ConditionedNetwork(resnet18(k) if cfg["model"] == "resnet18" else tiny_cnn(k), _conditioning(cfg))


def milestones_for(epochs: int, schedule: str) -> list[int]:
    """Epochs after which the step size is multiplied by 0.1: ``claim`` — one milestone so that the
    last ``max(1, round(0.15 E))`` epochs run at 0.1× (for ``E ≥ 2``); ``study6`` — after
    ``round(0.5 E)`` and ``round(0.75 E)`` epochs; ``constant`` — none."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be an integer >= 1, got {epochs!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "constant" or epochs == 1:
        return []
    if schedule == "claim":
        return [epochs - max(1, round(0.15 * epochs))]
    return sorted({max(1, round(0.5 * epochs)), max(1, round(0.75 * epochs))} - {epochs})


def lm_same_batch_available() -> bool:
    """Whether :class:`kwng.precond.KWNGPreconditioner` accepts ``lm_rule`` (the same-batch
    Levenberg–Marquardt variant of ``kwng_lm_same_batch``)."""
    import inspect

    from ..precond import KWNGPreconditioner

    return "lm_rule" in inspect.signature(KWNGPreconditioner.__init__).parameters


def _conditioning(cfg: RunConfig) -> nn.Module | None:
    from ..nets import DiagonalConditioning

    if cfg["conditioning"] == "well":
        return None
    return DiagonalConditioning(NUM_CLASSES[cfg["dataset"]], CONDITION_NUMBER)


def _optimizer(cfg: RunConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    spec = cfg.spec
    if spec["optimizer"] == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=spec.get("momentum", 0.0),
                           weight_decay=spec.get("weight_decay", 0.0))


def _preconditioner(cfg: RunConfig, model: nn.Module, optimizer, U, device):
    spec = cfg.spec
    kind = spec.get("precond")
    if kind is None:
        return None
    if kind in ("kfac", "ekfac"):
        from ..baselines import KFACPreconditioner

        # U is inside the model (ConditionedNetwork): the Fisher's predictive logits are the outputs
        return KFACPreconditioner(model, kind=kind, damping=1e-3, update_freq=100, diag_freq=1, output_fn=U,
                                  clip_norm=CLIP_NORM, device=device)
    from ..precond import KWNGPreconditioner

    kw: dict[str, Any] = {}
    if spec.get("eps_convention", "ours") == "authors":
        n = cfg.batch
        kw.update(eps=authors_eps(EPS_AUTHORS, n), eps_min=authors_eps(EPS_BOUNDS_AUTHORS[0], n),
                  eps_max=authors_eps(EPS_BOUNDS_AUTHORS[1], n))
    else:
        kw.update(eps=1e-5)
    if "lm_rule" in spec:
        if not lm_same_batch_available():
            raise ValueError(f"method {cfg['method']!r} needs KWNGPreconditioner(lm_rule=...), which this "
                             "version of kwng.precond does not accept")
        kw["lm_rule"] = spec["lm_rule"]
    # the fast path replicates the forward of the module the loop calls through __call__: the body h
    # (ConditionedNetwork.forward_both calls it; U·h is then pulled back to it, U has no parameters)
    from ..nets import ConditionedNetwork

    net = model.body if isinstance(model, ConditionedNetwork) else model
    return KWNGPreconditioner(net, optimizer=optimizer, num_basis=spec["num_basis"], lam=0.0,
                              kernel=spec["kernel"], bandwidth="mean_sq", sigma0=1.0, damping=spec["damping"],
                              lm_interval=5, lm_omega=0.85, lm_low=0.25, lm_high=0.75, adapt_eps=True,
                              clip_norm=CLIP_NORM, mode="fast", diagonal_only=spec["diagonal_only"], **kw)


def _split_data(cfg: RunConfig):
    """Training / evaluation arrays. With ``val_size`` > 0 (step-size selection) the evaluation set is
    held out of the training set (the test set is not looked at); ``train_subset`` keeps that many."""
    x, y = load_cifar(cfg["dataset"], "train", cfg["data_root"], cfg["source"], cfg["download"])
    if cfg["val_size"]:
        perm = np.random.default_rng(12345).permutation(len(x))
        val, rest = perm[:cfg["val_size"]], perm[cfg["val_size"]:]
        if cfg["train_subset"]:
            rest = rest[:cfg["train_subset"]]
        return x[rest], y[rest], x[val], y[val]
    if cfg["train_subset"]:
        keep = np.random.default_rng(12345).permutation(len(x))[:cfg["train_subset"]]
        x, y = x[np.sort(keep)], y[np.sort(keep)]
    xt, yt = load_cifar(cfg["dataset"], "test", cfg["data_root"], cfg["source"], cfg["download"])
    return x, y, xt, yt


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())  # map_location may have moved it
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def evaluate(model: nn.Module, data: GPUAugmentedData, U: nn.Module | None = None, batch_size: int = 1000,
             num_classes: int | None = None) -> tuple[float, float] | tuple[float, float, list[float]]:
    """Mean cross-entropy of the outputs (``U`` applied after ``model`` if given) and accuracy of their
    arg-max on ``data`` (eval mode, no augmentation). With ``num_classes``, also the accuracy on the
    examples of each class (NaN for a class without examples)."""
    was = model.training
    model.eval()
    loss_sum = torch.zeros((), device=data.device, dtype=torch.float64)
    k = num_classes or 1
    hits = torch.zeros(k, device=data.device, dtype=torch.long)
    count = torch.zeros(k, device=data.device, dtype=torch.long)
    for z, y in data.eval_batches(batch_size):
        out = model(z)
        out = U(out) if U is not None else out
        loss_sum += F.cross_entropy(out, y, reduction="sum").double()
        ok = (out.argmax(1) == y).long()
        cls = y if num_classes else torch.zeros_like(y)
        hits.index_add_(0, cls, ok)
        count.index_add_(0, cls, torch.ones_like(ok))
    model.train(was)
    loss, acc = float(loss_sum) / len(data), float(hits.sum()) / len(data)
    if not num_classes:
        return loss, acc
    per = (hits.double() / count.double()).tolist()  # 0/0 -> nan
    return loss, acc, per


# ------------------------------------------------------------------------------------ step, stats
class _EpochStats:
    """Sums over the steps of one epoch, kept on the device (one host sync when the epoch ends):
    training loss and accuracy, the share of each update's squared norm on the last layer, and the
    epoch mean (over finite values) and last value of the KWNG diagnostics of :data:`INFO_KEYS`."""

    def __init__(self, device: torch.device) -> None:
        z = lambda dt=torch.float64: torch.zeros((), device=device, dtype=dt)  # noqa: E731
        self.device = device
        self.loss_sum, self.correct, self.share_sum = z(), z(torch.long), z()
        self.seen, self.steps = 0, 0
        self.info_sum: dict[str, torch.Tensor] = {}
        self.info_n: dict[str, torch.Tensor] = {}
        self.info_last: dict[str, torch.Tensor] = {}

    def add_info(self, info: dict) -> None:
        for k in INFO_KEYS:
            v = info.get(k)
            if v is None:
                continue
            v = torch.as_tensor(v, device=self.device).detach().to(torch.float64).reshape(())
            fin = torch.isfinite(v)
            self.info_sum[k] = self.info_sum.get(k, 0) + torch.where(fin, v, torch.zeros_like(v))
            self.info_n[k] = self.info_n.get(k, 0) + fin.long()
            self.info_last[k] = v

    def row(self) -> dict[str, Any]:
        out = {"train_loss": float(self.loss_sum) / max(self.seen, 1),
               "train_acc": float(self.correct) / max(self.seen, 1),
               "last_layer_update_share": float(self.share_sum) / max(self.steps, 1)}
        for k in self.info_sum:
            n = int(self.info_n[k])
            out[f"{k}_mean"] = float(self.info_sum[k]) / n if n else float("nan")
            out[f"{k}_last"] = float(self.info_last[k])
        return out

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("loss_sum", "correct", "share_sum", "seen", "steps", "info_sum",
                                               "info_n", "info_last")}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                v = v.to(self.device)
            elif isinstance(v, dict):
                v = {kk: vv.to(self.device) if isinstance(vv, torch.Tensor) else vv for kk, vv in v.items()}
            setattr(self, k, v)


class _UpdateShare:
    """Per step, ``‖Δθ_last‖² / ‖Δθ‖²``: the share of the update's squared norm on the last layer
    (``Δθ`` = the parameters after ``optimizer.step()`` minus before; multi-tensor ops, no sync)."""

    def __init__(self, model: nn.Module) -> None:
        from ..nets import last_linear

        last = {id(p) for p in last_linear(model).parameters()}
        params = [p for p in model.parameters() if p.requires_grad]
        self.params = [p.detach() for p in params]
        self.mask = torch.tensor([id(p) in last for p in params], device=params[0].device)  # once: no copy per step
        self.snap = [p.clone() for p in self.params]

    def before(self) -> None:
        torch._foreach_copy_(self.snap, self.params)

    def after(self) -> torch.Tensor:
        torch._foreach_sub_(self.snap, self.params)
        sq = torch.stack(torch._foreach_norm(self.snap)).double() ** 2
        total = sq.sum()
        last = torch.where(self.mask, sq, torch.zeros_like(sq)).sum()  # no boolean indexing: no sync
        return torch.where(total > 0, last / total.clamp(min=1e-300), torch.zeros_like(total))


def _train_step(cfg: RunConfig, model: nn.Module, optimizer, precond, z: torch.Tensor, yb: torch.Tensor,
                share: _UpdateShare | None = None) -> tuple[torch.Tensor, torch.Tensor, dict, torch.Tensor | None]:
    """One training step of any method: forward, direction (plain, KFAC or KWNG; clipped to
    :data:`CLIP_NORM`), ``optimizer.step()``; for ``lm_rule == "same_batch"`` the loss of the same batch
    after the step (no grad, BatchNorm running statistics restored) goes to the preconditioner.
    Returns ``(loss, outputs, info, last-layer share)``."""
    from ..baselines import bn_state, clip_grad_norm, restore_bn_state

    optimizer.zero_grad(set_to_none=True)
    h, outputs = model.forward_both(z)
    loss = F.cross_entropy(outputs, yb)
    kind = cfg.spec.get("precond")
    info: dict = {}
    if kind == "kwng":
        info = precond.step(loss, outputs if cfg.spec["estimator_input"] == "scaled" else h)
    elif kind in ("kfac", "ekfac"):
        info = precond.step(loss, outputs, inputs=z)
    else:
        loss.backward()
        clip_grad_norm(model.parameters(), CLIP_NORM)
    if share is not None:
        share.before()
    optimizer.step()
    frac = share.after() if share is not None else None
    if kind == "kwng" and getattr(precond, "lm_rule", "authors") == "same_batch":
        saved = bn_state(model)
        with torch.no_grad():
            loss_after = F.cross_entropy(model(z), yb)
        restore_bn_state(model, saved)
        precond.observe_loss_after_step(loss_after)
    return loss, outputs, info, frac


def _save_checkpoint(path: Path, ck: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(ck, tmp)
    os.replace(tmp, path)


def _past(deadline: float | None) -> bool:
    """Whether the Unix time ``deadline`` has passed (checked once per batch by :func:`run`)."""
    return deadline is not None and time.time() > deadline


# --------------------------------------------------------------------------------------------- run
def run(cfg: RunConfig | dict, progress: bool = True, force: bool = False) -> dict:
    """Train one configuration to completion (or to ``stop_after_epoch`` / ``max_steps`` / ``deadline``),
    resuming from its checkpoint if one exists. Returns the metrics record (also written to disk).

    A run directory written with another identity (:func:`kwng.experiments.guard.run_identity`: step
    size, epochs, model, data, batch, method spec, ...) is refused, never resumed, skipped or
    overwritten; so is an unfinished record whose checkpoint is gone. ``force`` moves such results to
    a dated backup and starts afresh.


    At the ``deadline`` (a Unix time) the run checkpoints in the middle of its epoch, with the
    epoch's partial sums and the data generator's state at the epoch start: the resumed run replays
    the epoch's batch draws up to that point and continues exactly where it stopped."""
    cfg = cfg if isinstance(cfg, RunConfig) else RunConfig(**cfg)
    rdir, ckpt_path = run_dir_for(cfg), checkpoint_path_for(cfg)
    metrics_path = rdir / "metrics.json"
    lr = resolve_lr(cfg)
    identity = _identity(cfg, lr)
    prev = guard.check_existing_run(rdir, ckpt_path, identity, force)
    if prev is not None:
        log.info("%s is complete: skipped", rdir)
        return prev
    device = _device(cfg["device"])
    torch.manual_seed(cfg["seed"])
    np.random.seed(cfg["seed"])
    random.seed(cfg["seed"])
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    x, y, xt, yt = _split_data(cfg)
    train = GPUAugmentedData(x, y, cfg["dataset"], device)
    test = GPUAugmentedData(xt, yt, cfg["dataset"], device)
    model = _build_model(cfg).to(device)
    optimizer = _optimizer(cfg, model, lr)
    E = cfg["epochs"]
    milestones = milestones_for(E, cfg["schedule"])
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)
    precond = _preconditioner(cfg, model, optimizer, None, device)
    k_classes = NUM_CLASSES[cfg["dataset"]]
    data_gen = torch.Generator().manual_seed(10_000 + cfg["seed"])
    record = {"config": dict(cfg), "identity": identity, "lr": lr, "milestones": milestones, "batch_size": cfg.batch,
              "method_spec": cfg.spec, "clip_norm": CLIP_NORM, "epochs": [], "complete": False,
              "diverged": False, "train_size": len(train), "eval_size": len(test),
              "eval_split": "validation (held out of train)" if cfg["val_size"] else "test",
              "samples": "U h (U inside the network)" if cfg.spec.get("estimator_input", "scaled") == "scaled"
              else "h (before U)", "U": model.conditioning.diag.tolist() if model.conditioning is not None
              else None}
    if precond is not None and hasattr(precond, "hyperparameters"):
        record["precond"] = {k: v for k, v in precond.hyperparameters().items() if isinstance(v, (int, float, str))}
    start_epoch, steps, time_train, partial = 0, 0, 0.0, None
    ck = guard.resume_checkpoint(ckpt_path, identity, device, force, rdir)
    if ck is not None:
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        if precond is not None:
            precond.load_state_dict(ck["precond"])
        data_gen.set_state(ck["data_gen"].cpu())
        _set_rng_state(ck["rng"], device)
        record = ck["record"]
        start_epoch, steps, time_train = ck["epoch"], ck["steps"], ck["time_train"]
        partial = ck.get("partial")
        log.info("%s: resumed after epoch %d%s", rdir, start_epoch,
                 f" and {partial['batches']} batches" if partial else "")
    write_provenance(rdir, dict(cfg), seeds={"seed": cfg["seed"], "data": 10_000 + cfg["seed"]}, device=str(device),
                     lr=lr, method_spec=cfg.spec, resumed_from_epoch=start_epoch)
    nb = train.num_batches(cfg.batch)
    total_steps = E * nb if cfg["max_steps"] is None else min(E * nb, cfg["max_steps"])
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, initial=min(steps, total_steps), desc=str(rdir), leave=False,
                   mininterval=5.0, file=sys.stderr)
    kind = cfg.spec.get("precond")
    share = _UpdateShare(model)
    model.train()
    for epoch in range(start_epoch, E):
        if steps >= total_steps:
            break
        _sync(device)
        t0 = time.perf_counter()
        stats, skip, t_before = _EpochStats(device), 0, 0.0
        if partial is not None:  # resume mid-epoch: replay the epoch's draws up to where it stopped
            data_gen.set_state(partial["data_gen_epoch_start"].cpu())
            stats.load_state_dict(partial["stats"])
            skip, t_before = partial["batches"], partial["time_in_epoch"]
            partial = None
        gen_start = data_gen.get_state()
        fallback_kfac, stopped = 0, None
        for b, (z, yb) in enumerate(train.batches(cfg.batch, data_gen)):
            if b < skip:
                continue
            if _past(cfg["deadline"]):
                stopped = "deadline"
                break
            loss, outputs, info, frac = _train_step(cfg, model, optimizer, precond, z, yb, share)
            if kind in ("kfac", "ekfac"):
                fallback_kfac += info["fallback"]
            elif kind == "kwng":
                stats.add_info(info)
            stats.loss_sum += loss.detach().double() * len(yb)
            stats.correct += (outputs.detach().argmax(1) == yb).sum()
            stats.share_sum += frac
            stats.seen += len(yb)
            stats.steps += 1
            steps += 1
            if bar is not None:
                bar.update(1)
            if steps % 50 == 0 and not bool(torch.isfinite(stats.loss_sum)):
                break  # diverged: stop early (recorded below)
            if steps >= total_steps:
                break
        if stopped == "deadline":
            _sync(device)
            done = skip + (b - skip)  # batches of this epoch already taken
            _save_checkpoint(ckpt_path, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "precond": precond.state_dict() if precond else None,
                "data_gen": data_gen.get_state(), "rng": _rng_state(device), "record": record,
                "epoch": epoch, "steps": steps, "time_train": time_train,
                "partial": {"batches": done, "stats": stats.state_dict(), "data_gen_epoch_start": gen_start,
                            "time_in_epoch": t_before + time.perf_counter() - t0}})
            log.warning("%s: deadline reached in epoch %d after %d batches: checkpointed", rdir, epoch + 1, done)
            record["stopped"] = "deadline"
            break
        _sync(device)
        time_train += t_before + time.perf_counter() - t0
        scheduler.step()
        te = time.perf_counter()
        test_loss, test_acc, per_class = evaluate(model, test, None, cfg["eval_batch_size"], k_classes)
        from ..nets import last_linear

        rows_norm = torch.linalg.vector_norm(last_linear(model).weight.detach(), dim=1).tolist()
        row = {"epoch": epoch + 1, "steps": steps, "lr": optimizer.param_groups[0]["lr"], **stats.row(),
               "test_loss": test_loss, "test_acc": test_acc, "test_acc_per_class": per_class,
               "last_layer_row_norms": rows_norm, "time_train": time_train,
               "time_eval": time.perf_counter() - te}
        if kind == "kwng":
            c = precond.counters()
            row.update(eps=precond.eps, fallbacks=c["fallbacks"], clipped=c["clipped"],
                       ill_conditioned=c["ill_conditioned"], damping_floored=c["damping_floored"])
        elif kind in ("kfac", "ekfac"):
            prev = record["epochs"][-1]["fallbacks"] if record["epochs"] else 0
            row["fallbacks"] = prev + int(fallback_kfac)
        record["epochs"].append(row)
        finished = epoch + 1 == E or steps >= total_steps
        if not math.isfinite(row["train_loss"]):
            record["diverged"] = True
            finished = True
        record["complete"] = finished
        record.pop("stopped", None)
        log.info("%s epoch %d: train %.4f/%.3f test %.4f/%.3f (%.1fs)", rdir, epoch + 1, row["train_loss"],
                 row["train_acc"], test_loss, test_acc, time_train)
        if not finished:
            _save_checkpoint(ckpt_path, {
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "precond": precond.state_dict() if precond else None,
                "data_gen": data_gen.get_state(), "rng": _rng_state(device), "record": record,
                "epoch": epoch + 1, "steps": steps, "time_train": time_train})
        atomic_write_json(metrics_path, record)
        if finished:
            with contextlib.suppress(FileNotFoundError):
                ckpt_path.unlink()
            break
        if cfg["stop_after_epoch"] is not None and epoch + 1 >= cfg["stop_after_epoch"]:
            break
    if bar is not None:
        bar.close()
    return record


def _identity(cfg: RunConfig, lr: float) -> dict:
    from ..data import source_fingerprint

    try:
        data = source_fingerprint(cfg["dataset"], cfg["data_root"], cfg["source"])
    except FileNotFoundError:
        if not cfg["download"]:
            raise
        data = None  # fetched by this run; not compared
    return guard.run_identity(cfg, lr, cfg.batch, cfg.spec, data)


# ----------------------------------------------------------------------------------------- plans
#: rough cost of one step relative to SGD (H200, batch 128; results/cifar/timing/timing.json), used only
#: to spread the runs of a plan over the GPUs when no timing file is given
REL_COST = {"sgd": 1.0, "sgd_momentum": 1.0, "sgd_momentum_wd": 1.05, "adam": 1.4, "kfac": 1.7, "ekfac": 11.0,
            "kwng_m20": 16.7, "kwng_bigbatch": 16.3, "kwng_lm_same_batch": 5.8}
_KWNG_REL_COST = 5.4


def job_cost(job: dict, timing: dict | None = None) -> float:
    """Relative cost of a run of ``job`` per epoch (timing file's seconds per step if given)."""
    m = job["method"]
    if timing is not None and m in timing:
        return float(timing[m]["sec_per_step"]) * math.ceil(50_000 / timing[m].get("batch_size", BATCH_SIZE))
    return REL_COST.get(m, _KWNG_REL_COST if METHODS[m].get("precond") == "kwng" else 1.0)


def assign_slots(plan: list[dict], gpus: int, procs_per_gpu: int, timing: dict | None = None) -> list[dict]:
    """The plan with a ``slot`` (worker index ``g · procs_per_gpu + p``) for each of the first runs,
    chosen greedily (most expensive run first, to the GPU with the least load and a free worker) so that
    every GPU gets a similar total cost; runs beyond the number of workers get no slot (taken by the
    first worker to finish)."""
    gpus = max(gpus, 1)
    order = sorted(range(len(plan)), key=lambda i: -job_cost(plan[i], timing))
    load, used = [0.0] * gpus, [0] * gpus
    out = [dict(j) for j in plan]
    for i in order:
        free = [g for g in range(gpus) if used[g] < procs_per_gpu]
        if not free:
            break
        g = min(free, key=lambda g: (load[g], g))
        out[i]["slot"] = g * procs_per_gpu + used[g]
        used[g] += 1
        load[g] += job_cost(plan[i], timing)
    return out


def build_plan(name: str, dataset: str = "cifar10", epochs: int = 6, select_steps: int = 120,
               select_subset: int | None = 10_000, select_val: int = 2_000, data_root: str | None = None,
               select_epochs: int = 2, with_ablations: bool | None = None,
               methods: Sequence[str] | None = None) -> list[dict]:
    """Run lists (only the runs of ``methods``, when given: a suite run in parts).

    * ``claim_select``: every method of :data:`CLAIM_METHODS` × {ill, well} × :data:`LR_GRID`, each
      ``select_epochs`` epochs at a constant step on the training set minus ``select_val`` held-out
      images (on ``select_subset`` of the rest if given), scored on the held-out images; results under
      ``results/cifar/claim/selection/lr<lr>/``.
    * ``claim``: the claim suite, ``epochs`` epochs with the ``claim`` schedule and the step sizes of
      ``claim_select``, in priority order: seed 0 of every method of :data:`CLAIM_METHODS` in both
      conditionings, seed 1 of :data:`CLAIM_TWO_SEEDS`, then :data:`CLAIM_ABLATIONS` (seed 0, both
      conditionings) when ``with_ablations`` (default: when the preconditioner supports them).
    * ``select`` and ``main``: the plans of the earlier 6-epoch study. ``select``: every method of
      :data:`SELECT_METHODS` × {ill, well} × :data:`LR_GRID` for ``select_steps`` steps on
      ``select_subset`` training images, evaluated on ``select_val`` held-out training images.
      ``main``: seed 0 of sgd/adam/kwng in both conditionings, seeds 1–2 of those, seed 0 of the other
      methods in both conditionings, the ablations (ill only).
    * a path to a JSON list of run settings.
    """
    if methods is not None:
        unknown = sorted(set(methods) - set(METHODS))
        if unknown:
            raise ValueError(f"methods must be names from {sorted(METHODS)}, got {unknown}")
        keep = set(methods)
        return [j for j in build_plan(name, dataset, epochs, select_steps, select_subset, select_val, data_root,
                                      select_epochs, with_ablations) if j["method"] in keep]
    common = {"dataset": dataset, "data_root": data_root}
    if name == "claim_select":
        jobs = []
        for cond in ("ill", "well"):
            for m in CLAIM_METHODS:
                for lr in LR_GRID:
                    jobs.append({**common, "conditioning": cond, "method": m, "seed": 0, "epochs": select_epochs,
                                 "lr": lr, "schedule": "constant", "train_subset": select_subset,
                                 "val_size": select_val, "out": str(CLAIM_SELECTION / f"lr{lr:g}")})
        return jobs
    if name == "claim":
        base = {**common, "epochs": epochs, "lr": "selected", "schedule": "claim", "out": str(CLAIM),
                "selection_file": str(CLAIM_SELECTION / "selected.json")}
        jobs = [{**base, "conditioning": c, "method": m, "seed": 0} for m in CLAIM_METHODS for c in ("ill", "well")]
        jobs += [{**base, "conditioning": c, "method": m, "seed": 1} for m in CLAIM_TWO_SEEDS for c in ("ill", "well")]
        if with_ablations is None:
            with_ablations = lm_same_batch_available()
        if with_ablations:
            jobs += [{**base, "conditioning": c, "method": m, "seed": 0} for m in CLAIM_ABLATIONS
                     for c in ("ill", "well")]
        return jobs
    if name == "select":
        jobs = []
        for cond in ("ill", "well"):
            for m in SELECT_METHODS:
                for lr in LR_GRID:
                    jobs.append({**common, "conditioning": cond, "method": m, "seed": 0, "epochs": 100, "lr": lr,
                                 "max_steps": select_steps, "train_subset": select_subset, "val_size": select_val,
                                 "out": str(SELECTION / f"lr{lr:g}"), "schedule": "study6"})
        # expensive methods first so that they do not form the tail
        order = {"ekfac": 0, "kfac": 1, "kwng": 2, "kwng_momentum": 3}
        return sorted(jobs, key=lambda j: order.get(j["method"], 9))
    if name == "main":
        jobs = []
        base = {**common, "epochs": epochs, "lr": "selected", "schedule": "study6"}
        for cond in ("ill", "well"):
            jobs += [{**base, "conditioning": cond, "method": m, "seed": 0} for m in MAIN_SEEDED]
        for seed in (1, 2):
            for cond in ("ill", "well"):
                jobs += [{**base, "conditioning": cond, "method": m, "seed": seed} for m in MAIN_SEEDED]
        for cond in ("ill", "well"):
            jobs += [{**base, "conditioning": cond, "method": m, "seed": 0} for m in ONE_SEED_BOTH]
        jobs += [{**base, "conditioning": "ill", "method": m, "seed": 0} for m in ABLATIONS]
        return jobs
    path = Path(name)
    if path.is_file():
        return list(read_json(path))
    raise ValueError(f"plan must be 'claim_select', 'claim', 'select', 'main' or a JSON file of run settings, "
                     f"got {name!r}")


def _claim(cfg: RunConfig, session: str) -> bool:
    """Claim a run for this sweep session (an exclusive file); False if another worker holds it."""
    path = checkpoint_path_for(cfg).parent / f".claim-{session}"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def worker(jobs: Iterable[dict], session: str, deadline: float | None,
           failures_file: str | os.PathLike | None = None) -> list[dict]:
    """Run every unclaimed, unfinished job of ``jobs`` in this process.

    A run that fails (corrupt record, other configuration in its directory, error while training) is
    logged and listed, and the worker goes on with the next. Returns the failures
    (``{"run", "error"}``), also written to ``failures_file`` when given."""
    failures: list[dict] = []
    for job in jobs:
        job = {k: v for k, v in job.items() if k != "slot"}
        if deadline is not None and time.time() > deadline - 20:
            log.info("worker %d: deadline close, not starting new runs", os.getpid())
            break
        name = "/".join(str(job.get(k, "?")) for k in ("dataset", "conditioning", "method", "seed"))
        try:
            cfg = RunConfig(**{**job, "deadline": deadline})
            name = str(run_dir_for(cfg))
            mp = run_dir_for(cfg) / "metrics.json"
            done = mp.is_file() and read_json(mp).get("complete")
            if done or _claim(cfg, session):  # a finished run is still checked against its record
                run(cfg, progress=False)
        except (RuntimeError, ValueError, OSError, KeyError, EOFError) as exc:  # one bad run must not stop a sweep
            log.error("run %s failed: %s", name, exc)
            failures.append({"run": name, "error": f"{type(exc).__name__}: {exc}"})
            if failures_file is not None:
                atomic_write_json(failures_file, failures)
            if isinstance(exc, RuntimeError) and "CUDA" in str(exc) and "out of memory" not in str(exc):
                raise
    return failures


def _is_complete(job: dict) -> bool:
    mp = run_dir_for(RunConfig(**{k: v for k, v in job.items() if k != "slot"})) / "metrics.json"
    try:
        return mp.is_file() and bool(read_json(mp).get("complete"))
    except ValueError as err:  # an unreadable record: its worker reports the failure, the rest go on
        log.warning("%s", err)
        return False


def sweep(plan: list[dict], gpus: int, procs_per_gpu: int, deadline_s: float | None, plan_file: Path,
          timing: dict | None = None) -> int:
    """Spawn ``gpus × procs_per_gpu`` worker processes over ``plan`` and wait for them. The unfinished
    runs get worker slots balanced over the GPUs (:func:`assign_slots`); the rest, most expensive first,
    go to whichever worker is free."""
    if gpus < 0 or procs_per_gpu < 1:
        raise ValueError(f"gpus must be >= 0 and procs_per_gpu >= 1, got {gpus}, {procs_per_gpu}")
    pending = [j for j in plan if not _is_complete(j)]
    slotted = assign_slots(pending, gpus, procs_per_gpu, timing)
    rest = sorted((j for j in slotted if "slot" not in j), key=lambda j: -job_cost(j, timing))
    plan = [j for j in slotted if "slot" in j] + rest
    log.info("sweep: %d unfinished runs, %d with a worker slot", len(plan), len(plan) - len(rest))
    atomic_write_json(plan_file, plan)
    session = uuid.uuid4().hex[:12]
    deadline = None if deadline_s is None else time.time() + deadline_s
    procs = []
    for g in range(max(gpus, 1)):
        for p in range(procs_per_gpu):
            env = dict(os.environ)
            if gpus > 0:
                env["CUDA_VISIBLE_DEVICES"] = str(g)
            cmd = [sys.executable, "-m", "kwng.experiments", "cifar", "worker", "--plan", str(plan_file),
                   "--session", session, "--offset", str(g * procs_per_gpu + p)]
            if deadline is not None:
                cmd += ["--deadline", repr(deadline)]
            procs.append(subprocess.Popen(cmd, env=env))
    rc = 0
    for pr in procs:
        rc = max(rc, pr.wait())
    failures = []
    for f in sorted(plan_file.parent.glob(f"{plan_file.stem}.failures-{session}-*.json")):
        failures += read_json(f)
    if failures:
        log.error("sweep: %d run(s) failed (the others ran):\n%s", len(failures),
                  "\n".join(f"  {x['run']}: {x['error']}" for x in failures))
        rc = max(rc, 1)
    return rc


# -------------------------------------------------------------------------------------- selection
def select_lrs(root: str | os.PathLike = SELECTION, write: bool = True, force: bool = False) -> dict:
    """Apply the selection rule to the short runs under ``root``.

    Rule: for each (dataset, conditioning, method), the step size of :data:`LR_GRID` with the highest
    held-out accuracy at the end of the short run; runs that diverged (non-finite loss) are excluded;
    ties go to the lower final training loss. Writes ``root/selected.json``.
    """
    root = Path(root)
    rows: dict[str, list] = {}
    for mp in sorted(root.glob("lr*/*/*/*/seed*/metrics.json")):
        rec = read_json(mp)
        c = rec["config"]
        key = f"{c['dataset']}/{c['conditioning']}/{c['method']}"
        last = rec["epochs"][-1] if rec["epochs"] else None
        ok = last is not None and rec.get("complete") and not rec.get("diverged") and \
            math.isfinite(last["train_loss"])
        rows.setdefault(key, []).append({"lr": rec["lr"], "val_acc": last["test_acc"] if last else None,
                                         "train_loss": last["train_loss"] if last else None, "ok": bool(ok),
                                         "steps": last["steps"] if last else 0})
    selected = {}
    for key, rs in rows.items():
        good = [r for r in rs if r["ok"]]
        if not good:
            continue
        best = max(good, key=lambda r: (r["val_acc"], -r["train_loss"]))
        selected[key] = {"lr": best["lr"], "val_acc": best["val_acc"],
                         "candidates": sorted(rs, key=lambda r: -r["lr"])}
    out = {"rule": select_lrs.__doc__.split("Writes")[0].strip(), "grid": list(LR_GRID), "selected": selected,
           "inherit": {m: s["lr_from"] for m, s in METHODS.items() if "lr_from" in s}}
    if write:  # a different existing selection is refused unless force (then backed up)
        guard.write_json_guarded(root / "selected.json", out, force)
    return out


# -------------------------------------------------------------------------------------------- timing
def timing(methods: Iterable[str], dataset: str, conditioning: str, steps: int, warmup: int, device: str | None,
           out: Path, model_name: str = "resnet18") -> dict:
    """Seconds per training step of each method alone on ``device`` (random inputs, batch of the
    method): the step of the runner (:func:`_train_step`, with the last-layer share), not timing
    evaluation. Writes ``out`` with provenance."""
    dev = _device(device)
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    res = {}
    for m in methods:
        cfg = RunConfig(dataset=dataset, conditioning=conditioning, method=m, lr=0.01, model=model_name)
        torch.manual_seed(0)
        model = _build_model(cfg).to(dev)
        opt = _optimizer(cfg, model, 0.01)
        pc = _preconditioner(cfg, model, opt, None, dev)
        share = _UpdateShare(model)
        z = torch.randn(cfg.batch, 3, 32, 32, device=dev)
        y = torch.randint(0, NUM_CLASSES[dataset], (cfg.batch,), device=dev)
        for i in range(warmup + steps):
            if i == warmup:
                _sync(dev)
                t0 = time.perf_counter()
            _train_step(cfg, model, opt, pc, z, y, share)
        _sync(dev)
        sec = (time.perf_counter() - t0) / steps
        res[m] = {"sec_per_step": sec, "batch_size": cfg.batch}
        log.info("timing %s: %.2f ms/step", m, 1e3 * sec)
        del model, opt, pc, share
    rec = {"device": str(dev), "steps": steps, "warmup": warmup, "conditioning": conditioning,
           "note": "KFAC refreshes every 100 steps: its per-step time here includes the refresh share only if "
                   "steps >= 100", "methods": res}
    atomic_write_json(out, rec)
    write_provenance(out.parent, {"command": "timing", "methods": list(methods)}, device=str(dev))
    return rec


def schedule_epochs(timing_file: Path, plan: list[dict], budget_s: float, concurrency_gain: float = 1.5,
                    lo: int = 3, hi: int = 15, train_size: int = 50_000, gpus: int = 1,
                    procs_per_gpu: int | None = None, eval_s: float = 0.5) -> int:
    """The largest number of epochs (in ``[lo, hi]``) with which ``plan`` fits ``budget_s`` seconds of
    wall clock on ``gpus`` GPUs, from the per-step times of ``timing_file`` (a method missing from it
    costs like ``kwng``) and an assumed throughput gain of concurrent processes on one GPU.

    With one GPU the plan's total cost per epoch counts; with several, the most loaded GPU's cost
    after :func:`assign_slots` (``procs_per_gpu`` workers each, default: enough for every run)."""
    t = read_json(timing_file)["methods"]
    timing = {m: t.get(m, t.get("kwng", {"sec_per_step": 0.02, "batch_size": BATCH_SIZE})) for m in METHODS}

    def per_epoch(j: dict) -> float:
        bs = METHODS[j["method"]].get("batch_size", BATCH_SIZE)
        return math.ceil(train_size / bs) * timing[j["method"]]["sec_per_step"] + eval_s

    procs = procs_per_gpu or max(1, math.ceil(len(plan) / max(gpus, 1)))
    slotted = assign_slots(plan, gpus, procs, timing)
    loads = [0.0] * max(gpus, 1)
    rest = 0.0
    for j in slotted:
        if "slot" in j:
            loads[j["slot"] // procs] += per_epoch(j)
        else:
            rest += per_epoch(j)
    worst = max(loads) + rest / max(gpus, 1)
    e = int(budget_s * concurrency_gain // worst)
    return max(lo, min(hi, e))


# ---------------------------------------------------------------------------------------- results
def load_results(root: str | os.PathLike = RESULTS, dataset: str = "cifar10") -> dict[tuple, dict]:
    """``{(conditioning, method, seed): metrics record}`` for the runs under ``root/dataset``."""
    out = {}
    for mp in sorted(Path(root, dataset).glob("*/*/seed*/metrics.json")):
        rec = read_json(mp)  # names the file if it is not JSON
        try:
            c = rec["config"]
            out[(c["conditioning"], c["method"], int(c["seed"]))] = rec
        except (KeyError, TypeError, ValueError) as exc:
            raise ResultFileError(f"{mp}: not a metrics record ({type(exc).__name__}: {exc})") from exc
    return out


#: Runs of the committed ``main`` plan that the GPU budget cut short, with the number of epochs each
#: reached (of 6). The sweep's deadline stopped them; their last checkpoint was not kept. They are
#: reported as ``"cut"`` by :func:`check_results` (not ``"incomplete"``) only while their record has
#: exactly this many finite epochs, ``complete = false`` and a provenance file.
BUDGET_CUT = {"ill/kwng_m20/seed0": 3, "well/kwng_m20/seed0": 3}


def check_results(root: str | os.PathLike = RESULTS, dataset: str = "cifar10", epochs: int | None = None,
                  allow_cut: dict[str, int] | None = None) -> dict:
    """Completeness of the committed results: for every run of the ``main`` plan, whether its
    ``metrics.json`` and ``provenance.json`` exist, it is complete (or diverged, recorded as such), and
    has one row per epoch with finite test accuracy.

    ``allow_cut`` (default :data:`BUDGET_CUT` for CIFAR-10, none otherwise) maps run names to the number
    of epochs they are documented to have reached; such a run goes to ``"cut"`` if its record matches
    that exactly, to ``"incomplete"`` otherwise (a complete run on the list is ``"ok"``).
    Returns ``{"missing": [...], "incomplete": [...], "cut": [...], "ok": [...]}`` with run names
    ``cond/method/seedk``."""
    if allow_cut is None:
        allow_cut = BUDGET_CUT if dataset == "cifar10" else {}
    res: dict[str, list[str]] = {"missing": [], "incomplete": [], "cut": [], "ok": []}
    for job in build_plan("main", dataset=dataset, epochs=epochs or 1):
        name = f"{job['conditioning']}/{job['method']}/seed{job['seed']}"
        d = Path(root) / dataset / job["conditioning"] / job["method"] / f"seed{job['seed']}"
        if not (d / "metrics.json").is_file() or not (d / "provenance.json").is_file():
            res["missing"].append(name)
            continue
        rec = read_json(d / "metrics.json")
        e = len(rec["epochs"])
        want = epochs or rec["config"]["epochs"]
        finite = all(math.isfinite(r["test_acc"]) for r in rec["epochs"])
        good = rec.get("diverged") or (rec.get("complete") and e == want and finite)
        if good:
            res["ok"].append(name)
        elif name in allow_cut and not rec.get("complete") and e == allow_cut[name] and e < want and finite:
            res["cut"].append(name)
        else:
            res["incomplete"].append(name)
    return res


def check_claim(root: str | os.PathLike = CLAIM, dataset: str = "cifar10", min_epochs: int = 30) -> dict:
    """Completeness of the claim suite (the ``claim`` plan without ablations), with no exceptions:
    every run has ``metrics.json`` and ``provenance.json``, ``schedule == "claim"`` with its milestone,
    at least ``min_epochs`` planned epochs, all of them recorded (``complete``), finite test accuracy and
    a per-class test accuracy (one finite number per class) in every epoch. A run that diverged
    (non-finite training loss; it stops early) is listed under ``"diverged"`` instead of ``"ok"``.
    Returns ``{"missing", "incomplete", "diverged", "ok"}`` with run names ``cond/method/seedk``."""
    if isinstance(min_epochs, bool) or not isinstance(min_epochs, int) or min_epochs < 1:
        raise ValueError(f"min_epochs must be an integer >= 1, got {min_epochs!r}")
    res: dict[str, list[str]] = {"missing": [], "incomplete": [], "diverged": [], "ok": []}
    k = NUM_CLASSES[dataset]
    for job in build_plan("claim", dataset=dataset, epochs=min_epochs, with_ablations=False):
        name = f"{job['conditioning']}/{job['method']}/seed{job['seed']}"
        d = Path(root) / dataset / job["conditioning"] / job["method"] / f"seed{job['seed']}"
        if not (d / "metrics.json").is_file() or not (d / "provenance.json").is_file():
            res["missing"].append(name)
            continue
        rec = read_json(d / "metrics.json")
        rows, want = rec["epochs"], int(rec["config"]["epochs"])
        per_class_ok = all(len(r.get("test_acc_per_class", [])) == k and
                           all(math.isfinite(a) for a in r["test_acc_per_class"]) for r in rows)
        proto = (rec["config"].get("schedule") == "claim" and rec.get("milestones") == milestones_for(want, "claim")
                 and want >= min_epochs)
        if proto and rec.get("diverged") and rows:
            res["diverged"].append(name)
        elif (proto and rec.get("complete") and len(rows) == want and per_class_ok
              and [r["epoch"] for r in rows] == list(range(1, want + 1))
              and all(math.isfinite(r["test_acc"]) for r in rows)):
            res["ok"].append(name)
        else:
            res["incomplete"].append(name)
    return res


# -------------------------------------------------------------------------------------------- CLI
def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kwng.experiments cifar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="cifar10", choices=DATASETS)
    p.add_argument("--conditioning", default="ill", choices=CONDITIONINGS)
    p.add_argument("--method", default="kwng", choices=list(METHODS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", default="selected", help="a step size or 'selected' (from `cifar select`)")
    p.add_argument("--schedule", default="claim", choices=SCHEDULES)
    p.add_argument("--data-root", default=None)
    p.add_argument("--source", default="auto", choices=("auto", "official", "jpeg", "sample"))
    p.add_argument("--download", action="store_true", help="download the official archive via torchvision")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--checkpoint-dir", default=str(CHECKPOINTS))
    p.add_argument("--train-subset", type=int, default=None)
    p.add_argument("--val-size", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--model", default="resnet18", choices=("resnet18", "tiny"))
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--stop-after-epoch", type=int, default=None, help="stop (checkpointed) after this epoch")
    p.add_argument("--selection-file", default=None)
    p.add_argument("--force", action="store_true", help="if the run directory holds results of another "
                   "configuration (or a record without its checkpoint), move them to a dated backup")
    p.add_argument("--no-progress", action="store_true")
    return p


def _overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for it in items:
        key, sep, val = it.partition("=")
        if not sep or key not in RunConfig.DEFAULTS:
            raise ValueError(f"--set takes KEY=VALUE with KEY one of {sorted(RunConfig.DEFAULTS)}, got {it!r}")
        try:
            out[key] = json.loads(val)
        except json.JSONDecodeError:
            out[key] = val
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "cifar":
        argv = argv[1:]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sub = argv[0] if argv and not argv[0].startswith("-") else None
    rest = argv[1:] if sub else argv
    if sub is None:
        a = _run_parser().parse_args(rest)
        cfg = RunConfig(dataset=a.dataset, conditioning=a.conditioning, method=a.method, seed=a.seed,
                        epochs=a.epochs, lr=a.lr, data_root=a.data_root, source=a.source, device=a.device,
                        out=a.out, checkpoint_dir=a.checkpoint_dir, train_subset=a.train_subset,
                        val_size=a.val_size, max_steps=a.max_steps, model=a.model, batch_size=a.batch_size,
                        stop_after_epoch=a.stop_after_epoch, selection_file=a.selection_file, download=a.download,
                        schedule=a.schedule)
        log.info("configuration: %s", json.dumps(dict(cfg)))
        try:
            rec = run(cfg, progress=not a.no_progress, force=a.force)
        except (guard.ConfigMismatchError, ResultFileError, FileNotFoundError) as exc:
            log.error("refused: %s", exc)
            return 2
        if rec["epochs"]:
            log.info("final: %s", rec["epochs"][-1])
        return 0
    p = argparse.ArgumentParser(prog=f"python -m kwng.experiments cifar {sub}")
    if sub in ("sweep", "worker"):
        p.add_argument("--plan", required=True)
        p.add_argument("--dataset", default="cifar10", choices=DATASETS)
        p.add_argument("--epochs", default="6", help="an integer, or 'auto' (from the schedule file)")
        p.add_argument("--data-root", default=None)
        p.add_argument("--gpus", type=int, default=1)
        p.add_argument("--procs-per-gpu", type=int, default=4)
        p.add_argument("--deadline-s", type=float, default=None, help="stop starting/continuing runs after this")
        p.add_argument("--deadline", type=float, default=None)
        p.add_argument("--session", default=None)
        p.add_argument("--offset", type=int, default=0)
        p.add_argument("--select-steps", type=int, default=120)
        p.add_argument("--select-epochs", type=int, default=2, help="claim_select: epochs of each run")
        p.add_argument("--select-subset", type=int, default=None,
                       help="claim_select: training images per run (default: all but the held-out ones)")
        p.add_argument("--select-val", type=int, default=5_000, help="claim_select: held-out images")
        p.add_argument("--timing", default=None, help="a timing file (`cifar timing`) to balance the GPUs")
        p.add_argument("--methods", default=None, help="comma list: only these methods' runs of the plan")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a run setting in every run of the plan (e.g. model=tiny for a CPU "
                            "smoke test); VALUE is read as JSON if it parses, else as a string")
        a = p.parse_args(rest)
        if sub == "worker":
            jobs = list(read_json(a.plan))
            if any("slot" in j for j in jobs):  # this worker's assigned run, then the unassigned ones;
                # never another worker's run (that would move it to another GPU and unbalance the loads)
                jobs = [j for j in jobs if j.get("slot") == a.offset] + [j for j in jobs if "slot" not in j]
            else:
                jobs = jobs[a.offset:] + jobs[:a.offset]  # spread the first claims over the plan
            ff = Path(a.plan).with_name(f"{Path(a.plan).stem}.failures-{a.session}-{os.getpid()}.json")
            return 1 if worker(jobs, a.session, a.deadline, ff) else 0
        epochs = a.epochs
        if epochs == "auto":
            sched = CLAIM / "schedule.json" if a.plan == "claim" else RESULTS / "schedule.json"
            epochs = int(read_json(sched)["epochs"])
        only = a.methods.split(",") if a.methods else None
        if a.plan == "claim_select":
            plan = build_plan(a.plan, a.dataset, int(epochs), select_subset=a.select_subset,
                              select_val=a.select_val, data_root=a.data_root, select_epochs=a.select_epochs,
                              methods=only)
        else:
            plan = build_plan(a.plan, a.dataset, int(epochs), select_steps=a.select_steps, data_root=a.data_root,
                              methods=only)
        plan = [{**j, **_overrides(a.set)} for j in plan]
        plan_file = CHECKPOINTS / "plans" / f"{Path(a.plan).stem}.json"
        timing_rec = read_json(a.timing)["methods"] if a.timing else None
        log.info("sweep %s: %d runs on %d GPU(s) × %d processes", a.plan, len(plan), a.gpus, a.procs_per_gpu)
        return sweep(plan, a.gpus, a.procs_per_gpu, a.deadline_s, plan_file, timing_rec)
    p.add_argument("--force", action="store_true", help="replace a different existing output file "
                   "(select, timing, schedule), moving it to a dated backup first")
    if sub == "select":
        p.add_argument("--root", default=str(CLAIM_SELECTION))
        a = p.parse_args(rest)
        out = select_lrs(a.root, force=a.force)
        for k, v in sorted(out["selected"].items()):
            log.info("selected %s: lr=%g (held-out acc %.3f)", k, v["lr"], v["val_acc"])
        return 0
    if sub == "timing":
        p.add_argument("--methods", default="claim")
        p.add_argument("--dataset", default="cifar10", choices=DATASETS)
        p.add_argument("--conditioning", default="ill", choices=CONDITIONINGS)
        p.add_argument("--steps", type=int, default=30)
        p.add_argument("--warmup", type=int, default=5)
        p.add_argument("--device", default=None)
        p.add_argument("--model", default="resnet18", choices=("resnet18", "tiny"))
        p.add_argument("--out", default=str(CLAIM / "timing" / "timing.json"))
        a = p.parse_args(rest)
        methods = {"all": list(METHODS), "claim": list(CLAIM_METHODS)}.get(a.methods, a.methods.split(","))
        bad = [m for m in methods if m not in METHODS]
        if bad:
            raise ValueError(f"unknown methods {bad}; accepted: 'all', 'claim' or names from {list(METHODS)}")
        for f in (Path(a.out), Path(a.out).parent / "provenance.json"):
            if f.exists() and not a.force:
                raise guard.ConfigMismatchError(f"{f} exists; {guard.FORCE_HINT}")
            if f.exists():
                guard.backup(f)
        timing(methods, a.dataset, a.conditioning, a.steps, a.warmup, a.device, Path(a.out), a.model)
        return 0
    if sub == "schedule":
        p.add_argument("--plan", default="claim", choices=("claim", "main"))
        p.add_argument("--budget-s", type=float, required=True)
        p.add_argument("--timing", default=str(RESULTS / "timing" / "timing.json"))
        p.add_argument("--concurrency-gain", type=float, default=1.0)
        p.add_argument("--gpus", type=int, default=1)
        p.add_argument("--procs-per-gpu", type=int, default=None)
        p.add_argument("--min-epochs", type=int, default=1)
        p.add_argument("--max-epochs", type=int, default=400)
        p.add_argument("--out", default=None, help="write the schedule here (default: print only)")
        a = p.parse_args(rest)
        plan = build_plan(a.plan)
        e = schedule_epochs(Path(a.timing), plan, a.budget_s, a.concurrency_gain, a.min_epochs, a.max_epochs,
                            gpus=a.gpus, procs_per_gpu=a.procs_per_gpu)
        if a.out:
            guard.write_json_guarded(a.out, {
                "epochs": e, "budget_s": a.budget_s, "concurrency_gain": a.concurrency_gain, "gpus": a.gpus,
                "timing": a.timing, "plan": a.plan, "runs": len(plan),
                "milestones": milestones_for(e, "claim" if a.plan == "claim" else "study6")}, a.force)
        log.info("schedule: %d epochs fit %.0f s for plan %s (%d runs)", e, a.budget_s, a.plan, len(plan))
        print(e)
        return 0
    if sub == "check":
        p.add_argument("--suite", default="claim", choices=("claim", "study6"))
        p.add_argument("--root", default=None, help="default: results/cifar/claim (claim), results/cifar (study6)")
        p.add_argument("--dataset", default="cifar10", choices=DATASETS)
        p.add_argument("--min-epochs", type=int, default=30)
        a = p.parse_args(rest)
        if a.suite == "claim":
            res = check_claim(a.root or CLAIM, a.dataset, a.min_epochs)
            print(json.dumps({k: len(v) for k, v in res.items()}), "not ok:",
                  json.dumps(res["missing"] + res["incomplete"]), "diverged:", json.dumps(res["diverged"]))
            return 0 if not res["missing"] and not res["incomplete"] else 1
        res = check_results(a.root or RESULTS, a.dataset)
        print(json.dumps({k: len(v) for k, v in res.items()}), json.dumps(res["missing"] + res["incomplete"]),
              "cut by the budget (documented):", json.dumps(res["cut"]))
        return 0 if not res["missing"] and not res["incomplete"] else 1
    raise ValueError(f"unknown cifar subcommand {sub!r}; use sweep, worker, select, timing, schedule or check")
