"""torch.profiler table of one KWNG step configuration (top CUDA kernels), for tuning.

python benchmarks/profile_step.py [--config bf16_channels_last] [--mode kwng_fast]
    [--num-basis 5]
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch.profiler import ProfilerActivity, profile

from kwng.bench import CONFIGS, _make_step
from kwng.nets import resnet18


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="bf16_channels_last", choices=list(CONFIGS))
    p.add_argument("--mode", default="kwng_fast")
    p.add_argument("--num-basis", type=int, default=5)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--rows", type=int, default=30)
    a = p.parse_args()
    torch.backends.cudnn.benchmark = True
    prec, fmt = CONFIGS[a.config]
    dev = torch.device("cuda")
    model = copy.deepcopy(resnet18(10)).to(dev).to(memory_format=fmt)
    z = torch.randn(a.batch, 3, 32, 32, device=dev).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (a.batch,), device=dev)
    step, _ = _make_step(
        a.mode, model, z, y, a.num_basis, None if prec == torch.float32 else prec
    )
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows))


if __name__ == "__main__":
    main()
