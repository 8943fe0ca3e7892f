"""The CIFAR classification study (paper §4.2, App. D.2; book chapter
:ref:`experiments-cifar`): the command line, and every name of the study in one place.

Two studies share this runner:

* the **claim suite** (plans ``claim_select`` and ``claim``, results under
  ``results/cifar/claim/``): the methods of ``CLAIM_METHODS`` with the network
  ``z ↦ U h_θ(z)`` (:class:`kwng.nets.ConditionedNetwork`, ``U`` inside the network as
  in the authors' code, so the KWNG samples are ``U h_θ(z)``; ``kwng_samples_before_U``
  is the ablation on ``h_θ(z)``), the authors' ε convention
  (:func:`kwng.precond_config.eps_from_authors`), step sizes chosen from
  :data:`LR_GRID` by 2-epoch runs scored on a validation split of the training set, and
  one schedule for every method: constant step, ×0.1 for the last ~15 % of the epochs
  (:func:`~kwng.experiments.cifar_methods.milestones_for`);
* the **earlier 6-epoch study** (plans ``select`` and ``main``, results under
  ``results/cifar/cifar10``), kept readable: its methods keep their definitions (samples
  before ``U``, our ε convention).

Split by job: :mod:`kwng.experiments.cifar_methods` (method table, run configuration,
construction of model, optimizer and preconditioner, the one step protocol
:class:`~kwng.experiments.cifar_methods.MethodStep`),
:mod:`~kwng.experiments.cifar_train` (one run), :mod:`~kwng.experiments.cifar_metrics`
(per-epoch measurements), :mod:`~kwng.experiments.cifar_sweep` (plans, workers, timing,
schedule) and :mod:`~kwng.experiments.cifar_results` (loading, checks, selection rule).
This module is the command line; it re-exports their names (``cifar.run``, ...).

Commands (``python -m kwng.experiments cifar ...``):

* ``cifar --conditioning ill --method kwng --seed 0 --epochs 30 --lr 1`` — one run:
  batch 128, the paper's augmentation, the update clipped to norm 1 for every method.
  After every epoch (and at a deadline, mid-epoch) a checkpoint (``checkpoints/``:
  model, optimizer, preconditioner, every RNG state, the position in the epoch: exact
  resume) and the per-epoch record, written atomically to
  ``<out>/<dataset>/<conditioning>/<method>/seed<k>/metrics.json`` with
  ``provenance.json``. Per epoch: training loss/accuracy, test loss/accuracy, per-class
  test accuracy, last-layer row norms, the mean share of each update's squared norm on
  the last layer, and for KWNG the epoch mean and last value of the preconditioner's
  diagnostics (``INFO_KEYS``). With ``KWNG_SCALE=small`` (the default, see
  :mod:`kwng.config`) the settings not given on the command line are the small ones
  (:data:`SMALL_RUN`: the tiny network on the committed sample, 2 epochs, results under
  ``scratch/``); ``KWNG_SCALE=full`` gives the study's (ResNet-18, the full data set, 30
  epochs, ``results/cifar``).
* ``cifar sweep --plan claim_select|claim|select|main|<file.json> --gpus N
  --procs-per-gpu P [--deadline-s S]`` — runs the plan in ``N × P`` worker processes,
  one run per worker first (assigned so that the GPUs get similar loads), then any
  unfinished run; finished runs are skipped, interrupted ones resume from their
  checkpoint.
* ``cifar select [--root results/cifar/claim/selection]`` — applies the selection rule.
* ``cifar timing`` — seconds per step of every method, one at a time on an otherwise
  idle device.
* ``cifar schedule --plan claim --budget-s B --gpus N`` — the number of epochs that fits
  a budget.
* ``cifar check [--suite claim|study6]`` — completeness of the results
  (:func:`~kwng.experiments.cifar_results.check_claim`,
  :func:`~kwng.experiments.cifar_results.check_results`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from .. import config
from ..data import DATASETS
from ..provenance import ResultFileError, read_json
from . import guard
from .cifar_methods import (  # noqa: F401  (re-exported: cifar.X)
    BATCH_SIZE,
    CHECKPOINTS,
    CLAIM,
    CLAIM_ABLATIONS,
    CLAIM_METHODS,
    CLAIM_SELECTION,
    CLAIM_TWO_SEEDS,
    CLIP_NORM,
    CONDITION_NUMBER,
    CONDITIONINGS,
    EPS_AUTHORS,
    EPS_BOUNDS_AUTHORS,
    INFO_KEYS,
    LR_GRID,
    METHODS,
    MODELS,
    PRECISIONS,
    RESULTS,
    SCHEDULES,
    SELECT_METHODS,
    MethodStep,
    RunConfig,
    build_model,
    build_optimizer,
    make_step,
    milestones_for,
)
from .cifar_metrics import evaluate  # noqa: F401
from .cifar_results import (  # noqa: F401
    BUDGET_CUT,
    check_claim,
    check_results,
    load_results,
    select_lrs,
)
from .cifar_sweep import (  # noqa: F401
    _is_complete,
    assign_slots,
    build_plan,
    job_cost,
    schedule_epochs,
    sweep,
    timing,
    worker,
)
from .cifar_train import (  # noqa: F401
    checkpoint_path_for,
    resolve_lr,
    run,
    run_dir_for,
    train_step,
)
from .cli_checks import device_problem, lr_arg, path_problem

__all__ = ["METHODS", "LR_GRID", "SELECT_METHODS", "CLAIM_METHODS", "CLAIM_TWO_SEEDS",
           "CLAIM_ABLATIONS", "CONDITIONINGS", "SCHEDULES", "INFO_KEYS", "RunConfig",
           "run", "run_dir_for", "milestones_for", "evaluate",
           "build_plan", "select_lrs", "check_results", "check_claim", "load_results",
           "main", "BUDGET_CUT", "MethodStep", "make_step",
           "SMALL_RUN", "run_config_from_args"]

log = logging.getLogger(__name__)

#: the single run's settings at ``KWNG_SCALE=small`` when the command line does not give
#: them (``source`` only when ``--data-root`` is not given either); ``full`` keeps the
#: study's defaults
SMALL_RUN = {"model": "tiny", "source": "sample", "epochs": 2,
             "out": str(Path("scratch") / "cifar")}
_FULL_RUN = {"model": "resnet18", "source": "auto", "epochs": 30, "out": str(RESULTS)}


# ----------------------------------------------------------------------------- one run
def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kwng.experiments cifar",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--dataset", default="cifar10", choices=DATASETS)
    add("--conditioning", default="ill", choices=CONDITIONINGS)
    add("--method", default="kwng", choices=list(METHODS))
    add("--seed", type=int, default=0)
    add("--epochs", type=int, default=None, help="default: 30 (full scale), 2 (small)")
    add("--lr", default="selected", type=lr_arg,
        help="a step size or 'selected' (`cifar select`)")
    add("--schedule", default="claim", choices=SCHEDULES)
    add("--capture", action="store_true", help="replay the training step from a CUDA "
        "graph (CUDA only; KFAC/EKFAC run eagerly)")
    add("--precision", default="fp32", choices=PRECISIONS,
        help="the network's forward/backward: fp32 (TF32 on CUDA) or bf16 autocast")
    add("--channels-last", action="store_true", help="the network in channels_last")
    add("--data-root", default=None)
    add("--source", default=None, choices=("auto", "official", "jpeg", "sample"),
        help="default: auto (full scale, or with --data-root), sample (small)")
    add("--download", action="store_true",
        help="download the official archive via torchvision")
    add("--device", default=None)
    add("--out", default=None, help=f"default: {RESULTS} (full scale), "
        f"{SMALL_RUN['out']} (small)")
    add("--checkpoint-dir", default=str(CHECKPOINTS))
    add("--train-subset", type=int, default=None)
    add("--val-size", type=int, default=0)
    add("--max-steps", type=int, default=None)
    add("--model", default=None, choices=MODELS,
        help="default: resnet18 (full scale), tiny (small)")
    add("--batch-size", type=int, default=None)
    add("--stop-after-epoch", type=int, default=None,
        help="stop (checkpointed) after this epoch")
    add("--selection-file", default=None)
    add("--force", action="store_true", help="if the run directory holds results of "
        "another configuration (or a record without its checkpoint), move them to a "
        "dated backup")
    add("--no-progress", action="store_true")
    return p


def run_config_from_args(a: argparse.Namespace) -> RunConfig:
    """The :class:`RunConfig` of a parsed single-run command line: the settings it does
    not give come from the scale (:data:`SMALL_RUN` at ``KWNG_SCALE=small``)."""
    scaled = dict(SMALL_RUN if config.scale() == "small" else _FULL_RUN)
    if a.data_root is not None:
        scaled["source"] = "auto"
    keys = ("dataset", "conditioning", "method", "seed", "epochs", "lr", "data_root",
            "source", "device", "out", "checkpoint_dir", "train_subset", "val_size",
            "max_steps", "model", "batch_size", "stop_after_epoch", "selection_file",
            "download", "schedule", "capture", "precision", "channels_last")
    given = {k: getattr(a, k) for k in keys}
    return RunConfig(**{k: scaled[k] if v is None and k in scaled else v
                        for k, v in given.items()})


def _main_run(rest: list[str]) -> int:
    p = _run_parser()
    a = p.parse_args(rest)
    problem = path_problem(a, ("out", "checkpoint_dir", "data_root", "selection_file"))
    if problem or device_problem(a.device):
        p.error(problem or device_problem(a.device))
    cfg = run_config_from_args(a)
    log.info("configuration (KWNG_SCALE=%s): %s", config.scale(), json.dumps(dict(cfg)))
    if a.data_root is not None and config.scale() == "small" and a.model is None:
        log.warning("KWNG_SCALE=small: --data-root trains the small model %r on the "
                    "data at %s (KWNG_SCALE=full or --model resnet18: the study's "
                    "network)", cfg["model"], a.data_root)
    try:
        rec = run(cfg, progress=not a.no_progress, force=a.force)
    except (guard.ConfigMismatchError, ResultFileError, FileNotFoundError,
            ValueError) as exc:
        log.error("refused: %s", exc)
        return 2
    if rec["epochs"]:
        log.info("final: %s", rec["epochs"][-1])
    return 0


# ------------------------------------------------------------------------ sweep, worker
def _overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for it in items:
        key, sep, val = it.partition("=")
        if not sep or key not in RunConfig.DEFAULTS:
            raise ValueError(f"--set takes KEY=VALUE with KEY one of "
                             f"{sorted(RunConfig.DEFAULTS)}, got {it!r}")
        try:
            out[key] = json.loads(val)
        except json.JSONDecodeError:
            out[key] = val
    return out


def _sweep_arguments(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--plan", required=True)
    add("--dataset", default="cifar10", choices=DATASETS)
    add("--epochs", default="6", help="an integer, or 'auto' (from the schedule file)")
    add("--data-root", default=None)
    add("--gpus", type=int, default=1)
    add("--procs-per-gpu", type=int, default=4)
    add("--deadline-s", type=float, default=None,
        help="stop starting/continuing runs after this")
    add("--deadline", type=float, default=None)
    add("--session", default=None)
    add("--offset", type=int, default=0)
    add("--select-steps", type=int, default=120)
    add("--select-epochs", type=int, default=2, help="claim_select: epochs of each run")
    add("--select-subset", type=int, default=None, help="claim_select: training images "
        "per run (default: all but the held-out ones)")
    add("--select-val", type=int, default=5_000, help="claim_select: held-out images")
    add("--timing", default=None, help="a timing file (`cifar timing`) to balance the "
        "GPUs")
    add("--methods", default=None, help="comma list: only these methods' runs")
    add("--force", action="store_true", help="back up finished runs of another config")
    add("--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a run setting in every run of the plan (e.g. model=tiny for a "
             "CPU smoke test); VALUE is read as JSON if it parses, else as a string")


def _main_worker(a: argparse.Namespace) -> int:
    jobs = list(read_json(a.plan))
    if any("slot" in j for j in jobs):
        # this worker's assigned run, then the unassigned ones; never another worker's
        # run (that would move it to another GPU and unbalance the loads)
        jobs = ([j for j in jobs if j.get("slot") == a.offset]
                + [j for j in jobs if "slot" not in j])
    else:
        jobs = jobs[a.offset:] + jobs[:a.offset]  # spread the first claims
    stem = Path(a.plan).stem
    ff = Path(a.plan).with_name(f"{stem}.failures-{a.session}-{os.getpid()}.json")
    return 1 if worker(jobs, a.session, a.deadline, ff) else 0


def _main_sweep(a: argparse.Namespace) -> int:
    epochs = a.epochs
    if epochs == "auto":
        sched = (CLAIM if a.plan == "claim" else RESULTS) / "schedule.json"
        epochs = int(read_json(sched)["epochs"])
    only = a.methods.split(",") if a.methods else None
    if a.plan == "claim_select":
        plan = build_plan(a.plan, a.dataset, int(epochs), select_subset=a.select_subset,
                          select_val=a.select_val, data_root=a.data_root,
                          select_epochs=a.select_epochs, methods=only)
    else:
        plan = build_plan(a.plan, a.dataset, int(epochs), select_steps=a.select_steps,
                          data_root=a.data_root, methods=only)
    plan = [{**j, **_overrides(a.set)} for j in plan]
    # sweeps of one plan over disjoint method lists may run side by side: one plan
    # file each
    tag = ("-" + hashlib.sha1(",".join(sorted(only)).encode()).hexdigest()[:8]
           if only else "")
    plan_file = CHECKPOINTS / "plans" / f"{Path(a.plan).stem}{tag}.json"
    timing_rec = read_json(a.timing)["methods"] if a.timing else None
    log.info("sweep %s: %d runs on %d GPU(s) × %d processes", a.plan, len(plan), a.gpus,
             a.procs_per_gpu)
    return sweep(plan, a.gpus, a.procs_per_gpu, a.deadline_s, plan_file, timing_rec,
                 force=a.force)


# ----------------------------------------------------- select, timing, schedule, check
def _main_select(p: argparse.ArgumentParser, rest: list[str]) -> int:
    p.add_argument("--root", default=str(CLAIM_SELECTION))
    a = p.parse_args(rest)
    out = select_lrs(a.root, force=a.force)
    for k, v in sorted(out["selected"].items()):
        log.info("selected %s: lr=%g (held-out acc %.3f)", k, v["lr"], v["val_acc"])
    return 0


def _main_timing(p: argparse.ArgumentParser, rest: list[str]) -> int:
    add = p.add_argument
    add("--methods", default="claim")
    add("--dataset", default="cifar10", choices=DATASETS)
    add("--conditioning", default="ill", choices=CONDITIONINGS)
    add("--steps", type=int, default=30)
    add("--warmup", type=int, default=5)
    add("--device", default=None)
    add("--model", default="resnet18", choices=MODELS)
    add("--out", default=str(CLAIM / "timing" / "timing.json"))
    a = p.parse_args(rest)
    methods = {"all": list(METHODS), "claim": list(CLAIM_METHODS)}.get(
        a.methods, a.methods.split(","))
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ValueError(f"unknown methods {bad}; accepted: 'all', 'claim' or names "
                         f"from {list(METHODS)}")
    for f in (Path(a.out), Path(a.out).parent / "provenance.json"):
        if f.exists() and not a.force:
            raise guard.ConfigMismatchError(f"{f} exists; {guard.FORCE_HINT}")
        if f.exists():
            guard.backup(f)
    timing(methods, a.dataset, a.conditioning, a.steps, a.warmup, a.device, Path(a.out),
           a.model)
    return 0


def _main_trainer_timing(p: argparse.ArgumentParser, rest: list[str]) -> int:
    from .cifar_timing import trainer_timing

    add = p.add_argument
    add("--methods", default="sgd,adam,kfac,kwng")
    add("--conditioning", default="ill", choices=CONDITIONINGS)
    add("--precisions", default="bf16", help="comma list of fp32, bf16")
    add("--epochs", type=int, default=2)
    add("--trace-steps", type=int, default=256)
    add("--data-root", default=None)
    add("--source", default="auto", choices=("auto", "official", "jpeg", "sample"))
    add("--model", default="resnet18", choices=MODELS)
    add("--device", default=None)
    add("--train-subset", type=int, default=None)
    add("--out", default=str(RESULTS / "authors100" / "timing" / "trainer_timing.json"))
    a = p.parse_args(rest)
    res = trainer_timing(a.methods.split(","), Path(a.out), conditioning=a.conditioning,
                         precisions=a.precisions.split(","), epochs=a.epochs,
                         trace_steps=a.trace_steps, data_root=a.data_root,
                         source=a.source, model=a.model, device=a.device,
                         train_subset=a.train_subset, force=a.force)
    for r in res["rows"]:
        log.info("trainer timing %-12s %s %-8s epoch %.2f s (loop %.2f s, "
                 "after %.2f s, "
                 "%.2f ms/step)", r["method"], r["precision"], r["mode"],
                 r["steady_epoch_s"], r["steady_train_s"], r["steady_after_s"],
                 r["steady_ms_per_step"])
    for t in res["loss_match"]:
        log.info("loss match %s over %d steps: captured vs eager %.3g, eager vs eager "
                 "%.3g", t["method"], t["steps"], t["max_rel_diff_captured_vs_eager"],
                 t["max_rel_diff_eager_vs_eager"])
    return 0


def _main_schedule(p: argparse.ArgumentParser, rest: list[str]) -> int:
    add = p.add_argument
    add("--plan", default="claim", choices=("claim", "main"))
    add("--budget-s", type=float, required=True)
    add("--timing", default=str(RESULTS / "timing" / "timing.json"))
    add("--concurrency-gain", type=float, default=1.0)
    add("--gpus", type=int, default=1)
    add("--procs-per-gpu", type=int, default=None)
    add("--min-epochs", type=int, default=1)
    add("--max-epochs", type=int, default=400)
    add("--out", default=None, help="write the schedule here (default: print only)")
    a = p.parse_args(rest)
    plan = build_plan(a.plan)
    e = schedule_epochs(Path(a.timing), plan, a.budget_s, a.concurrency_gain,
                        a.min_epochs, a.max_epochs, gpus=a.gpus,
                        procs_per_gpu=a.procs_per_gpu)
    if a.out:
        guard.write_json_guarded(a.out, {
            "epochs": e, "budget_s": a.budget_s, "concurrency_gain": a.concurrency_gain,
            "gpus": a.gpus, "timing": a.timing, "plan": a.plan, "runs": len(plan),
            "milestones": milestones_for(e, a.plan if a.plan == "claim" else "study6")},
            a.force)
    log.info("schedule: %d epochs fit %.0f s for plan %s (%d runs)", e, a.budget_s,
             a.plan, len(plan))
    print(e)
    return 0


def _main_check(p: argparse.ArgumentParser, rest: list[str]) -> int:
    p.add_argument("--suite", default="claim",
                   choices=("claim", "study6", "authors100"))
    p.add_argument("--tiers", default="1", help="authors100: comma list of tiers")
    p.add_argument("--root", default=None,
                   help="default: results/cifar/claim (claim), results/cifar (study6)")
    p.add_argument("--dataset", default="cifar10", choices=DATASETS)
    p.add_argument("--min-epochs", type=int, default=30)
    a = p.parse_args(rest)
    if a.suite == "authors100":
        from .cifar_results import check_authors100

        res = check_authors100(a.root or RESULTS / "authors100", a.dataset,
                               tuple(int(t) for t in a.tiers.split(",")))
        print(json.dumps({k: len(v) for k, v in res.items()}), "not ok:",
              json.dumps(res["missing"] + res["incomplete"]), "diverged:",
              json.dumps(res["diverged"]))
    elif a.suite == "claim":
        res = check_claim(a.root or CLAIM, a.dataset, a.min_epochs)
        print(json.dumps({k: len(v) for k, v in res.items()}), "not ok:",
              json.dumps(res["missing"] + res["incomplete"]), "diverged:",
              json.dumps(res["diverged"]))
    else:
        res = check_results(a.root or RESULTS, a.dataset)
        print(json.dumps({k: len(v) for k, v in res.items()}),
              json.dumps(res["missing"] + res["incomplete"]),
              "cut by the budget (documented):", json.dumps(res["cut"]))
    return 0 if not res["missing"] and not res["incomplete"] else 1


_WRITERS = {"select": _main_select, "timing": _main_timing, "schedule": _main_schedule,
            "check": _main_check, "trainer-timing": _main_trainer_timing}


def main(argv: list[str] | None = None) -> int:
    """``python -m kwng.experiments cifar [subcommand] ...`` (module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "cifar":
        argv = argv[1:]
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sub = argv[0] if argv and not argv[0].startswith("-") else None
    rest = argv[1:] if sub else argv
    if sub is None:
        return _main_run(rest)
    p = argparse.ArgumentParser(prog=f"python -m kwng.experiments cifar {sub}")
    if sub not in _WRITERS and sub not in ("sweep", "worker"):
        raise ValueError(f"unknown cifar subcommand {sub!r}; use sweep, worker, "
                         "select, timing, trainer-timing, schedule or check")
    try:  # a refusal (other configuration, unreadable or missing file): rc 2, named
        if sub in ("sweep", "worker"):
            _sweep_arguments(p)
            a = p.parse_args(rest)
            return _main_worker(a) if sub == "worker" else _main_sweep(a)
        p.add_argument("--force", action="store_true", help="replace a different "
                       "existing output file (select, timing, schedule), moving it to "
                       "a dated backup first")
        return _WRITERS[sub](p, rest)
    except (guard.ConfigMismatchError, ResultFileError, FileNotFoundError) as exc:
        log.error("refused: %s", exc)
        return 2
