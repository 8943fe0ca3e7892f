"""The CIFAR classification study (paper §4.2, App. E; book chapter :ref:`experiments-cifar`).

Commands (``python -m kwng.experiments cifar ...``):

* ``cifar --dataset cifar10 --conditioning ill --method kwng --seed 0 --epochs 6 --lr 0.1`` — one run:
  ResNet-18 of Table 1, loss ``CE(U h_θ(z), y)`` (``U`` = :class:`kwng.nets.DiagonalConditioning` with
  condition number 1e7 for ``ill``, the identity for ``well``), batch 128, the paper's augmentation, the
  update clipped to norm 1 for every method, step-size milestones at 50 % and 75 % of the epochs
  (×0.1). After every epoch: a checkpoint (``checkpoints/``, with model, optimizer, preconditioner and
  every RNG state: exact resume) and the per-epoch record, written atomically to
  ``results/cifar/<dataset>/<conditioning>/<method>/seed<k>/metrics.json`` with ``provenance.json``.
  ``--lr selected`` reads the step size chosen by ``select``.
* ``cifar sweep --plan select|main|<file.json> --gpus N --procs-per-gpu P [--deadline-s S]`` — runs the
  plan's independent runs in ``N × P`` worker processes (several per GPU), each claiming the next
  unfinished run; finished runs are skipped, interrupted ones resume from their checkpoint.
* ``cifar select`` — applies the selection rule to the short runs and writes
  ``results/cifar/selection/selected.json``.
* ``cifar timing`` — seconds per step of every method, one at a time on an otherwise idle device.
* ``cifar schedule --budget-s B`` — the number of epochs that fits a budget, from the timing file.
* ``cifar check`` — completeness of the committed results (:func:`check_results`; the runs the GPU
  budget cut short are listed in :data:`BUDGET_CUT`).
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
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..data import DATASETS, NUM_CLASSES, GPUAugmentedData, load_cifar
from ..provenance import ResultFileError, atomic_write_json, read_json, write_provenance
from . import guard

__all__ = ["METHODS", "LR_GRID", "SELECT_METHODS", "CONDITIONINGS", "RunConfig", "run", "run_dir_for",
           "build_plan", "select_lrs", "check_results", "load_results", "main", "BUDGET_CUT"]

log = logging.getLogger(__name__)

CONDITIONINGS = ("well", "ill")
LR_GRID = (10.0, 1.0, 0.1, 0.01, 0.001, 0.0001)
CONDITION_NUMBER = 1e7
CLIP_NORM = 1.0
BATCH_SIZE = 128

# method -> settings. "lr_from": the method whose selected step size it uses (budget: see the chapter).
_KWNG = {"precond": "kwng", "num_basis": 5, "damping": "T_tilde", "kernel": "gaussian", "diagonal_only": False,
         "estimator_input": "logits"}
METHODS: dict[str, dict[str, Any]] = {
    "sgd": {"optimizer": "sgd"},
    "sgd_momentum": {"optimizer": "sgd", "momentum": 0.9},
    "sgd_momentum_wd": {"optimizer": "sgd", "momentum": 0.9, "weight_decay": 5e-4},
    "adam": {"optimizer": "adam"},
    "kfac": {"optimizer": "sgd", "precond": "kfac"},
    "ekfac": {"optimizer": "sgd", "precond": "ekfac"},
    "kwng": {"optimizer": "sgd", **_KWNG},
    "kwng_m20": {"optimizer": "sgd", **_KWNG, "num_basis": 20, "lr_from": "kwng"},
    "kwng_momentum": {"optimizer": "sgd", "momentum": 0.9, **_KWNG},
    "kwng_bigbatch": {"optimizer": "sgd", **_KWNG, "batch_size": 512, "lr_from": "kwng"},
    "kwng_damping_identity": {"optimizer": "sgd", **_KWNG, "damping": "identity", "lr_from": "kwng"},
    "kwng_damping_T": {"optimizer": "sgd", **_KWNG, "damping": "T", "lr_from": "kwng"},
    "diag_T": {"optimizer": "sgd", **_KWNG, "damping": "T", "diagonal_only": True, "lr_from": "kwng"},
    "diag_Ttilde": {"optimizer": "sgd", **_KWNG, "damping": "T_tilde", "diagonal_only": True, "lr_from": "kwng"},
    "kwng_rq": {"optimizer": "sgd", **_KWNG, "kernel": "rq", "lr_from": "kwng"},
    "kwng_scaled_logits": {"optimizer": "sgd", **_KWNG, "estimator_input": "scaled", "lr_from": "kwng"},
}
SELECT_METHODS = ("sgd", "sgd_momentum", "sgd_momentum_wd", "adam", "kfac", "ekfac", "kwng", "kwng_momentum")
MAIN_SEEDED = ("sgd", "adam", "kwng")
ONE_SEED_BOTH = ("sgd_momentum", "sgd_momentum_wd", "kfac", "ekfac", "kwng_m20", "kwng_momentum", "kwng_bigbatch")
ABLATIONS = ("kwng_damping_identity", "kwng_damping_T", "diag_T", "diag_Ttilde", "kwng_rq", "kwng_scaled_logits")

RESULTS = Path("results") / "cifar"
SELECTION = RESULTS / "selection"
CHECKPOINTS = Path("checkpoints")


# ------------------------------------------------------------------------------------------ config
class RunConfig(dict):
    """The configuration of one run (a plain dict with defaults and validation)."""

    DEFAULTS: dict[str, Any] = {
        "dataset": "cifar10", "conditioning": "ill", "method": "kwng", "seed": 0, "epochs": 6, "lr": "selected",
        "data_root": None, "source": "auto", "device": None, "out": str(RESULTS), "checkpoint_dir": str(CHECKPOINTS),
        "train_subset": None, "val_size": 0, "max_steps": None, "model": "resnet18", "batch_size": None,
        "eval_batch_size": 1000, "stop_after_epoch": None, "deadline": None, "selection_file": None,
        "download": False,
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
    from ..nets import resnet18, tiny_cnn

    k = NUM_CLASSES[cfg["dataset"]]
    return resnet18(k) if cfg["model"] == "resnet18" else tiny_cnn(k)


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

        return KFACPreconditioner(model, kind=kind, damping=1e-3, update_freq=100, diag_freq=1, output_fn=U,
                                  clip_norm=CLIP_NORM, device=device)
    from ..precond import KWNGPreconditioner

    return KWNGPreconditioner(model, optimizer=optimizer, num_basis=spec["num_basis"], eps=1e-5, lam=0.0,
                              kernel=spec["kernel"], bandwidth="mean_sq", sigma0=1.0, damping=spec["damping"],
                              lm_interval=5, lm_omega=0.85, lm_low=0.25, lm_high=0.75, adapt_eps=True,
                              clip_norm=CLIP_NORM, mode="fast", diagonal_only=spec["diagonal_only"])


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
def evaluate(model: nn.Module, data: GPUAugmentedData, U: nn.Module | None, batch_size: int = 1000
             ) -> tuple[float, float]:
    """Mean cross-entropy of ``U h_θ(z)`` and accuracy of its arg-max on ``data`` (eval mode, no aug)."""
    was = model.training
    model.eval()
    loss_sum = torch.zeros((), device=data.device, dtype=torch.float64)
    correct = torch.zeros((), device=data.device, dtype=torch.long)
    for z, y in data.eval_batches(batch_size):
        out = model(z)
        out = U(out) if U is not None else out
        loss_sum += F.cross_entropy(out, y, reduction="sum").double()
        correct += (out.argmax(1) == y).sum()
    model.train(was)
    return float(loss_sum) / len(data), float(correct) / len(data)


# --------------------------------------------------------------------------------------------- run
def run(cfg: RunConfig | dict, progress: bool = True, force: bool = False) -> dict:
    """Train one configuration to completion (or to ``stop_after_epoch`` / ``max_steps`` / ``deadline``),
    resuming from its checkpoint if one exists. Returns the metrics record (also written to disk).

    A run directory written with another identity (:func:`kwng.experiments.guard.run_identity`: step
    size, epochs, model, data, batch, method spec, ...) is refused, never resumed, skipped or
    overwritten; so is an unfinished record whose checkpoint is gone. ``force`` moves such results to
    a dated backup and starts afresh."""
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
    U = _conditioning(cfg)
    U = U.to(device) if U is not None else None
    optimizer = _optimizer(cfg, model, lr)
    E = cfg["epochs"]
    milestones = sorted({max(1, round(0.5 * E)), max(1, round(0.75 * E))} - {E})
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.1)
    precond = _preconditioner(cfg, model, optimizer, U, device)
    data_gen = torch.Generator().manual_seed(10_000 + cfg["seed"])
    record = {"config": dict(cfg), "identity": identity, "lr": lr, "milestones": milestones, "batch_size": cfg.batch,
              "method_spec": cfg.spec, "clip_norm": CLIP_NORM, "epochs": [], "complete": False,
              "diverged": False, "train_size": len(train), "eval_size": len(test),
              "eval_split": "validation (held out of train)" if cfg["val_size"] else "test"}
    start_epoch, steps, time_train = 0, 0, 0.0
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
        log.info("%s: resumed after epoch %d", rdir, start_epoch)
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
    model.train()
    for epoch in range(start_epoch, E):
        if steps >= total_steps:
            break
        _sync(device)
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        correct = torch.zeros((), device=device, dtype=torch.long)
        seen, fallback_kfac, stopped = 0, 0, None
        for z, yb in train.batches(cfg.batch, data_gen):
            if cfg["deadline"] is not None and time.time() > cfg["deadline"]:
                stopped = "deadline"
                break
            optimizer.zero_grad(set_to_none=True)
            outputs = model(z)
            scaled = U(outputs) if U is not None else outputs
            loss = F.cross_entropy(scaled, yb)
            if kind == "kwng":
                precond.step(loss, scaled if cfg.spec["estimator_input"] == "scaled" else outputs)
            elif kind in ("kfac", "ekfac"):
                fallback_kfac += precond.step(loss, outputs, inputs=z)["fallback"]
            else:
                from ..baselines import clip_grad_norm

                loss.backward()
                clip_grad_norm(model.parameters(), CLIP_NORM)
            optimizer.step()
            loss_sum += loss.detach().double() * len(yb)
            correct += (scaled.detach().argmax(1) == yb).sum()
            seen += len(yb)
            steps += 1
            if bar is not None:
                bar.update(1)
            if steps % 50 == 0 and not bool(torch.isfinite(loss_sum)):
                break
            if steps >= total_steps:
                break
        if stopped == "deadline":
            log.warning("%s: deadline reached during epoch %d; the last checkpoint is kept", rdir, epoch + 1)
            record["stopped"] = "deadline"
            break
        _sync(device)
        time_train += time.perf_counter() - t0
        scheduler.step()
        te = time.perf_counter()
        test_loss, test_acc = evaluate(model, test, U, cfg["eval_batch_size"])
        row = {"epoch": epoch + 1, "steps": steps, "lr": optimizer.param_groups[0]["lr"],
               "train_loss": float(loss_sum) / max(seen, 1), "train_acc": float(correct) / max(seen, 1),
               "test_loss": test_loss, "test_acc": test_acc, "time_train": time_train,
               "time_eval": time.perf_counter() - te}
        if kind == "kwng":
            c = precond.counters()
            row.update(eps=precond.eps, fallbacks=c["fallbacks"], clipped=c["clipped"],
                       ill_conditioned=c["ill_conditioned"])
        elif kind in ("kfac", "ekfac"):
            prev = record["epochs"][-1]["fallbacks"] if record["epochs"] else 0
            row["fallbacks"] = prev + int(fallback_kfac)
        record["epochs"].append(row)
        finished = epoch + 1 == E or steps >= total_steps
        if not math.isfinite(row["train_loss"]):
            record["diverged"] = True
            finished = True
        record["complete"] = finished
        log.info("%s epoch %d: train %.4f/%.3f test %.4f/%.3f (%.1fs)", rdir, epoch + 1, row["train_loss"],
                 row["train_acc"], test_loss, test_acc, time_train)
        if not finished:
            ck = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                  "scheduler": scheduler.state_dict(), "precond": precond.state_dict() if precond else None,
                  "data_gen": data_gen.get_state(), "rng": _rng_state(device), "record": record,
                  "epoch": epoch + 1, "steps": steps, "time_train": time_train}
            ckpt_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = ckpt_path.with_suffix(f".{os.getpid()}.tmp")
            torch.save(ck, tmp)
            os.replace(tmp, ckpt_path)
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
def build_plan(name: str, dataset: str = "cifar10", epochs: int = 6, select_steps: int = 120,
               select_subset: int = 10_000, select_val: int = 2_000, data_root: str | None = None) -> list[dict]:
    """Run lists. ``select``: every method of :data:`SELECT_METHODS` × {ill, well} × :data:`LR_GRID` for
    ``select_steps`` steps on ``select_subset`` training images, evaluated on ``select_val`` held-out
    training images. ``main``: in priority order — seed 0 of sgd/adam/kwng in both conditionings,
    seeds 1–2 of those, seed 0 of the other methods in both conditionings, the ablations (ill only)."""
    common = {"dataset": dataset, "data_root": data_root}
    if name == "select":
        jobs = []
        for cond in ("ill", "well"):
            for m in SELECT_METHODS:
                for lr in LR_GRID:
                    jobs.append({**common, "conditioning": cond, "method": m, "seed": 0, "epochs": 100, "lr": lr,
                                 "max_steps": select_steps, "train_subset": select_subset, "val_size": select_val,
                                 "out": str(SELECTION / f"lr{lr:g}")})
        # expensive methods first so that they do not form the tail
        order = {"ekfac": 0, "kfac": 1, "kwng": 2, "kwng_momentum": 3}
        return sorted(jobs, key=lambda j: order.get(j["method"], 9))
    if name == "main":
        jobs = []
        base = {**common, "epochs": epochs, "lr": "selected"}
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
    raise ValueError(f"plan must be 'select', 'main' or a JSON file of run settings, got {name!r}")


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


def sweep(plan: list[dict], gpus: int, procs_per_gpu: int, deadline_s: float | None, plan_file: Path) -> int:
    """Spawn ``gpus × procs_per_gpu`` worker processes over ``plan`` and wait for them."""
    if gpus < 0 or procs_per_gpu < 1:
        raise ValueError(f"gpus must be >= 0 and procs_per_gpu >= 1, got {gpus}, {procs_per_gpu}")
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
    """Seconds per training step of each method alone on ``device`` (random inputs, batch of the method)."""
    dev = _device(device)
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True
    res = {}
    for m in methods:
        cfg = RunConfig(dataset=dataset, conditioning=conditioning, method=m, lr=0.01, model=model_name)
        torch.manual_seed(0)
        model = _build_model(cfg).to(dev)
        U = _conditioning(cfg)
        U = U.to(dev) if U is not None else None
        opt = _optimizer(cfg, model, 0.01)
        pc = _preconditioner(cfg, model, opt, U, dev)
        z = torch.randn(cfg.batch, 3, 32, 32, device=dev)
        y = torch.randint(0, NUM_CLASSES[dataset], (cfg.batch,), device=dev)
        from ..baselines import clip_grad_norm

        for i in range(warmup + steps):
            if i == warmup:
                _sync(dev)
                t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            outputs = model(z)
            scaled = U(outputs) if U is not None else outputs
            loss = F.cross_entropy(scaled, y)
            kind = cfg.spec.get("precond")
            if kind == "kwng":
                pc.step(loss, scaled if cfg.spec["estimator_input"] == "scaled" else outputs)
            elif kind in ("kfac", "ekfac"):
                pc.step(loss, outputs, inputs=z)
            else:
                loss.backward()
                clip_grad_norm(model.parameters(), CLIP_NORM)
            opt.step()
        _sync(dev)
        sec = (time.perf_counter() - t0) / steps
        res[m] = {"sec_per_step": sec, "batch_size": cfg.batch}
        log.info("timing %s: %.2f ms/step", m, 1e3 * sec)
        del model, opt, pc
    rec = {"device": str(dev), "steps": steps, "warmup": warmup, "conditioning": conditioning,
           "note": "KFAC refreshes every 100 steps: its per-step time here includes the refresh share only if "
                   "steps >= 100", "methods": res}
    atomic_write_json(out, rec)
    write_provenance(out.parent, {"command": "timing", "methods": list(methods)}, device=str(dev))
    return rec


def schedule_epochs(timing_file: Path, plan: list[dict], budget_s: float, concurrency_gain: float = 1.5,
                    lo: int = 3, hi: int = 15, train_size: int = 50_000) -> int:
    """The largest number of epochs (in ``[lo, hi]``) with which ``plan`` fits ``budget_s`` seconds,
    from the per-step times of ``timing_file`` and an assumed throughput gain of concurrent processes."""
    t = read_json(timing_file)["methods"]
    per_epoch = 0.0
    for j in plan:
        m = j["method"]
        bs = METHODS[m].get("batch_size", BATCH_SIZE)
        sec = t.get(m, t.get("kwng", {"sec_per_step": 0.02}))["sec_per_step"]
        per_epoch += math.ceil(train_size / bs) * sec + 0.5  # + evaluation
    e = int(budget_s * concurrency_gain // per_epoch)
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


# -------------------------------------------------------------------------------------------- CLI
def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kwng.experiments cifar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="cifar10", choices=DATASETS)
    p.add_argument("--conditioning", default="ill", choices=CONDITIONINGS)
    p.add_argument("--method", default="kwng", choices=list(METHODS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--lr", default="selected", help="a step size or 'selected' (from `cifar select`)")
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
                        stop_after_epoch=a.stop_after_epoch, selection_file=a.selection_file, download=a.download)
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
        a = p.parse_args(rest)
        if sub == "worker":
            jobs = list(read_json(a.plan))
            jobs = jobs[a.offset:] + jobs[:a.offset]  # spread the first claims over the plan
            ff = Path(a.plan).with_name(f"{Path(a.plan).stem}.failures-{a.session}-{os.getpid()}.json")
            return 1 if worker(jobs, a.session, a.deadline, ff) else 0
        epochs = a.epochs
        if epochs == "auto":
            epochs = int(read_json(RESULTS / "schedule.json")["epochs"])
        plan = build_plan(a.plan, a.dataset, int(epochs), select_steps=a.select_steps, data_root=a.data_root)
        plan_file = CHECKPOINTS / "plans" / f"{Path(a.plan).stem}.json"
        log.info("sweep %s: %d runs on %d GPU(s) × %d processes", a.plan, len(plan), a.gpus, a.procs_per_gpu)
        return sweep(plan, a.gpus, a.procs_per_gpu, a.deadline_s, plan_file)
    p.add_argument("--force", action="store_true", help="replace a different existing output file "
                   "(select, timing, schedule), moving it to a dated backup first")
    if sub == "select":
        p.add_argument("--root", default=str(SELECTION))
        a = p.parse_args(rest)
        out = select_lrs(a.root, force=a.force)
        for k, v in sorted(out["selected"].items()):
            log.info("selected %s: lr=%g (held-out acc %.3f)", k, v["lr"], v["val_acc"])
        return 0
    if sub == "timing":
        p.add_argument("--methods", default="all")
        p.add_argument("--dataset", default="cifar10", choices=DATASETS)
        p.add_argument("--conditioning", default="ill", choices=CONDITIONINGS)
        p.add_argument("--steps", type=int, default=30)
        p.add_argument("--warmup", type=int, default=5)
        p.add_argument("--device", default=None)
        p.add_argument("--model", default="resnet18", choices=("resnet18", "tiny"))
        p.add_argument("--out", default=str(RESULTS / "timing" / "timing.json"))
        a = p.parse_args(rest)
        methods = list(METHODS) if a.methods == "all" else a.methods.split(",")
        for f in (Path(a.out), Path(a.out).parent / "provenance.json"):
            if f.exists() and not a.force:
                raise guard.ConfigMismatchError(f"{f} exists; {guard.FORCE_HINT}")
            if f.exists():
                guard.backup(f)
        timing(methods, a.dataset, a.conditioning, a.steps, a.warmup, a.device, Path(a.out), a.model)
        return 0
    if sub == "schedule":
        p.add_argument("--budget-s", type=float, required=True)
        p.add_argument("--timing", default=str(RESULTS / "timing" / "timing.json"))
        p.add_argument("--concurrency-gain", type=float, default=1.5)
        p.add_argument("--min-epochs", type=int, default=3)
        p.add_argument("--max-epochs", type=int, default=15)
        p.add_argument("--out", default=str(RESULTS / "schedule.json"))
        a = p.parse_args(rest)
        e = schedule_epochs(Path(a.timing), build_plan("main"), a.budget_s, a.concurrency_gain, a.min_epochs,
                            a.max_epochs)
        guard.write_json_guarded(a.out, {"epochs": e, "budget_s": a.budget_s, "concurrency_gain": a.concurrency_gain,
                                         "milestones": "50% and 75% of the epochs, x0.1"}, a.force)
        log.info("schedule: %d epochs", e)
        print(e)
        return 0
    if sub == "check":
        p.add_argument("--root", default=str(RESULTS))
        p.add_argument("--dataset", default="cifar10", choices=DATASETS)
        a = p.parse_args(rest)
        res = check_results(a.root, a.dataset)
        print(json.dumps({k: len(v) for k, v in res.items()}), json.dumps(res["missing"] + res["incomplete"]),
              "cut by the budget (documented):", json.dumps(res["cut"]))
        return 0 if not res["missing"] and not res["incomplete"] else 1
    raise ValueError(f"unknown cifar subcommand {sub!r}; use sweep, worker, select, timing, schedule or check")
