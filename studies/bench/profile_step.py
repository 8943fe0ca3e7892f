"""Where the GPU time of a training step goes: kernel time per step, by kind of kernel.

python -m studies.bench.profile_step [--configs
bf16_channels_last,fp32_channels_last] [--modes sgd,fwd_bwd_RN,kwng_fast] [--num-basis
5] [--top 12] [--gpu-path triton] [--refresh-every 1000] [--json OUT] [--by-source]

For every (configuration, mode) it profiles a few steps of
``studies.bench.step_cost._make_step`` (the rows of ``python -m
studies.bench.step_cost``) with ``torch.profiler`` and prints the summed kernel
time per step (the GPU work, whatever the host adds), split into kinds named from the
kernel names (convolution forward, data and weight gradients, GEMM, batch norm,
elementwise, reductions, copies), and the most expensive kernels. With
``--refresh-every k`` (k larger than the warm-up and profiled steps, e.g. 1000) the KWNG
modes build their kernel system once, in the warm-up, and every profiled step reuses
it: the kernels of a step between refreshes (``KWNGConfig.refresh_every``), to set
beside SGD's. ``--json`` also writes the per-step kernel times; ``--by-source`` sums
them by the line of ``kwng/`` or ``studies/`` that launched them. A tuning aid: the
numbers to report come from ``python -m studies.bench.step_cost``.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import re

import torch
from torch.profiler import ProfilerActivity, profile

from kwng.engine.gpu_paths import GPU_SOLVES
from studies.bench.step_cost import CONFIGS, ROWS, _make_step
from studies.cifar.nets import resnet18

KINDS = (  # first match wins; patterns on the lower-cased kernel name
    ("conv_wgrad", r"wgrad|weight_grad|bprop_filter|filter"),
    ("conv_dgrad", r"dgrad|data_grad|bprop_data"),
    ("conv_fwd", r"fprop|conv|implicit|xmma_fprop|cudnn"),
    ("gemm", r"gemm|cutlass|sm90_xmma|cublas|nvjet"),
    ("batch_norm", r"batch_norm|batchnorm|bn_"),
    ("triton", r"triton"),
    ("reduce", r"reduce"),
    ("copy", r"copy|cat|transpose|permute"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pat in KINDS:
        if re.search(pat, low):
            return kind
    return "other"


def kernel_times(prof, steps: int) -> dict[str, float]:
    """Summed device time (µs per step) of every CUDA kernel name."""
    out: dict[str, float] = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] += e.device_time / steps
    return out


#: a Python frame of a profile with ``with_stack=True`` (its file, line and function)
#:
#: :meta hide-value:
FRAME = re.compile(r"^(?P<path>.*\.py)\((?P<line>\d+)\): (?P<func>.+)$")
#: the source trees a kernel is attributed to (the innermost frame in one of them)
OURS = ("kwng/", "studies/")


def source_of(event) -> str:
    """Where the code that launched ``event``'s kernels is: ``file:line function`` of
    the innermost frame of :data:`OURS` among its ancestors in the profile
    (``cpu_parent``), else ``"backward pass (autograd)"`` for an op of the autograd
    engine, else the outermost op's name."""
    node, root = event, event
    while node is not None:
        m = FRAME.match(node.name)
        if m and any(o in m["path"] for o in OURS):
            path = m["path"]
            short = path[max(path.rfind(o) for o in OURS if o in path):]
            return f"{short}:{m['line']} {m['func']}"
        root, node = node, node.cpu_parent
    if root.name.startswith("autograd::"):
        return "backward pass (autograd)"
    return f"outside {', '.join(OURS)}: {root.name[:60]}"


def source_times(prof, steps: int) -> dict[str, float]:
    """Summed kernel time (µs per step) by the source line that launched it
    (:func:`source_of`), from a profile taken with CPU and CUDA activities and
    ``with_stack=True``."""
    out: dict[str, float] = collections.defaultdict(float)
    for e in prof.events():
        for k in getattr(e, "kernels", ()) or ():
            out[source_of(e)] += k.duration / steps
    return dict(out)


def profile_one(
    config: str, mode: str, num_basis: int, batch: int, steps: int,
    gpu_solve: str = "auto", refresh_every: int = 1, by_source: bool = False,
) -> tuple[dict[str, float], dict[str, float] | None]:
    prec, fmt = CONFIGS[config]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = copy.deepcopy(resnet18(10)).to(dev).to(memory_format=fmt).train()
    z = torch.randn(batch, 3, 32, 32, device=dev).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (batch,), device=dev)
    if mode == "fwd_bwd_RN":
        z = z.repeat(num_basis + 1, 1, 1, 1).contiguous(memory_format=fmt)
        y = y.repeat(num_basis + 1)
        mode = "fwd_bwd_N"
    step, _ = _make_step(
        mode, model, z, y, num_basis, None if prec == torch.float32 else prec,
        refresh_every=refresh_every, gpu_solve=gpu_solve,
    )
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] + [ProfilerActivity.CPU] * by_source
    with profile(activities=acts, with_stack=by_source) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return kernel_times(prof, steps), source_times(prof, steps) if by_source else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="bf16_channels_last")
    p.add_argument("--modes", default="sgd,fwd_bwd_RN,kwng_fast")
    p.add_argument("--num-basis", type=int, default=5)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--gpu-path", default="triton", choices=GPU_SOLVES,
                   help="kernels or torch.compile for the fast path "
                   "(KWNGConfig.gpu_solve)")
    p.add_argument("--refresh-every", type=int, default=1,
                   help="KWNGConfig.refresh_every of the KWNG modes (above 5 + "
                   "--steps: every profiled step reuses the system)")
    p.add_argument("--json", default=None, help="also write the kernel times here")
    p.add_argument("--by-source", action="store_true",
                   help="also sum the kernel time by the kwng/studies source line "
                   "that launched it (a profile with Python stacks)")
    a = p.parse_args(argv)
    modes = a.modes.split(",")
    for m in modes:
        if m not in ROWS and m != "fwd_bwd_RN":
            raise SystemExit(f"--modes entries must be among {list(ROWS)}, got {m!r}")
    if a.refresh_every < 1:
        raise SystemExit(f"--refresh-every must be >= 1, got {a.refresh_every}")
    record = {"refresh_every": a.refresh_every, "num_basis": a.num_basis,
              "batch": a.batch, "steps": a.steps, "rows": []}
    torch.backends.cudnn.benchmark = True
    for config in a.configs.split(","):
        for mode in modes:
            times, by_src = profile_one(config, mode, a.num_basis, a.batch, a.steps,
                                        a.gpu_path, a.refresh_every, a.by_source)
            by_kind: dict[str, float] = collections.defaultdict(float)
            for name, t in times.items():
                by_kind[kind_of(name)] += t
            total = sum(times.values())
            kinds = "  ".join(
                f"{k} {v / 1e3:.2f}"
                for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
            )
            print(
                f"\n== {config} {mode} M={a.num_basis}: {total / 1e3:.2f} ms of "
                f"kernels per step\n   by kind (ms): {kinds}"
            )
            for name, t in sorted(times.items(), key=lambda kv: -kv[1])[: a.top]:
                print(f"   {t / 1e3:7.3f} ms  {kind_of(name):11s} {name[:110]}")
            ranked = sorted((by_src or {}).items(), key=lambda kv: -kv[1])
            for src, t in ranked[: a.top]:
                print(f"   {t / 1e3:7.3f} ms  from {src}")
            record["rows"].append({"config": config, "mode": mode,
                                   "total_us": total, "by_kind_us": dict(by_kind),
                                   "kernels_us": dict(times),
                                   **({"by_source_us": by_src} if by_src else {})})
    if a.json:
        from studies.kit.provenance import atomic_write_text, make_provenance

        record["device"] = torch.cuda.get_device_name()
        record["torch"] = torch.__version__
        record["provenance"] = make_provenance(vars(a), device="cuda")
        atomic_write_text(a.json, json.dumps(record, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
