"""KWNG data-parallel with ``kwng.DistributedKWNG`` (it replaces
``DistributedDataParallel``): every rank writes the direction of the global batch.

    # two CPU ranks
    torchrun --standalone --nproc-per-node=2 examples/ddp_kwng.py --steps 3

gloo on CPUs, NCCL on GPUs (``--device cuda``: one GPU per rank). Pass the bare model,
not a ``DistributedDataParallel`` wrapper; each rank feeds its own shard of the batch.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from kwng import DistributedKWNG
from kwng.engine.distributed import replica_spread


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=32, help="samples per rank")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if cuda else "cpu")
    torch.manual_seed(0)  # the same initial model on every rank (also broadcast)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = DistributedKWNG(model, lr=0.1, num_basis=5, eps=1e-5,
                              batch_sizes=args.batch,
                              generator=torch.Generator(device).manual_seed(1))
    g = torch.Generator(device).manual_seed(100 + rank)  # each rank its own shard
    w = torch.randn(20, 5, generator=torch.Generator(device).manual_seed(7),
                    device=device)
    for step in range(args.steps):
        z = torch.randn(args.batch, 20, generator=g, device=device)
        y = (z @ w).argmax(1)
        optimizer.zero_grad()
        X = model(z)
        loss = nn.functional.cross_entropy(X, y)   # this rank's shard
        precond.step(loss, X)                      # the global direction in p.grad
        optimizer.step()
        if rank == 0:
            print(f"step {step:3d}  loss(rank 0) {loss.item():.4f}")
    spread = replica_spread(model)  # largest parameter difference between ranks
    if rank == 0:
        print(f"{world} ranks, replica spread {spread:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
