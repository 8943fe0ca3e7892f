"""Many CIFAR runs (book chapter :ref:`experiments-cifar`): a plan's runs spread over
worker processes on GPU slots (:func:`sweep`), each worker's loop over the plan
(:func:`worker`), and their command lines, ``cifar sweep`` and ``cifar worker``."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from studies.cifar.config import SETTINGS, RunConfig
from studies.cifar.data import DATASETS
from studies.cifar.hooks import plan_names
from studies.cifar.methods import CHECKPOINTS, CLAIM
from studies.cifar.plans import assign_slots, build_plan, job_cost
from studies.cifar.runtime import (
    checkpoint_path_for,
    resolve_lr,
    run_dir_for,
    run_identity_of,
)
from studies.cifar.train import run
from studies.kit import guard
from studies.kit.cli_checks import int_arg, int_list_arg, number_arg
from studies.kit.provenance import ResultFileError, atomic_write_json, read_json
from studies.kit.run_lock import run_lock

log = logging.getLogger(__name__)

#: the keys of a plan's job that are not run settings, the worker slot and the
#: estimated seconds the run takes (``est_s``, read by ``--finish-by-s``)
JOB_META = ("slot", "est_s")


# ---------------------------------------------------------------------------- workers
def _claim(cfg: RunConfig, session: str) -> bool:
    """Claim a run for this sweep session (an exclusive file); False if another worker
    holds it."""
    path = checkpoint_path_for(cfg).parent / f".claim-{session}"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def run_lock_for(cfg: RunConfig) -> contextlib.AbstractContextManager:
    """The lock of one run (:func:`studies.kit.run_lock.run_lock`): the file
    ``run.lock`` next to its checkpoint; a second process on the run refuses."""
    return run_lock(checkpoint_path_for(cfg).parent / "run.lock", str(run_dir_for(cfg)))


def worker(jobs: Iterable[dict], session: str, deadline: float | None,
           failures_file: str | os.PathLike | None = None,
           start_by: float | None = None,
           finish_by: float | None = None, force: bool = False) -> list[dict]:
    """Run every unclaimed, unfinished job of ``jobs`` in this process: none started
    after the Unix time ``start_by``, and none whose estimated duration (its
    ``est_s``) would end it after ``finish_by``, so that a run that cannot finish
    before the GPU machine goes back is not begun. ``force``: a record in a run's way
    (another configuration, or a cut run whose checkpoint is gone) is moved to a dated
    backup and the run starts again (:func:`studies.cifar.train.run`).

    A run that fails (corrupt record, other configuration in its directory, error while
    training) is logged and listed, and the worker goes on with the next. Returns the
    failures (``{"run", "error"}``), also written to ``failures_file`` when given."""
    failures: list[dict] = []
    for job in jobs:
        est = job.get("est_s")
        job = {k: v for k, v in job.items() if k not in JOB_META}
        if deadline is not None and time.time() > deadline - 20:
            log.info("worker %d: deadline close, not starting new runs", os.getpid())
            break
        if start_by is not None and time.time() > start_by:
            log.info("worker %d: past --start-by, not starting new runs", os.getpid())
            break
        if finish_by is not None and est is not None and time.time() + est > finish_by:
            log.info("worker %d: %s/%s lr %s would not finish in time (about %.0f s)",
                     os.getpid(), job.get("conditioning"), job.get("method"),
                     job.get("lr"), est)
            continue
        name = "/".join(str(job.get(k, "?"))
                        for k in ("dataset", "conditioning", "method", "seed"))
        try:
            cfg = RunConfig.from_dict({**job, "deadline": deadline})
            name = str(run_dir_for(cfg))
            # one worker of the session takes each run, finished or not: a finished
            # run is still checked against the job (its identity), by that worker
            if _claim(cfg, session):
                with run_lock_for(cfg):
                    run(cfg, progress=False, force=force)
        # one bad run must not stop a sweep
        except (RuntimeError, ValueError, OSError, KeyError, EOFError) as exc:
            log.error("run %s failed: %s", name, exc)
            failures.append({"run": name, "error": f"{type(exc).__name__}: {exc}"})
            if failures_file is not None:
                atomic_write_json(failures_file, failures)
            msg = str(exc)
            if (isinstance(exc, RuntimeError) and "CUDA" in msg
                    and "out of memory" not in msg):
                raise
    return failures


def _selected_lr(cfg: RunConfig) -> float | None:
    """The run's step size, or ``None`` (logged) where ``lr='selected'`` has none yet:
    such a job is not skipped, its worker reports it."""
    try:
        return resolve_lr(cfg)
    except ValueError as err:  # no selected step size for this method
        log.warning("%s: not skipped (%s); its worker reports it", run_dir_for(cfg),
                    err)
        return None


def is_complete(job: dict, force: bool = False) -> bool:
    """Whether the sweep may skip ``job``: complete *and* of the identity it asks for
    (:func:`studies.kit.guard.check_existing_run`: another identity raises unless
    ``force`` moves the record to a backup). An unreadable or malformed record, or a run
    whose identity cannot be computed here, is not skipped: its worker reports it."""
    cfg = RunConfig.from_dict({k: v for k, v in job.items() if k not in JOB_META})
    rdir = run_dir_for(cfg)
    mp = rdir / "metrics.json"
    try:
        rec = read_json(mp) if mp.is_file() else None
        if not (isinstance(rec, dict) and rec.get("complete")):
            return False  # nothing to skip: its worker starts, resumes or refuses it
        lr = _selected_lr(cfg)
        if lr is None:
            return False
        identity = run_identity_of(cfg, lr)
        return guard.check_existing_run(rdir, checkpoint_path_for(cfg), identity,
                                        force) is not None
    except (FileNotFoundError, KeyError, ResultFileError) as err:
        log.warning("%s: not skipped (%s); its worker reports it", rdir, err)
        return False


def _spawn_workers(plan_file: Path, gpus: int, procs_per_gpu: int, session: str,
                   deadline: float | None, start_by: float | None = None,
                   finish_by: float | None = None,
                   force: bool = False) -> list[subprocess.Popen]:
    procs = []
    for g in range(max(gpus, 1)):
        for p in range(procs_per_gpu):
            env = dict(os.environ)
            if gpus > 0:  # the g-th of the devices this sweep sees
                visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                env["CUDA_VISIBLE_DEVICES"] = (visible[g] if len(visible) > g
                                               and visible[g] else str(g))
            cmd = [sys.executable, "-m", "studies", "cifar", "worker",
                   "--plan", str(plan_file), "--session", session, "--offset",
                   str(g * procs_per_gpu + p)]
            if deadline is not None:
                cmd += ["--deadline", repr(deadline)]
            for flag, t in (("--start-by", start_by), ("--finish-by", finish_by)):
                if t is not None:
                    cmd += [flag, repr(t)]
            cmd += ["--force"] if force else []
            # a session of their own: a terminal's Ctrl-C reaches the sweep, which
            # forwards it once (:func:`_wait_forwarding`)
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    return procs


def _wait_forwarding(procs: list[subprocess.Popen]) -> int:
    """Wait for every worker; a SIGTERM or SIGINT to the sweep meanwhile is passed on
    to the workers that still run, and the sweep goes on waiting for them. The largest
    exit status, or ``128 + signal`` when the sweep was signalled."""
    got: list[int] = []

    def forward(signum: int, _frame) -> None:
        got.append(signum)
        log.warning("sweep: %s received, passed on to %d worker(s); waiting for them",
                    signal.Signals(signum).name, sum(p.poll() is None for p in procs))
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc = max((p.wait() for p in procs), default=0)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 128 + got[0] if got else rc


def sweep(plan: list[dict], gpus: int, procs_per_gpu: int, deadline_s: float | None,
          plan_file: Path, timing: dict | None = None, force: bool = False,
          start_by_s: float | None = None, finish_by_s: float | None = None) -> int:
    """Spawn ``gpus × procs_per_gpu`` worker processes over ``plan`` and wait for them.
    The unfinished runs get worker slots balanced over the GPUs (:func:`assign_slots`);
    the rest, most expensive first, go to whichever worker is free.

    A finished run is skipped only with the identity the plan asks for
    (:func:`is_complete`); else nothing starts and ``ConfigMismatchError`` lists each
    such run and its differing keys, unless ``force`` (backed up, run again)."""
    if gpus < 0 or procs_per_gpu < 1:
        raise ValueError(f"gpus must be >= 0 and procs_per_gpu >= 1, "
                         f"got {gpus}, {procs_per_gpu}")
    pending, refused = [], []
    for j in plan:
        try:
            if not is_complete(j, force):
                pending.append(j)
        except guard.ConfigMismatchError as err:
            refused.append(str(err))
    if refused:
        raise guard.ConfigMismatchError(
            f"sweep: {len(refused)} finished run(s) of the plan were produced with "
            "another configuration; nothing was started:\n  "
            + "\n  ".join(refused))
    slotted = assign_slots(pending, gpus, procs_per_gpu, timing)
    rest = sorted((j for j in slotted if "slot" not in j),
                  key=lambda j: -job_cost(j, timing))
    plan = [j for j in slotted if "slot" in j] + rest
    log.info("sweep: %d unfinished runs, %d with a worker slot", len(plan),
             len(plan) - len(rest))
    atomic_write_json(plan_file, plan)
    session = uuid.uuid4().hex[:12]
    deadline = None if deadline_s is None else time.time() + deadline_s
    now = time.time()
    start_by = None if start_by_s is None else now + start_by_s
    finish_by = None if finish_by_s is None else now + finish_by_s
    rc = _wait_forwarding(_spawn_workers(plan_file, gpus, procs_per_gpu, session,
                                         deadline, start_by, finish_by, force))
    failures = []
    pattern = f"{plan_file.stem}.failures-{session}-*.json"
    for f in sorted(plan_file.parent.glob(pattern)):
        failures += read_json(f)
    if failures:
        log.error("sweep: %d run(s) failed (the others ran):\n%s", len(failures),
                  "\n".join(f"  {x['run']}: {x['error']}" for x in failures))
        rc = max(rc, 1)
    return rc


# ------------------------------------------------------------------------ command lines
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
    if text in plan_names() or Path(text).is_file():
        return text
    raise argparse.ArgumentTypeError(f"must be one of {', '.join(plan_names())} or a "
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
        help=f"{', '.join(plan_names())} or a JSON file of run settings")
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
    add("--est-factor", type=number_arg(0), default=1.0,
        help="factor on each run's estimated duration (est_s: a run alone on its GPU) "
             "for --finish-by-s, for runs that share a GPU (several processes per "
             "GPU, or queues side by side): about processes / throughput gain")
    add("--select-epochs", type=int_arg(1), default=2,
        help="claim_select: epochs of each run")
    add("--select-subset", type=int_arg(1), default=None, help="claim_select: "
        "training images per run (default: all but the held-out ones)")
    add("--select-val", type=int_arg(1), default=5_000,
        help="claim_select: held-out images")
    add("--timing", default=None, help="a timing file (`cifar timing`) to balance the "
        "GPUs")
    add("--methods", default=None, help="comma list: only these methods' runs")
    add("--seeds", default=None, type=int_list_arg(0), help="comma list: only these "
        "seeds' runs")
    add("--force", action="store_true", help="back up what is in a run's way (a "
        "finished run of another configuration, a cut run whose checkpoint is gone) "
        "and run it")
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
    add("--force", action="store_true")


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
                       a.finish_by, a.force) else 0


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
    plan = [{**j, **_overrides(a.set)} for j in plan
            if a.seeds is None or j.get("seed") in a.seeds]
    if a.est_factor != 1.0:
        plan = [{**j, "est_s": j["est_s"] * a.est_factor} if j.get("est_s") else j
                for j in plan]
    # sweeps of one plan over disjoint method lists may run side by side: one plan
    # file each
    key = ",".join(sorted(only or [])) + (f"@{a.seeds}" if a.seeds else "")
    tag = "-" + hashlib.sha1(key.encode()).hexdigest()[:8] if key else ""
    plan_file = CHECKPOINTS / "plans" / f"{Path(a.plan).stem}{tag}.json"
    timing_rec = read_json(a.timing)["methods"] if a.timing else None
    log.info("sweep %s: %d runs on %d GPU(s) × %d processes", a.plan, len(plan), a.gpus,
             a.procs_per_gpu)
    return sweep(plan, a.gpus, a.procs_per_gpu, a.deadline_s, plan_file, timing_rec,
                 force=a.force, start_by_s=a.start_by_s,
                 finish_by_s=a.finish_by_s)


def sweep_command(p: argparse.ArgumentParser, rest: list[str]) -> int:
    """``cifar sweep``: the plan's runs in ``--gpus × --procs-per-gpu`` workers
    (:func:`sweep`)."""
    _sweep_arguments(p)
    return _main_sweep(p.parse_args(rest))


def worker_command(p: argparse.ArgumentParser, rest: list[str]) -> int:
    """``cifar worker``: one worker of a sweep (:func:`worker`)."""
    _worker_arguments(p)
    return _main_worker(p.parse_args(rest))
