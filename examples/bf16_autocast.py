"""KWNG under bf16 autocast: the network runs in bfloat16, the preconditioner's kernel
algebra in float32.

    python examples/bf16_autocast.py --steps 3 --batch 16 --image-size 8   # seconds

On a GPU add ``--device cuda`` (and make a convolutional model channels_last:
``model.to(memory_format=torch.channels_last)``). bf16 needs no loss scaling; for fp16
pass ``grad_scaler=torch.amp.GradScaler()`` to the preconditioner and
``grad_scaler.scale(loss)`` to ``precond.step`` (README, "Using the preconditioner").
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from kwng import KWNGPreconditioner


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    precond = KWNGPreconditioner(model, lr=0.05, num_basis=5, eps=1e-5, mode="auto",
                                 generator=torch.Generator(device).manual_seed(1))
    g = torch.Generator(device).manual_seed(args.seed)
    losses = []
    for step in range(args.steps):
        z = torch.randn(args.batch, 3, args.image_size, args.image_size, device=device,
                        generator=g)
        y = (z.mean((1, 2, 3)) > 0).long()
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            X = model(z)                       # bfloat16 outputs
            loss = nn.functional.cross_entropy(X.float(), y)
        precond.step(loss, X)                  # g, T in the parameters' dtype
        optimizer.step()
        losses.append(loss.item())
        print(f"step {step:3d}  loss {loss.item():.4f}  X.dtype {X.dtype}")
    return losses


if __name__ == "__main__":
    main()
