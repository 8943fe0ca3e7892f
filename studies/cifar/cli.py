"""The CIFAR classification study (paper §4.2, App. D.2; book chapter
:ref:`experiments-cifar`): the command line, and every name of the study in one place.

Two studies share this runner:

* the **claim suite** (plans ``claim_select`` and ``claim``, results under
  ``results/cifar/claim/``): the methods of ``CLAIM_METHODS`` with the network ``z ↦ U
  h_θ(z)`` (:class:`studies.cifar.nets.ConditionedNetwork`, ``U`` inside the
  network as in the authors' code, so the KWNG samples are ``U h_θ(z)``;
  ``kwng_samples_before_U`` is the ablation on ``h_θ(z)``), the authors' ε convention
  (:func:`kwng.engine.config.eps_from_authors`), step sizes chosen from
  :data:`~studies.cifar.methods.LR_GRID` by 2-epoch runs scored on a validation
  split of the training set, and one schedule for every method: constant step, ×0.1 for
  the last ~15 % of the epochs (:func:`~studies.cifar.methods.milestones_for`);
* the **earlier 6-epoch study** (plans ``select`` and ``main``, results under
  ``results/cifar/cifar10``), kept readable: its methods keep their definitions (samples
  before ``U``, our ε convention).

Split by job: :mod:`~studies.cifar.config` (the settings of one run),
:mod:`studies.cifar.methods` (the method table),
:mod:`~studies.cifar.steps` (the one step protocol
:class:`~studies.cifar.steps.MethodStep`),
:mod:`~studies.cifar.train` (one run), :mod:`~studies.cifar.metrics`
(per-epoch measurements), :mod:`~studies.cifar.plans` (lists of runs),
:mod:`~studies.cifar.sweep` (worker processes),
:mod:`~studies.cifar.timing` (step and epoch times, the schedule),
:mod:`~studies.cifar.results` (loading, checks, selection rule) and
:mod:`~studies.fig3.verdicts` (the decision rules). This module is the command
line: one run, in one process or in ``W`` under torchrun, and the table of the other
commands (:data:`COMMANDS`), each defined beside what it runs.

Commands (``python -m studies cifar ...``):

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
  :class:`~studies.cifar.config.RunConfig`. With ``KWNG_SCALE=small`` (the
  default, see :mod:`kwng.scale_switch`) the settings not given on the command line are
  the
  small ones (:meth:`~studies.cifar.config.RunConfig.small`: the tiny network
  on the committed sample, 2 epochs, results under ``scratch/``); ``KWNG_SCALE=full``
  gives the study's (ResNet-18, the full data set, 30 epochs, ``results/cifar``).
* ``torchrun --nproc-per-node=W -m studies cifar ddp --epochs 100`` — one run
  of ResNet-18 on CIFAR-10 with KWNG on ``W`` processes (book chapter
  :ref:`distributed`; :func:`ddp_main`).
* ``cifar sweep --plan claim_select|claim|authors100|fig3|<file.json> --gpus N
  --procs-per-gpu P [--deadline-s S]`` — runs the plan in ``N × P`` worker processes,
  one run per worker first (assigned so that the GPUs get similar loads), then any
  unfinished run; finished runs are skipped, interrupted ones resume from their
  checkpoint (:func:`~studies.cifar.sweep.sweep_command`).
* ``cifar select [--root results/cifar/claim/selection]`` — applies the selection rule
  (:func:`~studies.cifar.results.select_command`).
* ``cifar timing`` — seconds per step of every method, one at a time on an otherwise
  idle device; ``cifar trainer-timing`` — the trainer's epochs, eager against captured
  (:mod:`~studies.cifar.timing`).
* ``cifar schedule --plan claim --budget-s B --gpus N`` — the number of epochs that fits
  a budget (:func:`~studies.cifar.timing.schedule_command`).
* ``cifar check [--suite claim|study6|authors100|fig3|amortized_seeds]`` — completeness
  of the results (:func:`~studies.cifar.results.check_command`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from kwng import scale_switch as config
from studies.cifar.config import SETTINGS, RunConfig, add_run_options
from studies.cifar.data import SOURCES
from studies.cifar.methods import PRECISIONS
from studies.cifar.results import check_command, select_command
from studies.cifar.sweep import run_lock_for, sweep_command, worker_command
from studies.cifar.timing import (
    schedule_command,
    timing_command,
    trainer_timing_command,
)
from studies.cifar.train import run
from studies.kit import guard
from studies.kit.cli_checks import (
    device_problem,
    int_arg,
    number_arg,
    path_problem,
)
from studies.kit.provenance import ResultFileError

__all__ = ["main", "run_config_from_args", "ddp_main", "COMMANDS", "PURPOSES"]

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- one run
def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m studies cifar",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(p)
    p.add_argument("--force", action="store_true", help="if the run directory holds "
                   "results of another configuration (or a record without its "
                   "checkpoint), move them to a dated backup")
    p.add_argument("--no-progress", action="store_true")
    return p


def run_config_from_args(a: argparse.Namespace) -> RunConfig:
    """The :class:`~studies.cifar.config.RunConfig` of a parsed single-run
    command line: the settings it does not give come from the scale's preset
    (:meth:`~studies.cifar.config.RunConfig.small` at ``KWNG_SCALE=small``)."""
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


# ---------------------------------------------------- one run on W processes (torchrun)
#: ``--num-basis`` -> the method of that basis size
_METHOD_OF_BASIS = {5: "kwng", 20: "kwng_basis20"}


def _ddp_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchrun ... -m studies cifar ddp",
        description="ResNet-18 on CIFAR-10 with KWNG on W processes (book chapter "
                    "'KWNG on many GPUs')")
    add = p.add_argument
    add("--out", default=str(Path("scratch") / "cifar_ddp"),
        help="results folder (default: the git-ignored scratch/cifar_ddp)")
    add("--checkpoint-dir", default=str(Path("checkpoints") / "cifar_ddp"))
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu",
        choices=("cuda", "cpu"))
    add("--model", default="resnet18", choices=("resnet18", "tiny"))
    add("--epochs", type=int_arg(1), default=100)
    add("--stop-after-epoch", type=int_arg(1), default=None,
        help="stop (checkpointed) after this epoch; rerun to resume")
    add("--batch", type=int_arg(1), default=128, help="per-rank batch")
    add("--lr", type=number_arg(0), default=0.1)
    add("--num-basis", type=int, default=5, choices=tuple(_METHOD_OF_BASIS))
    add("--precision", default="fp32", choices=PRECISIONS)
    add("--capture", action="store_true", help="replay the step from a CUDA graph")
    add("--subset", type=int_arg(1), default=None, help="train on this many images")
    add("--source", default="auto", choices=SOURCES)
    add("--data-root", default=None)
    add("--eval-batch", type=int_arg(1), default=1000)
    add("--seed", type=int_arg(0), default=0)
    add("--timeout", type=number_arg(0), default=600.0,
        help="seconds a collective may wait for the other ranks")
    add("--force", action="store_true",
        help="move results of another configuration to a dated backup")
    add("--no-progress", action="store_true")
    return p


def _ddp_launch_checks(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here (use --device cpu)")
    if args.capture and args.device != "cuda":
        p.error("--capture replays CUDA graphs: it needs --device cuda")
    if "RANK" not in os.environ:
        p.error("launch with torchrun: torchrun --nproc-per-node=W -m "
                "studies cifar ddp ...")


def _ddp_config(args: argparse.Namespace, world: int) -> RunConfig:
    """The run of the command line ``args`` on ``world`` processes, on this rank's
    device (its local GPU, ``LOCAL_RANK``, or the CPU)."""
    device = "cpu"
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    return RunConfig(
        dataset="cifar10", conditioning="well", method=_METHOD_OF_BASIS[args.num_basis],
        seed=args.seed, epochs=args.epochs, lr=args.lr, data_root=args.data_root,
        source=args.source, device=device,
        out=str(Path(args.out) / f"{args.model}-W{world}-B{args.batch}"),
        checkpoint_dir=args.checkpoint_dir, train_subset=args.subset,
        model=args.model, batch_size=args.batch, eval_batch_size=args.eval_batch,
        stop_after_epoch=args.stop_after_epoch, schedule="claim", capture=args.capture,
        precision=args.precision, channels_last=args.device == "cuda",
        world_size=world)


def ddp_main(argv: list[str] | None = None) -> dict | None:
    """``torchrun --nproc-per-node=W -m studies cifar ddp [options]``: one run
    of the one trainer (:func:`studies.cifar.train.run`) on ``W`` processes;
    returns its record. On a CPU (gloo) a small run checks the whole path::

        torchrun --nproc-per-node=2 -m studies cifar ddp --device cpu \\
            --model tiny --source sample --epochs 1 --subset 256 --batch 16

    It starts the process group and trains a
    :class:`~studies.cifar.config.RunConfig` of ``world_size = W``. Every rank
    builds the same *global* batch of ``W × --batch`` images from one data generator
    and trains on its slice, so a ``W``-rank run sees exactly the batches of a
    one-process run at batch ``W·B``; :class:`kwng.engine.distributed.DistributedKWNG`
    gives every rank the direction of that global batch. The method is the claim
    suite's ``kwng`` (plain SGD, ``M = 5``, ``T_tilde`` damping, Gaussian kernel, ``ε``
    and its bounds in the authors' convention for the global batch, clipping at norm 1;
    ``--num-basis 20``: ``kwng_basis20``) on the well-conditioned network; batch norm
    uses each rank's shard statistics (as under DDP) and the running statistics of rank
    0 are copied to every rank before each evaluation.

    As every run: under ``<out>/<model>-W<W>-B<B>/`` the run directory
    ``cifar10/well/<method>/seed<k>`` holds ``metrics.json`` (one row per epoch, with
    the run's identity) and ``provenance.json``, written atomically by rank 0; a
    checkpoint after every epoch (``--checkpoint-dir``) lets a rerun of the same command
    resume exactly; a directory or checkpoint of another configuration is refused
    (``--force`` moves it to a dated backup); a complete run is skipped. ``--capture``
    replays the step from a CUDA graph (the collectives inside). Ranks must share the
    filesystem (one host)."""
    p = _ddp_parser()
    args = p.parse_args(argv)
    _ddp_launch_checks(p, args)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(message)s", stream=sys.stdout)
    try:
        return run(_ddp_config(args, world), progress=not args.no_progress,
                   force=args.force)
    except (guard.ConfigMismatchError, ResultFileError, ValueError,
            FileNotFoundError) as exc:  # a refusal: one line per rank
        print(f"rank {rank}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        dist.destroy_process_group()


# -------------------------------------------------------------------- the command table
#: the commands besides one run (``cifar [options]``, ``cifar ddp``), name ->
#: ``(parser, argv) -> exit code``
COMMANDS = {
    "sweep": sweep_command,
    "worker": worker_command,
    "select": select_command,
    "timing": timing_command,
    "schedule": schedule_command,
    "check": check_command,
    "trainer-timing": trainer_timing_command,
}

#: what each command of :data:`COMMANDS` is for (its ``--help`` description)
PURPOSES = {
    "sweep": "run a plan of runs in worker processes (finished runs skipped, "
             "interrupted ones resumed)",
    "worker": "one worker process of a sweep (started by `cifar sweep`)",
    "select": "apply the step-size selection rule to the selection runs",
    "timing": "seconds per step of every method, one at a time on an idle device",
    "schedule": "the number of epochs of a plan that fits a time budget",
    "check": "check that the results of a suite are complete",
    "trainer-timing": "the trainer's epochs, eager against captured",
}


def main(argv: list[str] | None = None) -> int:
    """``python -m studies cifar [command] ...`` (module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "cifar":
        argv = argv[1:]
    if argv and argv[0] == "ddp":  # each rank sets up its own logging
        ddp_main(argv[1:])
        return 0
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sub = argv[0] if argv and not argv[0].startswith("-") else None
    rest = argv[1:] if sub else argv
    if sub is None:
        return _main_run(rest)
    if sub not in COMMANDS:
        argparse.ArgumentParser(prog="python -m studies cifar").error(
            f"unknown cifar subcommand {sub!r}; use {', '.join(COMMANDS)}, ddp (under "
            "torchrun) (or options only: one run)")
    p = argparse.ArgumentParser(prog=f"python -m studies cifar {sub}",
                                description=PURPOSES[sub])
    if sub not in ("sweep", "worker"):  # a sweep has its own --force, a worker none
        p.add_argument("--force", action="store_true", help="replace a different "
                       "existing output file (select, timing, schedule), moving it to "
                       "a dated backup first")
    try:  # a refusal (other configuration, unreadable or missing file): rc 2, named
        return COMMANDS[sub](p, rest)
    except (guard.ConfigMismatchError, ResultFileError, FileNotFoundError) as exc:
        log.error("refused: %s", exc)
        return 2
    except ValueError as exc:  # a setting no option type could check alone
        p.error(str(exc))
