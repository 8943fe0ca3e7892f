"""Why a stale kernel system can stall: a per-step trace of an amortized KWNG run.

A CIFAR run of an amortized method (``refresh_every = k > 1``) is trained as the
trainer trains it (:class:`studies.cifar.train.Run`, eagerly: a graph replay
hides the per-step values), and on every step between refreshes a *twin*
preconditioner computes the direction that a fresh system would give at this step: the
same model, batch, samples, ``ε`` and basis draw (the random stream is forked, so the
run's own stream is untouched), ``refresh_every = 1`` in the float64 reference path. A
second forward pass feeds the twin; it moves copies of the BatchNorm running
statistics, and the gradient buffers are emptied before the run's own step, so the
traced run takes the steps of an untraced one (``tests/test_amortized_study.py``
checks it bit for bit on the CPU). The fresh direction depends on its random basis
too (``M`` points of the batch): a second fresh direction with another basis draw
at the same step gives the cosine that basis noise alone leaves (``cos_fresh_pair``),
the scale against which the stale direction's ``cos_fresh`` is read.

Each step gives one row (:data:`FIELDS`): the kind of step, the loss, ``ε``, the
reduction ratio ``r`` of the ε rule, the fallback and clipping of the safeguard, the
rank of ``C Cᵀ``'s solve, the cosine between ``g`` and the direction, and on steps
between refreshes the cosine between the applied direction and the fresh one, and
between ``g`` and the fresh one.

Command (a GPU machine; writes ``OUT/trace.csv`` and ``OUT/provenance.json``, and
refuses an ``OUT`` that holds a trace)::

    python -m studies.fig3.amortized.stale_trace --method kwng_k100 --seed 3 \\
        --epochs 15 --data-root DATA --out OUT
"""

from __future__ import annotations

import argparse
import csv
import io
import logging
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from studies.cifar.config import RunConfig
from studies.cifar.methods import METHODS
from studies.cifar.runtime import resolve_lr, run_identity_of
from studies.cifar.steps import autocast_for
from studies.cifar.train import Run
from studies.kit.provenance import atomic_write_text, write_provenance

__all__ = ["FIELDS", "StaleTrace", "trace_run", "read_trace", "by_age", "by_epoch",
           "TRACE_HEADER", "trace_table", "loss_jumps", "first_fallbacks", "main"]

log = logging.getLogger(__name__)

#: the columns of a trace row
FIELDS = ("step", "refresh", "loss", "eps", "ratio", "fallback", "clipped",
          "rank", "cos_g", "cos_fresh", "cos_g_fresh", "cos_fresh_pair")


def _flat(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1).double() for p in params])


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b))
    return float(torch.dot(a, b)) / den if den > 0 else math.nan


def _swap_bn_buffers(model: torch.nn.Module) -> list[tuple]:
    """Give every BatchNorm module copies of its running statistics, so that a
    forward pass in training mode moves the copies: the originals keep their values
    and their version counters (the run's own graph of this step saved them). Returns
    ``(module, name, original)`` to put back."""
    saved = []
    for mod in model.modules():
        if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
            for name, buf in list(mod.named_buffers(recurse=False)):
                if buf is not None:
                    saved.append((mod, name, buf))
                    setattr(mod, name, buf.clone())
    return saved


def _info_cos(info: dict) -> float:
    """The cosine between ``g`` and the direction of a step's ``info``."""
    den = float(info["grad_norm"]) * float(info["direction_norm"])
    return float(info["dot"]) / den if den > 0 else math.nan


class StaleTrace:
    """Installs the twin on ``run`` (a :class:`~studies.cifar.train.Run` of a
    KWNG method with ``refresh_every > 1``) and collects a row a step in ``rows``."""

    def __init__(self, run: Run) -> None:
        pc = getattr(run.method, "precond", None)
        if pc is None or not hasattr(pc, "cache") or pc.cache.every == 1:
            raise ValueError("the run's method must be KWNG with refresh_every > 1, "
                             f"got {run.cfg.method!r}")
        from kwng.engine.precond import KWNGPreconditioner

        self.run, self.pc, self.rows = run, pc, []
        cfg = pc.config.replace(refresh_every=1, refresh_guard=False, eps_schedule=None,
                                mode="reference")
        self.twin = KWNGPreconditioner(pc.model, cfg)
        self._direction = run.method.direction
        run.method.direction = self._traced

    def _fresh(self, batch: tuple) -> tuple[torch.Tensor, float, float]:
        """The fresh system's direction on ``batch`` at this step, its cosine with
        ``g``, and its cosine with a second fresh direction of another basis draw (the
        run's state untouched)."""
        pc = self.pc
        devices = [pc.params[0].device] if pc.params[0].is_cuda else []
        with torch.random.fork_rng(devices=devices):
            d, info = self._twin_step(batch)
            d2, _ = self._twin_step(batch)
        return d, _info_cos(info), _cos(d, d2)

    def _twin_step(self, batch: tuple) -> tuple[torch.Tensor, dict]:
        run, pc = self.run, self.pc
        saved = _swap_bn_buffers(run.model)
        with autocast_for(batch[0].device, run.cfg.precision):
            h, out = run.model.forward_both(batch[0])
            loss = F.cross_entropy(out.float(), batch[1])
        self.twin.lm.eps.copy_(pc.lm.eps)
        info = self.twin.step(loss, out if run.method.samples == "scaled" else h)
        for mod, name, buf in saved:
            setattr(mod, name, buf)
        d = _flat(self.twin.params)
        for p in pc.params:
            p.grad = None
        return d, info

    def _traced(self, loss: torch.Tensor, outputs: torch.Tensor,
                hidden: torch.Tensor | None, batch: tuple | None) -> dict:
        pc = self.pc
        refresh = pc.cache.due
        fresh, fresh_g, pair = ((None, math.nan, math.nan) if refresh
                                else self._fresh(batch))
        info = self._direction(loss, outputs, hidden, batch)
        self.rows.append({
            "step": len(self.rows), "refresh": int(refresh),
            "loss": float(loss.detach()),
            "eps": float(info["eps"]), "ratio": float(info["reduction_ratio"]),
            "fallback": int(info["fallback"]), "clipped": int(info["clipped"]),
            "rank": int(info["rank"]), "cos_g": _info_cos(info),
            "cos_fresh": math.nan if fresh is None else _cos(_flat(pc.params), fresh),
            "cos_g_fresh": fresh_g, "cos_fresh_pair": pair})
        return info

    def csv(self) -> str:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(self.rows)
        return buf.getvalue()


def trace_run(settings: dict[str, Any], out: str | Path) -> StaleTrace:
    """Train ``settings`` (a :class:`~studies.cifar.config.RunConfig` dict:
    eager, its records and checkpoints under ``out``) with the trace installed; write
    ``out/trace.csv`` and ``out/provenance.json``. Refuses an ``out`` with a trace."""
    out = Path(out)
    if (out / "trace.csv").exists():
        raise FileExistsError(f"{out / 'trace.csv'} exists: choose another --out "
                              "(a trace is never overwritten)")
    cfg = RunConfig.of({**settings, "capture": False, "out": str(out / "run"),
                        "checkpoint_dir": str(out / "checkpoints")})
    lr = resolve_lr(cfg)
    run = Run(cfg, lr, run_identity_of(cfg, lr))
    tr = StaleTrace(run)
    run.train_all(progress=True)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "trace.csv", tr.csv())
    write_provenance(out, cfg.to_dict(), seeds={"seed": cfg.seed},
                     device=str(run.device), lr=lr, method_spec=cfg.spec,
                     what="per-step trace of an amortized KWNG run "
                          "(studies.fig3.amortized.stale_trace)")
    return tr


def read_trace(path: str | Path) -> list[dict[str, float]]:
    """The rows of a committed ``trace.csv`` (:data:`FIELDS`, every value a float;
    the fresh-direction cosines are NaN on refresh steps). Raises ``ValueError`` when
    the file lacks a column of :data:`FIELDS`."""
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        missing = sorted(set(FIELDS) - set(reader.fieldnames or ()))
        if missing:
            raise ValueError(f"{path} lacks the trace columns {missing}")
        return [{k: float(r[k]) for k in FIELDS} for r in reader]


def by_age(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """Per age of the system (steps since its refresh: 1, 2, ...), over the steps
    between refreshes of ``rows``: ``age``, ``steps``, the median cosine of the reused
    direction with a fresh one (``cos_fresh``) and of two fresh ones of different basis
    draws (``cos_fresh_pair``, what basis noise alone leaves), and the share of steps
    that fell back to ``g`` (``fallback``)."""
    ages: dict[int, list[dict[str, float]]] = {}
    age = 0
    for r in rows:
        age = 0 if r["refresh"] else age + 1
        if age:
            ages.setdefault(age, []).append(r)

    return [{"age": a, "steps": len(rs),
             "cos_fresh": _median([r["cos_fresh"] for r in rs]),
             "cos_fresh_pair": _median([r["cos_fresh_pair"] for r in rs]),
             "fallback": sum(r["fallback"] for r in rs) / len(rs)}
            for a, rs in sorted(ages.items())]


def _median(vals: list[float]) -> float:
    vals = [v for v in vals if math.isfinite(v)]
    return statistics.median(vals) if vals else math.nan


def by_epoch(rows: list[dict[str, float]], epochs: int) -> list[dict[str, float]]:
    """``rows`` cut into ``epochs`` equal epochs (the trace's ``stop_after_epoch``): per
    epoch its ``steps``, the median ``loss``, the ``fallbacks`` (steps whose direction
    fell back to ``g``), the last ``eps``, and the medians of ``cos_fresh`` and
    ``cos_fresh_pair`` over its steps between refreshes."""
    if epochs < 1 or len(rows) % epochs:
        raise ValueError(f"epochs must be >= 1 and divide the {len(rows)} rows, "
                         f"got {epochs}")
    n = len(rows) // epochs
    out = []
    for e in range(epochs):
        rs = rows[e * n:(e + 1) * n]
        out.append({"epoch": e + 1, "steps": n,
                    "loss": _median([r["loss"] for r in rs]),
                    "fallbacks": int(sum(r["fallback"] for r in rs)),
                    "eps": rs[-1]["eps"],
                    "cos_fresh": _median([r["cos_fresh"] for r in rs]),
                    "cos_fresh_pair": _median([r["cos_fresh_pair"] for r in rs])})
    return out


#: the columns of :func:`trace_table`
TRACE_HEADER = ("epoch", "median loss", "fallbacks", "ε at its end",
                "cos reused–fresh (median)", "cos fresh–fresh (median)")


def trace_table(epochs: list[dict[str, float]]) -> tuple[tuple[str, ...], list[tuple]]:
    """``(header, rows)`` of :func:`by_epoch`'s epochs, for a page."""
    return TRACE_HEADER, [(str(e["epoch"]), f"{e['loss']:.2f}", str(e["fallbacks"]),
                           f"{e['eps']:.1e}", f"{e['cos_fresh']:.3f}",
                           f"{e['cos_fresh_pair']:.3f}") for e in epochs]


def loss_jumps(rows: list[dict[str, float]], factor: float = 2.0) -> dict[str, int]:
    """How often the next step's loss is at least ``factor`` times this step's, after
    a step that fell back to ``g`` and after one that did not: ``after_fallback`` of
    ``fallback_steps``, ``after_other`` of ``other_steps``."""
    if factor <= 1:
        raise ValueError(f"factor must be > 1, got {factor}")
    out = {"after_fallback": 0, "fallback_steps": 0, "after_other": 0, "other_steps": 0}
    for a, b in zip(rows, rows[1:]):
        kind = "fallback" if a["fallback"] else "other"
        out[f"{kind}_steps"] += 1
        out[f"after_{kind}"] += int(b["loss"] >= factor * a["loss"])
    return out


def first_fallbacks(rows: list[dict[str, float]], n: int = 3) -> list[dict[str, float]]:
    """The first ``n`` steps that fell back to ``g``: ``step``, the step's ``loss``
    (its batch, before the update), ``next_loss`` (the next batch's, after it; NaN for
    the last row) and whether the fallback direction was ``clipped``."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    out = []
    for i, r in enumerate(rows):
        if r["fallback"] and len(out) < n:
            nxt = rows[i + 1]["loss"] if i + 1 < len(rows) else math.nan
            out.append({"step": int(r["step"]), "loss": r["loss"], "next_loss": nxt,
                        "clipped": bool(r["clipped"])})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m studies.fig3.amortized.stale_trace",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", required=True,
                    choices=[m for m, v in METHODS.items()
                             if v.settings.get("refresh_every", 1) > 1])
    ap.add_argument("--conditioning", default="ill", choices=("ill", "well"))
    ap.add_argument("--lr", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=15,
                    help="epochs traced (the authors' schedule of 100 epochs is cut)")
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--source", default="auto")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--train-subset", type=int, default=None)
    ap.add_argument("--val-size", type=int, default=5000,
                    help="images held out of training (the protocol's 5,000)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    settings = {"method": a.method, "conditioning": a.conditioning, "lr": a.lr,
                "seed": a.seed, "epochs": 100, "stop_after_epoch": a.epochs,
                "schedule": "authors", "val_size": a.val_size, "eval_test": True,
                "batch_size": a.batch_size,
                "precision": "bf16" if torch.cuda.is_available() else "fp32",
                "channels_last": torch.cuda.is_available(), "data_root": a.data_root,
                "source": a.source, "model": a.model, "train_subset": a.train_subset,
                "device": a.device}
    tr = trace_run(settings, a.out)
    print(f"{len(tr.rows)} steps traced into {Path(a.out) / 'trace.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
