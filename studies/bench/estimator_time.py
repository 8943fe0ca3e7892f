"""Time one KWNG estimate at the paper's synthetic scale and print its relative error.

Normal model, d = 10, N = 5000, M = ⌊d√N⌋ = 707, λ = 0, ε = 1e-5, Gaussian kernel with
the mean-squared-distance bandwidth (σ0 = 0.2),
stable form. Runs on the CPU and, when present, on CUDA, in float64 (and float32 on
CUDA). Usage: ``python -m studies.bench.estimator_time [--repeats 3] [--json
out.json]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import kwng
from studies.kit.provenance import atomic_write_json, make_provenance


def one_estimate(model, theta, grad, Z, device, dtype, seed):
    th = theta.to(device=device, dtype=dtype)
    Zd = Z.to(device=device, dtype=dtype)
    g = grad.to(device=device, dtype=dtype)
    M = int(model.d * Z.shape[0] ** 0.5)
    if device != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = kwng.kwng_gradient(
        lambda t: model.sample(t, Zd),
        th,
        g,
        num_basis=M,
        eps=1e-5,
        kernel=kwng.GaussianKernel(1.0),
        bandwidth="mean_sq",
        sigma0=0.2,
        generator=torch.Generator().manual_seed(seed),
    )
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, res


def _write(args: argparse.Namespace, rows: list[dict]) -> None:
    """The measurements ``rows`` and their provenance, to ``args.json``."""
    config = dict(
        model="normal",
        d=args.d,
        N=args.N,
        M=int(args.d * args.N**0.5),
        lam=0.0,
        eps=1e-5,
        kernel="gaussian",
        bandwidth="mean_sq",
        sigma0=0.2,
        method="stable",
        repeats=args.repeats,
    )
    atomic_write_json(
        args.json,
        dict(rows=rows, provenance=make_provenance(config, seeds=[0, 1, 2, 3])),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--d", type=int, default=10)
    ap.add_argument("--N", type=int, default=5000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--json", default=None, help="also write the measurements to this file"
    )
    args = ap.parse_args()
    model = kwng.NormalModel(args.d)
    gen = torch.Generator().manual_seed(0)
    theta = model.params_near_reference(gen)  # L near the identity: Σ well conditioned
    grad = 0.1**0.5 * torch.randn(model.num_params, generator=gen, dtype=torch.float64)
    Z = model.sample_latent(args.N, gen)
    exact = model.wng(theta, grad)
    configs = [("cpu", torch.float64)]
    if torch.cuda.is_available():
        configs += [("cuda", torch.float64), ("cuda", torch.float32)]
    rows = []
    for device, dtype in configs:
        one_estimate(model, theta, grad, Z, device, dtype, 0)  # warm-up
        times, errs = [], []
        for r in range(args.repeats):
            t, res = one_estimate(model, theta, grad, Z, device, dtype, r + 1)
            times.append(t)
            errs.append(kwng.relative_error(res.direction.cpu(), exact))
        name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        row = dict(
            device=name,
            dtype=str(dtype),
            d=args.d,
            N=args.N,
            M=int(args.d * args.N**0.5),
            median_s=statistics.median(times),
            relative_error_median=statistics.median(errs),
        )
        rows.append(row)
        print(
            f"{name:28s} {str(dtype):14s} d={args.d} N={args.N} M={row['M']}: "
            f"{row['median_s'] * 1e3:9.1f} ms  relative error "
            f"{row['relative_error_median']:.4f}"
        )
    if len(rows) > 1:
        print(
            "speed-up of CUDA float64 over CPU: "
            f"{rows[0]['median_s'] / rows[1]['median_s']:.1f}x"
        )
    if args.json:
        _write(args, rows)


if __name__ == "__main__":
    main()
