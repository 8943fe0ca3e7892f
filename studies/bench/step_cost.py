"""Cost of one training step: SGD vs KWNG, side by side, in one process on one device.

Run ``python -m studies.bench.step_cost`` on a GPU: the paper's ResNet-18
(Table 1) at batch ``N = 128``, CIFAR-shaped random inputs, in three configurations —
fp32 NCHW, fp32 ``channels_last`` and bf16 autocast + ``channels_last`` — and for each
configuration the rows

* ``sgd``: zero_grad → forward → loss → ``loss.backward()`` → ``optimizer.step()``;
* ``fwd_bwd_N`` and ``fwd_bwd_RN`` (``R = M + 1``): one forward + backward at batch
  ``N`` and at batch ``R·N`` — the second is the hardware limit of a KWNG step, which
  needs ``R`` backward passes over the same activations;
* ``kwng_fast`` / ``kwng_reference``: :class:`kwng.KWNGPreconditioner` in each mode
  (``M`` = 5 and 20); ``diag_fast``: ``diagonal_only=True`` (``D⁻¹ g``, the ablation of
  App. D.3);
* ``sgd_graph`` / ``kwng_fast_graph``: the step captured once in a CUDA graph and
  replayed (possible for KWNG because the fast step never synchronises with the host);
  the step size and the batch are then fixed at capture, as in any graph-captured
  training loop (:func:`kwng.engine.capture.capture_step`);
* on request (``--rows``, not in the default set): ``adam`` / ``adam_graph`` (Adam,
  eager and captured) and ``diag_fast_graph`` (the diagonal variant captured).

``--model vit`` times the Vision Transformer of :mod:`studies.cifar.vit` instead (every
parameter batched by the engine); its rows for the target "a captured KWNG step ≤ 4× a
captured SGD step" are ``--configs bf16_channels_last --rows
sgd,sgd_graph,adam,adam_graph,kwng_fast,kwng_fast_graph --num-basis 5 --refresh-every
1,20``.

With ``--refresh-every 1,5,20,100`` every KWNG row runs once per ``k``
(``refresh_every``, :class:`kwng.engine.precond.SystemCache`; records name it): a
captured row with ``k > 1`` records two graphs and replays the refresh graph every
``k`` steps. Such a row times a whole number of periods (``--steps`` rounded up to a
multiple of ``k``), so its ``mean_ms`` is the amortized step's cost whatever the
phase; ``ratio_to_sgd_graph`` compares it with the captured SGD step.

With ``--gpu-paths triton,compile`` the KWNG rows run once with the hand-written Triton
kernels and once with the ``torch.compile``d PyTorch functions
(``KWNGConfig(gpu_solve=...)``; each record names its ``gpu_path``): the whole step side
by side, for the rule that keeps a kernel only where it is measurably faster.

Each row is timed after warm-up steps, with a device synchronisation after every step;
the median is reported with its ratio to the ``sgd`` row of the same configuration, and
the peak memory (``peak_mem_mb``, warm-up included; ``steady_peak_mem_mb``, the timed
steps only: the warm-up of a process's first KWNG row also holds the compilation's and
cuDNN's one-off allocations). The table goes to ``results/benchmarks/step_cost.json``
with provenance; an existing file is kept unless ``--force`` (which moves it to a dated
backup).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import logging
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from kwng.engine.capture import capture_step
from kwng.engine.gpu_paths import GPU_SOLVES
from kwng.engine.precond import KWNGPreconditioner
from studies.bench.timed import _warm_then_time, training_step
from studies.cifar.nets import NETWORKS, mlp
from studies.kit.provenance import (
    atomic_write_json,
    index_provenance,
    make_provenance,
)

__all__ = ["bench_config", "CONFIGS", "EXTRA_ROWS", "MODELS", "ROWS", "main"]

log = logging.getLogger(__name__)

CONFIGS = {"fp32_nchw": (torch.float32, torch.contiguous_format),
           "fp32_channels_last": (torch.float32, torch.channels_last),
           "bf16_channels_last": (torch.bfloat16, torch.channels_last)}
ROWS = ("sgd", "sgd_graph", "fwd_bwd_N", "fwd_bwd_RN", "kwng_fast", "kwng_reference",
        "diag_fast", "kwng_fast_graph")
#: rows run only when ``--rows`` names them (the committed table holds :data:`ROWS`)
EXTRA_ROWS = ("adam", "adam_graph", "diag_fast_graph")
_PLAIN = ("sgd", "sgd_graph", "fwd_bwd_N", "adam", "adam_graph")
#: ``--model``: the CIFAR kit's networks (10 classes) and an MLP on 784 inputs
MODELS = {**NETWORKS, "mlp": lambda k: mlp(784, k, hidden=256, depth=2)}


def _make_step(row: str, model: nn.Module, z: torch.Tensor, y: torch.Tensor,
               num_basis: int, amp: torch.dtype | None, refresh_every: int = 1,
               gpu_solve: str = "auto"
               ) -> tuple[Callable[[], None], KWNGPreconditioner | None]:
    graph = row.endswith("_graph")
    row = row.removesuffix("_graph")
    opt = (
        torch.optim.Adam(model.parameters(), lr=1e-3, capturable=graph)
        if row == "adam"
        else torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    )
    precond = None
    if row in ("kwng_fast", "kwng_reference", "diag_fast"):
        precond = KWNGPreconditioner(
            model,
            lr=1e-3,
            num_basis=num_basis,
            eps=1e-5,
            mode="reference" if row == "kwng_reference" else "fast",
            diagonal_only=row == "diag_fast",
            refresh_every=refresh_every,
            gpu_solve=gpu_solve,
        )
    if row == "fwd_bwd_RN":
        z = z.repeat((num_basis + 1,) + (1,) * (z.dim() - 1)).contiguous(
            memory_format=torch.channels_last
            if z.is_contiguous(memory_format=torch.channels_last)
            and not z.is_contiguous()
            else torch.contiguous_format
        )
        y = y.repeat(num_basis + 1)

    step = training_step(model, opt, z, y, precond, amp,
                         optimizer_step=precond is not None or row in ("sgd", "adam"))

    # the whole step captured once and replayed: no Python or launch cost per step
    if graph:
        if z.device.type != "cuda":
            raise ValueError("the *_graph rows need a CUDA device")
        return capture_step(step, preconditioner=precond), precond
    return step, precond


def _time_row(row: str, M: int, base: nn.Module, z: torch.Tensor, y: torch.Tensor,
              amp: torch.dtype | None, steps: int, warmup: int, refresh_every: int = 1,
              gpu_solve: str = "auto") -> dict:
    """One row's record (times in ms, peak memory, the preconditioner's counters); with
    ``refresh_every = k > 1`` a whole number of periods is timed."""
    device = z.device
    m = copy.deepcopy(base).train()
    if device.type == "cuda":  # before the step is built: emptying the cache after a
        torch.cuda.empty_cache()  # capture also freed the cuBLAS workspace that the
        torch.cuda.reset_peak_memory_stats(device)  # graph replays (illegal access)
    step, precond = _make_step(row, m, z, y, max(M, 1), amp, refresh_every,
                               gpu_solve)
    n = steps if row != "kwng_reference" else max(5, steps // 3)
    n = -(-n // refresh_every) * refresh_every
    times = _warm_then_time(step, device, n, warmup)
    rec = {
        "mode": row,
        "num_basis": M or None,
        "median_ms": statistics.median(times),
        "mean_ms": statistics.fmean(times),
        "min_ms": min(times),
        "q25_ms": statistics.quantiles(times, n=4)[0] if len(times) > 1 else times[0],
        "q75_ms": statistics.quantiles(times, n=4)[2] if len(times) > 1 else times[0],
        "steps": len(times),
    }
    if device.type == "cuda":
        rec["steady_peak_mem_mb"] = times.steady_peak / 2 ** 20
        rec["peak_mem_mb"] = max(times.warm_peak, times.steady_peak) / 2 ** 20
    if precond is not None:
        rec["refresh_every"] = refresh_every
        rec["counters"] = precond.counters()
        precond.remove_hooks()
    return rec


def bench_config(model: nn.Module, z: torch.Tensor, y: torch.Tensor, *,
                 precision: torch.dtype, memory_format: torch.memory_format,
                 basis_sizes: tuple[int, ...], steps: int, warmup: int,
                 rows: tuple[str, ...] = ROWS, gpu_paths: tuple[str, ...] = ("triton",),
                 refresh_every: tuple[int, ...] = (1,)) -> list[dict]:
    """Time every row in one configuration; returns records with ``ratio_to_sgd``
    (medians) and ``ratio_to_sgd_graph`` (means, where an ``sgd_graph`` row ran). The
    KWNG rows run once per entry of ``gpu_paths`` (``KWNGConfig.gpu_solve``: the
    hand-written kernels or ``torch.compile``) and of ``refresh_every``; their records
    name both."""
    base = copy.deepcopy(model).to(memory_format=memory_format)
    z = z.contiguous(memory_format=memory_format) if z.dim() == 4 else z
    amp = None if precision == torch.float32 else precision
    out = []
    for row in rows:
        kwng_row = row.startswith(("kwng", "diag"))
        for M in (basis_sizes if row not in _PLAIN else (0,)):
            for path in gpu_paths if kwng_row else gpu_paths[:1]:
                for k in refresh_every if kwng_row else (1,):
                    rec = _time_row(row, M, base, z, y, amp, steps, warmup, k, path)
                    if kwng_row:
                        rec["gpu_path"] = path
                    out.append(rec)
                    log.info("  %-15s M=%-3s k=%-4s %-8s %8.2f ms (mean %.2f)", row,
                             M or "-", rec.get("refresh_every", "-"),
                             rec.get("gpu_path", ""), rec["median_ms"], rec["mean_ms"])
    sgd = next((r["median_ms"] for r in out if r["mode"] == "sgd"), None)
    sgd_graph = next((r["mean_ms"] for r in out if r["mode"] == "sgd_graph"), None)
    for r in out:
        r["ratio_to_sgd"] = None if sgd is None else r["median_ms"] / sgd
        r["ratio_to_sgd_graph"] = (
            None if sgd_graph is None else r["mean_ms"] / sgd_graph
        )
    return out


def _table(records: list[dict]) -> str:
    lines = [
        "| precision | memory format | mode | M | k | GPU path | median ms | mean ms | "
        "× SGD | "
        "peak MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        ratio = "" if r["ratio_to_sgd"] is None else f"{r['ratio_to_sgd']:.2f}"
        mem = f"{r['peak_mem_mb']:.0f}" if "peak_mem_mb" in r else ""
        lines.append(
            f"| {r['precision']} | {r['memory_format']} | {r['mode']} | "
            f"{r['num_basis'] or ''} | "
            f"{r.get('refresh_every', '')} | {r.get('gpu_path', '')} | "
            f"{r['median_ms']:.2f} | "
            f"{r['mean_ms']:.2f} | {ratio} | {mem} |"
        )
    return "\n".join(lines)


def _write(path: Path, record: dict, force: bool) -> None:
    if path.exists():
        if not force:
            raise SystemExit(
                f"{path} exists (a committed result?): pass --out elsewhere, or "
                "--force to move it "
                "to a dated backup first"
            )
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
        backup = path.with_name(f"{path.stem}.backup-{stamp}{path.suffix}")
        path.rename(backup)
        log.info("moved the old %s to %s", path, backup)
    atomic_write_json(path, record)


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """The integer options and the device of :func:`main`, checked before any row
    runs."""
    for name in ("batch", "steps", "image_size"):
        if getattr(args, name) < 1:
            p.error(
                f"--{name.replace('_', '-')} must be an integer >= 1, got "
                f"{getattr(args, name)}"
            )
    if args.warmup < 0:
        p.error(f"--warmup must be an integer >= 0, got {args.warmup}")
    if not args.out.strip():
        p.error("--out must be a file path, got an empty string")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(
            "--device must be a torch device such as cpu or cuda:0, got "
            f"{args.device!r}"
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(
            f"--device {args.device}: CUDA is not available on this machine (use "
            "--device cpu)"
        )
    return device


def _lists(p: argparse.ArgumentParser, args: argparse.Namespace,
           device: torch.device) -> dict:
    """The comma lists of the command line, checked (``p.error`` on a bad one)."""
    lists = {
        "configs": [c for c in args.configs.split(",") if c],
        "rows": tuple(r for r in (args.rows or ",".join(
            r for r in ROWS if device.type == "cuda" or not r.endswith("_graph")
        )).split(",") if r),
        "gpu_paths": tuple(g for g in args.gpu_paths.split(",") if g),
    }
    for name, allowed in (("configs", CONFIGS), ("rows", ROWS + EXTRA_ROWS),
                          ("gpu_paths", GPU_SOLVES)):
        got = lists[name]
        if set(got) - set(allowed) or not got:
            p.error(f"--{name.replace('_', '-')} must be a comma list of "
                    f"{list(allowed)}, got {getattr(args, name)!r}")
    graph = [r for r in lists["rows"] if r.endswith("_graph")]
    if graph and device.type != "cuda":  # checked before any row runs
        p.error(f"--rows {','.join(graph)} need a CUDA device, got --device "
                f"{args.device}")
    try:
        lists["basis_sizes"] = tuple(int(m) for m in args.num_basis.split(","))
    except ValueError:
        p.error(f"--num-basis must be a comma list of integers, got {args.num_basis!r}")
    if any(m < 1 or m > args.batch for m in lists["basis_sizes"]):
        p.error(f"--num-basis entries must lie in [1, --batch={args.batch}], got "
                f"{lists['basis_sizes']}")
    try:
        lists["refresh_every"] = tuple(int(k) for k in args.refresh_every.split(","))
    except ValueError:
        lists["refresh_every"] = ()
    if not lists["refresh_every"] or min(lists["refresh_every"]) < 1:
        p.error("--refresh-every must be a comma list of integers >= 1, got "
                f"{args.refresh_every!r}")
    return lists


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, torch.device, dict]:
    """The command line, checked before any row runs: the arguments, the device and the
    lists (``configs``, ``rows``, ``basis_sizes``, ``gpu_paths``)."""
    p = argparse.ArgumentParser(prog="python -m studies.bench.step_cost",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="resnet18", choices=tuple(MODELS))
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--num-basis", default="5,20", help="comma list of M")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma list of {list(CONFIGS)}")
    p.add_argument("--rows", default=None,
                   help=f"comma list of {list(ROWS + EXTRA_ROWS)} (default: "
                   f"{list(ROWS)}; on a CPU all but the *_graph rows, which need CUDA)")
    p.add_argument("--refresh-every", default="1",
                   help="comma list of k (refresh_every): the KWNG rows run once per "
                   "k (kwng.engine.precond.SystemCache)")
    p.add_argument("--gpu-paths", default="triton",
                   help=f"comma list of {list(GPU_SOLVES)}: the KWNG rows run once per "
                   "path (KWNGConfig.gpu_solve)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--out", default="results/benchmarks/step_cost.json")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --out (moved to a dated backup)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = _check_args(p, args)
    lists = _lists(p, args, device)
    if Path(args.out).exists() and not args.force:
        raise SystemExit(f"{args.out} exists (a committed result?): pass --out "
                         "elsewhere, or --force")
    return args, device, lists


def main(argv: list[str] | None = None) -> dict:
    args, device, lists = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    model = MODELS[args.model](10).to(device)
    shape = (784,) if args.model == "mlp" else (3, args.image_size, args.image_size)
    z = torch.randn((args.batch,) + shape, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    config = vars(args).copy()
    log.info("studies.bench.step_cost: %s", config)
    records = []
    for name in lists["configs"]:
        precision, fmt = CONFIGS[name]
        log.info("%s:", name)
        for r in bench_config(
            model,
            z,
            y,
            precision=precision,
            memory_format=fmt,
            basis_sizes=lists["basis_sizes"],
            steps=args.steps,
            warmup=args.warmup,
            rows=lists["rows"],
            gpu_paths=lists["gpu_paths"],
            refresh_every=lists["refresh_every"],
        ):
            r["precision"] = "bf16_autocast" if precision == torch.bfloat16 else "fp32"
            r["memory_format"] = (
                "channels_last" if fmt == torch.channels_last else "nchw"
            )
            records.append(r)
    prov = make_provenance(config, seeds={"torch": args.seed}, device=str(device))
    record = {
        "model": args.model,
        "q": sum(p.numel() for p in model.parameters()),
        "batch_size": args.batch,
        "device": prov["device"],
        "torch": torch.__version__,
        "tf32": {
            "cudnn": torch.backends.cudnn.allow_tf32,
            "matmul": torch.backends.cuda.matmul.allow_tf32,
        },
        "rows": records,
        "provenance": prov,
    }
    out_path = Path(args.out)
    _write(out_path, record, args.force)
    index_provenance(out_path.parent)
    log.info("\n%s\nwrote %s", _table(records), out_path)
    return record


if __name__ == "__main__":
    main()
