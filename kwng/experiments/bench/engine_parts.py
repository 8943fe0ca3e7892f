"""The replicated engine's parts, each against its alternatives, on the shapes of the
paper's ResNet-18 (batch N = 128, R = M + 1 copies), side by side in one run.

python -m kwng.experiments.bench.engine_parts [--copies 6] [--batch 128]

Prints, per dtype (fp32 and bf16, channels_last), the summed time over the network's
layers of: the forward repeat (``torch.cat`` against one broadcast copy); the per-copy
weight gradients of the convolutions (``R`` calls on slices against one call with the
copies stacked along the output channels, and one plain call at batch ``R·N`` for
scale); the per-copy batch-norm backward (PyTorch operations against the Triton
kernels of :mod:`kwng.engine.triton_ops`, and the native batch-norm backward at ``R·N`` for
scale). Then, once, the direction at the end of the step (``T`` float32, ``M = R − 1``
rows, ``q`` = ResNet-18's parameter count): :func:`kwng.nystrom_solve_nosync`, the
preconditioner's safeguard and the copy into the gradient buffer, against the four
kernels of :mod:`kwng.engine.triton_solve`. CUDA events, median of 20 repetitions after
warm-up. A tuning aid: it decided the choices written in :mod:`kwng.engine.replicate_layers`
and :mod:`kwng.engine.precond`.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kwng.engine import replicate_layers as rl
from kwng.engine import triton_ops

CL = torch.channels_last
# (C_in, C_out, spatial, kernel, stride, count) of ResNet-18's convolutions at 32 × 32
CONVS = [
    (3, 64, 32, 3, 1, 1),
    (64, 64, 32, 3, 1, 4),
    (64, 128, 32, 3, 2, 1),
    (128, 128, 16, 3, 1, 3),
    (64, 128, 32, 1, 2, 1),
    (128, 256, 16, 3, 2, 1),
    (256, 256, 8, 3, 1, 3),
    (128, 256, 16, 1, 2, 1),
    (256, 512, 8, 3, 2, 1),
    (512, 512, 4, 3, 1, 3),
    (256, 512, 8, 1, 2, 1),
]
BNS = [(64, 32, 5), (128, 16, 5), (256, 8, 5), (512, 4, 5)]  # (C, spatial, count)


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def repeat_parts(N, R, dt):
    cat = bcast = tri = 0.0
    for C, s, n in BNS:
        y0 = torch.randn(N, C, s, s, device="cuda", dtype=dt).contiguous(
            memory_format=CL
        )
        out = torch.empty((R * N, C, s, s), device="cuda", dtype=dt, memory_format=CL)
        shape = (R, N, C, s, s)
        cat += 2 * n * timed(lambda: torch.cat([y0] * R))
        bcast += (
            2 * n * timed(lambda: out.view(shape).copy_(y0.unsqueeze(0).expand(shape)))
        )
        tri += 2 * n * timed(lambda: triton_ops.repeat(y0, R, CL))
    return {
        "repeat: torch.cat": cat,
        "repeat: broadcast copy": bcast,
        "repeat: Triton (read once)": tri,
    }


def wgrad_parts(N, R, dt):
    bwd = torch.ops.aten.convolution_backward
    loop = stacked = big = 0.0
    for cin, cout, s, k, stride, n in CONVS:
        so = s // stride
        x0 = torch.randn(N, cin, s, s, device="cuda", dtype=dt).contiguous(
            memory_format=CL
        )
        xb = x0.repeat(R, 1, 1, 1).contiguous(memory_format=CL)
        w = torch.randn(cout, cin, k, k, device="cuda", dtype=dt).contiguous(
            memory_format=CL
        )
        dy = torch.randn(R * N, cout, so, so, device="cuda", dtype=dt).contiguous(
            memory_format=CL
        )
        args = (
            [stride] * 2,
            [k // 2] * 2,
            [1, 1],
            False,
            [0, 0],
            1,
            [False, True, False],
        )

        def f_loop():
            return rl._wgrad_loop(dy, x0, w, R, args[:-1])

        def f_stacked():
            return rl._wgrad_stacked(dy, x0, w, R, args[:-1])

        loop += n * timed(f_loop)
        stacked += n * timed(f_stacked)
        big += n * timed(lambda: bwd(dy, xb, w, None, *args)[1])
    return {
        "wgrad: R calls": loop,
        "wgrad: stacked channels": stacked,
        "wgrad: one call at R·N (summed)": big,
    }


def bn_parts(N, R, dt):
    torch_ops = triton_k = native = 0.0
    for C, s, n in BNS:
        S = N * s * s
        d = torch.randn(R, S, C, device="cuda", dtype=dt)
        x = torch.randn(S, C, device="cuda", dtype=dt)
        mean, invstd, scale = (torch.rand(C, device="cuda") + 0.5 for _ in range(3))

        def f_torch():
            xh = ((x.float() - mean) * invstd).to(dt)
            db = d.sum(1, dtype=torch.float32)
            dg = (d * xh).sum(1, dtype=torch.float32)
            dx = torch.addcmul((-(scale * db) / S).to(dt)[:, None], d, scale.to(dt))
            return dx.addcmul_(xh, ((scale * dg) / S).to(dt)[:, None], value=-1)

        xb = x.repeat(R, 1).view(R * N, s, s, C).permute(0, 3, 1, 2)
        db_ = d.view(R * N, s, s, C).permute(0, 3, 1, 2)
        w = torch.ones(C, device="cuda")
        torch_ops += n * timed(f_torch)
        if triton_ops.available(d):
            triton_k += n * timed(
                lambda: triton_ops.bn_backward(d, x, mean, invstd, scale, True)
            )
        native += n * timed(
            lambda: torch.ops.aten.native_batch_norm_backward(
                db_, xb, w, None, None, mean, invstd, True, 1e-5, [True, True, True]
            )
        )
    return {
        "bn backward: PyTorch ops": torch_ops,
        "bn backward: Triton": triton_k,
        "bn backward: native at R·N (no per-copy)": native,
    }


def direction_parts(M: int, q: int = 11_173_962) -> dict[str, float]:
    """The direction of one step from ``T`` ``(M, q)`` and ``g``: PyTorch operations
    against the fused kernels (same ``ε``, damping ``T̃``, clipping to 1)."""
    from types import SimpleNamespace

    from kwng.engine.precond import KWNGPreconditioner
    from kwng.engine.triton_solve import fused_direction
    from kwng.nosync import nystrom_solve_nosync

    gen = torch.Generator(device="cuda").manual_seed(0)
    T = torch.randn(M, q, device="cuda", generator=gen)
    g = torch.randn(q, device="cuda", generator=gen)
    C = torch.randn(M, 128, device="cuda", dtype=torch.float64, generator=gen)
    CCt, K = C @ C.T, C @ C.T / 128
    eps = torch.tensor(1e-2, dtype=torch.float64, device="cuda")
    out = torch.empty_like(g)
    clip = SimpleNamespace(clip_norm=1.0)

    def f_torch():
        d, _ = nystrom_solve_nosync(T, CCt, K, g, 128, eps=eps, damping="T_tilde")
        out.copy_(KWNGPreconditioner._safeguard(clip, g, d)[0])

    def f_fused():
        fused_direction(T, CCt, K, g, 128, eps=eps, lam=0.0, damping="T_tilde",
                        rcond=None, clip_norm=1.0, out=out)

    return {"direction: PyTorch ops": timed(f_torch),
            "direction: fused kernels": timed(f_fused)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copies", type=int, default=6)
    p.add_argument("--batch", type=int, default=128)
    a = p.parse_args()
    torch.backends.cudnn.benchmark = True
    print(torch.cuda.get_device_name(), torch.__version__)
    for dt in (torch.float32, torch.bfloat16):
        print(
            f"\n{dt} channels_last, N = {a.batch}, R = {a.copies} "
            "(ms, summed over layers)"
        )
        for part in (repeat_parts, wgrad_parts, bn_parts):
            for k, v in part(a.batch, a.copies, dt).items():
                print(f"  {k:45s} {v:8.3f}")
    print(f"\nthe direction, M = {a.copies - 1} (ms, T in float32)")
    for k, v in direction_parts(a.copies - 1).items():
        print(f"  {k:45s} {v:8.3f}")


if __name__ == "__main__":
    main()
