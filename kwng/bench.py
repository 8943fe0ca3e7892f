"""Cost of one training step: SGD vs KWNG (reference, fast, loop, diagonal only).

Run ``python -m kwng.bench`` (GPU: the paper's ResNet-18 at batch 128, ``M = 5``, fp32, CIFAR-shaped
random inputs, and a small MLP). Every mode is timed on the same device in one process: warm-up
steps, then ``--steps`` steps each followed by a device synchronisation, and the median wall time
is reported with its ratio to the SGD step. The result goes to
``results/benchmarks/step_cost.json`` with provenance (:mod:`kwng.provenance`); ``--profile`` also
writes a ``torch.profiler`` table of a few fast-mode steps next to it.

Modes (all do zero_grad → forward → loss → gradients → optimizer.step):

* ``sgd``: ``loss.backward()``;
* ``kwng_reference``: :class:`kwng.KWNGPreconditioner` with ``mode="reference"`` (the authors'
  ``M + 1`` serial backward passes and host-side algebra);
* ``kwng_fast``: ``mode="fast"`` (one batched backward, sync-free algebra);
* ``kwng_loop``: ``mode="loop"`` (serial backward passes, sync-free algebra);
* ``kwng_ensemble``: ``mode="ensemble"`` (one forward + backward of an ``M+1``-copy ensemble);
* ``diag_only``: ``mode="fast", diagonal_only=True`` (``D⁻¹ g``, the ablation of App. E);
* ``forward`` and ``forward_backward``: parts of the SGD step, for the cost analysis.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .nets import mlp, resnet18
from .precond import KWNGPreconditioner
from .provenance import atomic_write_json, atomic_write_text, make_provenance

__all__ = ["time_steps", "bench_model", "main"]

log = logging.getLogger(__name__)

MODES = ("forward", "forward_backward", "sgd", "kwng_reference", "kwng_loop", "kwng_fast", "kwng_ensemble",
         "diag_only")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(fn: Callable[[], None], device: torch.device, steps: int, warmup: int) -> list[float]:
    """Wall times in ms of ``steps`` calls of ``fn`` after ``warmup`` calls, synchronising after each."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def _make_step(mode: str, model: nn.Module, z: torch.Tensor, y: torch.Tensor, num_basis: int,
               lr: float) -> tuple[Callable[[], None], KWNGPreconditioner | None]:
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    precond = None
    if mode.startswith("kwng") or mode == "diag_only":
        kw = {"kwng_reference": {"mode": "reference"}, "kwng_loop": {"mode": "loop"},
              "kwng_fast": {"mode": "fast"}, "kwng_ensemble": {"mode": "ensemble"},
              "diag_only": {"mode": "fast", "diagonal_only": True}}[mode]
        precond = KWNGPreconditioner(model, optimizer=opt, num_basis=num_basis, eps=1e-5, **kw)

    def step() -> None:
        if mode == "forward":
            with torch.no_grad():
                model(z)
            return
        opt.zero_grad(set_to_none=True)
        X = model(z)
        loss = loss_fn(X, y)
        if precond is None:
            loss.backward()
            if mode == "forward_backward":
                return
        else:
            precond.step(loss, X)
        opt.step()

    return step, precond


def bench_model(name: str, model: nn.Module, z: torch.Tensor, y: torch.Tensor, *, num_basis: int, steps: int,
                warmup: int, modes: tuple[str, ...] = MODES, lr: float = 1e-3) -> dict:
    """Time every mode on one model; returns ``{mode: {median_ms, ..., ratio_to_sgd}}``."""
    device = z.device
    state = {k: v.clone() for k, v in model.state_dict().items()}
    out: dict[str, dict] = {}
    for mode in modes:
        model.load_state_dict(state)
        model.train()
        step, precond = _make_step(mode, model, z, y, num_basis, lr)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if mode in ("kwng_fast", "diag_only"):
            # record the vmap fallbacks (ops without a batching rule run as a loop) of one fast step
            torch._C._functorch._set_vmap_fallback_warning_enabled(True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step()
            torch._C._functorch._set_vmap_fallback_warning_enabled(False)
            fallbacks = sorted({str(w.message)[:160] for w in caught})
            for msg in fallbacks:
                log.warning("%s %s: %s", name, mode, msg)
        times = time_steps(step, device, steps, warmup)
        rec = {"median_ms": statistics.median(times), "min_ms": min(times),
               "q25_ms": statistics.quantiles(times, n=4)[0] if len(times) > 1 else times[0],
               "q75_ms": statistics.quantiles(times, n=4)[2] if len(times) > 1 else times[0], "steps": steps}
        if device.type == "cuda":
            rec["peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2 ** 20
        if precond is not None:
            rec["counters"] = precond.counters()
            precond.remove_hooks()
        if mode in ("kwng_fast", "diag_only"):
            rec["vmap_fallback_warnings"] = fallbacks
        out[mode] = rec
        log.info("%s %-17s %8.2f ms", name, mode, rec["median_ms"])
    if "sgd" in out:
        for rec in out.values():
            rec["ratio_to_sgd"] = rec["median_ms"] / out["sgd"]["median_ms"]
    return out


def _profile(model: nn.Module, z: torch.Tensor, y: torch.Tensor, num_basis: int, path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    step, _ = _make_step("kwng_fast", model, z, y, num_basis, 1e-3)
    for _ in range(3):
        step()
    _sync(z.device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if z.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(5):
            step()
        _sync(z.device)
    key = "cuda_time_total" if z.device.type == "cuda" else "cpu_time_total"
    atomic_write_text(path, prof.key_averages().table(sort_by=key, row_limit=40) + "\n")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m kwng.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--num-basis", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--models", default="resnet18,mlp", help="comma list of resnet18, mlp")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--out", default="results/benchmarks/step_cost.json")
    p.add_argument("--profile", action="store_true", help="also write a torch.profiler table of fast mode")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ValueError(f"--modes must be among {MODES}, got {sorted(unknown)}")
    config = vars(args).copy()
    log.info("kwng.bench: %s", config)
    results = {}
    for name in [m for m in args.models.split(",") if m]:
        if name == "resnet18":
            model = resnet18(10).to(device)
            z = torch.randn(args.batch, 3, args.image_size, args.image_size, device=device)
        elif name == "mlp":
            model = mlp(784, 10, hidden=256, depth=2).to(device)
            z = torch.randn(args.batch, 784, device=device)
        else:
            raise ValueError(f"--models entries must be resnet18 or mlp, got {name!r}")
        y = torch.randint(0, 10, (args.batch,), device=device)
        q = sum(p.numel() for p in model.parameters())
        res = bench_model(name, model, z, y, num_basis=args.num_basis, steps=args.steps, warmup=args.warmup,
                          modes=modes)
        results[name] = {"q": q, "modes": res}
        if args.profile and name == "resnet18":
            _profile(model, z, y, args.num_basis, Path(args.out).with_name("step_cost_profile.txt"))
    prov = make_provenance(config, seeds={"torch": args.seed}, device=str(device))
    record = {"device": prov["device"], "torch": torch.__version__, "batch_size": args.batch,
              "num_basis": args.num_basis, "dtype": "float32", "results": results, "provenance": prov}
    atomic_write_json(args.out, record)
    for name, r in results.items():
        line = ", ".join(f"{m} {v['median_ms']:.2f} ms" + (f" ({v['ratio_to_sgd']:.2f}x)" if "ratio_to_sgd" in v
                                                           else "") for m, v in r["modes"].items())
        log.info("%s (q=%d): %s", name, r["q"], line)
    log.info("wrote %s", args.out)
    return record


if __name__ == "__main__":
    main()
