"""Weak scaling of KWNG data-parallel against SGD under DistributedDataParallel (book
chapter :ref:`distributed`).

One ``torchrun`` job per world size ``W`` (``scripts/run_ddp_scaling.sh`` runs W = 1, 2,
4 and merges them with :mod:`studies.bench.ddp_record`)::

    torchrun --nproc-per-node=W -m studies.bench.ddp_scaling --out part_W.json
    python -m studies.bench.ddp_record part_1.json part_2.json part_4.json \\
        --out ddp_scaling.json

Each rank trains ResNet-18 (:func:`studies.cifar.nets.resnet18`) on its own
random CIFAR-shaped batch of ``--batch`` images (128: the global batch is ``W × 128``,
weak scaling), in fp32 and in bf16 autocast, ``channels_last`` on a GPU (as
:mod:`studies.bench.step_cost`), and times the rows

* ``sgd_ddp``: SGD with momentum, the model wrapped in ``DistributedDataParallel``;
* ``kwng``: the same optimizer behind :class:`kwng.engine.distributed.DistributedKWNG`
  (``M = --num-basis``, the fast path);
* at ``W = 1`` also ``sgd_plain`` and ``kwng_plain``: the one-GPU steps without any
  wrapper (:class:`kwng.KWNGPreconditioner`), the baseline of the efficiency;

each eager and captured in a CUDA graph (the collectives inside; DDP is built on a side
stream and warmed up 11 steps, as PyTorch's notes on whole-network capture ask). A
capture that fails is recorded with its error and the row is timed eagerly instead
(``capture_fallbacks``, logged). Step times are medians of CUDA-event intervals on
rank 0 (wall clock on a CPU); every rank's median is kept. The collectives are also
timed alone on the same sizes: the all-reduce of ``(M + 1)·q`` values (KWNG), of ``q``
values (SGD's gradient, which DDP overlaps with the backward pass) and KWNG's
all-gather.

The merge adds per row the weak-scaling efficiency ``t_plain(W = 1) / t(W)`` (same
method, precision and capture) and the share of the step that the collective alone
takes, and a summary per precision and capture at the largest ``W``. An existing
``--out`` is never overwritten (``--force`` moves it to a dated backup).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from studies.bench.timed import training_step
from studies.kit.guard import backup
from studies.kit.provenance import atomic_write_json, make_provenance

__all__ = ["main", "run", "SCALING_METHODS", "PLAIN", "PRECISIONS", "CAPTURES"]

log = logging.getLogger(__name__)

SCALING_METHODS = ("sgd_ddp", "kwng")
PLAIN = {"sgd_ddp": "sgd_plain", "kwng": "kwng_plain"}
PRECISIONS = ("fp32", "bf16")
CAPTURES = ("eager", "graph")
DDP_WARMUP = 11  # eager DDP steps before a capture (PyTorch's CUDA-graph notes)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], None], device: torch.device, steps: int) -> list[float]:
    """Per-call times in ms: CUDA-event intervals on the device's stream (no host sync
    between calls), wall clock on a CPU."""
    if device.type == "cuda":
        ev = [tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))
              for _ in range(steps)]
        for a, b in ev:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize(device)
        return [a.elapsed_time(b) for a, b in ev]
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        out.append(1e3 * (time.perf_counter() - t0))
    return out


def _build(method: str, base: nn.Module, z: torch.Tensor, y: torch.Tensor, M: int,
           precision: str, device: torch.device):
    """A fresh model and the step function of ``method``: ``(step, precond)``."""
    from kwng.engine.distributed import DistributedKWNG
    from kwng.engine.precond import KWNGPreconditioner

    model = copy.deepcopy(base).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    net, precond = model, None
    if method == "sgd_ddp":
        side = torch.cuda.Stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            net = nn.parallel.DistributedDataParallel(
                model, device_ids=[device] if device.type == "cuda" else None)
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)
    elif method in ("kwng", "kwng_plain"):
        kw = dict(lr=lambda: opt.param_groups[0]["lr"], num_basis=M, eps=1e-5,
                  mode="fast")
        precond = (DistributedKWNG(model, batch_sizes=z.shape[0], **kw)
                   if method == "kwng" else KWNGPreconditioner(model, **kw))
    amp = torch.bfloat16 if precision == "bf16" else None
    step = training_step(net, opt, z, y, precond, amp)
    return step, precond


def _agree(ok: bool, device: torch.device) -> bool:
    """Whether every rank says ``ok`` (a collective: all ranks must call it)."""
    t = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item() == 1.0)


def _row(method: str, precision: str, capture: str, base, z, y, args,
         device: torch.device) -> dict:
    from kwng.engine.capture import capture_step

    # free the allocator before the step is built (as studies.bench.step_cost)
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    step, precond = _build(method, base, z, y, args.num_basis, precision, device)
    warm = max(args.warmup, DDP_WARMUP if method == "sgd_ddp" else 0)
    fn, error, captured = step, None, False
    if capture == "graph" and device.type != "cuda":
        error = "no CUDA device: CUDA graphs need one"
    elif capture == "graph":
        try:
            fn, captured = capture_step(step, warmup=warm), True
        except Exception as exc:  # noqa: BLE001  (recorded, counted and logged)
            error = f"{type(exc).__name__}: {exc}"[:500]
        if not _agree(captured, device) and captured:  # every rank replays, or none
            captured, error = False, "another rank's capture failed"
    if capture == "graph" and not captured:
        log.warning("%s %s: not captured, timed eagerly: %s", method, precision, error)
        fn = step
    for _ in range(0 if captured else warm):
        step()
    _sync(device)
    times = _time(fn, device, args.steps)
    med = statistics.median(times)
    meds = [torch.zeros(1, dtype=torch.float64, device=device)
            for _ in range(dist.get_world_size())]
    dist.all_gather(meds, torch.tensor([med], dtype=torch.float64, device=device))
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [med, med, med]
    rec = {"method": method, "precision": precision, "capture": capture,
           "captured": captured, "capture_error": error, "median_ms": med,
           "q25_ms": q[0], "q75_ms": q[2], "steps": len(times),
           "rank_medians_ms": [float(m) for m in meds]}
    if precond is not None:
        rec["counters"] = precond.counters()
        precond.remove_hooks()
    log.info("W=%d %-10s %-4s %-5s %8.2f ms%s", dist.get_world_size(), method,
             precision, capture, med, "" if error is None else f"  ({error[:80]})")
    return rec


def _collectives(q: int, n_gather: int, args, device: torch.device) -> dict:
    """Median times of the step's collectives alone, on buffers of the same sizes
    (``n_gather``: the values each rank sends in KWNG's all-gather)."""
    from kwng.engine.distributed import _all_gather

    out = {}
    for name, n, op in (("allreduce_kwng", (args.num_basis + 1) * q, "reduce"),
                        ("allreduce_sgd", q, "reduce"),
                        ("allgather_kwng", n_gather, "gather")):
        buf = torch.ones(n, device=device)
        recv = torch.empty(n * dist.get_world_size(), device=device)
        fn = ((lambda b=buf: dist.all_reduce(b)) if op == "reduce"
              else (lambda b=buf, r=recv: _all_gather(r, b)))
        for _ in range(3):
            fn()
        _sync(device)
        out[name] = {"values": n, "median_ms": statistics.median(
            _time(fn, device, max(5, args.steps)))}
    return out


def _device(args) -> torch.device:
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def run(args) -> dict | None:
    """One world size: every row on every rank; rank 0 writes ``args.out``."""
    from studies.cifar.nets import resnet18, tiny_cnn

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout))
    device = _device(args)
    W, rank = dist.get_world_size(), dist.get_rank()
    if rank:
        logging.getLogger().setLevel(logging.WARNING)  # rank 0 reports
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    torch.manual_seed(args.seed)  # the same model everywhere
    base = resnet18(10) if args.model == "resnet18" else tiny_cnn(10, width=8)
    base = base.to(device)
    fmt = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    base = base.to(memory_format=fmt)
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own data
    z = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=gen)
    z = z.to(device).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (args.batch,), generator=gen).to(device)
    q = sum(p.numel() for p in base.parameters())
    names = [None] * W
    dist.all_gather_object(names, torch.cuda.get_device_name(device)
                           if device.type == "cuda" else "cpu")
    config = {k: v for k, v in vars(args).items() if k != "force"}
    record = {"world_size": W, "per_rank_batch": args.batch,
              "global_batch": W * args.batch,
              "model": args.model, "q": q, "num_basis": args.num_basis,
              "devices": names, "rows": [], "capture_fallbacks": 0}
    t0 = time.time()
    n_gather = args.batch * 10 + 1 + 2 * args.num_basis  # d = 10 classes
    record["collectives"] = _collectives(q, n_gather, args, device)
    record["provenance"] = make_provenance(
        config, seeds={"model": args.seed, "data": f"{args.seed + 1} + rank"},
        device=str(device), devices=names, world_size=W, wall_time_s=None)
    # the riskiest row last: a failed or hung capture of DDP keeps every other row
    methods = [*(("kwng_plain", "sgd_plain") if W == 1 else ()), "kwng", "sgd_ddp"]
    for capture in args.captures:
        for method in methods:
            for precision in args.precisions:
                rec = _row(method, precision, capture, base, z, y, args, device)
                record["rows"].append(rec)
                fell_back = capture == "graph" and not rec["captured"]
                record["capture_fallbacks"] += int(fell_back)
                record["provenance"]["wall_time_s"] = time.time() - t0
                if rank == 0:  # after every row: a crash keeps what was measured
                    atomic_write_json(args.out, record)
    if rank == 0:
        atomic_write_json(args.out, record)
    dist.barrier()
    dist.destroy_process_group()
    return record if rank == 0 else None


def _csv(text: str, allowed: tuple[str, ...], name: str, p) -> list[str]:
    got = [t for t in text.split(",") if t]
    if not got or set(got) - set(allowed):
        p.error(f"{name} must be a comma list of {list(allowed)}, got {text!r}")
    return got


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(prog="python -m studies.bench.ddp_scaling",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the result file (never overwritten)")
    p.add_argument("--force", action="store_true",
                   help="move an existing --out to a dated backup first")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=("cuda", "cpu"))
    p.add_argument("--model", default="resnet18", choices=("resnet18", "tiny"))
    p.add_argument("--batch", type=int, default=128, help="per-rank batch")
    p.add_argument("--num-basis", type=int, default=5)
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--captures", default="eager,graph")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective may wait for the other ranks")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    out = Path(args.out)
    if out.exists() and not args.force:
        p.error(f"--out {out} exists (a committed result?): pass another --out, or "
                "--force to move it to a dated backup")
    for name in ("batch", "num_basis", "steps", "image_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be an integer >= 1, got "
                    f"{getattr(args, name)}")
    if args.num_basis > args.batch:
        p.error(f"--num-basis must lie in [1, --batch={args.batch}], got "
                f"{args.num_basis}")
    if args.warmup < 0:
        p.error(f"--warmup must be an integer >= 0, got {args.warmup}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here (use --device cpu)")
    if "RANK" not in os.environ:
        p.error("launch with torchrun (python -m torch.distributed.run "
                "--nproc-per-node=W -m studies.bench.ddp_scaling ...)")
    args.precisions = _csv(args.precisions, PRECISIONS, "--precisions", p)
    args.captures = _csv(args.captures, CAPTURES, "--captures", p)
    if out.exists() and int(os.environ["RANK"]) == 0:
        backup(out)  # --force
    return run(args)


if __name__ == "__main__":
    main()
