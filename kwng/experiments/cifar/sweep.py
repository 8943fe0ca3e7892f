"""Many CIFAR runs: plans, worker processes, GPU slots, the step-size selection rule,
step timing and the epoch schedule (book chapter :ref:`experiments-cifar`)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import torch

from kwng.experiments import guard
from kwng.experiments.cifar.config import RunConfig
from kwng.experiments.cifar.data import NUM_CLASSES
from kwng.experiments.cifar.methods import (
    BATCH_SIZE,
    METHODS,
    device_for,
)
from kwng.experiments.cifar.metrics import UpdateShare
from kwng.experiments.cifar.plans import assign_slots, job_cost
from kwng.experiments.cifar.runtime import (
    checkpoint_path_for,
    fast_cuda,
    resolve_lr,
    run_dir_for,
    run_identity_of,
    sync,
)
from kwng.experiments.cifar.steps import (
    build_model,
    build_optimizer,
    make_step,
    train_step,
)
from kwng.experiments.cifar.train import run
from kwng.experiments.provenance import (
    ResultFileError,
    atomic_write_json,
    read_json,
    write_provenance,
)
from kwng.experiments.run_lock import run_lock

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
    """The lock of one run (:func:`kwng.experiments.run_lock.run_lock`): the file
    ``run.lock`` next to its checkpoint; a second process on the run refuses."""
    return run_lock(checkpoint_path_for(cfg).parent / "run.lock", str(run_dir_for(cfg)))


def worker(jobs: Iterable[dict], session: str, deadline: float | None,
           failures_file: str | os.PathLike | None = None,
           start_by: float | None = None,
           finish_by: float | None = None) -> list[dict]:
    """Run every unclaimed, unfinished job of ``jobs`` in this process: none started
    after the Unix time ``start_by``, and none whose estimated duration (its
    ``est_s``) would end it after ``finish_by``, so that a run that cannot finish
    before the GPU machine goes back is not begun.

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
                    run(cfg, progress=False)
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


def is_complete(job: dict, force: bool = False) -> bool:
    """Whether the sweep may skip ``job``: complete *and* of the identity it asks for
    (:func:`kwng.experiments.guard.check_existing_run`: another identity raises unless
    ``force`` moves the record to a backup). An unreadable or malformed record, or a run
    whose identity cannot be computed here, is not skipped: its worker reports it."""
    cfg = RunConfig.from_dict({k: v for k, v in job.items() if k not in JOB_META})
    rdir = run_dir_for(cfg)
    mp = rdir / "metrics.json"
    try:
        rec = read_json(mp) if mp.is_file() else None
        if not (isinstance(rec, dict) and rec.get("complete")):
            return False  # nothing to skip: its worker starts, resumes or refuses it
        identity = run_identity_of(cfg, resolve_lr(cfg))
        return guard.check_existing_run(rdir, checkpoint_path_for(cfg), identity,
                                        force) is not None
    except (FileNotFoundError, KeyError, ResultFileError) as err:
        log.warning("%s: not skipped (%s); its worker reports it", rdir, err)
        return False


def _spawn_workers(plan_file: Path, gpus: int, procs_per_gpu: int, session: str,
                   deadline: float | None, start_by: float | None = None,
                   finish_by: float | None = None) -> list[subprocess.Popen]:
    procs = []
    for g in range(max(gpus, 1)):
        for p in range(procs_per_gpu):
            env = dict(os.environ)
            if gpus > 0:  # the g-th of the devices this sweep sees
                visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                env["CUDA_VISIBLE_DEVICES"] = (visible[g] if len(visible) > g
                                               and visible[g] else str(g))
            cmd = [sys.executable, "-m", "kwng.experiments", "cifar", "worker",
                   "--plan", str(plan_file), "--session", session, "--offset",
                   str(g * procs_per_gpu + p)]
            if deadline is not None:
                cmd += ["--deadline", repr(deadline)]
            for flag, t in (("--start-by", start_by), ("--finish-by", finish_by)):
                if t is not None:
                    cmd += [flag, repr(t)]
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
                                         deadline, start_by, finish_by))
    failures = []
    pattern = f"{plan_file.stem}.failures-{session}-*.json"
    for f in sorted(plan_file.parent.glob(pattern)):
        failures += read_json(f)
    if failures:
        log.error("sweep: %d run(s) failed (the others ran):\n%s", len(failures),
                  "\n".join(f"  {x['run']}: {x['error']}" for x in failures))
        rc = max(rc, 1)
    return rc


# ----------------------------------------------------------------------------- timing
def _time_method(m: str, dataset: str, conditioning: str, steps: int, warmup: int,
                 dev: torch.device, model_name: str) -> dict:
    cfg = RunConfig(dataset=dataset, conditioning=conditioning, method=m, lr=0.01,
                    model=model_name)
    torch.manual_seed(0)
    model = build_model(cfg).to(dev)
    method = make_step(cfg, model, build_optimizer(cfg, model, 0.01), dev)
    share = UpdateShare(model)
    z = torch.randn(cfg.batch, 3, 32, 32, device=dev)
    y = torch.randint(0, NUM_CLASSES[dataset], (cfg.batch,), device=dev)
    for i in range(warmup + steps):
        if i == warmup:
            sync(dev)
            t0 = time.perf_counter()
        train_step(method, model, z, y, share)
    sync(dev)
    return {"sec_per_step": (time.perf_counter() - t0) / steps, "batch_size": cfg.batch}


def timing(methods: Iterable[str], dataset: str, conditioning: str, steps: int,
           warmup: int, device: str | None, out: Path,
           model_name: str = "resnet18") -> dict:
    """Seconds per training step of each method alone on ``device`` (random inputs,
    batch of the method): the step of the runner
    (:func:`kwng.experiments.cifar.steps.train_step`, with the last-layer share), not
    timing evaluation. Writes ``out`` with provenance."""
    dev = device_for(device)
    fast_cuda(dev)
    res = {}
    for m in methods:
        res[m] = _time_method(m, dataset, conditioning, steps, warmup, dev, model_name)
        log.info("timing %s: %.2f ms/step", m, 1e3 * res[m]["sec_per_step"])
    rec = {"device": str(dev), "steps": steps, "warmup": warmup,
           "conditioning": conditioning,
           "note": "KFAC refreshes every 100 steps: its per-step time here includes "
                   "the refresh share only if steps >= 100", "methods": res}
    atomic_write_json(out, rec)
    write_provenance(out.parent, {"command": "timing", "methods": list(methods)},
                     device=str(dev))
    return rec


def schedule_epochs(timing_file: Path, plan: list[dict], budget_s: float,
                    concurrency_gain: float = 1.5, lo: int = 3, hi: int = 15,
                    train_size: int = 50_000, gpus: int = 1,
                    procs_per_gpu: int | None = None, eval_s: float = 0.5) -> int:
    """The largest number of epochs (in ``[lo, hi]``) with which ``plan`` fits
    ``budget_s`` seconds of wall clock on ``gpus`` GPUs, from the per-step times of
    ``timing_file`` (a method missing from it costs like ``kwng``) and an assumed
    throughput gain of concurrent processes on one GPU.

    With one GPU the plan's total cost per epoch counts; with several, the most loaded
    GPU's cost after :func:`assign_slots` (``procs_per_gpu`` workers each, default:
    enough for every run)."""
    t = read_json(timing_file)["methods"]
    fallback = t.get("kwng", {"sec_per_step": 0.02, "batch_size": BATCH_SIZE})
    timing = {m: t.get(m, fallback) for m in METHODS}

    def per_epoch(j: dict) -> float:
        bs = METHODS[j["method"]].spec.get("batch_size", BATCH_SIZE)
        return math.ceil(train_size / bs) * timing[j["method"]]["sec_per_step"] + eval_s

    procs = procs_per_gpu or max(1, math.ceil(len(plan) / max(gpus, 1)))
    loads = [0.0] * max(gpus, 1)
    rest = 0.0
    for j in assign_slots(plan, gpus, procs, timing):
        if "slot" in j:
            loads[j["slot"] // procs] += per_epoch(j)
        else:
            rest += per_epoch(j)
    worst = max(loads) + rest / max(gpus, 1)
    e = int(budget_s * concurrency_gain // worst)
    return max(lo, min(hi, e))
