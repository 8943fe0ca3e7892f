"""Does a training loop built on :func:`kwng.capture_step` train as the eager loop does?

python -m studies.bench.capture_check [--steps 40] [--config
bf16_channels_last] [--methods sgd,kwng,kfac,ekfac,ekfac_s10] [--model vit]
[--json PATH]

On a GPU, the paper's ResNet-18 (batch 128; ``--model vit``: the Vision Transformer of
:mod:`studies.cifar.vit`) is trained on four fixed random batches in
turn, each copied into the captured step's static inputs before the replay, as a real
loop would: (1) SGD eagerly and graph-captured from the same initialisation (with
``--deterministic`` cuDNN algorithms the parameters must agree bit for bit; without, two
eager runs already differ, and training on random labels amplifies it); (2) KWNG (fast
path) eagerly and graph-captured (the basis draws differ between the two, so the loss
curves are compared, not the parameters); (3) KFAC
(:class:`studies.cifar.baselines.KFACPreconditioner`, damping 1e-3, factors
refreshed every 100 steps, clip 1; needs nngeometry and ``--steps`` ≥ 250, so that the
timed loop holds two refreshes) eagerly and captured: the steps between refreshes replay
a graph, the refresh steps run eagerly (both loops draw the Monte-Carlo labels from the
same seed); (4) EKFAC likewise (eigenbasis refreshed every 100 steps, the scalings
re-estimated on every step from the step's own forward, damping 1e-3, clip 1; the same
``--steps`` bound); (5) ``ekfac_s10``, EKFAC with the scalings re-estimated every 10
steps only (two graphs between refreshes). Prints both loss curves of each method, the
parameter difference, the time per step of each loop (refresh steps included) and, for
KFAC and EKFAC, the number of eager steps in the captured loop; ``--json`` also writes
them, with their provenance, to a new file (an existing one is never overwritten).

"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch
from torch import nn

from kwng import KWNGPreconditioner, capture_step
from studies.bench.step_cost import CONFIGS
from studies.cifar.nets import NETWORKS
from studies.kit.provenance import atomic_write_json, make_provenance

__all__ = ["KFAC_STEPS", "CAPTURE_METHODS", "main", "make_loop", "train",
           "write_record"]

#: the methods the check can run
CAPTURE_METHODS = ("sgd", "kwng", "kfac", "ekfac", "ekfac_s10")
#: per (E)KFAC method, its preconditioner's kind and the steps between re-estimates of
#: EKFAC's scalings
_DIAG_FREQ = {"kfac": ("kfac", 1), "ekfac": ("ekfac", 1), "ekfac_s10": ("ekfac", 10)}
#: the fewest timed steps of a KFAC or EKFAC check (two refreshes at update_freq 100)
KFAC_STEPS = 250


def make_loop(model, method, amp, static_z, static_y):
    """The step of ``method`` (one of :data:`CAPTURE_METHODS`) on the static inputs,
    the list
    its losses go to (device tensors) and its preconditioner (``None`` for SGD)."""
    if method not in CAPTURE_METHODS:
        raise ValueError(f"method must be one of {CAPTURE_METHODS}, got {method!r}")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    pc = None
    if method == "kwng":
        pc = KWNGPreconditioner(model, lr=0.05, num_basis=5, eps=1e-3)
    elif method in _DIAG_FREQ:
        from studies.cifar.baselines import KFACPreconditioner

        kind, diag_freq = _DIAG_FREQ[method]
        pc = KFACPreconditioner(model, kind=kind, damping=1e-3, update_freq=100,
                                diag_freq=diag_freq, clip_norm=1.0)
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
        elif method in _DIAG_FREQ:
            pc.step(loss, X, inputs=static_z)
        else:
            pc.step(loss, X)
        opt.step()
        losses.append(loss.detach())  # a device tensor: no host sync

    return step, losses, pc


def train(model, method, graph, batches, steps, amp):
    """``steps`` steps over ``batches`` after 3 warm-up steps on the first batch (those
    of :func:`kwng.capture_step`, run eagerly too so that both loops take the same
    number of steps); returns the losses, the ms per step and the number of timed steps
    that ran eagerly (all of them in the eager loop; (E)KFAC's refreshes when
    captured)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    torch.manual_seed(2)  # the same Monte-Carlo labels ((E)KFAC) in both loops
    static_z, static_y = (t.clone() for t in batches[0])
    step, losses, pc = make_loop(model, method, amp, static_z, static_y)
    if graph:
        run = capture_step(step, warmup=3, preconditioner=pc)
        static_loss = losses[-1]  # the tensor every replay rewrites
    else:
        for _ in range(3):
            step()
        run = step
    losses.clear()
    eager = 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        z, y = batches[i % len(batches)]
        static_z.copy_(z)
        static_y.copy_(y)
        n = len(losses)
        run()
        if len(losses) == n:  # a replay ran no Python: read the graph's loss
            losses.append(static_loss.clone())
        else:
            eager += 1
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - t0) / steps
    return [float(v) for v in losses], ms, eager


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--config", default="bf16_channels_last", choices=list(CONFIGS))
    p.add_argument("--model", default="resnet18", choices=("resnet18", "vit"))
    p.add_argument("--methods", default="sgd,kwng",
                   help=f"comma-separated, of {','.join(CAPTURE_METHODS)}")
    p.add_argument(
        "--no-tf32", action="store_true", help="fp32 convolutions in full fp32"
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic cuDNN algorithms (else two eager runs differ too)",
    )
    p.add_argument("--json", default=None,
                   help="write the rows and their provenance to this new file")
    a = p.parse_args(argv)
    if a.json is not None and Path(a.json).exists():
        p.error(f"--json {a.json} exists; results are never overwritten")
    a.methods = a.methods.split(",")
    if any(m not in CAPTURE_METHODS for m in a.methods):
        p.error(f"--methods must name methods of {CAPTURE_METHODS}, got {a.methods}")
    if set(_DIAG_FREQ) & set(a.methods) and a.steps < KFAC_STEPS:
        p.error(f"--steps must be >= {KFAC_STEPS} with kfac or ekfac (two refreshes), "
                f"got {a.steps}")
    return a


def main() -> None:
    a = _args()
    methods = a.methods
    if a.no_tf32:
        torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = a.deterministic
    prec, fmt = CONFIGS[a.config]
    amp = None if prec == torch.float32 else prec
    torch.backends.cudnn.benchmark = not a.deterministic  # the capture searches none
    dev = torch.device("cuda")
    torch.manual_seed(0)
    base = NETWORKS[a.model](10).to(dev).to(memory_format=fmt).train()
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
    models, rows, diffs = {}, [], {}
    for method in methods:
        for graph in (False, True):
            m = copy.deepcopy(base)
            losses, ms, eager = train(m, method, graph, batches, a.steps, amp)
            models[(method, graph)] = m
            rows.append({"method": method, "loop": "graph" if graph else "eager",
                         "ms_per_step": ms, "eager_steps": eager if graph else None,
                         "loss_last": losses[-1],
                         "loss_mean": sum(losses) / len(losses)})
            tag = f"{method} {'graph' if graph else 'eager'}"
            print(
                f"{tag:11s} {ms:6.2f} ms/step  loss "
                + " ".join(f"{v:.3f}" for v in losses[:: max(1, a.steps // 8)])
                + f"  last {losses[-1]:.3f}  mean {sum(losses) / len(losses):.4f}"
                + (f"  eager steps {eager}/{a.steps}" if graph else "")
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
        diffs[method] = num / den
        print(
            f"{method}: parameters eager vs graph, relative difference {num / den:.1e}"
        )
    if a.json is not None:
        write_record(a.json, rows, diffs, {"config": a.config, "steps": a.steps,
                                           "model": a.model,
                                           "methods": methods,
                                           "deterministic": a.deterministic,
                                           "tf32": not a.no_tf32})


def write_record(path: str, rows: list[dict], diffs: dict[str, float],
                 config: dict) -> dict:
    """Write the check's ``rows`` (one per method and loop: ms per step, eager steps of
    the captured loop, last and mean loss), the eager-vs-graph parameter differences
    and the provenance to the new file ``path``; return the record."""
    if Path(path).exists():
        raise FileExistsError(f"path {path} exists; results are never overwritten")
    record = {"rows": rows, "relative_difference": diffs,
              "provenance": make_provenance(config, seeds={"torch": 0, "batches": 1},
                                            device="cuda")}
    atomic_write_json(path, record)
    return record


if __name__ == "__main__":
    main()
