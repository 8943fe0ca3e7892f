"""Ranks of one :class:`kwng.engine.distributed.DistributedKWNG` job agree or stop: at
construction every rank raises naming the first setting or model entry in which a rank
differs from rank 0, and ``num_basis`` is checked against the global batch (not the
shard). Real gloo ranks on the CPU, started by
:func:`studies.bench.distributed_check.launch`.
"""

from __future__ import annotations

import json

import pytest
import torch

from studies.bench.distributed_check import compare_directions, launch

#: case -> (what rank 1 changes, the words the error must contain)
CASES = {
    "eps": ({"eps": 1e-3}, "eps: 1e-05 on rank 0 but 0.001 on rank 1"),
    "damping": ({"damping": "T"}, "damping: 'T_tilde' on rank 0 but 'T' on rank 1"),
    "lr": ({"lr": 0.5}, "lr: 0.1 on rank 0 but 0.5 on rank 1"),
    "activation": ({"act": "Tanh"}, "module 1: ReLU() on rank 0 but Tanh() on rank 1"),
    "num_basis": ({"num_basis": 3}, "num_basis: 2 on rank 0 but 3 on rank 1"),
    "parameter count": ({"depth": 2}, "trainable parameters: 4 tensors"),
    "dtype": ({"dtype": "float32"}, "torch.float64, on cpu on rank 0 but shape (6, 4), "
              "torch.float32"),
    "batch_sizes": ({"batch_sizes": 5}, "batch_sizes: [4, 4] on rank 0 but [5, 5]"),
}

WORKER = """
import datetime, json, sys
import torch, torch.distributed as dist
from torch import nn
from kwng.engine.distributed import DistributedKWNG

def build(act="ReLU", depth=1, dtype="float64", batch_sizes=4, **kw):
    torch.manual_seed(0)
    layers, c = [], 4
    for _ in range(depth):
        layers += [nn.Linear(c, 6), getattr(nn, act)()]
        c = 6
    model = nn.Sequential(*layers, nn.Linear(c, 3)).to(getattr(torch, dtype))
    hp = {"lr": 0.1, "num_basis": 2, "eps": 1e-5, **kw}
    return model, DistributedKWNG(model, batch_sizes=batch_sizes, **hp)

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
rank, out = dist.get_rank(), {}
for name, change in json.loads(sys.argv[1]).items():
    try:
        build(**(change if rank == 1 else {}))
        out[name] = "accepted"
    except ValueError as e:
        out[name] = str(e)
model, pc = build(num_basis=9)  # 8 samples in all
X = model(torch.randn(4, 4, dtype=torch.float64))
try:
    pc.step(X.square().mean(), X)
except ValueError as e:
    out["global batch"] = str(e)
print("RESULT " + json.dumps(out))
dist.destroy_process_group()
"""


def _results(texts: list[str]) -> list[dict[str, str]]:
    return [json.loads(t.split("RESULT ", 1)[1].splitlines()[0]) for t in texts]


def test_ranks_that_differ_stop_on_every_rank_naming_the_difference(tmp_path):
    changes = {k: v[0] for k, v in CASES.items()}
    ranks = _results(launch(["-c", WORKER, json.dumps(changes)], 2, timeout=90,
                            logdir=tmp_path))
    for name, (_, words) in CASES.items():
        for r, res in enumerate(ranks):
            assert "the ranks disagree on" in res[name], (name, r, res[name])
            assert words in res[name], (name, r, res[name])
    for res in ranks:
        assert "the global batch has 8 samples but num_basis = 9" in res["global batch"]


@pytest.mark.parametrize("mode", ["fast", "reference"])
def test_num_basis_beyond_the_shard_within_the_global_batch(mode):
    """M = 3 with shards of 2 samples (4 in all): accepted, and the direction is the
    single-process one on the concatenated batch."""
    rows = compare_directions(2, [2, 2], steps=1, cases=[("mlp", mode)], timeout=60)
    assert rows[0]["rel_err"] <= 1e-10 and rows[0]["rank_spread"] == 0.0, rows


def test_fingerprint_lists_settings_parameters_and_modules(tmp_path):
    import torch.distributed as dist

    from kwng.engine.distributed import DistributedKWNG, fingerprint

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}",
                            rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU())
        keys = dict(fingerprint(DistributedKWNG(model, lr=0.1, num_basis=2)))
    finally:
        dist.destroy_process_group()
    assert keys["num_basis"] == "2" and keys["lr"] == "0.1"
    assert keys["parameter 0.weight"] == "shape (3, 2), torch.float32, on cpu"
    assert keys["module 1"] == "ReLU()"
