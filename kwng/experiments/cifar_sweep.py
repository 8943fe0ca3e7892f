"""Many CIFAR runs: plans, worker processes, GPU slots, the step-size selection rule,
step timing and the epoch schedule (book chapter :ref:`experiments-cifar`)."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ..data import NUM_CLASSES
from ..provenance import ResultFileError, atomic_write_json, read_json, write_provenance
from . import guard
from .cifar_methods import (
    ABLATIONS,
    AUTHORS100,
    AUTHORS100_RUNS,
    AUTHORS100_SETTINGS,
    BATCH_SIZE,
    CLAIM,
    CLAIM_ABLATIONS,
    CLAIM_METHODS,
    CLAIM_SELECTION,
    CLAIM_TWO_SEEDS,
    LR_GRID,
    MAIN_SEEDED,
    METHODS,
    ONE_SEED_BOTH,
    SELECT_METHODS,
    SELECTION,
    RunConfig,
    build_model,
    build_optimizer,
    device_for,
    make_step,
)
from .cifar_metrics import UpdateShare
from .cifar_train import (
    _identity,
    checkpoint_path_for,
    fast_cuda,
    resolve_lr,
    run,
    run_dir_for,
    sync,
    train_step,
)

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------ plans
#: rough cost of one step relative to SGD (H200, batch 128;
#: results/cifar/timing/timing.json), used only to spread the runs of a plan over the
#: GPUs when no timing file is given
REL_COST = {"sgd": 1.0, "sgd_momentum": 1.0, "sgd_momentum_wd": 1.05, "adam": 1.4,
            "kfac": 1.7, "ekfac": 11.0, "kwng_m20": 16.7, "kwng_bigbatch": 16.3,
            "kwng_lm_same_batch": 5.8, "kwng_basis20": 16.7}
_KWNG_REL_COST = 5.4


def job_cost(job: dict, timing: dict | None = None) -> float:
    """Relative cost of a run of ``job`` (per epoch, times its ``epochs`` when given;
    the timing file's seconds per step if given)."""
    m = job["method"]
    epochs = int(job.get("epochs", 1))
    if timing is not None and m in timing:
        steps = math.ceil(50_000 / timing[m].get("batch_size", BATCH_SIZE))
        return float(timing[m]["sec_per_step"]) * steps * epochs
    kwng = METHODS[m].get("precond") == "kwng"
    return REL_COST.get(m, _KWNG_REL_COST if kwng else 1.0) * epochs


def assign_slots(plan: list[dict], gpus: int, procs_per_gpu: int,
                 timing: dict | None = None) -> list[dict]:
    """The plan with a ``slot`` (worker index ``g · procs_per_gpu + p``) for each of
    the first runs, chosen greedily (most expensive run first, to the GPU with the least
    load and a free worker) so that every GPU gets a similar total cost; runs beyond the
    number of workers get no slot (taken by the first worker to finish)."""
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


def _grid(methods: Sequence[str], common: dict, out: Path, **settings) -> list[dict]:
    """Every method × {ill, well} × :data:`LR_GRID`, seed 0, results under
    ``out/lr<lr>``."""
    return [{**common, "conditioning": cond, "method": m, "seed": 0, "lr": lr,
             **settings, "out": str(out / f"lr{lr:g}")}
            for cond in ("ill", "well") for m in methods for lr in LR_GRID]


def _seeded(base: dict, methods: Sequence[str], seed: int,
            conds: Sequence[str] = ("ill", "well")) -> list[dict]:
    """Seed ``seed`` of each method in each conditioning (method-major order)."""
    return [{**base, "conditioning": c, "method": m, "seed": seed}
            for m in methods for c in conds]


def _claim_plan(common: dict, epochs: int, with_ablations: bool | None) -> list[dict]:
    base = {**common, "epochs": epochs, "lr": "selected", "schedule": "claim",
            "out": str(CLAIM), "selection_file": str(CLAIM_SELECTION / "selected.json")}
    jobs = _seeded(base, CLAIM_METHODS, 0) + _seeded(base, CLAIM_TWO_SEEDS, 1)
    if with_ablations is None or with_ablations:
        jobs += _seeded(base, CLAIM_ABLATIONS, 0)
    return jobs


def authors100_out(lr: float, settings: dict) -> Path:
    """Where a run of the plan ``authors100`` writes:
    ``results/cifar/authors100/lr<lr>``
    (``.../fp32/lr<lr>`` for the precision control)."""
    tag = f"lr{lr:g}"
    return AUTHORS100 / ("fp32" if settings.get("precision") == "fp32" else "") / tag


def _authors100_plan(common: dict, tiers: Sequence[int] = (1, 2, 3)) -> list[dict]:
    """The runs of :data:`AUTHORS100_RUNS` of ``tiers``, in tier order."""
    jobs = []
    for tier, m, cond, lr, seed, epochs, extra in AUTHORS100_RUNS:
        if tier not in tiers:
            continue
        jobs.append({**common, **AUTHORS100_SETTINGS, **extra, "method": m,
                     "conditioning": cond, "lr": lr, "seed": seed, "epochs": epochs,
                     "out": str(authors100_out(lr, extra))})
    return jobs


def _main_plan(common: dict, epochs: int) -> list[dict]:
    base = {**common, "epochs": epochs, "lr": "selected", "schedule": "study6"}
    jobs = []
    for seed in (0, 1, 2):
        for cond in ("ill", "well"):
            jobs += _seeded(base, MAIN_SEEDED, seed, (cond,))
    for cond in ("ill", "well"):
        jobs += _seeded(base, ONE_SEED_BOTH, 0, (cond,))
    return jobs + _seeded(base, ABLATIONS, 0, ("ill",))


def build_plan(name: str, dataset: str = "cifar10", epochs: int = 6,
               select_steps: int = 120, select_subset: int | None = 10_000,
               select_val: int = 2_000, data_root: str | None = None,
               select_epochs: int = 2, with_ablations: bool | None = None,
               methods: Sequence[str] | None = None) -> list[dict]:
    """Run lists (only the runs of ``methods``, when given: a suite run in parts).

    * ``claim_select``: every method of :data:`CLAIM_METHODS` × {ill, well} ×
      :data:`LR_GRID`, each ``select_epochs`` epochs at a constant step on the training
      set minus ``select_val`` held-out images (on ``select_subset`` of the rest if
      given), scored on the held-out images; results under
      ``results/cifar/claim/selection/lr<lr>/``.
    * ``claim``: the claim suite, ``epochs`` epochs with the ``claim`` schedule and the
      step sizes of ``claim_select``, in priority order: seed 0 of every method of
      :data:`CLAIM_METHODS` in both conditionings, seed 1 of :data:`CLAIM_TWO_SEEDS`,
      then :data:`CLAIM_ABLATIONS` (seed 0, both conditionings) when ``with_ablations``
      (default: yes).
    * ``select`` and ``main``: the plans of the earlier 6-epoch study. ``select``: every
      method of :data:`~kwng.experiments.cifar_methods.SELECT_METHODS` ×
      {ill, well} × :data:`LR_GRID` for
      ``select_steps`` steps on ``select_subset`` training images, evaluated on
      ``select_val`` held-out training images. ``main``: seed 0 of sgd/adam/kwng in both
      conditionings, seeds 1–2 of those, seed 0 of the other methods in both
      conditionings, the ablations (ill only).
    * ``authors100``: the authors'-horizon study (:data:`AUTHORS100_RUNS` of tiers 1–3,
      every run with its own epochs and step size; ``epochs`` is not used; the plan
      ``authors100_all`` adds tier 4), results under
      ``results/cifar/authors100/lr<lr>/``.
    * a path to a JSON list of run settings.
    """
    if methods is not None:
        unknown = sorted(set(methods) - set(METHODS))
        if unknown:
            raise ValueError(f"methods must be names from {sorted(METHODS)}, "
                             f"got {unknown}")
        jobs = build_plan(name, dataset, epochs, select_steps, select_subset,
                          select_val, data_root, select_epochs, with_ablations)
        return [j for j in jobs if j["method"] in set(methods)]
    common = {"dataset": dataset, "data_root": data_root}
    if name == "claim_select":
        return _grid(CLAIM_METHODS, common, CLAIM_SELECTION, epochs=select_epochs,
                     schedule="constant", train_subset=select_subset,
                     val_size=select_val)
    if name == "claim":
        return _claim_plan(common, epochs, with_ablations)
    if name == "select":
        jobs = _grid(SELECT_METHODS, common, SELECTION, epochs=100,
                     max_steps=select_steps, train_subset=select_subset,
                     val_size=select_val, schedule="study6")
        # expensive methods first so that they do not form the tail
        order = {"ekfac": 0, "kfac": 1, "kwng": 2, "kwng_momentum": 3}
        return sorted(jobs, key=lambda j: order.get(j["method"], 9))
    if name == "main":
        return _main_plan(common, epochs)
    if name in ("authors100", "authors100_all"):
        return _authors100_plan(common, (1, 2, 3, 4) if name.endswith("all")
                                else (1, 2, 3))
    path = Path(name)
    if path.is_file():
        return list(read_json(path))
    raise ValueError("plan must be 'claim_select', 'claim', 'select', 'main', "
                     f"'authors100' or a JSON file of run settings, got {name!r}")


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


def worker(jobs: Iterable[dict], session: str, deadline: float | None,
           failures_file: str | os.PathLike | None = None) -> list[dict]:
    """Run every unclaimed, unfinished job of ``jobs`` in this process.

    A run that fails (corrupt record, other configuration in its directory, error while
    training) is logged and listed, and the worker goes on with the next. Returns the
    failures (``{"run", "error"}``), also written to ``failures_file`` when given."""
    failures: list[dict] = []
    for job in jobs:
        job = {k: v for k, v in job.items() if k != "slot"}
        if deadline is not None and time.time() > deadline - 20:
            log.info("worker %d: deadline close, not starting new runs", os.getpid())
            break
        name = "/".join(str(job.get(k, "?"))
                        for k in ("dataset", "conditioning", "method", "seed"))
        try:
            cfg = RunConfig(**{**job, "deadline": deadline})
            name = str(run_dir_for(cfg))
            mp = run_dir_for(cfg) / "metrics.json"
            rec = read_json(mp) if mp.is_file() else None
            done = isinstance(rec, dict) and rec.get("complete")
            if done or _claim(cfg, session):  # a finished run is still checked
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


def _is_complete(job: dict, force: bool = False) -> bool:
    """Whether the sweep may skip ``job``: complete *and* of the identity it asks for
    (:func:`kwng.experiments.guard.check_existing_run`: another identity raises unless
    ``force`` moves the record to a backup). An unreadable or malformed record, or a run
    whose identity cannot be computed here, is not skipped: its worker reports it."""
    cfg = RunConfig(**{k: v for k, v in job.items() if k != "slot"})
    rdir = run_dir_for(cfg)
    mp = rdir / "metrics.json"
    try:
        rec = read_json(mp) if mp.is_file() else None
        if not (isinstance(rec, dict) and rec.get("complete")):
            return False  # nothing to skip: its worker starts, resumes or refuses it
        identity = _identity(cfg, resolve_lr(cfg))
        return guard.check_existing_run(rdir, checkpoint_path_for(cfg), identity,
                                        force) is not None
    except (FileNotFoundError, KeyError, ResultFileError) as err:
        log.warning("%s: not skipped (%s); its worker reports it", rdir, err)
        return False


def _spawn_workers(plan_file: Path, gpus: int, procs_per_gpu: int, session: str,
                   deadline: float | None) -> list[subprocess.Popen]:
    procs = []
    for g in range(max(gpus, 1)):
        for p in range(procs_per_gpu):
            env = dict(os.environ)
            if gpus > 0:
                env["CUDA_VISIBLE_DEVICES"] = str(g)
            cmd = [sys.executable, "-m", "kwng.experiments", "cifar", "worker",
                   "--plan", str(plan_file), "--session", session, "--offset",
                   str(g * procs_per_gpu + p)]
            if deadline is not None:
                cmd += ["--deadline", repr(deadline)]
            procs.append(subprocess.Popen(cmd, env=env))
    return procs


def sweep(plan: list[dict], gpus: int, procs_per_gpu: int, deadline_s: float | None,
          plan_file: Path, timing: dict | None = None, force: bool = False) -> int:
    """Spawn ``gpus × procs_per_gpu`` worker processes over ``plan`` and wait for them.
    The unfinished runs get worker slots balanced over the GPUs (:func:`assign_slots`);
    the rest, most expensive first, go to whichever worker is free.

    A finished run is skipped only with the identity the plan asks for
    (:func:`_is_complete`); else nothing starts and ``ConfigMismatchError`` lists each
    such run and its differing keys, unless ``force`` (backed up, run again)."""
    if gpus < 0 or procs_per_gpu < 1:
        raise ValueError(f"gpus must be >= 0 and procs_per_gpu >= 1, "
                         f"got {gpus}, {procs_per_gpu}")
    pending, refused = [], []
    for j in plan:
        try:
            if not _is_complete(j, force):
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
    rc = 0
    for pr in _spawn_workers(plan_file, gpus, procs_per_gpu, session, deadline):
        rc = max(rc, pr.wait())
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
    (:func:`kwng.experiments.cifar_train.train_step`, with the last-layer share), not
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
        bs = METHODS[j["method"]].get("batch_size", BATCH_SIZE)
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
