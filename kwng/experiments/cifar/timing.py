"""The CIFAR trainer, eager against graph-captured, measured side by side in one process
on one device (book chapter :ref:`experiments-cifar`).

:func:`trainer_timing` trains each method for a few whole epochs twice — eagerly and
with its step replayed from a CUDA graph
(:class:`~kwng.experiments.cifar.steps.StepRunner`) — and records, per epoch, the wall
time of the training loop, of the evaluation and record keeping after it, and of the
whole epoch. It then checks that the graph computes what the eager step computes: with
cuDNN deterministic and its benchmark search off, it trains ``trace_steps`` steps from
the same seed eagerly twice and captured once and compares the per-step losses (the two
eager runs give the noise floor of the device's own non-determinism). Results go to a
JSON file with provenance; an existing file is kept unless ``force``.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from kwng.experiments import guard
from kwng.experiments.cifar.config import RunConfig
from kwng.experiments.cifar.methods import METHODS
from kwng.experiments.cifar.runtime import sync
from kwng.experiments.cifar.train import Run
from kwng.experiments.provenance import make_provenance

__all__ = ["trainer_timing"]

log = logging.getLogger(__name__)

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
