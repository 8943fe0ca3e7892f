"""Launch ranks on one machine and check that
:class:`kwng.engine.distributed.DistributedKWNG` writes the single-process direction
(``tests/test_distributed.py`` and the book chapter :ref:`distributed`).

:func:`launch` starts ``W`` Python processes with the environment ``torchrun`` gives
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, a free ``MASTER_PORT``), each with its own
log file, and waits for all of them with a deadline: the first rank that exits with an
error, or the deadline, kills the others and raises with the failing rank's log.
Nothing hangs.

:func:`compare_directions` runs :func:`worker` on ``W`` ranks (gloo, CPU, float64): each
rank takes its shard of one global batch and makes ``steps`` KWNG steps with
:class:`~kwng.engine.distributed.DistributedKWNG` (Levenberg–Marquardt every step, so
the second step's ``ε`` depends on the global losses). The reference is one process with
:class:`kwng.KWNGPreconditioner` on the concatenated batch with the same basis (the same
generator seed: the distributed basis is rank 0's draw). For a network with batch norm
the ranks normalise with their shard's statistics, so the reference runs the forward
shard by shard in its one process (``X = cat(model(z_1), …, model(z_W))``) and builds
the mean loss over all samples from it: the same function of ``θ`` as the ranks'
together.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kwng._checks import check_choice, check_int, check_positive
from kwng.scale_switch import REPO_ROOT

__all__ = ["free_port", "launch", "worker", "compare_directions", "CASES"]

#: (network, mode) pairs of :func:`compare_directions`: an MLP and a small batch-norm
#: CNN, each on the fast path and in the reference mode
CASES = (("mlp", "fast"), ("mlp", "reference"), ("bn", "fast"), ("bn", "reference"))
_SETTINGS = {"num_basis": 3, "eps": 1e-3, "clip_norm": None}
_SEED, _BASIS_SEED = 0, 1234


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(argv: Sequence[str], world_size: int, timeout: float = 60.0,
           logdir: str | os.PathLike | None = None) -> list[str]:
    """Run ``python argv...`` as ranks ``0..world_size-1`` of one job on this machine
    and return each rank's output (stdout and stderr together).

    Raises ``RuntimeError`` naming the rank, its exit status and the end of its log when
    a rank fails, and when the job is not done after ``timeout`` seconds; the remaining
    ranks are killed first. The child processes import the same ``kwng`` as the caller.
    """
    world_size = check_int(world_size, "world_size", 1)
    timeout = check_positive(timeout, "timeout")
    logdir = Path(tempfile.mkdtemp(prefix="kwng-ranks-") if logdir is None else logdir)
    root = str(REPO_ROOT)
    path = [root, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(path)}
    procs, logs = [], []
    for r in range(world_size):
        log = open(logdir / f"rank{r}.log", "w+")  # noqa: SIM115  (closed below)
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}))
    deadline, failure = time.monotonic() + timeout, None
    try:
        while failure is None and any(p.poll() is None for p in procs):
            bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                failure = (bad[0], f"exited with status {procs[bad[0]].returncode}")
            elif time.monotonic() > deadline:
                late = [r for r, p in enumerate(procs) if p.poll() is None]
                failure = (late[0], f"still running after {timeout:g} s (ranks {late})")
            time.sleep(0.05)
        if failure is None:
            bad = [r for r, p in enumerate(procs) if p.returncode != 0]
            if bad:
                failure = (bad[0], f"exited with status {procs[bad[0]].returncode}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    if failure is not None:
        r, why = failure
        raise RuntimeError(f"rank {r} of {world_size} {why}; its log ends with:\n"
                           f"{texts[r][-3000:]}")
    return texts


def _problem(net: str, sizes: Sequence[int]):
    """The network (float64) and the global batch split into shards of ``sizes``."""
    from studies.cifar.nets import mlp, tiny_cnn

    gen = torch.Generator().manual_seed(_SEED)
    torch.manual_seed(_SEED)
    N = sum(sizes)
    if net == "mlp":
        model, z = mlp(5, 4, hidden=8, depth=2), torch.randn(N, 5, generator=gen)
    else:
        model, z = tiny_cnn(4, width=3), torch.randn(N, 3, 6, 6, generator=gen)
    y = torch.randint(0, 4, (N,), generator=gen)
    return model.double(), z.double().split(list(sizes)), y.split(list(sizes))


def _steps(precond, model, shards_z, shards_y, steps: int) -> list[dict[str, Any]]:
    """``steps`` SGD steps along the KWNG direction; the forward runs shard by shard
    (one shard on a rank, all of them in the reference)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        X = torch.cat([model(z) for z in shards_z])
        loss = F.cross_entropy(X, torch.cat(shards_y))
        info = precond.step(loss, X)
        grads = [p.grad.reshape(-1) for p in model.parameters()]
        out.append({"direction": torch.cat(grads).clone(), "eps": float(info["eps"]),
                    "ratio": float(info["reduction_ratio"])})
        opt.step()
    return out


def _run_case(net: str, mode: str, sizes: Sequence[int], steps: int,
              rank: int | None, refresh_every: int = 1) -> list[dict[str, Any]]:
    """The steps of one case on ``rank`` (``None``: the single-process reference),
    refreshing the kernel system every ``refresh_every`` steps."""
    from kwng.engine.distributed import DistributedKWNG
    from kwng.engine.lm import LMSchedule
    from kwng.engine.precond import KWNGPreconditioner

    model, zs, ys = _problem(net, sizes)
    if net == "mlp" and rank is None:
        zs, ys = [torch.cat(zs)], [torch.cat(ys)]  # no batch norm: one forward
    gen = torch.Generator().manual_seed(_BASIS_SEED)
    kw = dict(lr=0.1, generator=gen, mode=mode, eps_schedule=LMSchedule(interval=1),
              refresh_every=refresh_every, **_SETTINGS)
    if rank is None:
        precond = KWNGPreconditioner(model, **kw)
    else:
        precond = DistributedKWNG(model, batch_sizes=list(sizes), **kw)
        zs, ys = [zs[rank]], [ys[rank]]
    quiet = logging.getLogger("kwng.engine.precond")
    level = quiet.level
    if rank is None and net == "bn":  # the shard-by-shard reference takes the serial
        quiet.setLevel(logging.ERROR)  # passes on purpose: no warning about it
    try:
        return _steps(precond, model, zs, ys, steps)
    finally:
        quiet.setLevel(level)
        precond.remove_hooks()


def worker(out: str | os.PathLike, sizes: Sequence[int], steps: int,
           cases: Sequence[tuple[str, str]] = CASES, timeout: float = 60.0,
           refresh_every: int = 1) -> None:
    """One rank of :func:`compare_directions` (gloo, environment as under torchrun):
    every case's steps saved to ``out/rank<r>.pt``."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    try:
        rank = dist.get_rank()
        res = {f"{net}/{mode}": _run_case(net, mode, sizes, steps, rank, refresh_every)
               for net, mode in cases}
        torch.save(res, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def compare_directions(world_size: int = 2, sizes: Sequence[int] | None = None,
                       steps: int = 2, cases: Sequence[tuple[str, str]] = CASES,
                       timeout: float = 60.0, refresh_every: int = 1
                       ) -> list[dict[str, Any]]:
    """Run the cases on ``world_size`` ranks (shards of ``sizes``, default 6 samples
    each) and in one process, with the kernel system refreshed every
    ``refresh_every`` steps; one row per case with ``rel_err`` (the largest
    ``‖ĝ_rank − ĝ_one‖ / ‖ĝ_one‖`` over ranks and steps), ``eps_rel_err`` (the same for
    the Levenberg–Marquardt ``ε`` of each step), ``ratio_rel_err`` (the same for its
    reduction ratio ``r``, from the second step on) and ``rank_spread`` (the largest
    difference between two ranks' directions; 0 when they agree bitwise)."""
    world_size = check_int(world_size, "world_size", 1)
    sizes = ([6] * world_size if sizes is None
             else [check_int(s, "sizes", 1) for s in sizes])
    if len(sizes) != world_size:
        raise ValueError(f"sizes must hold world_size = {world_size} integers, "
                         f"got {sizes}")
    for net, mode in cases:
        check_choice(net, "network", ("mlp", "bn"))
        check_choice(mode, "mode", ("fast", "reference"))
    with tempfile.TemporaryDirectory(prefix="kwng-ddp-") as tmp:
        launch(["-m", "studies.bench.distributed_check", "--out", tmp, "--sizes",
                ",".join(map(str, sizes)), "--steps", str(steps), "--cases",
                ",".join(f"{n}/{m}" for n, m in cases), "--timeout", str(timeout),
                "--refresh-every", str(refresh_every)],
               world_size, timeout, logdir=tmp)
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world_size)]
    rows = []
    for net, mode in cases:
        ref = _run_case(net, mode, sizes, steps, None, refresh_every)
        got = [res[f"{net}/{mode}"] for res in ranks]
        pairs = [(g[s], ref[s], got[0][s]) for g in got for s in range(steps)]
        later = [(a, b) for g in got for a, b in zip(g[1:], ref[1:])]  # r from step 2
        rows.append({
            "network": net, "mode": mode, "world_size": world_size,
            "sizes": list(sizes),
            "rel_err": max(float((a["direction"] - b["direction"]).norm()
                                 / b["direction"].norm()) for a, b, _ in pairs),
            "eps_rel_err": max(abs(a["eps"] - b["eps"]) / b["eps"]
                               for a, b, _ in pairs),
            "ratio_rel_err": max((abs(a["ratio"] - b["ratio"]) / abs(b["ratio"])
                                  for a, b in later), default=0.0),
            "rank_spread": max(float((a["direction"] - z["direction"]).abs().max())
                               for a, _, z in pairs),
            "eps_changed": ref[-1]["eps"] != ref[0]["eps"]})
    return rows


def _main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m studies.bench.distributed_check")
    p.add_argument("--out", required=True)
    p.add_argument("--sizes", required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--cases", default=",".join(f"{n}/{m}" for n, m in CASES))
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--refresh-every", type=int, default=1)
    a = p.parse_args(argv)
    cases = [tuple(c.split("/")) for c in a.cases.split(",")]
    worker(a.out, [int(s) for s in a.sizes.split(",")], a.steps, cases, a.timeout,
           a.refresh_every)


if __name__ == "__main__":
    _main()
