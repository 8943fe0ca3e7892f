"""Which exact path is faster on this device: the step cost of ``mode="fast"`` and
``mode="reference"`` side by side, with SGD, the measurement behind ``mode="auto"``
(:data:`kwng.engine.config.AUTO_MODES`).

Run ``python -m studies.bench.mode_choice --device cpu`` (and ``--device
cuda`` on a GPU). For each model (``cnn``: a small CNN with batch norm on ``3 × 32 ×
32`` images, the size a user's first script has; ``mlp``: a dense network with many
parameters; ``resnet18``: the paper's network) every row times a whole training step
(forward, loss, the preconditioner's backward passes and direction,
``optimizer.step()``) with a device synchronisation after each step. The rows take
turns in ``--rounds`` rounds (so that a machine shared with other work slows every
row alike); the median is reported next to the SGD step's.

The verdict of a model is the faster mode; a model *kind* (``conv``: the model has a
``Conv2d``; ``dense``: it has none) takes ``reference`` when the geometric mean of
``fast / reference`` over its models exceeds 1, else ``fast``. The record
(``results/benchmarks/mode_choice/<device type>.json``) carries these verdicts
(``auto_modes``) and the provenance; an existing file is kept unless ``--force``
(dated backup).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import logging
import math
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from kwng.engine.precond import KWNGPreconditioner
from studies.bench.timed import time_steps, training_step
from studies.cifar.nets import mlp, resnet18, tiny_cnn
from studies.kit.provenance import (
    atomic_write_json,
    index_provenance,
    make_provenance,
)

__all__ = ["MODELS", "ROWS", "auto_modes", "main", "time_models"]

log = logging.getLogger(__name__)

#: model name -> (constructor, input shape of one sample, kind)
#:
#: :meta hide-value:
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], str]] = {
    "cnn": (lambda: tiny_cnn(10, width=16), (3, 32, 32), "conv"),
    "mlp": (lambda: mlp(784, 10, hidden=256, depth=2), (784,), "dense"),
    "resnet18": (lambda: resnet18(10), (3, 32, 32), "conv"),
}
ROWS = ("sgd", "fast", "reference")


def _step(row: str, model: nn.Module, z: torch.Tensor, y: torch.Tensor,
          num_basis: int) -> tuple[Callable[[], None], KWNGPreconditioner | None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    precond = None if row == "sgd" else KWNGPreconditioner(
        model, lr=1e-3, num_basis=num_basis, eps=1e-5, mode=row)

    return training_step(model, opt, z, y, precond), precond


def time_models(models: list[str], device: torch.device, batch: int, num_basis: int,
                steps: int, warmup: int, rounds: int) -> list[dict]:
    """One record per model and row: median and quartiles in ms, ratio to SGD."""
    out = []
    for name in models:
        build, shape, kind = MODELS[name]
        base = build().to(device).train()
        z = torch.randn(batch, *shape, device=device)
        y = torch.randint(0, 10, (batch,), device=device)
        built = {row: _step(row, copy.deepcopy(base), z, y, num_basis) for row in ROWS}
        times: dict[str, list[float]] = {row: [] for row in ROWS}
        for r in range(rounds):
            for row in ROWS:
                n = steps // rounds + (r < steps % rounds)
                times[row] += time_steps(built[row][0], device, n,
                                         warmup if r == 0 else 0)
        sgd = statistics.median(times["sgd"])
        for row in ROWS:
            med = statistics.median(times[row])
            t = times[row]
            q = statistics.quantiles(t, n=4) if len(t) > 1 else [med] * 3
            rec = {"model": name, "kind": kind, "mode": row, "num_basis": num_basis,
                   "median_ms": med, "q25_ms": q[0], "q75_ms": q[2],
                   "steps": len(times[row]), "ratio_to_sgd": med / sgd}
            precond = built[row][1]
            if precond is not None:
                rec["serial_steps"] = precond.counters()["serial_steps"]
                precond.remove_hooks()
            out.append(rec)
            log.info("  %-9s %-10s %9.2f ms  %5.2f x SGD", name, row, med,
                     rec["ratio_to_sgd"])
    return out


def auto_modes(rows: list[dict]) -> tuple[dict[str, str], dict[str, float]]:
    """The verdict per model kind and, per model, ``fast / reference`` (median
    times)."""
    med = {(r["model"], r["mode"]): r["median_ms"] for r in rows}
    kinds = {r["model"]: r["kind"] for r in rows}
    ratios = {m: med[(m, "fast")] / med[(m, "reference")] for m in kinds}
    verdict = {}
    for kind in dict.fromkeys(kinds.values()):
        logs = [math.log(v) for m, v in ratios.items() if kinds[m] == kind]
        verdict[kind] = "reference" if sum(logs) > 0 else "fast"
    return verdict, ratios


def _parse(argv: list[str] | None
           ) -> tuple[argparse.Namespace, torch.device, list[str]]:
    p = argparse.ArgumentParser(prog="python -m studies.bench.mode_choice",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default=None, help=f"comma list of {list(MODELS)} "
                   "(default: cnn,mlp on a CPU; all three on a GPU)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--num-basis", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5,
                   help="the rows take turns in this many rounds of steps/rounds steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="default: "
                   "results/benchmarks/mode_choice/<device type>.json")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --out (moved to a dated backup)")
    args = p.parse_args(argv)
    for name, low in (("batch", 1), ("num_basis", 1), ("steps", 1), ("warmup", 0),
                      ("rounds", 1)):
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be an integer >= {low}, got "
                    f"{getattr(args, name)}")
    if args.num_basis > args.batch:
        p.error(f"--num-basis must lie in [1, --batch={args.batch}], got "
                f"{args.num_basis}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error("--device must be a torch device such as cpu or cuda, got "
                f"{args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available on this machine")
    default = "cnn,mlp" if device.type == "cpu" else "cnn,mlp,resnet18"
    models = [m for m in (args.models or default).split(",") if m]
    if not models or set(models) - set(MODELS):
        p.error(f"--models must be a comma list of {list(MODELS)}, got {args.models!r}")
    args.out = args.out or f"results/benchmarks/mode_choice/{device.type}.json"
    if Path(args.out).exists() and not args.force:
        raise SystemExit(f"{args.out} exists (a committed result?): pass --out "
                         "elsewhere, or --force to move it to a dated backup")
    return args, device, models


def main(argv: list[str] | None = None) -> dict:
    args, device, models = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    torch.manual_seed(args.seed)
    config = vars(args).copy()
    log.info("studies.bench.mode_choice: %s", config)
    rows = time_models(models, device, args.batch, args.num_basis, args.steps,
                       args.warmup, args.rounds)
    verdict, ratios = auto_modes(rows)
    prov = make_provenance(config, seeds={"torch": args.seed}, device=str(device))
    record = {"device_type": device.type, "device": prov["device"],
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "rows": rows, "fast_over_reference": ratios, "auto_modes": verdict,
              "provenance": prov}
    path = Path(args.out)
    if path.exists():
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
        path.rename(path.with_name(f"{path.stem}.backup-{stamp}{path.suffix}"))
    atomic_write_json(path, record)
    index_provenance(path.parent)
    print("model     fast ms  reference ms  SGD ms  fast/reference")
    for m, v in ratios.items():
        med = {r["mode"]: r["median_ms"] for r in rows if r["model"] == m}
        print(f"{m:<9} {med['fast']:7.2f}  {med['reference']:12.2f}  {med['sgd']:6.2f}"
              f"  {v:14.2f}")
    print(f"auto on {device.type}: {verdict}   (wrote {path})")
    return record


if __name__ == "__main__":
    main()
