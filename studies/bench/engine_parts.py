"""The fast KWNG step's parts on the shapes of the paper's ResNet-18 (batch N = 128,
R = M + 1 copies): each PyTorch function eagerly, compiled by ``torch.compile`` and,
where one exists, as its hand-written Triton kernel, side by side in one run on one
device.

python -m studies.bench.engine_parts [--copies 6] [--batch 128] [--json PATH]

Per dtype (fp32 and bf16, channels_last), summed over the layers of one step:

* ``repeat`` — the ``R``-fold copy of each convolution's and batch norm's output
  (:func:`kwng.engine.replicate_layers.repeat_copies`; its kernel was deleted by the
  rule below);
* ``relayout`` — the stacking of the copies along the channels
  (:func:`kwng.engine.replicate_layers.stack_copies`; its kernel was deleted too),
  summed as if every convolution needed it (in ResNet-18 none does: each convolution
  takes the layout its batch norm writes, so this is an upper bound);
* ``bn_backward`` — the per-copy batch-norm backward with the stacked second output
  (:func:`kwng.engine.replicate_bn.bn_backward_torch` /
  :func:`kwng.engine.triton_bn.bn_backward`), and the native batch-norm backward at
  batch ``R·N`` for scale;
* ``wgrad`` — the per-copy weight gradients of the convolutions (``R`` calls on slices,
  one call with the copies stacked along the output channels, one plain call at
  ``R·N`` for scale; no compiled form: these are cuDNN calls).

Then, once, ``direction`` — the end of the step from ``T`` (float32, ``M = R − 1`` rows,
``q`` = ResNet-18's parameter count) and ``g``:
:func:`kwng.engine.precond.direction_into` (Prop. 6, the safeguard, the copy into
the gradient buffer) against the four kernels of
:func:`kwng.engine.triton_solve.fused_direction`.

Each timing replays the part captured in a CUDA graph, as in the captured training step
(no launch or guard cost), after warm-up (which compiles); CUDA events, median of
``--reps`` replays. Each part gets the verdict of the kernel rule: the kernel stays
only if the compiled function is slower by more than ``max(0.3 ms, 5 % of the captured
step)`` per step (the step of ``results/benchmarks/step_cost.json``, fp32 or bf16
channels_last, ``M = 5``). ``--json PATH`` writes the table with provenance.
``--device cpu --smoke`` runs tiny shapes (the test-suite; no kernels, no verdict).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kwng.engine import capture as cuda_graphs
from kwng.engine import gpu_paths
from kwng.engine import replicate_layers as rl
from kwng.engine.precond import direction_into
from kwng.engine.replicate_bn import bn_backward_torch
from kwng.scale_switch import REPO_ROOT
from studies.kit import paths
from studies.kit.provenance import atomic_write_json, make_provenance

CL = torch.channels_last
ROOT = REPO_ROOT
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
SMOKE_CONVS = [(3, 4, 8, 3, 1, 1), (4, 8, 8, 3, 2, 1)]
SMOKE_BNS = [(4, 8, 2), (8, 4, 1)]
Q_RESNET18 = 11_173_962


class Bench:
    """The device, the timing and the compiler settings of one run."""

    def __init__(self, device: torch.device, reps: int, mode: str, backend: str,
                 smoke: bool) -> None:
        self.device, self.reps, self.mode, self.backend = device, reps, mode, backend
        self.smoke = smoke
        self.convs, self.bns = (SMOKE_CONVS, SMOKE_BNS) if smoke else (CONVS, BNS)
        self.kernels = gpu_paths.use_kernels(torch.empty(1, device=device))

    def compiled(self, fn):
        return torch.compile(fn, fullgraph=True, mode=self.mode,
                             backend=self.backend)

    def timed(self, fn) -> float:
        """ms of one call of ``fn``: replayed from a CUDA graph on CUDA, else wall
        time."""
        if self.device.type != "cuda":
            fn()  # warm-up (compiles)
            ts = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                ts.append(1e3 * (time.perf_counter() - t0))
            return statistics.median(ts)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = cuda_graphs.record_graph(fn)
        ts = []
        for _ in range(self.reps):
            a, b = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            a.record()
            graph.replay()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        del graph
        return statistics.median(ts)

    def rand(self, *shape, dtype=torch.float32, fmt=torch.contiguous_format):
        return torch.randn(*shape, device=self.device, dtype=dtype).contiguous(
            memory_format=fmt)


def repeat_parts(b: Bench, N: int, R: int, dt) -> dict[str, float | None]:
    """The repeat's kernel was deleted by the rule (its last times: the committed
    ``results/benchmarks/engine_parts.json``): eager against compiled."""
    out = {"eager": 0.0, "compile": 0.0, "triton": None}
    comp = b.compiled(rl.repeat_copies)
    for C, s, n in b.bns:  # each layer's convolution and batch norm repeat their output
        y0 = b.rand(N, C, s, s, dtype=dt, fmt=CL)
        out["eager"] += 2 * n * b.timed(lambda: rl.repeat_copies(y0, R))
        out["compile"] += 2 * n * b.timed(lambda: comp(y0, R))
    return out


def relayout_parts(b: Bench, N: int, R: int, dt) -> dict[str, float | None]:
    """The relayout's kernel was deleted by the rule, as the repeat's."""
    out = {"eager": 0.0, "compile": 0.0, "triton": None}
    comp = b.compiled(rl.stack_copies)
    for _, cout, s, _, stride, n in b.convs:
        so = s // stride
        dy = b.rand(R * N, cout, so, so, dtype=dt, fmt=CL)
        out["eager"] += n * b.timed(lambda: rl.stack_copies(dy, R))
        out["compile"] += n * b.timed(lambda: comp(dy, R))
    return out


def bn_parts(b: Bench, N: int, R: int, dt) -> dict[str, float | None]:
    out = {"eager": 0.0, "compile": 0.0, "triton": 0.0 if b.kernels else None,
           "native at R·N (no per-copy)": 0.0}
    comp = b.compiled(bn_backward_torch)
    for C, s, n in b.bns:
        S = N * s * s
        d, x = b.rand(R, S, C, dtype=dt), b.rand(S, C, dtype=dt)
        mean, invstd, scale = (torch.rand(C, device=b.device) + 0.5 for _ in range(3))
        args = (d, x[None], mean, invstd, scale, True, True, True)
        out["eager"] += n * b.timed(lambda: bn_backward_torch(*args))
        out["compile"] += n * b.timed(lambda: comp(*args))
        if b.kernels:
            from kwng.engine import triton_bn

            out["triton"] += n * b.timed(lambda: triton_bn.bn_backward(
                d, x, mean, invstd, scale, True, interleaved=True))
        xb = x.repeat(R, 1).view(R * N, s, s, C).permute(0, 3, 1, 2)
        db_ = d.view(R * N, s, s, C).permute(0, 3, 1, 2)
        w = torch.ones(C, device=b.device)
        out["native at R·N (no per-copy)"] += n * b.timed(
            lambda: torch.ops.aten.native_batch_norm_backward(
                db_, xb, w, None, None, mean, invstd, True, 1e-5, [True, True, True]))
    return out


def wgrad_parts(b: Bench, N: int, R: int, dt) -> dict[str, float | None]:
    bwd = torch.ops.aten.convolution_backward
    out = {"R calls": 0.0, "stacked channels": 0.0, "one call at R·N": 0.0}
    for cin, cout, s, k, stride, n in b.convs:
        so = s // stride
        x0 = b.rand(N, cin, s, s, dtype=dt, fmt=CL)
        xb = x0.repeat(R, 1, 1, 1).contiguous(memory_format=CL)
        w = b.rand(cout, cin, k, k, dtype=dt, fmt=CL)
        dy = b.rand(R * N, cout, so, so, dtype=dt, fmt=CL)
        args = ([stride] * 2, [k // 2] * 2, [1, 1], False, [0, 0], 1)
        out["R calls"] += n * b.timed(lambda: rl._wgrad_loop(dy, x0, w, R, args))
        out["stacked channels"] += n * b.timed(
            lambda: rl._wgrad_stacked(dy, x0, w, R, args))
        out["one call at R·N"] += n * b.timed(
            lambda: bwd(dy, xb, w, None, *args, [False, True, False])[1])
    return out


def direction_parts(b: Bench, M: int, q: int) -> dict[str, float | None]:
    """The direction of one step from ``T`` ``(M, q)`` and ``g`` (damping ``T̃``,
    clipping to 1): eager, compiled, the fused kernels."""
    gen = torch.Generator(device=b.device).manual_seed(0)
    T = torch.randn(M, q, device=b.device, generator=gen)
    g = torch.randn(q, device=b.device, generator=gen)
    C = torch.randn(M, 128, device=b.device, dtype=torch.float64, generator=gen)
    CCt, K = C @ C.T, C @ C.T / 128
    eps = torch.tensor(1e-2, dtype=torch.float64, device=b.device)
    out = torch.empty_like(g)
    kw = dict(eps=eps, lam=0.0, damping="T_tilde", rcond=None, clip_norm=1.0)
    comp = b.compiled(direction_into)
    res = {"eager": b.timed(lambda: direction_into(out, T, CCt, K, g, 128, **kw)),
           "compile": b.timed(lambda: comp(out, T, CCt, K, g, 128, **kw)),
           "triton": None}
    if b.kernels:
        from kwng.engine.triton_solve import fused_direction

        res["triton"] = b.timed(
            lambda: fused_direction(T, CCt, K, g, 128, out=out, **kw))
    return res


def verdict(part: dict, step_ms: float | None) -> dict | None:
    """The rule: delete the kernel where compile is within ``max(0.3 ms, 5 % of the
    captured step)`` of it, per step."""
    if part.get("triton") is None or step_ms is None:
        return None
    slower = part["compile"] - part["triton"]
    allowed = max(0.3, 0.05 * step_ms)
    return {"compile_minus_triton_ms": slower, "allowed_ms": allowed,
            "step_ms": step_ms, "keep_kernel": slower > allowed}


def captured_steps() -> dict[str, float]:
    """The captured KWNG step (M = 5, channels_last) of the committed table, per
    dtype."""
    rec = json.loads((ROOT / paths.RESULTS / "benchmarks" / "step_cost.json")
                     .read_text())
    return {("float32" if r["precision"] == "fp32" else "bfloat16"): r["median_ms"]
            for r in rec["rows"] if r["mode"] == "kwng_fast_graph"
            and r["num_basis"] == 5 and r["memory_format"] == "channels_last"}


def run(b: Bench, N: int, R: int) -> dict:
    steps = {} if b.smoke else captured_steps()
    table: dict = {}
    for dt in (torch.float32, torch.bfloat16):
        name = str(dt).removeprefix("torch.")
        table[name] = {}
        for part, fn in (("repeat", repeat_parts), ("relayout", relayout_parts),
                         ("bn_backward", bn_parts), ("wgrad", wgrad_parts)):
            res = fn(b, N, R, dt)
            table[name][part] = {"ms": res, "verdict": verdict(res, steps.get(name))}
            print(f"{name:9s} {part:12s} " + "  ".join(
                f"{k}: {v:.3f}" for k, v in res.items() if v is not None), flush=True)
    q = 1000 if b.smoke else Q_RESNET18
    res = direction_parts(b, R - 1, q)
    table["direction"] = {"ms": res, "M": R - 1, "q": q,
                          "verdict": verdict(res, steps.get("float32"))}
    print("direction (float32) " + "  ".join(
        f"{k}: {v:.3f}" for k, v in res.items() if v is not None), flush=True)
    return table


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copies", type=int, default=6)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile-mode", default="default",
                   choices=("default", "max-autotune-no-cudagraphs"))
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU tests)")
    p.add_argument("--json", default=None, help="write the table here, with provenance")
    a = p.parse_args(argv)
    torch.backends.cudnn.benchmark = True
    device = torch.device(a.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(name, torch.__version__, flush=True)
    b = Bench(device, a.reps, a.compile_mode, a.compile_backend, a.smoke)
    table = run(b, a.batch, a.copies)
    record = {"device": name, "torch": torch.__version__, "batch": a.batch,
              "copies": a.copies, "parts": table,
              "provenance": make_provenance(vars(a), device=str(device))}
    if a.json:
        atomic_write_json(a.json, record)
        print("wrote", a.json)
    return record


if __name__ == "__main__":
    main()
