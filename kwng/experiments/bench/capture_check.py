"""Does a training loop built on :func:`kwng.capture_step` train as the eager loop does?

python -m kwng.experiments.bench.capture_check [--steps 40] [--config
bf16_channels_last]

On a GPU, the paper's ResNet-18 (batch 128) is trained on four fixed random batches in
turn, each copied into the captured step's static inputs before the replay, as a real
loop would: (1) SGD eagerly and graph-captured from the same initialisation (with
``--deterministic`` cuDNN algorithms the parameters must agree bit for bit; without, two
eager runs already differ, and training on random labels amplifies it); (2) KWNG
(fast path) eagerly and graph-captured (the basis draws differ between the two, so the
loss curves are compared, not the parameters). Prints both loss curves of each method,
the parameter difference and the time per step of each loop.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

from kwng import KWNGPreconditioner, capture_step
from kwng.experiments.bench.step_cost import CONFIGS
from kwng.experiments.cifar.nets import resnet18


def make_loop(model, method, amp, static_z, static_y):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    pc = None
    if method == "kwng":
        pc = KWNGPreconditioner(model, lr=0.05, num_basis=5, eps=1e-3)
    losses = []

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(
            "cuda",
            dtype=amp or torch.float32,
            enabled=amp is not None,
            cache_enabled=False,
        ):
            X = model(static_z)
            loss = nn.functional.cross_entropy(X.float(), static_y)
        if pc is None:
            loss.backward()
        else:
            pc.step(loss, X)
        opt.step()
        losses.append(loss.detach())  # a device tensor: no host sync

    return step, losses


def train(model, method, graph, batches, steps, amp):
    """``steps`` steps over ``batches`` after 3 warm-up steps on the first batch (those
    of :func:`kwng.capture_step`, run eagerly too so that both loops take the same
    number of steps); returns the losses and the ms per step."""
    static_z, static_y = (t.clone() for t in batches[0])
    step, losses = make_loop(model, method, amp, static_z, static_y)
    if graph:
        run = capture_step(step, warmup=3)
        static_loss = losses[-1]  # the tensor every replay rewrites
    else:
        for _ in range(3):
            step()
        run = step
    losses.clear()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        z, y = batches[i % len(batches)]
        static_z.copy_(z)
        static_y.copy_(y)
        run()
        if graph:
            losses.append(static_loss.clone())
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - t0) / steps
    return [float(v) for v in losses], ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--config", default="bf16_channels_last", choices=list(CONFIGS))
    p.add_argument("--methods", default="sgd,kwng")
    p.add_argument(
        "--no-tf32", action="store_true", help="fp32 convolutions in full fp32"
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic cuDNN algorithms (else two eager runs differ too)",
    )
    a = p.parse_args()
    if a.no_tf32:
        torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = a.deterministic
    prec, fmt = CONFIGS[a.config]
    amp = None if prec == torch.float32 else prec
    torch.backends.cudnn.benchmark = not a.deterministic  # the capture searches none
    dev = torch.device("cuda")
    torch.manual_seed(0)
    base = resnet18(10).to(dev).to(memory_format=fmt).train()
    g = torch.Generator(device=dev).manual_seed(1)
    batches = [
        (
            torch.randn(128, 3, 32, 32, device=dev, generator=g).contiguous(
                memory_format=fmt
            ),
            torch.randint(0, 10, (128,), device=dev, generator=g),
        )
        for _ in range(4)
    ]
    print(torch.cuda.get_device_name(), a.config)
    models = {}
    methods = a.methods.split(",")
    for method in methods:
        for graph in (False, True):
            m = copy.deepcopy(base)
            losses, ms = train(m, method, graph, batches, a.steps, amp)
            models[(method, graph)] = m
            tag = f"{method} {'graph' if graph else 'eager'}"
            print(
                f"{tag:11s} {ms:6.2f} ms/step  loss "
                + " ".join(f"{v:.3f}" for v in losses[:: max(1, a.steps // 8)])
                + f"  last {losses[-1]:.3f}"
            )
    for method in methods:
        e, gm = models[(method, False)], models[(method, True)]
        num = (
            sum(
                float((p - q).detach().double().norm() ** 2)
                for p, q in zip(e.parameters(), gm.parameters())
            )
            ** 0.5
        )
        den = sum(float(p.detach().double().norm() ** 2) for p in e.parameters()) ** 0.5
        print(
            f"{method}: parameters eager vs graph, relative difference {num / den:.1e}"
        )


if __name__ == "__main__":
    main()
