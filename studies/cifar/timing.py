"""How long the CIFAR study's runs take (book chapter :ref:`experiments-cifar`): a step,
an epoch of the trainer, and the epochs a plan fits into a budget; with the commands
``cifar timing``, ``cifar trainer-timing`` and ``cifar schedule``.

:func:`timing` measures the seconds per training step of each method alone on one
device (random inputs, the step of the runner, no evaluation);
:func:`schedule_epochs` turns them into the number of epochs with which a plan fits a
budget.

:func:`trainer_timing` trains each method for a few whole epochs twice — eagerly and
with its step replayed from a CUDA graph
(:class:`~studies.cifar.steps.StepRunner`) — and records, per epoch, the wall
time of the training loop, of the evaluation and record keeping after it, and of the
whole epoch. It then checks that the graph computes what the eager step computes: with
cuDNN deterministic and its benchmark search off, it trains ``trace_steps`` steps from
the same seed eagerly twice and captured once and compares the per-step losses (the two
eager runs give the noise floor of the device's own non-determinism). Results go to a
JSON file with provenance; an existing file is kept unless ``force``.
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Sequence

import torch

from studies.cifar.config import RunConfig
from studies.cifar.data import DATASETS, NUM_CLASSES
from studies.cifar.methods import (
    BATCH_SIZE,
    CLAIM,
    CLAIM_METHODS,
    CONDITIONINGS,
    METHODS,
    RESULTS,
    TIMED_PRECISIONS,
    device_for,
    milestones_for,
)
from studies.cifar.metrics import UpdateShare
from studies.cifar.nets import NETWORKS
from studies.cifar.plans import assign_slots, build_plan
from studies.cifar.runtime import fast_cuda, sync
from studies.cifar.steps import (
    build_model,
    build_optimizer,
    make_step,
    train_step,
)
from studies.cifar.train import Run
from studies.kit import guard
from studies.kit.cli_checks import device_problem, int_arg, names_arg, number_arg
from studies.kit.provenance import (
    atomic_write_json,
    make_provenance,
    read_json,
    write_provenance,
)

__all__ = ["timing", "trainer_timing", "schedule_epochs", "timing_command",
           "trainer_timing_command", "schedule_command"]

log = logging.getLogger(__name__)


# -------------------------------------------------- seconds per step, epochs per budget
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
    (:func:`studies.cifar.steps.train_step`, with the last-layer share), not
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
    step_times = {m: t.get(m, fallback) for m in METHODS}

    def per_epoch(j: dict) -> float:
        bs = METHODS[j["method"]].spec.get("batch_size", BATCH_SIZE)
        sec = step_times[j["method"]]["sec_per_step"]
        return math.ceil(train_size / bs) * sec + eval_s

    procs = procs_per_gpu or max(1, math.ceil(len(plan) / max(gpus, 1)))
    loads = [0.0] * max(gpus, 1)
    rest = 0.0
    for j in assign_slots(plan, gpus, procs, step_times):
        if "slot" in j:
            loads[j["slot"] // procs] += per_epoch(j)
        else:
            rest += per_epoch(j)
    worst = max(loads) + rest / max(gpus, 1)
    e = int(budget_s * concurrency_gain // worst)
    return max(lo, min(hi, e))


# --------------------------------------------- the trainer's epochs, eager and captured
def _config(method: str, capture: bool, common: dict, **extra: Any) -> RunConfig:
    return RunConfig.from_dict({**common, "method": method, "capture": capture,
                                "lr": METHODS[method].timing_lr, **extra})


def _time_epochs(cfg: RunConfig, epochs: int) -> dict:
    state = Run(cfg, float(cfg.lr), identity={})
    nb = state.train.num_batches(cfg.batch)
    total = epochs * nb
    rows = []
    state.model.train()
    for epoch in range(epochs):
        sync(state.device)
        t0 = time.perf_counter()
        state.train_epoch(epoch, total, None)
        t1 = time.perf_counter()
        state.end_epoch(epoch, total)
        sync(state.device)
        t2 = time.perf_counter()
        rows.append({"epoch": epoch + 1, "train_s": t1 - t0, "after_s": t2 - t1,
                     "epoch_s": t2 - t0,
                     "eval_s": state.record["epochs"][-1]["time_eval"],
                     "train_loss": state.record["epochs"][-1]["train_loss"]})
    runner = state.runner
    out = {"captured": runner.capture, "captures": runner.captures,
           "replays": runner.replays, "eager_steps": runner.eager,
           "steps_per_epoch": nb, "epochs": rows,
           "steady_epoch_s": rows[-1]["epoch_s"], "steady_train_s": rows[-1]["train_s"],
           "steady_after_s": rows[-1]["after_s"],
           "steady_ms_per_step": 1e3 * rows[-1]["train_s"] / nb}
    del state, runner  # its CUDA graphs go with it, before the next method's run
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def _trace(cfg: RunConfig, steps: int) -> tuple[list[float], bool]:
    """The per-step losses of ``steps`` steps, and whether a CUDA graph replayed them
    (a captured run on a CPU runs eagerly)."""
    torch.backends.cudnn.deterministic = True
    state = Run(cfg, float(cfg.lr), identity={})
    torch.backends.cudnn.benchmark = False  # Run switched it on
    state.trace = torch.full((steps,), math.nan, dtype=torch.float64,
                             device=state.device)
    state.trace_pos = torch.zeros((), dtype=torch.long, device=state.device)
    state.model.train()
    epoch = 0
    while state.steps < steps:
        state.train_epoch(epoch, steps, None)
        epoch += 1
    out, captured = state.trace.tolist(), state.runner.replays > 0
    del state
    torch.backends.cudnn.deterministic = False
    return out, captured


def _max_rel(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b))


def _epoch_rows(methods, precisions, epochs, common, tmp) -> list[dict]:
    """Eager and captured epoch times of every method in every precision."""
    rows = []
    for prec in precisions:
        for m in methods:
            for capture in (False, True):
                cfg = _config(m, capture, common, precision=prec,
                              out=f"{tmp}/out/{prec}/{int(capture)}")
                log.info("timing %s %s %s", m, prec, "captured" if capture else "eager")
                rec = _time_epochs(cfg, epochs)
                rows.append({"method": m, "precision": prec,
                             "mode": "captured" if rec["captured"] else "eager",
                             "asked_capture": capture, **rec})
                if capture and not rec["captured"]:
                    rows[-1]["why_eager"] = (METHODS[m].not_capturable
                                             or "not on CUDA")
    return rows


def _loss_match(m, prec, trace_steps, common, tmp) -> dict | None:
    """The per-step losses of one captured run and two eager runs of method ``m``
    (capturable methods only), and their largest relative differences; ``None`` when
    the captured run replayed no graph (no CUDA device): there is nothing to match."""
    t = {}
    for name, capture in (("captured", True), ("eager", False), ("eager_again", False)):
        cfg = _config(m, capture, common, precision=prec, epochs=1,
                      max_steps=trace_steps, out=f"{tmp}/trace/{name}")
        t[name], captured = _trace(cfg, trace_steps)
        if capture and not captured:
            log.warning("loss match of %s skipped: no CUDA graph ran on %s", m,
                        cfg.device or "this machine")
            return None
    return {"method": m, "precision": prec, "steps": trace_steps,
            "max_rel_diff_captured_vs_eager": _max_rel(t["eager"], t["captured"]),
            "max_rel_diff_eager_vs_eager": _max_rel(t["eager"], t["eager_again"]),
            "loss_eager": t["eager"], "loss_captured": t["captured"]}


def trainer_timing(methods: Sequence[str], out: Path, *, conditioning: str = "ill",
                   precisions: Sequence[str] = ("bf16",), epochs: int = 2,
                   trace_steps: int = 256, data_root: str | None = None,
                   source: str = "auto", model: str = "resnet18",
                   device: str | None = None, train_subset: int | None = None,
                   force: bool = False) -> dict:
    """Epoch times eager vs captured for each method and precision, and the per-step
    loss match over ``trace_steps`` steps; written to ``out`` (with provenance)."""
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ValueError(f"methods must be names from {sorted(METHODS)}, got {bad}")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be an integer >= 1, got {epochs!r}")
    if isinstance(trace_steps, bool) or not isinstance(trace_steps, int) \
            or trace_steps < 1:
        raise ValueError(f"trace_steps must be an integer >= 1, got {trace_steps!r}")
    out = Path(out)
    if out.exists() and not force:
        raise guard.ConfigMismatchError(f"{out} exists; {guard.FORCE_HINT}")
    with tempfile.TemporaryDirectory(prefix="kwng-timing-") as tmp:
        common = {"conditioning": conditioning, "schedule": "authors",
                  "epochs": max(epochs, 1), "data_root": data_root, "source": source,
                  "model": model, "device": device, "out": f"{tmp}/out",
                  "checkpoint_dir": f"{tmp}/ck", "train_subset": train_subset,
                  "channels_last": True}
        rows = _epoch_rows(methods, precisions, epochs, common, tmp)
        traces = [_loss_match(m, precisions[0], trace_steps, common, tmp)
                  for m in methods if METHODS[m].not_capturable is None]
        traces = [t for t in traces if t is not None]
    dev = str(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu"
    result = {"rows": rows, "loss_match": traces, "device": dev,
              "config": {"methods": list(methods), "conditioning": conditioning,
                         "precisions": list(precisions), "epochs": epochs,
                         "trace_steps": trace_steps, "model": model,
                         "train_subset": train_subset,
                         "lrs": {m: METHODS[m].timing_lr for m in methods}},
              "provenance": make_provenance(
                  config={"methods": list(methods), "precisions": list(precisions)},
                  seeds={"seed": 0, "data": 10_000}, device=device)}
    guard.write_json_guarded(out, result, force)
    return result


# ----------------------------------------------------------------------------- commands
def timing_command(p: argparse.ArgumentParser, rest: list[str]) -> int:
    """``cifar timing``: :func:`timing` of the claim suite's methods (or ``--methods``),
    an existing output file moved to a dated backup with ``--force``."""
    add = p.add_argument
    add("--methods", default="claim",
        type=names_arg(list(METHODS), extra=("all", "claim")))
    add("--dataset", default="cifar10", choices=DATASETS)
    add("--conditioning", default="ill", choices=CONDITIONINGS)
    add("--steps", type=int_arg(1), default=30)
    add("--warmup", type=int_arg(0), default=5)
    add("--device", default=None)
    add("--model", default="resnet18", choices=tuple(NETWORKS))
    add("--out", default=str(CLAIM / "timing" / "timing.json"))
    a = p.parse_args(rest)
    if device_problem(a.device):
        p.error(device_problem(a.device))
    methods = {"all": list(METHODS), "claim": list(CLAIM_METHODS)}.get(
        a.methods[0], a.methods
    )
    for f in (Path(a.out), Path(a.out).parent / "provenance.json"):
        if f.exists() and not a.force:
            raise guard.ConfigMismatchError(f"{f} exists; {guard.FORCE_HINT}")
        if f.exists():
            guard.backup(f)
    timing(methods, a.dataset, a.conditioning, a.steps, a.warmup, a.device,
           Path(a.out), a.model)
    return 0


def trainer_timing_command(p: argparse.ArgumentParser, rest: list[str]) -> int:
    """``cifar trainer-timing``: :func:`trainer_timing`, its rows logged."""
    add = p.add_argument
    add("--methods", default="sgd,adam,kfac,kwng", type=names_arg(list(METHODS)))
    add("--conditioning", default="ill", choices=CONDITIONINGS)
    add("--precisions", default="bf16", type=names_arg(TIMED_PRECISIONS),
        help="comma list of fp32, bf16")
    add("--epochs", type=int_arg(1), default=2)
    add("--trace-steps", type=int_arg(1), default=256)
    add("--data-root", default=None)
    add("--source", default="auto", choices=("auto", "official", "jpeg", "sample"))
    add("--model", default="resnet18", choices=tuple(NETWORKS))
    add("--device", default=None)
    add("--train-subset", type=int_arg(1), default=None)
    add("--out", default=str(RESULTS / "authors100" / "timing" / "trainer_timing.json"))
    a = p.parse_args(rest)
    if device_problem(a.device):
        p.error(device_problem(a.device))
    res = trainer_timing(
        a.methods, Path(a.out), conditioning=a.conditioning, precisions=a.precisions,
        epochs=a.epochs, trace_steps=a.trace_steps, data_root=a.data_root,
        source=a.source, model=a.model, device=a.device, train_subset=a.train_subset,
        force=a.force)
    for r in res["rows"]:
        log.info("trainer timing %-12s %s %-8s epoch %.2f s (loop %.2f s, after "
                 "%.2f s, %.2f ms/step)", r["method"], r["precision"], r["mode"],
                 r["steady_epoch_s"], r["steady_train_s"], r["steady_after_s"],
                 r["steady_ms_per_step"])
    for t in res["loss_match"]:
        log.info("loss match %s over %d steps: captured vs eager %.3g, eager vs eager "
                 "%.3g", t["method"], t["steps"], t["max_rel_diff_captured_vs_eager"],
                 t["max_rel_diff_eager_vs_eager"])
    return 0


def schedule_command(p: argparse.ArgumentParser, rest: list[str]) -> int:
    """``cifar schedule``: :func:`schedule_epochs` of the claim plan, printed (and
    written with ``--out``)."""
    add = p.add_argument
    add("--plan", default="claim", choices=("claim",))
    add("--budget-s", type=number_arg(0), required=True)
    add("--timing", default=str(RESULTS / "timing" / "timing.json"))
    add("--concurrency-gain", type=number_arg(0), default=1.0)
    add("--gpus", type=int_arg(1), default=1)
    add("--procs-per-gpu", type=int_arg(1), default=None)
    add("--min-epochs", type=int_arg(1), default=1)
    add("--max-epochs", type=int_arg(1), default=400)
    add("--out", default=None, help="write the schedule here (default: print only)")
    a = p.parse_args(rest)
    plan = build_plan(a.plan)
    e = schedule_epochs(Path(a.timing), plan, a.budget_s, a.concurrency_gain,
                        a.min_epochs, a.max_epochs, gpus=a.gpus,
                        procs_per_gpu=a.procs_per_gpu)
    if a.out:
        guard.write_json_guarded(
            a.out, {"epochs": e, "budget_s": a.budget_s,
                    "concurrency_gain": a.concurrency_gain, "gpus": a.gpus,
                    "timing": a.timing, "plan": a.plan, "runs": len(plan),
                    "milestones": milestones_for(e, "claim")}, a.force)
    log.info("schedule: %d epochs fit %.0f s for plan %s (%d runs)", e, a.budget_s,
             a.plan, len(plan))
    print(e)
    return 0
