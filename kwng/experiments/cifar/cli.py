"""The CIFAR classification study (paper §4.2, App. D.2; book chapter
:ref:`experiments-cifar`): the command line, and every name of the study in one place.

Two studies share this runner:

* the **claim suite** (plans ``claim_select`` and ``claim``, results under
  ``results/cifar/claim/``): the methods of ``CLAIM_METHODS`` with the network ``z ↦ U
  h_θ(z)`` (:class:`kwng.experiments.cifar.nets.ConditionedNetwork`, ``U`` inside the
  network as in the authors' code, so the KWNG samples are ``U h_θ(z)``;
  ``kwng_samples_before_U`` is the ablation on ``h_θ(z)``), the authors' ε convention
  (:func:`kwng.engine.config.eps_from_authors`), step sizes chosen from
  :data:`~kwng.experiments.cifar.methods.LR_GRID` by 2-epoch runs scored on a validation
  split of the training set, and one schedule for every method: constant step, ×0.1 for
  the last ~15 % of the epochs (:func:`~kwng.experiments.cifar.methods.milestones_for`);
* the **earlier 6-epoch study** (plans ``select`` and ``main``, results under
  ``results/cifar/cifar10``), kept readable: its methods keep their definitions (samples
  before ``U``, our ε convention).

Split by job: :mod:`kwng.experiments.cifar.methods` (method table, run configuration,
construction of model and optimizer), :mod:`~kwng.experiments.cifar.steps` (the one step
protocol :class:`~kwng.experiments.cifar.steps.MethodStep`),
:mod:`~kwng.experiments.cifar.train` (one run), :mod:`~kwng.experiments.cifar.metrics`
(per-epoch measurements), :mod:`~kwng.experiments.cifar.sweep` (plans, workers, timing,
schedule), :mod:`~kwng.experiments.cifar.results` (loading, checks, selection rule) and
:mod:`~kwng.experiments.cifar.verdicts` (the decision rules). This module is the command
line.

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
  diagnostics (``INFO_KEYS``). The options are the fields of
  :class:`~kwng.experiments.cifar.config.RunConfig`. With ``KWNG_SCALE=small`` (the
  default, see :mod:`kwng.config`) the settings not given on the command line are the
  small ones (:meth:`~kwng.experiments.cifar.config.RunConfig.small`: the tiny network
  on the committed sample, 2 epochs, results under ``scratch/``); ``KWNG_SCALE=full``
  gives the study's (ResNet-18, the full data set, 30 epochs, ``results/cifar``).
* ``cifar sweep --plan claim_select|claim|authors100|fig3|<file.json> --gpus N
  --procs-per-gpu P [--deadline-s S]`` — runs the plan in ``N × P`` worker processes,
  one run per worker first (assigned so that the GPUs get similar loads), then any
  unfinished run; finished runs are skipped, interrupted ones resume from their
  checkpoint.
* ``cifar select [--root results/cifar/claim/selection]`` — applies the selection rule.
* ``cifar timing`` — seconds per step of every method, one at a time on an otherwise
  idle device.
* ``cifar schedule --plan claim --budget-s B --gpus N`` — the number of epochs that fits
  a budget.
* ``cifar check [--suite claim|study6|authors100|fig3]`` — completeness of the results
  (:func:`~kwng.experiments.cifar.results.check_claim`,
  :func:`~kwng.experiments.cifar.results.check_results`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from kwng import config
from kwng.experiments import guard
from kwng.experiments.cifar.commands import COMMANDS
from kwng.experiments.cifar.config import SETTINGS, RunConfig, add_run_options
from kwng.experiments.cifar.data import DATASETS
from kwng.experiments.cifar.methods import CHECKPOINTS, CLAIM
from kwng.experiments.cifar.plans import PLAN_NAMES, build_plan
from kwng.experiments.cifar.sweep import (
    run_lock_for,
    sweep,
    worker,
)
from kwng.experiments.cifar.train import (
    run,
)
from kwng.experiments.cli_checks import (
    device_problem,
    int_arg,
    number_arg,
    path_problem,
)
from kwng.experiments.provenance import ResultFileError, read_json

__all__ = ["main", "run_config_from_args"]

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- one run
def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kwng.experiments cifar",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(p)
    p.add_argument("--force", action="store_true", help="if the run directory holds "
                   "results of another configuration (or a record without its "
                   "checkpoint), move them to a dated backup")
    p.add_argument("--no-progress", action="store_true")
    return p


def run_config_from_args(a: argparse.Namespace) -> RunConfig:
    """The :class:`~kwng.experiments.cifar.config.RunConfig` of a parsed single-run
    command line: the settings it does not give come from the scale's preset
    (:meth:`~kwng.experiments.cifar.config.RunConfig.small` at ``KWNG_SCALE=small``)."""
    given = {k: v for k, v in vars(a).items()
             if k in SETTINGS and v is not None and v is not False}
    preset = RunConfig.small if config.scale() == "small" else RunConfig.full
    return preset(**given)


def _main_run(rest: list[str]) -> int:
    p = _run_parser()
    a = p.parse_args(rest)
    problem = path_problem(a, ("out", "checkpoint_dir", "data_root", "selection_file"))
    if problem or device_problem(a.device):
        p.error(problem or device_problem(a.device))
    try:
        cfg = run_config_from_args(a)
    except ValueError as exc:
        p.error(str(exc))
    log.info("configuration (KWNG_SCALE=%s): %s", config.scale(),
             json.dumps(cfg.to_dict()))
    if a.data_root is not None and config.scale() == "small" and a.model is None:
        log.warning("KWNG_SCALE=small: --data-root trains the small model %r on the "
                    "data at %s (KWNG_SCALE=full or --model resnet18: the study's "
                    "network)", cfg.model, a.data_root)
    try:
        with run_lock_for(cfg):
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
        if not sep or key not in SETTINGS:
            raise ValueError(f"--set takes KEY=VALUE with KEY one of "
                             f"{sorted(SETTINGS)}, got {it!r}")
        try:
            out[key] = json.loads(val)
        except json.JSONDecodeError:
            out[key] = val
    return out


def _plan_arg(text: str) -> str:
    """``--plan``: a named plan or an existing JSON file of run settings."""
    if text in PLAN_NAMES or Path(text).is_file():
        return text
    raise argparse.ArgumentTypeError(f"must be one of {', '.join(PLAN_NAMES)} or a "
                                     f"JSON file of run settings, got {text!r}")


def _epochs_arg(text: str) -> str:
    """``--epochs`` of a sweep: an integer >= 1 or ``auto``."""
    try:
        return text if text == "auto" else str(int_arg(1)(text))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 1 or 'auto', got {text!r}") from None


def _sweep_arguments(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--plan", required=True, type=_plan_arg,
        help=f"{', '.join(PLAN_NAMES)} or a JSON file of run settings")
    add("--dataset", default="cifar10", choices=DATASETS)
    add("--epochs", default="6", type=_epochs_arg,
        help="an integer, or 'auto' (from the schedule file)")
    add("--data-root", default=None)
    add("--gpus", type=int_arg(0), default=1)
    add("--procs-per-gpu", type=int_arg(1), default=4)
    add("--deadline-s", type=number_arg(0), default=None,
        help="stop starting/continuing runs after this")
    add("--start-by-s", type=number_arg(0), default=None,
        help="start no run after this many seconds (a run begun later could not "
             "finish before the machine goes back)")
    add("--finish-by-s", type=number_arg(0), default=None,
        help="start no run whose estimated duration (a plan's est_s) would end it "
             "after this many seconds")
    add("--select-epochs", type=int_arg(1), default=2,
        help="claim_select: epochs of each run")
    add("--select-subset", type=int_arg(1), default=None, help="claim_select: "
        "training images per run (default: all but the held-out ones)")
    add("--select-val", type=int_arg(1), default=5_000,
        help="claim_select: held-out images")
    add("--timing", default=None, help="a timing file (`cifar timing`) to balance the "
        "GPUs")
    add("--methods", default=None, help="comma list: only these methods' runs")
    add("--force", action="store_true", help="back up finished runs of another config")
    add("--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a run setting in every run of the plan (e.g. model=tiny for a "
             "CPU smoke test); VALUE is read as JSON if it parses, else as a string")


def _worker_arguments(p: argparse.ArgumentParser) -> None:
    """A sweep's worker process (started by the sweep, never by hand): its plan file,
    session, slot and the sweep's limits as Unix times."""
    add = p.add_argument
    add("--plan", required=True, help="the sweep's plan file")
    add("--session", default=None)
    add("--offset", type=int_arg(0), default=0)
    add("--deadline", type=number_arg(0), default=None)
    add("--start-by", type=number_arg(0), default=None)
    add("--finish-by", type=number_arg(0), default=None)


def _main_worker(a: argparse.Namespace) -> int:
    # a sweep started in the background by a non-interactive shell starts its workers
    # with SIGINT ignored; the sweep passes a SIGINT on, so the worker must hear it
    signal.signal(signal.SIGINT, signal.default_int_handler)
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
    return 1 if worker(jobs, a.session, a.deadline, ff, a.start_by,
                       a.finish_by) else 0


def _main_sweep(a: argparse.Namespace) -> int:
    epochs = a.epochs
    if epochs == "auto":
        epochs = int(read_json(CLAIM / "schedule.json")["epochs"])
    only = a.methods.split(",") if a.methods else None
    if a.plan == "claim_select":
        plan = build_plan(a.plan, a.dataset, int(epochs), select_subset=a.select_subset,
                          select_val=a.select_val, data_root=a.data_root,
                          select_epochs=a.select_epochs, methods=only)
    else:
        plan = build_plan(a.plan, a.dataset, int(epochs), data_root=a.data_root,
                          methods=only)
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
                 force=a.force, start_by_s=a.start_by_s,
                 finish_by_s=a.finish_by_s)


# ----------------------------------------------------- select, timing, schedule, check


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
    if sub not in COMMANDS and sub not in ("sweep", "worker"):
        argparse.ArgumentParser(prog="python -m kwng.experiments cifar").error(
            f"unknown cifar subcommand {sub!r}; use sweep, worker, "
            f"{', '.join(COMMANDS)} (or options only: one run)")
    p = argparse.ArgumentParser(prog=f"python -m kwng.experiments cifar {sub}")
    try:  # a refusal (other configuration, unreadable or missing file): rc 2, named
        if sub in ("sweep", "worker"):
            (_worker_arguments if sub == "worker" else _sweep_arguments)(p)
            a = p.parse_args(rest)
            return _main_worker(a) if sub == "worker" else _main_sweep(a)
        p.add_argument("--force", action="store_true", help="replace a different "
                       "existing output file (select, timing, schedule), moving it to "
                       "a dated backup first")
        return COMMANDS[sub](p, rest)
    except (guard.ConfigMismatchError, ResultFileError, FileNotFoundError) as exc:
        log.error("refused: %s", exc)
        return 2
    except ValueError as exc:  # a setting no option type could check alone
        p.error(str(exc))
