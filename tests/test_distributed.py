"""KWNG data-parallel (:mod:`kwng.engine.distributed`): W ranks on W shards write the
direction of one process on the concatenated batch, with the same basis, to 1e-10 in
float64.

The ranks are real processes (gloo on the CPU) started by
:func:`studies.bench.distributed_check.launch` with a deadline: a rank that fails or
runs late fails the test, and the others are killed. The reference is
:class:`kwng.KWNGPreconditioner` in this process with the generator seed of rank 0
(whose draw every rank uses). With per-rank batch norm (the small CNN) each rank
normalises with its own shard's statistics; the reference reproduces that by running the
forward shard by shard in its one process, ``X = cat(model(z_1), …, model(z_W))``, and
taking the mean cross-entropy over all samples
(:func:`studies.bench.distributed_check.compare_directions`). Two steps with the
Levenberg–Marquardt rule at every step check that the rule sees the global loss (``ε``
and the reduction ratio ``r`` of the second step).
"""

from __future__ import annotations

import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kwng import KWNGPreconditioner
from kwng.engine.distributed import DistributedKWNG, bucket_size, replica_spread
from studies.bench.distributed_check import CASES, compare_directions, launch
from studies.cifar.nets import mlp

TOL = 1e-10


@pytest.mark.parametrize("world_size,sizes", [(2, None), (3, [5, 7, 6])],
                         ids=["2-equal-shards", "3-unequal-shards"])
def test_direction_of_w_ranks_is_the_single_process_direction(world_size, sizes):
    rows = compare_directions(world_size, sizes, steps=2, timeout=50)
    assert [(r["network"], r["mode"]) for r in rows] == list(CASES)
    for r in rows:
        assert r["rel_err"] <= TOL, r
        assert r["eps_rel_err"] <= TOL and r["ratio_rel_err"] <= TOL, r
        assert r["rank_spread"] == 0.0, r  # every rank writes the same bits
        assert r["eps_changed"], r  # the second step's ε really depends on the losses


def test_amortized_steps_of_w_ranks_are_the_single_process_ones():
    """refresh_every = 2 over 3 steps (refresh, cached, refresh): a step between
    refreshes reduces g and the loss only and still writes the single-process
    direction on every rank."""
    rows = compare_directions(2, None, steps=3, timeout=50, refresh_every=2)
    for r in rows:
        assert r["rel_err"] <= TOL and r["eps_rel_err"] <= TOL, r
        assert r["rank_spread"] == 0.0, r


def test_a_failing_rank_fails_fast_and_kills_the_others(tmp_path):
    code = ("import os, time; r = int(os.environ['RANK'])\n"
            "if r == 1: raise SystemExit('rank 1 gives up')\n"
            "time.sleep(60)")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 of 2 exited with status 1") as exc:
        launch(["-c", code], 2, timeout=30, logdir=tmp_path)
    assert "rank 1 gives up" in str(exc.value)
    assert time.monotonic() - t0 < 20


def test_a_late_rank_times_out(tmp_path):
    with pytest.raises(RuntimeError, match="still running after 1 s"):
        launch(["-c", "import time; time.sleep(60)"], 2, timeout=1, logdir=tmp_path)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_one_rank_is_the_plain_preconditioner(one_rank_group):
    """W = 1: the gather and the reduce are identities, the direction is the base
    class's bit for bit (same basis generator)."""
    out = []
    for cls in (KWNGPreconditioner, DistributedKWNG):
        torch.manual_seed(0)
        model = mlp(4, 3, hidden=6).double()
        z, y = torch.randn(9, 4, dtype=torch.float64), torch.arange(9) % 3
        pc = cls(model, lr=0.1, num_basis=3,
                 generator=torch.Generator().manual_seed(7))
        X = model(z)
        pc.step(F.cross_entropy(X, y), X)
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        assert replica_spread(model) == 0.0 or cls is KWNGPreconditioner
    assert torch.equal(out[0], out[1])


def test_one_rank_amortized_is_the_plain_preconditioner(one_rank_group):
    """W = 1, refresh_every = 2: the q + 1 all-reduce of a step between refreshes is
    an identity too; four steps equal the base class's bit for bit."""
    out = []
    for cls in (KWNGPreconditioner, DistributedKWNG):
        torch.manual_seed(0)
        model = mlp(4, 3, hidden=6).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        pc = cls(model, lr=0.1, num_basis=3, refresh_every=2,
                 generator=torch.Generator().manual_seed(7))
        dirs = []
        for _ in range(4):
            z = torch.randn(9, 4, dtype=torch.float64)
            opt.zero_grad()
            X = model(z)
            pc.step(F.cross_entropy(X, torch.arange(9) % 3), X)
            dirs.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            opt.step()
        out.append(torch.stack(dirs))
    assert torch.equal(out[0], out[1])


def test_arguments_are_checked(one_rank_group):
    model = mlp(4, 3, hidden=6)
    with pytest.raises(ValueError, match=r"batch_sizes must be None, an integer >= 1 "
                       r"or 1 integers"):
        DistributedKWNG(model, lr=0.1, batch_sizes=[4, 4])
    with pytest.raises(ValueError, match="batch_sizes must be"):
        DistributedKWNG(model, lr=0.1, batch_sizes=0)
    with pytest.raises(ValueError, match="broadcast must be a bool"):
        DistributedKWNG(model, lr=0.1, broadcast=1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    with pytest.raises(ValueError, match="not a DistributedDataParallel wrapper"):
        DistributedKWNG(ddp, lr=0.1)
    pc = DistributedKWNG(model, lr=0.1, num_basis=2, batch_sizes=8)
    X = model(torch.randn(5, 4))
    with pytest.raises(ValueError, match=r"rank 0's batch has 5 samples but "
                       r"batch_sizes\[0\] = 8"):
        pc.step(F.cross_entropy(X, torch.zeros(5, dtype=torch.long)), X)
    assert "world_size=1" in repr(pc) and pc.hyperparameters()["world_size"] == 1
    q = sum(p.numel() for p in model.parameters())
    assert bucket_size(5, q) == 6 * q


def test_needs_a_process_group():
    if dist.is_initialized():  # pragma: no cover
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(ValueError, match="init_process_group"):
        DistributedKWNG(mlp(4, 3), num_basis=2, eps_schedule=None)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
